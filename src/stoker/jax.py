"""JAX adapter: a loader's batches as jax arrays, placed on devices ahead of the training step.

`to_jax` (`loader.to_jax()`) puts each batch on the device as `jax.device_put`
does (in one process by the C++ call under it, see `_DirectPut`; with a sharding over
several processes by `jax.make_array_from_process_local_data`) and keeps
`prefetch_to_device` batches in flight beyond the one the user holds: the put
returns at once and copies asynchronously, so the next batches travel while the step
runs. On the CPU backend JAX may alias stoker's page-aligned buffers instead of copying;
that is safe, since JAX keeps the numpy array alive and stoker never rewrites a buffer
while an array on it is alive.

Each batch carries the loader position it was taken at; `state_dict()` saves the
position of the last batch handed to the user, not of the batches prefetched, so resume
is exact.

JAX is imported here only: `import stoker` needs numpy alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from .errors import SpecError
from .loader import UserPosition
from .plan.order import shard_from_rank

# What jax.device_put runs for a host array once its Python is done: one C++ call that places
# the array on a device (on the CPU, aliases it). See _DirectPut. Internal to JAX (checked on
# the version constraints/ci.txt pins); a JAX that moves any of it gets jax.device_put.
try:
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src.interpreters import pxla as _pxla
    from jax._src.lib import xla_client as _xc

    _batched_device_put = _xc.batched_device_put
    _default_device = _pxla.get_default_device
    _typeof = _core.typeof
    _update_dp_aval = _dispatch.update_dp_aval
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX installed; tests force the path
    _batched_device_put = None

if TYPE_CHECKING:
    from .loader import Loader

__all__ = ["JaxLoader", "shard_from_jax", "to_jax"]

JaxBatch = dict[str, jax.Array]


def shard_from_jax() -> tuple[int, int]:
    """`(jax.process_index(), jax.process_count())`: this process's shard of a multi-host job.

    Example:
        >>> loader = ds.loader(256, shard=stoker.jax.shard_from_jax())
    """
    return shard_from_rank(jax.process_index(), jax.process_count())


def to_jax(loader: Loader, sharding: Any = None, prefetch_to_device: int = 2) -> JaxLoader:
    """The loader's batches as dicts of jax arrays; see `JaxLoader`.

    Args:
        loader: a stoker Loader (`ds.loader(...)`); its batches are this process's.
        sharding: None (JAX's default device), a `jax.sharding.Sharding` (e.g. a
            `NamedSharding` over the batch axis) for every field, or `{field: Sharding}`.
            With several processes each loader's batch is the process-local part of a
            global array (`make_array_from_process_local_data`): give each process
            its shard, e.g. `shard=stoker.jax.shard_from_jax()`.
        prefetch_to_device: batches put on the device ahead of the one being used.

    Example:
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> mesh = jax.make_mesh((jax.device_count(),), ("batch",))
        >>> data = NamedSharding(mesh, PartitionSpec("batch"))
        >>> state = None  # the model's
        >>> for batch in ds.loader(256, drop_remainder=True).to_jax(sharding=data):
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

    Each `iter()` starts a new pass of the loader. `state_dict()` is the position after
    the last batch this object returned (prefetched batches are not counted).
    `close()` closes the loader too; a context manager.
    """

    def __init__(self, loader: Loader, *, sharding: Any = None, prefetch_to_device: int = 2) -> None:
        if isinstance(prefetch_to_device, bool) or not isinstance(prefetch_to_device, int) or prefetch_to_device < 0:
            raise SpecError(f"prefetch_to_device={prefetch_to_device!r} must be a non-negative integer")
        self.loader = loader
        self.sharding = _shardings(loader, sharding)
        self.prefetch_to_device = prefetch_to_device
        self._multiprocess = jax.process_count() > 1
        self._position = loader.position
        self._direct = _DirectPut(self.sharding, self._multiprocess) if _batched_device_put is not None else None

    def __len__(self) -> int:
        return len(self.loader)

    def _put(self, batch: Mapping[str, np.ndarray]) -> JaxBatch:
        if self._direct is not None and self._direct.usable:
            return self._direct(batch, self._put_by_jax)
        return self._put_by_jax(batch)

    def _put_by_jax(self, batch: Mapping[str, np.ndarray]) -> JaxBatch:
        """The batch placed by JAX's public calls: what `_DirectPut` does faster and is checked against."""
        if all(self.sharding.get(name) is None for name in batch):  # the per-field test below, for every field
            # One call for the whole batch: device_put's Python costs per call rather than per
            # array.
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
        it = iter(self.loader)
        self._position = self.loader.position  # the new pass's start, until its first batch
        return self._batches(it)

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
                    self._position = loader.position  # the pass ended: the next one's start
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


# Dtypes JAX narrows unless jax_enable_x64 is on (int64 -> int32, ...): always jax.device_put's,
# which converts them, so a setting changed mid-run is followed.
_X64_DEPENDENT = frozenset(np.dtype(t) for t in (np.int64, np.uint64, np.float64, np.complex128))


