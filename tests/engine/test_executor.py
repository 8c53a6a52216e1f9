"""OrderedMap / ThreadExecutor ordering and errors; AlignedPool alignment and reuse."""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import time

import numpy as np
import pytest

from stoker import kernels
from stoker.engine import executor as engine
from stoker.engine.executor import ALIGNMENT, AlignedPool, OrderedMap, ThreadExecutor
from tests.helpers.resources import stoker_threads, vm_flags, wait_no_stoker_threads


def _jitter(x: int) -> int:
    time.sleep(random.Random(x).random() * 0.003)
    return x * x


@pytest.mark.parametrize("threads", [1, 2, 4, 8])
@pytest.mark.parametrize("window", [1, 3, 16])
def test_results_come_in_task_order(threads: int, window: int) -> None:
    with ThreadExecutor(threads).map_ordered(_jitter, range(60), window=window) as results:
        assert list(results) == [x * x for x in range(60)]


class Boom(Exception):
    pass


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("k", [0, 1, 7, 29])
def test_error_in_fn_is_raised_after_all_earlier_results(threads: int, k: int) -> None:
    def fn(x: int) -> int:
        if x == k:
            raise Boom(f"task {x}")
        return _jitter(x)

    got = []
    with pytest.raises(Boom, match=f"task {k}"):
        for r in ThreadExecutor(threads).map_ordered(fn, range(40), window=4):
            got.append(r)
    assert got == [x * x for x in range(k)]


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("k", [0, 3, 12])
def test_error_while_producing_task_k_is_raised_at_position_k(threads: int, k: int) -> None:
    def tasks():
        for i in range(30):
            if i == k:
                raise Boom(f"planning {i}")
            yield i

    got = []
    with pytest.raises(Boom, match=f"planning {k}"):
        for r in ThreadExecutor(threads).map_ordered(_jitter, tasks(), window=5):
            got.append(r)
    assert got == [x * x for x in range(k)]


def test_look_ahead_never_exceeds_the_window() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def fn(x: int) -> int:
        with lock:
            started.append(x)
        return x

    m = OrderedMap(fn, range(100), threads=4, window=3, name="stoker-worker")
    try:
        assert next(m) == 0
        time.sleep(0.1)
        assert max(started) <= 3  # delivered 1, at most 3 more ahead
        assert list(m) == list(range(1, 100))
    finally:
        m.close()


def test_a_worker_waiting_on_a_full_window_refills_it_in_bursts_not_one_task_per_result() -> None:
    """Behind a slow consumer, a worker waits until the window has room for a consumer's wake-up's
    worth of results (min(MAX_PER_WAKE, window - workers)) and then starts them back to back."""
    window, n = 6, 30
    per_wake = min(engine.MAX_PER_WAKE, window - 1)
    delivered_at_start: dict[int, int] = {}

    def fn(x: int) -> int:
        delivered_at_start[x] = m._state.delivered  # results the consumer had when task x began
        return x

    with OrderedMap(fn, range(n), threads=1, window=window, name="stoker-worker") as m:
        got = []
        for r in m:
            got.append(r)
            time.sleep(0.03)  # slower than the worker: the window is full whenever we come back
    assert got == list(range(n))
    seen = delivered_at_start
    # The first task to find the window full starts only once `per_wake` results are taken.
    assert seen[window] >= per_wake, seen
    # The rest start in bursts: a few distinct "results taken" values among them (one per
    # wake-up, a late one or a result taken mid-burst on a loaded machine adding one), not one
    # per task as when each result taken woke the worker.
    assert len({seen[x] for x in range(window, n)}) <= (n - window) // per_wake + 3, seen


def test_threads_start_at_first_next_not_at_construction() -> None:
    m = ThreadExecutor(3).map_ordered(_jitter, range(10), window=2)
    try:
        assert stoker_threads() == []
        assert next(m) == 0
        assert len(stoker_threads()) >= 1
    finally:
        m.close()
    assert wait_no_stoker_threads() == []


def test_close_is_idempotent_and_stops_the_threads() -> None:
    m = ThreadExecutor(4).map_ordered(_jitter, iter(range(10**6)), window=4)
    next(m)
    m.close()
    m.close()
    assert wait_no_stoker_threads() == []
    with pytest.raises(StopIteration):
        next(m)


def test_dropping_an_unfinished_map_stops_its_threads() -> None:
    m = ThreadExecutor(4).map_ordered(_jitter, iter(range(10**6)), window=4)
    next(m)
    del m
    gc.collect()
    assert wait_no_stoker_threads() == []


