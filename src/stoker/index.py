"""A persistent index beside the data: record counts and seek points, no decompression to open.

``write_index(ds)`` (or ``stoker index DIR``) writes one small JSON file, ``.stoker-index.json``,
in every directory that holds the dataset's files. Per file it records the size and
``mtime_ns`` it was indexed at, the record count, and for gzip/zlib files the decompressed
size, the start of every gzip member as ``(compressed offset, decompressed offset)``, and
periodic seek points inside members and zlib streams: the first deflate block boundary
after every ``spacing`` bytes of output (1 MiB by default) as ``(byte, bit, decompressed
offset)`` plus the 32 KiB window before it, kept compressed in a sidecar file
``.stoker-windows.NAME`` (see :mod:`stoker.seekpoints`).

A Dataset built afterwards takes the record counts of compressed files from the index
when the file's size and mtime still match, so opening 10,000 compressed groups
decompresses nothing; random access (``ds[i]``, ``ds.read``), subsets and loader reads that
start inside a compressed file (shards, resume) start decoding at the last seek point before
the records they need instead of at the start of the file. Where libz cannot be loaded
through ctypes, the index holds member starts only (one seek point per gzip member).

Trust: an entry whose file changed size or mtime is stale. ``Dataset(..., index="auto")``
(the default) raises :class:`~stoker.errors.StaleIndexError` naming the file; an index file
of another format version raises naming the index file. ``index="rebuild"`` rewrites stale,
missing and old entries (decompressing only those files); ``index="ignore"`` never reads it.
A windows file that does not match its data file raises naming the windows file, when used.
Files are written atomically (temp file, fsync, ``os.replace``); windows before the index.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from . import seekpoints
from .errors import CorruptDataError, SpecError, StaleIndexError
from .inflate import Inflater
from .remote import is_remote
from .seekpoints import SeekPoint, WindowRef

if TYPE_CHECKING:
    from .dataset import Dataset
    from .files import Catalog, FileInfo
    from .spec import Field

__all__ = [
    "INDEX_NAME",
    "INDEX_VERSION",
    "IndexEntry",
    "IndexLookup",
    "IndexMode",
    "apply_index",
    "index_path",
    "write_index",
]

INDEX_NAME = ".stoker-index.json"  # a dot file, so globs like "data/*" never match it
# 2: seek points inside members ("points", "windows"); version 1 files are rebuilt or refused.
INDEX_VERSION = 2
_FORMAT = "stoker-index"
IndexMode = Literal["auto", "rebuild", "ignore"]
_MODES = ("auto", "rebuild", "ignore")


@dataclass(frozen=True)
class IndexEntry:
    """What the index knows of one file."""

    size: int
    mtime_ns: int
    compression: str | None
    decompressed_bytes: int  # == size for raw files
    # (compressed offset, decompressed offset) of each gzip member start; ((0, 0),) for zlib.
    members: tuple[tuple[int, int], ...]
    # (byte, bit, decompressed offset, window offset, window length) of each block seek point;
    # the windows live in the sidecar file named ``windows`` (a basename), None when no point.
    points: tuple[tuple[int, int, int, int, int], ...] = ()
    windows: str | None = None

    def to_json(self, records: int) -> dict[str, Any]:
        return {
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "compression": self.compression,
            "records": records,
            "decompressed_bytes": self.decompressed_bytes,
            "members": [list(m) for m in self.members],
            # Only where there are points: 10,000 small files parse measurably faster without.
            **({"points": [list(p) for p in self.points], "windows": self.windows} if self.points else {}),
        }


def index_path(data_file: str) -> str:
    """The index file that covers ``data_file``: ``.stoker-index.json`` in its directory."""
    return os.path.join(os.path.dirname(os.path.abspath(data_file)), INDEX_NAME)


def _load(path: str) -> dict[str, Any] | None:
    """The index file's entries by basename; None when there is no index file."""
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StaleIndexError(
            f"index file {path!r} cannot be read ({e}); rebuild it with `stoker index`", path=path
        ) from e
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("files"), dict):
        raise StaleIndexError(f"{path!r} is not a stoker index file; remove it or rebuild it", path=path)
    if doc.get("version") != INDEX_VERSION:
        raise StaleIndexError(
            f"index file {path!r} has format version {doc.get('version')!r}, this stoker reads version "
            f"{INDEX_VERSION}; rebuild it with `stoker index` or Dataset(..., index='rebuild')",
            path=path,
        )
    return doc["files"]


