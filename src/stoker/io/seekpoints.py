"""Decompression seek points inside gzip members and zlib streams: found with libz, resumed with zlib.

A deflate stream can be entered at any block boundary given the 32 KiB of output before it
(the window back-references may reach into) and the boundary's bit position. Finding block
boundaries needs `inflate(Z_BLOCK)`, which Python's `zlib` module does not offer, so
`scan_file` drives the system's libz through `ctypes` (the library CPython's own
`zlib` module links to) and records a point at the first block boundary after every
`spacing` bytes of output: `(byte, bit, decompressed offset, window)`. The same pass checks
every member's CRC and length. Resuming from a point on a byte boundary needs nothing beyond
the standard library (or isal): `decompressobj(wbits=-15, zdict=window)` fed the file's bytes
from the point. A point inside a byte is resumed by libz too (`PrimedInflate`): its
`inflatePrime` takes the byte's remaining bits, and the file's own bytes follow, so a stored
block's padding to a byte boundary falls where the encoder put it (the point's bytes shifted
into whole bytes would make every stored block after it read its length from the wrong
bytes). See
`stoker.inflate.Inflater`.

Windows are stored zlib-compressed in a small sidecar file per data file
(`.stoker-windows.NAME.BUILD`) beside the index, and read only when a point is used, so
opening a dataset never touches them. Where libz cannot be loaded (`available` is False)
the index holds member starts only, as gzip itself would allow.

Nothing an index says is taken on trust where it decides which bytes are records. Every point
carries a check (`point_check`): a CRC-32 over the point's own numbers, the file's
decompressed size, and the first `CHECK_BYTES` decoded from it, verified before any of
those bytes is handed out; every window carries its CRC-32 and is inflated with a size limit;
a sidecar's header names the data file (size, mtime) and the build (a hash of its contents)
the index entry was written with. So a point off by a byte, a window of another point, a
sidecar of another generation or a wrong file size is a StaleIndexError, never wrong records.

Why not `indexed_gzip`: it does the same for gzip through the same zlib calls, but fails on
zlib streams (measured: `ZRAN_BUILD_INDEX_FAIL`), stores windows uncompressed, and would be a
compiled dependency for what is ~150 lines over libz here.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import os
import stat
import struct
import tempfile
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..errors import CorruptDataError, ReadError, StaleIndexError, WriteError

__all__ = [
    "CHECK_BYTES",
    "MAX_PACKED",
    "SPACING",
    "WINDOW",
    "Heads",
    "PrimedInflate",
    "Scan",
    "SeekPoint",
    "WindowRef",
    "available",
    "cannot_write_index",
    "load_window",
    "point_check",
    "scan_file",
    "stale_point",
    "windows_name",
    "write_atomic",
    "write_windows",
]

# Output between seek points: a read from a point inflates on average half of this, and each
# point's window costs space in the sidecar (measured: benchmarks/results/access_history.md).
SPACING = 1 << 20
WINDOW = 32768  # deflate's largest back-reference distance
_CHUNK = 512 * 1024  # compressed input per read while scanning (as in stoker.inflate)
_OUT = 256 * 1024  # output buffer per inflate call while scanning (its contents are not kept)
# Decoded bytes after a point that its check covers: enough that a point a byte, a record or a
# block off decodes to other bytes, few enough that verifying costs nothing next to a read.
CHECK_BYTES = 1024
# A compressed window is at most its 32 KiB plus zlib's stored-block overhead; anything longer
# in an index is a lie, refused before it is read.
MAX_PACKED = WINDOW + WINDOW // 64 + 64
_MAGIC = b"STKWIN02"
_HEADER = struct.Struct("<8sQQ16s")  # magic, data file size, data file mtime_ns, build
_CHECKED = struct.Struct("<QBQQ")  # compressed, bits, decompressed, file's decompressed size
HEADER_BYTES = _HEADER.size
_LONGEST_BASE = 255 - len(".stoker-windows.") - 33 - 14  # file name limit less prefix, .BUILD, .RANDOM.tmp
_Z_OK, _Z_STREAM_END, _Z_BUF_ERROR, _Z_BLOCK, _Z_NO_FLUSH = 0, 1, -5, 5, 0


class WindowRef(NamedTuple):
    """Where one seek point's window lies and what it must be: its sidecar file, the CRC-32 of
    the window, the build both were written with, and the data file it was made from."""

    path: str
    offset: int
    length: int
    crc: int
    build: str
    data_size: int
    data_mtime_ns: int


class SeekPoint(NamedTuple):
    """A place decoding can start: a member (or stream) start, or a block boundary inside one.

    Indexable as `(compressed, decompressed, ...)`. A member start has `window=None`.
    """

    compressed: int  # member start: its first byte; block: the byte holding the block's first bit
    decompressed: int
    bits: int = 0  # the block starts this many bits into byte `compressed` (deflate packs LSB first)
    window: WindowRef | None = None
    # A block point decodes raw deflate, which stops at its member's end: where the next member
    # starts as (compressed, decompressed), or None when none follows.
    next_member: tuple[int, int] | None = None
    check: int | None = None  # point_check() of this point, None where nothing vouches for it
    total: int = 0  # the file's decompressed size, as the index says (bound into `check`)
    index_file: str | None = None  # the index file the point came from, named by errors


def point_check(compressed: int, bits: int, decompressed: int, total: int, head_crc: int) -> int:
    """A point's check: CRC-32 of the first CHECK_BYTES decoded from it (`head_crc`, fewer
    where the file ends sooner) continued over the point's numbers and the file's size, so no
    number of it can change alone."""
    return zlib.crc32(_CHECKED.pack(compressed, bits, decompressed, total), head_crc)


def stale_point(point: SeekPoint, path: str, field: str | None, why: str) -> StaleIndexError:
    """The error for a seek point that does not hold: names the index, the data file and the point."""
    where = f"index {point.index_file!r}" if point.index_file else "the index"
    return StaleIndexError(
        f"field {field!r}: {where} does not match {path!r} at its seek point (compressed offset "
        f"{point.compressed}, bit {point.bits}, decompressed offset {point.decompressed}): {why}; rebuild it "
        "with `stoker index` or Dataset(..., index='rebuild')",
        field=field, path=point.index_file or path, offset=point.decompressed,
    )  # fmt: skip


class Scan(NamedTuple):
    """What one pass over a compressed file found; `head` is the CRC-32 of the first
    CHECK_BYTES decoded after a point (see `point_check`)."""

    decompressed_bytes: int
    members: tuple[tuple[int, int, int], ...]  # (compressed, decompressed, head) of each member start
    # (byte, bit, decompressed, window, head) at block boundaries
    points: tuple[tuple[int, int, int, bytes, int], ...]


class Heads:
    """CRC-32s of the first CHECK_BYTES decoded after each of a scan's points, fed its output in order."""

    def __init__(self) -> None:
        self.crcs: list[int] = []
        self._open: list[tuple[int, int]] = []  # (slot in crcs, decompressed offset of its point)

    def add(self, at: int) -> int:
        """Start one at decompressed offset `at`; returns its slot in `crcs`."""
        self.crcs.append(0)
        self._open.append((len(self.crcs) - 1, at))
        return len(self.crcs) - 1

    def wanted(self, at: int) -> int:
        """How many bytes of output from `at` on the open ones still need."""
        return max((start + CHECK_BYTES - at for _, start in self._open), default=0)

    def feed(self, data: bytes | memoryview, at: int) -> None:
        """The decoded bytes at decompressed offsets `at .. at + len(data)`."""
        end = at + len(data)
        still = []
        for slot, start in self._open:
            lo, hi = max(start, at) - at, min(start + CHECK_BYTES, end) - at
            if hi > lo:
                self.crcs[slot] = zlib.crc32(data[lo:hi], self.crcs[slot])
            if start + CHECK_BYTES > end:
                still.append((slot, start))
        self._open = still


