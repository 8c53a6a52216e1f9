"""Threads, buffers and prefetch: runs the plan's batches in parallel, delivers them in order.

Two small interfaces live here so later work plugs in rather than bolts on:

- an `Allocator` hands out batch buffers (aligned now; pinned or shared memory later);
- an `Executor` maps a function over tasks with bounded look-ahead and delivers
  results in task order (threads now; worker processes later).

The engine never decides *what* is read: that is the plan's. Whatever the thread count or
look-ahead, the sequence delivered is the same, and an error is raised at the position of
the task that failed, after every earlier result has been delivered.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import math
import mmap
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from ..errors import ForkedPassError
from ..kernels import _kernels

__all__ = [
    "ALIGNMENT", "AlignedPool", "Allocator", "Executor", "OrderedMap", "StopFlag", "Stopped", "ThreadExecutor",
    "fork_generation", "forked_pass", "run_finalizer",
]  # fmt: skip

T = TypeVar("T")
R = TypeVar("R")

# TensorFlow takes DLPack tensors zero-copy only from 64-byte aligned memory (less aligned
# numpy buffers fall back to a much slower copy). Page alignment covers it.
ALIGNMENT = 64


class Stopped(Exception):
    """Raised inside a worker when the loader is closing; never reaches the user."""


class Allocator(Protocol):
    """Hands out writable buffers; a buffer is reused only after every array on it is gone."""

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray: ...

    def clear(self) -> None:
        """Forget pooled buffers (the pass is over); arrays still held stay valid."""
        ...


# Pool regions this large are advised to use transparent huge pages (before first touch).
# Where the kernel compacts memory for huge pages only on advice (THP defrag "madvise", as
# here), unadvised regions got none (/proc/self/smaps_rollup: AnonHugePages 0), and every
# 4 KiB of a batch's output was its own TLB entry (measured: benchmarks/results/w1_history.md).
HUGE_PAGE_MIN_BYTES = 2 << 20

# Worker threads lower their own scheduling priority by this much (Linux: per thread, via
# setpriority on the thread id; lowering needs no privilege). The consumer, and threads
# the training framework wakes per batch, then take a core the moment they become
# runnable instead of queueing behind a worker mid-copy; workers still get every cycle
# nobody else wants: TF's executor threads hop per batch, and each hop waited a scheduler
# slice (measured: benchmarks/results/tf_compare_history.md). `STOKER_WORKER_NICE=0` turns it off.
WORKER_NICE = int(os.environ.get("STOKER_WORKER_NICE", "8"))


class AlignedPool:
    """Page-aligned buffers, recycled LIFO once the caller has dropped every view of them.

    A LIFO free list hands back the buffer most recently released, whose pages are most
    likely still in cache. Bytes kept for reuse never exceed `max_pooled_bytes`.

    A dropped array is noticed by a weak reference whose callback is a C function (a deque's
    append), so no Python code runs in the thread that drops it: Python reports a Ctrl-C that
    lands inside a Python finalizer as "Exception ignored" and never raises it, and the
    consumer drops a batch every step. The buffers noticed are taken back at the next
    `array()`, in a worker.
    """

    def __init__(self, max_pooled_bytes: int) -> None:
        self.max_pooled_bytes = max_pooled_bytes
        self._free: dict[int, list[object]] = {}
        self._pooled = 0
        self._lock = threading.Lock()
        self._closed = False
        self._out: dict[int, tuple[weakref.ref[object], object, int]] = {}  # id(ref) -> (ref, region, nbytes)
        self._dropped: collections.deque[weakref.ref[object]] = collections.deque()
        self._on_drop = self._dropped.append  # one bound method for every weak reference
        self.allocated = 0  # fresh regions created (for tests and stats)

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        # On every batch, for every field: one lock round where the pool has the region.
        used = math.prod(shape) * dtype.itemsize
        nbytes = used or 1
        with self._lock:
            if self._dropped:
                self._take_back()
            free = self._free.get(nbytes)
            region = free.pop() if free else None
            if region is not None:
                self._pooled -= nbytes
                arr = self._track(region, nbytes)
        if region is None:
            region = self._new_region(nbytes)
            self.allocated += 1
            with self._lock:
                arr = self._track(region, nbytes)
        if used != nbytes:
            arr = arr[:used]
        return arr.view(dtype).reshape(shape)

    def _track(self, region: object, nbytes: int) -> np.ndarray:
        """A uint8 array over `region`, noticed when dropped (caller holds the lock)."""
        arr = self._as_array(region, nbytes)
        # `arr.base` is an object made for this array alone (numpy's memoryview of the
        # region); every view of `arr` keeps it alive, so its death means no array on the
        # region is left anywhere.
        base: object = arr.base
        ref = weakref.ref(base, self._on_drop)
        if not self._closed:
            self._out[id(ref)] = (ref, region, nbytes)
        return arr

    def _new_region(self, nbytes: int) -> object:
        """A fresh region of `nbytes`; subclasses supply other memory (pinned, shared).

        Private anonymous memory: a process forked from this one (a DataLoader worker, say)
        writes to its own copy, never into our batches; it costs nothing against shared memory
        (measured: benchmarks/results/w1_history.md). Large regions are advised to use huge pages (see
        HUGE_PAGE_MIN_BYTES).
        """
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if nbytes >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # advice only
                region.madvise(mmap.MADV_HUGEPAGE)
        return region

    def _as_array(self, region: object, nbytes: int) -> np.ndarray:
        """A uint8 array over the region whose `.base` is created anew for each call."""
        return np.frombuffer(region, dtype=np.uint8, count=nbytes)  # type: ignore[call-overload]

    def _take_back(self) -> None:
        """Pool the regions whose arrays have all been dropped (caller holds the lock)."""
        while self._dropped:
            entry = self._out.pop(id(self._dropped.popleft()), None)
            if entry is None:
                continue
            _, region, nbytes = entry
            if self._pooled + nbytes <= self.max_pooled_bytes:
                self._free.setdefault(nbytes, []).append(region)
                self._pooled += nbytes
            # Otherwise the region is dropped: unmapped once the last reference goes.

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._out.clear()
            self._dropped.clear()
            self._pooled = 0
            self._closed = True


class Executor(Protocol):
    """Maps `fn` over `tasks` with at most `window` results ahead of the consumer.

    `threads`: the workers that run `fn` at once; where `resizable`, the loader's autotune
    sets it between passes and adds or retires workers of a running map (OrderedMap's
    `add_worker` / `retire_worker`).
    """

    threads: int
    resizable: bool

    def map_ordered(
        self, fn: Callable[[T], R], tasks: Iterable[T], *, window: int, defer_wake: bool = False,
        stop: StopFlag | None = None,
    ) -> OrderedMap[R]:  # fmt: skip
        """`defer_wake`: `fn` gives the GIL up in a kernel early in each task, or calls
        `flush_wake` before it blocks; the consumer's wake-up for a result then leaves
        with the worker's next kernel call (see `OrderedMap`). An executor may ignore it.
        `stop`: the flag the map sets when it closes (a new one if None), so work built
        before the map (the assembler's waits on stream turns) watches it."""
        ...


class ThreadExecutor:
    """Worker threads that pull tasks in order and hand results back in order."""

    resizable = True  # autotune climbs the worker count

    def __init__(self, threads: int, *, name: str = "stoker-worker") -> None:
        self.threads = threads
        self.name = name

    def map_ordered(
        self, fn: Callable[[T], R], tasks: Iterable[T], *, window: int, defer_wake: bool = False,
        stop: StopFlag | None = None,
    ) -> OrderedMap[R]:  # fmt: skip
        return OrderedMap(
            fn, tasks, threads=self.threads, window=window, name=self.name, defer_wake=defer_wake, stop=stop
        )


class StopFlag:
    """Set once, read without a lock.

    `threading.Event.set` is Python code that takes a Condition: a Ctrl-C landing inside it
    can leave that Condition's lock held by the main thread and the flag unset. Setting this is
    one store, so whatever interrupts a close() after it, every worker sees it.
    """

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def check(self) -> None:
        """Raise Stopped once set (for waits that look at the flag between their steps)."""
        if self._set:
            raise Stopped


# How often a worker waiting for room in the window looks at the stop flag and its OrderedMap:
# the bound on how long a worker outlives a close() that a Ctrl-C cut short.
WAIT_SECONDS = 0.1
# How long a close() (a Ctrl-C, a break) waits for workers to finish their task. A worker still
# busy then, stuck in a system call (a hung network mount) or a slow transform, is named in a
# warning and left running as the daemon thread it is; it closes the pass's files when it returns.
SHUTDOWN_SECONDS = 2.0
# Most results the consumer is woken for at once (see _State.work): more per wake-up leaves
# workers waiting on a full window (measured: benchmarks/results/w1_history.md).
MAX_PER_WAKE = 4


def run_finalizer(finalizer: weakref.finalize) -> None:
    """Run `finalizer`'s callback now, keeping it armed until the callback has returned.

    `weakref.finalize.__call__` disarms first: an exception (a Ctrl-C) inside the callback
    would leave nothing to finish the job. Here a later close(), or the garbage collector,
    runs the (idempotent) callback again.
    """
    info = finalizer.peek()
    if info is None:
        return
    _, func, args, kwargs = info
    func(*args, **(kwargs or {}))
    finalizer.detach()


class _LockWake:
    """The consumer's wake-up where the compiled kernels are missing: a plain lock, released to wake."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def post(self) -> None:
        with contextlib.suppress(RuntimeError):  # released already: one wake-up is pending
            self._lock.release()

    post_later = post

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=timeout)


def _new_wake() -> object:
    """The consumer's wake-up: the compiled kernels' Signal where built (see `post_later`)."""
    if _kernels is not None:
        with contextlib.suppress(OSError):  # no unnamed semaphores on this system
            return _kernels.Signal()
    return _LockWake()


def _lower_priority() -> None:
    """Lower the calling thread's priority by `WORKER_NICE` (where the platform has per-thread nice)."""
    if WORKER_NICE > 0 and hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:  # relative to the process (its main thread), so a worker's own threads do not compound it
            target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + WORKER_NICE)
            tid = threading.get_native_id()
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except OSError:  # a sandbox that forbids it: run at the inherited priority
            pass


