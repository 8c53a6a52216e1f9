"""One error hierarchy under StokerError; each class is also the fitting builtin."""

from __future__ import annotations

from typing import Any

__all__ = [
    "CorruptDataError",
    "ForkedPassError",
    "PairingError",
    "ReadError",
    "RecordIndexError",
    "SpecError",
    "StaleIndexError",
    "StateError",
    "StokerError",
    "SupersededError",
    "TransformError",
    "WriteError",
]


class StokerError(Exception):
    """Base of every error stoker raises on purpose.

    Carries where it applies: `field`, `path`, `index` (record index within the
    file) and `offset` (byte offset within the file, or within the decompressed
    stream for compressed fields). Attributes not known are None.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        path: str | None = None,
        index: int | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.path = path
        self.index = index
        self.offset = offset

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep keyword attributes across pickling (process workers, Ray tasks).
        return (_rebuild, (type(self), str(self), self.field, self.path, self.index, self.offset))


def _rebuild(
    cls: type[StokerError],
    message: str,
    field: str | None,
    path: str | None,
    index: int | None,
    offset: int | None,
) -> StokerError:
    return cls(message, field=field, path=path, index=index, offset=offset)


class SpecError(StokerError, ValueError):
    """A Field, Dataset or loader argument is invalid, or a glob matched nothing usable."""


class PairingError(StokerError, ValueError):
    """The fields' files do not line up: counts of files or of records, or their keys, differ."""


class CorruptDataError(StokerError, ValueError):
    """File contents are not what the spec says: bad size, bad compressed stream, short data."""


class ReadError(StokerError, OSError):
    """The operating system refused or failed a read (permissions, I/O error, vanished file)."""


class StateError(StokerError, ValueError):
    """A saved loader state does not belong to this dataset and loader configuration."""


class StaleIndexError(StokerError, ValueError):
    """A persistent index file no longer matches its data files, or was written by another version."""


class RecordIndexError(StokerError, IndexError):
    """A record index is outside the dataset (random access)."""


class SupersededError(StokerError, RuntimeError):
    """A loader's iterator was used after a newer `iter(loader)` ended its pass (one pass at a time)."""


class TransformError(StokerError, TypeError):
    """A `transform=` function returned something other than a dict of numpy arrays."""


class ForkedPassError(StokerError, RuntimeError):
    """A pass was iterated in a process forked from the one that started it, which has none of its threads."""


class WriteError(StokerError, OSError):
    """The operating system refused a write stoker must make: the persistent index in a read-only directory."""
