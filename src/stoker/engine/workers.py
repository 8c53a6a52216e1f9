"""Worker processes for transforms that hold the GIL (`workers="process"`).

Reading and assembly stay on threads of the loader's process (they release the GIL); the
transform stage runs in worker processes. Batches travel in shared memory, never pickled:

- the loader's buffers are memfd regions (`SharedPool`): anonymous shared memory
  that never appears in `/dev/shm` and that the kernel frees when the last mapping and
  descriptor are gone, so nothing can leak there, whatever way the loader ends;
- a batch is sent as descriptors (`SCM_RIGHTS` over a Unix socket) plus a few bytes of
  layout; the worker maps them (keeping each mapping for the next batch the loader's pool
  puts in that region), runs the stage, writes outputs into memfd regions of its own and
  sends their descriptors back; an output that is an input unchanged is not copied;
- workers hold only the pickled transforms: no dataset, no file, no copy of anything that
  grows with the data (the per-worker duplication of pytorch#13246 cannot happen).

Workers are started with `spawn` (never `fork`: the loader's process has threads, and a
forked child could inherit a lock held by one of them), at the first batch, and stopped when
the pass ends, is closed, broken out of or dropped; a worker ignores SIGINT so that Ctrl-C
is handled once, by the loader's process, which then stops them. A worker that dies fails the
batch it held (`WorkerError`, raised in that batch's turn) and is replaced, so batches
before it are still delivered. Transforms must be picklable: built-ins, or functions defined
at module level.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..errors import SpecError, StokerError
from .executor import SHUTDOWN_SECONDS, AlignedPool, OrderedMap, StopFlag, Stopped, fork_generation

if TYPE_CHECKING:
    from ..io.files import Catalog
    from ..plan.batches import BatchPlan
    from .fusion import Stage

__all__ = ["ProcessExecutor", "SharedPool", "WorkerError", "require_linux"]

T = TypeVar("T")
R = TypeVar("R")
Batch = dict[str, np.ndarray]

# Messages are layouts and tracebacks, never array data; one datagram each.
_MAX_MESSAGE = 1 << 20
# An exception whose pickle is larger than this (one holding an array, say) comes back as text.
_MAX_PICKLED_ERROR = 64 << 10
# How long close() waits for the workers to exit by themselves before terminating them, all
# together (a Ctrl-C then reaches the caller within about this, see stoker.engine), and then for
# SIGTERM to end them before SIGKILL.
_JOIN_SECONDS = SHUTDOWN_SECONDS
_TERM_SECONDS = 1.0

# Live memfd regions of this process: start address -> (descriptor, bytes).
_REGIONS: dict[int, tuple[int, int]] = {}
_REGIONS_LOCK = threading.Lock()


class WorkerError(StokerError, RuntimeError):
    """A transform worker process died, or raised something that cannot be rebuilt here."""


class _RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (its `__cause__`)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _forget(address: int, fd: int) -> None:
    with _REGIONS_LOCK:
        _REGIONS.pop(address, None)
    os.close(fd)


def require_linux() -> None:
    """Refuse, before anything starts, where the batches' shared memory cannot be made: it is
    Linux's memfd (`os.memfd_create`), and passing its descriptors is Linux's too."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        raise SpecError(
            f"workers='process' needs Linux (it shares batches through os.memfd_create), and this is "
            f"{sys.platform!r}; use workers='thread' (the default) here"
        )