def _my_nice(_: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_workers_run_at_a_lower_priority_than_the_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer (and whatever the framework wakes per batch) preempts a worker mid-copy, not the reverse."""
    assert int(os.environ.get("STOKER_WORKER_NICE", "8")) == engine.WORKER_NICE
    monkeypatch.setattr(engine, "WORKER_NICE", 5)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ThreadExecutor(3).map_ordered(_my_nice, range(30), window=4) as m:
        nices = set(m)
    assert nices == {min(19, base + engine.WORKER_NICE)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller's own is untouched


def test_a_worker_started_by_a_worker_is_not_lowered_twice() -> None:
    def nested(_: int) -> int:
        with ThreadExecutor(1).map_ordered(_my_nice, range(2), window=1) as inner:
            return max(inner)

    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    with ThreadExecutor(1).map_ordered(nested, range(2), window=1) as m:
        assert set(m) == {min(19, base + engine.WORKER_NICE)}


def test_bad_threads_or_window_raise() -> None:
    with pytest.raises(ValueError):
        OrderedMap(_jitter, [], threads=0, window=1, name="x")
    with pytest.raises(ValueError):
        OrderedMap(_jitter, [], threads=1, window=0, name="x")


def test_empty_tasks_give_no_results() -> None:
    assert list(ThreadExecutor(2).map_ordered(_jitter, [], window=2)) == []


# -- AlignedPool --------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "dtype"), [((3,), "uint8"), ((7, 5), "float32"), ((0,), "int64"),
                                              ((2, 3, 4), "float64"), ((1,), "bool")])  # fmt: skip
def test_pool_arrays_are_64_byte_aligned_and_writable(shape, dtype) -> None:
    pool = AlignedPool(1 << 20)
    arr = pool.array(shape, np.dtype(dtype))
    assert arr.shape == shape and arr.dtype == np.dtype(dtype)
    assert arr.ctypes.data % ALIGNMENT == 0 and ALIGNMENT == 64
    arr[...] = 1
    assert type(arr) is np.ndarray


@pytest.mark.parametrize("nbytes", [4096, 16 << 20])
def test_a_forked_process_writing_to_a_pool_array_never_changes_ours(nbytes: int) -> None:
    pool = AlignedPool(64 << 20)
    arr = pool.array((nbytes,), np.dtype(np.uint8))
    arr[:] = 1
    pid = os.fork()
    if pid == 0:  # the child (a DataLoader worker, say) writes to its copy and leaves at once
        arr[:] = 7
        os._exit(0 if int(arr[-1]) == 7 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(arr.min()) == 1 and int(arr.max()) == 1


def test_pool_reuses_a_buffer_only_after_every_view_is_dropped() -> None:
    pool = AlignedPool(1 << 20)
    a = pool.array((1000,), np.dtype(np.float32))
    addr = a.ctypes.data
    view = a[10:20]
    a[:] = 1.5
    del a
    gc.collect()
    b = pool.array((1000,), np.dtype(np.float32))  # a view is alive: must not reuse
    assert b.ctypes.data != addr
    b[:] = -1
    assert np.all(view == 1.5)
    del view
    gc.collect()
    c = pool.array((1000,), np.dtype(np.float32))
    assert c.ctypes.data == addr  # every view gone: recycled
    assert pool.allocated == 2


def test_pool_keeps_no_more_than_max_pooled_bytes() -> None:
    pool = AlignedPool(0)
    a = pool.array((100,), np.dtype(np.uint8))
    del a
    gc.collect()
    pool.array((100,), np.dtype(np.uint8))
    assert pool.allocated == 2


def test_cleared_pool_keeps_live_arrays_valid_and_pools_nothing() -> None:
    pool = AlignedPool(1 << 20)
    a = pool.array((10,), np.dtype(np.int32))
    a[:] = 7
    pool.clear()
    assert np.all(a == 7)
    del a
    gc.collect()
    pool.array((10,), np.dtype(np.int32))
    assert pool.allocated == 2


def test_dropping_a_pool_array_runs_no_python_code() -> None:
    """Python reports a Ctrl-C landing in a finalizer as "Exception ignored" and never raises it;
    the consumer drops a batch every step, so that drop must run no Python code."""
    pool = AlignedPool(1 << 20)
    a = pool.array((100,), np.dtype(np.float32))
    calls: list[str] = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        del a
    finally:
        sys.setprofile(None)
    assert calls == []
    pool.array((100,), np.dtype(np.float32))
    assert pool.allocated == 1  # recycled all the same


def test_the_consumer_side_of_an_ordered_map_runs_no_python_locking_code() -> None:
    """A Ctrl-C lands in the main thread at any bytecode: threading's Python code that takes a lock
    (Condition, Event, Thread.start waiting on one) could be left holding it, and every worker with it."""
    entered: set[str] = set()

    def profile(frame: object, event: str, arg: object) -> None:
        code = frame.f_code  # type: ignore[attr-defined]
        if event == "call" and code.co_filename == threading.__file__:
            entered.add(code.co_name)

    om = ThreadExecutor(2).map_ordered(_jitter, range(200), window=3)
    sys.setprofile(profile)
    try:
        got = [next(om) for _ in range(50)]
        om.add_worker()
        om.set_window(5)
        got += [next(om) for _ in range(50)]
        om.retire_worker()
        got += [next(om) for _ in range(50)]
        om.close()
    finally:
        sys.setprofile(None)
    assert got == [_jitter(i) for i in range(150)]
    assert not entered & {"__enter__", "__exit__", "wait", "wait_for", "set", "start", "_acquire_restore"}, entered
    assert wait_no_stoker_threads() == []


def _copy_then_square(x: int) -> int:
    """A task that gives the GIL up in a kernel first, as the loader's assembler does."""
    src = np.full(1 << 17, x % 100, np.int8)
    dst = np.empty(src.shape, np.float32)
    kernels.cast_into(dst, src)
    assert dst[-1] == x % 100
    return _jitter(x)


@pytest.mark.parametrize("compiled", [True, False], ids=["signal", "lock-fallback"])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_deferred_wake_ups_deliver_every_result_in_order(
    monkeypatch: pytest.MonkeyPatch, compiled: bool, threads: int
) -> None:
    if not compiled:
        monkeypatch.setattr(engine, "_kernels", None)  # as where the C kernels were not built
    with ThreadExecutor(threads).map_ordered(_copy_then_square, range(80), window=3, defer_wake=True) as results:
        assert isinstance(results._state.arrived, engine._LockWake) is (not compiled or not kernels.compiled())
        assert list(results) == [x * x for x in range(80)]
    assert wait_no_stoker_threads() == []


def test_a_deferred_wake_up_waits_at_most_for_the_next_task_of_its_worker() -> None:
    """With defer_wake, result 0's wake-up leaves with the worker's next kernel call; a task with
    none sends it when it ends, so the consumer is not left to its 0.5 s poll."""
    release = threading.Event()

    def fn(x: int) -> int:
        if x == 1:
            release.wait(5)  # blocks in Python: no kernel gives the GIL up
            time.sleep(0.05)
        return x

    with ThreadExecutor(1).map_ordered(fn, range(3), window=4, defer_wake=True) as results:
        t = time.perf_counter()
        threading.Timer(0.1, release.set).start()
        assert next(results) == 0
        waited = time.perf_counter() - t
    # Result 0 arrives when task 1 ends (~0.15 s), not at the consumer's 0.5 s poll.
    assert 0.1 <= waited < 0.45, waited


def test_a_result_wakes_the_consumer_at_once_when_nothing_after_it_is_in_flight() -> None:
    """A ready result waits for the next one only while another worker is on it (one wake-up for
    both); with nothing after it in flight it is delivered at once."""

    def fn(x: int) -> int:
        if x == 1:
            time.sleep(0.6)  # dispatched only once task 0 is published: one worker
        return x

    with ThreadExecutor(1).map_ordered(fn, range(3), window=4) as results:
        t = time.perf_counter()
        assert next(results) == 0
        assert time.perf_counter() - t < 0.4  # neither task 1's 0.6 s nor the 0.5 s poll
        assert list(results) == [1, 2]


def test_a_ready_result_waits_at_most_for_the_one_in_flight_after_it() -> None:
    done = threading.Event()

    def fn(x: int) -> int:
        if x == 2:
            done.wait(5)
            time.sleep(0.1)
        return x

    with ThreadExecutor(2).map_ordered(fn, range(6), window=4) as results:
        assert next(results) == 0
        threading.Timer(0.05, done.set).start()
        t = time.perf_counter()
        assert next(results) == 1
        assert time.perf_counter() - t < 0.4  # task 2's end wakes it, not the 0.5 s poll
        assert list(results) == [2, 3, 4, 5]


@pytest.mark.parametrize("defer_wake", [False, True], ids=["at-once", "deferred"])
def test_the_first_result_goes_at_once_though_later_ones_are_in_flight(defer_wake: bool) -> None:
    """The consumer has nothing before its first result, so it is not held for the ones after
    it: here task 1 ends only once result 0 has been taken, which the 0.5 s poll would find."""
    taken, started = threading.Event(), threading.Event()

    def fn(x: int) -> int:
        if x == 0:
            started.wait(5)  # task 1 is in flight when result 0 lands
        if x == 1:
            started.set()
            taken.wait(5)
        return x

    with ThreadExecutor(2).map_ordered(fn, range(6), window=4, defer_wake=defer_wake) as results:
        t = time.perf_counter()
        assert next(results) == 0
        waited = time.perf_counter() - t
        taken.set()
        assert list(results) == [1, 2, 3, 4, 5]
    assert waited < 0.4, waited


def test_large_pool_buffers_are_advised_to_use_huge_pages_and_small_ones_are_not() -> None:
    pool = AlignedPool(max_pooled_bytes=64 << 20)
    big = pool.array((4 << 20,), np.dtype(np.uint8))
    small = pool.array((1 << 20,), np.dtype(np.uint8))
    assert "hg" in vm_flags(big.ctypes.data)
    assert "hg" not in vm_flags(small.ctypes.data)
    big[:] = 1  # still plain, private, writable memory
    assert int(big.sum()) == 4 << 20
