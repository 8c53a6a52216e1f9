"""Which files, paired how: globs expanded, groups aligned, record counts settled.

A group is the i-th file of every field. Raw counts come from file sizes when the
Dataset is built; compressed counts come from the gzip trailer of a file proved to be a
single member (a scan for a second member's header, without inflating) when the trailer
agrees with a raw field, or, in a group with no raw field, when every compressed field is
such a file and their trailers agree on a count above zero (confirmed at the end of the
stream while reading), and from decompressing the file when the group first opens
otherwise. So opening many groups costs no decompression up front.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import stat
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptDataError, PairingError, ReadError, SpecError, StokerError
from ..machine import open_regular
from ..spec import Field, shape_hint
from .index import IndexLookup, apply_index, record_count, resolve_index_dir
from .indexlock import Pin
from .inflate import GZIP_MAGIC, decompressed_size, gzip_trailer_size
from .manifest import load_manifest
from .remote import Probe, Version, is_remote
from .seekpoints import SeekPoint
from .unchanged import Seen

__all__ = ["Catalog", "FileInfo", "Group", "Inspected", "expand_files"]

_DIGITS = re.compile(r"\d+")
_SUFFIXES = {".gz": "gzip", ".gzip": "gzip", ".zz": "zlib", ".zlib": "zlib"}


@dataclass(frozen=True)
class FileInfo:
    """One file of one field, as seen when the Dataset was built."""

    path: str
    size: int
    mtime_ns: int
    compression: str | None
    # Raw: exact record count. Compressed: the trailer's estimate or None until counted.
    records_hint: int | None
    # A remote object's ETag, version id, size and mtime, which every read of it is held to.
    version: Version | None = None
    # A local file's device and inode (None: a URL), so that a file replaced since is told apart.
    dev: int | None = None
    ino: int | None = None

    @property
    def seen(self) -> Seen | None:
        """(device, inode, size, mtime) of a local file as the Dataset saw it; None for a URL."""
        if self.dev is None or self.ino is None:
            return None
        return (self.dev, self.ino, self.size, self.mtime_ns)


# Bytes read per pread by the single-member scan: large enough that call overhead vanishes.
_SCAN_CHUNK = 8 << 20
_MAGIC16 = int.from_bytes(GZIP_MAGIC, "little")  # ID1 ID2 read as one little-endian uint16


def _member_headers(buf: np.ndarray, skip_first: bool) -> tuple[bool, bool]:
    """(a member header in `buf`, a `1f 8b` too near its end to judge) for a chunk.

    A header is what gzip(1) writes: `1f 8b 08`, FLG's reserved bits 5-7 clear (zlib
    refuses a member with them set), XFL 0, 2 or 4, OS 0-13 or 255 (RFC 1952's values).
    Vectorized: the magic is looked for as uint16 at even and at odd offsets.
    """
    n = len(buf)
    even = np.flatnonzero(buf[: n - n % 2].view("<u2") == _MAGIC16) * 2
    odd = np.flatnonzero(buf[1 : n - (n - 1) % 2].view("<u2") == _MAGIC16) * 2 + 1 if n > 1 else even[:0]
    at = np.concatenate([even, odd])
    if skip_first:
        at = at[at > 0]
    whole = at[at + 10 <= n]
    cm, flg, xfl, os_ = (buf[whole + k] for k in (2, 3, 8, 9))
    valid = (cm == 8) & (flg & 0xE0 == 0) & ((xfl == 0) | (xfl == 2) | (xfl == 4)) & ((os_ <= 13) | (os_ == 255))
    return bool(valid.any()), len(whole) < len(at)


def one_gzip_member(path: str, size: int) -> bool:
    """True when the local gzip file `path` of `size` bytes provably holds one member.

    Any second member starts with a member header somewhere after byte 0; the scan looks
    for one at memory speed, without inflating. Compressed data matches such a header by
    chance about once per 200 GiB, and a false match only means the file is counted by
    decompressing it. Remote or unreadable files, and files that change size, are not proved.
    """
    if is_remote(path) or size < 18:  # 18: the smallest member (header, empty block, trailer)
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        # Chunks overlap by 9 bytes, so a header cut by a chunk boundary is seen whole.
        offset, step = 0, max(_SCAN_CHUNK, 10)
        while offset < size:
            chunk = os.pread(fd, step + 9, offset)
            found, cut = _member_headers(np.frombuffer(chunk, np.uint8), skip_first=offset == 0)
            if found:
                return False
            if len(chunk) < step + 9:  # the end of the file
                return not cut and offset + len(chunk) == size  # a magic in the last 9 bytes: unproved
            offset += step
        return False  # the file grew
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Group:
    """The aligned files of one group: `paths[field]` and the shared record count."""

    index: int
    paths: Mapping[str, str]
    records: int


def _has_magic(pattern: str) -> bool:
    return glob.has_magic(pattern)


def expand_files(name: str, spec: Field) -> list[str]:
    """The field's files in pairing order: each glob's matches sorted, explicit paths as given.

    A name with glob characters (`*`, `?`, `[`) is a glob, unless a file of exactly that
    name exists: `img_[0].bin` is that file when it exists, never `img_0.bin`. The same path
    twice (listed twice, or matched by two globs) is a SpecError: its records would be read twice.
    """
    patterns = [spec.files] if isinstance(spec.files, str) else list(spec.files)
    out: list[str] = []
    for pattern in patterns:
        if is_remote(pattern):
            from .remote import expand

            out.extend(expand(name, pattern, spec.storage_options))
        elif _has_magic(pattern) and not os.path.lexists(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise SpecError(
                    f"field {name!r}: glob {pattern!r} matched no file{_escape_hint(pattern)}", field=name, path=pattern
                )
            out.extend(matches)
        else:
            out.append(pattern)
    _check_once(name, out)
    return out


def _escape_hint(pattern: str) -> str:
    """Where a pattern's directory exists under a name holding glob characters, how to glob in it."""
    head = os.path.dirname(pattern)
    while head and not os.path.isdir(head):
        head = os.path.dirname(head)
    if not head or not _has_magic(head):
        return ""
    return (
        f"; the directory {head!r} exists, but its name is read as glob syntax: to glob in it, "
        f"write glob.escape({head!r}) + {pattern[len(head) :]!r}"
    )


def _check_once(name: str, paths: list[str]) -> None:
    seen: dict[str, int] = {}
    for i, path in enumerate(paths):
        key = path if is_remote(path) else os.path.normpath(os.path.abspath(path))
        first = seen.setdefault(key, i)
        if first != i:
            raise SpecError(
                f"field {name!r}: {path!r} is file {first} and file {i} of the field (after globbing); "
                "a file may appear once: its records would be read twice",
                field=name, path=path,
            )  # fmt: skip


def _stat(name: str, path: str) -> os.stat_result:
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise SpecError(f"field {name!r}: file {path!r} does not exist", field=name, path=path) from e
    except OSError as e:  # ELOOP for symlink loops, EACCES on a parent directory, ...
        raise ReadError(f"field {name!r}: cannot stat {path!r}: {e.strerror}", field=name, path=path) from e
    if stat.S_ISDIR(st.st_mode):
        raise SpecError(f"field {name!r}: {path!r} is a directory, not a record file", field=name, path=path)
    if not stat.S_ISREG(st.st_mode):
        raise SpecError(f"field {name!r}: {path!r} is not a regular file", field=name, path=path)
    return st


def open_local(name: str, path: str) -> int:
    """A read-only descriptor of local file `path` of field `name`; a ReadError naming both,
    also for a path that is no longer a regular file (a FIFO put there would block the open)."""
    try:
        return open_regular(path)
    except OSError as e:
        raise ReadError(f"field {name!r}: cannot open {path!r}: {e.strerror}", field=name, path=path) from e


def _suffix(path: str) -> str:
    """`os.path.splitext(path)[1]`, without its per-call overhead (10,000s of files)."""
    dot = path.rfind(".")
    start = max(path.rfind(os.sep), path.rfind(os.altsep) if os.altsep else -1) + 1
    return path[dot:] if dot > start and path[start:dot].strip(".") else ""


def _by_suffix(path: str) -> str | None:
    return _SUFFIXES.get(_suffix(path).lower())


def _check_zlib_header(head: bytes) -> bool:
    return len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] * 256 + head[1]) % 31 == 0


