"""The Loader: a plan, a budget, a resume state and a pipeline put together behind `for batch in loader`."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import LoaderConfig
from .engine.assembler import GROUP_KEY, INDEX_KEY, VALID_KEY
from .engine.autotune import available_cores
from .engine.budget import Budget, size
from .engine.decoded import KeptDecoded
from .engine.descriptors import keep_open
from .engine.executor import Allocator
from .engine.fusion import Stage
from .engine.maps import loader_kept_maps
from .engine.pipeline import Autotune, Cursor, Pass, Pipeline, Report, Workers
from .engine.stats import Counters, LoaderStats
from .errors import SpecError
from .io.readahead import described, drop_behind_for
from .io.remote import is_remote
from .machine import default_memory_budget
from .plan.batches import BatchPlan, Plan, PlanConfig, default_block_length, default_cycle_length, next_pass, pass_end
from .plan.order import shard_take
from .resume import Resume
from .spec import parse_bytes, resolve_cast

if TYPE_CHECKING:
    from .dataset import Dataset

__all__ = ["Loader", "LoaderConfig", "UserPosition", "default_threads"]

Batch = dict[str, np.ndarray]


def default_threads() -> int:
    """One worker per core this process may run on (the ceiling loop uses the same)."""
    return available_cores()


def _option(name: str) -> Any:
    """A read-only view of `loader.config.<name>` (the option's one home is LoaderConfig)."""
    return property(lambda self: getattr(self.config, name), doc=f"`config.{name}` (see LoaderConfig).")


class Loader:
    """Batches of a Dataset, in the plan's order, prepared by worker threads.

    Each `iter(loader)` starts a new pass over `epochs` epochs, and ends the previous
    pass if one is still open (its iterator then raises SupersededError). Pass k covers
    epochs `k*epochs .. k*epochs+epochs-1`, each in its own order (`(seed, epoch)`), as
    a PyTorch DataLoader or tf.data reshuffles each iteration; `reshuffle_each_iteration=
    False` replays epochs `0 .. epochs-1` every pass. Threads start at the first batch
    asked for, and stop when the pass ends, is closed, is broken out of, or is dropped.

    Built by `Dataset.loader(...)`, or from a `LoaderConfig` (adapters that split a rank's
    shard among worker processes set `even_over` there). `state`: a `state_dict()` to resume from.

    Example:
        >>> with ds.loader(256, cast={"image": "float32"}) as loader:
        ...     for batch in loader:
        ...         train_step(batch["image"], batch["label"])
    """

    batch_size: int = _option("batch_size")
    epochs: int | None = _option("epochs")
    drop_remainder: bool = _option("drop_remainder")
    with_index: bool = _option("with_index")
    pad_last: bool = _option("pad_last")
    workers: str = _option("workers")
    shuffle: Any = _option("shuffle")
    seed: int | None = _option("seed")
    window: int = _option("window")
    reshuffle_each_iteration: bool = _option("reshuffle_each_iteration")
    shard: tuple[int, int] = _option("shard")
    even: bool = _option("even")

    def __init__(self, dataset: Dataset, config: LoaderConfig, *, state: Mapping[str, Any] | None = None) -> None:
        self.dataset, self.config = dataset, config
        fields, catalog = dataset.fields, dataset.catalog
        self.cycle_length = config.cycle_length or default_cycle_length(dataset.num_groups)
        self.block_length = config.block_length or default_block_length(max(f.record_bytes for f in fields.values()))
        self.stage, assembly, self.dtypes, self.shapes = _output(dataset, config)
        # None scales with the machine: see stoker.machine.default_memory_budget.
        memory_budget = parse_bytes(default_memory_budget() if config.memory_budget is None else config.memory_budget)
        remote = any(is_remote(i.path) for infos in dataset.files for i in infos.values())
        workers = Workers.of(config.workers, config.executor)
        threads = config.threads or default_threads()
        # threads=None: measured on the first pass (stoker.engine.autotune), from 1 per core up to 2.
        tune_threads = config.threads is None and workers.tunable
        max_threads = 2 * default_threads() if tune_threads else threads
        self.budget: Budget = size(
            batch_size=config.batch_size, memory_budget=memory_budget, given=config.memory_budget,
            record_bytes={n: math.prod(self.shapes[n]) * self.dtypes[n].itemsize for n in self.dtypes},
            prefetch=config.prefetch, threads=threads, max_threads=max_threads, remote=remote,
            coalescable=workers.given is None and workers.in_process and self.stage is None and not config.pad_last,
            num_parallel_reads=config.num_parallel_reads,
        )  # fmt: skip
        executor = workers.executor(threads, self.stage, catalog)
        self.autotune = Autotune(
            executor, threads=threads, prefetch=self.budget.prefetch, tune_threads=tune_threads,
            tune_prefetch=config.prefetch is None, max_threads=max_threads, fits=self.budget.fits,
            batch_bytes=self.budget.batch_bytes,
        )  # fmt: skip
        seek_fields = _seek_fields(dataset, self.budget) if config.shuffle == "global" else frozenset()
        self._plan = Plan(dataset.num_groups, catalog.count, PlanConfig(
            config.batch_size, config.drop_remainder, self.cycle_length, self.block_length,
            shuffle=config.shuffle or False, seed=config.seed, window=config.window, shard=config.shard,
            even=config.even, pad_last=config.pad_last, even_over=config.even_over,
        ))  # fmt: skip
        self._resume = Resume(dataset, config, (self.cycle_length, self.block_length))
        self._cursor = Cursor(config.epochs, reshuffle=config.reshuffle_each_iteration)
        self._passes: weakref.WeakSet[Pass] = weakref.WeakSet()
        self._passes_begun = 0
        self._closed = False
        self._counters = Counters()
        # Larger than half the RAM: drop pages behind the reader (stoker.io.readahead); output unchanged.
        raw_bytes = sum(i.size for infos in dataset.files for i in infos.values() if i.compression is None)
        self.drop_behind = drop_behind_for(raw_bytes)
        # Maps of the files read, kept from one pass to the next (a pass per epoch is how PyTorch
        # loops and Keras' fit iterate) so a later pass does not map and fault them in again;
        # compressed files decoded whole (labels) likewise (stoker.engine.decoded.KeptDecoded).
        self._kept_maps = loader_kept_maps()
        self._kept_decoded = KeptDecoded(self.budget.kept_decoded_bytes)
        self._open_files: str | None = None  # what a global shuffle did about open files (_keep_files_open)
        # Builds each pass's batch buffers from the bytes it may keep pooled (see use_allocator).
        self._allocator: Callable[[int], Allocator] = workers.allocator
        self._pipeline = Pipeline(
            catalog, {n: assembly[n] for n in fields}, batch_size=config.batch_size,
            with_index=config.with_index, stage=self.stage, units=self.budget.parts, workers=workers,
            executor=executor, autotune=self.autotune, counters=self._counters, kept_maps=self._kept_maps,
            kept_decoded=self._kept_decoded, drop_behind=self.drop_behind, gathers=config.shuffle == "global",
            fetch=(self.budget.num_parallel_reads, self.budget.fetch_bytes, self.budget.part_bytes),
            seek_fields=seek_fields, record_bytes=sum(f.record_bytes for f in fields.values()),
        )  # fmt: skip
        if state is not None:
            self.load_state_dict(state)

    threads = property(lambda self: self.autotune.threads, doc="Worker threads (autotune's, once it has measured).")
    prefetch = property(lambda self: self.autotune.prefetch, doc="Batches prepared ahead.")
    tuning = property(lambda self: self.autotune.tuning, doc="What autotune measured and chose, once it has.")
    memory_budget = property(lambda self: self.budget.memory_budget, doc="Bytes the engine may hold.")
    batch_bytes = property(lambda self: self.budget.batch_bytes, doc="One batch's bytes, as delivered.")
    num_parallel_reads = property(lambda self: self.budget.num_parallel_reads, doc="Remote GETs in flight.")

    # -- resume ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: after the last batch `__next__` returned.

        Small and JSON-serializable. Batches prefetched but not yet returned are not
        counted, so nothing is skipped on resume. `position` counts records of the
        epoch's global sequence; batch_size and shard may change on resume (elastic).
        Once a pass has ended, the loader stands at the start of the next pass, so a loop
        that saves after each pass resumes with the pass it had not begun.
        """
        return self.state_at(self._cursor.delivered)

    def state_at(self, position: tuple[int, int]) -> dict[str, Any]:
        """The state of this loader standing at `(epoch, position)`: for adapters that run ahead
        of their user and save the position the user actually reached (see UserPosition)."""
        return self._resume.state_at(position)

    @property
    def position(self) -> tuple[int, int]:
        """`(epoch, position)` after the last batch `__next__` returned (the start of a pass
        not yet delivered from, once `iter()` has begun it or the pass before has ended)."""
        return self._cursor.delivered

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state`: the next `iter()` continues right after the saved batch."""
        self._cursor.load(self._resume.check(state))

    # -- passes ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch for this shard (settles every group's record count)."""
        total, config = len(self.dataset), self.config
        if config.pad_last:
            return self._plan.padded_batches(total)
        return self._plan.batches_per_epoch(
            shard_take(total, config.shard, even=config.even, even_over=config.even_over)
        )

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise SpecError("this loader is closed; make a new one with dataset.loader(...)")
        for p in list(self._passes):
            p.supersede()
        start = self._cursor.next_start()
        stop = pass_end(start[0], self.config.epochs, reshuffle=self.config.reshuffle_each_iteration)
        pooled = self.budget.pooled(self.prefetch)
        self._keep_files_open()  # before the assembler's open-file table reads the descriptor limit
        plans = self._plan.batches(stop, first_epoch=start[0], start=start[1])
        p = self._pipeline.start(
            plans, self._allocator, pooled, report=Report(self._cursor, self.autotune), key=(start, stop),
            # Once the loader has been iterated again (an epoch loop), passes read on into the next;
            # a loader iterated once does not pay for requests nobody reads.
            then=self._pass_after(start, stop) if self._passes_begun else None,
        )  # fmt: skip
        self._passes_begun += 1
        self._cursor.begin(start)
        self._passes.add(p)
        return p

    def _pass_after(
        self, start: tuple[int, int], stop: int | None
    ) -> tuple[tuple[tuple[int, int], int | None], Iterator[BatchPlan]] | None:
        """Where the pass after one from `start` to `stop` starts and ends, and its plans (the
        pass reads them ahead at its end: see stoker.engine.ahead.NextPass); None: it never ends."""
        if stop is None:
            return None
        config = self.config
        first = next_pass(start[0], stop - 1, config.epochs, reshuffle=config.reshuffle_each_iteration)
        end = pass_end(first, config.epochs, reshuffle=config.reshuffle_each_iteration)
        return ((first, 0), end), self._plan.batches(end, first_epoch=first)

    def use_allocator(self, factory: Callable[[int], Allocator]) -> None:
        """Build the batch buffers of later passes with `factory(pooled_bytes)` (an adapter's pinned
        or shared memory: one buffer path, not two); a pass already running keeps its own."""
        self._allocator = factory

    @property
    def allocator(self) -> Callable[[int], Allocator]:
        """What builds each pass's batch buffers (see use_allocator)."""
        return self._allocator

    def _keep_files_open(self) -> None:
        """Once per loader, for a global shuffle: keep the raw files open (stoker.engine.descriptors.keep_open)."""
        if self.config.shuffle != "global" or self._open_files is not None:
            return
        files = self.dataset.files
        self._open_files = keep_open(
            sum(1 for infos in files for i in infos.values() if i.compression is None and not is_remote(i.path))
        )

    # -- what it reports -------------------------------------------------------------
    def stats(self) -> LoaderStats:
        """Counters since this loader's first batch: records, bytes, time per stage, waits, CPU.

        Cheap enough to leave on (a few clock reads per batch). `print(loader.stats())`
        shows one screen; `stoker.doctor.verdict` says what limits the pipeline.
        """
        held = self._counters.batches > 0 and self.autotune.held_down(
            self.budget.parts, self.batch_bytes, self._pass_batches()
        )
        return self._counters.snapshot(
            threads=self.threads, prefetch=self._shown_prefetch(), batch_size=self.config.batch_size,
            record_bytes={n: f.record_bytes for n, f in self.dataset.fields.items()},
            dtypes={n: self.dtypes[n].name for n in self.dataset.fields},
            tuning={
                "readahead": described(gathers=self.config.shuffle == "global", drop_behind=self.drop_behind),
                **({"open files": self._open_files} if self._open_files else {}),
                **({"autotune": self.tuning} if self.tuning else {}),
            },
            memory_budget=self.memory_budget, batch_bytes=self.batch_bytes, coalesced=self.budget.parts,
            cycle_length=self.cycle_length, block_length=self.block_length, prefetch_limited=held,
            buffers_made=getattr(self._pipeline.pool, "allocated", 0),
        )  # fmt: skip

    def _pass_batches(self) -> int | None:
        """Batches a pass yields, where that is known without reading a file (None: not yet
        known, or it never ends)."""
        if self.config.epochs is None or not self.dataset.catalog.settled():
            return None
        return len(self) * self.config.epochs

    def _shown_prefetch(self) -> int:
        """Batches that can be in flight: `prefetch`, and no more than the data holds."""
        data = self._pass_batches()
        return self.prefetch if data is None else min(self.prefetch, data)

    def __repr__(self) -> str:
        return (
            f"Loader(batch_size={self.batch_size}, epochs={self.epochs}, cycle_length={self.cycle_length}, "
            f"block_length={self.block_length}, threads={self.threads}, prefetch={self._shown_prefetch()})"
        )

    # -- adapters and lifetime -------------------------------------------------------
    # The adapters' own signatures, so `loader.to_torch("cuda", ...)` works as documented.
    def to_torch(self, device: Any = None, pin_memory: bool = False, cast_on_device: Any = None) -> Any:
        """This loader as an iterable of dicts of torch tensors; see `stoker.torch.to_torch`."""
        from .torch import to_torch

        return to_torch(self, device=device, pin_memory=pin_memory, cast_on_device=cast_on_device)

    def to_jax(self, sharding: Any = None, prefetch_to_device: int = 2) -> Any:
        """This loader as an iterable of dicts of jax arrays; see `stoker.jax.to_jax`."""
        from .jax import to_jax

        return to_jax(self, sharding=sharding, prefetch_to_device=prefetch_to_device)

    def to_tf(self, *, element_spec: Any = None) -> Any:
        """This loader as a `tf.data.Dataset` (zero-copy); see `stoker.tf.to_tf`."""
        from .tf import to_tf

        return to_tf(self, element_spec=element_spec)

    def close(self) -> None:
        """Stop every pass's threads, close its files and unmap the files kept mapped; idempotent."""
        self._closed = True
        for p in list(self._passes):
            p.close()
        if self._kept_maps is not None:
            self._kept_maps.close()
        self._kept_decoded.clear()
        self._pipeline.clear_pool()
        self._pipeline.next_slot.clear()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class UserPosition:
    """State for adapters that run ahead of their user (device prefetch, copies in flight).

    Subclasses set `self.loader` and update `self._position` to the loader position
    recorded with each batch as they hand it to the user, so a saved state resumes right
    after the last batch the user actually received.
    """

    loader: Loader
    _position: tuple[int, int]

    def state_dict(self) -> dict[str, Any]:
        """The loader's state after the last batch this iterable returned (JSON-serializable)."""
        return self.loader.state_at(self._position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state`: the next `iter()` continues right after the saved batch."""
        self.loader.load_state_dict(state)
        self._position = self.loader.position


def _output(
    dataset: Dataset, config: LoaderConfig
) -> tuple[Stage | None, dict[str, np.dtype], dict[str, np.dtype], dict[str, tuple[int, ...]]]:
    """The transforms bound to seed and shard (see stoker.transforms); what each field is assembled
    as; the dtypes and shapes of what is delivered (what goes in, where a transform's output is unknown)."""
    fields = dataset.fields
    dtypes = resolve_cast(fields, config.cast)
    shapes = {n: f.shape for n, f in fields.items()}
    if config.with_index:
        dtypes[GROUP_KEY] = dtypes[INDEX_KEY] = np.dtype(np.int64)
        shapes[GROUP_KEY] = shapes[INDEX_KEY] = ()
    if config.pad_last:
        dtypes[VALID_KEY] = np.dtype(bool)
        shapes[VALID_KEY] = ()
    assembly = dict(dtypes)
    if config.transform is None:
        return None, assembly, dtypes, shapes
    stage = Stage(
        config.transform, seed=config.seed, shard=config.shard,
        records={n: (shapes[n], dtypes[n]) for n in dtypes}, stored={n: f.native_dtype for n, f in fields.items()},
    )  # fmt: skip
    assembly.update(stage.assembly)
    if stage.exact:  # only built-ins: what is delivered is known
        dtypes = {n: d for n, (_, d) in stage.records.items()}
        shapes = {n: s for n, (s, _) in stage.records.items()}
    return stage, assembly, dtypes, shapes


def _seek_fields(dataset: Dataset, budget: Budget) -> frozenset[str]:
    """A global shuffle reads compressed fields from memory, so they must fit what prefetch leaves
    of the budget; fields a persistent index covers are read record by record from its seek points
    instead where they do not (slower per record, bounded memory). Those fields, or a SpecError."""
    fields, catalog = dataset.fields, dataset.catalog
    compressed = [n for n in fields if any(i[n].compression is not None for i in dataset.files)]
    if not compressed:
        return frozenset()
    total = len(dataset)
    need = sum(total * fields[n].record_bytes for n in compressed)
    allowed = budget.spare(budget.prefetch)
    seek: frozenset[str] = frozenset()
    if need > allowed:
        seek = frozenset(
            n for n in compressed
            if all((g, n) in catalog.seek_points for g, i in enumerate(catalog.files) if i[n].compression)
        )  # fmt: skip
        compressed = [n for n in compressed if n not in seek]
        need = sum(total * fields[n].record_bytes for n in compressed)
    if need > allowed:
        raise SpecError(
            f"shuffle='global' keeps compressed field(s) {compressed} decompressed in memory: {need} bytes, "
            f"more than the {allowed} bytes memory_budget={budget.memory_budget} leaves after prefetch; "
            "raise memory_budget, store those fields uncompressed, index them with `stoker index` (then they "
            "are read through seek points), or use shuffle='files' (any compression)",
            field=compressed[0], path=dataset.files[0][compressed[0]].path,
        )  # fmt: skip
    return seek
