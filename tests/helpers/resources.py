"""What a test holds and must release: stoker's worker threads, open files, memory maps, batch
buffers; and ``consume``, an iteration that fails the test instead of hanging the suite."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

import stoker

# stoker threads alive when the current test began (hung by an earlier failed test): not ours.
BASELINE: set[threading.Thread] = set()


class Allocations:
    """The buffers an allocator handed out: ``address in`` it is True for any address inside one
    (a batch assembled with others is a view into theirs, see stoker.engine.budget.COALESCE_BYTES);
    ``len()`` counts the distinct buffers."""

    def __init__(self) -> None:
        self.spans: dict[int, int] = {}  # start -> end

    def add(self, arr: np.ndarray) -> None:
        self.spans[arr.ctypes.data] = arr.ctypes.data + arr.nbytes

    def __contains__(self, address: object) -> bool:
        return isinstance(address, int) and any(a <= address < e for a, e in self.spans.items())

    def __len__(self) -> int:
        return len(self.spans)


def record_allocations(loader: stoker.Loader) -> Allocations:
    """Make ``loader`` record every buffer its allocator hands out; returns the record it fills."""
    addresses = Allocations()
    make = loader.allocator

    class Recording:
        def __init__(self, pooled: int) -> None:
            self.inner = make(pooled)

        def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            out = self.inner.array(shape, dtype)
            addresses.add(out)
            return out

        def clear(self) -> None:
            self.inner.clear()

    loader.use_allocator(Recording)
    return addresses


def stoker_threads() -> list[threading.Thread]:
    """stoker worker threads started by the current test and still alive."""
    return [t for t in threading.enumerate() if t.name.startswith("stoker-worker") and t not in BASELINE]


def wait_no_stoker_threads(timeout: float = 5.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    if not stoker_threads():  # the common case: skip gc.collect(), costly once TF/torch are loaded
        return []
    while True:
        gc.collect()
        alive = stoker_threads()
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def open_paths(under: Path) -> list[str]:
    """Files under ``under`` this process holds open (from /proc/self/fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(under)):
            out.append(target)
    return out


def mapped_paths(under: Path) -> list[str]:
    """Files under ``under`` this process has memory-mapped, once per mapping (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n").startswith(str(under)):
                out.append(parts[5].rstrip("\n"))
    return out


def consume(iterable: Iterable, timeout: float = 20.0) -> tuple[list, BaseException | None]:
    """Iterate in a helper thread: (items delivered, the error raised or None).

    Fails the test, instead of hanging the suite, when no item and no error comes for ``timeout``s.
    """
    got: list = []
    box: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            for item in iterable:
                got.append(item)
        except BaseException as e:
            box["error"] = e
        else:
            box["error"] = None

    t = threading.Thread(target=run, name="test-consumer", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"hung: {len(got)} batches delivered, then neither a batch nor an error for {timeout}s")
    return got, box["error"]


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
