"""Page-cache advice for raw files read front to back: read ahead of the reader, drop behind it.

Ahead: `POSIX_FADV_WILLNEED` on the next `AHEAD_BYTES` of the file after each run, so a
cold file is already on its way from the disk when the next run asks for it. The advice is not
free even when every page is cached (the kernel walks the range), so it is given only where
it can help: two one-byte reads with `RWF_NOWAIT` (cheap: they never touch the disk) probe the page after the run and
the file's last page, and a file whose both are cached gets no more advice ahead this epoch.

Behind: when the dataset's raw files are larger than half of this machine's RAM, the pages
a run has finished with are dropped (`MADV_DONTNEED` on our mapping, then
`POSIX_FADV_DONTNEED`), so streaming a dataset bigger than RAM neither evicts the
training process's memory nor keeps gigabytes of pages nobody reads again this epoch.
Smaller datasets keep their pages: the next epoch reads them from memory.

Gathers (`shuffle="global"`) of a dataset larger than half the RAM: every record is asked of
the disk with `POSIX_FADV_WILLNEED` a few batches before it is copied (see
stoker.engine.pipeline.advising_ahead), and the files' maps are advised `MADV_RANDOM`. Left to page
faults, a record missing from the cache was read by the kernel's read-around (`read_ahead_kb`
around the fault, many times a record's bytes) and, once the kernel gave that up, a page per
fault (measured: benchmarks/results/w1_big_history.md). Its pages are not
dropped behind: they stay in the cache, not marked as recently used (MADV_RANDOM), so the kernel
reclaims them before other pages; dropping each record's pages once copied would cost a flush
of the other cores' TLBs per call (`MADV_DONTNEED` or `MADV_PAGEOUT`). A
dataset that fits keeps the read-around: its first epoch's faults bring whole stretches of each
file in at the disk's sequential rate, and every later epoch reads from memory.

Advice changes what the kernel caches, never what is read: the output is the same either way.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any

import numpy as np

from ..kernels import willneed_records
from ..machine import address_space_room, physical_memory

__all__ = ["AHEAD_BYTES", "Readahead", "described", "drop_behind_for"]

# Not tuned by measurement yet: 16 MiB ahead of each file of the interleave cycle is a
# few runs of ~1 MiB in flight per file, small beside the page cache.
AHEAD_BYTES = 16 << 20
# Pages kept behind the reader (runs of the same file finish out of order across workers).
BEHIND_SLACK = 4 << 20
_PAGE = mmap.PAGESIZE
# Bound at import: the probe is advice about the cache, not a read of the data, so it keeps
# the real call even where a test wraps `os.preadv` to inject faults into the data reads.
_preadv = getattr(os, "preadv", None)


def drop_behind_for(raw_bytes: int) -> bool:
    """Whether a dataset with `raw_bytes` of raw files should drop pages behind the reader.

    Also where they are more than half of the address space the process may still map (under
    `ulimit -v`): dropping behind is what closes each file's map once it is read instead of
    keeping it for the next epoch, and maps kept of every file would run out of address space.
    """
    ram = physical_memory()
    room = address_space_room()
    return (bool(ram) and raw_bytes > ram // 2) or (room is not None and raw_bytes > room // 2)


def described(*, gathers: bool, drop_behind: bool) -> str:
    """What this module does for a loader, in a few words (its stats' `tuning`): `gathers` for a
    global shuffle's random reads, `drop_behind` for a dataset larger than RAM/2."""
    if not gathers:
        return "willneed ahead" + (", drop behind (larger than RAM/2)" if drop_behind else "")
    if drop_behind:
        return "willneed on each record a few batches ahead, maps MADV_RANDOM (larger than RAM/2)"
    return "the kernel's read-around (fits in RAM/2)"


class Readahead:
    """Advice for one pass; `after_read` is called after each run of a raw file."""

    def __init__(self, *, drop_behind: bool, gathers: bool = False) -> None:
        self.drop_behind = drop_behind
        self.gathers = gathers  # the pass reads by gathers (shuffle="global")
        self.enabled = hasattr(os, "posix_fadvise")
        self.probing = hasattr(os, "RWF_NOWAIT") and _preadv is not None
        self.advised = 0  # WILLNEED rounds asked (calls ahead of runs, batches of gathers; for tests)
        # Per descriptor: bytes from the file's start already dropped behind the reader, so
        # each run drops only what it newly left behind (a range from 0 would walk the whole
        # file's pages again on every run). A descriptor number reused for another file
        # starts below the mark and resets it.
        self._dropped: dict[int, int] = {}

    def after_read(self, fd: int, mapped: Any, size: int, offset: int, nbytes: int, *, ahead: bool = True) -> bool:
        """Advise after a run; True when the rest of the file is cached (`ahead` can stop).

        The caller keeps that answer per open file and passes `ahead=False` from then on, so a
        warm file costs two probes per epoch, not two per run: each probe is a system call that
        gives up the GIL, and a consumer running Python holds it for up to the switch interval.
        """
        if not self.enabled:
            return False
        end = offset + nbytes
        rest_cached = False
        if ahead and end < size:
            if self._cached(fd, end) and self._cached(fd, size - 1):
                rest_cached = True
            else:
                os.posix_fadvise(fd, end, min(AHEAD_BYTES, size - end), os.POSIX_FADV_WILLNEED)
                self.advised += 1
        if self.drop_behind:
            upto = (offset - BEHIND_SLACK) // _PAGE * _PAGE
            done = self._dropped.get(fd, 0)
            if offset < done:  # another file on this descriptor number, or a new epoch
                done = 0
            if upto > done:
                if mapped is not None:
                    mapped.madvise(mmap.MADV_DONTNEED, done, upto - done)
                os.posix_fadvise(fd, done, upto - done, os.POSIX_FADV_DONTNEED)
                self._dropped[fd] = upto
        return rest_cached

    @property
    def gathers_ahead(self) -> bool:
        """Whether gathers are advised ahead: a global shuffle of a dataset larger than RAM/2."""
        return self.enabled and self.drop_behind and self.gathers

    def on_map(self, mapped: Any) -> None:
        """A new map of a raw file: with `gathers_ahead`, advised `MADV_RANDOM`, so a record
        the advice missed costs its own pages, not the kernel's read-around, and its pages are
        not taken as recently used (reclaimed before the training process's)."""
        if self.gathers_ahead and hasattr(mmap, "MADV_RANDOM"):
            with contextlib.suppress(OSError, ValueError):
                mapped.madvise(mmap.MADV_RANDOM)

    def before_gather(self, fds: np.ndarray, offsets: np.ndarray, length: int) -> None:
        """Ask the disk for a gather's records at once, record `k` at `offsets[k]` of file
        `fds[k]` (`gathers_ahead` only)."""
        if self.gathers_ahead and len(offsets):
            willneed_records(fds, offsets, length)
            self.advised += 1

    def missing(self, fd: int, offset: int) -> bool:
        """Whether the page holding `offset` is known to be out of the page cache: False where
        the probe cannot tell, or past the file's end. Like the probe ahead, a miss starts the
        kernel's readahead there."""
        if not self.probing or _preadv is None:
            return False
        try:
            _preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
        except BlockingIOError:  # EAGAIN: not cached
            return True
        except OSError:  # RWF_NOWAIT unsupported by this file system
            self.probing = False
        return False

    def _cached(self, fd: int, offset: int) -> bool:
        """Whether the page holding `offset` is in the page cache (False when unknown).

        A probe that misses returns at once, but the kernel starts its own readahead from that
        page: on a cold file the probe is the first request, never a wasted one.
        """
        if not self.probing or _preadv is None:
            return False
        byte = bytearray(1)
        try:
            return _preadv(fd, [byte], offset, os.RWF_NOWAIT) == 1
        except BlockingIOError:  # EAGAIN: not cached
            return False
        except OSError:  # RWF_NOWAIT unsupported by this file system: always advise
            self.probing = False
            return False
