"""Loaders whose work gets stuck (run by tests/engine/test_executor_shutdown.py in a child process).

- ``interrupt DIR HOW WORKERS``: iterates a loader whose transform never returns (HOW: ``sleep``
  in Python, or ``read`` blocked in a system call on a pipe nobody writes to), printing
  ``iterating`` first; the parent then sends SIGINT. Prints ``KeyboardInterrupt`` once it
  reaches this code, and exits.
- ``fifo DIR KIND``: a file of a group not opened yet (raw, or gzip with KIND ``gzip``) is
  replaced by a FIFO while a loader reads, as a hung mount would hold an open; prints the error
  the pass ends in, as JSON.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from typing import Any

import numpy as np

import stoker

# A pipe nobody writes to, made before the loader's workers start (process workers inherit nothing
# of it: they block in their own read of a pipe of their own).
_PIPE: list[int] = []


def sleep_forever(batch: dict[str, Any], rng: Any) -> dict[str, Any]:
    time.sleep(3600)
    return batch


def read_forever(batch: dict[str, Any], rng: Any) -> dict[str, Any]:
    if not _PIPE:
        _PIPE.extend(os.pipe())
    os.read(_PIPE[0], 1)
    return batch


def interrupt(root: str, how: str, workers: str) -> None:
    os.makedirs(root)
    for g in range(2):
        np.zeros((64, 16), np.int8).tofile(os.path.join(root, f"img_{g}.bin"))
    ds = stoker.Dataset(image=stoker.Field(os.path.join(root, "img_*.bin"), "int8", (16,)))
    fn = sleep_forever if how == "sleep" else read_forever
    try:
        with ds.loader(8, transform=[fn], workers=workers, threads=2) as loader:
            it = iter(loader)
            print("iterating", flush=True)
            next(it)
        print("a batch came", flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)


def fifo(root: str, kind: str) -> dict[str, Any]:
    os.makedirs(root)
    suffix = ".bin.gz" if kind == "gzip" else ".bin"
    paths = [os.path.join(root, f"img_{g}{suffix}") for g in range(3)]
    for g, p in enumerate(paths):
        data = np.full((40, 16), g, np.int8).tobytes()
        with open(p, "wb") as f:
            f.write(gzip.compress(data) if kind == "gzip" else data)
    ds = stoker.Dataset(image=stoker.Field(os.path.join(root, f"img_*{suffix}"), "int8", (16,)))
    got = 0
    error: BaseException | None = None
    with ds.loader(10, cycle_length=1, threads=1, prefetch=1) as loader:
        it = iter(loader)
        got += len(next(it)["image"])  # group 0 is being read; group 2 is not open yet
        os.unlink(paths[2])
        os.mkfifo(paths[2])  # opening it for reading would wait for a writer forever
        try:
            for batch in it:
                got += len(batch["image"])
        except stoker.StokerError as e:
            error = e
    path = getattr(error, "path", None)
    return {"delivered": got, "error": type(error).__name__, "message": str(error), "path": path}


if __name__ == "__main__":
    if sys.argv[1] == "interrupt":
        interrupt(*sys.argv[2:5])
    else:
        print(json.dumps(fifo(*sys.argv[2:4])))