def flush_wake() -> None:
    """Send this thread's deferred wake-up now (before it blocks on anything but a kernel)."""
    if _kernels is not None:
        _kernels.flush()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_forks = 0  # fork()s between this process and the one that imported stoker


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def fork_generation() -> int:
    """How many fork()s lie between this process and the one that imported stoker: work begun
    at another generation belongs to an ancestor, and its threads did not come along."""
    return _forks


def forked_pass(started_in: int) -> ForkedPassError:
    """The error for a pass (begun in process `started_in`) iterated in a child forked from it."""
    return ForkedPassError(
        f"this pass was started in process {started_in}, and this process ({os.getpid()}) is a fork of it, "
        "which has none of the pass's worker threads (or processes), so it would wait for ever; the parent's "
        "pass goes on unharmed. In the child, make a new loader with dataset.loader(...) and iterate that "
        "(or fork before the first next(), or use a start method other than fork)"
    )


class _State(Generic[T, R]):
    """What the workers share; held apart from the iterator so dropping it can stop them.

    Ctrl-C: Python raises KeyboardInterrupt in the main thread, at any bytecode, and only there.
    So the main thread (the consumer, close(), autotune) touches this state only through steps
    an interrupt cannot split: `with lock` on a plain Lock (acquired and released in C),
    posting `arrived` (C code), one store to `stop`, `_thread.start_new_thread`. It never enters a
    threading.Condition: its `__enter__` and `wait` are Python code that a KeyboardInterrupt
    can leave holding the lock (an interrupt lands there often), after
    which every worker would block on it forever. It never calls
    Thread.start either (which waits on an Event the same way). Workers, which never see a
    KeyboardInterrupt, start the threads, leave by themselves once `stop` is set or their
    OrderedMap is gone, and the last one out runs the cleanups (closing files).
    """

    def __init__(
        self, fn: Callable[[T], R], tasks: Iterator[T], window: int, name: str, defer_wake: bool, stop: StopFlag
    ) -> None:
        self.fn = fn
        self.defer_wake = defer_wake
        self.tasks = tasks
        self.window = window
        self.name = name
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)  # the window has room: workers wait here
        self.waiting = 0  # workers waiting on `space` (the consumer notifies only when one is)
        # Posted by a worker when the result the consumer waits for arrives.
        self.arrived: Any = _new_wake()
        self.results: dict[int, R | _Failure] = {}
        self.dispatched = 0
        self.delivered = 0
        self.exhausted = False
        self.stop = stop
        self.owner: Callable[[], object] = lambda: True  # the OrderedMap, weakly (set by it)
        self.threads: list[threading.Thread] = []  # every worker ever started; shutdown joins them all
        self.running = 0  # workers registered and not yet exited
        self.launching = 0  # launchers still starting workers
        self.retire = 0  # workers asked to exit (autotune lowering the thread count)
        self.cleanups: list[Callable[[], None]] = []
        self.doing: dict[str, object] = {}  # worker thread name -> the task it runs (named if it outlives close)
        self.warned = False  # workers left behind by a close were named in a warning
        self.born, self.pid = _forks, os.getpid()  # a forked child has none of the threads: it must not wait on them

    def signal(self) -> None:
        """Wake the consumer now (a wake-up already pending makes this a no-op)."""
        self.arrived.post()

    def launch(self, n: int) -> None:
        """Start `n` workers; runs on a thread started with `_thread`, never the main thread."""
        with self.lock:
            self.launching += 1
        try:
            for _ in range(n):
                with self.lock:
                    if self.stop.is_set() or self.exhausted:
                        return
                    t = threading.Thread(target=self._run, name=f"{self.name}-{len(self.threads)}", daemon=True)
                    self.threads.append(t)
                    self.running += 1
                try:
                    t.start()
                except BaseException as e:  # no thread to be had (limits): fail at the next result
                    e.add_note(f"stoker: while starting worker thread {t.name}")
                    with self.lock:
                        self.threads.remove(t)
                        self.running -= 1
                        if not self.running:
                            self.results[self.dispatched] = _Failure(e)
                            self.dispatched += 1
                            self.exhausted = True
                        self.signal()
                    return
        finally:
            with self.lock:
                self.launching -= 1
                todo = self._last_out()
            self._clean(todo)

    def _run(self) -> None:
        _lower_priority()
        try:
            self.work()
        finally:
            flush_wake()
            with self.lock:
                self.running -= 1
                todo = self._last_out()
            self._clean(todo)

    def _last_out(self) -> list[Callable[[], None]]:
        """The cleanups for the last worker out of a closing map to run (caller holds the lock)."""
        if self.running or self.launching or not self.stop.is_set():
            return []
        todo, self.cleanups = self.cleanups, []
        return todo

    @staticmethod
    def _clean(todo: list[Callable[[], None]]) -> None:
        for fn in todo:
            fn()

    def _leaving(self) -> bool:
        if self.stop.is_set():
            return True
        if self.owner() is None:  # the OrderedMap is gone and its close never completed
            self.stop.set()
            return True
        return False

    def work(self) -> None:
        lock = self.lock
        while True:
            with lock:
                # A full window: wait until it has room for as many results as the consumer
                # takes per wake-up (see OrderedMap.__next__), then fill it in one go.
                full = self.dispatched - self.delivered >= self.window
                while (
                    full and not self._leaving() and not self.exhausted and not self.retire
                    and self.window - (self.dispatched - self.delivered) < self._per_wake()
                ):  # fmt: skip
                    flush_wake()
                    self.waiting += 1
                    try:
                        self.space.wait(WAIT_SECONDS)
                    finally:
                        self.waiting -= 1
                if self._leaving() or self.exhausted:
                    return
                if self.retire:
                    self.retire -= 1
                    return
                seq = self.dispatched
                try:
                    task = next(self.tasks)
                except StopIteration:
                    self.exhausted = True
                    self.space.notify_all()
                    self.signal()
                    return
                except BaseException as e:  # a planning error belongs to this position
                    e.add_note(f"stoker: raised while planning result {seq}")
                    self.exhausted = True
                    self.results[seq] = _Failure(e)
                    self.dispatched += 1
                    self.space.notify_all()
                    self.signal()
                    return
                self.dispatched += 1
                me = threading.current_thread().name
                self.doing[me] = task
            result: R | _Failure
            try:
                result = self.fn(task)
            except Stopped:
                return
            except BaseException as e:
                e.add_note(f"stoker: raised in thread {threading.current_thread().name} on {task!r}")
                result = _Failure(e)
            finally:
                flush_wake()  # the previous result's wake-up waits no longer than this task
            with lock:
                self.doing.pop(me, None)
                self.results[seq] = result
                # The consumer is woken once the result it waits for (d) is here and so are the
                # ones after it up to what the window holds beyond one task per worker (or
                # nothing more is in flight, or d failed). A consumer that outpaces the workers
                # then takes several results per wake-up, and each wake-up costs both sides a
                # sleep and a GIL hand-off, while every worker still has a slot to fill as it
                # sleeps. Taking more than that room leaves workers waiting on a full window
                # (measured: benchmarks/results/w1_history.md).
                # A worker on the last of them wakes it when done.
                # With defer_wake, the wake-up leaves when this thread next gives the GIL up in
                # a kernel (the next batch's copy), so the consumer wakes to a free GIL instead
                # of waking to wait for it (stoker/_kernels.c, Signal): one sleep per batch
                # instead of two or three.
                # The map's first result is the exception: the consumer has nothing to work on
                # yet, so it goes at once. Held for the three after it, a pass's first batch came
                # a few batches late, dead time for a consumer slower than the workers (a training step),
                # which never waits again once its first batch is in hand; paid once per pass
                # (per epoch in PyTorch's and Keras' loops).
                d = self.delivered
                if d in self.results and (
                    d == 0
                    or isinstance(self.results[d], _Failure)
                    or all(k in self.results for k in range(d + 1, min(d + self._per_wake(), self.dispatched)))
                ):
                    if self.defer_wake:
                        self.arrived.post_later()
                    else:
                        self.signal()
            # Drop our references now: a batch must be recyclable as soon as its caller lets go.
            del task, result

    def _left_behind(self, alive: list[threading.Thread]) -> None:
        """Warn, once, that the workers `alive` outlived a close and run on as daemon threads."""
        with self.lock:
            if self.warned:
                return
            self.warned = True
            doing = {t.name: self.doing.get(t.name) for t in alive}
        busy = "; ".join(f"{name} on {task!r}" if task is not None else name for name, task in doing.items())
        warnings.warn(
            f"stoker: {len(alive)} worker thread(s) of {self.name} still busy {SHUTDOWN_SECONDS:g} s after "
            f"the loader was closed, left running as daemon threads: {busy}. Each is stuck in a system call "
            "(a hung file system?) or a slow transform; it closes the pass's files when it returns.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _per_wake(self) -> int:
        """Results the consumer takes per wake-up (caller holds the lock): the window less one
        task per worker, at most `MAX_PER_WAKE`."""
        return max(1, min(MAX_PER_WAKE, self.window - (self.running - self.retire)))

    def shutdown(self) -> None:
        """Stop and join every worker, then release what they hold.

        Idempotent, and a later call finishes what an interrupted one left: the first step
        is one store to `stop`, after which the workers leave by themselves. Workers still
        busy after `SHUTDOWN_SECONDS` are named in a warning and left to finish (see there).
        """
        if self.born != _forks:
            return  # a forked child's copy: the workers, their lock and their cleanups are the parent's
        self.stop.set()
        with self.lock:
            self.space.notify_all()
        self.signal()
        me = threading.current_thread()
        interrupted: BaseException | None = None
        deadline = time.monotonic() + SHUTDOWN_SECONDS
        while True:
            with self.lock:
                alive = [t for t in self.threads if t is not me and t.is_alive()]
                launching = self.launching
            if not alive and not launching:
                break
            if time.monotonic() >= deadline:
                self._left_behind(alive)
                break
            for t in alive:
                # A Ctrl-C during close must not leave workers behind: go on joining (each
                # worker is at most one task from leaving), up to the deadline, then raise it.
                try:
                    t.join(max(0.0, deadline - time.monotonic()))
                except KeyboardInterrupt as e:
                    interrupted = e
            if launching and not alive:
                time.sleep(0.001)
        with self.lock:
            self.results.clear()
        close = getattr(self.tasks, "close", None)
        if close is not None:
            # ValueError: "generator already executing" in a worker that is exiting.
            with contextlib.suppress(ValueError):
                close()
        while True:  # what no worker was left to run (none started, or all had finished)
            with self.lock:
                if self.running or self.launching or not self.cleanups:
                    break
                fn = self.cleanups[0]
            fn()  # taken off the list only once done: an interrupted one runs again (they are idempotent)
            with self.lock:
                if self.cleanups and self.cleanups[0] is fn:
                    self.cleanups.pop(0)
        if interrupted is not None:
            try:
                raise interrupted
            finally:  # no cycle through this frame keeping the exception, and what it holds, alive
                interrupted = None


class OrderedMap(Generic[R]):
    """Iterator over `fn(task)` in task order; a context manager with idempotent close()."""

    def __init__(
        self,
        fn: Callable[[T], R],
        tasks: Iterable[T],
        *,
        threads: int,
        window: int,
        name: str,
        defer_wake: bool = False,
        stop: StopFlag | None = None,
    ) -> None:
        if threads < 1 or window < 1:
            raise ValueError(f"{threads=} and {window=} must be positive")
        flag = StopFlag() if stop is None else stop
        self._state: _State[T, R] = _State(fn, iter(tasks), window, name, defer_wake, flag)
        self._state.owner = weakref.ref(self)
        self._threads = threads
        self._name = name
        self._started = False
        self._closed = False
        self._finalizer = weakref.finalize(self, self._state.shutdown)

    @property
    def stop(self) -> StopFlag:
        """Set when the map is closing; work that waits on something should watch it."""
        return self._state.stop

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Run idempotent `fn` at close, once every worker has left (by the last one out, or by close())."""
        st = self._state
        with st.lock:
            st.cleanups.append(fn)

    def _start(self) -> None:
        # Threads start at the first next(), never at construction: safe to build before fork.
        self._state.born, self._state.pid = _forks, os.getpid()  # the threads' process owns the map
        self._started = True
        _thread.start_new_thread(self._state.launch, (self._threads,))

    def add_worker(self) -> None:
        """Start one more worker (autotune); what is delivered, and its order, do not change."""
        st = self._state
        with st.lock:
            if self._closed or st.stop.is_set() or not self._started:
                return
        _thread.start_new_thread(st.launch, (1,))

    def retire_worker(self) -> None:
        """Ask one worker to exit once its current task is done (autotune)."""
        st = self._state
        with st.lock:
            st.retire += 1
            st.space.notify_all()

    def set_window(self, window: int) -> None:
        """Results allowed ahead of the consumer from now on (autotune, within the memory budget)."""
        st = self._state
        with st.lock:
            st.window = max(1, window)
            st.space.notify_all()

    def __iter__(self) -> OrderedMap[R]:
        return self

    def __next__(self) -> R:
        if self._state.born != _forks and self._started:
            raise forked_pass(self._state.pid)
        if self._closed:
            raise StopIteration
        if not self._started:
            self._start()
        st = self._state
        while True:
            with st.lock:
                result = st.results.pop(st.delivered, None)
                if result is not None:
                    st.delivered += 1
                    # Workers waiting for room are woken once the window has room for as many
                    # results as the consumer takes per wake-up (and they wait for that much room,
                    # see _State.work), not at every result taken: a consumer slower than the
                    # workers (a TensorFlow step, small records) paid a worker's wake-up on every
                    # batch (a futex wake, and an interrupt to the other core on a VM), and the
                    # woken worker did one task and slept again (measured:
                    # benchmarks/results/tf_compare_history.md). Condition.notify is Python code:
                    # skipped on most batches.
                    if st.waiting and st.window - (st.dispatched - st.delivered) >= st._per_wake():
                        st.space.notify()
                    break
                over = (st.exhausted and st.delivered >= st.dispatched) or (
                    not st.running and not st.launching and (st.exhausted or st.stop.is_set())
                )
            if over:
                break
            st.arrived.wait(0.5)
        if result is None:
            self.close()
            raise StopIteration
        if isinstance(result, _Failure):
            self.close()
            raise result.error
        return result

    def close(self) -> None:
        """Stop the workers and release what they hold; safe to call more than once."""
        self._closed = True
        self._state.stop.set()
        run_finalizer(self._finalizer)

    def __enter__(self) -> OrderedMap[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