def scan(name: str, info: FileInfo, *, spacing: int = seekpoints.SPACING) -> IndexEntry:
    """Index one file: decompress it once to find its size, member starts and seek points."""
    if info.compression is None:
        return IndexEntry(info.size, info.mtime_ns, None, info.size, ((0, 0),))
    points: tuple[tuple[int, int, int, int, int], ...] = ()
    windows = None
    if seekpoints.available() and not is_remote(info.path):
        found = seekpoints.scan_file(info.path, info.compression, spacing=spacing, field=name)
        total, members = found.decompressed_bytes, found.members
        if found.points:
            sidecar = seekpoints.windows_path(info.path)
            spans = seekpoints.write_windows(sidecar, info.size, info.mtime_ns, [p[3] for p in found.points])
            points = tuple((c, b, d, off, n) for (c, b, d, _), (off, n) in zip(found.points, spans, strict=True))
            windows = os.path.basename(sidecar)
    else:  # no libz (or a URL): member starts, found by the ordinary decoder
        with Inflater(info.path, info.compression, field=name) as inf:
            while inf.skip(1 << 30) == 1 << 30:
                pass
            total, members = inf.produced, tuple(inf.members)
    st = os.stat(info.path)
    if st.st_size != info.size or st.st_mtime_ns != info.mtime_ns:
        raise StaleIndexError(f"field {name!r}: {info.path!r} changed while it was being indexed", field=name,
                              path=info.path)  # fmt: skip
    return IndexEntry(info.size, info.mtime_ns, info.compression, total, members, points, windows)


_FILE_START = (SeekPoint(0, 0),)


def seek_points_of(info: FileInfo, doc: Mapping[str, Any]) -> tuple[SeekPoint, ...]:
    """The seek points an index entry gives, sorted by decompressed offset (raises on malformed)."""
    members = doc["members"]
    raw = doc.get("points")
    if len(members) == 1 and not raw:
        return _FILE_START  # the common case, once per file when opening: no objects built
    members = [(int(a), int(b)) for a, b in members]
    # One member: its start is the file's start, no member seek point worth keeping.
    found = [SeekPoint(c, d) for c, d in members] if len(members) > 1 else [SeekPoint(0, 0)]
    if raw:
        sidecar = os.path.join(os.path.dirname(os.path.abspath(info.path)), str(doc["windows"]))
        starts = [c for c, _ in members]
        for c, bit, d, off, n in raw:
            k = bisect.bisect_right(starts, int(c))
            found.append(
                SeekPoint(
                    int(c), int(d), int(bit), WindowRef(sidecar, int(off), int(n), info.size, info.mtime_ns),
                    members[k] if k < len(members) else None,
                )
            )  # fmt: skip
        found.sort(key=lambda p: p.decompressed)
    return tuple(found)


def records_of(name: str, spec: Field, info: FileInfo, entry: IndexEntry) -> int:
    """The record count an entry implies under the field's record layout."""
    body = entry.decompressed_bytes - spec.header_bytes - spec.footer_bytes
    if body < 0 or body % spec.record_bytes:
        raise CorruptDataError(
            f"field {name!r}: {info.path!r} decompresses to {entry.decompressed_bytes} bytes (per its index), "
            f"which is not header_bytes={spec.header_bytes} + footer_bytes={spec.footer_bytes} + a whole number "
            f"of {spec.record_bytes}-byte records",
            field=name, path=info.path,
        )  # fmt: skip
    return body // spec.record_bytes