class _DirectPut:
    """A batch placed as `jax.device_put` places it, by the C++ call device_put ends in.

    `jax.device_put` spends tens of microseconds of Python an array (pytree flattening,
    resolving the sharding, layout and copy semantics, dispatch) before the C++ call that places
    it, and all of it holds the GIL that stoker's workers need between their copies. This makes
    that call itself, with what device_put computes first computed the same way and kept per
    shape, dtype and sharding: the array's abstract value, the devices and the slice of the
    array each gets (measured: benchmarks/results/torch_jax_history.md).

    A field without a sharding goes to JAX's default device, uncommitted (as `device_put(x)`);
    one with a sharding is committed to it. The first array of each shape, dtype and sharding
    (a pass's first batch, its shorter last one) is also placed by JAX's public calls and
    compared (type, abstract value, sharding, committed, bytes); on any difference, or any error
    before that, the loader uses those calls from then on and that batch is the one they made
    (where they raise, as for a batch a sharding cannot split evenly, that error is raised).
    Left to them always: across processes (`make_array_from_process_local_data`),
    the dtypes JAX narrows without x64 (int64, float64, ...: `__group__` and `__index__`),
    and anything not a numpy array.
    """

    def __init__(self, shardings: Mapping[str, Any], multiprocess: bool) -> None:
        self.usable = True
        self._shardings = shardings
        self._multiprocess = multiprocess
        # (shape, dtype, sharding or default device) -> what the call needs, or None: by JAX's calls
        self._plans: dict[tuple[Any, ...], tuple[Any, Any, list[Any], list[Any] | None, bool] | None] = {}
        self._checked: set[tuple[Any, ...]] = set()  # plans whose first arrays matched JAX's

    def __call__(
        self, batch: Mapping[str, np.ndarray], by_jax: Callable[[Mapping[str, np.ndarray]], JaxBatch]
    ) -> JaxBatch:
        out: JaxBatch = {}
        rest: dict[str, Any] = {}
        fresh: dict[str, tuple[Any, ...]] = {}  # fields placed by a plan not checked yet
        default: Any = None  # JAX's default device, looked up once a batch where a field needs it
        try:
            for name, x in batch.items():
                given = self._shardings.get(name)
                if given is None and default is None:
                    default = _default_device()
                key, plan = self._plan(x, given, default)
                if plan is None:
                    rest[name] = x
                    continue
                if key not in self._checked:
                    fresh[name] = key
                aval, sharding, devices, index, committed = plan
                shards = [x] * len(devices) if index is None else [x[i] for i in index]
                out[name] = _batched_device_put(aval, sharding, shards, devices, committed)
        except Exception:
            if not fresh:
                raise
            self.usable = False  # this JAX's call differs from what we know: JAX's public calls
            return by_jax(batch)
        if rest:
            out.update(by_jax(rest))
        if fresh:
            expected = by_jax({name: batch[name] for name in fresh})
            if all(_same(out[name], a) for name, a in expected.items()):
                self._checked.update(fresh.values())
            else:
                self.usable = False
                out.update(expected)
        return {name: out[name] for name in batch}

    def _plan(
        self, x: Any, given: Any, default: Any
    ) -> tuple[tuple[Any, ...], tuple[Any, Any, list[Any], list[Any] | None, bool] | None]:
        if type(x) is not np.ndarray or x.dtype in _X64_DEPENDENT:
            return (), None
        if given is not None and self._multiprocess:
            return (), None
        key = (x.shape, x.dtype, default if given is None else given)
        if key not in self._plans:
            self._plans[key] = self._make_plan(x, given, key[2])
        return key, self._plans[key]

    @staticmethod
    def _make_plan(x: np.ndarray, given: Any, where: Any) -> tuple[Any, Any, list[Any], list[Any] | None, bool] | None:
        """What `device_put(x, given)` computes before its C++ call (`where`: the default device
        when `given` is None), or None where the array should take device_put's own way."""
        aval = _update_dp_aval(_typeof(x), given)
        if aval.dtype != x.dtype or aval.shape != x.shape:
            return None
        if given is None:
            return aval, jax.sharding.SingleDeviceSharding(where), [where], None, False
        if not given.is_fully_addressable:
            return None
        placed = given.addressable_devices_indices_map(x.shape)
        index = None if given.is_fully_replicated else list(placed.values())
        return aval, given, list(placed), index, True


def _same(got: jax.Array, expected: jax.Array) -> bool:
    """The same array as device_put's: type, abstract value, placement and bytes."""
    return (
        type(got) is type(expected)
        and got.aval == expected.aval
        and got.sharding == expected.sharding
        and got.committed == expected.committed
        and np.array_equal(np.asarray(got).reshape(-1).view(np.uint8), np.asarray(expected).reshape(-1).view(np.uint8))
    )
