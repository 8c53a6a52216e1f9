"""A global shuffle's batches: records picked from across the dataset, copied file by file in
one kernel call over their addresses, and asked of the disk a few batches ahead."""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from ..errors import StokerError
from ..io import faults
from ..io.files import Catalog, FileInfo
from ..io.readahead import Readahead
from ..io.reads import seek_read
from ..io.remote import is_remote
from ..io.seekpoints import SeekPoint
from ..kernels import MapFault, copy_records, file_sizes, gather_records, gathers
from ..plan.batches import BatchPlan, Gather, Run
from ..spec import Field
from .decoded import WholeFiles
from .executor import flush_wake
from .openfiles import OpenFile, OpenFiles
from .rawreads import RawReader
from .stats import Counters

__all__ = ["Gatherer", "by_file"]


def by_file(gather: Gather) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """A gather sorted by (group, record), so each file is visited once, front to back:
    `(order, groups, index, spans)`, record `k` of the sorted ones going to row
    `order[k]`, `spans` the `[a, b)` stretches of one group each."""
    order = np.lexsort((gather.index, gather.groups))
    groups, index = gather.groups[order], gather.index[order]
    cuts = (np.flatnonzero(np.diff(groups)) + 1).tolist()
    spans = list(zip([0, *cuts], [*cuts, len(order)], strict=True)) if len(order) else []
    return order, groups, index, spans


