"""Raw files cut short while stoker reads them through memory maps (run by tests/test_kernels_map_faults.py).

Run in a child process, so that a SIGBUS shows as the child dying, not as the test run dying:

- ``scenario NAME DIR``: one pass in which the file about to be copied is truncated to 0 bytes
  right after stoker checked its size (its size check is wrapped to cut it), so the copy itself
  faults, on the read path NAME names; prints what the pass delivered and raised, as JSON.
- ``runs ORDER KIND COUNT DIR``: COUNT passes, each over fresh files that a thread truncates at a
  random moment of the pass to random sizes; prints how many passes ended whole, how many in a
  CorruptDataError, and every wrong thing seen, as JSON.

KIND ``nokernels`` runs as where the C kernels were not built (stoker.kernels._kernels = None).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import stoker
import stoker.engine.executor
import stoker.engine.fusion
import stoker.engine.gather
import stoker.engine.rawreads
import stoker.engine.records
import stoker.transforms
from stoker import kernels

GROUPS = 4


def without_kernels() -> None:
    kernels._kernels = None
    stoker.engine.executor._kernels = None  # type: ignore[attr-defined]
    stoker.engine.fusion._kernels = None


def values(groups: int, n: int) -> np.ndarray:
    """The value every element of record ``r`` of group ``g`` holds: ``values(...)[g, r]``."""
    return (np.arange(groups)[:, None] * 7919 + np.arange(n)[None, :] * 31) % 251 - 125


def write(d: str, groups: int, n: int, per: int, dtype: np.dtype) -> list[str]:
    os.makedirs(d)
    paths = [os.path.join(d, f"img_{g}.bin") for g in range(groups)]
    table = values(groups, n)
    for g, p in enumerate(paths):
        np.repeat(table[g].astype(dtype), per).tofile(p)
    return paths


def check(batch: dict[str, np.ndarray], table: np.ndarray, scale: float, bad: list[str]) -> int:
    want = table[batch["__group__"], batch["__index__"]] * scale
    if not (batch["image"].astype(np.float64) == want[:, None]).all():
        bad.append(f"wrong records among groups {batch['__group__'][:4]}, records {batch['__index__'][:4]}")
    return len(want)


def cut_after_check(victims: list[str], armed: threading.Event) -> None:
    """Wrap stoker's size checks so the first file checked once ``armed`` is cut to 0 bytes just after."""

    def cut(fd: int) -> None:
        if armed.is_set() and not victims:
            path = os.readlink(f"/proc/self/fd/{fd}")
            victims.append(path)
            os.truncate(path, 0)

    size, sizes = stoker.engine.rawreads.file_size, stoker.engine.rawreads.file_sizes
    # A raw read through a map checks the size before its copy and again after it (a cut inside a
    # page reads as zeros). Only a cut after the check before is the race under test: one after
    # the check after is found by the next read's check, never by a fault.
    after_copy = threading.local()

    def before_a_copy() -> bool:
        before = not getattr(after_copy, "next", False)
        after_copy.next = before
        return before

    def file_size(fd: int) -> int:
        now = size(fd)
        if before_a_copy():
            cut(fd)
        return now

    def file_sizes(fds: list[int]) -> list[int]:
        now = sizes(fds)
        if before_a_copy():
            cut(fds[0])
        return now

    def gather_sizes(fds: list[int]) -> list[int]:
        now = sizes(fds)
        cut(fds[0])
        return now

    acquire = stoker.engine.records.RecordReader._acquire  # maps the file and checks its size

    def acquired(self: Any, name: str, spec: Any, info: Any, local: Any) -> Any:
        m = acquire(self, name, spec, info, local)
        cut(m.fd)
        return m

    stoker.engine.rawreads.file_size = file_size  # type: ignore[assignment]
    stoker.engine.rawreads.file_sizes = file_sizes  # type: ignore[assignment]
    stoker.engine.gather.file_sizes = gather_sizes  # type: ignore[assignment]
    stoker.engine.records.RecordReader._acquire = acquired  # type: ignore[method-assign]


