"""Whether a local file is still the one the Dataset saw: inode, size and mtime, from one stat.

A Dataset's record counts, and every copy of a file's records kept in memory, belong to the files
as they were when it was built; a file opened again later is read only if it is still that file,
so that no batch pairs one field's new records with another's old ones.
"""

from __future__ import annotations

import os

from ..errors import CorruptDataError

__all__ = ["Seen", "check_unchanged", "seen_of"]

# (st_dev, st_ino, st_size, st_mtime_ns) of a local file.
Seen = tuple[int, int, int, int]


def seen_of(st: os.stat_result) -> Seen:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(
    field: str | None, path: str, seen: Seen | None, st: os.stat_result, *, cut_ok: bool = False
) -> None:
    """A CorruptDataError naming `field` and `path` unless `st` is of the file `seen` (None: not checked).

    `cut_ok`: a raw file cut short in place (the same inode, smaller) passes, since its readers
    check every read against its size and fail at the first record it no longer holds, naming it.
    """
    if seen is None:
        return
    now = seen_of(st)
    # The device number is left out: a shared filesystem's differs between the hosts that mount
    # it (a Ray task on another node), while its inode numbers are the server's.
    if now[1:] == seen[1:] or (cut_ok and now[1] == seen[1] and now[2] < seen[2]):
        return
    if now[1] != seen[1]:
        what = "replaced by another file (another inode)"
    elif now[2] != seen[2]:
        what = f"{'grown' if now[2] > seen[2] else 'cut'} from {seen[2]} to {now[2]} bytes"
    else:
        what = f"modified (mtime {seen[3]} ns, now {now[3]} ns)"
    raise CorruptDataError(
        f"field {field!r}: {path!r} changed since the Dataset was built: {what}; a Dataset reads its files "
        "only as they were when it was built, and reads no more of this one: build a new Dataset to read "
        "the files as they are now",
        field=field, path=path,
    )  # fmt: skip
