"""Keras 3 adapter: a loader as a `keras.utils.PyDataset`, so `model.fit` runs on any backend.

`loader.to_tf()` needs TensorFlow; Keras 3 on the JAX or PyTorch backend takes a PyDataset
instead, which it indexes batch by batch. `to_keras` hands it the loader's batches in
the loader's order, as `(x, y)` or `(x, y, sample_weight)` tuples of numpy arrays (the
backend moves them to its device).

Limits, each refused with a SpecError naming the fix rather than worked around:

- Keras must ask for the batches in order: pass `fit(..., shuffle=False)` (Keras shuffles a
  PyDataset's batch order by default). Shuffle with the loader instead
  (`shuffle="global"` or `"files"` and a seed).
- Keras' own workers must stay off (`workers=1`, no multiprocessing, which this adapter
  sets): stoker's threads already prepare batches ahead.
- A Keras epoch is one epoch of the loader (`len(loader)` batches); the adapter reads the
  loader's epochs one after the other, and where a pass ends it starts the loader's next pass,
  which goes on with the next epochs: each Keras epoch gets a new order where the loader
  shuffles (unless `reshuffle_each_iteration=False`).
- Batches are numpy arrays on the host: no zero-copy handoff to the device here (see
  `stoker.jax` and `stoker.torch` for training loops of your own).
- On the TensorFlow backend use `loader.to_tf()`: Keras reads a PyDataset's first batches
  there to learn their shapes, which an in-order reader would take from training.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import SpecError

if TYPE_CHECKING:
    from .loader import Loader

__all__ = ["to_keras"]

Names = str | Sequence[str]


def to_keras(loader: Loader, x: Names, y: Names | None = None, *, sample_weight: str | None = None) -> Any:
    """`loader` as a `keras.utils.PyDataset` of `(x, y[, sample_weight])` batches.

    Args:
        loader: a stoker Loader; its `len()` batches make one Keras epoch.
        x: a field name (its array), or a list of names (a dict of arrays, for a model with
            named inputs).
        y: the same for the targets (named outputs); None: inputs only (`predict`).
        sample_weight: a field giving each record's weight in the loss.

    Example:
        >>> import stoker.keras  # doctest: +SKIP
        >>> loader = ds.loader(256, epochs=None, cast={"image": "float32"}, shuffle="global", seed=0)  # doctest: +SKIP
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


def _pick(batch: dict[str, np.ndarray], names: Names) -> Any:
    return batch[names] if isinstance(names, str) else {n: batch[n] for n in names}


@functools.cache
def _adapter_class() -> type:
    """The PyDataset subclass, made on first use so that importing stoker.keras needs no Keras."""
    import keras

    class LoaderPyDataset(keras.utils.PyDataset):
        """A stoker Loader read in order, one Keras epoch per loader epoch."""

        def __init__(self, loader: Loader, x: Names, y: Names | None, sample_weight: str | None) -> None:
            super().__init__(workers=1, use_multiprocessing=False)
            self.loader = loader
            self.x, self.y, self.sample_weight = x, y, sample_weight
            self._batches: Iterator[dict[str, np.ndarray]] | None = None
            self._next = 0  # the index Keras must ask for next

        @property
        def num_batches(self) -> int:
            return len(self.loader)

        def __len__(self) -> int:
            return len(self.loader)

        def __getitem__(self, index: int) -> tuple[Any, ...]:
            if index == 0 and self._next != 0:  # an epoch left early (steps_per_epoch): the next one
                self._next = 0
            if index != self._next:
                raise SpecError(
                    f"stoker.keras serves the loader's batches in order, and Keras asked for batch {index} where "
                    f"{self._next} comes next: pass fit(..., shuffle=False) and shuffle with the loader "
                    "(shuffle='global' or 'files', seed=...)"
                )
            batch = self._take()
            self._next = (index + 1) % len(self.loader)
            out: tuple[Any, ...] = (_pick(batch, self.x),)
            if self.y is not None:
                out += (_pick(batch, self.y),)
            if self.sample_weight is not None:
                out += (batch[self.sample_weight],)
            return out

        def _take(self) -> dict[str, np.ndarray]:
            if self._batches is not None:
                try:
                    return next(self._batches)
                except StopIteration:
                    pass
            self._batches = iter(self.loader)  # the loader's epochs ran out: a new pass
            try:
                return next(self._batches)
            except StopIteration:
                raise SpecError("stoker.keras: the loader yields no batch (an empty dataset or shard)") from None

    return LoaderPyDataset
