"""A loader's passes: the stages a batch goes through, the ordered map that runs them, what a
pass reports to its loader, and the state that carries across passes (where the user stands,
autotune's worker count and prefetch).

`Pipeline.start` wires one pass: the reader of the catalog (stoker.engine.reader.open_reader,
an assembler and its parts), the planned tasks (coalesced, fetched ahead, advised ahead) and the executor's
map, handed to a `Pass`, the iterator `iter(loader)` returns. `Workers` says once what differs
between worker threads and worker processes, so nothing above branches on `workers`.

Remote bytes: a pass that has asked for all of its own asks for the first ones of the loader's
next pass while it delivers its last batches (stoker.engine.ahead.NextPass); the pass that starts
next with the same plans goes on from there with the same fetcher (`Handoff`, `NextSlot`), so
its first batch need not wait for requests made only when it starts.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import SupersededError
from ..io.fetch import Fetcher
from ..io.readahead import AHEAD_BYTES, Readahead
from ..plan.batches import BatchPlan, coalesce, next_pass
from .ahead import NextPass
from .assembler import Assembler, Task
from .autotune import ThreadTuner, wanted_prefetch
from .decoded import KeptDecoded
from .executor import (
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
from .fusion import Stage
from .maps import KeptMaps
from .reader import open_reader
from .stats import ConsumerClock, Counters

if TYPE_CHECKING:
    from ..io.files import Catalog

__all__ = ["Autotune", "Cursor", "Handoff", "NextSlot", "Pass", "Pipeline", "Workers", "advising_ahead"]

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class Workers:
    """What differs between worker threads and worker processes, decided once per loader.

    `in_process`: tasks run on threads of this process, which keep one buffer pool across
    passes, fetch remote bytes ahead and run the transform stage themselves; worker processes
    map each pass's shared buffers by descriptor and run the stage there. `given`: an executor
    from the caller, which autotune and coalescing leave alone.
    """

    in_process: bool
    given: Executor | None = None

    @classmethod
    def of(cls, workers: str, executor: Executor | None) -> Workers:
        """For `workers` ("thread" or "process", checked by LoaderConfig) and the caller's executor."""
        return cls(workers == "thread", executor)

    @property
    def tunable(self) -> bool:
        """Whether autotune may climb the worker count (processes start with the map, one per worker)."""
        return self.in_process and self.given is None

    def executor(self, threads: int, stage: Stage | None, catalog: Catalog) -> Executor:
        if self.in_process:
            return self.given or ThreadExecutor(threads)
        from .workers import ProcessExecutor

        assert stage is not None  # LoaderConfig: workers="process" needs transforms
        return ProcessExecutor(threads, stage, catalog)

    def allocator(self, pooled: int) -> Allocator:
        """A pass's batch buffers by default, keeping at most `pooled` bytes for reuse."""
        if self.in_process:
            return AlignedPool(max_pooled_bytes=pooled)
        from .workers import SharedPool

        return SharedPool(max_pooled_bytes=pooled)


class Cursor:
    """Where a loader's user stands, `(epoch, position)` after the last batch delivered, and
    where its next pass starts: a loaded state's position, else the pass after the last."""

    def __init__(self, epochs: int | None, *, reshuffle: bool) -> None:
        self.epochs, self.reshuffle = epochs, reshuffle
        self.delivered: tuple[int, int] = (0, 0)
        self.resume: tuple[int, int] | None = None  # a loaded state: the next pass only
        self.first_epoch: int | None = None  # the first epoch of the last pass started

    def next_start(self) -> tuple[int, int]:
        if self.resume is not None:
            return self.resume
        if self.first_epoch is None:
            return (0, 0)
        return (next_pass(self.first_epoch, self.delivered[0], self.epochs, reshuffle=self.reshuffle), 0)

    def load(self, where: tuple[int, int]) -> None:
        self.resume = self.delivered = where

    def begin(self, start: tuple[int, int]) -> None:
        self.resume = None
        self.first_epoch = start[0]
        self.delivered = start