# Bytes inflated to tell a gzip file with no compression suffix from raw records that start
# with gzip's magic: random bytes fail a deflate decoder within a few bytes.
_SNIFF_BYTES = 64 << 10


def _inflates_as_gzip(fd: int, size: int) -> bool:
    """Whether the file's first `_SNIFF_BYTES` inflate as gzip without error (a whole file that
    small must also reach its member's end)."""
    data = os.pread(fd, min(size, _SNIFF_BYTES), 0)
    d = zlib.decompressobj(31)
    try:
        d.decompress(data, 1 << 20)
    except zlib.error:
        return False
    return d.eof or size > _SNIFF_BYTES


def _raw_fits(spec: Field, size: int) -> bool:
    body = size - spec.header_bytes - spec.footer_bytes
    return body >= 0 and body % spec.record_bytes == 0


def _inspect(
    name: str, spec: Field, path: str, index: IndexLookup | None = None, probe: Probe | None = None
) -> FileInfo:
    if probe is not None:  # a remote file, stat'ed and its head/tail fetched in bulk by stoker.io.remote
        trailer = int.from_bytes(probe.tail, "little") if len(probe.tail) == 4 else None
        info = _classify(name, spec, path, probe.size, probe.mtime_ns, probe.head, lambda: trailer)
        return dataclasses.replace(info, version=probe.version)
    st = _stat(name, path)
    if index is not None:
        # A matching persistent index entry vouches for the file (checked when indexed):
        # no open, no header or trailer read; opening 10,000 groups costs one stat per file.
        vouched = _by_suffix(path) if spec.compression == "auto" else spec.compression
        if vouched is not None and index.matches(path, st, vouched):
            return FileInfo(path, st.st_size, st.st_mtime_ns, vouched, None, dev=st.st_dev, ino=st.st_ino)
    fd = open_local(name, path)
    try:
        head = os.pread(fd, 3, 0) if st.st_size else b""
        info = _classify(
            name, spec, path, st.st_size, st.st_mtime_ns, head, lambda: gzip_trailer_size(fd, st.st_size),
            lambda: _inflates_as_gzip(fd, st.st_size),
        )  # fmt: skip
        return dataclasses.replace(info, dev=st.st_dev, ino=st.st_ino)
    except OSError as e:
        if isinstance(e, StokerError):
            raise
        raise ReadError(f"field {name!r}: cannot read {path!r}: {e.strerror}", field=name, path=path) from e
    finally:
        os.close(fd)


