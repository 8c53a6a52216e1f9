"""The Loader: a plan, an assembler and an executor put together behind `for batch in loader`."""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .engine.assembler import GROUP_KEY, INDEX_KEY, VALID_KEY, Assembler, Task, build_parts
from .engine.autotune import SPARE, ThreadTuner, available_cores, default_prefetch, wanted_prefetch
from .engine.decoded import KEPT_DECODED_BYTES, KeptDecoded
from .engine.descriptors import pass_open_files, raise_open_files
from .engine.executor import (
    ALIGNMENT,
    AlignedPool,
    Allocator,
    Executor,
    OrderedMap,
    StopFlag,
    Stopped,
    ThreadExecutor,
    fork_generation,
    forked_pass,
    run_finalizer,
)
from .engine.fusion import Stage
from .engine.maps import loader_kept_maps
from .engine.stats import Counters, LoaderStats
from .errors import SpecError, StateError, SupersededError
from .io.fetch import Fetcher, parallel_reads
from .io.readahead import AHEAD_BYTES, Readahead, drop_behind_for
from .io.remote import is_remote
from .machine import address_space_note, default_memory_budget
from .plan.batches import (
    BatchPlan,
    Plan,
    PlanConfig,
    Shuffle,
    coalesce,
    default_block_length,
    default_cycle_length,
    next_pass,
    pass_end,
)
from .plan.order import fingerprint, shard_take, validate_even_over, validate_shard
from .spec import parse_bytes, positive, resolve_cast

if TYPE_CHECKING:
    from .dataset import Dataset

__all__ = ["Loader", "UserPosition", "default_threads"]

Batch = dict[str, np.ndarray]
STATE_VERSION = 1
# "files" shuffle: blocks whose order is shuffled together. An explicit constant, never
# derived from memory_budget, so the order never depends on the budget.
DEFAULT_WINDOW = 16
# Small batches are assembled several at a time, as one batch of about this many bytes whose
# parts are delivered one by one (views of it; see _Pass): the per-batch work (planning,
# dispatch, buffers, file bookkeeping, a copy call per run and field) is paid once for all of
# them, and a file's records for all of them are copied in one call. The batches, their order
# and their contents are what they would be one at a time. That work is still a noticeable
# share of a 16 MiB batch's time (measured: benchmarks/results/w1_history.md).
COALESCE_BYTES = 64 << 20
MAX_COALESCE = 64
# With fields at URLs: an assembly's first batch waits for every GET of the assembly, and 64 MiB
# is half of the default read-ahead, so the pipeline moved in lurches; assemblies of 16 MiB kept
# pace with benchmarks/remote.py's plain loop where those of 64 MiB fell behind it.
COALESCE_REMOTE_BYTES = 16 << 20


def default_threads() -> int:
    """One worker per core this process may run on (the ceiling loop uses the same)."""
    return available_cores()


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{name}={value!r} must be True or False")


def _seed_ok(seed: object) -> bool:
    return not isinstance(seed, bool) and isinstance(seed, int | np.integer) and bool(seed >= 0)


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """A Loader's arguments, checked once when built: every count a positive integer, every flag
    a bool, the choices among those offered and consistent with each other. What depends on the
    dataset (cast, the memory budget against a batch) the Loader checks when it sizes itself.

    `None` stands for "stoker chooses" (see Loader); counts are plain ints after the checks.
    """

    batch_size: int
    epochs: int | None = 1
    drop_remainder: bool = False
    cycle_length: int | None = None
    block_length: int | None = None
    threads: int | None = None
    prefetch: int | None = None
    memory_budget: int | str | None = None
    with_index: bool = False
    shuffle: Shuffle | None = False
    seed: int | None = None
    window: int = DEFAULT_WINDOW
    reshuffle_each_iteration: bool = True
    shard: tuple[int, int] = (0, 1)
    even: bool = True
    even_over: int | None = None
    pad_last: bool = False
    workers: str = "thread"
    num_parallel_reads: int | None = None
    transform: Any = None
    executor: Executor | None = None

    def __post_init__(self) -> None:
        # In the order Loader checked its arguments before this class: with two wrong, the same error.
        put = functools.partial(object.__setattr__, self)
        put("batch_size", positive("batch_size", self.batch_size, allow_none=False))
        put("epochs", positive("epochs", self.epochs))
        _flag("drop_remainder", self.drop_remainder)
        _flag("with_index", self.with_index)
        _flag("pad_last", self.pad_last)
        if self.pad_last and self.drop_remainder:
            raise SpecError("pad_last=True pads the last batch and drop_remainder=True drops it; choose one")
        put("cycle_length", positive("cycle_length", self.cycle_length))
        put("block_length", positive("block_length", self.block_length))
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)
        put("threads", positive("threads", self.threads))
        if self.workers not in ("thread", "process"):
            raise SpecError(f"workers={self.workers!r} must be 'thread' or 'process'")
        if self.transform is None:
            if self.workers == "process":
                raise SpecError("workers='process' runs transform= functions in worker processes; none was given")
        else:
            if self.workers == "process" and self.executor is not None:
                raise SpecError("workers='process' brings its own executor; pass executor= or workers=, not both")
            if self.seed is not None and not _seed_ok(self.seed):
                raise SpecError(
                    f"seed={self.seed!r} must be a non-negative integer or None (transforms then use seed 0)"
                )
            validate_shard(self.shard)
        put("prefetch", positive("prefetch", self.prefetch))
        shuffle = False if self.shuffle is None else self.shuffle
        if shuffle not in (False, "global", "files"):
            raise SpecError(f"shuffle={shuffle!r} must be False, 'global' or 'files'")
        put("shuffle", shuffle)
        if shuffle and not _seed_ok(self.seed):
            raise SpecError(
                f"shuffle={shuffle!r} needs seed= a non-negative integer (got seed={self.seed!r}); stoker never "
                "seeds from the clock, so the same seed gives the same order on any machine"
            )
        put("seed", int(self.seed) if self.seed is not None else None)
        put("window", positive("window", self.window, allow_none=False))
        _flag("reshuffle_each_iteration", self.reshuffle_each_iteration)
        put("shard", validate_shard(self.shard))
        _flag("even", self.even)
        put("even_over", validate_even_over(self.shard, self.even_over))
        put("num_parallel_reads", positive("num_parallel_reads", self.num_parallel_reads))


