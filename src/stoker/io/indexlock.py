"""Who may write an index directory, and which of its windows files readers still use.

Writers take `.stoker-index.lock` in the index directory (`flock`, exclusive, one open file per
writer, so threads of one process exclude each other too) from before their first windows file
to after their last removal: a second writer waits up to `WRITE_WAIT` seconds, then fails with a
WriteError naming the directory and the holder, and never interleaves with the first.

Readers keep the build they opened: a Dataset that took seek points from an index holds a
shared POSIX record lock (`lockf`) on `.stoker-index.readers` from before it reads the index
until it is garbage collected (one lock per process and directory, shared by its Datasets),
and lists in this process the windows files its points name (`Pin`). A writer removes a windows
file no entry names any more only when no other process holds that lock (tried without
waiting) and no Dataset of its own process names the file; otherwise the file stays on disk
until a later index write finds it unused. POSIX record locks never conflict within one
process, which is why this process's readers are counted by name instead; they are not
inherited through fork, which is why a forked child takes its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

from ..errors import WriteError

__all__ = ["READERS_LOCK", "WRITER_LOCK", "WRITE_WAIT", "Pin", "pin", "removing", "writing"]

WRITER_LOCK = ".stoker-index.lock"
READERS_LOCK = ".stoker-index.readers"
# How long a writer waits for another writer of the same index directory: indexing a large
# dataset takes minutes, and a writer that waits for ever hides a stuck one.
WRITE_WAIT = 600.0
_POLL = (0.01, 0.5)  # first and longest sleep between tries of a held writer lock


def _holder(fd: int) -> str:
    try:
        said = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        said = ""
    return said or "a writer that has not said who it is"


@contextlib.contextmanager
def _exclusive(home: str, wait: float) -> Iterator[None]:
    path = os.path.join(home, WRITER_LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except PermissionError:  # another user's lock file in a directory both may write: flock needs no write access
        fd = _open_lock_read_only(path, home)
    except OSError as e:
        raise WriteError(f"cannot open the index lock {path!r} ({e.strerror or e})", path=home) from e
    held = False
    try:
        deadline = time.monotonic() + wait
        pause = _POLL[0]
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise WriteError(
                        f"index directory {home!r} is being written by another index writer ({_holder(fd)}, "
                        f"per {path!r}); waited {wait:g}s for it. Let it finish, or wait longer with `stoker index "
                        "--wait SECONDS` or write_index(..., wait=SECONDS)",
                        path=home,
                    ) from None
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, _POLL[1])
        held = True
        with contextlib.suppress(OSError):  # who holds it, for a writer that gives up waiting to name
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        if held:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)  # releases the flock


def _open_lock_read_only(path: str, home: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise WriteError(f"cannot open the index lock {path!r} ({e.strerror or e})", path=home) from e


@contextlib.contextmanager
def writing(homes: Iterable[str], *, wait: float = WRITE_WAIT) -> Iterator[None]:
    """Hold the writer lock of every index directory in `homes` (taken in sorted order, so two
    writers of overlapping sets never wait on each other in a cycle)."""
    with contextlib.ExitStack() as stack:
        for home in sorted(set(homes)):
            stack.enter_context(_exclusive(home, wait))
        yield


class _Home:
    """This process's shared lock on one directory's readers file, and the Pins that need it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pins: weakref.WeakSet[Pin] = weakref.WeakSet()
        self.users = 0  # live Pins plus writers checking right now: the fd closes at zero


_homes: dict[str, _Home] = {}
_guard = threading.RLock()  # reentrant: a Pin's finalizer may run in the middle of a guarded section


def _open_readers(home: str, *, create: bool) -> int | None:
    path = os.path.join(home, READERS_LOCK)
    flags = getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT if create else 0)
    for mode in (os.O_RDWR, os.O_RDONLY):  # read-only: data another user indexed still gets its pin
        try:
            return os.open(path, mode | flags, 0o666)
        except OSError:
            continue
    return None


class Pin:
    """The windows files of one index directory that a Dataset's seek points name: kept on disk,
    against writers of any process, while the Pin lives. Pickled, it pins again where it lands."""

    def __init__(self, home: str, home_lock: _Home | None) -> None:
        self.home = home
        self.names: frozenset[str] = frozenset()
        self._home = home_lock
        self.held = home_lock is not None  # False: nothing to hold there (see `pin`)
        if home_lock is not None:
            home_lock.pins.add(self)
            weakref.finalize(self, _unuse, home, home_lock)

    def __reduce__(self) -> tuple[object, ...]:
        return (_repin, (self.home, self.names))


def _repin(home: str, names: frozenset[str]) -> Pin:
    p = pin(home)
    p.names = names
    return p


def _unuse(home: str, h: _Home) -> None:
    with _guard:
        h.users -= 1
        if h.users == 0 and _homes.get(home) is h:
            del _homes[home]
            os.close(h.fd)  # the process's last fd on the file: its record lock goes with it


def pin(home: str) -> Pin:
    """A Pin of index directory `home`, taken before its index is read (names are set once it
    is); without the readers file (an index written by an older stoker, or storage nobody can
    write) the Pin holds nothing, as nothing there can remove a windows file either."""
    with _guard:
        h = _homes.get(home)
        if h is None:
            create = os.path.exists(os.path.join(home, ".stoker-index.json"))
            fd = _open_readers(home, create=create)
            if fd is None:
                return Pin(home, None)
            try:
                fcntl.lockf(fd, fcntl.LOCK_SH)  # waits only while a writer removes files
            except OSError:
                os.close(fd)
                return Pin(home, None)
            h = _homes[home] = _Home(fd)
        h.users += 1
        return Pin(home, h)


@contextlib.contextmanager
def removing(home: str) -> Iterator[frozenset[str] | None]:
    """While held, with no reader of another process: the windows files this process's Datasets
    name in `home` (the caller removes the others); None when another process reads there.
    The caller holds the writer lock of `home`."""
    with _guard:
        h = _homes.get(home)
        if h is not None:
            h.users += 1
            fd = h.fd
        else:
            opened = _open_readers(home, create=True)
            if opened is None:
                yield None
                return
            fd = opened
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # from this process's shared lock, atomically
            except OSError:
                yield None  # another process holds it shared: it may use any of them
                return
            try:
                pins = list(h.pins) if h is not None else []
                yield frozenset().union(*(p.names for p in pins))
            finally:
                fcntl.lockf(fd, fcntl.LOCK_SH if h is not None else fcntl.LOCK_UN)
        finally:
            if h is not None:
                _unuse(home, h)
            else:
                os.close(fd)


def _before_fork() -> None:
    _guard.acquire()


def _after_fork_in_parent() -> None:
    _guard.release()


def _after_fork_in_child() -> None:
    global _guard
    _guard = threading.RLock()
    for h in _homes.values():
        with contextlib.suppress(OSError):
            fcntl.lockf(h.fd, fcntl.LOCK_SH)  # record locks stay with the parent: the child takes its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)  # fmt: skip