class Autotune:
    """Worker count and prefetch of a loader's passes: what it was given, or what autotune
    (stoker.engine.autotune.ThreadTuner) measures. A climb that a pass ended before it was done
    (a pass per epoch of a small dataset) goes on in the next pass from the count it stood at,
    with a fresh start-up window; a new climb each pass would start from a trial count and, at
    the maximum, stop there unmeasured. Once done, later passes start with the measured values.
    """

    def __init__(
        self, executor: Executor, *, threads: int, prefetch: int, tune_threads: bool, tune_prefetch: bool,
        max_threads: int, fits: int, batch_bytes: int,
    ) -> None:  # fmt: skip
        self.threads, self.prefetch = threads, prefetch
        self.tune_threads, self.tune_prefetch = tune_threads, tune_prefetch
        self.max_threads = max_threads
        self.tuning = ""  # what autotune measured and chose, once it has
        self.climb: ThreadTuner | None = None  # until done
        self._executor = executor
        self._fits, self._batch_bytes = fits, batch_bytes

    def for_pass(self, units: int) -> tuple[ThreadTuner | None, int]:
        """The climb a new pass goes on with (None: nothing to tune), and its look-ahead window in units."""
        if not self.tune_threads or self.tuning:
            return None, self.prefetch // units
        if self.climb is None:
            self.climb = ThreadTuner(start=self.threads, max_threads=self.max_threads,
                                     tune_prefetch=self.tune_prefetch, fits=self._fits // units,
                                     batch_bytes=self._batch_bytes * units)  # fmt: skip
        else:
            self.climb.new_pass()
            if self._executor.resizable:  # the count the climb stands at
                self._executor.threads = self.climb.threads
        window = self.climb.prefetch_for(self.threads) if self.tune_prefetch else self.prefetch // units
        return self.climb, window

    def held_down(self, units: int, batch_bytes: int, batches: int | None) -> bool:
        """Whether memory_budget held a prefetch stoker chose below its default (`units` batches
        of `batch_bytes` assembled together), where a pass of `batches` (None: unknown or
        endless) holds more than the prefetch allowed (else there is nothing to hold)."""
        if not self.tune_prefetch:
            return False
        wanted = units * wanted_prefetch(self.threads, units * batch_bytes)
        return self.prefetch < wanted and (batches is None or batches > self.prefetch)

    def tuned(self, tuner: ThreadTuner, units: int) -> None:
        """Autotune stands at `tuner`'s worker count; once it is done, later passes start there."""
        self.threads = tuner.threads
        if tuner.done:
            self.climb = None
            self.tuning = tuner.summary()
            if self._executor.resizable:
                self._executor.threads = tuner.threads
            if self.tune_prefetch:
                self.prefetch = tuner.prefetch_for(tuner.threads) * units


class Report:
    """What a pass tells its loader: where its user stands, and what autotune measured. Both
    held weakly, so a pass (`iter(ds.loader(...))` keeps only the pass) does not keep its loader."""

    __slots__ = ("_autotune", "_cursor")

    def __init__(self, cursor: Cursor, autotune: Autotune) -> None:
        self._cursor = weakref.ref(cursor)
        self._autotune = weakref.ref(autotune)

    def alive(self) -> bool:
        return self._cursor() is not None

    def delivered(self, where: tuple[int, int]) -> None:
        cursor = self._cursor()
        if cursor is not None:
            cursor.delivered = where

    def ended(self) -> None:
        """The plan's end: the loader stands at the start of the next pass."""
        cursor = self._cursor()
        if cursor is not None:
            cursor.delivered = cursor.next_start()

    def tuned(self, tuner: ThreadTuner, units: int) -> None:
        autotune = self._autotune()
        if autotune is not None:
            autotune.tuned(tuner, units)


class NextSlot:
    """A loader's next pass, asked for by the pass before it (stoker.engine.ahead.NextPass), held
    until a pass with its key takes it; any other start, or the loader's close, closes its fetcher
    (requests in flight cancelled, bytes let go). Thread-safe."""

    def __init__(self) -> None:
        self._held: NextPass | None = None
        self._lock = threading.Lock()

    def put(self, next_pass: NextPass) -> None:
        with self._lock:
            old, self._held = self._held, next_pass
        if old is not None:
            old.fetcher.close()

    def take(self, key: Hashable) -> NextPass | None:
        """The held next pass if it starts and ends where `key` says (else None, the held one closed)."""
        with self._lock:
            held, self._held = self._held, None
        if held is not None and held.key != key:
            held.fetcher.close()
            return None
        return held

    def clear(self) -> None:
        with self._lock:
            old, self._held = self._held, None
        if old is not None:
            old.fetcher.close()


