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
from the persistent index, see `stoker.io.index`; else the file's start) only as far as the
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

import errno
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CorruptDataError, ReadError
from ..io import remote
from ..io.faults import cut_short, no_end, resized, short_stream
from ..io.files import Catalog, FileInfo, open_local
from ..io.index import count_disagrees
from ..io.inflate import Inflater
from ..io.reads import seek_read
from ..io.remote import is_remote
from ..io.seekpoints import SeekPoint
from ..io.unchanged import check_unchanged
from ..kernels import MapFault, copy_records, gather_records, gathers, guard_maps
from ..machine import descriptor_limits
from .decoded import KeptDecoded
from .descriptors import pass_open_files
from .openfiles import OpenFile, map_refused

if TYPE_CHECKING:
    from ..spec import Field

__all__ = ["DEFAULT_CACHE_BYTES", "STREAM_SPLIT", "RecordReader"]

# Decoded compressed files kept per Dataset for random access. Label files of one float32 a record
# take 16 KiB a group of 4096 records, so a million groups' labels fit; image files of
# 64 MiB decoded: four at a time, enough for the loader's default cycle of 4 groups.
DEFAULT_CACHE_BYTES = 256 << 20
# Raw files a reader keeps mapped between reads (each costs two descriptors and address space,
# no memory), at least, within a quarter of the soft descriptor limit (a read of more groups
# holds them a share at a time); as many as a loader's pass keeps open where the limit allows
# (stoker.engine.descriptors.pass_open_files), least recently used ones closed beyond. A record subset's
# global shuffle reads from most of its files in every batch, and with too few kept it maps
# them again batch after batch (measured: benchmarks/results/access_history.md).
MAX_MAPPED = 64
# The split's permutation stream: independent of the loader's record/group/window streams.
STREAM_SPLIT = 3


