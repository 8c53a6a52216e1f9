"""The errors for files that no longer hold what the Dataset saw: cut short, failed reads, streams
that end early or run on. Every reader builds its errors here, so each names the field, the file,
the record and the byte offset the same way."""

from __future__ import annotations

import numpy as np

from ..errors import CorruptDataError, ReadError, StokerError
from ..spec import Field
from .files import FileInfo

__all__ = [
    "cut_short",
    "cut_since_built",
    "footer_short",
    "gather_truncated",
    "header_short",
    "map_fault",
    "no_end",
    "read_failed",
    "reading_note",
    "resized",
    "runs_on",
    "seek_beyond_end",
    "short_stream",
    "stream_short",
    "truncated",
]


def reading_note(name: str, info: FileInfo, group: int, start: int, stop: int) -> str:
    """The note added to an error not of stoker's own raised while reading records `start..stop-1`."""
    return f"stoker: while reading field {name!r} from {info.path!r} (group {group}, records {start}..{stop - 1})"


def cut_since_built(name: str, info: FileInfo, size: int) -> CorruptDataError:
    """A raw file found `size` bytes long, shorter than when the Dataset was built."""
    return CorruptDataError(
        f"field {name!r}: {info.path!r} is {size} bytes now but was {info.size} bytes when the Dataset was built; "
        "the file was truncated after the Dataset was built",
        field=name, path=info.path, offset=size,
    )  # fmt: skip


