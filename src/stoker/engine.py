"""Threads, buffers and prefetch: runs the plan's batches in parallel, delivers them in order.

Two small interfaces live here so later work plugs in rather than bolts on:

- an :class:`Allocator` hands out batch buffers (aligned now; pinned or shared memory later);
- an :class:`Executor` maps a function over tasks with bounded look-ahead and delivers
  results in task order (threads now; worker processes later).

The engine never decides *what* is read: that is the plan's. Whatever the thread count or
look-ahead, the sequence delivered is the same, and an error is raised at the position of
the task that failed, after every earlier result has been delivered.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

import numpy as np

__all__ = ["ALIGNMENT", "AlignedPool", "Allocator", "Executor", "OrderedMap", "Stopped", "ThreadExecutor"]

T = TypeVar("T")
R = TypeVar("R")

# TensorFlow takes DLPack tensors zero-copy only from 64-byte aligned memory (measured:
# 16-byte aligned numpy buffers fall back to a copy ~30x slower). Page alignment covers it.
ALIGNMENT = 64


class Stopped(Exception):
    """Raised inside a worker when the loader is closing; never reaches the user."""


class Allocator(Protocol):
    """Hands out writable buffers; a buffer is reused only after every array on it is gone."""

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray: ...

    def clear(self) -> None:
        """Forget pooled buffers (the pass is over); arrays still held stay valid."""
        ...


class AlignedPool:
    """Page-aligned buffers, recycled LIFO once the caller has dropped every view of them.

    A LIFO free list hands back the buffer most recently released, whose pages are most
    likely still in cache. Bytes kept for reuse never exceed ``max_pooled_bytes``.
    """

    def __init__(self, max_pooled_bytes: int) -> None:
        self.max_pooled_bytes = max_pooled_bytes
        self._free: dict[int, list[object]] = {}
        self._pooled = 0
        self._lock = threading.Lock()
        self._closed = False
        self.allocated = 0  # fresh regions created (for tests and stats)

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        used = math.prod(shape) * dtype.itemsize
        nbytes = max(1, used)
        with self._lock:
            free = self._free.get(nbytes)
            region = free.pop() if free else None
            if region is not None:
                self._pooled -= nbytes
        if region is None:
            region = self._new_region(nbytes)
            self.allocated += 1
        arr = self._as_array(region, nbytes)
        # ``arr.base`` is an object made for this array alone (numpy's memoryview of the
        # region); every view of ``arr`` keeps it alive, so its death means no array on the
        # region is left anywhere.
        done = weakref.finalize(arr.base, self._release, region, nbytes)
        done.atexit = False  # at exit the arrays may still be alive; the OS reclaims the memory
        return arr[:used].view(dtype).reshape(shape)

    def _new_region(self, nbytes: int) -> object:
        """A fresh region of ``nbytes``; subclasses supply other memory (pinned, shared)."""
        return mmap.mmap(-1, nbytes)

    def _as_array(self, region: object, nbytes: int) -> np.ndarray:
        """A uint8 array over the region whose ``.base`` is created anew for each call."""
        return np.frombuffer(region, dtype=np.uint8, count=nbytes)  # type: ignore[call-overload]

    def _release(self, region: object, nbytes: int) -> None:
        with self._lock:
            if not self._closed and self._pooled + nbytes <= self.max_pooled_bytes:
                self._free.setdefault(nbytes, []).append(region)
                self._pooled += nbytes
        # Otherwise the region is dropped: unmapped once the last reference goes.

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._pooled = 0
            self._closed = True


class Executor(Protocol):
    """Maps ``fn`` over ``tasks`` with at most ``window`` results ahead of the consumer."""

    def map_ordered(self, fn: Callable[[T], R], tasks: Iterable[T], *, window: int) -> OrderedMap[R]: ...


class ThreadExecutor:
    """Worker threads that pull tasks in order and hand results back in order."""

    def __init__(self, threads: int, *, name: str = "stoker-worker") -> None:
        self.threads = threads
        self.name = name

    def map_ordered(self, fn: Callable[[T], R], tasks: Iterable[T], *, window: int) -> OrderedMap[R]:
        return OrderedMap(fn, tasks, threads=self.threads, window=window, name=self.name)


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _State(Generic[T, R]):
    """What the workers share; held apart from the iterator so dropping it can stop them."""

    def __init__(self, fn: Callable[[T], R], tasks: Iterator[T], window: int) -> None:
        self.fn = fn
        self.tasks = tasks
        self.window = window
        lock = threading.Lock()
        self.cond = threading.Condition(lock)  # a result arrived: the consumer waits here
        self.space = threading.Condition(lock)  # the window has room: workers wait here
        self.results: dict[int, R | _Failure] = {}
        self.dispatched = 0
        self.delivered = 0
        self.exhausted = False
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.retire = 0  # workers asked to exit (autotune lowering the thread count)

    def work(self) -> None:
        cond = self.cond
        while True:
            with cond:
                while (
                    not self.stop.is_set() and not self.exhausted and not self.retire
                    and self.dispatched - self.delivered >= self.window
                ):  # fmt: skip
                    self.space.wait()
                if self.stop.is_set() or self.exhausted:
                    return
                if self.retire:
                    self.retire -= 1
                    return
                seq = self.dispatched
                try:
                    task = next(self.tasks)
                except StopIteration:
                    self.exhausted = True
                    cond.notify_all()
                    self.space.notify_all()
                    return
                except BaseException as e:  # a planning error belongs to this position
                    e.add_note(f"stoker: raised while planning result {seq}")
                    self.exhausted = True
                    self.results[seq] = _Failure(e)
                    self.dispatched += 1
                    cond.notify_all()
                    self.space.notify_all()
                    return
                self.dispatched += 1
            result: R | _Failure
            try:
                result = self.fn(task)
            except Stopped:
                return
            except BaseException as e:
                e.add_note(f"stoker: raised in thread {threading.current_thread().name} on {task!r}")
                result = _Failure(e)
            with cond:
                self.results[seq] = result
                cond.notify()
            # Drop our references now: a batch must be recyclable as soon as its caller lets go.
            del task, result

    def shutdown(self) -> None:
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
            self.space.notify_all()
        me = threading.current_thread()
        interrupted: BaseException | None = None
        for t in self.threads:
            while t is not me and t.is_alive():
                # A Ctrl-C during close must not leave workers behind: finish joining, then raise it.
                try:
                    t.join()
                except KeyboardInterrupt as e:
                    interrupted = e
        with self.cond:
            self.results.clear()
        close = getattr(self.tasks, "close", None)
        if close is not None:
            # ValueError: "generator already executing" in a worker that is exiting.
            with contextlib.suppress(ValueError):
                close()
        if interrupted is not None:
            raise interrupted


class OrderedMap(Generic[R]):
    """Iterator over ``fn(task)`` in task order; a context manager with idempotent close()."""

    def __init__(self, fn: Callable[[T], R], tasks: Iterable[T], *, threads: int, window: int, name: str) -> None:
        if threads < 1 or window < 1:
            raise ValueError(f"{threads=} and {window=} must be positive")
        self._state: _State[T, R] = _State(fn, iter(tasks), window)
        self._threads = threads
        self._name = name
        self._started = False
        self._closed = False
        self._finalizer = weakref.finalize(self, self._state.shutdown)

    @property
    def stop(self) -> threading.Event:
        """Set when the map is closing; work that waits on something should watch it."""
        return self._state.stop

    def _start(self) -> None:
        # Threads start at the first next(), never at construction: safe to build before fork.
        self._started = True
        for i in range(self._threads):
            t = threading.Thread(target=self._state.work, name=f"{self._name}-{i}", daemon=True)
            self._state.threads.append(t)
            t.start()

    def add_worker(self) -> None:
        """Start one more worker (autotune); what is delivered, and its order, do not change."""
        st = self._state
        with st.cond:
            if self._closed or st.stop.is_set() or not self._started:
                return
            t = threading.Thread(target=st.work, name=f"{self._name}-{len(st.threads)}", daemon=True)
            st.threads.append(t)
        t.start()

    def retire_worker(self) -> None:
        """Ask one worker to exit once its current task is done (autotune)."""
        st = self._state
        with st.cond:
            st.retire += 1
            st.space.notify_all()

    def set_window(self, window: int) -> None:
        """Results allowed ahead of the consumer from now on (autotune, within the memory budget)."""
        st = self._state
        with st.cond:
            st.window = max(1, window)
            st.space.notify_all()

    def __iter__(self) -> OrderedMap[R]:
        return self

    def __next__(self) -> R:
        if self._closed:
            raise StopIteration
        if not self._started:
            self._start()
        st = self._state
        with st.cond:
            while st.delivered not in st.results:
                if st.exhausted and st.delivered >= st.dispatched:
                    break
                idle = not any(t.is_alive() for t in st.threads)
                if idle and st.delivered not in st.results and (st.exhausted or st.stop.is_set()):
                    break
                st.cond.wait(0.5)
            result = st.results.pop(st.delivered, None)
            if result is not None:
                st.delivered += 1
                st.space.notify()
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
        self._finalizer()

    def __enter__(self) -> OrderedMap[R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
