"""The raw files a pass holds open and mapped, counted by reference: a file closes once its final
planned run is done and nobody holds it, its map given back to be kept for the next epoch."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..errors import ReadError
from ..io.faults import cut_since_built
from ..io.files import FileInfo, open_local
from ..io.readahead import Readahead
from ..io.unchanged import check_unchanged
from ..kernels import map_address, map_file
from ..machine import address_space_limit, address_space_room
from .descriptors import pass_open_files
from .maps import Identity, KeptMaps, identity_of

__all__ = ["OpenFile", "OpenFiles", "map_refused"]


def map_refused(name: str, path: str, size: int, e: OSError) -> ReadError:
    """The ReadError of a file the system would not map: where it ran out of address space under
    `ulimit -v`, the limit, and what to change."""
    why = f"field {name!r}: cannot map {path!r} ({size} bytes): {e.strerror or e}"
    limit = address_space_limit()
    if e.errno == errno.ENOMEM and limit is not None:
        why += (
            f"; this process's address space is limited (RLIMIT_AS, `ulimit -v`: {limit} bytes, "
            f"{address_space_room()} free): raise the limit, or read fewer files at once (cycle_length=, "
            "shuffle='files' rather than 'global')"
        )
    return ReadError(why, field=name, path=path)


class OpenFile:
    """One raw file open and mapped; `refs` counts the reads using it right now."""

    __slots__ = ("_address", "done", "fd", "ident", "map", "refs", "reused", "size", "warm")

    def __init__(self, fd: int, size: int, mapped: Any, ident: Identity | None = None, *, reused: bool = False) -> None:
        self.fd = fd
        self.ident = ident  # what the map was made from (see OpenFiles.close_file)
        self.size = size
        self.map = mapped
        # The map was kept from an earlier epoch: every page of it was read once already.
        self.reused = reused
        self.refs = 0
        self.done = False
        self.warm = False  # the rest of the file was found in the page cache: no advice ahead
        self._address = 0

    def address(self) -> int:
        """Where the map's first byte lies in memory (the map is open)."""
        if not self._address:
            self._address = map_address(self.map)
        return self._address

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class OpenFiles:
    """A pass's open raw files by (epoch, path), held and let go by reference.

    Runs planned but not yet done are counted per (epoch, raw file) (`planned`): a file closes
    only when its final run is done and no earlier run is still to come (workers finish out of
    order; a file closed early would be opened again, and fail if it was deleted meanwhile). At
    most `pass_open_files()` are kept open; beyond, those nobody holds close, oldest first.

    Holds of many files at once (`hold`: a global shuffle's gathers, a batch's runs over many small
    files) take at most `hold_limit` each, and all of them together at most `pass_open_files()`,
    a hold waiting for others to end beyond it: under the soft descriptor limit, whatever the
    number of files or workers, with half of it left to the caller's own files.

    `kept_maps`: where maps are kept for the next epoch (a loader's, shared by its passes); None:
    this table's own, closed with it.
    """

    def __init__(self, readahead: Readahead, kept_maps: KeptMaps | None = None) -> None:
        self.readahead = readahead
        self.kept_maps = KeptMaps() if kept_maps is None else kept_maps
        self._owns_kept_maps = kept_maps is None
        self.lock = threading.Lock()
        self._files: OrderedDict[tuple[int, str], OpenFile] = OrderedDict()
        self._max_open = pass_open_files()
        self._pending: dict[tuple[int, str], int] = {}
        # Files held by `hold` now, under `_max_open`; a hold waits on `_room` beyond it. Each
        # worker holds once at a time, and a hold never asks more than `_max_open`, so waits end.
        self.hold_limit = max(1, self._max_open // 2)
        self._holding = 0
        self._room = threading.Condition(self.lock)

    def planned(self, epoch: int, paths: Sequence[str]) -> None:
        """One more run of each of `paths` is planned in `epoch` (by the dispatcher, in plan order)."""
        with self.lock:
            for path in paths:
                key = (epoch, path)
                self._pending[key] = self._pending.get(key, 0) + 1

    def _held_again(self, epoch: int, path: str) -> OpenFile | None:
        """The pass's open file of `path`, held once more (caller holds `lock`), or None."""
        f = self._files.get((epoch, path))
        if f is not None:
            self._files.move_to_end((epoch, path))
            f.refs += 1
        return f

    def acquire(self, epoch: int, name: str, info: FileInfo) -> OpenFile:
        """Field `name`'s raw file `info`, held (opened and mapped where it is not yet)."""
        key = (epoch, info.path)
        with self.lock:
            f = self._held_again(epoch, info.path)
        if f is not None:
            return f
        fd = self._open(name, info)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ReadError(
                    f"field {name!r}: {info.path!r} is no longer a regular file (replaced since the Dataset was built)",
                    field=name, path=info.path,
                )  # fmt: skip
            # Only the file the Dataset saw: one replaced, rewritten, grown or cut since is refused
            # here, so a later epoch never pairs its new records with another field's kept ones.
            check_unchanged(name, info.path, info.seen, st, cut_ok=True)
            size = min(st.st_size, info.size)
            ident = identity_of(st, size)
            # The same file, unchanged, read in an earlier epoch or held by one still reading
            # it: its pages are mapped already. Not with drop-behind: its maps are its own.
            shared = not self.readahead.drop_behind
            lent = self.kept_maps.take(info.path, ident) if shared else None
            mapped, reused = lent if lent is not None else (None, False)
            # Mapped for cast copies, strided runs and gathers, and plain runs once the map is
            # kept from an earlier epoch; plain runs of a new map use preadv.
            try:
                if mapped is None and size:
                    mapped = map_file(fd, size)
                    self.readahead.on_map(mapped)
                    if shared:
                        mapped = self.kept_maps.lend(info.path, ident, mapped)
            except OSError as e:
                raise map_refused(name, info.path, size, e) from e
            except ValueError as e:  # mmap.mmap (no kernels built): the file was cut since its fstat
                raise cut_since_built(name, info, os.fstat(fd).st_size) from e
        except BaseException:
            os.close(fd)
            raise
        f = OpenFile(fd, size, mapped, ident, reused=reused)
        f.refs = 1
        with self.lock:
            other = self._files.get(key)
            if other is not None:  # another worker opened it meanwhile; use theirs
                other.refs += 1
                f.refs = 0
                self._close_file(info.path, f)
                return other
            self._files[key] = f
            self._evict()
        return f

    def _open(self, name: str, info: FileInfo) -> int:
        """A descriptor of `info`'s file; where the process is out of descriptors, the files
        nobody holds are closed and the open tried once more, before the ReadError naming it."""
        try:
            return open_local(name, info.path)
        except ReadError as e:
            if not isinstance(e.__cause__, OSError) or e.__cause__.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            with self.lock:
                idle = [(key, f) for key, f in self._files.items() if f.refs == 0]
                for key, f in idle:
                    del self._files[key]
                    self._close_file(key[1], f)
            if not idle:
                e.add_note(f"stoker: this pass holds {len(self._files)} data files open, each in use")
                raise
        return open_local(name, info.path)

    def hold(self, epoch: int, name: str, infos: list[FileInfo]) -> list[OpenFile]:
        """`acquire` of each raw file of `infos` (at most `hold_limit`): those open already in
        one lock round (a global shuffle's batch reads from hundreds on W1-big, benchmarks/w1_big.py), the others
        opened one by one. On an error, what was held is let go. Give them back with `let_go`,
        or with `released` of each and then `end_hold`."""
        if len(infos) > self.hold_limit:
            raise ValueError(f"a hold of {len(infos)} files exceeds hold_limit={self.hold_limit}")
        held: list[OpenFile | None] = [None] * len(infos)
        with self.lock:
            while self._holding and self._holding + len(infos) > self._max_open:
                self._room.wait()
            self._holding += len(infos)
            for k, info in enumerate(infos):
                held[k] = self._held_again(epoch, info.path)
        try:
            for k, f in enumerate(held):
                if f is None:
                    held[k] = self.acquire(epoch, name, infos[k])
        except BaseException:
            self.let_go(epoch, infos, held)
            raise
        return held  # type: ignore[return-value]  # every one acquired

    def let_go(self, epoch: int, infos: list[FileInfo], held: Sequence[OpenFile | None]) -> None:
        """`release` (not counted as a run) of files held by `hold`, in one lock round."""
        with self.lock:
            for info, f in zip(infos, held, strict=True):
                if f is not None:
                    self.released(epoch, info, f, False, counted=False)
            self._end_hold(len(infos))

    def end_hold(self, n: int) -> None:
        """A `hold` of `n` files whose files were given back one by one (`released`) is over."""
        with self.lock:
            self._end_hold(n)

    def _end_hold(self, n: int) -> None:
        self._holding -= n
        self._room.notify_all()

    def _evict(self) -> None:
        excess = len(self._files) - self._max_open
        for key in list(self._files):
            if excess <= 0:
                break
            f = self._files[key]
            if f.refs == 0:
                del self._files[key]
                self._close_file(key[1], f)
                excess -= 1

    def _run_done(self, epoch: int, path: str) -> None:
        """One planned run of `path` is done (caller holds `lock`)."""
        key = (epoch, path)
        left = self._pending.get(key, 0) - 1
        if left > 0:
            self._pending[key] = left
        else:
            self._pending.pop(key, None)

    def release(self, epoch: int, info: FileInfo, f: OpenFile, final: bool) -> None:
        """A run of `f` is done (`final`: its file's last)."""
        with self.lock:  # one lock round per run: this is on the hot path
            self.released(epoch, info, f, final)

    def released(self, epoch: int, info: FileInfo, f: OpenFile, final: bool, *, counted: bool = True) -> None:
        """A hold of `f` is over (caller holds `lock`): `final`, its file's last run;
        `counted`, one of its planned runs (`let_go` gives back holds that were neither)."""
        f.refs -= 1
        f.done = f.done or final
        if counted:
            self._run_done(epoch, info.path)
        self._close_if_done(epoch, info, f)

    def empty_run(self, epoch: int, info: FileInfo, final: bool) -> None:
        """A planned run of no records is done: it only says, where `final`, that the file is."""
        with self.lock:
            self._run_done(epoch, info.path)
            f = self._files.get((epoch, info.path))
            if f is not None:
                if final:
                    f.done = True
                self._close_if_done(epoch, info, f)

    def _close_if_done(self, epoch: int, info: FileInfo, f: OpenFile) -> None:
        """Close `f` once its final run is done, nobody holds it and no run of it is still to
        come (caller holds `lock`)."""
        if f.done and f.refs == 0 and (epoch, info.path) not in self._pending:
            if self._files.get((epoch, info.path)) is f:
                del self._files[(epoch, info.path)]
            self._close_file(info.path, f)

    def _close_file(self, path: str, f: OpenFile) -> None:
        """Close a raw file, giving its memory map back to be kept for the next epoch where that
        pays (see KeptMaps; caller holds `lock`, or the pass is closing).

        Kept only while the dataset fits the page cache: with drop-behind its pages are evicted
        for good, and a map would only hold the address space.
        """
        mapped, f.map = f.map, None
        if mapped is not None:
            if self.readahead.drop_behind:
                mapped.close()
            else:
                self.kept_maps.put(path, f.ident, mapped)  # type: ignore[arg-type]  # made by acquire
        f.close()

    def close(self) -> None:
        """Close every file (a map still held by another pass stays for it), and the kept maps
        where they are this table's own; idempotent."""
        with self.lock:
            files = list(self._files.items())
            self._files.clear()
        for (_, path), f in files:
            self._close_file(path, f)
        if self._owns_kept_maps:
            self.kept_maps.close()
