"""Transforms on W1: their cost against no transform, and process workers for GIL-bound ones.

W1 is the seed's layout (16 pairs x 4096 records of 128x128 int8 + gzip float32 labels,
batch 256). Contenders, each in a fresh process, alternated round by round:

- ``none``: float32 images (``cast={"image": "float32"}``), no transform: the baseline;
- ``normalize+flip``: ``Normalize(mean=-0.5, std=127.5)`` (int8 -> float32 in [-1, 1]) and
  ``RandomFlip`` left-right, fused into assembly (the compiled one-pass kernel);
- ``normalize+flip numpy``: the same without the compiled kernel (its pure-numpy fallback);
- ``cast float16`` / ``cast bfloat16``: ``cast={"image": ...}``; ``Cast float16`` / ``Cast bfloat16``: the
  ``Cast`` transform alone; ``normalize+flip float16`` / ``bfloat16``: normalize+flip with a
  trailing ``Cast`` (mixed-precision inputs);
- ``python thread xN`` / ``python process xN``: a GIL-bound pure-Python transform (a loop
  over 1,024 values of each frame) on N worker threads or N worker processes;
- ``wait process xN``: a transform that sleeps 20 ms (no CPU): whether N workers overlap.

Timing starts after a few batches (two per worker and two more: worker processes take a
moment to spawn, and all of them must be up). Writes the
medians and the per-round ratios (normalize+flip / none, process x2 / process x1, ...), and
records per CPU-second of the loader's process and its workers (from /proc): on a machine
whose cores are taken by other work, throughput cannot grow with workers, but this shows
whether a worker's share of the work costs the same. The load average before and after the
rounds is written with the figures.

    python benchmarks/transforms.py [--rounds 5] [--seconds 3] [--only "python process x1,python process x2"]
                                    [--out benchmarks/results] [--name transforms]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from typing import Any

import numpy as np

import stoker
import stoker.engine.fusion as fusion
from harness import (
    add_out_argument,
    alternate,
    cached_sample,
    child_json,
    default_cache,
    median_of,
    ratio_table,
    summary_table,
    write_results,
)
from stoker.transforms import Cast, Normalize, RandomFlip

PYTHON_VALUES = 1024  # values of each frame the GIL-bound transform loops over


def python_checksum(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Pure Python per record: holds the GIL the whole time (what process workers are for)."""
    flat = batch["image"].reshape(len(batch["image"]), -1)
    sums = np.empty(len(flat), np.int64)
    for i, rec in enumerate(flat):
        acc = 0
        for v in rec[:PYTHON_VALUES].tolist():
            acc = (acc * 31 + v) & 0xFFFF
        sums[i] = acc
    return {**batch, "checksum": sums}


