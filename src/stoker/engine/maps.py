"""Memory maps of raw files kept for the next epoch and shared by all who read a file at once,
each valid while its file is unchanged (device, inode, mtime, size)."""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from typing import Any

from ..io.remote import is_remote
from ..kernels import maps_hold_descriptors
from . import descriptors

__all__ = ["Identity", "KeptMaps", "identity", "identity_of", "loader_kept_maps"]

# A map kept for the next epoch, valid while the file is still this one: (st_dev, st_ino,
# st_mtime_ns, mapped size).
Identity = tuple[int, int, int, int]


class _Lent:
    """A map in KeptMaps: the file it was made from, and how many holders read through it now."""

    __slots__ = ("ident", "map", "users")

    def __init__(self, ident: Identity, mapped: Any, users: int) -> None:
        self.ident = ident
        self.map = mapped
        self.users = users


class KeptMaps:
    """Memory maps of raw files by path: one map of a file for all who read it at once, kept for
    the next epoch once the last of them has given it back.

    A map closed at the end of each epoch is made again in the next, and every page of the file
    is faulted in again, which costs a loop casting from maps a good share of its records/s
    (measured: benchmarks/results/w1_history.md; `MAP_POPULATE` gained nothing). A pass over
    several epochs keeps its maps from one to the next; a loader keeps one `KeptMaps` for all
    its passes where maps hold no descriptor (`stoker.kernels.map_file`), so a new pass per
    epoch (a PyTorch `for batch in loader` per epoch, each epoch of Keras' `fit`) finds them
    too, and no file stays open between passes; `Loader.close()` unmaps them, or their last
    holder (the loader, or a pass still running after its loader was dropped) going away does.

    A map is shared while in use, not only kept after: a global shuffle reads from every file
    up to an epoch's last batch, so the next epoch's first batches open every file while the
    last epoch still holds it, and a map of its own for each would be made and faulted in again
    once per epoch.

    A map is used only for the same file, unchanged (device, inode, mtime and size); at most
    `limit` are kept once nobody holds them (descriptors.max_kept_maps). Beyond it the map given back
    last is closed, not the oldest: epochs visit the same files, in the same order unless
    shuffled, so the least recently used map is the one needed soonest, and evicting it would
    close every map before its next visit; keeping the first `limit` finds them on every
    epoch whatever the order.
    Thread-safe: a pass's last worker may still be giving maps back while the next pass takes
    them.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = descriptors.max_kept_maps() if limit is None else limit
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, _Lent] = OrderedDict()
        self._idle = 0  # maps nobody holds
        self._closed = False

    def take(self, path: str, ident: Identity) -> tuple[Any, bool] | None:
        """The map of `path` if it is of this file unchanged, and whether it was idle (kept
        after its holders had read through it, rather than held by one still reading); give it
        back with `put`. A stale map nobody holds is closed."""
        stale = None
        with self._lock:
            lent = self._maps.get(path)
            if lent is None:
                return None
            if lent.ident == ident:
                idle = lent.users == 0
                self._idle -= idle
                lent.users += 1
                self._maps.move_to_end(path)
                return lent.map, idle
            if lent.users == 0:  # still held: it goes when its last holder gives it back
                del self._maps[path]
                self._idle -= 1
                stale = lent.map
        if stale is not None:
            stale.close()
        return None

    def lend(self, path: str, ident: Identity, mapped: Any) -> Any:
        """Share `mapped`, a new map of `path`, with later takers; the map to read through
        and give back with `put`: another's of the same file where one came first (`mapped`
        is then closed), else `mapped`."""
        extra = None
        with self._lock:
            lent = self._maps.get(path)
            if self._closed:
                pass  # put() closes it
            elif lent is not None and lent.ident == ident:
                self._idle -= lent.users == 0
                lent.users += 1
                mapped, extra = lent.map, mapped
            elif lent is None or lent.users == 0:
                if lent is not None:
                    self._idle -= 1
                    extra = lent.map
                self._maps[path] = _Lent(ident, mapped, 1)
                self._maps.move_to_end(path)
        if extra is not None:
            extra.close()
        return mapped

    def put(self, path: str, ident: Identity, mapped: Any) -> None:
        """Give back a map (from `take` or `lend`, or made apart), kept once nobody holds it."""
        closing = []
        with self._lock:
            lent = self._maps.get(path)
            if lent is not None and lent.map is mapped:
                lent.users -= 1
                if lent.users == 0:
                    self._idle += 1
                    self._maps.move_to_end(path)
            elif self._closed or self.limit == 0 or (lent is not None and lent.users):
                closing.append(mapped)  # not kept; a map of this path still held stays
            else:
                if lent is not None:
                    closing.append(lent.map)
                    self._idle -= 1
                self._maps[path] = _Lent(ident, mapped, 0)
                self._maps.move_to_end(path)
                self._idle += 1
            limit = 0 if self._closed else self.limit
            if self._idle > limit:  # the latest given back go first (see the class)
                idle = (k for k, v in reversed(self._maps.items()) if v.users == 0)
                for key in list(itertools.islice(idle, self._idle - limit)):
                    closing.append(self._maps.pop(key).map)
                    self._idle -= 1
        for m in closing:
            m.close()

    def __len__(self) -> int:
        """Maps kept that nobody holds."""
        return self._idle

    def close(self) -> None:
        """Unmap every map nobody holds; the others are unmapped as they are given back, and
        later `lend` and `put` calls close what they are given. Idempotent."""
        with self._lock:
            self._closed = True
            idle = [k for k, v in self._maps.items() if v.users == 0]
            maps = [self._maps.pop(k).map for k in idle]
            self._idle = 0
        for m in maps:
            m.close()


def identity(path: str) -> Identity | None:
    """(device, inode, mtime, size) of a local file, or None where it cannot be had."""
    if is_remote(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return identity_of(st, st.st_size)


def identity_of(st: os.stat_result, size: int) -> Identity:
    """The identity of a file by its stat and the size read of it (see KeptMaps, KeptDecoded)."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns, size)


def loader_kept_maps() -> KeptMaps | None:
    """A `KeptMaps` for a loader to share between its passes, or None where maps hold a
    descriptor (no compiled kernels): each pass then keeps its own and closes them with it."""
    return None if maps_hold_descriptors() else KeptMaps()
