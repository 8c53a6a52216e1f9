"""JAX adapter: a loader's batches as jax arrays, placed on devices ahead of the training step.

:func:`to_jax` (``loader.to_jax()``) puts each batch with ``jax.device_put`` (or, with a
sharding over several processes, ``jax.make_array_from_process_local_data``) and keeps
``prefetch_to_device`` batches in flight beyond the one the user holds: ``device_put``
returns at once and copies asynchronously, so the next batches travel while the step
runs. On the CPU backend JAX may alias stoker's page-aligned buffers instead of copying;
that is safe, since JAX keeps the numpy array alive and stoker never rewrites a buffer
while an array on it is alive.

Each batch carries the loader position it was taken at; ``state_dict()`` saves the
position of the last batch handed to the user, not of the batches prefetched, so resume
is exact.

JAX is imported here only: ``import stoker`` needs numpy alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from .errors import SpecError
from .loader import UserPosition
from .order import shard_from_rank

if TYPE_CHECKING:
    from .loader import Loader

__all__ = ["JaxLoader", "shard_from_jax", "to_jax"]

JaxBatch = dict[str, jax.Array]


def shard_from_jax() -> tuple[int, int]:
    """``(jax.process_index(), jax.process_count())``: this process's shard of a multi-host job.

    Example:
        >>> loader = ds.loader(256, shard=stoker.jax.shard_from_jax())  # doctest: +SKIP
    """
    return shard_from_rank(jax.process_index(), jax.process_count())


def to_jax(loader: Loader, sharding: Any = None, prefetch_to_device: int = 2) -> JaxLoader:
    """The loader's batches as dicts of jax arrays; see :class:`JaxLoader`.

    Args:
        loader: a stoker Loader (``ds.loader(...)``); its batches are this process's.
        sharding: None (JAX's default device), a ``jax.sharding.Sharding`` (e.g. a
            ``NamedSharding`` over the batch axis) for every field, or ``{field: Sharding}``.
            With several processes each loader's batch is the process-local part of a
            global array (``make_array_from_process_local_data``): give each process
            its shard, e.g. ``shard=stoker.jax.shard_from_jax()``.
        prefetch_to_device: batches put on the device ahead of the one being used.

    Example:
        >>> mesh = jax.make_mesh((jax.device_count(),), ("batch",))  # doctest: +SKIP
        >>> data = NamedSharding(mesh, PartitionSpec("batch"))  # doctest: +SKIP
        >>> for batch in ds.loader(256, drop_remainder=True).to_jax(sharding=data):  # doctest: +SKIP
        ...     state = train_step(state, batch["image"], batch["label"])
    """
    return JaxLoader(loader, sharding=sharding, prefetch_to_device=prefetch_to_device)


def _shardings(loader: Loader, sharding: Any) -> dict[str, Any]:
    names = list(loader.dtypes)
    if sharding is None:
        return dict.fromkeys(names)
    if isinstance(sharding, Mapping):
        unknown = [k for k in sharding if k not in loader.dtypes]
        if unknown:
            raise SpecError(f"sharding names unknown field(s) {unknown}; fields are {names}", field=str(unknown[0]))
        chosen = {n: sharding.get(n) for n in names}
    else:
        chosen = dict.fromkeys(names, sharding)
    for name, s in chosen.items():
        if s is not None and not isinstance(s, jax.sharding.Sharding):
            raise SpecError(f"sharding for field {name!r}: {s!r} is not a jax.sharding.Sharding", field=name)
    return chosen


class JaxLoader(UserPosition):
    """An iterable of dicts of jax arrays over a stoker Loader, prefetched to the device.

    Each ``iter()`` starts a new pass of the loader. ``state_dict()`` is the position after
    the last batch this object returned (prefetched batches are not counted).
    ``close()`` closes the loader too; a context manager.
    """

    def __init__(self, loader: Loader, *, sharding: Any = None, prefetch_to_device: int = 2) -> None:
        if isinstance(prefetch_to_device, bool) or not isinstance(prefetch_to_device, int) or prefetch_to_device < 0:
            raise SpecError(f"prefetch_to_device={prefetch_to_device!r} must be a non-negative integer")
        self.loader = loader
        self.sharding = _shardings(loader, sharding)
        self.prefetch_to_device = prefetch_to_device
        self._multiprocess = jax.process_count() > 1
        self._position = loader.position

    def __len__(self) -> int:
        return len(self.loader)

    def _put(self, batch: Mapping[str, np.ndarray]) -> JaxBatch:
        if all(s is None for s in self.sharding.values()):  # the per-field test below, for every field
            # One call for the whole batch: device_put's Python costs ~50 us a call, per call
            # rather than per array (W1's two fields: ~57-95 us a batch by field, ~51 in one).
            return cast(JaxBatch, jax.device_put(dict(batch)))
        out: JaxBatch = {}
        for name, array in batch.items():
            s = self.sharding.get(name)
            if s is None:
                out[name] = jax.device_put(array)
            elif self._multiprocess:
                out[name] = jax.make_array_from_process_local_data(s, array)
            else:
                out[name] = jax.device_put(array, s)
        return out

    def __iter__(self) -> Iterator[JaxBatch]:
        return self._batches(iter(self.loader))

    def _batches(self, it: Iterator[dict[str, np.ndarray]]) -> Iterator[JaxBatch]:
        loader = self.loader
        ahead: deque[tuple[JaxBatch, tuple[int, int]]] = deque()
        try:
            exhausted = False
            while True:
                while not exhausted and len(ahead) <= self.prefetch_to_device:
                    batch = next(it, None)
                    if batch is None:
                        exhausted = True
                        break
                    ahead.append((self._put(batch), loader.position))
                    del batch
                if not ahead:
                    return
                arrays, position = ahead.popleft()
                self._position = position
                yield arrays
                del arrays
        finally:
            ahead.clear()
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def close(self) -> None:
        """Stop the loader's threads and close its files; idempotent."""
        self.loader.close()

    def __enter__(self) -> JaxLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"JaxLoader({self.loader!r}, prefetch_to_device={self.prefetch_to_device})"