def wait_20ms(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Needs no CPU: shows whether the workers overlap at all, whatever the machine's load."""
    time.sleep(0.02)
    return batch


CONTENDERS: dict[str, dict[str, Any]] = {
    "none": {"cast": {"image": "float32"}},
    "normalize+flip": {"transform": "normalize+flip"},
    "normalize+flip numpy": {"transform": "normalize+flip", "kernel": False},
    "cast float16": {"cast": {"image": "float16"}},
    "cast bfloat16": {"cast": {"image": "bfloat16"}},
    "Cast float16": {"transform": "cast float16"},
    "Cast bfloat16": {"transform": "cast bfloat16"},
    "normalize+flip float16": {"transform": "normalize+flip float16"},
    "normalize+flip bfloat16": {"transform": "normalize+flip bfloat16"},
    "python thread x2": {"transform": "python", "workers": "thread", "threads": 2},
    "python process x1": {"transform": "python", "workers": "process", "threads": 1},
    "python process x2": {"transform": "python", "workers": "process", "threads": 2},
    "wait process x1": {"transform": "wait", "workers": "process", "threads": 1},
    "wait process x2": {"transform": "wait", "workers": "process", "threads": 2},
}


def child(name: str, data: str, seconds: float) -> dict[str, float]:
    cfg = CONTENDERS[name]
    ds = stoker.Dataset(
        image=stoker.Field(f"{data}/img_*.bin", "int8", (128, 128, 1)),
        label=stoker.Field(f"{data}/out_*.bin.gz", "float32", compression="gzip"),
    )
    transform: Any = None
    kind = cfg.get("transform")
    if kind is not None and kind.startswith("normalize+flip"):
        transform = [Normalize(mean=-0.5, std=127.5, fields="image"), RandomFlip(fields="image", axis=1)]
        if kind != "normalize+flip":
            transform.append(Cast(kind.split()[1], fields="image"))
    elif kind is not None and kind.startswith("cast "):
        transform = [Cast(kind.split()[1], fields="image")]
    elif kind == "python":
        transform = [python_checksum]
    elif kind == "wait":
        transform = [wait_20ms]
    if cfg.get("kernel") is False:
        fusion._kernels = None  # the pure-numpy path, as where no C compiler built it
    kw = {k: v for k, v in cfg.items() if k in ("cast", "workers", "threads")}
    n = 0
    with ds.loader(256, epochs=None, seed=0, transform=transform, **kw) as loader:
        it = iter(loader)
        for _ in range(2 * cfg.get("threads", 1) + 2):  # spawn every worker and warm up outside the timing
            next(it)
        cpu0 = cpu_seconds()
        start = time.perf_counter()
        for batch in it:
            n += len(batch["label"])
            if time.perf_counter() - start >= seconds:
                break
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds() - cpu0
    return {"records": n, "seconds": elapsed, "cpu": cpu, "records_per_cpu_s": n / max(cpu, 1e-9)}


def cpu_seconds() -> float:
    """CPU time of this process and its live worker processes (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in ["self", *(str(p.pid) for p in multiprocessing.active_children())]:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def _spin(seconds: float, out: Any) -> None:
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        pass
    out.put(time.process_time() - cpu)


def spin_check(seconds: float = 2.0) -> float:
    """CPU-seconds two busy processes get, over what one gets: what a second worker can add here."""
    ctx = multiprocessing.get_context("spawn")
    got = []
    for k in (1, 2):
        q = ctx.Queue()
        procs = [ctx.Process(target=_spin, args=(seconds, q)) for _ in range(k)]
        for p in procs:
            p.start()
        got.append(sum(q.get() for _ in procs))
        for p in procs:
            p.join()
    return got[1] / got[0]


RATIOS = [
    ("normalize+flip", "none"),
    ("normalize+flip numpy", "none"),
    ("cast float16", "none"),
    ("cast bfloat16", "none"),
    ("Cast float16", "none"),
    ("Cast bfloat16", "none"),
    ("cast bfloat16", "Cast bfloat16"),
    ("normalize+flip float16", "none"),
    ("normalize+flip bfloat16", "none"),
    ("python process x2", "python process x1"),
    ("python process x2", "python thread x2"),
    ("wait process x2", "wait process x1"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--data", default=default_cache() + "/sample-16x4096x128")
    add_out_argument(ap)
    ap.add_argument("--name", default="transforms", help="the results file's name in --out (NAME.md, NAME_history.md)")
    ap.add_argument("--only", help="comma-separated contenders to run (default: all)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.data, args.seconds)))
        return 0
    data = cached_sample(args.data)
    names = args.only.split(",") if args.only else list(CONTENDERS)
    load_before = os.getloadavg()
    argv = ["--data", str(data), "--seconds", str(args.seconds)]
    rounds = alternate(names, args.rounds, lambda name: child_json(name, [__file__, "--child", name, *argv]))
    load_after = os.getloadavg()
    spare = spin_check()
    cores = len(os.sched_getaffinity(0))
    title = (f"Transforms on W1 ({cores} cores, {args.rounds} alternated rounds of {args.seconds:g}s, "
             "warm page cache, batch 256)")  # fmt: skip
    body = (
        "Load average (1, 5, 15 min) before the rounds: {:.2f} {:.2f} {:.2f}; after: {:.2f} {:.2f} {:.2f}.\n\n".format(
            *load_before, *load_after
        )
        + summary_table(rounds, columns={"records per CPU-second": median_of("records_per_cpu_s")})
        + "\n"
        + ratio_table(rounds, [(a, b) for a, b in RATIOS if a in names and b in names])
        + f"\nMachine check after the rounds: two busy processes got {spare:.2f}x the CPU-seconds of one.\n"
    )
    write_results(args.name, title, body, script=__file__, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