def _classify(
    name: str,
    spec: Field,
    path: str,
    size: int,
    mtime_ns: int,
    head: bytes,
    trailer: Callable[[], int | None],
    inflates: Callable[[], bool] | None = None,
) -> FileInfo:
    """Compression, and the record count or its estimate, from a file's size and first/last bytes.

    `compression="auto"`: the suffix decides (`.gz`/`.gzip` gzip, `.zz`/`.zlib` zlib). With no
    such suffix the file is raw, unless it starts with gzip's magic (`1f 8b 08`): then it is
    gzip where raw records cannot fill it, or where its first bytes inflate as gzip
    (`inflates`, None for a URL); otherwise it could be either, and a SpecError asks for
    `compression=`. Each error of detection names the file and the `compression=` that fixes it.
    """
    kind: str | None
    why = f"compression={spec.compression!r}"
    if spec.compression == "auto":
        kind = _by_suffix(path)
        why = f"compression='auto' and its suffix {_suffix(path)!r}"
        if kind is None and head[:3] == GZIP_MAGIC + b"\x08":
            if not _raw_fits(spec, size) or (inflates is not None and inflates()):
                kind = "gzip"
            else:
                raise SpecError(
                    f"field {name!r}: {path!r} has no compression suffix and starts with gzip's magic bytes "
                    "1f 8b 08, but does not inflate as gzip and its size fits whole raw records; pass "
                    "compression=None if it holds raw records (or compression='gzip' if it is a gzip file, "
                    "to have its stream checked)",
                    field=name, path=path,
                )  # fmt: skip
    else:
        kind = spec.compression
    if kind == "gzip" and size and head[:2] != GZIP_MAGIC:
        raise CorruptDataError(
            f"field {name!r}: {path!r} should be gzip ({why}) but does not start with the gzip magic bytes "
            f"1f 8b (found {head[:2].hex(' ')}); pass compression=None if it holds raw records",
            field=name, path=path, offset=0,
        )  # fmt: skip
    if kind == "zlib" and size and not _check_zlib_header(head):
        raise CorruptDataError(
            f"field {name!r}: {path!r} should be zlib ({why}) but has no valid zlib header "
            f"(found {head[:2].hex(' ')}); pass compression=None if it holds raw records",
            field=name, path=path, offset=0,
        )  # fmt: skip
    hint: int | None = None
    if kind is None:
        body = size - spec.header_bytes - spec.footer_bytes
        if body < 0:
            raise CorruptDataError(
                f"field {name!r}: {path!r} has {size} bytes, fewer than "
                f"header_bytes={spec.header_bytes} + footer_bytes={spec.footer_bytes}",
                field=name, path=path,
            )  # fmt: skip
        if body % spec.record_bytes:
            raise CorruptDataError(
                f"field {name!r}: {path!r} body is {body} bytes (file {size} - header "
                f"{spec.header_bytes} - footer {spec.footer_bytes}), not a whole number of "
                f"{spec.record_bytes}-byte records; the last {body % spec.record_bytes} bytes "
                f"start at offset {spec.header_bytes + body - body % spec.record_bytes}"
                + ("; if it is compressed, pass compression='gzip' or 'zlib'" if spec.compression == "auto" else ""),
                field=name, path=path, index=body // spec.record_bytes,
                offset=spec.header_bytes + body - body % spec.record_bytes,
            )  # fmt: skip
        hint = body // spec.record_bytes
    elif kind == "gzip":
        isize = trailer()
        if isize is not None:
            body = isize - spec.header_bytes - spec.footer_bytes
            if body >= 0 and body % spec.record_bytes == 0:
                hint = body // spec.record_bytes
    elif size == 0:
        raise CorruptDataError(
            f"field {name!r}: {path!r} is empty, not a zlib stream ({why}); pass compression=None to read "
            "it as a raw file of no records",
            field=name, path=path,
        )  # fmt: skip
    if kind == "gzip" and size == 0:
        raise CorruptDataError(
            f"field {name!r}: {path!r} is empty, not a gzip stream ({why}); pass compression=None to read "
            "it as a raw file of no records",
            field=name, path=path,
        )  # fmt: skip
    return FileInfo(path, size, mtime_ns, kind, hint)