class Handoff:
    """What a pass does with its fetcher once it is over: hands it on with the next pass's bytes
    asked for (`keep`: the pass reached its end, or a newer one replaced it), else closes it."""

    __slots__ = ("fetcher", "keep", "next_pass", "slot")

    def __init__(self, slot: NextSlot, fetcher: Fetcher, next_pass: NextPass | None) -> None:
        self.slot, self.fetcher, self.next_pass = slot, fetcher, next_pass
        self.keep = False

    def settle(self) -> None:
        """Idempotent: the first call decides."""
        nxt, self.next_pass = self.next_pass, None
        if self.keep and nxt is not None and nxt.started and not nxt.failed:
            self.fetcher.drop_older(nxt.generation)  # what this pass asked for and never read
            self.slot.put(nxt)
        else:
            self.fetcher.close()


class Pipeline:
    """What every pass of a loader shares, and `start`, which wires one pass.

    Args:
        catalog: the files of the dataset (or the view of a subset) the passes read.
        dtypes: what each field is assembled as (the cast, or a fused transform's input).
        units: batches assembled together (see stoker.engine.budget.COALESCE_BYTES).
        fetch: `(num_parallel_reads, fetch_bytes, part_bytes)` of remote reads (stoker.io.fetch).
    """

    def __init__(
        self, catalog: Catalog, dtypes: Mapping[str, np.dtype], *,
        batch_size: int, with_index: bool, stage: Stage | None, units: int, workers: Workers, executor: Executor,
        autotune: Autotune,
        counters: Counters, kept_maps: KeptMaps | None, kept_decoded: KeptDecoded, fetch: tuple[int, int, int],
        drop_behind: bool, gathers: bool, seek_fields: frozenset[str], record_bytes: int,
    ) -> None:  # fmt: skip
        self.catalog, self.dtypes = catalog, dict(dtypes)
        self.batch_size, self.with_index, self.stage, self.units = batch_size, with_index, stage, units
        self.workers, self.executor, self.autotune, self.counters = workers, executor, autotune, counters
        self.kept_maps, self.kept_decoded, self.fetch = kept_maps, kept_decoded, fetch
        self.drop_behind, self.gathers, self.seek_fields = drop_behind, gathers, seek_fields
        self.record_bytes = record_bytes  # of one record, all fields as stored
        self.pool: Allocator | None = None  # the batch buffers kept between passes (see pass_pool)
        self._pool_factory: Callable[[int], Allocator] | None = None
        self.next_slot = NextSlot()  # the next pass's remote bytes, asked for by the last pass
        weakref.finalize(self, self.next_slot.clear)

    def pass_pool(self, allocator: Callable[[int], Allocator], pooled: int) -> tuple[Allocator, bool]:
        """The batch buffers for a new pass, and whether the pass owns them (clears them when done).

        Worker threads keep one pool for all the loader's passes: a pass per epoch (a PyTorch
        loop, Keras' fit) then starts on the buffers of the last one, whose pages are mapped
        already, instead of faulting in fresh ones. At most `pooled` bytes are kept for reuse;
        `clear_pool()` lets them go. A pool of another allocator (an adapter asking for pinned
        memory) replaces it. Worker processes map buffers by descriptor, per pass.
        """
        if not self.workers.in_process:
            return allocator(pooled), True
        if self.pool is None or self._pool_factory is not allocator:
            if self.pool is not None:
                self.pool.clear()
            self.pool, self._pool_factory = allocator(pooled), allocator
        elif isinstance(self.pool, AlignedPool):
            self.pool.max_pooled_bytes = pooled
        return self.pool, False

    def clear_pool(self) -> None:
        if self.pool is not None:
            self.pool.clear()

    def start(
        self, plans: Iterator[BatchPlan], allocator: Callable[[int], Allocator], pooled: int, *, report: Report,
        key: Hashable = None, then: tuple[Hashable, Iterator[BatchPlan]] | None = None,
    ) -> Pass:  # fmt: skip
        """A pass over `plans`, its batches built by `allocator` (at most `pooled` bytes kept for reuse).

        `key`: where the pass starts and ends (`plans` a pure function of it): the next pass the
        last one asked for, if it has this key, goes on with its requests. `then`: the key and
        plans of the pass after this one, whose first remote bytes this one asks for at its end.
        """
        pool, own_pool = self.pass_pool(allocator, pooled)
        stop_flag = StopFlag()  # one stop event: a worker waiting for its turn on a stream wakes when the map closes
        goes_on = self.next_slot.take(key)
        if goes_on is not None:
            fetcher = goes_on.fetcher
        else:
            reads, fetch_bytes, part_bytes = self.fetch
            fetcher = Fetcher(reads, ahead_bytes=fetch_bytes, part_bytes=part_bytes)
        try:
            return self._wire(plans, pool, own_pool, stop_flag, fetcher, goes_on, then, report)
        except BaseException:
            fetcher.close()  # the requests asked for the pass that did not start
            raise

    def _wire(
        self, plans: Iterator[BatchPlan], pool: Allocator, own_pool: bool, stop_flag: StopFlag, fetcher: Fetcher,
        goes_on: NextPass | None, then: tuple[Hashable, Iterator[BatchPlan]] | None, report: Report,
    ) -> Pass:  # fmt: skip
        """`start`'s pass over `plans` with `fetcher` (`goes_on`: the next pass it is, asked for by the last)."""
        assembler = open_reader(
            self.catalog, self.dtypes, allocator=pool, batch_size=self.batch_size, with_index=self.with_index,
            fused=self.stage,  # built-in transforms run as records are read
            fetcher=fetcher, close_fetcher=False, counters=self.counters,
            readahead=Readahead(drop_behind=self.drop_behind, gathers=self.gathers),
            stop=stop_flag, seek_fields=self.seek_fields, kept_maps=self.kept_maps, kept_decoded=self.kept_decoded,
        )  # fmt: skip
        # Batches assembled together: the engine, its look-ahead and autotune count these
        # units; the pass hands their parts out one by one.
        units = self.units
        if goes_on is not None:
            plans = goes_on.plans  # coalesced already, its first ones asked for (goes_on.asked)
        elif units > 1:
            plans = coalesced_units(plans, units, assembler.redoable)
        in_process = self.workers.in_process
        next_pass: NextPass | None = None
        if in_process:  # worker processes read for themselves
            if then is not None and assembler.parts.ahead.remote:
                later = coalesced_units(then[1], units, assembler.redoable) if units > 1 else then[1]
                next_pass = NextPass(then[0], later, fetcher)
            plans = assembler.fetching_ahead(plans, goes_on=goes_on, then=next_pass)
        tasks: Iterator[Task] = map(assembler.prepare, plans)
        if assembler.parts.readahead.gathers_ahead:
            tasks = advising_ahead(tasks, max(1, AHEAD_BYTES // (self.batch_size * units * self.record_bytes)))
        work: Callable[[Task], Any] = assembler
        if units > 1:
            work = functools.partial(assemble_parts, assembler)
        if self.stage is not None and in_process:
            work = self.stage.bind(assembler, pool.array, self.catalog)
        tuner, window = self.autotune.for_pass(units)
        # The assembler's first step that may give the GIL up or block is a copy kernel, or it
        # flushes the wake-up before (stoker.engine.flush_wake): deferred wake-ups apply.
        batches = self.executor.map_ordered(work, tasks, window=window, defer_wake=True, stop=stop_flag)
        handoff = Handoff(self.next_slot, fetcher, next_pass)
        batches.add_cleanup(assembler.close)  # the fetcher: by the pass's shutdown, which knows how it ended
        if own_pool:
            batches.add_cleanup(pool.clear)
        return Pass(
            batches, assembler, pool if own_pool else None, units=units, counters=self.counters, tuner=tuner,
            report=report, pool_of=pool, handoff=handoff,
        )  # fmt: skip


def shutdown(
    batches: OrderedMap[tuple[Batch, BatchPlan]], assembler: Assembler, pool: Allocator | None, born: int,
    handoff: Handoff | None = None,
) -> None:  # fmt: skip
    # Idempotent, and safe to run again after a Ctrl-C cut it short (see stoker.engine.executor._State):
    # the stop flag first, then the join; the files are also closed by the last worker out.
    # `pool`: the pass's own, cleared with it (None: the loader's, kept for its next pass).
    # `handoff`: the fetcher, handed to the next pass or closed once the streams let go of their parts.
    if born != fork_generation():
        return  # a forked child's copy: the threads, files and buffers are the parent pass's
    assembler.stop.set()
    batches.close()
    assembler.close()
    if handoff is not None:
        handoff.settle()
    if pool is not None:
        pool.clear()


def coalesced_units(
    plans: Iterator[BatchPlan], parts: int, redoable: Callable[[BatchPlan], bool]
) -> Iterator[BatchPlan]:
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


class Coalesced:
    """What a worker makes of coalesced batches: each part's batch, in order, and the error of
    the first part that failed (the parts after it are not made)."""

    __slots__ = ("batches", "error", "rows")

    def __init__(self, batches: list[tuple[Batch, BatchPlan]], error: BaseException | None, rows: int) -> None:
        self.batches = batches
        self.error = error
        self.rows = rows


def assemble_parts(assembler: Assembler, task: Task) -> Any:
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
                return Coalesced(batches, e, plan.rows)
        return Coalesced(batches, None, plan.rows)
    split: list[tuple[Batch, BatchPlan]] = []
    row = 0
    for part in plan.parts:
        split.append(({name: arr[row : row + part.rows] for name, arr in out.items()}, part))
        row += part.rows
    return Coalesced(split, None, plan.rows)


def advising_ahead(tasks: Iterator[Task], depth: int) -> Iterator[Task]:
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


class Pass:
    """One pass over the loader's epochs: the iterator `iter(loader)` returns.

    It hands out the results of the executor's map (`batches`, built with `assembler` by
    `Pipeline.start`), the parts of coalesced units one by one, and tells its loader where
    its user stands through `report`. `pool`: the pass's own buffers, cleared with it (None: the
    loader's); `pool_of`: the buffers it draws from, whichever (autotune watches their count).
    """

    def __init__(
        self, batches: OrderedMap[Any], assembler: Assembler, pool: Allocator | None, *, units: int,
        counters: Counters, tuner: ThreadTuner | None, report: Report, pool_of: Allocator,
        handoff: Handoff | None = None,
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
        # While tuning: the thread __next__ last returned to, and its clocks then (`ConsumerClock`),
        # so autotune learns whether the consumer computes on the host while it keeps a batch.
        self._left: tuple[int, float, float | None] | None = None
        self._clock = ConsumerClock()
        self._ready: collections.deque[tuple[Batch, BatchPlan]] = collections.deque()
        self._failed: BaseException | None = None  # raised once the parts before it are out
        self._handoff = handoff
        # The next pass's remote bytes, asked for as this one's batches are delivered (room comes back).
        self._next_pass = handoff.next_pass if handoff is not None else None
        self._born, self._pid = fork_generation(), os.getpid()  # a fork()ed child inherits this pass, not its threads
        self._finalizer = weakref.finalize(self, shutdown, batches, assembler, pool, self._born, handoff)
        weakref.finalize(self, self._clock.close)  # a pass collected unclosed lets its descriptor go too

    def __iter__(self) -> Pass:
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
            clock = self._clock.read() if self._tuner is not None else None
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
                        self._hand_on()
                    raise
                if isinstance(result, Coalesced):
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
            if self._tuner is not None:
                self._consumer_kept(self._tuner, asked, clock)
                if unit_rows:
                    self._tune(asked, got, unit_rows)
            self._last = got
            self._left = (threading.get_ident(), *self._clock.read()) if self._tuner is not None else None
            self._report.delivered((plan.epoch, plan.position))
            if self._next_pass is not None:
                self._next_pass.ask()
        except BaseException:
            self.close()
            raise
        return batch

    def _consumer_kept(self, tuner: ThreadTuner, asked: float, clock: tuple[float, float | None] | None) -> None:
        """Tell autotune how the consumer spent the time it kept the last batch, read from its
        thread's clocks (a thread's clocks are its own: a batch taken by another thread than the
        last one says nothing)."""
        left = self._left
        if clock is None or left is None or self._last is None or left[0] != threading.get_ident():
            return
        (cpu, queued), (_, cpu_at, queued_at) = clock, left
        waited = queued - queued_at if queued is not None and queued_at is not None else 0.0
        tuner.kept(asked - self._last, cpu - cpu_at, waited)

    def _tune(self, asked: float, got: float, rows: int) -> None:
        tuner = self._tuner
        assert tuner is not None
        if not self._report.alive():  # nobody to tell what it measured
            return
        tuner.observe(self._batches, asked, got, self._last, rows, getattr(self._pool, "allocated", 0))
        self._report.tuned(tuner, self._parts)
        if tuner.done:  # later passes start with the measured values
            self._tuner = None

    def _hand_on(self) -> None:
        """This pass is over, not left: what it asked for of the next pass goes to it."""
        if self._handoff is not None:
            if self._next_pass is not None:
                self._next_pass.ask()
            self._handoff.keep = True

    def supersede(self) -> None:
        """End this pass for a newer one; a pass still open then says so at its next `next()`."""
        if not self._closed:
            self._superseded = True
            self._hand_on()
        self.close()

    def close(self) -> None:
        self._closed = True
        self._clock.close()
        run_finalizer(self._finalizer)  # armed until done: a later close() or GC finishes an interrupted one
        self._ready.clear()  # batches of an assembly not handed out: their buffer goes with the pass