def _close_all(maps: OrderedDict[str, OpenFile]) -> None:
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
        # Files decoded whole (each at most cache_bytes), least recently used dropped first.
        self._decoded_files = KeptDecoded(self.cache_bytes)
        self._lock = threading.Lock()
        self._decoding: dict[tuple[int, str], threading.Lock] = {}
        self._maps: OrderedDict[str, OpenFile] = OrderedDict()
        # Two descriptors a mapped file (the file's and the copy mmap keeps): at most half the
        # soft descriptor limit, the rest left to the loader and the caller's own files.
        self._max_mapped = max(1, min(max(MAX_MAPPED, pass_open_files()), descriptor_limits()[0] // 4))
        self._finalizer = weakref.finalize(self, _close_all, self._maps)

    def close(self) -> None:
        """Unmap and close every file and drop decoded data; idempotent (the reader reopens on use)."""
        with self._lock:
            busy = {p: m for p, m in self._maps.items() if m.refs}
            idle = [m for p, m in self._maps.items() if not m.refs]
            self._maps.clear()
            self._maps.update(busy)  # in use by another thread: closed when released
            self._decoded_files.clear()
        for m in idle:
            m.close()

    def _acquire(self, name: str, spec: Field, info: FileInfo, local: np.ndarray) -> OpenFile:
        with self._lock:
            m = self._maps.get(info.path)
            if m is not None:
                self._maps.move_to_end(info.path)
                m.refs += 1
        if m is None:
            fd = self._open(name, info)
            try:
                self._check_size(name, spec, info, fd, local)
                guard_maps()
                try:
                    m = OpenFile(fd, info.size, mmap.mmap(fd, info.size, access=mmap.ACCESS_READ))
                except ValueError:  # cut since the check: "mmap length is greater than file size"
                    self._check_size(name, spec, info, fd, local)
                    raise
                except OSError as e:  # out of address space (`ulimit -v`), too many maps
                    raise map_refused(name, info.path, info.size, e) from e
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

    def _open(self, name: str, info: FileInfo) -> int:
        """A descriptor of `info`'s file; out of descriptors, the maps no read uses are closed and
        the open tried once more, before the ReadError naming the file."""
        try:
            return open_local(name, info.path)
        except ReadError as e:
            if not isinstance(e.__cause__, OSError) or e.__cause__.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            with self._lock:
                idle = [(p, m) for p, m in self._maps.items() if not m.refs]
                for p, _ in idle:
                    del self._maps[p]
            if not idle:
                raise
            for _, m in idle:
                m.close()
        return open_local(name, info.path)

    def _check_size(self, name: str, spec: Field, info: FileInfo, fd: int, local: np.ndarray) -> None:
        # On every read: a file cut short under a map would kill the process (SIGBUS); and the
        # same fstat says whether it is still the file the Dataset saw.
        st = os.fstat(fd)
        if st.st_size != info.size:
            raise resized(name, spec, info, st.st_size, int(local.max()))
        check_unchanged(name, info.path, info.seen, st, cut_ok=True)

    def _release(self, info: FileInfo, m: OpenFile) -> None:
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
        # A read of more groups than may be mapped at once holds them a share of that at a time:
        # every file of a part is held until its part is copied.
        per = max(1, self._max_mapped // (2 * len(self.catalog.fields)))  # 2: room for a second reader thread
        for k in range(0, len(parts), per):
            self._read_parts(parts[k : k + per], groups, records, rows, out)

    def _read_parts(
        self,
        parts: list[np.ndarray],
        groups: np.ndarray,
        records: np.ndarray,
        rows: np.ndarray,
        out: Mapping[str, np.ndarray],
    ) -> None:
        """`read_into` of the records `parts` (positions in `groups`, one group each) name."""
        # Local raw files' records are copied by one kernel call per field over their addresses
        # (stoker.kernels.gather_records), after every file is held and its size checked in
        # the order the files come; a record subset's global shuffle reads from most of its
        # files in every batch, and a copy per file and field was most of its time.
        fields = self.catalog.fields
        direct = {n: gathers(out[n], spec.dtype) for n, spec in fields.items()}
        held: list[tuple[FileInfo, OpenFile]] = []
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
        if is_remote(info.path):  # a URL: coalesced ranged reads (stoker.io.remote), no memory map
            wanted, inverse = np.unique(local, return_inverse=True)
            raw = remote.read_records(
                info.path, spec.storage_options, spec.header_bytes, spec.record_bytes, wanted,
                size=info.size, field=name, version=info.version,
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
    def _check_after(name: str, spec: Field, info: FileInfo, m: OpenFile, need: int) -> None:
        """A CorruptDataError if `info`'s file, read through `m` up to byte `need`, is shorter now."""
        size = os.fstat(m.fd).st_size
        if size < need:
            raise cut_short(name, spec, info, size, size)

    def _fault(self, name: str, spec: Field, held: Sequence[tuple[FileInfo, OpenFile]], e: OSError) -> CorruptDataError:
        """The error for a MapFault reading `held`'s maps: the file whose map holds the fault's
        address (else the first now shorter than it was) was cut short."""
        at = getattr(e, "address", 0)
        info, m = next(
            ((i, m) for i, m in held if 0 <= at - m.address() < i.size),
            next(((i, m) for i, m in held if os.fstat(m.fd).st_size < i.size), held[0]),
        )
        size = os.fstat(m.fd).st_size
        return cut_short(name, spec, info, size, at - m.address() if 0 <= at - m.address() < info.size else size)

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
        arr = self._decoded_files.get(name, info.path, info.seen)
        if arr is not None:
            self._check_kept(name, info)
            return arr
        with self._lock:
            lock = self._decoding.setdefault(key, threading.Lock())
        with lock:
            arr = self._decoded_files.get(name, info.path, info.seen)
            if arr is None:
                arr = self._decode_whole(name, spec, info, g, n)  # its open checks the file
                self._decoded_files.put(name, info.path, info.seen, arr)
        return arr

    @staticmethod
    def _check_kept(name: str, info: FileInfo) -> None:
        """A stat per reuse of a decoded file: one changed since is refused, as opening it would be."""
        if info.seen is None:  # a URL
            return
        try:
            st = os.stat(info.path)
        except OSError as e:
            raise ReadError(
                f"field {name!r}: cannot stat {info.path!r}: {e.strerror}", field=name, path=info.path
            ) from e
        check_unchanged(name, info.path, info.seen, st)

    def _decode_whole(self, name: str, spec: Field, info: FileInfo, g: int, n: int) -> np.ndarray:
        assert info.compression is not None
        buf = np.empty(n * spec.record_bytes, np.uint8)
        index_file = self.catalog.root().index_file(g, name)
        with Inflater(
            info.path,
            info.compression,
            field=name,
            storage_options=spec.storage_options,
            version=info.version,
            seen=info.seen,
        ) as inf:
            got = inf.skip(spec.header_bytes) + inf.readinto(memoryview(buf))  # type: ignore[arg-type]
            if got < spec.header_bytes + len(buf):
                at = max(0, (inf.produced - spec.header_bytes) // spec.record_bytes)
                found = f"ends at decompressed offset {inf.produced}, inside record {at}"
                raise count_disagrees(
                    index_file, info, name, g, n, found, record=at, offset=inf.produced
                ) or short_stream(name, spec, info, n, inf.produced)
            if inf.skip(spec.footer_bytes) != spec.footer_bytes or not inf.at_end():
                found = f"does not end after {n} records and footer_bytes={spec.footer_bytes}"
                lie = count_disagrees(index_file, info, name, g, n, found, record=n, offset=inf.produced)
                if lie is not None:
                    raise lie
                raise no_end(name, spec, info, n, inf.produced)
        return buf.view(spec.dtype).reshape(n, *spec.shape)

    def _seek_read(
        self, name: str, spec: Field, info: FileInfo, g: int, local: np.ndarray, dst: np.ndarray, rows: np.ndarray
    ) -> None:
        """Decode only from the seek point before each run of wanted records (bounded memory)."""
        points = self.catalog.root().seek_points.get((g, name), _FILE_START)
        dst[rows] = seek_read(name, spec, info, points, local, self.catalog.count(g))


_FILE_START = (SeekPoint(0, 0),)