def _probe_remote(name: str, spec: Field, paths: Sequence[str]) -> dict[str, Probe]:
    """Sizes and head/tail bytes of the field's remote files, fetched concurrently (none: {})."""
    urls = [p for p in paths if is_remote(p)]
    if not urls:
        return {}
    from .remote import probe

    return probe(name, urls, spec.storage_options)


def _stem(base: str) -> str:
    """`os.path.splitext(base)[0]` of a basename, without its per-call overhead (10,000s of files)."""
    dot = base.rfind(".")
    return base[:dot] if dot > 0 and base[:dot].strip(".") else base


def _numbers(path: str) -> tuple[int, ...]:
    base = os.path.basename(path)
    while (stem := _stem(base)) != base and not stem.isdigit():
        base = stem
    return tuple(map(int, _DIGITS.findall(base)))


def _keys(paths: Sequence[str], pair_key: str | None, name: str) -> list[tuple[object, ...] | None]:
    if pair_key is None:
        return [_numbers(p) or None for p in paths]
    rx = re.compile(pair_key)
    keys: list[tuple[object, ...] | None] = []
    for p in paths:
        m = rx.search(os.path.basename(p))
        if m is None:
            raise PairingError(
                f"field {name!r}: pair_key {pair_key!r} does not match the basename of {p!r}", field=name, path=p
            )
        keys.append((m.group(1) if rx.groups else m.group(0),))
    return keys