class _ZStream(ctypes.Structure):
    # zlib.h's z_stream; uLong is C's unsigned long on every platform, as c_ulong is.
    _fields_ = [
        ("next_in", ctypes.c_void_p),
        ("avail_in", ctypes.c_uint),
        ("total_in", ctypes.c_ulong),
        ("next_out", ctypes.c_void_p),
        ("avail_out", ctypes.c_uint),
        ("total_out", ctypes.c_ulong),
        ("msg", ctypes.c_char_p),
        ("state", ctypes.c_void_p),
        ("zalloc", ctypes.c_void_p),
        ("zfree", ctypes.c_void_p),
        ("opaque", ctypes.c_void_p),
        ("data_type", ctypes.c_int),
        ("adler", ctypes.c_ulong),
        ("reserved", ctypes.c_ulong),
    ]


@functools.cache
def _libz() -> Any:
    """The system libz with the calls seek points need, or None."""
    names = ["libz.so.1", "libz.dylib", "zlib1.dll"]
    found = ctypes.util.find_library("z")
    if found:
        names.append(found)
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            lib.zlibVersion.restype = ctypes.c_char_p
            for fn in (
                lib.inflateInit2_, lib.inflate, lib.inflateEnd, lib.inflateReset, lib.inflateGetDictionary,
                lib.inflatePrime, lib.inflateSetDictionary,
            ):  # fmt: skip
                fn.restype = ctypes.c_int
            lib.inflateInit2_.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
            lib.inflate.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.inflateEnd.argtypes = lib.inflateReset.argtypes = [ctypes.c_void_p]
            lib.inflateGetDictionary.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.inflatePrime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.inflateSetDictionary.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def available() -> bool:
    """True when block seek points can be built here (libz with `inflateGetDictionary` found)."""
    return _libz() is not None


