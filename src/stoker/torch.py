"""PyTorch adapter: a loader's batches as torch tensors, and a `torch.utils.data.IterableDataset`.

Two ways in:

- `to_torch` (`loader.to_torch()`): the loader's own threads, no worker processes.
  Each numpy array becomes a tensor with `torch.from_numpy`, **without a copy**. That is
  safe because stoker never rewrites a batch buffer while any array on it, or a tensor
  made from one, is alive (buffers are recycled only once every view is gone). With
  `device=` each tensor is copied with `non_blocking=True`; with `pin_memory=True`
  (and CUDA present) the loader assembles batches straight into pinned memory, through
  its buffer allocator, so the copy is a real asynchronous DMA. `cast_on_device=`
  casts after the transfer: ship int8 images as stored and cast on the GPU, 4x fewer
  bytes over PCIe than float32 (the recommended setup).
- `StokerIterableDataset`: for code built around `torch.utils.data.DataLoader`
  (`batch_size=None`; stoker batches). With `num_workers=W` each worker process
  reads its own part of the rank's shard, so no record is read twice and none is
  dropped that the rank alone would deliver; each DataLoader epoch goes on with the
  next epoch's order, persistent workers too; `state_dict` / `load_state_dict`
  follow torchdata's `StatefulDataLoader` conventions (called in each worker, state
  per worker). It adds worker processes and IPC of every batch, so
  `to_torch` is the faster path; use this one when the DataLoader is a given.

PyTorch is imported here only: `import stoker` needs numpy alone.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.sharedctypes
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils.data

from .config import LoaderConfig
from .dataset import Dataset
from .engine.executor import AlignedPool
from .errors import SpecError, StateError
from .loader import Loader, UserPosition, default_threads
from .plan.order import shard_from_rank, shard_take, validate_shard

if TYPE_CHECKING:
    from .engine.executor import Allocator

__all__ = ["PinnedPool", "StokerIterableDataset", "TorchLoader", "shard_from_distributed", "to_torch", "worker_shard"]

TensorBatch = dict[str, torch.Tensor]
PIN_MEMORY_NO_CUDA = (
    "pin_memory=True has no effect: CUDA is not available, so batches stay in stoker's page-aligned "
    "host memory (the same as pin_memory=False)"
)


def _from_numpy(name: str, array: np.ndarray) -> torch.Tensor:
    """`torch.from_numpy`, also for ml_dtypes' bfloat16 (`cast="bfloat16"`): torch does not
    know that numpy dtype, so its bits go through an int16 view into a torch.bfloat16 tensor
    on the same memory (no copy; the tensor keeps the array alive, as from_numpy's do)."""
    if array.dtype.kind != "V":
        return torch.from_numpy(array)
    dtype = getattr(torch, array.dtype.name, None)
    if not isinstance(dtype, torch.dtype) or dtype.itemsize != array.dtype.itemsize:
        raise SpecError(f"to_torch: field {name!r} is {array.dtype.name}, which PyTorch has no dtype for", field=name)
    return torch.from_numpy(array.view(f"i{array.dtype.itemsize}")).view(dtype)


def shard_from_distributed() -> tuple[int, int]:
    """`(rank, world_size)` of the initialized `torch.distributed` group, else `(0, 1)`.

    Example:
        >>> loader = ds.loader(256, shard=stoker.torch.shard_from_distributed())
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return shard_from_rank(dist.get_rank(), dist.get_world_size())
    return (0, 1)


def worker_shard(shard: tuple[int, int], worker: int, num_workers: int) -> tuple[int, int]:
    """The shard worker `worker` of `num_workers` reads within `shard = (i, c)`.

    `(i + c * worker, c * num_workers)`: shard `(i, c)` owns the positions `p` with
    `p % c == i`; its workers split exactly those (`p % (c * W) == i + c * w`), so a
    rank reads the same records whatever its worker count, and no two workers of any rank
    read the same record. With `even=True` a worker's loader gets `even_over=c`, so the
    trim is the rank's (`stoker.plan.order.shard_take`), never more with workers.

    Example:
        >>> worker_shard((1, 4), 2, 3)
        (9, 12)
    """
    index, count = validate_shard(shard)
    worker, num_workers = validate_shard((worker, num_workers))
    return index + count * worker, count * num_workers


class PinnedPool(AlignedPool):
    """The engine's `stoker.engine.executor.AlignedPool` over CUDA pinned (page-locked) host memory.

    Same pool, same contract: a buffer goes back to the free list only once every array
    (and tensor) on it is gone; at most `max_pooled_bytes` are kept. Only where the
    memory comes from differs. Pinned memory from the CUDA host allocator is page aligned.
    """

    def _new_region(self, nbytes: int) -> object:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _as_array(self, region: object, nbytes: int) -> np.ndarray:
        # `.numpy()` makes a new tensor-backed base for each call, like np.frombuffer.
        assert isinstance(region, torch.Tensor)
        return region.numpy()


def _pinned_factory(pooled: int) -> Allocator:
    return PinnedPool(pooled)


def _check_available(device: torch.device | None) -> None:
    """Refuse a CUDA device this process cannot use now, rather than fail at the first batch."""
    if device is None or device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise SpecError(
            f"device={str(device)!r}, but CUDA is not available to PyTorch here (torch.cuda.is_available() is "
            "False: a CPU-only build, no GPU or no driver): pass device=None to keep batches on the CPU, or "
            "install a CUDA build of PyTorch"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise SpecError(
            f"device={str(device)!r}, but PyTorch sees {torch.cuda.device_count()} CUDA device(s) "
            f"(cuda:0..cuda:{torch.cuda.device_count() - 1}; CUDA_VISIBLE_DEVICES may hide the others)"
        )


def _torch_dtypes(loader: Loader, cast_on_device: Mapping[str, Any] | None) -> dict[str, torch.dtype]:
    if cast_on_device is None:
        return {}
    if not isinstance(cast_on_device, Mapping):
        raise SpecError(f"cast_on_device={cast_on_device!r} must be a mapping of field -> torch.dtype")
    out = {}
    for name, dtype in cast_on_device.items():
        if name not in loader.dtypes:
            raise SpecError(
                f"cast_on_device names unknown field {name!r}; fields are {list(loader.dtypes)}", field=name
            )
        if not isinstance(dtype, torch.dtype):
            raise SpecError(
                f"cast_on_device[{name!r}]={dtype!r} must be a torch.dtype such as torch.float32", field=name
            )
        out[name] = dtype
    return out


def to_torch(
    loader: Loader,
    device: str | torch.device | None = None,
    pin_memory: bool = False,
    cast_on_device: Mapping[str, torch.dtype] | None = None,
) -> TorchLoader:
    """The loader's batches as dicts of torch tensors; see `TorchLoader`.

    Args:
        loader: a stoker Loader (`ds.loader(...)`).
        device: where tensors go (`"cuda"`, `"cuda:1"`, ...); None keeps them on the
            CPU, zero-copy over stoker's buffers. A CUDA device this process cannot use is a
            SpecError here, not at the first batch.
        pin_memory: assemble batches in CUDA pinned memory (asynchronous copies). Without
            CUDA this warns once and does nothing else: batches stay where they are.
        cast_on_device: `{field: torch.dtype}` cast after the copy to `device` (on the
            CPU when device is None, which costs a copy).

    Example:
        >>> loader = ds.loader(256, drop_remainder=True)  # images stay int8 on the host  # doctest: +SKIP
        >>> for batch in loader.to_torch("cuda", pin_memory=True, cast_on_device={"image": torch.float32}):
        ...     loss = step(batch["image"], batch["label"])  # doctest: +SKIP
    """
    return TorchLoader(loader, device=device, pin_memory=pin_memory, cast_on_device=cast_on_device)


class TorchLoader(UserPosition):
    """An iterable of dicts of torch tensors over a stoker Loader; a context manager.

    Each `iter()` starts a new pass of the loader. `state_dict()` is the position
    after the last batch this object returned, so resume is exact. `close()` closes the
    loader too (threads, files) and waits for copies still in flight.
    """

    def __init__(
        self,
        loader: Loader,
        *,
        device: str | torch.device | None = None,
        pin_memory: bool = False,
        cast_on_device: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        if not isinstance(pin_memory, bool):
            raise SpecError(f"pin_memory={pin_memory!r} must be True or False")
        try:
            self.device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise SpecError(f"device={device!r} is not a torch device") from e
        _check_available(self.device)
        self.loader = loader
        self.cast_on_device = _torch_dtypes(loader, cast_on_device)
        self.pin_memory = False
        if pin_memory:
            if torch.cuda.is_available():
                loader.use_allocator(_pinned_factory)
                self.pin_memory = True
            else:
                warnings.warn(PIN_MEMORY_NO_CUDA, RuntimeWarning, stacklevel=3)
        self._position = loader.position
        # Host batches whose asynchronous copy may still be reading them: kept alive (so
        # stoker cannot recycle the buffer) until the copy's event has completed.
        self._inflight: deque[tuple[torch.cuda.Event, TensorBatch]] = deque()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[TensorBatch]:
        self._finish_copies(wait=True)
        it = iter(self.loader)
        self._position = self.loader.position  # the new pass's start, until its first batch
        return self._batches(it)

    def _batches(self, it: Iterator[dict[str, np.ndarray]]) -> Iterator[TensorBatch]:
        loader = self.loader
        try:
            for batch in it:
                position = loader.position
                host = {name: _from_numpy(name, array) for name, array in batch.items()}
                del batch
                out = self._transfer(host)
                self._position = position
                yield out
                del out, host
            self._position = loader.position  # the pass ended: the next one's start
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _transfer(self, host: TensorBatch) -> TensorBatch:
        device = self.device
        if device is None or device.type == "cpu":
            return {n: t.to(self.cast_on_device[n]) if n in self.cast_on_device else t for n, t in host.items()}
        cuda = device.type == "cuda"
        if cuda:
            self._finish_copies(wait=False)
        out = {n: t.to(device, non_blocking=cuda) for n, t in host.items()}
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._inflight.append((event, host))
        return {n: t.to(self.cast_on_device[n]) if n in self.cast_on_device else t for n, t in out.items()}

    def _finish_copies(self, *, wait: bool) -> None:
        while self._inflight:
            event, _ = self._inflight[0]
            if wait:
                event.synchronize()
            elif not event.query():
                return
            self._inflight.popleft()

    def close(self) -> None:
        """Wait for copies in flight, stop the loader's threads, close its files; idempotent."""
        self._finish_copies(wait=True)
        self.loader.close()

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TorchLoader({self.loader!r}, device={self.device}, pin_memory={self.pin_memory})"


# DataLoader workers per rank the shared epoch counter has room for (one slot per worker of
# each worker count, so workers of one DataLoader always agree): 128 * 129 / 2 slots, 132 KiB.
MAX_WORKERS = 128


class EpochCounter:
    """Where each `iter()` of a `StokerIterableDataset` starts, shared by its copies in every process.

    DataLoader workers iterate copies of the dataset (forked, or pickled to start them under
    spawn or forkserver; persistent workers keep theirs from one epoch to the next), so an
    attribute set in the main process never reaches a running worker. This lives in shared
    memory made at construction, which a fork inherits and the pickling that starts a worker
    hands over (pickled elsewhere, it is copied). int64s: the epoch `set_epoch` pinned and
    how often it was called; then one slot per `(worker, num_workers)`, written by that worker
    alone (so no lock): the `set_epoch` call it last saw, and the epoch its next `iter()`
    starts from.
    """

    def __init__(self, epochs: int | None, *, reshuffle: bool, values: bytes | None = None) -> None:
        self.epochs = epochs
        self.reshuffle = reshuffle
        size = 2 + 2 * (MAX_WORKERS * (MAX_WORKERS + 1) // 2)
        self._shared: Any = multiprocessing.sharedctypes.RawArray("q", size)
        if values is not None:
            memoryview(self._shared).cast("B")[:] = values

    def pin(self, epoch: int) -> None:
        """The next `iter()` of every copy starts at `epoch`."""
        self._shared[0] = epoch
        self._shared[1] += 1

    @property
    def pinned(self) -> int:
        return int(self._shared[0])

    def _slot(self, worker: int, workers: int) -> int:
        if workers > MAX_WORKERS:
            raise SpecError(
                f"StokerIterableDataset counts epochs for up to {MAX_WORKERS} DataLoader workers per rank; "
                f"this DataLoader has num_workers={workers}"
            )
        return 2 + 2 * (workers * (workers - 1) // 2 + worker)

    def peek(self, worker: int, workers: int) -> int:
        """The epoch the next `iter()` of this worker starts from."""
        shared, slot = self._shared, self._slot(worker, workers)
        if not self.reshuffle or shared[slot] != shared[1]:  # no iter() since the last set_epoch
            return int(shared[0])
        return int(shared[slot + 1])

    def claim(self, worker: int, workers: int, loaded: int | None) -> int:
        """The first epoch of this worker's new `iter()` (`loaded`: a loaded state's), counted as begun."""
        first = self.peek(worker, workers) if loaded is None else loaded
        slot = self._slot(worker, workers)
        self._shared[slot] = self._shared[1]
        self._shared[slot + 1] = first + (self.epochs or 1)
        return first

    def reached(self, worker: int, workers: int, epoch: int) -> None:
        """`epochs=None`: this worker's iterator got to `epoch`; the next `iter()` goes on after it."""
        slot = self._slot(worker, workers)
        self._shared[slot + 1] = max(int(self._shared[slot + 1]), epoch + 1)

    def __reduce__(self) -> tuple[Any, ...]:
        if multiprocessing.context.get_spawning_popen() is not None:  # starting a worker: share
            return (_shared_counter, (self.epochs, self.reshuffle, self._shared))
        return (_copied_counter, (self.epochs, self.reshuffle, bytes(self._shared)))


def _copied_counter(epochs: int | None, reshuffle: bool, values: bytes) -> EpochCounter:
    return EpochCounter(epochs, reshuffle=reshuffle, values=values)


def _shared_counter(epochs: int | None, reshuffle: bool, shared: Any) -> EpochCounter:
    counter = EpochCounter.__new__(EpochCounter)
    counter.epochs, counter.reshuffle, counter._shared = epochs, reshuffle, shared
    return counter


class StokerIterableDataset(torch.utils.data.IterableDataset[TensorBatch]):
    """A stoker loader as a `torch.utils.data.IterableDataset` of whole batches.

    Use it with `DataLoader(dataset, batch_size=None, ...)`: stoker makes the batches.
    Each `iter()` (each DataLoader epoch) yields `epochs` epochs and the next `iter()` goes
    on with the epochs after them (new orders), in the main process or in workers,
    persistent or not; `set_epoch(e)` pins the epoch the next `iter()` starts from, and
    a loaded state takes precedence over both. `reshuffle_each_iteration=False` in the
    loader settings starts every `iter()` at the pinned epoch (0 unless set). In a
    DataLoader worker `w` of `W`, the loader reads `worker_shard` `(shard, w, W)`, so
    the workers of a rank together read that rank's shard exactly once; with `even=True`
    the rank's shard is trimmed as one (`stoker.plan.order.shard_take`), so a rank
    delivers what its own loader would whatever `W`, and every rank as many batches.

    Args:
        dataset: the stoker Dataset.
        batch_size: records per batch (per worker, per rank).
        shard: this rank's `(index, count)`, e.g. `shard_from_distributed`.
        epochs: epochs per `iter()`; None: forever.
        threads: stoker threads per worker process; None: the cores divided among workers.
        loader_kwargs: the rest of `stoker.Dataset.loader`'s settings (cast,
            shuffle, seed, drop_remainder, prefetch, memory_budget, even, ...), per worker.

    State (torchdata's `Stateful`): `state_dict()` is the loader state after the last
    batch this process (worker) yielded; `StatefulDataLoader` calls it in every worker
    and keeps the one that goes with the last batch its user received, then calls
    `load_state_dict` in the same worker on resume (same `num_workers`).

    Example:
        >>> from torchdata.stateful_dataloader import StatefulDataLoader
        >>> batches = StokerIterableDataset(ds, 256, shuffle="global", seed=0)
        >>> dl = StatefulDataLoader(batches, batch_size=None, num_workers=2)
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shard: tuple[int, int] = (0, 1),
        epochs: int | None = 1,
        threads: int | None = None,
        **loader_kwargs: Any,
    ) -> None:
        if not isinstance(dataset, Dataset):
            raise SpecError(f"dataset={dataset!r} must be a stoker.Dataset")
        for reserved in ("state", "shard", "epochs", "even_over"):
            if reserved in loader_kwargs:
                raise SpecError(f"{reserved}= is set on StokerIterableDataset itself, not in loader settings")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise SpecError(f"epochs={epochs!r} must be a positive integer or None")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shard = validate_shard(shard)
        self.epochs = epochs
        self.threads = threads
        self.loader_kwargs = dict(loader_kwargs)
        self._pending: dict[str, Any] | None = None
        self._loader: Loader | None = None
        self._position: tuple[int, int] = (0, 0)
        self._make_loader(0, 1, epochs=1).close()  # settings errors surface here, not in a worker
        reshuffle = self.loader_kwargs.get("reshuffle_each_iteration", True)
        self._epochs = EpochCounter(epochs, reshuffle=reshuffle)

    # -- where this process stands --------------------------------------------------
    def _worker(self) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def _make_loader(self, worker: int, workers: int, *, epochs: int | None) -> Loader:
        """The loader of worker `worker` of `workers`: its part of the rank's shard, trimmed as the rank's."""
        threads = self.threads or max(1, default_threads() // workers)
        shard = worker_shard(self.shard, worker, workers)
        even_over = self.shard[1] if workers > 1 else None
        config = LoaderConfig(
            batch_size=self.batch_size, shard=shard, even_over=even_over, epochs=epochs, threads=threads,
            **self.loader_kwargs,
        )  # fmt: skip
        return Loader(self.dataset, config)

    @property
    def epoch(self) -> int:
        """The epoch `set_epoch` pinned (0 until it is called)."""
        return self._epochs.pinned

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next `iter()` starts from, in this process and every DataLoader worker
        (a loaded state takes precedence); later ones go on from there."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise SpecError(f"epoch={epoch!r} must be a non-negative integer")
        self._epochs.pin(epoch)

    def __iter__(self) -> Iterator[TensorBatch]:
        # Everything happens at the first next(): StatefulDataLoader builds (and drops)
        # an iterator before it loads a state, and that one must neither consume the state
        # nor count as an epoch begun.
        self._loader = None  # state_dict() now says where the new iterator starts
        return self._batches()

    def _batches(self) -> Iterator[TensorBatch]:
        worker, workers = self._worker()
        state, self._pending = self._pending, None
        loaded = None if state is None else int(state["epoch"])
        if state is not None and workers == 1 and self._spent(state):
            # Saved after its epoch's last batch (StatefulDataLoader keeps such a state at each epoch's
            # end): this iter() is the next epoch's, as without the restart. Only alone: a worker of
            # several may be done with an epoch its siblings are still delivering.
            loaded, state = int(state["epoch"]) + 1, None
        first = self._epochs.claim(worker, workers, loaded)
        epochs = None if self.epochs is None else first + self.epochs
        loader = self._make_loader(worker, workers, epochs=epochs)
        try:
            loader.load_state_dict(state if state is not None else loader.state_at((first, 0)))
            self._loader = loader
            self._position = loader.position
            for batch in loader:
                self._position = loader.position
                if self.epochs is None:
                    self._epochs.reached(worker, workers, self._position[0])
                yield {name: _from_numpy(name, array) for name, array in batch.items()}
        finally:
            loader.close()

    def _spent(self, state: Mapping[str, Any]) -> bool:
        """Whether this rank's shard has no batch left of the state's epoch after its position."""
        total = len(self.dataset)
        position = min(int(state["position"]), total)
        settings = self.loader_kwargs
        if settings.get("pad_last", False):
            return position >= total
        left = shard_take(total, self.shard, position, even=settings.get("even", True))
        return left == 0 or (settings.get("drop_remainder", False) and left < self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """This process's loader state after the last batch it yielded (JSON-serializable)."""
        if self._pending is not None:
            return dict(self._pending)
        if self._loader is None:
            worker, workers = self._worker()
            with self._make_loader(worker, workers, epochs=1) as loader:
                return loader.state_at((self._epochs.peek(worker, workers), 0))
        return self._loader.state_at(self._position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next `iter()` in this process resumes right after the batch `state` was saved at."""
        worker, workers = self._worker()
        # epochs=None: any epoch is one this iterable may start from (see _batches).
        with self._make_loader(worker, workers, epochs=None) as probe:
            try:
                probe.load_state_dict(state)  # raises StateError for a foreign state, here
            except StateError as e:
                e.add_note(f"while loading StokerIterableDataset state in worker {worker} of {workers}")
                raise
        self._pending = dict(state)

    # -- pickling (DataLoader workers started with "spawn" or "forkserver") ----------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loader"] = None  # threads and files stay with the process that opened them
        return state

    def __repr__(self) -> str:
        return f"StokerIterableDataset({self.dataset!r}, batch_size={self.batch_size}, shard={self.shard})"