def cut_short(name: str, spec: Field, info: FileInfo, size: int, offset: int) -> CorruptDataError:
    """A read of `info`'s file failing at byte `offset`: the file is `size` bytes now."""
    index = max(0, (offset - spec.header_bytes) // spec.record_bytes)
    return CorruptDataError(
        f"field {name!r}: {info.path!r} is {size} bytes now but was {info.size} bytes when the Dataset "
        f"was built (reading record {index}, byte offset {offset}, failed)",
        field=name, path=info.path, index=index, offset=offset,
    )  # fmt: skip


def resized(name: str, spec: Field, info: FileInfo, size: int, last: int) -> CorruptDataError:
    """A file found `size` bytes long, not the size the Dataset saw, with record `last` asked of it."""
    offset = spec.header_bytes + last * spec.record_bytes
    return CorruptDataError(
        f"field {name!r}: {info.path!r} is {size} bytes now but was {info.size} bytes when the Dataset "
        f"was built (record {last} asked for, byte offset {offset})",
        field=name, path=info.path, index=last, offset=offset,
    )  # fmt: skip


def truncated(
    name: str, info: FileInfo, spec: Field, group: int, start: int, count: int, offset: int
) -> CorruptDataError:
    """Records `start .. start+count-1` of `group` asked for, and the file ends at byte `offset`."""
    index = max(start, (offset - spec.header_bytes) // spec.record_bytes)
    return CorruptDataError(
        f"field {name!r}: {info.path!r} ends at byte {offset}, inside record {index} of group "
        f"{group} (records {start}..{start + count - 1} were asked for); "
        "the file was truncated after the Dataset was built",
        field=name, path=info.path, index=index, offset=offset,
    )  # fmt: skip


def gather_truncated(
    name: str, info: FileInfo, spec: Field, group: int, local: np.ndarray, size: int
) -> CorruptDataError:
    """A gather of records `local` (ascending) from a file now `size` bytes long: it names the
    first record asked for that the file no longer holds."""
    whole = max(0, size - spec.header_bytes) // spec.record_bytes
    first = int(local[min(len(local) - 1, int(np.searchsorted(local, whole)))])
    return truncated(name, info, spec, group, first, len(local), size)


def read_failed(name: str, info: FileInfo, spec: Field, offset: int, e: OSError) -> ReadError:
    """A read of `info`'s file failing at byte `offset` with `e`."""
    index = (offset - spec.header_bytes) // spec.record_bytes
    return ReadError(
        f"field {name!r}: read of {info.path!r} failed at record {index} (byte offset {offset}): {e.strerror}",
        field=name, path=info.path, index=index, offset=offset,
    )  # fmt: skip


def map_fault(
    name: str, info: FileInfo, spec: Field, group: int, start: int, count: int, e: OSError, *, now: int, mapped: int,
    offset: int,
) -> StokerError:  # fmt: skip
    """A bus error reading a map of `mapped` bytes at `offset` in it (-1: unknown), the file
    `now` bytes long: cut short (a CorruptDataError, as the size check gives) or, still whole,
    a failed read."""
    if now < mapped:
        return truncated(name, info, spec, group, start, count, now)
    offset = offset if 0 <= offset < mapped else spec.header_bytes + start * spec.record_bytes
    return read_failed(name, info, spec, offset, OSError(e.errno, "bus error reading its memory map"))


def short_stream(name: str, spec: Field, info: FileInfo, n: int, produced: int) -> CorruptDataError:
    """A stream read from a seek point ending at decompressed offset `produced`, of a file of `n` records."""
    index = max(0, (produced - spec.header_bytes) // spec.record_bytes)
    return CorruptDataError(
        f"field {name!r}: {info.compression} stream {info.path!r} ends at decompressed offset {produced}, "
        f"inside record {index} of {n}",
        field=name, path=info.path, index=index, offset=produced,
    )  # fmt: skip


def stream_short(name: str, info: FileInfo, group: int, expected: int, pos: int, produced: int) -> CorruptDataError:
    """A stream ending after `pos` whole records, at decompressed offset `produced`; its group has `expected`."""
    return CorruptDataError(
        f"field {name!r}: {info.compression} stream {info.path!r} ends after {pos} whole records "
        f"(decompressed offset {produced}), but group {group} has {expected} records "
        f"(record {pos} is missing)",
        field=name, path=info.path, index=pos, offset=produced,
    )  # fmt: skip


def seek_beyond_end(name: str, info: FileInfo, record: int, target: int, produced: int) -> CorruptDataError:
    """A stream ending at `produced`, before `record` (decompressed offset `target`) that its
    index placed after a seek point."""
    return CorruptDataError(
        f"field {name!r}: {info.path!r} ends at decompressed offset {produced}, before record "
        f"{record} (offset {target}) that its persistent index places after a seek point",
        field=name, path=info.path, index=record, offset=produced,
    )  # fmt: skip


def header_short(name: str, spec: Field, info: FileInfo, produced: int) -> CorruptDataError:
    """A stream decompressing to `produced` bytes, fewer than its header."""
    return CorruptDataError(
        f"field {name!r}: {info.path!r} decompresses to {produced} bytes, fewer than "
        f"header_bytes={spec.header_bytes}",
        field=name, path=info.path, offset=produced,
    )  # fmt: skip


def footer_short(name: str, spec: Field, info: FileInfo, pos: int, produced: int) -> CorruptDataError:
    """A stream ending at `produced`, inside the footer that follows its `pos` records."""
    return CorruptDataError(
        f"field {name!r}: {info.path!r} ends at decompressed offset {produced}, inside "
        f"footer_bytes={spec.footer_bytes} that follow record {pos - 1}",
        field=name, path=info.path, index=pos, offset=produced,
    )  # fmt: skip


def no_end(name: str, spec: Field, info: FileInfo, n: int, produced: int) -> CorruptDataError:
    """A stream decoded whole that does not end after its `n` records and footer (at `produced`)."""
    return CorruptDataError(
        f"field {name!r}: {info.path!r} does not end after its {n} records and footer_bytes="
        f"{spec.footer_bytes} (decompressed offset {produced})",
        field=name, path=info.path, index=n, offset=produced,
    )  # fmt: skip


def runs_on(name: str, info: FileInfo, group: int, pos: int, offset: int) -> CorruptDataError:
    """A stream whose data continues at `offset`, past the `pos` records of its group."""
    return CorruptDataError(
        f"field {name!r}: {info.path!r} holds more than the {pos} records of group {group} "
        f"(data continues at decompressed offset {offset}); its gzip trailer "
        "disagrees with its contents or the other fields' files are short",
        field=name, path=info.path, index=pos, offset=offset,
    )  # fmt: skip