class PrimedInflate:
    """Raw deflate from a block boundary `bits` (1-7) into a byte whose value is `first`:
    libz's inflate primed with that byte's remaining bits and with `window`, then fed the
    file's bytes after it. As `zlib.decompressobj`: `decompress(data, max_length)`,
    `eof`, `unused_data`, `unconsumed_tail`; libz's errors raise `zlib.error`."""

    def __init__(self, bits: int, first: int, window: bytes) -> None:
        lib = _libz()
        if lib is None:
            raise RuntimeError("libz is not available for seek points")  # an index with such points needs it
        self._lib = lib
        self._strm = _ZStream()
        if lib.inflateInit2_(ctypes.byref(self._strm), -15, lib.zlibVersion(), ctypes.sizeof(self._strm)) != _Z_OK:
            raise MemoryError("inflateInit2 failed")
        self._end = weakref.finalize(self, lib.inflateEnd, ctypes.byref(self._strm))
        if (
            lib.inflatePrime(ctypes.byref(self._strm), 8 - bits, first >> bits) != _Z_OK
            or lib.inflateSetDictionary(ctypes.byref(self._strm), window, len(window)) != _Z_OK
        ):
            self._end()
            raise zlib.error("cannot prime the decoder at this seek point")
        self.eof = False
        self.unused_data = b""
        self.unconsumed_tail = b""

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self.eof:
            self.unused_data += data
            return b""
        strm = self._strm
        inbuf = (ctypes.c_char * max(1, len(data))).from_buffer_copy(data or b"\0")
        out = ctypes.create_string_buffer(max_length)
        strm.next_in, strm.avail_in = ctypes.addressof(inbuf), len(data)
        strm.next_out, strm.avail_out = ctypes.addressof(out), max_length
        ret = self._lib.inflate(ctypes.byref(strm), _Z_NO_FLUSH)
        rest = data[len(data) - strm.avail_in :]
        if ret == _Z_STREAM_END:
            self.eof, self.unused_data, self.unconsumed_tail = True, rest, b""
            self._end()
        elif ret in (_Z_OK, _Z_BUF_ERROR):
            self.unconsumed_tail = rest
        else:
            raise zlib.error(strm.msg.decode(errors="replace") if strm.msg else f"inflate returned {ret}")
        return out.raw[: max_length - strm.avail_out]