def _memfd_region(nbytes: int) -> mmap.mmap:
    """A fresh shared region; its descriptor is kept (for sending) until the region is unmapped."""
    require_linux()
    fd = os.memfd_create("stoker-batch", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    address = np.frombuffer(region, np.uint8, count=1).ctypes.data
    with _REGIONS_LOCK:
        _REGIONS[address] = (fd, nbytes)
    weakref.finalize(region, _forget, address, fd)
    return region


def _region_of(arr: np.ndarray) -> tuple[int, int] | None:
    """`(fd, bytes)` of the memfd region `arr` fills from its start, if it is one."""
    if not arr.flags.c_contiguous or arr.nbytes == 0:
        return None
    with _REGIONS_LOCK:
        found = _REGIONS.get(arr.ctypes.data)
    return found if found is not None and found[1] >= arr.nbytes else None


def _shared_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    return np.frombuffer(_memfd_region(nbytes), dtype=dtype, count=math.prod(shape)).reshape(shape)


class SharedPool(AlignedPool):
    """`AlignedPool` over memfd regions, which worker processes map by descriptor."""

    def _new_region(self, nbytes: int) -> object:
        return _memfd_region(nbytes)


def _describe_arrays(batch: Mapping[str, np.ndarray], keep: list[np.ndarray]) -> tuple[list[Any], list[int]]:
    """Layout and descriptors of a batch; arrays not already shared are copied into shared memory."""
    layout: list[Any] = []
    fds: list[int] = []
    for name, arr in batch.items():
        region = _region_of(arr)
        if region is None and arr.nbytes:
            copy = _shared_array(arr.shape, arr.dtype)
            np.copyto(copy, arr)
            keep.append(copy)
            region = _region_of(copy)
        if region is None:  # empty
            layout.append((name, -1, arr.shape, arr.dtype))
        else:
            layout.append((name, len(fds), arr.shape, arr.dtype))
            fds.append(region[0])
    return layout, fds


class _Mappings:
    """A worker's mappings of the loader's regions, kept by memfd inode for the next batch in them.

    The loader's pool recycles its buffers, so most batches arrive in regions this worker has
    mapped before. Mapping a region afresh costs a page fault per page touched (measured:
    benchmarks/results/transforms_history.md); a kept mapping costs one fstat. At most `limit` are kept, the least
    recently used dropped first (its memory is freed once the loader has dropped it too).
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.maps: OrderedDict[tuple[int, int], mmap.mmap] = OrderedDict()

    def get(self, fd: int, nbytes: int) -> mmap.mmap:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)  # an inode is never reused while a mapping holds it
        region = self.maps.get(key)
        if region is not None and len(region) >= nbytes:
            self.maps.move_to_end(key)
            return region
        region = mmap.mmap(fd, max(nbytes, st.st_size))
        self.maps[key] = region
        while len(self.maps) > self.limit:
            self.maps.popitem(last=False)  # unmapped when the last array on it is gone
        return region


def _map_arrays(layout: list[Any], fds: list[int], mappings: _Mappings | None = None) -> Batch:
    out: Batch = {}
    for name, i, shape, dtype in layout:
        if i < 0:
            out[name] = np.empty(shape, dtype)
            continue
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        region = mmap.mmap(fds[i], nbytes) if mappings is None else mappings.get(fds[i], nbytes)
        out[name] = np.frombuffer(region, dtype=dtype, count=count).reshape(shape)
    return out


def _serve(sock: socket.socket, stage_bytes: bytes, keep_mapped: int = 64) -> None:
    """A worker process: batches in, transformed batches out, until the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the loader's to handle
    stage: Stage = pickle.loads(stage_bytes)
    mappings = _Mappings(keep_mapped)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 256)
        except OSError:
            return
        if not msg:
            return
        reply: bytes
        out_fds: list[int] = []
        keep: list[np.ndarray] = []
        try:
            plan, layout, done = pickle.loads(msg)
            batch = _map_arrays(layout, fds, mappings)
            for fd in fds:
                os.close(fd)
            fds = []
            out = stage.run(batch, plan, _shared_array, done)
            same = [k for k, v in out.items() if batch.get(k) is v]
            produced = {k: v for k, v in out.items() if k not in same}
            out_layout, out_fds = _describe_arrays(produced, keep)
            keep.extend(produced.values())  # their descriptors must stay open until sent
            reply = pickle.dumps(("ok", same, out_layout))
            del batch, out, produced
        except BaseException as e:
            text = "".join(traceback.format_exception(e))
            pickled: bytes | None = None
            with contextlib.suppress(Exception):
                pickled = pickle.dumps(e)
            if pickled is not None and len(pickled) > _MAX_PICKLED_ERROR:
                pickled = None
            reply = pickle.dumps(("error", pickled, f"{type(e).__qualname__}: {e}", text))
        finally:
            for fd in fds:
                os.close(fd)
        try:
            socket.send_fds(sock, [reply], out_fds)
        except OSError:
            return
        finally:
            del keep  # the regions' descriptors close once their arrays are gone


