"""Decode and cast into the output: executes one planned batch into fresh aligned arrays.

The Assembler coordinates; its parts do the work (`Parts`, built for a pass by `build_parts`):
raw runs by `RawReader` (preadv into the batch, or a cast from a memory map in one pass),
compressed runs by `StreamTurns` (one stream per (epoch, group, field), batches taking their
turn on it by tickets handed out in plan order, so parallel workers still read each stream
front to back exactly once), a global shuffle's gathers by `Gatherer`, the open files by
`OpenFiles`, files decoded whole by `WholeFiles`, remote bytes asked for ahead by `FetchAhead`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import StokerError
from ..io import faults
from ..io.fetch import Fetcher
from ..io.files import Catalog
from ..io.readahead import Readahead
from ..io.remote import is_remote
from ..kernels import gathers
from ..plan.batches import BatchPlan, Run
from ..spec import Field
from .ahead import FetchAhead, NextPass
from .buffers import Staging
from .decoded import KeptDecoded, WholeFiles
from .executor import Allocator, StopFlag, Stopped
from .gather import Gatherer
from .inflating import StreamReads
from .maps import KeptMaps
from .openfiles import OpenFiles
from .rawreads import RawReader
from .stats import CPU_SAMPLE_SECONDS, Counters, thread_clock
from .turns import Stream, StreamTurns

__all__ = ["GROUP_KEY", "INDEX_KEY", "VALID_KEY", "Assembler", "Parts", "Task", "build_parts", "fill_padding"]

GROUP_KEY = "__group__"
INDEX_KEY = "__index__"
VALID_KEY = "__valid__"  # pad_last: True on real rows, False on padding


@dataclass
class Task:
    """A planned batch plus its turn on every compressed stream it reads."""

    plan: BatchPlan
    tickets: dict[tuple[int, str], tuple[Stream, int]] = field(default_factory=dict)
    # Fields whose transforms ran during assembly (see Assembler's `fused`), with their draws.
    fused: frozenset[str] = frozenset()
    draws: Any = None
    # Gathers whose records this task asks of the disk before its own (see Readahead.before_gather).
    ahead: tuple[BatchPlan, ...] = ()

    def __repr__(self) -> str:
        return f"batch {self.plan.index} of epoch {self.plan.epoch} ({self.plan.rows} records)"


def fill_padding(out: dict[str, np.ndarray], valid: int) -> None:
    """pad_last: zero the padding rows `valid..` of every array, mark them in `__valid__`.

    `__group__` / `__index__` of padding rows are -1, so they never name a real record.
    """
    for name, arr in out.items():
        if name == VALID_KEY:
            arr[:valid] = True
            arr[valid:] = False
        elif name in (GROUP_KEY, INDEX_KEY):
            arr[valid:] = -1
        else:
            arr[valid:] = 0


@dataclass(frozen=True)
class Parts:
    """What an Assembler coordinates, built together for one pass (see `build_parts`)."""

    files: OpenFiles
    raw: RawReader
    streams: StreamTurns
    whole: WholeFiles
    gather: Gatherer
    ahead: FetchAhead
    fetcher: Fetcher
    readahead: Readahead
    counters: Counters
    stop: StopFlag
    close_fetcher: bool = True  # False: the fetcher's owner (a loader's pipeline) closes it

    def close(self) -> None:
        """Release every file and stream the parts hold; idempotent."""
        self.stop.set()
        self.files.close()
        self.streams.close()
        self.whole.close()
        if self.close_fetcher:
            self.fetcher.close()


def build_parts(
    catalog: Catalog, out_dtypes: Mapping[str, np.dtype], *, fetcher: Fetcher | None = None,
    counters: Counters | None = None, readahead: Readahead | None = None, stop: StopFlag | None = None,
    seek_fields: frozenset[str] = frozenset(), kept_maps: KeptMaps | None = None,
    kept_decoded: KeptDecoded | None = None, close_fetcher: bool = True,
) -> Parts:  # fmt: skip
    """The parts of a pass's Assembler over `catalog`, sharing what the loader gives.

    Args:
        fetcher: ranged GETs of remote files (stoker.io.fetch); a default one if None.
        counters: where reads and waits are counted (the loader's, for its stats).
        readahead: page-cache advice (the loader sets drop-behind for datasets larger than RAM/2).
        stop: the flag the executor's map sets when it closes: waits on stream turns watch it.
        seek_fields: a global shuffle's compressed fields too large to hold: read through seek points.
        kept_maps, kept_decoded: a loader's, kept across its passes; None: the pass's own.
        close_fetcher: whether closing the parts closes `fetcher` (False: its giver does).
    """
    fields: dict[str, Field] = dict(catalog.fields)
    cast = {n: np.dtype(out_dtypes[n]) != f.dtype for n, f in fields.items()}
    fetcher = Fetcher() if fetcher is None else fetcher
    counters = Counters() if counters is None else counters
    readahead = Readahead(drop_behind=False) if readahead is None else readahead
    stop = StopFlag() if stop is None else stop
    staging = Staging()
    files = OpenFiles(readahead, kept_maps)
    raw = RawReader(
        catalog, cast, files, fetcher=fetcher, readahead=readahead, counters=counters, stop=stop, staging=staging
    )
    reads = StreamReads(catalog, cast, fetcher=fetcher, counters=counters, stop=stop, staging=staging)
    whole = WholeFiles(catalog, reads, counters, kept_decoded)
    streams = StreamTurns(catalog, reads, whole, counters=counters, stop=stop)
    gather = Gatherer(catalog, files, raw, whole, readahead=readahead, counters=counters, seek_fields=seek_fields)
    ahead = FetchAhead(catalog, fetcher, seek_fields=seek_fields)
    return Parts(files, raw, streams, whole, gather, ahead, fetcher, readahead, counters, stop, close_fetcher)


class Assembler:
    """Turns planned batches into dicts of arrays: `prepare` (the dispatcher, in plan order),
    the call (workers), `close`. The files and streams are its parts' (see `Parts`).

    `fused`: the loader's transform stage (stoker.engine.fusion.Stage), if any: fields it can run
    record by record are transformed as they are read from the file's memory map, so their
    stored records never land in a buffer of their own.
    """

    def __init__(
        self, catalog: Catalog, out_dtypes: Mapping[str, np.dtype], allocator: Allocator, parts: Parts | None = None,
        *, batch_size: int, with_index: bool = False, fused: Any = None,
    ) -> None:  # fmt: skip
        self.catalog = catalog
        self.fields: dict[str, Field] = dict(catalog.fields)
        self.out_dtypes = dict(out_dtypes)
        self.allocator = allocator
        self.batch_size = batch_size
        self.with_index = with_index
        self.parts = build_parts(catalog, out_dtypes) if parts is None else parts
        self.fused = fused
        self._compressed = {n for n in self.fields if any(infos[n].compression is not None for infos in catalog.files)}
        self._raw = [n for n in self.fields if any(infos[n].compression is None for infos in catalog.files)]
        # Fields of local raw files alone, in every group (read together, see _read_together).
        self._local_raw = frozenset(n for n in self._raw if not any(
            infos[n].compression is not None or is_remote(infos[n].path) for infos in catalog.files
        ))  # fmt: skip
        self._local = threading.local()
        self._fusable: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._redoable: dict[int, bool] = {}  # per group, see redoable()

    @property
    def stop(self) -> StopFlag:
        """Set once the pass is closing (its executor's map shares it)."""
        return self.parts.stop

    # -- dispatch (runs under the executor's lock, in plan order) ----------------------
    def fetching_ahead(
        self, plans: Iterator[BatchPlan], *, goes_on: NextPass | None = None, then: NextPass | None = None
    ) -> Iterator[BatchPlan]:
        """`plans`, the remote bytes they read asked for ahead of the workers (see FetchAhead:
        `goes_on`, the next pass this one is; `then`, the one after it)."""
        return self.parts.ahead(plans, goes_on=goes_on, then=then)

    def prepare(self, plan: BatchPlan) -> Task:
        """The task of `plan`: its raw runs counted as planned, its turns on compressed streams taken."""
        task = Task(plan)
        streams = self.parts.streams
        streams.begin(plan.epoch)
        for i, run in enumerate(plan.runs):
            infos = self.catalog.files[run.group]
            if self._raw:
                self.parts.files.planned(plan.epoch, [infos[n].path for n in self._raw if infos[n].compression is None])
            for name in self._compressed:
                if infos[name].compression is not None:
                    task.tickets[(i, name)] = streams.ticket(plan.epoch, run.group, name, run.final)
        return task

    # -- work (runs in worker threads) --------------------------------------------------
    def add_index_arrays(self, plan: BatchPlan, out: dict[str, np.ndarray]) -> None:
        """`__group__` and `__index__` (with_index) and `__valid__` (padded batches) into `out`."""
        if self.with_index:
            out[GROUP_KEY] = self.allocator.array((plan.rows,), np.dtype(np.int64))
            out[INDEX_KEY] = self.allocator.array((plan.rows,), np.dtype(np.int64))
        if plan.valid is not None:
            out[VALID_KEY] = self.allocator.array((plan.rows,), np.dtype(bool))
            fill_padding(out, plan.valid)

    def __call__(self, task: Task) -> tuple[dict[str, np.ndarray], BatchPlan]:
        plan = task.plan
        began = time.perf_counter()
        # This thread's CPU clock, on one batch in every CPU_SAMPLE_SECONDS (Counters.batch_done).
        local = self._local
        began_clock = thread_clock() if began >= getattr(local, "cpu_due", 0.0) else None
        out: dict[str, np.ndarray] = {}
        fused = self._fused_fields(plan)
        if fused:
            task.fused, task.draws = frozenset(fused), self.fused.draws(plan)
        for ahead in task.ahead:
            self.parts.gather.advise(ahead)
        for name, spec in self.fields.items():
            shape, dtype = fused.get(name, (spec.shape, self.out_dtypes[name]))
            out[name] = self.allocator.array((plan.rows, *shape), dtype)
        self.add_index_arrays(plan, out)
        if plan.gather is not None:
            groups, index = self.parts.gather(plan, out)
            if self.with_index:
                out[GROUP_KEY][: len(groups)] = groups
                out[INDEX_KEY][: len(index)] = index
        taken: set[tuple[int, str]] = set()  # stream turns this batch has had
        try:
            together = self._read_together(task, out)
            for i, run in enumerate(plan.runs):
                self._read_run(task, i, run, out, taken, together)
        except Stopped:
            raise
        except BaseException:
            # Give up this batch's remaining stream turns, or later batches wait forever.
            for key, (stream, ticket) in task.tickets.items():
                if key not in taken:
                    stream.abandon(ticket)
            raise
        ended = time.perf_counter()
        runs = plan.runs if plan.gather is None else ()
        if began_clock is None:
            self.parts.counters.batch_done(ended - began, runs=runs)
        else:
            cpu, runnable = thread_clock()
            self.parts.counters.batch_done(
                ended - began,
                cpu - began_clock[0],
                None if runnable is None or began_clock[1] is None else runnable - began_clock[1],
                runs=runs,
            )
            local.cpu_due = ended + CPU_SAMPLE_SECONDS
        return out, plan

    def _fused_fields(self, plan: BatchPlan) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Fields transformed while read: local raw files only, not for gathers or padding."""
        if self.fused is None or plan.gather is not None or plan.valid is not None:
            return {}
        if self._fusable is None:
            local = {n for n in self.fields if not any(
                infos[n].compression is not None or is_remote(infos[n].path) for infos in self.catalog.files
            )}  # fmt: skip
            self._fusable = {n: rec for n, rec in self.fused.record_fields(self.fields).items() if n in local}
        return self._fusable

    def _read_run(
        self, task: Task, i: int, run: Run, out: dict[str, np.ndarray], taken: set[tuple[int, str]],
        together: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        """Run `i` of the task's batch, every field but those `together` (read already,
        but for an empty run)."""
        plan = task.plan
        infos = self.catalog.files[run.group]
        for name, spec in self.fields.items():
            if name in together and run.count:
                continue
            dst = out[name][run.row : run.row + run.count]
            info = infos[name]
            try:
                if info.compression is None:
                    put = functools.partial(self.fused.put, name, draws=task.draws) if name in task.fused else None
                    self.parts.raw.read(plan.epoch, name, spec, info, run, dst, put)
                else:
                    stream, ticket = task.tickets[(i, name)]
                    try:
                        self.parts.streams.read(plan.epoch, name, spec, info, run, dst, stream, ticket)
                    finally:
                        taken.add((i, name))
            except (StokerError, Stopped):
                raise
            except BaseException as e:  # not one of ours: still say which file the worker was on
                e.add_note(faults.reading_note(name, info, run.group, run.start, run.stop))
                raise
        if self.with_index:
            out[GROUP_KEY][run.row : run.row + run.count] = run.group
            out[INDEX_KEY][run.row : run.row + run.count] = np.arange(run.start, run.stop, run.step)

    def _read_together(self, task: Task, out: dict[str, np.ndarray]) -> frozenset[str]:
        """Read the fields whose runs of this batch all come from local raw files, each field in
        one kernel call over its records' addresses; the fields so read.

        A batch of many short runs (small files, or records of each file's tail) paid each run's
        file acquisition, size check, copy call and release as a call of its own, per field,
        a large share of a worker's time on small groups. For a batch of one run
        (W1's, benchmarks/w1.py) the per-run path below is already one call per field.
        """
        plan = task.plan
        runs = [run for run in plan.runs if run.count]  # an empty run only says a file is done
        if len(runs) < 2:
            return frozenset()
        names = [n for n in self._local_raw if n not in task.fused and gathers(out[n], self.fields[n].dtype)]
        for name in names:
            self.parts.raw.read_runs(plan.epoch, runs, name, self.fields[name], out[name])
        return frozenset(names)

    def redoable(self, plan: BatchPlan) -> bool:
        """Whether `plan` can be assembled again, or its runs split between batches: it reads
        no compressed stream in turns (only raw files and files decoded whole, whose records
        any batch copies in any order)."""
        return all(self._redoable_group(run.group) for run in plan.runs)

    def _redoable_group(self, group: int) -> bool:
        known = self._redoable.get(group)
        if known is None:
            infos = self.catalog.files[group]
            known = self._redoable[group] = all(
                infos[n].compression is None or self.parts.whole.whole_able(self.fields[n], group)
                for n in self._compressed
            )
        return known

    def close(self) -> None:
        """Release every file and stream; idempotent."""
        self.parts.close()