class Gatherer:
    """Copies a gather's records into the batch, field by field: local raw files through their
    maps, remote ones by ranged GETs, compressed ones from memory (`WholeFiles.resident`) or,
    for `seek_fields`, from the persistent index's seek points."""

    def __init__(
        self, catalog: Catalog, files: OpenFiles, raw: RawReader, whole: WholeFiles, *, readahead: Readahead,
        counters: Counters, seek_fields: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        self.catalog = catalog
        self.fields: dict[str, Field] = dict(catalog.fields)
        self.files = files
        self.raw = raw
        self.whole = whole
        self.readahead = readahead
        self.counters = counters
        self.seek_fields = seek_fields

    def __call__(self, plan: BatchPlan, out: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Plan `plan`'s gather into `out`; (groups, records) in the batch's row order."""
        assert plan.gather is not None
        flush_wake()  # see stoker.engine: gathers may wait on files, streams and numpy
        order, groups, index, spans = by_file(plan.gather)
        for name, spec in self.fields.items():
            t = time.perf_counter()
            for o, g, i, s in self._parts(order, groups, index, spans):
                self._field(plan.epoch, name, spec, out[name], o, g, i, s)
            self.counters.add("gather", name, time.perf_counter() - t)
        return plan.gather.groups, plan.gather.index

    def _parts(
        self, order: np.ndarray, groups: np.ndarray, index: np.ndarray, spans: list[tuple[int, int]]
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]]:
        """`by_file`'s gather in parts of at most `OpenFiles.hold_limit` groups each, so that a
        batch over more files than may be open at once holds them a part at a time."""
        limit = self.files.hold_limit
        if len(spans) <= limit:
            return [(order, groups, index, spans)]
        parts = []
        for k in range(0, len(spans), limit):
            some = spans[k : k + limit]
            a, b = some[0][0], some[-1][1]
            parts.append((order[a:b], groups[a:b], index[a:b], [(x - a, y - a) for x, y in some]))
        return parts

    def advise(self, plan: BatchPlan) -> None:
        """Ask the disk for the records of `plan`'s gather in local raw files (see
        Readahead.before_gather): a task does it for a batch a few ahead of its own."""
        if plan.gather is None or not self.readahead.gathers_ahead:
            return
        order, all_groups, all_index, all_spans = by_file(plan.gather)
        for name, spec in self.fields.items():
            t = time.perf_counter()
            for _, groups, index, spans in self._parts(order, all_groups, all_index, all_spans):
                group_of = groups[[a for a, _ in spans]].tolist() if spans else []
                lengths = [b - a for a, b in spans]
                _, raw, picked = self._raw_of(name, group_of)
                held = self.files.hold(plan.epoch, name, picked)
                try:
                    fd = iter([f.fd for f in held])
                    fds = np.repeat(np.array([next(fd) if r else -1 for r in raw], np.int64), lengths)
                    mine = fds >= 0
                    offsets = index * spec.record_bytes + spec.header_bytes
                    self.readahead.before_gather(fds[mine], offsets[mine], spec.record_bytes)
                finally:
                    self.files.let_go(plan.epoch, picked, held)
            # The gathers' time: asking the disk for random records is part of reading them.
            self.counters.add("gather", name, time.perf_counter() - t)

    def _field(
        self, epoch: int, name: str, spec: Field, dst: np.ndarray, order: np.ndarray, groups: np.ndarray,
        index: np.ndarray, spans: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        """`dst[order[k]]` = record `index[k]` of group `groups[k]`, sorted by group then
        record, `spans` the runs of one group.

        Records of local raw files and of compressed files held in memory are copied by one
        kernel call over their addresses: per group there is only the file to hold and its size
        to check (one call per group was a large share of a worker's time), and the files are
        held, their sizes read and let go in one call or lock round each (the batches of W1-big,
        benchmarks/w1_big.py, read from ~190 of its 415 files). Remote files and seek points are read group by group.
        """
        rb = spec.record_bytes
        direct = gathers(dst, spec.dtype)  # the kernel copies this field's records
        group_of = groups[[a for a, _ in spans]].tolist() if spans else []
        lasts = index[[b - 1 for _, b in spans]].tolist() if spans else []  # sorted: each span's last record
        infos, raw, picked = self._raw_of(name, group_of)
        held = self.files.hold(epoch, name, picked)
        bases = [-1] * len(spans)  # per span: where its group's records begin in memory, -1: copied already
        kept: list[np.ndarray] = []  # arrays some addresses point into, held until the copy is done
        try:
            files, sizes = iter(held), iter(file_sizes([f.fd for f in held]))
            for k, (a, b) in enumerate(spans):
                g, info = group_of[k], infos[k]
                if raw[k]:
                    f, now = next(files), next(sizes)
                    n = lasts[k] + 1
                    if f.map is None or min(f.size, now) < spec.header_bytes + n * rb:
                        raise faults.gather_truncated(name, info, spec, g, index[a:b], min(f.size, now))
                    if direct:
                        bases[k] = f.address() + spec.header_bytes
                        continue
                    # numpy casts these: the records are copied out of the map first (see RawReader._copy_mapped).
                    rows = np.empty((b - a, rb), np.uint8)
                    try:
                        copy_records(rows, f.fd, f.address(), index[a:b] * rb + spec.header_bytes)
                    except MapFault as e:
                        now = file_sizes([f.fd])[0]
                        raise faults.gather_truncated(name, info, spec, g, index[a:b], min(f.size, now)) from e
                    try:
                        dst[order[a:b]] = rows.view(spec.dtype).reshape(b - a, *spec.shape)
                    except BaseException as e:
                        e.add_note(faults.reading_note(name, info, g, int(index[a]), n))
                        raise
                    finally:
                        del rows
                elif info.compression is None:  # a remote file
                    dst[order[a:b]] = self.raw.remote_records(name, spec, info, index[a:b])
                elif name in self.seek_fields:
                    points = self.catalog.seek_points.get((g, name), (SeekPoint(0, 0),))
                    dst[order[a:b]] = seek_read(name, spec, info, points, index[a:b], self.catalog.count(g))
                else:
                    records, at = self.whole.resident(name, spec, info, g)
                    if direct and records.flags.c_contiguous:
                        kept.append(records)
                        bases[k] = at
                    else:
                        dst[order[a:b]] = records[index[a:b]]
            if direct and max(bases, default=-1) >= 0:
                starts = np.repeat(np.asarray(bases, np.int64), [b - a for a, b in spans])
                pick = starts >= 0
                try:
                    if pick.all():
                        gather_records(dst, order, index * rb + starts, spec.dtype)
                    else:
                        gather_records(dst, order[pick], index[pick] * rb + starts[pick], spec.dtype)
                except MapFault as e:
                    raise self._fault(name, spec, e, spans, group_of, infos, raw, held, index) from e
            if held:  # a cut inside a page reads as zeros, no fault: the sizes after say (see RawReader.read)
                raw_spans = [k for k, r in enumerate(raw) if r]  # held[j] is raw_spans[j]'s file
                for k, now in zip(raw_spans, file_sizes([f.fd for f in held]), strict=True):
                    if now < spec.header_bytes + (lasts[k] + 1) * rb:
                        a, b = spans[k]
                        raise faults.gather_truncated(name, infos[k], spec, group_of[k], index[a:b], now)
        finally:
            self.files.let_go(epoch, picked, held)
            kept.clear()

    def _raw_of(self, name: str, groups: list[int]) -> tuple[list[FileInfo], list[bool], list[FileInfo]]:
        """Field `name`'s file of each group, whether each is a local raw file (read through
        its map), and those files alone (what a gather holds)."""
        infos = [self.catalog.files[g][name] for g in groups]
        raw = [info.compression is None and not is_remote(info.path) for info in infos]
        return infos, raw, [info for info, r in zip(infos, raw, strict=True) if r]

    def _fault(
        self, name: str, spec: Field, e: OSError, spans: list[tuple[int, int]], group_of: list[int],
        infos: list[FileInfo], raw: list[bool], held: list[OpenFile], index: np.ndarray,
    ) -> StokerError:  # fmt: skip
        """The error for a MapFault in a gather's kernel call: the file it read from, cut short."""
        k = self.raw.faulted(held, e)
        f = held[k]
        j = [i for i, r in enumerate(raw) if r][k]  # held[k] is the k-th raw span's file
        a, b = spans[j]
        now = file_sizes([f.fd])[0]
        if now < f.size:
            return faults.gather_truncated(name, infos[j], spec, group_of[j], index[a:b], now)
        run = Run(group_of[j], int(index[a]), b - a, 0, False)
        return self.raw.map_fault(name, infos[j], spec, run, f, e)