class Loader:
    """Batches of a Dataset, in the plan's order, prepared by worker threads.

    Each `iter(loader)` starts a new pass over `epochs` epochs, and ends the previous
    pass if one is still open (its iterator then raises SupersededError). Pass k covers
    epochs `k*epochs .. k*epochs+epochs-1`, each in its own order (`(seed, epoch)`), as
    a PyTorch DataLoader or tf.data reshuffles each iteration; `reshuffle_each_iteration=
    False` replays epochs `0 .. epochs-1` every pass. Threads start at the first batch
    asked for, and stop when the pass ends, is closed, is broken out of, or is dropped.

    Beyond `Dataset.loader`'s settings, `even_over=c` is for adapters that split a rank's
    shard `(i, c)` among worker processes: with `shard=(i + c*w, c*W)` the `even` trim is
    the rank's, not the worker's (see `stoker.plan.order.shard_take`).

    Example:
        >>> with ds.loader(256, cast={"image": "float32"}) as loader:
        ...     for batch in loader:
        ...         train_step(batch["image"], batch["label"])
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        epochs: int | None = 1,
        drop_remainder: bool = False,
        cycle_length: int | None = None,
        block_length: int | None = None,
        cast: Any = None,
        threads: int | None = None,
        prefetch: int | None = None,
        memory_budget: int | str | None = None,
        with_index: bool = False,
        shuffle: Shuffle | None = False,
        seed: int | None = None,
        window: int = DEFAULT_WINDOW,
        reshuffle_each_iteration: bool = True,
        shard: tuple[int, int] = (0, 1),
        even: bool = True,
        state: Mapping[str, Any] | None = None,
        executor: Executor | None = None,
        pad_last: bool = False,
        transform: Any = None,
        workers: str = "thread",
        num_parallel_reads: int | None = None,
        even_over: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.config = config = LoaderConfig(
            batch_size=batch_size, epochs=epochs, drop_remainder=drop_remainder, cycle_length=cycle_length,
            block_length=block_length, threads=threads, prefetch=prefetch, memory_budget=memory_budget,
            with_index=with_index, shuffle=shuffle, seed=seed, window=window,
            reshuffle_each_iteration=reshuffle_each_iteration, shard=shard, even=even, even_over=even_over,
            pad_last=pad_last,
            workers=workers, num_parallel_reads=num_parallel_reads, transform=transform, executor=executor,
        )  # fmt: skip
        self.batch_size: int = config.batch_size
        self.epochs = config.epochs
        self.drop_remainder = config.drop_remainder
        self.with_index = config.with_index
        self.pad_last = config.pad_last
        self.workers = config.workers
        self.shuffle: Shuffle = config.shuffle or False
        self.seed = config.seed
        self.window: int = config.window
        self.reshuffle_each_iteration = config.reshuffle_each_iteration
        self.shard = config.shard
        self.even = config.even
        fields = dataset.fields
        self.cycle_length = config.cycle_length or default_cycle_length(dataset.num_groups)
        self.block_length = config.block_length or default_block_length(max(f.record_bytes for f in fields.values()))
        self.dtypes = resolve_cast(fields, cast)
        self.shapes = {n: f.shape for n, f in fields.items()}
        if config.with_index:
            self.dtypes[GROUP_KEY] = self.dtypes[INDEX_KEY] = np.dtype(np.int64)
            self.shapes[GROUP_KEY] = self.shapes[INDEX_KEY] = ()
        if config.pad_last:
            self.dtypes[VALID_KEY] = np.dtype(bool)
            self.shapes[VALID_KEY] = ()
        # None scales with the machine: see stoker.machine.default_memory_budget.
        memory_budget = default_memory_budget() if config.memory_budget is None else config.memory_budget
        self.memory_budget = parse_bytes(memory_budget)
        self._remote = any(is_remote(i.path) for infos in dataset.files for i in infos.values())
        self.threads = config.threads or default_threads()
        self._stage = self._transform_stage(config)
        # threads=None: measured on the first pass (stoker.engine.autotune), from 1 per core up to 2.
        self._tune_threads = config.threads is None and executor is None and workers != "process"
        self._tune_prefetch = config.prefetch is None
        self._max_threads = 2 * default_threads() if self._tune_threads else self.threads
        self._size(config, config.memory_budget)  # None shows as None: the default
        self.tuning = ""  # what autotune measured and chose, once it has
        self._climb: ThreadTuner | None = None  # autotune's climb, until done (it spans passes)
        self._executor: Executor = executor or ThreadExecutor(self.threads)
        if workers == "process":
            from .engine.workers import ProcessExecutor

            assert self._stage is not None
            self._executor = ProcessExecutor(self.threads, self._stage, dataset._catalog)
        self._seek_fields: frozenset[str] = frozenset()  # see _check_resident
        if self.shuffle == "global":
            self._check_resident(fields)
        self._plan = Plan(
            dataset.num_groups,
            dataset._catalog.count,
            PlanConfig(
                self.batch_size, self.drop_remainder, self.cycle_length, self.block_length,
                self.shuffle, self.seed, self.window, self.shard, self.even, self.pad_last, config.even_over,
            ),
        )  # fmt: skip
        self._passes: weakref.WeakSet[_Pass] = weakref.WeakSet()
        self._closed = False
        # Builds the batch buffer allocator of each pass from the bytes it may keep pooled;
        # adapters swap in pinned or shared memory here (one buffer path, not two).
        self.allocator_factory: Callable[[int], Allocator] = lambda pooled: AlignedPool(max_pooled_bytes=pooled)
        if workers == "process":
            from .engine.workers import SharedPool

            self.allocator_factory = lambda pooled: SharedPool(max_pooled_bytes=pooled)
        # Where the next pass starts when it is not the pass after the last (a loaded state).
        self._resume: tuple[int, int] | None = None
        self._first_epoch: int | None = None  # the first epoch of the last pass started
        self._delivered: tuple[int, int] = (0, 0)
        self._counters = Counters()
        # Larger than half the RAM: drop pages behind the reader (stoker.io.readahead); output unchanged.
        raw_bytes = sum(i.size for infos in dataset.files for i in infos.values() if i.compression is None)
        self.drop_behind = drop_behind_for(raw_bytes)
        self._keep_between_passes(config)
        self._pool: Allocator | None = None  # the batch buffers, kept between passes (see _pass_pool)
        self._pool_factory: Callable[[int], Allocator] | None = None
        # No finalizer closes the maps when the loader goes: a pass still running holds them
        # through its assembler (`iter(ds.loader(...))` keeps only the pass), and each map is
        # unmapped when its last holder goes (a FileMap unmaps when freed).
        if state is not None:
            self.load_state_dict(state)

    def _size(self, config: LoaderConfig, memory_budget: object) -> None:
        """A batch's bytes, the batches assembled together, and the prefetch the budget holds."""
        self.batch_bytes = sum(
            self.batch_size * math.prod(self.shapes[n]) * self.dtypes[n].itemsize for n in self.dtypes
        )
        if self.batch_bytes > self.memory_budget:
            raise SpecError(
                f"memory_budget={memory_budget!r} ({self.memory_budget} bytes) holds less than one batch "
                f"({self.batch_bytes} bytes for batch_size={self.batch_size}); raise memory_budget or lower batch_size"
                + (address_space_note() if config.memory_budget is None else "")
            )
        fits = self.memory_budget // self.batch_bytes
        self._parts = 1  # batches assembled together (see COALESCE_BYTES); set below
        # What the default prefetch takes half of: the batches the budget holds beside the
        # decoded files the loader keeps (at most KEPT_DECODED_BYTES, an eighth of what
        # prefetch leaves; see _kept_decoded), so the pool can recycle as many batches as are
        # in flight: halving `fits` alone left it one short where the budget binds, and the
        # pool then made a fresh buffer for some batches.
        self._fits = max(0, self.memory_budget - min(KEPT_DECODED_BYTES, self.memory_budget // 8)) // self.batch_bytes
        if config.prefetch is None:
            # See stoker.engine.autotune.default_prefetch (measured there), in batches assembled
            # together (see COALESCE_BYTES). Autotuned threads: reserved for the most workers
            # it may reach.
            self._parts = self._coalesced(config.pad_last, config.executor)
            unit = self._parts * self.batch_bytes
            self.prefetch = self._parts * default_prefetch(self._max_threads, unit, self._fits // self._parts)
        else:
            self.prefetch = config.prefetch
            if self.prefetch > fits:
                raise SpecError(
                    f"prefetch={config.prefetch} batches of {self.batch_bytes} bytes exceed "
                    f"memory_budget={memory_budget!r} ({self.memory_budget} bytes); at most {fits} fit"
                )

    def _keep_between_passes(self, config: LoaderConfig) -> None:
        """What the loader keeps for its passes: maps, decoded files, the remote reads' room."""
        # Memory maps of files read, kept from one pass to the next (a pass per epoch is how
        # PyTorch loops and Keras' fit iterate), holding no file open; unmapped by close() or
        # once the loader and its passes are gone, so a later pass does not map and fault
        # them in again.
        self._kept_maps = loader_kept_maps()
        self._open_files: str | None = None  # what a global shuffle did about open files (_keep_files_open)
        # Compressed files decoded whole (labels), kept from one epoch and pass to the next
        # (stoker.engine.decoded.KeptDecoded), within an eighth of what the batches in flight leave of
        # the memory budget; the buffer pool keeps the rest (see _start_pass).
        self._kept_decoded = KeptDecoded(max(0, min(KEPT_DECODED_BYTES, self._spare_bytes // 8)))
        # Ranged GETs of files behind URLs kept in flight (stoker.io.fetch), whatever `threads`; their
        # bytes come out of half of what prefetch leaves of the budget.
        room = self._spare_bytes // 2 if self._remote else 1 << 62
        self.num_parallel_reads, self._part_bytes = parallel_reads(config.num_parallel_reads, room)
        self._fetch_bytes = self.num_parallel_reads * self._part_bytes if self._remote else 0

    def _transform_stage(self, config: LoaderConfig) -> Stage | None:
        """The transforms bound to seed and shard; what batches look like after them (see transforms)."""
        self._assembly_dtypes = dict(self.dtypes)
        if config.transform is None:
            return None
        stage = Stage(
            config.transform,
            seed=config.seed,
            shard=config.shard,
            records={n: (self.shapes[n], self.dtypes[n]) for n in self.dtypes},
            stored={n: f.native_dtype for n, f in self.dataset.fields.items()},
        )
        self._assembly_dtypes.update(stage.assembly)
        if stage.exact:  # only built-ins: what is delivered is known
            self.dtypes = {n: d for n, (_, d) in stage.records.items()}
            self.shapes = {n: s for n, (s, _) in stage.records.items()}
        return stage

    def _coalesced(self, pad_last: bool, executor: Executor | None) -> int:
        """Batches assembled together (see COALESCE_BYTES): 1 unless batches are small.

        Only on the default path, where a failed assembly can be done again batch by batch
        (see _assemble_parts): thread workers and no transforms (they draw per batch), no
        padding, the prefetch left to stoker (it is counted in these units). Each part must
        start 64-byte aligned, as a batch of its own does (TensorFlow takes only such memory
        without a copy). At most what leaves the memory budget room for the default look-ahead.
        """
        if executor is not None or self._stage is not None or self.workers != "thread" or pad_last:
            return 1
        if any(self.batch_size * math.prod(self.shapes[n]) * self.dtypes[n].itemsize % ALIGNMENT for n in self.dtypes):
            return 1
        # About COALESCE_BYTES: a W1 batch is 16 MiB and its labels' 1 KiB, four of them one.
        target = COALESCE_REMOTE_BYTES if self._remote else COALESCE_BYTES
        parts = max(1, min(MAX_COALESCE, round(target / self.batch_bytes)))
        # The budget must hold twice a look-ahead of one assembly per starting worker plus the
        # consumer's spares (batches it takes per wake-up: an assembly holds `parts` of them).
        while parts > 1 and self._fits // parts < 2 * (self.threads + -(-SPARE // parts)):
            parts -= 1
        return parts

    @property
    def _spare_bytes(self) -> int:
        """What the batches in flight (`prefetch` of them) leave of `memory_budget`."""
        return self.memory_budget - self.prefetch * self.batch_bytes

    def _check_resident(self, fields: Mapping[str, Any]) -> None:
        """Global shuffle reads compressed fields from memory: they must fit the budget."""
        compressed = [n for n in fields if any(i[n].compression is not None for i in self.dataset.files)]
        if not compressed:
            return
        total = len(self.dataset)
        need = sum(total * fields[n].record_bytes for n in compressed)
        allowed = self._spare_bytes
        if need > allowed:
            # Too large to hold: fields a persistent index covers are read record by record from
            # its seek points instead (slower per record, bounded memory); the rest must fit.
            catalog = self.dataset._catalog
            self._seek_fields = frozenset(
                n for n in compressed
                if all((g, n) in catalog.seek_points for g, i in enumerate(catalog.files) if i[n].compression)
            )  # fmt: skip
            compressed = [n for n in compressed if n not in self._seek_fields]
            need = sum(total * fields[n].record_bytes for n in compressed)
        if need > allowed:
            raise SpecError(
                f"shuffle='global' keeps compressed field(s) {compressed} decompressed in memory: {need} bytes, "
                f"more than the {allowed} bytes memory_budget={self.memory_budget} leaves after prefetch; "
                "raise memory_budget, store those fields uncompressed, index them with `stoker index` (then they "
                "are read through seek points), or use shuffle='files' (any compression)",
                field=compressed[0], path=self.dataset.files[0][compressed[0]].path,
            )  # fmt: skip

    # -- resume ----------------------------------------------------------------------
    def _fingerprint_parts(self) -> dict[str, object]:
        ds = self.dataset
        parts: dict[str, object] = {
            "counts": [ds.records_in(g) for g in range(ds.num_groups)],
            "fields": {n: [f.dtype.str, list(f.shape), f.header_bytes, f.footer_bytes] for n, f in ds.fields.items()},
            "basenames": [[os.path.basename(i.path) for i in infos.values()] for infos in ds.files],
            "shuffle": self.shuffle,
            "seed": self.seed,
            "window": self.window if self.shuffle == "files" else None,
            "drop_remainder": self.drop_remainder,
            "interleave": [self.cycle_length, self.block_length],
            # Not batch_size, shard or even: they may change on resume (elastic), since the
            # position counts records of the epoch's global sequence, whoever takes them.
        }
        subset = ds._subset_key()
        if subset is not None:  # which groups and records of the files a subset holds
            parts["subset"] = subset
        return parts

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: after the last batch `__next__` returned.

        Small and JSON-serializable. Batches prefetched but not yet returned are not
        counted, so nothing is skipped on resume. `position` counts records of the
        epoch's global sequence; batch_size and shard may change on resume (elastic).
        Once a pass has ended, the loader stands at the start of the next pass, so a loop
        that saves after each pass resumes with the pass it had not begun.
        """
        return self._state_dict_at(self._delivered)

    @property
    def position(self) -> tuple[int, int]:
        """`(epoch, position)` after the last batch `__next__` returned (the start of a pass
        not yet delivered from, once `iter()` has begun it or the pass before has ended).

        Adapters that run ahead of their user (device prefetch, worker processes) keep this
        with each batch and save `_state_dict_at` the position their user actually reached.
        """
        return self._delivered

    def _state_dict_at(self, where: tuple[int, int]) -> dict[str, Any]:
        epoch, position = where
        parts = self._fingerprint_parts()
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shard": list(self.shard),
            "fingerprint": fingerprint(parts),
            "parts": {k: fingerprint({k: v}) for k, v in parts.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state`: the next `iter()` continues right after the saved batch."""
        self._resume = self._delivered = self._checked_state(state)

    def _checked_state(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """`(epoch, position)` of a state this loader can resume from, or a StateError saying why not.

        Types are exact (`True` is not a position) and ranges checked, so a crafted or
        damaged state is an error here rather than a short or empty run.
        """
        first = self.dataset.files[0][next(iter(self.dataset.fields))].path if self.dataset.files else None
        if not isinstance(state, Mapping) or not _is_int(state.get("version")) or state["version"] != STATE_VERSION:
            raise StateError(
                f"not a stoker loader state (version {STATE_VERSION} expected): {state!r:.200}", path=first
            )

        # Every count and position of a state below 2**63: what int64 arrays, and the
        # frameworks that carry a state as tensors, hold.
        def small(key: str, least: int = 0) -> bool:
            return _is_int(state.get(key), least=least) and state[key] < 1 << 63

        shard: Any = state.get("shard")
        for key, ok, what in (
            ("fingerprint", isinstance(state.get("fingerprint"), str), "a string"),
            ("parts", _is_digests(state.get("parts")), "a mapping of part names to digests"),
            ("epoch", small("epoch"), "a non-negative integer below 2**63"),
            ("position", small("position"), "a non-negative integer below 2**63"),
            ("seed", state.get("seed") is None or _is_int(state["seed"]), "a non-negative integer or None"),
            ("batch_size", small("batch_size", 1), "a positive integer below 2**63"),
            ("shard", _is_shard(shard) and shard[1] < 1 << 63, "[index, count] with 0 <= index < count < 2**63"),
        ):
            if not ok:
                raise StateError(f"state has {key}={state.get(key)!r:.200}; it must be {what}", path=first)
        parts = self._fingerprint_parts()
        if state["fingerprint"] != fingerprint(parts):
            saved = state["parts"]
            differ = [k for k, v in parts.items() if saved.get(k) != fingerprint({k: v})]
            raise StateError(
                f"the saved state belongs to a different dataset or loader configuration; differs in: "
                f"{', '.join(differ) or 'unknown parts'} (dataset's first file {first!r})",
                path=first,
            )
        if state["seed"] != self.seed:  # the fingerprint holds this loader's seed, not the state's
            raise StateError(
                f"state has seed={state['seed']!r:.200}, this loader's seed is {self.seed!r} (dataset's first file "
                f"{first!r})",
                path=first,
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if not self.reshuffle_each_iteration and self.epochs is not None and epoch >= self.epochs:
            raise StateError(
                f"state has epoch={epoch}, past this loader's epochs={self.epochs} (with reshuffle_each_iteration"
                "=False every pass covers epochs 0 .. epochs-1)",
                path=first,
            )
        # A shard's last batch may leave its position up to count - 1 past the epoch's end
        # (its next position is beyond it); that and the end itself mean the epoch is done.
        total = len(self.dataset)  # counts settled by the fingerprint already
        count = int(state["shard"][1])
        # More shards than records leave a shard nothing to read; a larger count would let a
        # state's position run past the epoch's end by as much, and end the epoch early.
        if count > max(total, self.shard[1]):
            raise StateError(
                f"state has shard={list(state['shard'])}: {count} shards of an epoch of {total} records (and this "
                f"loader's shard={list(self.shard)}); a state's shard count is at most the record count, or this "
                f"loader's own (dataset's first file {first!r})",
                path=first,
            )
        if position > total + count - 1:
            raise StateError(
                f"state has position={position}, past the end of epoch {epoch} ({total} records, "
                f"saved by shard {list(state['shard'])})",
                path=first,
            )
        return epoch, min(position, total)

    def __len__(self) -> int:
        """Batches per epoch for this shard (settles every group's record count)."""
        total = len(self.dataset)
        if self.pad_last:
            return self._plan.padded_batches(total)
        mine = shard_take(total, self.shard, even=self.even, even_over=self.config.even_over)
        return self._plan.batches_per_epoch(mine)

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise SpecError("this loader is closed; make a new one with dataset.loader(...)")
        for p in list(self._passes):
            p.supersede()
        start = self._next_start()
        p = self._start_pass(start, pass_end(start[0], self.epochs, reshuffle=self.reshuffle_each_iteration))
        self._resume = None  # a loaded state applies to the next pass only
        self._first_epoch = start[0]
        self._delivered = start
        self._passes.add(p)
        return p

    def _start_pass(self, start: tuple[int, int], stop: int | None) -> _Pass:
        """A pass over epochs `start[0] .. stop - 1` (None: forever) from position `start[1]`:
        its assembler's parts, the assembler, the planned tasks and the executor's map, built
        here and handed to the pass."""
        pooled = self._spare_bytes - self._kept_decoded.limit - self._fetch_bytes
        pool, own_pool = self._pass_pool(pooled)
        ds = self.dataset
        self._keep_files_open()  # before the assembler's open-file table reads the descriptor limit
        stop_flag = StopFlag()  # one stop event: a worker waiting for its turn on a stream wakes when the map closes
        parts = build_parts(
            ds._catalog, {n: self._assembly_dtypes[n] for n in ds.fields},
            fetcher=Fetcher(self.num_parallel_reads, ahead_bytes=self._fetch_bytes, part_bytes=self._part_bytes),
            counters=self._counters,
            readahead=Readahead(drop_behind=self.drop_behind, gathers=self.shuffle == "global"),
            stop=stop_flag, seek_fields=self._seek_fields, kept_maps=self._kept_maps, kept_decoded=self._kept_decoded,
        )  # fmt: skip
        assembler = ds._assembler(
            {n: self._assembly_dtypes[n] for n in ds.fields}, pool, parts, batch_size=self.batch_size,
            with_index=self.with_index, fused=self._stage,  # built-in transforms run as records are read
        )  # fmt: skip
        plans: Iterator[BatchPlan] = self._plan.batches(stop, first_epoch=start[0], start=start[1])
        # Batches assembled together (see COALESCE_BYTES): the engine, its look-ahead and
        # autotune count these units; the pass hands their parts out one by one.
        units = self._parts
        if units > 1:
            plans = _units(plans, units, assembler.redoable)
        if self.workers == "thread":  # worker processes read for themselves
            plans = assembler.fetching_ahead(plans)
        tasks: Iterator[Task] = map(assembler.prepare, plans)
        if parts.readahead.gathers_ahead:
            per_task = self.batch_size * units * sum(f.record_bytes for f in ds.fields.values())
            tasks = _advising_ahead(tasks, max(1, AHEAD_BYTES // per_task))
        work: Callable[[Task], Any] = assembler
        if units > 1:
            work = functools.partial(_assemble_parts, assembler)
        if self._stage is not None and self.workers == "thread":
            work = self._stage.bind(assembler, pool.array, ds._catalog)
        tuner: ThreadTuner | None = None
        window = self.prefetch // units
        if self._tune_threads and not self.tuning:
            # A pass that ended before the climb did (a pass per epoch of a small dataset) hands
            # it on: this pass goes on from the worker count it stood at, with a fresh start-up
            # window, since a new climb each pass would start from a trial count and, at the
            # maximum, stop there unmeasured.
            if self._climb is None:
                self._climb = ThreadTuner(start=self.threads, max_threads=self._max_threads,
                                          tune_prefetch=self._tune_prefetch, fits=self._fits // units,
                                          batch_bytes=self.batch_bytes * units)  # fmt: skip
            else:
                self._climb.new_pass()
                if self._executor.resizable:  # the count the climb stands at
                    self._executor.threads = self._climb.threads
            tuner = self._climb
            window = tuner.prefetch_for(self.threads) if self._tune_prefetch else window
        # The assembler's first step that may give the GIL up or block is a copy kernel, or it
        # flushes the wake-up before (stoker.engine.flush_wake): deferred wake-ups apply.
        batches = self._executor.map_ordered(work, tasks, window=window, defer_wake=True, stop=stop_flag)
        batches.add_cleanup(assembler.close)
        if own_pool:
            batches.add_cleanup(pool.clear)
        return _Pass(
            batches, assembler, pool if own_pool else None, units=units, counters=self._counters, tuner=tuner,
            report=_Report(self), pool_of=pool,
        )  # fmt: skip

    def _next_start(self) -> tuple[int, int]:
        """`(epoch, position)` the next pass starts from: a loaded state's, else the pass after the last."""
        if self._resume is not None:
            return self._resume
        if self._first_epoch is None:
            return (0, 0)
        last = self._delivered[0]
        return (next_pass(self._first_epoch, last, self.epochs, reshuffle=self.reshuffle_each_iteration), 0)

    def _pass_pool(self, pooled: int) -> tuple[Allocator, bool]:
        """The batch buffers for a new pass, and whether the pass owns them (clears them when done).

        With worker threads the loader keeps one pool for all its passes: a pass per epoch (a
        PyTorch loop, Keras' fit) then starts on the buffers of the last one, whose pages are
        mapped already, instead of faulting in fresh ones. At most `pooled` bytes are kept for reuse, as in a pass;
        `close()` lets them go. A pool built by another `allocator_factory` (an adapter asking
        for pinned memory) replaces it.
        """
        if self.workers != "thread":  # worker processes map buffers by descriptor, per pass
            return self.allocator_factory(pooled), True
        if self._pool is None or self._pool_factory is not self.allocator_factory:
            if self._pool is not None:
                self._pool.clear()
            self._pool, self._pool_factory = self.allocator_factory(pooled), self.allocator_factory
        elif isinstance(self._pool, AlignedPool):
            self._pool.max_pooled_bytes = pooled
        return self._pool, False

    def stats(self) -> LoaderStats:
        """Counters since this loader's first batch: records, bytes, time per stage, waits, CPU.

        Cheap enough to leave on (a few clock reads per batch). `print(loader.stats())`
        shows one screen; `stoker.doctor.verdict` says what limits the pipeline.
        """
        return self._counters.snapshot(
            threads=self.threads,
            prefetch=self._shown_prefetch(),
            batch_size=self.batch_size,
            record_bytes={n: f.record_bytes for n, f in self.dataset.fields.items()},
            dtypes={n: self.dtypes[n].name for n in self.dataset.fields},
            tuning={
                "readahead": self._readahead_said(),
                **({"open files": self._open_files} if self._open_files else {}),
                **({"autotune": self.tuning} if self.tuning else {}),
            },
            memory_budget=self.memory_budget,
            batch_bytes=self.batch_bytes,
            coalesced=self._parts,
            cycle_length=self.cycle_length,
            block_length=self.block_length,
            prefetch_limited=self._held_down(),
            buffers_made=getattr(self._pool, "allocated", 0),
        )

    def _keep_files_open(self) -> None:
        """A global shuffle reads from most of the dataset's raw files in every batch: raise the
        soft descriptor limit so a pass keeps them all open (stoker.engine.descriptors.raise_open_files),
        once per loader; what was done, or why not, shows in stats' `tuning`."""
        if self.shuffle != "global" or self._open_files is not None:
            return
        wanted = sum(
            1 for infos in self.dataset.files for i in infos.values() if i.compression is None and not is_remote(i.path)
        )
        raised = raise_open_files(wanted)
        kept = pass_open_files()
        if raised is not None:
            self._open_files = f"descriptor soft limit raised from {raised[0]} to {raised[1]} to keep {wanted} open"
        elif kept < wanted:
            self._open_files = (
                f"{kept} of {wanted} open at once, the others reopened as batches need them "
                "(at most a quarter of the descriptor limit, and 1024)"
            )
        else:
            self._open_files = ""

    def _readahead_said(self) -> str:
        """What stoker.io.readahead does for this loader, in a few words (stats' `tuning`)."""
        if self.shuffle != "global":
            return "willneed ahead" + (", drop behind (larger than RAM/2)" if self.drop_behind else "")
        if self.drop_behind:
            return "willneed on each record a few batches ahead, maps MADV_RANDOM (larger than RAM/2)"
        return "the kernel's read-around (fits in RAM/2)"

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
        if self._pool is not None:
            self._pool.clear()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Loader(batch_size={self.batch_size}, epochs={self.epochs}, cycle_length={self.cycle_length}, "
            f"block_length={self.block_length}, threads={self.threads}, prefetch={self._shown_prefetch()})"
        )

    def _pass_batches(self) -> int | None:
        """Batches a pass yields, where that is known without reading a file (None: not yet
        known, or it never ends)."""
        if self.epochs is None or not self.dataset._catalog.settled():
            return None
        return len(self) * self.epochs

    def _shown_prefetch(self) -> int:
        """Batches that can be in flight: `prefetch`, and no more than the data holds."""
        data = self._pass_batches()
        return self.prefetch if data is None else min(self.prefetch, data)

    def _held_down(self) -> bool:
        """Whether memory_budget held a prefetch stoker chose below its default, with batches
        delivered and more data than the prefetch it allowed (else there is nothing to hold)."""
        if not self._tune_prefetch or self._counters.batches == 0:
            return False
        data = self._pass_batches()
        wanted = self._parts * wanted_prefetch(self.threads, self._parts * self.batch_bytes)
        return self.prefetch < wanted and (data is None or data > self.prefetch)


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
        return self.loader._state_dict_at(self._position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state`: the next `iter()` continues right after the saved batch."""
        self.loader.load_state_dict(state)
        self._position = self.loader.position


def _is_int(value: object, *, least: int = 0) -> bool:
    """An integer (not a bool, which Python counts as one) of at least `least`."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= least)


def _is_shard(value: object) -> bool:
    return (
        isinstance(value, list | tuple) and len(value) == 2 and all(_is_int(v) for v in value)
        and 0 <= value[0] < value[1]
    )  # fmt: skip


def _is_digests(value: object) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _shutdown(
    batches: OrderedMap[tuple[Batch, BatchPlan]], assembler: Assembler, pool: Allocator | None, born: int
) -> None:
    # Idempotent, and safe to run again after a Ctrl-C cut it short (see stoker.engine.executor._State):
    # the stop flag first, then the join; the files are also closed by the last worker out.
    # `pool`: the pass's own, cleared with it (None: the loader's, kept for its next pass).
    if born != fork_generation():
        return  # a forked child's copy: the threads, files and buffers are the parent pass's
    assembler.stop.set()
    batches.close()
    assembler.close()
    if pool is not None:
        pool.clear()


def _units(plans: Iterator[BatchPlan], parts: int, redoable: Callable[[BatchPlan], bool]) -> Iterator[BatchPlan]:
    """`plans` with up to `parts` consecutive batches of one epoch coalesced into one
    (stoker.plan.coalesce), where each can be assembled again on its own (`redoable`); a
    batch that cannot (padding, a compressed stream read in turns) goes alone.

    A planning error comes after the batches planned before it, as it does without this.
    """
    unit: list[BatchPlan] = []
    try:
        for plan in plans:
            if plan.valid is not None or not redoable(plan):
                if unit:
                    yield _one(unit)
                    unit = []
                yield plan
                continue
            if unit and (unit[0].epoch != plan.epoch or (unit[0].gather is None) != (plan.gather is None)):
                yield _one(unit)
                unit = []
            unit.append(plan)
            if len(unit) == parts:
                yield _one(unit)
                unit = []
    except GeneratorExit:
        raise
    except BaseException:
        if unit:
            yield _one(unit)
        raise
    if unit:
        yield _one(unit)


def _one(plans: Sequence[BatchPlan]) -> BatchPlan:
    return plans[0] if len(plans) == 1 else coalesce(plans)


class _Parts:
    """What a worker makes of coalesced batches: each part's batch, in order, and the error of
    the first part that failed (the parts after it are not made)."""

    __slots__ = ("batches", "error", "rows")

    def __init__(self, batches: list[tuple[Batch, BatchPlan]], error: BaseException | None, rows: int) -> None:
        self.batches = batches
        self.error = error
        self.rows = rows


def _assemble_parts(assembler: Assembler, task: Task) -> Any:
    """Assemble a task; coalesced batches once as one, then split into their parts (views).

    Where that fails, the parts are assembled again one by one, so every batch before the
    failing one is delivered and the error is raised at the batch that holds the bad record,
    as it is without coalescing. (A failure ends the pass there: a file the failed assembly
    still had planned stays open until then.)
    """
    plan = task.plan
    if plan.parts is None:
        return assembler(task)
    try:
        out, _ = assembler(task)
    except Stopped:
        raise
    except BaseException:
        batches: list[tuple[Batch, BatchPlan]] = []
        for part in plan.parts:
            one = assembler.prepare(part)
            try:
                batches.append(assembler(one))
            except Stopped:
                raise
            except BaseException as e:
                e.add_note(f"stoker: raised in thread {threading.current_thread().name} on {one!r}")
                return _Parts(batches, e, plan.rows)
        return _Parts(batches, None, plan.rows)
    split: list[tuple[Batch, BatchPlan]] = []
    row = 0
    for part in plan.parts:
        split.append(({name: arr[row : row + part.rows] for name, arr in out.items()}, part))
        row += part.rows
    return _Parts(split, None, plan.rows)


def _advising_ahead(tasks: Iterator[Task], depth: int) -> Iterator[Task]:
    """`tasks`, each asking the disk for the records of the one `depth` after it first (the
    first for its own and the `depth` after it): a global shuffle's records, read from a
    dataset larger than RAM/2, are on their way by the time a worker copies them (measured:
    benchmarks/results/w1_big_history.md).

    A planning error comes after the tasks planned before it, as without the look-ahead.
    """
    waiting: collections.deque[Task] = collections.deque()
    first = True
    error: BaseException | None = None
    while True:
        try:
            task = next(tasks)
        except StopIteration:
            break
        except BaseException as e:  # a planning error: raised once the tasks before it are out
            error = e
            break
        waiting.append(task)
        if len(waiting) > depth:
            head = waiting.popleft()
            head.ahead = (head.plan, *(t.plan for t in waiting)) if first else (task.plan,)
            first = False
            yield head
    if first and waiting:  # fewer than depth + 1 tasks: the first asks for them all
        waiting[0].ahead = tuple(t.plan for t in waiting)
    while waiting:  # asked for already
        yield waiting.popleft()
    if error is not None:
        raise error


class _Report:
    """What a pass tells its loader: where its user stands, and what autotune measured. Held
    weakly, so a pass (`iter(ds.loader(...))` keeps only the pass) does not keep its loader."""

    __slots__ = ("_loader",)

    def __init__(self, loader: Loader) -> None:
        self._loader = weakref.ref(loader)

    def alive(self) -> bool:
        return self._loader() is not None

    def delivered(self, where: tuple[int, int]) -> None:
        loader = self._loader()
        if loader is not None:
            loader._delivered = where

    def ended(self) -> None:
        """The plan's end: the loader stands at the start of the next pass."""
        loader = self._loader()
        if loader is not None:
            loader._delivered = loader._next_start()

    def tuned(self, tuner: ThreadTuner, units: int) -> None:
        """Autotune stands at `tuner`'s worker count; once it is done, later passes start there."""
        loader = self._loader()
        if loader is None:
            return
        loader.threads = tuner.threads
        if tuner.done:
            loader._climb = None
            loader.tuning = tuner.summary()
            if loader._executor.resizable:
                loader._executor.threads = tuner.threads
            if loader._tune_prefetch:
                loader.prefetch = tuner.prefetch_for(tuner.threads) * units


class _Pass:
    """One pass over the loader's epochs: the iterator `iter(loader)` returns.

    It hands out the results of the executor's map (`batches`, built with `assembler` by
    `Loader._start_pass`), the parts of coalesced units one by one, and tells its loader where
    its user stands through `report`. `pool`: the pass's own buffers, cleared with it (None: the
    loader's); `pool_of`: the buffers it draws from, whichever (autotune watches their count).
    """

    def __init__(
        self, batches: OrderedMap[Any], assembler: Assembler, pool: Allocator | None, *, units: int,
        counters: Counters, tuner: ThreadTuner | None, report: _Report, pool_of: Allocator,
    ) -> None:  # fmt: skip
        self._closed = False  # by close(), its end or an error: a later next() is StopIteration
        self._superseded = False  # ended by a newer pass: a later next() raises SupersededError
        self._batches = batches
        self._assembler = assembler
        self._pool = pool_of
        self._parts = units
        self._counters = counters
        self._tuner = tuner
        self._report = report
        self._last: float | None = None  # when __next__ last returned a batch
        self._ready: collections.deque[tuple[Batch, BatchPlan]] = collections.deque()
        self._failed: BaseException | None = None  # raised once the parts before it are out
        self._born, self._pid = fork_generation(), os.getpid()  # a fork()ed child inherits this pass, not its threads
        self._finalizer = weakref.finalize(self, _shutdown, batches, assembler, pool, self._born)

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Batch:
        if self._born != fork_generation():
            raise forked_pass(self._pid)
        if self._superseded:
            raise SupersededError(
                "this iterator's pass was ended by a newer iter() on the same loader, which runs one pass at a "
                "time (zip(loader, loader) or two loops over one loader interleaved); iterate two loaders made "
                "with dataset.loader(...) to read two passes side by side"
            )
        asked = time.perf_counter()
        try:  # all of it: a Ctrl-C landing anywhere in here ends the pass with its threads
            unit_rows = 0  # a unit taken from the engine now: its rows, for autotune
            if self._ready:
                try:
                    batch, plan = self._ready.popleft()
                except IndexError:  # close() from another thread emptied it meanwhile
                    raise StopIteration from None
            elif self._failed is not None:  # the parts before it are out: now the error
                failed, self._failed = self._failed, None
                raise failed
            else:
                try:
                    result = next(self._batches)
                except StopIteration:
                    if not self._closed:  # the plan's end: stand at the next pass
                        self._report.ended()
                    raise
                if isinstance(result, _Parts):
                    unit_rows = result.rows
                    if not result.batches:  # its first batch failed
                        assert result.error is not None
                        raise result.error
                    self._ready.extend(result.batches)
                    self._failed = result.error
                    batch, plan = self._ready.popleft()
                else:
                    batch, plan = result
                    unit_rows = plan.rows
            got = time.perf_counter()
            self._counters.delivered(batch, plan.rows, asked, got, self._last)
            if self._tuner is not None and unit_rows:
                self._tune(asked, got, unit_rows)
            self._last = got
            self._report.delivered((plan.epoch, plan.position))
        except BaseException:
            self.close()
            raise
        return batch

    def _tune(self, asked: float, got: float, rows: int) -> None:
        tuner = self._tuner
        assert tuner is not None
        if not self._report.alive():  # nobody to tell what it measured
            return
        tuner.observe(self._batches, asked, got, self._last, rows, getattr(self._pool, "allocated", 0))
        self._report.tuned(tuner, self._parts)
        if tuner.done:  # later passes start with the measured values
            self._tuner = None

    def supersede(self) -> None:
        """End this pass for a newer one; a pass still open then says so at its next `next()`."""
        if not self._closed:
            self._superseded = True
        self.close()

    def close(self) -> None:
        self._closed = True
        run_finalizer(self._finalizer)  # armed until done: a later close() or GC finishes an interrupted one
        self._ready.clear()  # batches of an assembly not handed out: their buffer goes with the pass