# name -> (dtype, records per file, loader keywords or None for ds.read)
SCENARIOS: dict[str, tuple[str, int, dict[str, Any] | None]] = {
    "one run, cast": ("int8", 400, {"cast": "float32"}),
    "many runs, cast": ("int8", 12, {"cast": "float32"}),
    "strided run, cast": ("int8", 400, {"cast": "float32", "shard": (0, 2)}),
    "one run, numpy's cast": ("int32", 400, {"cast": "float64"}),
    "one run, fused transform": ("int8", 400, {"transform": "normalize"}),
    "one run, fused Cast, numpy's cast": ("int32", 400, {"transform": "cast"}),
    "kept map, copy": ("int8", 400, {"epochs": 2, "prefetch": 1, "arm_after": 4 * 400 // 32}),  # cut in epoch 1
    "kept map, numpy's copy": ("int32", 400, {"epochs": 2, "prefetch": 1, "arm_after": 4 * 400 // 32}),
    "global shuffle, cast": ("int8", 100, {"cast": "float32", "shuffle": "global", "seed": 3}),
    "global shuffle, numpy's cast": ("int32", 100, {"cast": "float64", "shuffle": "global", "seed": 3}),
    "ds.read, cast": ("int8", 100, None),
    "ds.read, numpy's cast": ("int32", 100, None),
}


def scenario(name: str, root: str) -> dict[str, Any]:
    dtype, n, kw = SCENARIOS[name.removesuffix(", no kernels")]
    if name.endswith(", no kernels"):
        without_kernels()
    per = 2048 // np.dtype(dtype).itemsize
    paths = write(root, GROUPS, n, per, np.dtype(dtype))
    ds = stoker.Dataset(image=stoker.Field(os.path.join(root, "img_*.bin"), dtype, (per,)))
    table = values(GROUPS, n).astype(np.float64)
    victims: list[str] = []
    bad: list[str] = []
    got = 0
    armed = threading.Event()
    cut_after_check(victims, armed)
    arm_after = (kw or {}).get("arm_after", 0)
    if not arm_after:
        armed.set()
    try:
        if kw is None:
            got = len(ds.read(np.arange(0, len(ds), 7))["image"])
        else:
            kw = dict(kw)
            kw.pop("arm_after", None)
            scale = 1.0
            transform = kw.pop("transform", None)
            if transform == "normalize":
                kw["transform"] = [stoker.transforms.Normalize(2.0, 0.0, fields=["image"])]
                scale = 2.0
            elif transform == "cast":  # one Cast: done as the records are read (LoneCast)
                kw["transform"] = [stoker.transforms.Cast("float64", fields=["image"])]
            with ds.loader(32, with_index=True, threads=1, cycle_length=GROUPS, **kw) as loader:
                for k, batch in enumerate(loader):
                    got += check(batch, table, scale, bad)
                    if k + 1 == arm_after:
                        armed.set()
        error: BaseException | None = None
    except BaseException as e:
        error = e
    return {
        "delivered": got,
        "bad": bad,
        "victim": victims[0] if victims else None,
        "paths": paths,
        "error": None if error is None else type(error).__name__,
        "message": str(error),
        "path": getattr(error, "path", None),
        "cause": None if error is None else type(error.__cause__).__name__,
        "fault": faulted(error),
    }


def faulted(error: BaseException | None) -> bool:
    """Whether a MapFault is in ``error``'s chain (a batch assembled with others is read again
    alone after an error, and that second read fails at its size check)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kernels.MapFault):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def runs(order: str, kind: str, count: int, root: str) -> dict[str, Any]:
    if kind == "nokernels":
        without_kernels()
    groups, n, record = GROUPS, 256, 16384
    modes = ["cast", "numpy"] if kind == "nokernels" else ["cast", "copy", "fused", "numpy"]
    rng = random.Random(1)
    summary: dict[str, Any] = {"runs": 0, "whole": 0, "corrupt": 0, "faults": 0, "bad": []}

    def one(d: str, mode: str, cut: Callable[[list[str]], None] | None) -> tuple[int, int, Any, list[str], list[str]]:
        dtype = np.dtype("int32" if mode == "numpy" else "int8")
        per = record // dtype.itemsize
        paths = write(d, groups, n, per, dtype)
        ds = stoker.Dataset(image=stoker.Field(os.path.join(d, "img_*.bin"), dtype, (per,)))
        table = values(groups, n).astype(np.float64)
        kw: dict[str, Any] = {"shuffle": "global", "seed": 7} if order == "global" else {}
        if mode == "fused":
            kw["transform"] = [stoker.transforms.Normalize(2.0, 0.0, fields=["image"])]
        elif mode != "copy":
            kw["cast"] = "float64" if mode == "numpy" else "float32"
        epochs = 2 if mode == "copy" else 1  # copy: the second epoch copies from the maps kept from the first
        got, bad = 0, []
        cutter = threading.Thread(target=cut, args=(paths,), daemon=True) if cut else None
        error = None
        with ds.loader(32, epochs=epochs, with_index=True, threads=2, **kw) as loader:
            if cutter is not None:
                cutter.start()
            try:
                for batch in loader:
                    got += check(batch, table, 2.0 if mode == "fused" else 1.0, bad)
            except stoker.CorruptDataError as e:
                error = e
        if cutter is not None:
            cutter.join()
        return got, epochs * groups * n, error, bad, paths

    for k in range(count):
        mode = modes[k % len(modes)]
        start = time.perf_counter()
        one(os.path.join(root, f"whole{k}"), mode, None)
        span = time.perf_counter() - start  # a pass, writing its files included
        delay, sizes = rng.uniform(0, span), [rng.randrange(0, n * record) for _ in range(groups)]

        def cut(paths: list[str], delay: float = delay, sizes: list[int] = sizes) -> None:
            time.sleep(delay)
            for p, size in zip(paths, sizes, strict=True):
                os.truncate(p, size)

        got, total, error, bad, paths = one(os.path.join(root, f"cut{k}"), mode, cut)
        summary["runs"] += 1
        summary["bad"] += [f"pass {k} ({mode}): {b}" for b in bad]
        if error is None:
            summary["whole"] += 1
            if got != total:
                summary["bad"].append(f"pass {k} ({mode}): {got} of {total} records and no error")
        else:
            summary["corrupt"] += 1
            summary["faults"] += faulted(error)
            if error.path not in paths or os.path.basename(error.path) not in str(error):
                summary["bad"].append(f"pass {k} ({mode}): the error names {error.path!r}: {error}")
    return summary


if __name__ == "__main__":
    if sys.argv[1] == "scenario":
        print(json.dumps(scenario(sys.argv[2], sys.argv[3])))
    else:
        print(json.dumps(runs(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])))