def scan_file(path: str, kind: str, *, spacing: int = SPACING, field: str | None = None) -> Scan:
    """Decompress `path` once (checking CRCs and lengths) and find its members and seek points."""
    lib = _libz()
    if lib is None:
        raise RuntimeError("libz is not available for seek points")  # callers check available() first
    if spacing <= 0:
        raise ValueError(f"{spacing=} must be a positive number of bytes")
    wbits = {"gzip": 31, "zlib": 15}[kind]
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ReadError(f"cannot open {path!r} for field {field!r}: {e.strerror}", field=field, path=path) from e
    strm = _ZStream()
    # Buffers sized to the file: indexing 20,000 small files must not zero 800 KiB for each.
    size = os.fstat(fd).st_size
    chunk = max(1, min(_CHUNK, size))
    out_size = min(_OUT, max(16384, 8 * chunk))
    inbuf = ctypes.create_string_buffer(chunk)
    outbuf = ctypes.create_string_buffer(out_size)
    window: Any = None
    wlen = ctypes.c_uint(0)

    def corrupt(what: str, consumed: int, total: int) -> CorruptDataError:
        return CorruptDataError(
            f"{kind} stream of field {field!r} in {path!r} is corrupt: {what} "
            f"(compressed offset {consumed}, decompressed offset {total})",
            field=field, path=path, offset=total,
        )  # fmt: skip

    if lib.inflateInit2_(ctypes.byref(strm), wbits, lib.zlibVersion(), ctypes.sizeof(strm)) != _Z_OK:
        os.close(fd)
        raise MemoryError("inflateInit2 failed")
    try:
        in_pos = 0  # file offset of the next read
        total = member_out = last = 0
        heads = Heads()
        members = [(0, 0, heads.add(0))]  # (compressed, decompressed, slot of its head CRC)
        points: list[tuple[int, int, int, bytes, int]] = []
        while True:
            if strm.avail_in == 0:
                data = os.pread(fd, chunk, in_pos)
                if not data:
                    raise corrupt("truncated: the stream ends before its end marker", in_pos, total)
                ctypes.memmove(inbuf, data, len(data))
                strm.next_in, strm.avail_in = ctypes.addressof(inbuf), len(data)
                in_pos += len(data)
            strm.next_out, strm.avail_out = ctypes.addressof(outbuf), out_size
            ret = lib.inflate(ctypes.byref(strm), _Z_BLOCK)
            produced = out_size - strm.avail_out
            if produced and (want := heads.wanted(total)) > 0:
                heads.feed(ctypes.string_at(outbuf, min(produced, want)), total)
            total += produced
            consumed = in_pos - strm.avail_in
            if ret == _Z_STREAM_END:
                rest = os.pread(fd, 2, consumed)
                if kind == "gzip" and rest == b"\x1f\x8b":
                    members.append((consumed, total, heads.add(total)))
                    member_out = last = total
                    lib.inflateReset(ctypes.byref(strm))
                    in_pos, strm.avail_in = consumed, 0  # read on from the member start
                    continue
                _check_padding(fd, consumed, functools.partial(corrupt, consumed=consumed, total=total))
                break
            if ret not in (_Z_OK, _Z_BUF_ERROR):
                msg = strm.msg.decode(errors="replace") if strm.msg else f"inflate returned {ret}"
                raise corrupt(msg, consumed, total)
            dt = strm.data_type
            if dt & 128 and not dt & 64 and total > member_out and total - last >= spacing:
                bitpos = consumed * 8 - (dt & 7)
                if window is None:
                    window = ctypes.create_string_buffer(WINDOW)
                wlen.value = WINDOW
                if lib.inflateGetDictionary(ctypes.byref(strm), window, ctypes.byref(wlen)) != _Z_OK:
                    raise corrupt("inflateGetDictionary failed", consumed, total)
                points.append((bitpos // 8, bitpos % 8, total, window.raw[: wlen.value], heads.add(total)))
                last = total
        crcs = heads.crcs
        return Scan(total, tuple((c, d, crcs[k]) for c, d, k in members), tuple((*p[:4], crcs[p[4]]) for p in points))
    finally:
        lib.inflateEnd(ctypes.byref(strm))
        os.close(fd)


def _check_padding(fd: int, offset: int, corrupt: Callable[[str], CorruptDataError]) -> None:
    # As stoker.inflate: zero padding after the last member is accepted, anything else is not.
    while data := os.pread(fd, _CHUNK, offset):
        if data.strip(b"\x00"):
            raise corrupt("trailing bytes after the last member that are not a valid member")
        offset += len(data)


def windows_name(base: str, build: str) -> str:
    """The sidecar holding the windows of data file `base`'s points, in the build `build`:
    each build under its own name, so a new one never overwrites what an older index points into."""
    return f".stoker-windows.{windows_stem(base)}.{build}"


def windows_stem(base: str) -> str:
    """`base` as windows file names carry it: shortened with a hash of it where the name with a
    build and a temp suffix would pass the 255 bytes a file name may have."""
    if len(os.fsencode(base)) <= _LONGEST_BASE:
        return base
    return f"{base[:100]}~{hashlib.blake2b(os.fsencode(base), digest_size=8).hexdigest()}"


def write_windows(
    directory: str, base: str, data_size: int, data_mtime_ns: int, windows: Sequence[bytes]
) -> tuple[str, str, list[tuple[int, int, int]]]:
    """Write `windows` (compressed) beside the index in `directory`, atomically, under a new name.

    Returns (the file's basename, its build, each window's (offset, length, CRC-32)). The build is
    a hash of everything written, so the same windows of the same data file get the same name.
    """
    packed = [zlib.compress(w, 1) for w in windows]
    digest = hashlib.blake2b(struct.pack("<QQ", data_size, data_mtime_ns), digest_size=16)
    for p in packed:
        digest.update(p)
    build = digest.hexdigest()
    spans = []
    offset = _HEADER.size
    for w, p in zip(windows, packed, strict=True):
        spans.append((offset, len(p), zlib.crc32(w)))
        offset += len(p)
    name = windows_name(base, build)
    header = _HEADER.pack(_MAGIC, data_size, data_mtime_ns, bytes.fromhex(build))
    write_atomic(os.path.join(directory, name), [header, *packed], prefix=name + ".", what="seek-point windows file")
    return name, build, spans


def cannot_write_index(path: str, e: OSError, what: str = "index file") -> WriteError:
    """A WriteError naming the index file (or windows file) `path` the system refused to write:
    a full disk, a file size limit, an I/O error. Nothing of the write is left behind."""
    return WriteError(
        f"cannot write the {what} {path!r}: {e.strerror or e}; nothing of it was kept (the index, if any, "
        "is as it was): free some space, or keep the index elsewhere with `stoker index --index-dir DIR`, "
        "Dataset(..., index_dir=DIR) or STOKER_INDEX_DIR=DIR",
        path=path,
    )


def write_atomic(path: str, data: bytes | Sequence[bytes], *, prefix: str, what: str = "index file") -> None:
    """Write `data` (bytes, or parts written in turn) to `path` whole or not at all (a temp file
    beside it, fsync'ed, renamed over it); a refused write is `cannot_write_index`'s WriteError,
    with nothing of it left behind."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=os.path.dirname(path))
    except OSError as e:
        raise cannot_write_index(path, e, what) from e
    try:
        with os.fdopen(fd, "wb") as f:
            for part in [data] if isinstance(data, bytes) else data:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        readable_by_all(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):  # a full disk, a file size limit: a WriteError naming the file
            raise cannot_write_index(path, e, what) from e
        raise


def readable_by_all(path: str) -> None:
    """Give a temp file the mode a plain `open` would (mkstemp makes it 0600): others read the data too."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    try:  # Linux: read it, rather than set and restore it (process-wide, racing other threads)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def load_window(ref: WindowRef, *, field: str | None = None, index: str | None = None) -> bytes:
    """One seek point's window, checked against its index entry: the sidecar's header (data file
    and build), the window's size (inflated with a limit) and its CRC-32."""

    def bad(why: str, cause: BaseException | None = None) -> StaleIndexError:
        err = StaleIndexError(
            f"field {field!r}: seek-point windows file {ref.path!r} {why} (index {index!r}); rebuild the index "
            "with `stoker index` or Dataset(..., index='rebuild')",
            field=field, path=ref.path,
        )  # fmt: skip
        err.__cause__ = cause
        return err

    try:
        # O_NONBLOCK: a FIFO in its place opens at once (and is refused below) instead of blocking.
        fd = os.open(ref.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror})", e) from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise bad("is not a regular file")
        head = os.pread(fd, _HEADER.size, 0)
        packed = os.pread(fd, ref.length, ref.offset)
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror})", e) from e
    finally:
        os.close(fd)
    if len(head) < _HEADER.size or _HEADER.unpack(head) != (
        _MAGIC, ref.data_size, ref.data_mtime_ns, bytes.fromhex(ref.build),
    ):  # fmt: skip
        raise bad("is not the one written with the index for this data file")
    if len(packed) != ref.length:
        raise bad(f"ends before the window at offset {ref.offset} (length {ref.length})")
    d = zlib.decompressobj()
    try:
        window = d.decompress(packed, WINDOW + 1)  # a window is at most 32 KiB: no bomb inflates past it
    except zlib.error as e:
        raise bad(f"is corrupt at offset {ref.offset}", e) from e
    if not d.eof or d.unconsumed_tail or d.unused_data or not 0 < len(window) <= WINDOW:
        raise bad(f"does not hold one window of at most {WINDOW} bytes at offset {ref.offset}")
    if zlib.crc32(window) != ref.crc:
        raise bad(f"holds a window at offset {ref.offset} whose CRC-32 is not the one indexed")
    return window