class _Worker:
    def __init__(self, ctx: Any, stage_bytes: bytes, name: str, keep_mapped: int) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = ctx.Process(target=_serve, args=(child, stage_bytes, keep_mapped), name=name, daemon=True)
            self.process.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.sock = parent
        self.dead = False

    def call(self, batch: Batch, plan: BatchPlan, done: frozenset[str], closing: StopFlag) -> Batch:
        keep: list[np.ndarray] = []
        layout, fds = _describe_arrays(batch, keep)
        try:
            socket.send_fds(self.sock, [pickle.dumps((plan, layout, done))], fds)
            msg, rfds, _, _ = socket.recv_fds(self.sock, _MAX_MESSAGE, 256)
        except OSError as e:
            if closing.is_set():
                raise Stopped from e
            msg, rfds = b"", []
        del keep
        if not msg:
            if closing.is_set():
                raise Stopped
            self.dead = True
            self.process.join(1.0)
            raise WorkerError(
                f"transform worker process {self.process.pid} exited with code {self.process.exitcode} "
                f"while transforming batch {plan.index} of epoch {plan.epoch}"
            )
        try:
            reply = pickle.loads(msg)
            if reply[0] == "error":
                _, pickled, summary, text = reply
                error: BaseException | None = None
                if pickled is not None:
                    with contextlib.suppress(Exception):
                        error = pickle.loads(pickled)
                if error is None:
                    error = WorkerError(f"{summary} (raised in transform worker process {self.process.pid})")
                error.__cause__ = _RemoteTraceback(text)
                error.add_note(f"stoker: raised in transform worker process {self.process.pid}")
                raise error
            _, same, out_layout = reply
            out = _map_arrays(out_layout, rfds)
        finally:
            for fd in rfds:
                os.close(fd)
        return {**{k: batch[k] for k in same}, **out}

    def interrupt(self) -> None:
        """Wake a thread waiting on this worker; the worker sees the end of its input and exits."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        _stop([self])


class _Pool:
    """Worker processes, started at the first batch; each runs one batch at a time."""

    def __init__(self, processes: int, stage_bytes: bytes, context: str, *, keep_mapped: int = 64) -> None:
        self.processes = processes
        self.stage_bytes = stage_bytes
        self.context = context
        self.keep_mapped = keep_mapped
        self.workers: list[_Worker] = []
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self.closing = StopFlag()  # set by close(), which a Ctrl-C may interrupt (see stoker.engine)
        self._lock = threading.Lock()
        self._started = False

    def _start(self) -> None:
        with self._lock:
            if self._started or self.closing.is_set():
                return
            self._started = True
            ctx = multiprocessing.get_context(self.context)
            for i in range(self.processes):
                w = _Worker(ctx, self.stage_bytes, f"stoker-transform-{i}", self.keep_mapped)
                self.workers.append(w)
                self.idle.put(w)

    def run(self, batch: Batch, plan: BatchPlan, done: frozenset[str] = frozenset()) -> Batch:
        if not self._started:
            self._start()
        while True:
            if self.closing.is_set():
                raise Stopped
            try:
                worker = self.idle.get(timeout=0.1)
            except queue.Empty:
                continue
            if not worker.dead:
                break
        try:
            return worker.call(batch, plan, done, self.closing)
        finally:
            if worker.dead:
                self._replace(worker)
            else:
                self.idle.put(worker)

    def _replace(self, dead: _Worker) -> None:
        """A fresh worker for the batches after (or before) the one a worker died on."""
        with self._lock:
            if self.closing.is_set() or dead not in self.workers:
                return
            i = self.workers.index(dead)
            ctx = multiprocessing.get_context(self.context)
            fresh = _Worker(ctx, self.stage_bytes, f"stoker-transform-{i}", self.keep_mapped)
            self.workers[i] = fresh
        dead.close()
        self.idle.put(fresh)

    def interrupt(self) -> None:
        self.closing.set()
        with self._lock:
            workers = list(self.workers)
        for w in workers:
            w.interrupt()

    def close(self) -> None:
        self.interrupt()
        with self._lock:
            workers, self.workers = self.workers, []
        _stop(workers)


def _stop(workers: list[_Worker]) -> None:
    """End worker processes, waiting for all of them at once: told to stop (the end of their
    input), then SIGTERM for those still busy after _JOIN_SECONDS (a transform that does not
    return), then SIGKILL for any that ignores it."""
    for w in workers:
        w.interrupt()
    _join_all(workers, _JOIN_SECONDS)
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
    _join_all(workers, _TERM_SECONDS)
    for w in workers:
        if w.process.is_alive():  # pragma: no cover - ignores SIGTERM
            w.process.kill()
        w.process.join()
        w.process.close()
        w.sock.close()


def _join_all(workers: list[_Worker], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))


def _shutdown(state: Any, pool: _Pool) -> None:
    # Wake threads waiting on workers first, then join the threads, then reap the workers.
    if state.born != fork_generation():
        return  # a forked child's copy: shutting the sockets down would end the parent's workers
    state.stop.set()
    pool.interrupt()
    state.shutdown()
    pool.close()


class _ProcessMap(OrderedMap[R]):
    """An OrderedMap whose close (or garbage collection) also stops the worker processes."""

    def __init__(
        self, fn: Callable[[T], R], tasks: Iterable[T], *, threads: int, window: int, name: str, pool: _Pool,
        stop: StopFlag | None = None,
    ) -> None:  # fmt: skip
        super().__init__(fn, tasks, threads=threads, window=window, name=name, stop=stop)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, self._state, pool)  # type: ignore[call-arg, arg-type]


class ProcessExecutor:
    """Assembly on threads of this process; the transform stage in `processes` worker processes.

    `map_ordered(fn, ...)` expects `fn(task) -> (batch, plan)` (the loader's assembler
    writing into a `SharedPool`) and yields `(transformed batch, plan)` in task order.
    """

    resizable = False  # the processes are started with the map, one per worker, for its whole life

    def __init__(self, processes: int, stage: Stage, catalog: Catalog, *, context: str = "spawn") -> None:
        require_linux()
        if processes < 1:
            raise SpecError(f"{processes=} must be a positive integer")
        self.processes = processes
        self.threads = processes  # the Executor protocol's worker count
        self.stage = stage
        self.catalog = catalog
        self.context = context
        try:
            self._stage_bytes = pickle.dumps(stage)
        except Exception as e:
            bad = [fn for fn in stage.transforms if not _picklable(fn)]
            raise SpecError(
                f"workers='process' sends the transforms to worker processes by pickling, and "
                f"{bad or stage.transforms} cannot be pickled ({type(e).__name__}: {e}); define them at "
                "module level (not lambdas or nested functions), or use workers='thread'"
            ) from e

    def map_ordered(
        self, fn: Callable[[T], R], tasks: Iterable[T], *, window: int, defer_wake: bool = False,
        stop: StopFlag | None = None,
    ) -> OrderedMap[R]:  # fmt: skip
        """`defer_wake` is ignored: a result's wake-up leaves at once, since the next task
        may first wait on a worker process."""
        from .fusion import note_records

        # Regions a worker keeps mapped: every array of the batches in flight or pooled, with room.
        pool = _Pool(self.processes, self._stage_bytes, self.context, keep_mapped=4 * (window + self.processes + 2))
        stage, catalog = self.stage, self.catalog

        def work(task: T) -> Any:
            batch: Batch
            plan: BatchPlan
            batch, plan = fn(task)  # type: ignore[misc]
            try:
                return pool.run(batch, stage.light(plan), getattr(task, "fused", frozenset())), plan
            except Stopped:
                raise
            except BaseException as e:
                note_records(e, plan, catalog)
                raise

        # One more thread than workers: a batch is being read while every worker transforms.
        return _ProcessMap(
            work, tasks, threads=self.processes + 1, window=window, name="stoker-worker-p", pool=pool, stop=stop
        )


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True
