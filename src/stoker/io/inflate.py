"""Streaming gzip/zlib decompression in large chunks, with errors that name the file.

Uses isal (faster than stdlib zlib) when installed, else zlib.
Multi-member gzip files are read member after member, as gzip(1) does; zero padding
after the last member is accepted, any other trailing bytes are an error. Decoding may
start at a persistent index's seek point (`stoker.seekpoints`): a member start, or a
deflate block boundary inside a member, entered as a raw stream primed with its window.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ..errors import CorruptDataError, ReadError, StaleIndexError, StokerError
from ..machine import open_regular
from .remote import RemoteReader, Version, is_remote
from .seekpoints import CHECK_BYTES, PrimedInflate, SeekPoint, load_window, point_check, stale_point
from .unchanged import Seen, check_unchanged

_zlib: ModuleType
try:  # pragma: no cover - which branch runs depends on the install
    from isal import isal_zlib as _zlib

    BACKEND = "isal"
except ImportError:  # pragma: no cover
    _zlib = zlib
    BACKEND = "zlib"

__all__ = ["BACKEND", "GZIP_MAGIC", "Inflater", "TruncatedStreamError", "decompressed_size", "gzip_trailer_size"]

GZIP_MAGIC = b"\x1f\x8b"
_WBITS = {"gzip": 31, "zlib": 15}
# Input read per call: large enough that syscall and call overhead vanish, small enough
# that a stream of a 4-byte-label file does not allocate much. measured: 256 KiB..1 MiB flat.
_CHUNK = 512 * 1024


def gzip_trailer_size(fd: int, size: int) -> int | None:
    """ISIZE of the last gzip member (uncompressed size mod 2**32), or None if too short."""
    if size < 18:
        return None
    tail = os.pread(fd, 4, size - 4)
    return int.from_bytes(tail, "little") if len(tail) == 4 else None


class TruncatedStreamError(CorruptDataError):
    """The compressed stream stops early; the bytes decoded before that point are intact."""


class Inflater:
    """Sequential reader of the decompressed bytes of one gzip or zlib file."""

    def __init__(
        self,
        path: str,
        kind: str,
        *,
        field: str | None = None,
        start: tuple[int, int] | SeekPoint = (0, 0),
        storage_options: Mapping[str, Any] | None = None,
        source: Any = None,
        version: Version | None = None,
        seen: Seen | None = None,
    ) -> None:
        # `source`: where a URL's compressed bytes come from (`pread(n, offset)`, `close()`;
        # a loader's read-ahead, stoker.io.fetch), else a RemoteReader of its own, held to
        # `version` (the object the Dataset was built on).
        # `start`: (compressed, decompressed) offset of a gzip member start or of the
        # stream start, or a SeekPoint at a deflate block boundary (stoker.seekpoints),
        # from which decoding may begin (a persistent index's seek point).
        # `seen`: the local file as the Dataset saw it; another is a CorruptDataError (stoker.io.unchanged).
        self.path = path
        self.kind = kind
        self.field = field
        # A URL is read through stoker.io.remote (ranged, retried); a path through its descriptor.
        if source is None and is_remote(path):
            source = RemoteReader(path, storage_options, field=field, version=version)
        self._remote = source
        try:
            self._fd = -1 if self._remote else open_regular(path)  # a FIFO there must not block the open
        except OSError as e:
            raise ReadError(f"cannot open {path!r} for field {field!r}: {e.strerror}", field=field, path=path) from e
        self._close_lock = threading.Lock()
        if self._fd >= 0 and seen is not None:
            try:
                check_unchanged(field, path, seen, os.fstat(self._fd))
            except BaseException:
                self.close()
                raise
        self._in_offset = start[0]  # compressed bytes read so far
        point = start if isinstance(start, SeekPoint) else None
        # A point an index vouches for: its check is verified before any byte from it is handed out.
        self._check = point if point is not None and point.check is not None else None
        self._index = point.index_file if point is not None else None
        # Decoding from a block boundary: raw deflate primed with the window, until its member
        # ends (then on at `_next_member`).
        self._raw = False
        self._next_member: tuple[int, int] | None = None
        self._d: Any
        self._tail = b""  # compressed input not yet consumed by the decompressor
        self._out = b""  # decompressed bytes not yet handed out
        self._out_pos = 0
        self.produced = start[1]  # decompressed bytes handed out
        self._decoded = start[1]  # decompressed bytes produced by the decoder
        # (compressed offset, decompressed offset) of every member start seen so far.
        self.members: list[tuple[int, int]] = [(start[0], start[1])]
        self._eof = False
        try:
            if point is not None and point.window is not None:
                self._enter_block(point)
            else:
                self._d = _zlib.decompressobj(_WBITS[kind])
        except BaseException:
            self.close()
            raise

    def _enter_block(self, point: SeekPoint) -> None:
        """Start at a block boundary: raw deflate primed with the point's window (and bits)."""
        assert point.window is not None
        window = load_window(point.window, field=self.field, index=point.index_file)
        self._raw, self._next_member = True, point.next_member
        if point.bits:  # the block starts inside byte `compressed`: libz, primed with its bits
            first = self._pread(1)
            if not first:
                raise self._at_point(point, "truncated: the file ends at a seek point of its index")
            self._in_offset += 1
            try:
                self._d = PrimedInflate(point.bits, first[0], window)
            except zlib.error as e:
                raise self._at_point(point, f"the decoder cannot be primed there ({e})") from e
        else:
            self._d = _zlib.decompressobj(wbits=-15, zdict=window)  # a raw stream's zdict is set at once

    def _at_point(self, point: SeekPoint, why: str) -> StokerError:
        """A point that does not hold: the index's fault where one vouched for it, else the data's."""
        if point.check is not None:
            return stale_point(point, self.path, self.field, why)
        return self._corrupt(why)

    def close(self) -> None:
        """Close the file; idempotent and safe to race (a descriptor is closed exactly once)."""
        with self._close_lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> Inflater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _corrupt(self, what: str, cause: BaseException | None = None) -> CorruptDataError:
        kind = TruncatedStreamError if what.startswith("truncated") else CorruptDataError
        err = kind(
            f"{self.kind} stream of field {self.field!r} in {self.path!r} is corrupt: {what} "
            f"(compressed offset {self._in_offset}, decompressed offset {self.produced})",
            field=self.field,
            path=self.path,
            offset=self.produced,
        )
        if cause is not None:
            err.__cause__ = cause
        return err

    def _read_input(self) -> bytes:
        data = self._pread(_CHUNK)
        self._in_offset += len(data)
        return data

    def _pread(self, n: int) -> bytes:
        if self._remote is not None:
            return self._remote.pread(n, self._in_offset)
        try:
            return os.pread(self._fd, n, self._in_offset)
        except OSError as e:
            raise ReadError(
                f"read of {self.path!r} (field {self.field!r}) failed at offset {self._in_offset}: {e.strerror}",
                field=self.field,
                path=self.path,
                offset=self._in_offset,
            ) from e

    def _refill(self, want: int) -> bool:
        """Decompress until at least some output is buffered; False at end of stream."""
        if self._check is not None:
            return self._refill_checked()
        return self._refill_plain(want)

    def _refill_checked(self) -> bool:
        """The first bytes from a vouched-for seek point: decoded, verified, only then handed out."""
        point, self._check = self._check, None
        assert point is not None and point.check is not None
        parts: list[bytes] = []
        got = 0
        try:
            while got < CHECK_BYTES and self._refill_plain(CHECK_BYTES - got):
                parts.append(self._out)
                got += len(self._out)
        except CorruptDataError as e:  # the data decoded from the start checks out: the point is wrong
            raise stale_point(point, self.path, self.field, f"the data does not decode from there ({e})") from e
        head = b"".join(parts)
        crc = zlib.crc32(memoryview(head)[:CHECK_BYTES])
        if point_check(point.compressed, point.bits, point.decompressed, point.total, crc) != point.check:
            raise stale_point(point, self.path, self.field, "what decodes from there is not what was indexed")
        self._out, self._out_pos = head, 0
        return bool(head)

    def _refill_plain(self, want: int) -> bool:
        while not self._eof:
            if self._d.eof and self._raw:
                self._end_raw()
                continue
            if self._d.eof:
                rest = self._d.unused_data + self._tail
                self._tail = b""
                if not rest:
                    rest = self._read_input()
                if len(rest) == 1:  # a member's magic cut by the end of a read: judge it whole
                    rest += self._read_input()
                if not rest:
                    self._eof = True
                    return False
                if self.kind == "gzip" and rest[:2] == GZIP_MAGIC:
                    self.members.append((self._in_offset - len(rest), self._decoded))
                    self._d = _zlib.decompressobj(_WBITS["gzip"])
                    self._tail = rest
                    continue
                self._check_padding(rest)
                self._eof = True
                return False
            # No input left is not yet the end: a call limited by its output size may have taken
            # all input and still hold output, which a call with no input hands out.
            data = self._tail or self._read_input()
            try:
                out = self._d.decompress(data, max(want, 65536))
            except (zlib.error, _zlib.error) as e:
                raise self._corrupt(str(e), e) from e
            self._tail = self._d.unconsumed_tail
            if out:
                self._decoded += len(out)
                self._out, self._out_pos = out, 0
                return True
            if not data and not self._d.eof:
                raise self._corrupt("truncated: the stream ends before its end marker")
        return False

    def _end_raw(self) -> None:
        """A stream entered at a block point ended: go on at the next member start, if any.

        Where the next member starts is checked, not taken from the index: right after this
        member's deflate data and its 8-byte trailer, at the decompressed offset decoded so far.
        """
        end = self._next_member
        if end is None:
            self._eof = True  # the index's scan checked what follows the last member
            return
        deflate_end = self._in_offset - len(self._d.unused_data) - len(self._tail)
        if self._decoded != end[1] or (self.kind == "gzip" and deflate_end + 8 != end[0]):
            why = (
                f"its member ends at compressed offset {deflate_end} + an 8-byte trailer, decompressed offset "
                f"{self._decoded}, but the index says the next member starts at {end[0]}, {end[1]}"
            )
            raise StaleIndexError(
                f"field {self.field!r}: the index of {self.path!r} does not match it: {why}; rebuild it with "
                "`stoker index` or Dataset(..., index='rebuild')",
                field=self.field, path=self._index or self.path, offset=self._decoded,
            )  # fmt: skip
        self._raw, self._next_member, self._tail = False, None, b""
        self._in_offset = end[0]
        self.members.append(end)
        self._d = _zlib.decompressobj(_WBITS["gzip"])

    def _check_padding(self, rest: bytes) -> None:
        # Trailing zeros are tolerated (tape/block padding, as gzip(1) does); anything else is not.
        while True:
            if rest.strip(b"\x00"):
                raise self._corrupt("trailing bytes after the last member that are not a valid member")
            rest = self._read_input()
            if not rest:
                return

    def readinto(self, buf: memoryview) -> int:
        """Fill `buf` with the next decompressed bytes; returns the count (short only at end)."""
        n = len(buf)
        done = 0
        while done < n:
            if self._out_pos >= len(self._out) and not self._refill(n - done):
                break
            take = min(n - done, len(self._out) - self._out_pos)
            buf[done : done + take] = self._out[self._out_pos : self._out_pos + take]
            self._out_pos += take
            done += take
            self.produced += take  # as it goes: an error raised by the next refill names this offset
        return done

    def skip(self, n: int) -> int:
        """Discard the next `n` decompressed bytes; returns how many were there."""
        done = 0
        while done < n:
            if self._out_pos >= len(self._out) and not self._refill(n - done):
                break
            take = min(n - done, len(self._out) - self._out_pos)
            self._out_pos += take
            done += take
            self.produced += take
        return done

    def at_end(self) -> bool:
        """True when no decompressed byte is left (reads ahead to check, validating the end)."""
        if self._out_pos < len(self._out):
            return False
        return not self._refill(1)


def decompressed_size(
    path: str,
    kind: str,
    *,
    field: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    version: Version | None = None,
    seen: Seen | None = None,
) -> int:
    """Decompress a whole file (a remote one at `version`) to count its bytes (validating CRCs
    and the end of stream)."""
    with Inflater(path, kind, field=field, storage_options=storage_options, version=version, seen=seen) as inf:
        while inf.skip(1 << 30) == 1 << 30:
            pass
        return inf.produced
