"""Random access and subsets: `ds[i]`, `ds.read(indices)`, `ds.select(...)`, `ds.split(...)`.

One table resolves a global record index to (group, record): the cumulative record counts
of the groups. A batch of indices is gathered in bulk: sorted by (group, record) so each
file is visited once, raw fields by fancy indexing of a memory map of the file (one copy,
no per-record syscall), compressed fields from their decoded form or through seek points.

Compressed fields, bounded: a file whose records decode to at most `cache_bytes`
(default 256 MiB per Dataset, `DEFAULT_CACHE_BYTES`) is decoded whole once, verified
to its end (CRC, length), and kept in a least-recently-used cache of at most
`cache_bytes`. A larger file is never held: each read decodes from the nearest seek point
before the wanted records (deflate block boundaries every ~1 MiB and gzip member starts,
from the persistent index, see `stoker.index`; else the file's start) only as far as the
last wanted record. Records read that way pass the deflate decoder's checks but not the
member's CRC, which covers the whole member (the index's own pass checked it).

A subset is a Dataset (`Subset`) over some groups of its root dataset and, per group,
all records or a sorted array of them. The plan and loader work on it unchanged: the plan
sees its geometry (groups and counts); batches of a subset of whole groups are read by the
streaming assembler (any compression, front to back); batches of a subset of records are read
by this module's gather, so every loader feature (shuffle, shard, resume, `with_index`,
`pad_last`, the framework adapters) works on both. `__group__` / `__index__` name the
root dataset's group and record in the file.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import numbers
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import remote
from .batch import GROUP_KEY, INDEX_KEY, VALID_KEY, Assembler, Task, fill_padding, pass_open_files
from .dataset import Dataset, resolve_cast
from .errors import CorruptDataError, RecordIndexError, SpecError
from .files import Catalog, FileInfo, Group, open_local
from .index import count_disagrees
from .inflate import Inflater
from .kernels import MapFault, copy_records, gather_records, gathers, guard_maps, map_address
from .order import Permutation
from .remote import is_remote
from .seekpoints import SeekPoint

if TYPE_CHECKING:
    from .engine import Allocator
    from .fetch import Fetcher
    from .plan import BatchPlan
    from .spec import Field

__all__ = ["DEFAULT_CACHE_BYTES", "RecordReader", "Subset", "read_one", "read_records", "select", "split"]

# Decoded compressed files kept per Dataset for random access. Labels of the seed's layout
# (4 bytes a record) take 16 KiB a group, so a million groups' labels fit; image files of
# 64 MiB decoded: four at a time, enough for the loader's default cycle of 4 groups.
DEFAULT_CACHE_BYTES = 256 << 20
# Raw files a reader keeps mapped between reads (each costs a descriptor and address space,
# no memory), at least; as many as a loader's pass keeps open where the descriptor limit allows
# (stoker.batch.pass_open_files), least recently used ones closed beyond. A record subset's
# global shuffle reads from most of its files in every batch, and with too few kept it maps
# them again batch after batch (measured: benchmarks/results/access_history.md).
MAX_MAPPED = 64
# The split's permutation stream: independent of the loader's record/group/window streams.
STREAM_SPLIT = 3


class _Mapped:
    """One raw file kept open and mapped; `refs` counts reads using it right now."""

    __slots__ = ("_address", "fd", "map", "refs")

    def __init__(self, fd: int, mapped: mmap.mmap) -> None:
        self.fd, self.map, self.refs = fd, mapped, 0
        self._address = 0

    def address(self) -> int:
        """Where the map's first byte lies in memory (the map is open)."""
        if not self._address:
            self._address = map_address(self.map)
        return self._address

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def _close_all(maps: OrderedDict[str, _Mapped]) -> None:
    for m in maps.values():
        m.close()
    maps.clear()