def _write_atomic(path: str, doc: Mapping[str, Any]) -> None:
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".stoker-index.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"), sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        seekpoints.readable_by_all(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _save(catalog: Catalog, entries: Mapping[tuple[int, str], IndexEntry]) -> list[str]:
    """Merge ``entries`` into the index file of each directory they live in; returns the paths."""
    by_file: dict[str, dict[str, dict[str, Any]]] = {}
    for (g, name), entry in entries.items():
        info = catalog.files[g][name]
        records = records_of(name, catalog.fields[name], info, entry)
        by_file.setdefault(index_path(info.path), {})[os.path.basename(info.path)] = entry.to_json(records)
    written = []
    for path, new in sorted(by_file.items()):
        try:
            old = _load(path) or {}
        except StaleIndexError:
            old = {}  # an older or unreadable index is replaced whole
        _write_atomic(path, {"format": _FORMAT, "version": INDEX_VERSION, "files": {**old, **new}})
        written.append(path)
    return written


def write_index(
    dataset: Dataset, *, spacing: int = seekpoints.SPACING, progress: Callable[[str], None] | None = None
) -> list[Path]:
    """Index every file of ``dataset`` (decompressing each compressed file once); returns the files written.

    Existing entries of other files in the same index file are kept. ``spacing``: decompressed
    bytes between seek points inside a member or zlib stream. ``progress(path)`` is called
    after each file is scanned.

    Example:
        >>> ds = stoker.Dataset(image=..., label=..., index="ignore")  # doctest: +SKIP
        >>> stoker.write_index(ds)  # doctest: +SKIP
        [PosixPath('data/.stoker-index.json')]
    """
    if isinstance(spacing, bool) or not isinstance(spacing, int) or spacing <= 0:
        raise SpecError(f"{spacing=} must be a positive number of bytes")
    catalog = dataset._catalog.root()
    entries = {}
    for g, infos in enumerate(catalog.files):
        for n, info in infos.items():
            entries[(g, n)] = scan(n, info, spacing=spacing)
            if progress is not None:
                progress(info.path)
    return [Path(p) for p in _save(catalog, entries)]


class IndexLookup:
    """The index files of one Dataset being opened, loaded once per directory."""

    def __init__(self, mode: str) -> None:
        if mode not in _MODES:
            raise SpecError(f"index={mode!r} must be one of {list(_MODES)}")
        self.mode = mode
        self._directories: dict[str, tuple[str, dict[str, Any] | None]] = {}
        # Entries matches() found to vouch for a file, by path: apply_index takes them as they are.
        self.vouched: dict[str, dict[str, Any]] = {}

    def directory(self, directory: str) -> tuple[str, dict[str, Any] | None]:
        """(index file path, its entries by basename or None) for a directory of data files."""
        known = self._directories.get(directory)
        if known is None:
            path = os.path.join(os.path.abspath(directory), INDEX_NAME)
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


def apply_index(catalog: Catalog, lookup: IndexLookup) -> None:
    """Give ``catalog`` the counts and seek points of matching index entries (see module doc).

    Runs once per file of a Dataset being opened, so it stays on plain dicts: one index
    file per directory, entries checked field by field without building objects.
    """
    mode = lookup.mode
    if mode == "ignore":
        return
    rebuild: dict[tuple[int, str], IndexEntry] = {}
    layout = {n: (f.header_bytes + f.footer_bytes, f.record_bytes) for n, f in catalog.fields.items()}
    vouched = lookup.vouched
    for g, infos in enumerate(catalog.files):
        for name, info in infos.items():
            if info.compression is None:
                continue  # raw counts come from the size: nothing to gain, nothing to trust
            doc = vouched.get(info.path)  # matched size, mtime and compression when the file was stat'ed
            if doc is None or doc.get("compression") != info.compression:
                if is_remote(info.path):
                    continue  # no index files beside remote objects (nothing is written to a bucket)
                directory, base = os.path.split(info.path)
                path, files = lookup.directory(directory)
                doc = files.get(base) if files is not None else None
                if not isinstance(doc, dict):
                    if mode != "rebuild":
                        continue  # a file no index covers: counted as without an index
                    entry = rebuild[(g, name)] = scan(name, info)
                    doc = entry.to_json(0)
                elif (doc.get("size"), doc.get("mtime_ns"), doc.get("compression")) != (
                    info.size, info.mtime_ns, info.compression,
                ):  # fmt: skip
                    if mode != "rebuild":
                        raise StaleIndexError(
                            f"field {name!r}: index {path!r} is stale for {info.path!r} (indexed at size "
                            f"{doc.get('size')}, mtime_ns {doc.get('mtime_ns')}, compression "
                            f"{doc.get('compression')}; now size {info.size}, mtime_ns {info.mtime_ns}, compression "
                            f"{info.compression}); rebuild it with `stoker index` or Dataset(..., index='rebuild')",
                            field=name, path=info.path,
                        )  # fmt: skip
                    entry = rebuild[(g, name)] = scan(name, info)
                    doc = entry.to_json(0)
            try:
                total = int(doc["decompressed_bytes"])
                points = seek_points_of(info, doc)
            except (KeyError, TypeError, ValueError) as e:
                path = index_path(info.path)
                raise StaleIndexError(
                    f"index {path!r} has a malformed entry for {info.path!r} ({e!r}); rebuild it", path=path
                ) from e
            framing, record_bytes = layout[name]
            records, rest = divmod(total - framing, record_bytes)
            if rest or records < 0:  # raises, naming the file
                entry = IndexEntry(info.size, info.mtime_ns, info.compression, total, ((0, 0),))
                records_of(name, catalog.fields[name], info, entry)
            catalog.set_indexed(g, name, records, points)
    if rebuild:
        _save(catalog, rebuild)