def _keys_agree(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    n = min(len(a), len(b))
    return a[len(a) - n :] == b[len(b) - n :]


def _fspath(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else os.fspath(path)


@dataclass(frozen=True)
class Inspected:
    """Groups another catalog inspected already: their files, record counts (None: not settled
    yet), seek points (keyed by the new group numbers) and the index pins that hold them."""

    files: list[dict[str, FileInfo]]
    counts: list[int | None]
    seek_points: dict[tuple[int, str], tuple[SeekPoint, ...]]
    index_pins: list[Pin]


class Catalog:
    """All groups of a Dataset; record counts settled lazily and thread-safely.

    `inspected`: groups another catalog inspected (`part`, `stoker.io.views.CatalogView`): taken
    as they are, nothing globbed, stat'ed or counted again.
    """

    def __init__(
        self,
        fields: Mapping[str, Field],
        *,
        pair_key: str | None = None,
        index: str = "auto",
        index_dir: str | os.PathLike[str] | None = None,
        inspected: Inspected | None = None,
    ) -> None:
        self.fields = dict(fields)
        # Where the persistent index lives (None: beside the data); see stoker.io.index. Inspected
        # groups keep their catalog's, resolved already ($STOKER_INDEX_DIR as it was then).
        self.index_dir = resolve_index_dir(index_dir) if inspected is None else _fspath(index_dir)
        self._lock = threading.Lock()
        self._exact: dict[tuple[int, str], int] = {}
        if inspected is not None:
            self.num_groups = len(inspected.files)
            self.files: list[dict[str, FileInfo]] = inspected.files
            self._counts: list[int | None] = list(inspected.counts)
            self.seek_points: dict[tuple[int, str], tuple[SeekPoint, ...]] = inspected.seek_points
            self.index_pins = inspected.index_pins
            return
        lookup = IndexLookup(index, self.index_dir)
        # Fields that are all URLs, with a manifest in index_dir: built from it alone (no listing, no probe).
        manifest = load_manifest(self.index_dir, self.fields, index)
        paths = manifest.paths() if manifest else {name: expand_files(name, spec) for name, spec in self.fields.items()}
        lengths = {name: len(p) for name, p in paths.items()}
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"{n!r}: {c} files (first {paths[n][0]!r})" for n, c in lengths.items())
            longest = max(lengths, key=lengths.__getitem__)
            lone = paths[longest][min(lengths.values())]  # the first file left without a partner
            raise PairingError(
                f"fields have different numbers of files: {detail}; {lone!r} of field {longest!r} has no partner",
                field=longest, path=lone,
            )  # fmt: skip
        self.num_groups = next(iter(lengths.values()))
        names = list(self.fields)
        # A manifest's groups were paired when it was written (10,000s of basenames not parsed again).
        keys = {name: _keys(paths[name], pair_key, name) for name in names} if not manifest else {}
        for g in range(self.num_groups if keys else 0):
            first = names[0]
            for other in names[1:]:
                a, b = keys[first][g], keys[other][g]
                if a is not None and b is not None and not _keys_agree(a, b):
                    raise PairingError(
                        f"group {g}: {paths[first][g]!r} (field {first!r}, key {a}) and {paths[other][g]!r} "
                        f"(field {other!r}, key {b}) carry different numbers; files must pair by position "
                        "(pass pair_key=REGEX to choose what must agree, or pair_key='' to disable)",
                        field=other, path=paths[other][g],
                    )  # fmt: skip
        probes = {name: _probe_remote(name, self.fields[name], paths[name]) for name in names} if not manifest else {}
        self.files = manifest.files(self.fields) if manifest else [
            {n: _inspect(n, self.fields[n], paths[n][g], lookup, probes[n].get(paths[n][g])) for n in names}
            for g in range(self.num_groups)
        ]  # fmt: skip
        self._counts = [None] * self.num_groups
        # From a persistent index that matches the file (see stoker.io.index): exact counts of
        # compressed files (`_exact`) and their seek points (compressed, decompressed offsets).
        self.seek_points = {}
        # Held while the catalog lives: no re-index removes the windows files its seek points name.
        indexed, self.index_pins = apply_index(self, lookup)
        for (g, n), (records, points) in indexed.items():
            self.set_indexed(g, n, records, points)
        if manifest:
            manifest.apply(self)
        for g, infos in enumerate(self.files):
            raw = {
                n: i.records_hint if i.compression is None else self._exact[(g, n)]
                for n, i in infos.items()
                if i.compression is None or (g, n) in self._exact
            }
            if len(set(raw.values())) > 1:
                raise self._mismatch(g, raw)
            if len(raw) == len(infos):
                self._counts[g] = next(iter(raw.values()))

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for process and Ray workers: the lock is per process.
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _mismatch(self, g: int, counts: Mapping[str, int | None]) -> PairingError:
        infos = self.files[g]
        detail = "; ".join(f"field {n!r}: {c} records in {infos[n].path!r}" for n, c in counts.items())
        first = next(iter(counts))
        hint = shape_hint(self.fields, counts)
        return PairingError(
            f"group {g} has different record counts per field: {detail}; no record of this group is yielded"
            + (f"; hint: {hint}" if hint else ""),
            field=first, path=infos[first].path,
        )  # fmt: skip

    def count(self, g: int) -> int:
        """Records of group `g`, settled when first asked (may decompress its files)."""
        n = self._counts[g]
        if n is not None:
            return n
        with self._lock:
            n = self._counts[g]
            if n is None:
                n = self._settle(g)
                self._counts[g] = n
        return n

    def counts(self) -> list[int]:
        return [self.count(g) for g in range(self.num_groups)]

    def settled(self) -> bool:
        """Whether every group's count is known, so that counting them reads no file."""
        return None not in self._counts

    def root(self) -> Catalog:
        """The catalog of the whole dataset (a subset's view answers with its parent's)."""
        return self

    def to_root(self, groups: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(group, record) of this catalog as (group, record in the file) of `root()`: the same here."""
        return groups, records

    def part(self, groups: Sequence[int]) -> Catalog:
        """A catalog of `groups` alone (non-empty), numbered 0.. in the order given: their
        files, settled counts and seek points, each field naming only their files.

        What a reader of those groups in another process needs and no more, so what it costs
        to ship does not grow with the other groups (stoker.ray sends one to each read task).
        """
        fields = {
            n: dataclasses.replace(spec, files=[self.files[g][n].path for g in groups])
            for n, spec in self.fields.items()
        }
        inspected = Inspected(
            files=[self.files[g] for g in groups],
            counts=[self.count(g) for g in groups],  # every count settled: the part reads no index
            seek_points={
                (i, n): self.seek_points[(g, n)] for i, g in enumerate(groups) for n in self.fields
                if (g, n) in self.seek_points
            },
            index_pins=self.index_pins,
        )  # fmt: skip
        return Catalog(fields, index_dir=self.index_dir, inspected=inspected)

    def set_indexed(self, g: int, name: str, records: int, seek_points: tuple[SeekPoint, ...]) -> None:
        """Record what a matching persistent index says of field `name` of group `g`."""
        self._exact[(g, name)] = records
        self.seek_points[(g, name)] = seek_points

    def index_file(self, g: int, name: str) -> str | None:
        """The persistent index file that gave group `g`'s count of field `name`, if one did."""
        points = self.seek_points.get((g, name))
        return points[0].index_file if points else None

    def _settle(self, g: int) -> int:
        infos = self.files[g]
        # A gzip trailer holds only the last member's size, so it is trusted only for a file
        # proved a single member, and only where it agrees with a raw file's size or, with no
        # raw field, with the other trailers (_trailers_count proves those). A multi-member file
        # whose last member happens to hold the raw count would otherwise be read misaligned
        # up to its end.
        raw = [i.records_hint for i in infos.values() if i.compression is None]
        known = raw[0] if raw else self._trailers_count(g)
        counts: dict[str, int | None] = {}
        for name, info in infos.items():
            if (g, name) in self._exact:
                counts[name] = self._exact[(g, name)]
            elif info.compression is None or (
                info.records_hint is not None
                and info.records_hint == known
                and (not raw or one_gzip_member(info.path, info.size))
            ):
                counts[name] = info.records_hint
            else:
                counts[name] = self._count_by_decompressing(name, info)
        if len(set(counts.values())) > 1:
            raise self._mismatch(g, counts)
        result = next(iter(counts.values()))
        assert result is not None
        return result

    def _trailers_count(self, g: int) -> int | None:
        """The count of a group with no raw field that its gzip trailers prove, or None.

        Trusted only when at least two fields are gzip, every compressed field's trailer
        gives the same count, that count is above zero (the last 4 bytes of zero padding, or
        of an empty member, read as a size of 0), and every one of the files is proved a
        single member (a multi-member file's trailer holds its last member's size only).
        The streams are still confirmed at their end while reading. Otherwise None: each
        compressed file is counted by decompressing it, so it is inflated twice, to count and
        to read, which is why a proved trailer is worth trusting.
        """
        infos = [i for n, i in self.files[g].items() if (g, n) not in self._exact]
        if len(infos) < 2 or len(infos) < len(self.files[g]):  # an indexed field: counted exactly anyway
            return None
        hints = {i.records_hint for i in infos}
        if len(hints) != 1 or any(i.compression != "gzip" for i in infos):  # zlib: no trailer
            return None
        hint = hints.pop()
        if hint is None or hint <= 0:
            return None
        return hint if all(one_gzip_member(i.path, i.size) for i in infos) else None

    def _count_by_decompressing(self, name: str, info: FileInfo) -> int:
        spec = self.fields[name]
        assert info.compression is not None
        total = decompressed_size(
            info.path,
            info.compression,
            field=name,
            storage_options=spec.storage_options,
            version=info.version,
            seen=info.seen,
        )
        return record_count(name, spec, info, total)