class RecordReader:
    """Gathers records of a root Catalog by (group, record), in bulk; safe to share between threads.

    Keeps raw files mapped between reads (see `MAX_MAPPED`); `close()` (or garbage
    collection of the reader) unmaps and closes them.
    """

    def __init__(self, catalog: Catalog, *, cache_bytes: int | None = None) -> None:
        self.catalog = catalog
        self.cache_bytes = DEFAULT_CACHE_BYTES if cache_bytes is None else cache_bytes
        self._cache: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()
        self._decoding: dict[tuple[int, str], threading.Lock] = {}
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()
        self._max_mapped = max(MAX_MAPPED, pass_open_files())
        self._finalizer = weakref.finalize(self, _close_all, self._maps)

    def close(self) -> None:
        """Unmap and close every file and drop decoded data; idempotent (the reader reopens on use)."""
        with self._lock:
            busy = {p: m for p, m in self._maps.items() if m.refs}
            idle = [m for p, m in self._maps.items() if not m.refs]
            self._maps.clear()
            self._maps.update(busy)  # in use by another thread: closed when released
            self._cache.clear()
            self._cached = 0
        for m in idle:
            m.close()

    def _acquire(self, name: str, spec: Field, info: FileInfo, local: np.ndarray) -> _Mapped:
        with self._lock:
            m = self._maps.get(info.path)
            if m is not None:
                self._maps.move_to_end(info.path)
                m.refs += 1
        if m is None:
            fd = open_local(name, info.path)
            try:
                self._check_size(name, spec, info, fd, local)
                guard_maps()
                try:
                    m = _Mapped(fd, mmap.mmap(fd, info.size, access=mmap.ACCESS_READ))
                except ValueError:  # cut since the check: "mmap length is greater than file size"
                    self._check_size(name, spec, info, fd, local)
                    raise
            except BaseException:
                os.close(fd)
                raise
            m.refs = 1
            with self._lock:
                other = self._maps.get(info.path)
                if other is not None:  # another thread mapped it meanwhile: use theirs
                    other.refs += 1
                    m.close()
                    m = other
                else:
                    self._maps[info.path] = m
                    excess = max(0, len(self._maps) - self._max_mapped)
                    evict = [(p, o) for p, o in self._maps.items() if not o.refs][:excess]
                    for p, _ in evict:
                        del self._maps[p]
            if other is None:
                for _, o in evict:
                    o.close()
        try:
            self._check_size(name, spec, info, m.fd, local)
        except BaseException:
            self._release(info, m)
            raise
        return m

    def _check_size(self, name: str, spec: Field, info: FileInfo, fd: int, local: np.ndarray) -> None:
        # On every read: a file cut short under a map would kill the process (SIGBUS).
        size = os.fstat(fd).st_size
        if size != info.size:
            last = int(local.max())
            raise CorruptDataError(
                f"field {name!r}: {info.path!r} is {size} bytes now but was {info.size} bytes when the Dataset "
                f"was built (record {last} asked for, byte offset {spec.header_bytes + last * spec.record_bytes})",
                field=name, path=info.path, index=last, offset=spec.header_bytes + last * spec.record_bytes,
            )  # fmt: skip

    def _release(self, info: FileInfo, m: _Mapped) -> None:
        with self._lock:
            m.refs -= 1
            orphan = m.refs == 0 and self._maps.get(info.path) is not m
        if orphan:  # closed or evicted while this read used it
            m.close()

    def read_into(
        self, groups: np.ndarray, records: np.ndarray, out: Mapping[str, np.ndarray], rows: np.ndarray | None = None
    ) -> None:
        """`out[field][rows[k]] = ` record `records[k]` of group `groups[k]` (indices already valid)."""
        if rows is None:
            rows = np.arange(len(groups), dtype=np.int64)
        if not len(groups):
            return
        if len(groups) == 1:  # ds[i]: no sorting to do
            parts = [np.zeros(1, np.int64)]
        else:
            order = np.lexsort((records, groups))
            parts = np.split(order, np.flatnonzero(np.diff(groups[order])) + 1)
        # Local raw files' records are copied by one kernel call per field over their addresses
        # (stoker.kernels.gather_records), after every file is held and its size checked in
        # the order the files come; a record subset's global shuffle reads from most of its
        # files in every batch, and a copy per file and field was most of its time.
        fields = self.catalog.fields
        direct = {n: gathers(out[n], spec.dtype) for n, spec in fields.items()}
        held: list[tuple[FileInfo, _Mapped]] = []
        needs: list[tuple[str, int]] = []  # per held file: its field, and the bytes its records reach
        gathered: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {n: ([], []) for n in fields}
        try:
            for part in parts:
                g = int(groups[part[0]])
                local, dst_rows = records[part], rows[part]
                for name, spec in fields.items():
                    info = self.catalog.files[g][name]
                    if info.compression is not None:
                        self._compressed(name, spec, info, g, local, out[name], dst_rows)
                    elif direct[name] and not is_remote(info.path):
                        m = self._acquire(name, spec, info, local)
                        held.append((info, m))
                        needs.append((name, spec.header_bytes + (int(local.max()) + 1) * spec.record_bytes))
                        to, at = gathered[name]
                        to.append(dst_rows)
                        at.append(local * spec.record_bytes + (m.address() + spec.header_bytes))
                    else:
                        self._raw(name, spec, info, local, out[name], dst_rows)
            for name, (to, at) in gathered.items():
                if to:
                    try:
                        done = gather_records(out[name], np.concatenate(to), np.concatenate(at), fields[name].dtype)
                    except MapFault as e:  # a file cut short after its size was checked
                        raise self._fault(name, fields[name], held, e) from e
                    assert done, "gathers() said the kernel applies"
            # A cut inside a page reads as zeros there, without a fault: the sizes after the copy
            # say whether every byte copied was still the file's.
            for (info, m), (name, need) in zip(held, needs, strict=True):
                self._check_after(name, fields[name], info, m, need)
        finally:
            for info, m in held:
                self._release(info, m)

    def _raw(
        self, name: str, spec: Field, info: FileInfo, local: np.ndarray, dst: np.ndarray, rows: np.ndarray
    ) -> None:
        if is_remote(info.path):  # a URL: coalesced ranged reads (stoker.remote), no memory map
            wanted, inverse = np.unique(local, return_inverse=True)
            raw = remote.read_records(
                info.path, spec.storage_options, spec.header_bytes, spec.record_bytes, wanted,
                size=info.size, field=name,
            )  # fmt: skip
            dst[rows] = raw.view(spec.dtype).reshape(len(wanted), *spec.shape)[inverse]
            return
        m = self._acquire(name, spec, info, local)
        try:
            # numpy casts these, and its reads of a map cannot be guarded: copied out first.
            raw = np.empty((len(local), spec.record_bytes), np.uint8)
            try:
                copy_records(raw, m.fd, m.address(), local * spec.record_bytes + spec.header_bytes)
            except MapFault as e:
                raise self._fault(name, spec, [(info, m)], e) from e
            self._check_after(name, spec, info, m, spec.header_bytes + (int(local.max()) + 1) * spec.record_bytes)
            dst[rows] = raw.view(spec.dtype).reshape(len(local), *spec.shape)
        finally:
            self._release(info, m)

    @staticmethod
    def _check_after(name: str, spec: Field, info: FileInfo, m: _Mapped, need: int) -> None:
        """A CorruptDataError if `info`'s file, read through `m` up to byte `need`, is shorter now."""
        size = os.fstat(m.fd).st_size
        if size < need:
            raise _cut_short(name, spec, info, size, size)

    def _fault(self, name: str, spec: Field, held: Sequence[tuple[FileInfo, _Mapped]], e: OSError) -> CorruptDataError:
        """The error for a MapFault reading `held`'s maps: the file whose map holds the fault's
        address (else the first now shorter than it was) was cut short."""
        at = getattr(e, "address", 0)
        info, m = next(
            ((i, m) for i, m in held if 0 <= at - m.address() < i.size),
            next(((i, m) for i, m in held if os.fstat(m.fd).st_size < i.size), held[0]),
        )
        size = os.fstat(m.fd).st_size
        return _cut_short(name, spec, info, size, at - m.address() if 0 <= at - m.address() < info.size else size)

    def _compressed(
        self, name: str, spec: Field, info: FileInfo, g: int, local: np.ndarray, dst: np.ndarray, rows: np.ndarray
    ) -> None:
        n = self.catalog.count(g)
        if n * spec.record_bytes <= self.cache_bytes:
            dst[rows] = self._decoded(name, spec, info, g, n)[local]
        else:
            self._seek_read(name, spec, info, g, local, dst, rows)

    def _decoded(self, name: str, spec: Field, info: FileInfo, g: int, n: int) -> np.ndarray:
        key = (g, name)
        with self._lock:
            arr = self._cache.get(key)
            if arr is not None:
                self._cache.move_to_end(key)
                return arr
            lock = self._decoding.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                arr = self._cache.get(key)
            if arr is None:
                arr = self._decode_whole(name, spec, info, g, n)
                with self._lock:
                    self._cache[key] = arr
                    self._cached += arr.nbytes
                    while self._cached > self.cache_bytes and len(self._cache) > 1:
                        _, old = self._cache.popitem(last=False)
                        self._cached -= old.nbytes
        return arr

    def _decode_whole(self, name: str, spec: Field, info: FileInfo, g: int, n: int) -> np.ndarray:
        assert info.compression is not None
        buf = np.empty(n * spec.record_bytes, np.uint8)
        index_file = self.catalog.root().index_file(g, name)
        with Inflater(info.path, info.compression, field=name, storage_options=spec.storage_options) as inf:
            got = inf.skip(spec.header_bytes) + inf.readinto(memoryview(buf))  # type: ignore[arg-type]
            if got < spec.header_bytes + len(buf):
                at = max(0, (inf.produced - spec.header_bytes) // spec.record_bytes)
                found = f"ends at decompressed offset {inf.produced}, inside record {at}"
                raise count_disagrees(index_file, info, name, g, n, found, record=at, offset=inf.produced) or _short(
                    name, spec, info, n, inf.produced
                )
            if inf.skip(spec.footer_bytes) != spec.footer_bytes or not inf.at_end():
                found = f"does not end after {n} records and footer_bytes={spec.footer_bytes}"
                lie = count_disagrees(index_file, info, name, g, n, found, record=n, offset=inf.produced)
                if lie is not None:
                    raise lie
                raise CorruptDataError(
                    f"field {name!r}: {info.path!r} does not end after its {n} records and footer_bytes="
                    f"{spec.footer_bytes} (decompressed offset {inf.produced})",
                    field=name, path=info.path, index=n, offset=inf.produced,
                )  # fmt: skip
        return buf.view(spec.dtype).reshape(n, *spec.shape)

    def _seek_read(
        self, name: str, spec: Field, info: FileInfo, g: int, local: np.ndarray, dst: np.ndarray, rows: np.ndarray
    ) -> None:
        """Decode only from the seek point before each run of wanted records (bounded memory)."""
        points = self.catalog.root().seek_points.get((g, name), _FILE_START)
        dst[rows] = seek_read(name, spec, info, points, local, self.catalog.count(g))


_FILE_START = (SeekPoint(0, 0),)


def seek_read(
    name: str, spec: Field, info: FileInfo, points: Sequence[SeekPoint], local: np.ndarray, count: int
) -> np.ndarray:
    """Records `local` (any order) of a compressed file, each run decoded from the seek point before it.

    `points`: the file's seek points sorted by decompressed offset; `count`: its records (for errors).
    """
    assert info.compression is not None
    rb = spec.record_bytes
    wanted, inverse = np.unique(local, return_inverse=True)
    got = np.empty((len(wanted), *spec.shape), spec.dtype)
    view = memoryview(got.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    starts = np.array([p[1] for p in points], dtype=np.int64)
    breaks = np.flatnonzero(np.diff(wanted) != 1) + 1
    inf: Inflater | None = None
    try:
        done = 0
        for run in np.split(wanted, breaks):
            target = spec.header_bytes + int(run[0]) * rb
            k = int(np.searchsorted(starts, target, side="right")) - 1
            if inf is None or inf.produced > target or int(starts[k]) > inf.produced:
                if inf is not None:
                    inf.close()
                inf = Inflater(
                    info.path, info.compression, field=name, start=points[k], storage_options=spec.storage_options
                )
            want = target - inf.produced
            if inf.skip(want) != want:
                raise _short(name, spec, info, count, inf.produced)
            nbytes = len(run) * rb
            if inf.readinto(view[done : done + nbytes]) != nbytes:
                raise _short(name, spec, info, count, inf.produced)
            done += nbytes
    finally:
        if inf is not None:
            inf.close()
    return got[inverse]


def _cut_short(name: str, spec: Field, info: FileInfo, size: int, offset: int) -> CorruptDataError:
    """The error for a read of `info`'s file failing at byte `offset`: the file is `size` bytes now."""
    index = max(0, (offset - spec.header_bytes) // spec.record_bytes)
    return CorruptDataError(
        f"field {name!r}: {info.path!r} is {size} bytes now but was {info.size} bytes when the Dataset "
        f"was built (reading record {index}, byte offset {offset}, failed)",
        field=name, path=info.path, index=index, offset=offset,
    )  # fmt: skip


def _short(name: str, spec: Field, info: FileInfo, n: int, produced: int) -> CorruptDataError:
    index = max(0, (produced - spec.header_bytes) // spec.record_bytes)
    return CorruptDataError(
        f"field {name!r}: {info.compression} stream {info.path!r} ends at decompressed offset {produced}, "
        f"inside record {index} of {n}",
        field=name, path=info.path, index=index, offset=produced,
    )  # fmt: skip


_FIRSTS: weakref.WeakKeyDictionary[Dataset, np.ndarray] = weakref.WeakKeyDictionary()
_READERS: weakref.WeakKeyDictionary[Dataset, RecordReader] = weakref.WeakKeyDictionary()
_TABLE_LOCK = threading.Lock()


def _firsts(ds: Dataset) -> np.ndarray:
    """Cumulative record counts: group g holds global records `firsts[g] .. firsts[g + 1]`."""
    table = _FIRSTS.get(ds)
    if table is None:
        counts = np.fromiter((ds.records_in(g) for g in range(ds.num_groups)), np.int64, ds.num_groups)
        table = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
        with _TABLE_LOCK:
            _FIRSTS[ds] = table
    return table


def _root(ds: Dataset) -> Dataset:
    return ds.root if isinstance(ds, Subset) else ds


def _reader(ds: Dataset) -> RecordReader:
    root = _root(ds)
    with _TABLE_LOCK:
        reader = _READERS.get(root)
        if reader is None:
            reader = _READERS[root] = RecordReader(root._catalog)
    return reader


def locate(ds: Dataset, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, record within the group) of each valid global index of `ds`."""
    firsts = _firsts(ds)
    groups = np.searchsorted(firsts, indices, side="right") - 1
    return groups, indices - firsts[groups]


def to_root(ds: Dataset, groups: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, record) of `ds` as (group, record in the file) of its root dataset."""
    if not isinstance(ds, Subset):
        return groups, records
    view = ds._catalog
    root_records = records.copy()
    order = np.argsort(groups, kind="stable")
    bounds = np.flatnonzero(np.diff(groups[order])) + 1
    for part in np.split(order, bounds) if len(order) else []:
        selected = view.records[int(groups[part[0]])]
        if selected is not None:
            root_records[part] = selected[records[part]]
    return view.groups[groups], root_records


def _indices(ds: Dataset, indices: Any, what: str) -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim != 1:
        raise SpecError(f"{what} must be a 1-D sequence of record indices, got shape {idx.shape}")
    if idx.size and idx.dtype.kind not in "iu":
        raise SpecError(f"{what} must be integers, got dtype {idx.dtype}")
    idx = idx.astype(np.int64)
    n = int(_firsts(ds)[-1])
    if idx.size:
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            first = int(idx[np.flatnonzero(bad)[0]])
            path = _first_path(ds)
            raise RecordIndexError(
                f"record index {first} is out of range for {ds!r} with {n} records (first file {path!r})",
                index=first, path=path,
            )  # fmt: skip
    return np.where(idx < 0, idx + n, idx)


def _first_path(ds: Dataset) -> str | None:
    files = ds.files
    return next(iter(files[0].values())).path if files else None


def read_records(ds: Dataset, indices: Any, *, cast: Any = None) -> dict[str, np.ndarray]:
    """`ds.read`: records at global `indices` (any order, repeats allowed) as `{field: (k, *shape)}`."""
    idx = _indices(ds, indices, "indices")
    dtypes = resolve_cast(ds.fields, cast)
    out = {n: np.empty((len(idx), *f.shape), dtypes[n]) for n, f in ds.fields.items()}
    if len(idx):
        groups, records = to_root(ds, *locate(ds, idx))
        _reader(ds).read_into(groups, records, out)
    return out


def read_one(ds: Dataset, i: Any) -> dict[str, np.ndarray]:
    """`ds[i]`: one record as `{field: array of the field's shape}`; a slice reads a batch."""
    if isinstance(i, slice):
        return read_records(ds, np.arange(*i.indices(len(ds)), dtype=np.int64))
    if isinstance(i, bool) or not isinstance(i, numbers.Integral):
        raise SpecError(f"a record index must be an integer (or a slice), got {i!r}")
    batch = read_records(ds, np.array([int(i)], dtype=np.int64))
    return {n: a[0, ...] for n, a in batch.items()}


class _CatalogView(Catalog):
    """The root catalog seen through a subset: its groups, and per group all records or some."""

    def __init__(self, root: Catalog, groups: np.ndarray, records: Sequence[np.ndarray | None]) -> None:
        # Not Catalog.__init__: a view shares the root's files and settled counts.
        self.fields = root.fields
        self._root = root
        self.groups = groups
        self.records = list(records)
        self.num_groups = len(groups)
        self.files = [root.files[int(g)] for g in groups]
        self.seek_points = {
            (v, name): root.seek_points[(int(g), name)]
            for v, g in enumerate(groups)
            for name in self.fields
            if (int(g), name) in root.seek_points
        }
        self._lock = threading.Lock()

    def count(self, g: int) -> int:
        selected = self.records[g]
        return len(selected) if selected is not None else self._root.count(int(self.groups[g]))

    def settled(self) -> bool:
        return all(r is not None for r in self.records) or self._root.settled()

    def root(self) -> Catalog:
        return self._root


class Subset(Dataset):
    """Some groups of a root Dataset and, per group, all or some of its records (in file order).

    Made by `Dataset.select` and `Dataset.split`; everything a Dataset does
    (`len`, `ds[i]`, `read`, `loader` with every option, `select` again) works on it.
    Its global indices run over its own records, group by group.
    """

    _catalog: _CatalogView

    def __init__(self, root: Dataset, groups: np.ndarray, records: Sequence[np.ndarray | None]) -> None:
        # Not Dataset.__init__: no globbing or counting again, the root did that.
        self.root = root
        self.fields = root.fields
        self.pair_key = root.pair_key
        self._catalog = _CatalogView(root._catalog, groups, records)

    @property
    def groups(self) -> tuple[Group, ...]:
        """Every group of the subset, `index` being its group number in the root dataset."""
        view = self._catalog
        return tuple(
            Group(int(view.groups[v]), {n: i.path for n, i in view.files[v].items()}, view.count(v))
            for v in range(view.num_groups)
        )

    def _subset_key(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self._catalog.groups, np.int64).tobytes())
        for selected in self._catalog.records:
            h.update(b"*" if selected is None else b"[" + np.ascontiguousarray(selected, np.int64).tobytes() + b"]")
        return h.hexdigest()[:16]

    def _assembler(
        self, out_dtypes: Mapping[str, np.dtype], allocator: Allocator, *, batch_size: int, with_index: bool,
        fetcher: Fetcher | None = None,
    ) -> Assembler:  # fmt: skip
        kind = _GroupsAssembler if all(r is None for r in self._catalog.records) else _RecordsAssembler
        return kind(self, out_dtypes, allocator, batch_size=batch_size, with_index=with_index, fetcher=fetcher)

    def __repr__(self) -> str:
        return f"Subset of {self.root!r}: {self.num_groups} groups"


class _GroupsAssembler(Assembler):
    """Whole groups: the streaming assembler, with `__group__` named in the root dataset."""

    def __init__(
        self, view: Subset, out_dtypes: Mapping[str, np.dtype], allocator: Allocator, *, batch_size: int,
        with_index: bool, fetcher: Fetcher | None = None,
    ) -> None:  # fmt: skip
        super().__init__(
            view._catalog, out_dtypes, allocator, batch_size=batch_size, with_index=with_index, fetcher=fetcher
        )
        self._groups = view._catalog.groups

    def __call__(self, task: Task) -> tuple[dict[str, np.ndarray], BatchPlan]:
        out, plan = super().__call__(task)
        if self.with_index:
            real = plan.rows if plan.valid is None else plan.valid
            out[GROUP_KEY][:real] = self._groups[out[GROUP_KEY][:real]]
        return out, plan


class _RecordsAssembler(Assembler):
    """Some records of groups: every planned batch read by random access (no stream turns)."""

    def __init__(
        self, view: Subset, out_dtypes: Mapping[str, np.dtype], allocator: Allocator, *, batch_size: int,
        with_index: bool, fetcher: Fetcher | None = None,
    ) -> None:  # fmt: skip
        super().__init__(
            view._catalog, out_dtypes, allocator, batch_size=batch_size, with_index=with_index, fetcher=fetcher
        )
        self._view = view
        self._reader = RecordReader(view.root._catalog)  # its cache lives as long as this pass

    def prepare(self, plan: BatchPlan) -> Task:
        return Task(plan)

    def fetching_ahead(self, plans: Iterator[BatchPlan]) -> Iterator[BatchPlan]:
        return plans  # its batches are read by random access (RecordReader), not through the fetcher

    def close(self) -> None:
        super().close()
        self._reader.close()

    def __call__(self, task: Task) -> tuple[dict[str, np.ndarray], BatchPlan]:
        plan = task.plan
        out = {n: self.allocator.array((plan.rows, *f.shape), self.out_dtypes[n]) for n, f in self.fields.items()}
        if self.with_index:
            out[GROUP_KEY] = self.allocator.array((plan.rows,), np.dtype(np.int64))
            out[INDEX_KEY] = self.allocator.array((plan.rows,), np.dtype(np.int64))
        if plan.valid is not None:
            out[VALID_KEY] = self.allocator.array((plan.rows,), np.dtype(bool))
            fill_padding(out, plan.valid)
        if plan.gather is not None:
            groups, local = plan.gather.groups, plan.gather.index
        else:
            runs = [r for r in plan.runs if r.count]
            groups = np.concatenate([np.full(r.count, r.group, np.int64) for r in runs] or [np.zeros(0, np.int64)])
            local = np.concatenate(
                [np.arange(r.start, r.stop, r.step, dtype=np.int64) for r in runs] or [np.zeros(0, np.int64)]
            )
        root_groups, root_records = to_root(self._view, groups, local)
        self._reader.read_into(root_groups, root_records, out)
        if self.with_index:
            out[GROUP_KEY][: len(groups)] = root_groups
            out[INDEX_KEY][: len(groups)] = root_records
        return out, plan


def _positions(value: Any, n: int, what: str) -> np.ndarray:
    """A slice or integer sequence of positions in `[0, n)` (negatives from the end), no repeats."""
    if isinstance(value, slice):
        return np.arange(*value.indices(n), dtype=np.int64)
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise SpecError(f"{what} must be a slice or a 1-D sequence of integers, got {value!r:.100}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < -n or arr.max() >= n):
        bad = int(arr[(arr < -n) | (arr >= n)][0])
        raise RecordIndexError(f"{what}: {bad} is out of range for {n}", index=bad)
    arr = np.where(arr < 0, arr + n, arr)
    if len(np.unique(arr)) != len(arr):
        raise SpecError(f"{what} holds repeated values; a subset holds each group or record once")
    return arr


def select(ds: Dataset, *, groups: Any = None, records: Any = None) -> Subset:
    """A subset of `ds`: `groups` (a slice or group numbers, kept in the order given), then
    `records` (a slice or global record indices of those groups, taken in ascending order).

    Groups are numbered as in `ds` (for a subset: its own groups); `records` index the
    records of the selected groups, as `len(ds.select(groups=...))` counts them. Groups
    left with no record are dropped. Repeats are an error.

    Example:
        >>> few = ds.select(groups=[0, 2], records=slice(0, 100))
    """
    if isinstance(ds, Subset):
        root, base_groups, base_records = ds.root, ds._catalog.groups, list(ds._catalog.records)
    else:
        root, base_groups, base_records = ds, np.arange(ds.num_groups, dtype=np.int64), [None] * ds.num_groups
    if groups is not None:
        chosen = _positions(groups, len(base_groups), "groups")
        base_groups = base_groups[chosen]
        base_records = [base_records[int(i)] for i in chosen]
    view = Subset(root, base_groups, base_records)
    if records is None:
        return view
    idx = np.sort(_positions(records, len(view), "records"))
    vg, local = locate(view, idx)
    new_groups: list[int] = []
    new_records: list[np.ndarray | None] = []
    bounds = np.flatnonzero(np.diff(vg)) + 1
    for part in np.split(np.arange(len(idx)), bounds) if len(idx) else []:
        v = int(vg[part[0]])
        chosen_records = local[part]
        prior = base_records[v]
        mapped = chosen_records if prior is None else prior[chosen_records]
        g = int(base_groups[v])
        whole = len(mapped) == root.records_in(g) and bool((mapped == np.arange(len(mapped))).all())
        new_groups.append(g)
        new_records.append(None if whole else mapped)  # whole groups keep streaming reads
    return Subset(root, np.array(new_groups, dtype=np.int64), new_records)


def _sizes(fractions: Sequence[float], total: int) -> list[int]:
    """Largest-remainder rounding: sizes summing to `total`, ties to the earlier name."""
    exact = [f * total for f in fractions]
    sizes = [math.floor(x) for x in exact]
    for k in sorted(range(len(exact)), key=lambda k: (-(exact[k] - sizes[k]), k))[: total - sum(sizes)]:
        sizes[k] += 1
    return sizes


def split(ds: Dataset, fractions: Mapping[str, float], *, seed: int, by: str = "group") -> dict[str, Subset]:
    """Disjoint subsets covering `ds`, sized by `fractions` (summing to 1), deterministic in `seed`.

    `by="group"` deals whole groups (files), so any compression streams; `by="record"`
    deals records. Units are permuted by a keyed permutation of `seed` (its own stream,
    independent of loader shuffles), cut in the order of `fractions` with sizes rounded by
    largest remainder, and each part keeps the dataset's order. The same seed and dataset
    give the same parts on any machine. A part that would be empty (2 groups cannot give a 10%
    part by group) is a SpecError, never a silent empty subset.

    Example:
        >>> parts = ds.split({"train": 0.9, "val": 0.1}, seed=0, by="record")
        >>> len(parts["train"]) + len(parts["val"]) == len(ds)
        True
    """
    if not isinstance(fractions, Mapping) or not fractions:
        raise SpecError(f"fractions={fractions!r} must be a non-empty mapping of name -> fraction")
    for name, f in fractions.items():
        if not isinstance(name, str) or isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 <= f <= 1:
            raise SpecError(f"fractions[{name!r}]={f!r} must be a number in [0, 1] under a string name")
    if abs(sum(float(f) for f in fractions.values()) - 1) > 1e-9:
        total = sum(fractions.values())
        raise SpecError(f"fractions {dict(fractions)} sum to {total}, not 1: the parts must cover the data")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise SpecError(f"seed={seed!r} must be a non-negative integer")
    if by not in ("group", "record"):
        raise SpecError(f"by={by!r} must be 'group' or 'record'")
    total = ds.num_groups if by == "group" else len(ds)
    sizes = _sizes([float(f) for f in fractions.values()], total)
    empty = [name for name, size in zip(fractions, sizes, strict=True) if size == 0]
    if empty:
        unit = "groups" if by == "group" else "records"
        instead = "split by='record', give them larger fractions" if by == "group" else "give them larger fractions"
        raise SpecError(
            f"split {dict(fractions)} of {total} {unit} (by={by!r}) leaves {', '.join(map(repr, empty))} empty "
            f"(sizes {dict(zip(fractions, sizes, strict=True))}); {instead}, or leave them out"
        )
    perm = Permutation(total, int(seed), 0, STREAM_SPLIT)(np.arange(total, dtype=np.int64))
    out: dict[str, Subset] = {}
    start = 0
    for name, size in zip(fractions, sizes, strict=True):
        part = np.sort(perm[start : start + size])
        start += size
        out[name] = select(ds, groups=part) if by == "group" else select(ds, records=part)
    return out
