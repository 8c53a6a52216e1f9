"""Keras 3 adapter: a loader as a `keras.utils.PyDataset`, so `model.fit` runs on any backend.

`to_keras` hands Keras the loader's batches in the loader's order, as `(x, y)` or
`(x, y, sample_weight)` tuples of numpy arrays (the backend moves them to its device), on the
TensorFlow, JAX and PyTorch backends alike.

Keras indexes a PyDataset batch by batch and starts again at index 0 whenever it begins a new
pass over it: at each Keras epoch, and before training to learn the batches' shapes (JAX and
PyTorch read batch 0 to build the model, TensorFlow batches 0 and 1 to type its tf.data
generator). The adapter answers as a sequence over the loader's current epoch would:

- Index `i` is batch `i` of the loader's current epoch, and asking for it again gives the same
  batch. A pass that starts over before the epoch's end (the shape reads, or a `fit` or
  `evaluate` cut short by `steps_per_epoch`/`steps` and called again) gets the same epoch from
  its first batch: the epoch's first two batches are kept for this, and further in the loader
  restarts the epoch from its saved state.
- Once a Keras epoch has taken the epoch's last batch, the next pass gets the loader's next
  epoch, so each Keras epoch gets a new order where the loader shuffles (unless
  `reshuffle_each_iteration=False`). `fit(steps_per_epoch=k)` with `k` under `len(loader)` goes
  on where the last Keras epoch stopped, as Keras asks, and so reads each epoch once over
  several Keras epochs. Indexing the dataset yourself, outside `fit`/`evaluate`/`predict`,
  never moves it on to the next epoch. With a one-batch epoch the JAX and PyTorch build's
  read of batch 0 cannot be told from a whole epoch: the loader's first epoch is then skipped
  (each Keras epoch still gets every record once).
- `pad_last=True` batches carry a `__valid__` field that is False on padding rows; pass
  `sample_weight="__valid__"` to leave them out of the loss and metrics, and keep
  `predictions[:len(dataset)]` (padding fills the end of the last batch).

Limits, each refused with a SpecError naming the fix rather than worked around:

- Keras must ask for the batches in order: pass `fit(..., shuffle=False)` (Keras shuffles a
  PyDataset's batch order by default). Shuffle with the loader instead
  (`shuffle="global"` or `"files"` and a seed).
- Keras' own workers must stay off (`workers=1`, no multiprocessing, which this adapter
  sets): stoker's threads already prepare batches ahead.
- Batches are numpy arrays on the host: no zero-copy handoff to the device here (see
  `stoker.jax` and `stoker.torch` for training loops of your own, and `loader.to_tf()`, which
  is zero-copy, on the TensorFlow backend).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import SpecError

if TYPE_CHECKING:
    from .loader import Loader

__all__ = ["to_keras"]

Names = str | Sequence[str]
Batch = dict[str, np.ndarray]

# Batches of each epoch kept for Keras to ask again: TensorFlow's signature reads two.
HEAD = 2


def to_keras(loader: Loader, x: Names, y: Names | None = None, *, sample_weight: str | None = None) -> Any:
    """`loader` as a `keras.utils.PyDataset` of `(x, y[, sample_weight])` batches.

    Args:
        loader: a stoker Loader; its `len()` batches make one Keras epoch.
        x: a field name (its array), or a list of names (a dict of arrays, for a model with
            named inputs).
        y: the same for the targets (named outputs); None: inputs only (`predict`).
        sample_weight: a field giving each record's weight in the loss (`"__valid__"` on a
            `pad_last=True` loader leaves the padding rows out).

    Example:
        >>> import stoker.keras  # doctest: +SKIP
        >>> loader = ds.loader(256, cast={"image": "float32"}, shuffle="global", seed=0)  # doctest: +SKIP
        >>> model.fit(stoker.keras.to_keras(loader, "image", "label"), epochs=3, shuffle=False)  # doctest: +SKIP
    """
    fields = set(loader.dtypes)
    for role, names in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        for name in [] if names is None else [names] if isinstance(names, str) else list(names):
            if name not in fields:
                raise SpecError(
                    f"to_keras {role}={name!r} is not a field of the loader's batches; they hold {sorted(fields)}"
                )
    if sample_weight is not None and y is None:
        raise SpecError("to_keras sample_weight= needs y=: Keras takes (x, y, sample_weight)")
    return _adapter_class()(loader, x, y, sample_weight)


def _pick(batch: Batch, names: Names) -> Any:
    return batch[names] if isinstance(names, str) else {n: batch[n] for n in names}


class _EpochCursor:
    """The loader's current epoch as Keras indexes it: in order, from 0 again at each new pass.

    Keras' calls come from its training thread and, on TensorFlow, from a tf.data thread:
    `serve` and the epoch hooks take one lock.
    """

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.batches = len(loader)
        self._lock = threading.Lock()
        self._stream: Iterator[Batch] | None = None  # the loader's batches, pass after pass
        self._head: list[Batch] = []  # the epoch's first HEAD batches, for a pass that starts over
        self._after_head: dict[str, Any] | None = None  # the loader's state after them
        self._taken = 0  # batches of the current epoch taken from the loader
        self._next = 0  # the index the current pass asks for next
        self._last: tuple[int, Batch] | None = None  # the batch served last, for a repeated request
        self._in_epoch = False  # between Keras' on_epoch_begin and on_epoch_end
        self._counted = False  # the current pass began inside a Keras epoch (not a shape read)

    def epoch_begins(self) -> None:
        with self._lock:
            self._in_epoch = True

    def epoch_ends(self) -> None:
        with self._lock:
            self._in_epoch = False

    def serve(self, index: int) -> Batch:
        with self._lock:
            if index == 0:
                if self._next == self.batches and self._counted:  # a Keras epoch took it all: the next one
                    self._head, self._after_head, self._taken, self._last = [], None, 0, None
                self._next, self._counted = 0, self._in_epoch
            elif self._last is not None and index == self._last[0]:
                return self._last[1]
            if index != self._next or index >= self.batches:
                raise SpecError(
                    f"stoker.keras serves the loader's batches in order, and Keras asked for batch {index} where "
                    f"{self._next} comes next (of {self.batches}): pass fit(..., shuffle=False) and shuffle with "
                    "the loader (shuffle='global' or 'files', seed=...)"
                )
            batch = self._batch(index)
            self._next, self._last = index + 1, (index, batch)
            return batch

    def _batch(self, index: int) -> Batch:
        if index < len(self._head):
            return self._head[index]
        if index < self._taken:  # a pass started over past the kept batches: restart the epoch there
            assert self._after_head is not None
            self.loader.load_state_dict(self._after_head)
            self._stream, self._taken = iter(self.loader), index
        batch = self._take()
        self._taken += 1
        if index < HEAD:
            self._head.append(batch)
            if index == HEAD - 1:
                self._after_head = self.loader.state_dict()
        return batch

    def _take(self) -> Batch:
        if self._stream is not None:
            try:
                return next(self._stream)
            except StopIteration:
                pass
        self._stream = iter(self.loader)  # the loader's epochs ran out: a new pass
        try:
            return next(self._stream)
        except StopIteration:
            raise SpecError("stoker.keras: the loader yields no batch (an empty dataset or shard)") from None


@functools.cache
def _adapter_class() -> type:
    """The PyDataset subclass, made on first use so that importing stoker.keras needs no Keras."""
    import keras

    class LoaderPyDataset(keras.utils.PyDataset):
        """A stoker Loader's epochs, one per Keras epoch, indexed as Keras asks (see stoker.keras)."""

        def __init__(self, loader: Loader, x: Names, y: Names | None, sample_weight: str | None) -> None:
            super().__init__(workers=1, use_multiprocessing=False)
            self.loader = loader
            self.x, self.y, self.sample_weight = x, y, sample_weight
            self._cursor = _EpochCursor(loader)

        @property
        def num_batches(self) -> int:
            return self._cursor.batches

        def __len__(self) -> int:
            return self._cursor.batches

        def on_epoch_begin(self) -> None:
            self._cursor.epoch_begins()

        def on_epoch_end(self) -> None:
            self._cursor.epoch_ends()

        def __getitem__(self, index: int) -> tuple[Any, ...]:
            batch = self._cursor.serve(index)
            out: tuple[Any, ...] = (_pick(batch, self.x),)
            if self.y is not None:
                out += (_pick(batch, self.y),)
            if self.sample_weight is not None:
                out += (batch[self.sample_weight],)
            return out

    return LoaderPyDataset
