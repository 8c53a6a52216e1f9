"""A persistent index of the data: record counts and seek points, no decompression to open.

`write_index(ds)` (or `stoker index DIR`) writes one small JSON file, `.stoker-index.json`,
per directory that holds the dataset's files: beside them, or under `index_dir` (the
argument, `stoker index --index-dir`, or the `STOKER_INDEX_DIR` environment variable) in a
folder named for the data directory, for data on read-only storage. Per file it records the
size and `mtime_ns` it was indexed at, the record count, and for gzip/zlib files the
decompressed size, the start of every gzip member, and periodic seek points inside members
and zlib streams: the first deflate block boundary after every `spacing` bytes of output
(1 MiB by default) plus the 32 KiB window before it, kept compressed in a sidecar file
`.stoker-windows.NAME.BUILD` beside the index (see `stoker.seekpoints`).

A Dataset built afterwards takes the record counts of compressed files from the index
when the file's size and mtime still match, so opening 10,000 compressed groups
decompresses nothing; random access (`ds[i]`, `ds.read`), subsets and loader reads that
start inside a compressed file (shards, resume) start decoding at the last seek point before
the records they need instead of at the start of the file. Where libz cannot be loaded
through ctypes, the index holds member starts only (one seek point per gzip member).

Trust: an entry whose file changed size or mtime is stale. `Dataset(..., index="auto")`
(the default) raises `stoker.errors.StaleIndexError` naming the file; an index file
of another format version, or one that is not well formed (any value of the wrong type or out
of range) raises naming the index file and the entry. `index="rebuild"` rewrites stale,
missing, malformed and old entries (decompressing only those files); `index="ignore"` never
reads it. What the index says is checked when it is used, not believed: every seek point
carries a check of its numbers, the file's decompressed size and the first KiB decoded from it;
every window its CRC-32 and the build of its sidecar; and a count from the index is confirmed
at the end of the stream as a gzip trailer's would be. A point, window or count that does not
hold is a StaleIndexError naming the index, never wrong records.

One generation at a time: a rebuild writes its windows under new names (the build is a hash
of their contents), then the index (temp file, fsync, atomic rename), and only then removes
the windows files no entry names any more and no reader still uses. Killed at any moment, the
index on disk names windows files that exist and belong to it. One writer per index directory
at a time, and a Dataset keeps the windows files its seek points name for as long as it lives,
whatever is re-indexed meanwhile (see `stoker.io.indexlock`).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import json
import os
import re
import reprlib
import stat
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..errors import CorruptDataError, SpecError, StaleIndexError, WriteError
from . import indexlock, seekpoints
from .indexlock import Pin
from .inflate import Inflater
from .remote import is_remote
from .seekpoints import SeekPoint, WindowRef

if TYPE_CHECKING:
    from ..spec import Field
    from .files import Catalog, FileInfo

__all__ = [
    "ENV_INDEX_DIR",
    "INDEX_NAME",
    "INDEX_VERSION",
    "IndexEntry",
    "IndexLookup",
    "IndexMode",
    "apply_index",
    "count_disagrees",
    "entry_check",
    "entry_from_scan",
    "index_home",
    "index_path",
    "parse_entry",
    "resolve_index_dir",
    "write_index",
]

INDEX_NAME = ".stoker-index.json"  # a dot file, so globs like "data/*" never match it
# 3: a check on every seek point, windows files named per build. Versions 1 (member starts
# only) and 2 (unchecked points) are refused, naming the file; index="rebuild" replaces them.
INDEX_VERSION = 3
ENV_INDEX_DIR = "STOKER_INDEX_DIR"
_FORMAT = "stoker-index"
IndexMode = Literal["auto", "rebuild", "ignore"]
_MODES = ("auto", "rebuild", "ignore")
_MAX_OFFSET = 1 << 62  # past any real file: a larger number in an index is a lie, not an offset
_CRC_MAX = 0xFFFF_FFFF
# entry_check's bytes for the common entry, one member and no block point (10,000s of small files).
_ONE_MEMBER = struct.Struct("<8q")
_BUILD = re.compile(r"[0-9a-f]{32}")
# A windows file of this store: NAME, optionally .BUILD, optionally .RANDOM.tmp (an unfinished write).
_WINDOWS_FILE = re.compile(r"\.stoker-windows\.(.+?)(?:\.[0-9a-f]{32}(?:\.[a-z0-9_]+\.tmp)?)?")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40


@dataclass(frozen=True)
class IndexEntry:
    """What the index knows of one file."""

    size: int
    mtime_ns: int
    compression: str | None
    decompressed_bytes: int  # == size for raw files
    # (compressed offset, decompressed offset, check) of each gzip member start; one for zlib.
    members: tuple[tuple[int, int, int], ...] = ()
    # (byte, bit, decompressed offset, window offset, window length, window CRC-32, check) of
    # each block seek point; the windows live in the sidecar `windows` of build `build`.
    points: tuple[tuple[int, int, int, int, int, int, int], ...] = ()
    windows: str | None = None
    build: str | None = None

    def to_json(self, records: int) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "compression": self.compression,
            "records": records,
            "decompressed_bytes": self.decompressed_bytes,
        }
        if self.compression is not None:
            doc["members"] = [list(m) for m in self.members]
            doc["check"] = entry_check(
                self.size, self.mtime_ns, self.decompressed_bytes, self.members, self.points, self.build
            )
        if self.points:  # only where there are points: 10,000 small files parse measurably faster without
            doc.update(points=[list(p) for p in self.points], windows=self.windows, build=self.build)
        return doc


def resolve_index_dir(index_dir: str | os.PathLike[str] | None) -> str | None:
    """Where indexes live: `index_dir`, else `$STOKER_INDEX_DIR`, else None (beside the data)."""
    if index_dir is None:
        index_dir = os.environ.get(ENV_INDEX_DIR) or None
        if index_dir is None:
            return None
    if isinstance(index_dir, bool) or not isinstance(index_dir, (str, os.PathLike)):
        raise SpecError(f"index_dir={index_dir!r} must be a directory path (str or os.PathLike) or None")
    path = os.fspath(index_dir)
    if not isinstance(path, str) or not path:
        raise SpecError(f"index_dir={index_dir!r} must be a non-empty directory path")
    return path if is_remote(path) else os.path.abspath(path)  # a URL: where a remote dataset's manifest lives


def index_home(data_dir: str, index_dir: str | None = None) -> str:
    """The directory holding the index (and windows files) of the data files in `data_dir`:
    `data_dir` itself, or a folder of `index_dir` named for it (its name and a hash of its path)."""
    data_dir = os.path.abspath(data_dir)
    if index_dir is None:
        return data_dir
    key = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:16]
    return os.path.join(index_dir, f"{os.path.basename(data_dir) or 'root'}-{key}")


def index_path(data_file: str, index_dir: str | None = None) -> str:
    """The index file that covers `data_file` (`index_dir` as `resolve_index_dir` gives it)."""
    return os.path.join(index_home(os.path.dirname(os.path.abspath(data_file)), index_dir), INDEX_NAME)


def _unreadable(path: str, why: str) -> StaleIndexError:
    return StaleIndexError(
        f"index file {path!r} {why}; rebuild it with `stoker index` or Dataset(..., index='rebuild')", path=path
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number an index holds")


def _load(path: str) -> dict[str, Any] | None:
    """The index file's entries by basename; None when there is no index file."""
    try:
        # O_NONBLOCK: a FIFO in its place opens at once (and is refused below) instead of blocking.
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _unreadable(path, f"cannot be read ({e.strerror})") from e
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise _unreadable(path, "is not a regular file")
            data = f.read()
    except OSError as e:
        raise _unreadable(path, f"cannot be read ({e.strerror})") from e
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
        raise _unreadable(path, f"cannot be read ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("files"), dict):
        raise StaleIndexError(f"{path!r} is not a stoker index file; remove it or rebuild it", path=path)
    if doc.get("version") != INDEX_VERSION:
        raise StaleIndexError(
            f"index file {path!r} has format version {_REPR.repr(doc.get('version'))}, this stoker reads version "
            f"{INDEX_VERSION}; rebuild it with `stoker index` or Dataset(..., index='rebuild')",
            path=path,
        )
    return doc["files"]


def scan(name: str, info: FileInfo, home: str, *, spacing: int = seekpoints.SPACING) -> IndexEntry:
    """Index one file: decompress it once to find its size, member starts and seek points; a
    windows file, if any, is written in `home` (the index's directory)."""
    if info.compression is None:
        return IndexEntry(info.size, info.mtime_ns, None, info.size)
    if seekpoints.available() and not is_remote(info.path):
        entry = entry_from_scan(
            info, home, seekpoints.scan_file(info.path, info.compression, spacing=spacing, field=name)
        )
    else:  # no libz (or a URL): member starts, found by the ordinary decoder
        total, heads = _member_heads(name, info)
        entry = IndexEntry(info.size, info.mtime_ns, info.compression, total, _members(total, heads))
    st = os.stat(info.path)
    if st.st_size != info.size or st.st_mtime_ns != info.mtime_ns:
        raise StaleIndexError(f"field {name!r}: {info.path!r} changed while it was being indexed", field=name,
                              path=info.path)  # fmt: skip
    return entry


def entry_from_scan(info: FileInfo, home: str, found: seekpoints.Scan) -> IndexEntry:
    """The entry of compressed file `info` from what `seekpoints.scan_file` found in it (or in a
    copy of it); the windows of its seek points are written in `home`."""
    total = found.decompressed_bytes
    points: tuple[tuple[int, int, int, int, int, int, int], ...] = ()
    windows = build = None
    if found.points:
        windows, build, spans = seekpoints.write_windows(
            home, os.path.basename(info.path), info.size, info.mtime_ns, [p[3] for p in found.points]
        )
        points = tuple(
            (c, b, d, off, n, crc, seekpoints.point_check(c, b, d, total, head))
            for (c, b, d, _, head), (off, n, crc) in zip(found.points, spans, strict=True)
        )
    members = _members(total, found.members)
    return IndexEntry(info.size, info.mtime_ns, info.compression, total, members, points, windows, build)


def _members(total: int, heads: Iterable[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    return tuple((c, d, seekpoints.point_check(c, 0, d, total, head)) for c, d, head in heads)


def _member_heads(name: str, info: FileInfo) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """(decompressed size, (compressed, decompressed, head CRC) of each member) by plain decoding."""
    assert info.compression is not None
    heads = seekpoints.Heads()
    found: list[tuple[int, int, int]] = []
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with Inflater(info.path, info.compression, field=name) as inf:
        while True:
            at = inf.produced
            n = inf.readinto(view)
            for c, d in inf.members[len(found) :]:  # members that began in this chunk
                found.append((c, d, heads.add(d)))
            heads.feed(view[:n], at)
            if n < len(buf):
                break
        total = inf.produced
    return total, tuple((c, d, heads.crcs[k]) for c, d, k in found)


class _Malformed(Exception):
    """One value of an index entry that cannot be what the index format says."""


def _num(value: Any, where: str, hi: int = _MAX_OFFSET) -> int:
    if type(value) is not int or not 0 <= value <= hi:  # type(): a bool or a float is no offset
        raise _Malformed(f"{where} is {_REPR.repr(value)}, not an integer in 0..{hi}")
    return value


def _list(value: Any, where: str, length: int | None = None) -> list[Any]:
    if type(value) is not list or (length is not None and len(value) != length):
        raise _Malformed(f"{where} is {_REPR.repr(value)}, not a list" + (f" of {length}" if length else ""))
    return value


def parse_entry(
    index_file: str, info: FileInfo, doc: Any, field: str | None = None
) -> tuple[int, tuple[SeekPoint, ...]]:
    """(decompressed size, seek points sorted by decompressed offset) of an entry that matched
    `info`; a StaleIndexError naming the index file and the entry where a value cannot be right."""
    try:
        return _parse(index_file, info, doc)
    except _Malformed as e:
        raise StaleIndexError(
            f"field {field!r}: index {index_file!r} has a malformed entry for {info.path!r} (entry "
            f"{os.path.basename(info.path)!r}): {e}; rebuild it with `stoker index` or Dataset(..., index='rebuild')",
            field=field,
            path=index_file,
        ) from None


def _parse(index_file: str, info: FileInfo, doc: Any) -> tuple[int, tuple[SeekPoint, ...]]:
    if type(doc) is dict and "points" not in doc:  # one member, no block point: checked inline, same rules
        total, members, check = doc.get("decompressed_bytes"), doc.get("members"), doc.get("check")
        if type(members) is list and len(members) == 1 and type(m := members[0]) is list and len(m) == 3:
            c, d, head = m
            if (
                type(total) is int and 0 <= total <= _MAX_OFFSET and type(c) is int and c == 0 and type(d) is int
                and d == 0 and type(head) is int and 0 <= head <= _CRC_MAX and type(check) is int
                and check == zlib.crc32(_ONE_MEMBER.pack(info.size, info.mtime_ns, total, 1, 0, 0, 0, head))
            ):  # fmt: skip
                return total, (SeekPoint(0, 0, check=head, total=total, index_file=index_file),)
    if not isinstance(doc, dict):
        raise _Malformed(f"it is {_REPR.repr(doc)}, not an object")
    last = max(0, info.size - 1)
    total = _num(doc.get("decompressed_bytes"), "decompressed_bytes")
    members = _list(doc.get("members"), "members")
    if not 0 < len(members) <= info.size:
        raise _Malformed(f"members holds {len(members)} member starts for a file of {info.size} bytes")
    heads: list[tuple[int, int, int]] = []
    for k, m in enumerate(members):
        c, d, check = _list(m, f"members[{k}]", 3)
        c, d = _num(c, f"members[{k}][0]", last), _num(d, f"members[{k}][1]", total)
        if not k and (c, d) != (0, 0):
            raise _Malformed(f"members[0] = {[c, d]}, not the file's start [0, 0]")
        if k and (c <= heads[-1][0] or d < heads[-1][1]):
            raise _Malformed(f"members[{k}] = {[c, d]} does not follow members[{k - 1}]")
        heads.append((c, d, _num(check, f"members[{k}][2]", _CRC_MAX)))
    raw = doc.get("points")
    raw = [] if raw is None else _list(raw, "points")
    points: list[tuple[int, int, int, int, int, int, int]] = []
    build = sidecar = None
    if raw:
        build = doc.get("build")
        if type(build) is not str or not _BUILD.fullmatch(build):
            raise _Malformed(f"build is {_REPR.repr(build)}, not 32 hex digits")
        expected = seekpoints.windows_name(os.path.basename(info.path), build)
        if doc.get("windows") != expected:  # a basename beside the index, never a path to elsewhere
            raise _Malformed(f"windows is {_REPR.repr(doc.get('windows'))}, not {expected!r}")
        sidecar = os.path.join(os.path.dirname(index_file), expected)
    for k, p in enumerate(raw):
        at = f"points[{k}]"
        c, bits, d, offset, length, crc, check = _list(p, at, 7)
        offset = _num(offset, f"{at}[3]")
        if offset < seekpoints.HEADER_BYTES:
            raise _Malformed(f"{at}[3] = {offset} lies inside the windows file's header")
        points.append((
            _num(c, f"{at}[0]", last), _num(bits, f"{at}[1]", 7), _num(d, f"{at}[2]", total), offset,
            _num(length, f"{at}[4]", seekpoints.MAX_PACKED), _num(crc, f"{at}[5]", _CRC_MAX),
            _num(check, f"{at}[6]", _CRC_MAX),
        ))  # fmt: skip
    check = _num(doc.get("check"), "check", _CRC_MAX)
    if check != entry_check(info.size, info.mtime_ns, total, heads, points, build):
        raise _Malformed(f"check {check} is not the CRC-32 of its values: the entry was changed after it was written")
    starts = [SeekPoint(c, d, check=k, total=total, index_file=index_file) for c, d, k in heads]
    if not points:
        return total, tuple(starts)
    assert sidecar is not None and build is not None
    member_offsets = [c for c, _, _ in heads]
    found = list(starts)
    for c, bits, d, offset, length, crc, check in points:
        window = WindowRef(sidecar, offset, length, crc, build, info.size, info.mtime_ns)
        j = bisect.bisect_right(member_offsets, c)
        after = (heads[j][0], heads[j][1]) if j < len(heads) else None
        found.append(SeekPoint(c, d, bits, window, after, check, total, index_file))
    found.sort(key=lambda p: p.decompressed)
    return total, tuple(found)


def entry_check(
    size: int,
    mtime_ns: int,
    total: int,
    members: Iterable[Iterable[int]],
    points: Iterable[Iterable[int]],
    build: str | None,
) -> int:
    """CRC-32 of an entry's values, written with it: an entry changed by anything but stoker's
    writer (a flipped digit, an edit, another entry's numbers) is refused when the Dataset opens."""
    members, points = list(members), list(points)
    nums = [size, mtime_ns, total, len(members), len(points), *itertools.chain(*members), *itertools.chain(*points)]
    return zlib.crc32((build or "").encode(), zlib.crc32(struct.pack(f"<{len(nums)}q", *nums)))


def records_of(name: str, spec: Field, info: FileInfo, entry: IndexEntry) -> int:
    """The record count an entry implies under the field's record layout."""
    return record_count(name, spec, info, entry.decompressed_bytes, source=" (per its index)")


def record_count(name: str, spec: Field, info: FileInfo, decompressed: int, *, source: str = "") -> int:
    """The records a compressed file of `decompressed` bytes holds under the field's layout
    (header, records, footer); `source` says where that size came from, in the error."""
    body = decompressed - spec.header_bytes - spec.footer_bytes
    if body < 0 or body % spec.record_bytes:
        raise CorruptDataError(
            f"field {name!r}: {info.path!r} decompresses to {decompressed} bytes{source}, "
            f"which is not header_bytes={spec.header_bytes} + footer_bytes={spec.footer_bytes} + a whole number "
            f"of {spec.record_bytes}-byte records",
            field=name, path=info.path,
        )  # fmt: skip
    return body // spec.record_bytes


def ensure_writable(home: str, data_dir: str) -> None:
    """Before any work: `home` can hold the index of `data_dir` (made if missing), or a
    WriteError naming it that says where else the index can go."""
    try:
        os.makedirs(home, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".stoker-index.", suffix=".probe", dir=home)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = "the data directory" if os.path.abspath(home) == os.path.abspath(data_dir) else "index directory"
        raise WriteError(
            f"cannot write the index of {data_dir!r}: {where} {home!r} is not writable ({e.strerror or e}); "
            f"keep the index elsewhere with `stoker index --index-dir DIR`, Dataset(..., index_dir=DIR) or "
            f"{ENV_INDEX_DIR}=DIR",
            path=home,
        ) from e


def _write_atomic(path: str, doc: Mapping[str, Any]) -> None:
    data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    seekpoints.write_atomic(path, data, prefix=".stoker-index.")


def _remove_old_windows(home: str, files: Mapping[str, Any], bases: Iterable[str]) -> None:
    """Remove the windows files of `bases` in `home` that no entry of the new index names and
    no reader uses (see stoker.io.indexlock): older builds, version-2 sidecars, and unfinished
    writes of an interrupted run."""
    keep = {e.get("windows") for e in files.values() if isinstance(e, dict)}
    stems = {seekpoints.windows_stem(b) for b in bases}
    with indexlock.removing(home) as in_use:
        if in_use is None:
            return  # a reader in another process may be reading through any of them: a later write removes them
        try:
            names = os.listdir(home)
        except OSError:
            return
        for name in names:
            m = _WINDOWS_FILE.fullmatch(name)
            if m and m.group(1) in stems and name not in keep and name not in in_use:
                with contextlib.suppress(OSError):  # gone already, or not ours to remove: harmless
                    os.unlink(os.path.join(home, name))


def _save(catalog: Catalog, entries: Mapping[tuple[int, str], IndexEntry], index_dir: str | None) -> list[str]:
    """Merge `entries` into the index file of each directory they live in; returns the paths."""
    by_file: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {}
    for (g, name), entry in entries.items():
        info = catalog.files[g][name]
        records = records_of(name, catalog.fields[name], info, entry)
        data_dir, base = os.path.split(os.path.abspath(info.path))
        by_file.setdefault(index_path(info.path, index_dir), (data_dir, {}))[1][base] = entry.to_json(records)
    written = []
    for path, (data_dir, new) in sorted(by_file.items()):
        try:
            old = _load(path) or {}
        except StaleIndexError:
            old = {}  # an older or unreadable index is replaced whole
        files = {**old, **new}
        doc: dict[str, Any] = {"format": _FORMAT, "version": INDEX_VERSION, "files": files}
        if index_dir is not None:  # for whoever looks into the index directory
            doc["data_dir"] = data_dir
        _write_atomic(path, doc)  # the switch: from here on the new windows files are the ones named
        _remove_old_windows(os.path.dirname(path), files, new)
        written.append(path)
    return written


class Indexable(Protocol):
    """What write_index reads of a Dataset: its catalog (io sits below the Dataset and never imports it)."""

    @property
    def catalog(self) -> Catalog: ...


def write_index(
    dataset: Indexable,
    *,
    spacing: int = seekpoints.SPACING,
    index_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    wait: float = indexlock.WRITE_WAIT,
) -> list[Path | str]:
    """Index every local file of `dataset` (decompressing each compressed file once); returns the files written.

    A Dataset whose fields are all URLs gets a manifest instead, in `index_dir` (a directory or
    a URL; required): one object that a Dataset built with the same `index_dir` is built from
    alone (see stoker.io.manifest); its path or URL is returned.

    Existing entries of other files in the same index file are kept. `spacing`: decompressed
    bytes between seek points inside a member or zlib stream. `index_dir`: where the index
    goes (default: the Dataset's `index_dir`, else `$STOKER_INDEX_DIR`, else beside the data).
    Every index directory is checked writable before any file is decompressed (a WriteError
    naming it otherwise). `progress(path)` is called after each file is scanned.

    One writer per index directory at a time: this waits up to `wait` seconds for another
    writer of the same directory (process or thread), then raises a WriteError naming the
    directory and the writer holding it. Datasets reading through the index meanwhile keep
    the seek points they opened (see stoker.io.indexlock).

    Example:
        >>> ds = stoker.Dataset(image=..., label=..., index="ignore")  # doctest: +SKIP
        >>> stoker.write_index(ds)  # doctest: +SKIP
        [PosixPath('data/.stoker-index.json')]
    """
    if isinstance(spacing, bool) or not isinstance(spacing, int) or spacing <= 0:
        raise SpecError(f"{spacing=} must be a positive number of bytes")
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < float("inf"):
        raise SpecError(f"{wait=} must be a non-negative, finite number of seconds")
    catalog = dataset.catalog.root()
    where = resolve_index_dir(index_dir) if index_dir is not None else catalog.index_dir
    if catalog.fields and all(is_remote(i.path) for infos in catalog.files for i in infos.values()):
        from .manifest import write_manifest  # it builds on this module's entries

        if where is None:
            raise SpecError("a Dataset of URLs is indexed into a manifest: pass index_dir=DIR (a directory or URL)")
        return [write_manifest(catalog, where, spacing=spacing, progress=progress)]
    local = [(g, n, info) for g, infos in enumerate(catalog.files) for n, info in infos.items()
             if not is_remote(info.path)]  # fmt: skip
    homes: dict[str, str] = {}
    for _, _, info in local:
        data_dir = os.path.dirname(os.path.abspath(info.path))
        homes.setdefault(data_dir, index_home(data_dir, where))
    for data_dir, home in sorted(homes.items()):
        ensure_writable(home, data_dir)
    entries = {}
    with indexlock.writing(homes.values(), wait=wait):
        for g, n, info in local:
            entries[(g, n)] = scan(n, info, homes[os.path.dirname(os.path.abspath(info.path))], spacing=spacing)
            if progress is not None:
                progress(info.path)
        written: list[Path | str] = [Path(p) for p in _save(catalog, entries, where)]
        return written


class IndexLookup:
    """The index files of one Dataset being opened, loaded once per directory."""

    def __init__(self, mode: str, index_dir: str | None = None) -> None:
        if mode not in _MODES:
            raise SpecError(f"index={mode!r} must be one of {list(_MODES)}")
        self.mode = mode
        self.index_dir = index_dir
        self._directories: dict[str, tuple[str, dict[str, Any] | None]] = {}
        # By index directory: taken before its index is read, so no writer removes what it names.
        self.pins: dict[str, Pin] = {}
        # Entries matches() found to vouch for a file, by path: apply_index takes them as they are.
        self.vouched: dict[str, dict[str, Any]] = {}

    def directory(self, directory: str) -> tuple[str, dict[str, Any] | None]:
        """(index file path, its entries by basename or None) for a directory of data files."""
        known = self._directories.get(directory)
        if known is None:
            home = index_home(directory, self.index_dir)
            path = os.path.join(home, INDEX_NAME)
            if self.mode != "ignore" and home not in self.pins:
                self.pins[home] = indexlock.pin(home)
            try:
                files = _load(path) if self.mode != "ignore" else None
            except StaleIndexError:
                if self.mode != "rebuild":
                    raise
                files = {}  # older or unreadable: every entry is rebuilt
            known = self._directories[directory] = (path, files)
        return known

    def matches(self, path: str, st: os.stat_result, compression: str) -> bool:
        """True when an entry vouches for this file as it is now (its header need not be read)."""
        if self.mode == "ignore":
            return False
        directory, base = os.path.split(path)
        files = self.directory(directory)[1]
        doc = files.get(base) if files else None
        if isinstance(doc, dict) and (doc.get("size"), doc.get("mtime_ns"), doc.get("compression")) == (
            st.st_size, st.st_mtime_ns, compression,
        ):  # fmt: skip
            self.vouched[path] = doc
            return True
        return False


# What an index says of a file: `(group, field) -> (records, seek points)`.
Indexed = dict[tuple[int, str], tuple[int, tuple[SeekPoint, ...]]]


def apply_index(catalog: Catalog, lookup: IndexLookup) -> tuple[Indexed, list[Pin]]:
    """The counts and seek points of matching index entries (see module doc), for the catalog
    to record (`Catalog.set_indexed`), and the Pins that keep the windows files they name on
    disk while the catalog holds them.

    Runs once per file of a Dataset being opened, so it stays on plain dicts: one index
    file per directory, entries checked field by field.
    """
    mode = lookup.mode
    indexed: Indexed = {}
    if mode == "ignore":
        return indexed, []
    todo: list[tuple[int, str, FileInfo, str]] = []  # rebuild: files to scan, with their index file
    vouched = lookup.vouched
    for g, infos in enumerate(catalog.files):
        for name, info in infos.items():
            if info.compression is None:
                continue  # raw counts come from the size: nothing to gain, nothing to trust
            doc = vouched.get(info.path)  # matched size, mtime and compression when the file was stat'ed
            directory, base = os.path.split(info.path)
            if doc is None or doc.get("compression") != info.compression:
                if is_remote(info.path):
                    continue  # no index of remote objects (nothing is written to a bucket)
                path, files = lookup.directory(directory)
                doc = files.get(base) if files is not None else None
                if not isinstance(doc, dict):
                    if mode != "rebuild":
                        continue  # a file no index covers: counted as without an index
                    doc = None
                elif (doc.get("size"), doc.get("mtime_ns"), doc.get("compression")) != (
                    info.size, info.mtime_ns, info.compression,
                ):  # fmt: skip
                    if mode != "rebuild":
                        raise StaleIndexError(
                            f"field {name!r}: index {path!r} is stale for {info.path!r} (indexed at size "
                            f"{_REPR.repr(doc.get('size'))}, mtime_ns {_REPR.repr(doc.get('mtime_ns'))}, compression "
                            f"{_REPR.repr(doc.get('compression'))}; now size {info.size}, mtime_ns {info.mtime_ns}, "
                            f"compression {info.compression}); rebuild it with `stoker index` or "
                            "Dataset(..., index='rebuild')",
                            field=name, path=info.path,
                        )  # fmt: skip
                    doc = None
            path = lookup.directory(directory)[0]
            parsed = None
            if doc is not None:
                try:
                    parsed = parse_entry(path, info, doc, name)
                except StaleIndexError:
                    if mode != "rebuild":
                        raise
            if parsed is None:  # rebuild: missing, stale or malformed
                todo.append((g, name, info, path))
            else:
                indexed[(g, name)] = _whole_records(catalog, g, name, info, parsed)
    if not todo:
        return indexed, _pins_in_use(indexed, lookup)
    homes = {os.path.dirname(path): os.path.dirname(os.path.abspath(info.path)) for _, _, info, path in todo}
    for home, data_dir in sorted(homes.items()):  # every directory written, checked before any file is scanned
        ensure_writable(home, data_dir)
    with indexlock.writing(homes):
        _pins_in_use(indexed, lookup)  # before the save: the windows this rebuild replaces are not kept for it
        rebuilt = {}
        for g, name, info, path in todo:
            entry = rebuilt[(g, name)] = scan(name, info, os.path.dirname(path))
            parsed = parse_entry(path, info, entry.to_json(0), name)
            indexed[(g, name)] = _whole_records(catalog, g, name, info, parsed)
        _save(catalog, rebuilt, lookup.index_dir)
        for home in homes:  # an index written just now: its readers file exists from here on
            if not lookup.pins[home].held:
                lookup.pins[home] = indexlock.pin(home)
        return indexed, _pins_in_use(indexed, lookup)


def _pins_in_use(indexed: Indexed, lookup: IndexLookup) -> list[Pin]:
    """The lookup's Pins, each naming the windows files the seek points found use in its
    directory; those naming none are let go (a Dataset of raw files pins nothing)."""
    used: dict[str, set[str]] = {}
    for _, points in indexed.values():
        for point in points:
            if point.window is not None:
                home, name = os.path.split(point.window.path)
                used.setdefault(home, set()).add(name)
    for home, p in lookup.pins.items():
        p.names = frozenset(used.get(home, ()))
    return [p for p in lookup.pins.values() if p.names and p.held]


def _whole_records(
    catalog: Catalog, g: int, name: str, info: FileInfo, parsed: tuple[int, tuple[SeekPoint, ...]]
) -> tuple[int, tuple[SeekPoint, ...]]:
    """The records and seek points of an entry's `(bytes, seek points)`, checked to be whole records."""
    total, points = parsed
    spec = catalog.fields[name]
    records, rest = divmod(total - spec.header_bytes - spec.footer_bytes, spec.record_bytes)
    if rest or records < 0:
        _not_whole_records(name, spec, info, total, points[0])
    return records, points


def _not_whole_records(name: str, spec: Field, info: FileInfo, total: int, start: SeekPoint) -> None:
    """Raise for an entry whose size is not whole records: the index's fault if its check of the
    file's start fails (it binds the size), else the data's (a CorruptDataError naming the file)."""
    with Inflater(info.path, info.compression or "gzip", field=name, start=start) as inf:
        inf.skip(1)  # verifies the start's check first: a StaleIndexError naming the index if it lies
    record_count(name, spec, info, total, source=" (per its index)")


def count_disagrees(
    index_file: str | None, info: FileInfo, name: str, group: int, records: int, found: str, *, record: int, offset: int
) -> StaleIndexError | None:
    """The error for a stream that holds other than the `records` an index gave its group,
    confirmed at the stream's end as a gzip trailer's count would be: the index's fault when
    the file is still as it was indexed (`found` says what the stream holds), else None
    (the data changed: the caller's CorruptDataError stands)."""
    if index_file is None:
        return None
    try:
        st = os.stat(info.path)
    except OSError:
        return None
    if (st.st_size, st.st_mtime_ns) != (info.size, info.mtime_ns):
        return None
    return StaleIndexError(
        f"field {name!r}: {info.path!r} {found}, but its index {index_file!r} gives group {group} {records} records; "
        "rebuild the index with `stoker index` or Dataset(..., index='rebuild')",
        field=name, path=index_file, index=record, offset=offset,
    )  # fmt: skip
