"""Copying raw records with a cast: from a memory map (stoker's path) or through pread (no SIGBUS).

A raw file truncated between stoker's size check and its copy from the memory map raises SIGBUS
there, which stoker's kernels now catch (a guard around their reads; README, Errors). Reading
through ``os.preadv`` into a small staging buffer, then casting, was the alternative considered:
it turns the cut into a short read. This measures what it would cost: int8 -> float32 batches of
256 W1 records (16 KiB each) from warm files, one thread, contenders alternated within each round;
prints medians and per-round ratios.

    python benchmarks/raw_copy.py [--rounds 7] [--seconds 1]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from stoker.sample import cached_sample

RECORD = 128 * 128
BATCH = 256


def mmap_cast(paths: list[str], out: np.ndarray, seconds: float) -> int:
    n, until = 0, time.perf_counter() + seconds
    while time.perf_counter() < until:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            for i in range(0, size // RECORD - BATCH + 1, BATCH):
                if os.fstat(fd).st_size < (i + BATCH) * RECORD:  # stoker's check before each copy
                    raise RuntimeError(f"{p} shrank")
                src = np.frombuffer(m, np.int8, count=BATCH * RECORD, offset=i * RECORD)
                np.copyto(out, src.reshape(out.shape), casting="unsafe")
                del src
                n += BATCH
            m.close()
            os.close(fd)
    return n


def pread_cast(chunk: int) -> Callable[[list[str], np.ndarray, float], int]:
    staging = bytearray(chunk)
    view, arr = memoryview(staging), np.frombuffer(staging, np.int8)

    def run(paths: list[str], out: np.ndarray, seconds: float) -> int:
        flat = out.reshape(-1)
        n, until = 0, time.perf_counter() + seconds
        while time.perf_counter() < until:
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                size = os.fstat(fd).st_size
                for i in range(0, size // RECORD - BATCH + 1, BATCH):
                    done, total = 0, BATCH * RECORD
                    while done < total:
                        got = os.preadv(fd, [view[: min(chunk, total - done)]], i * RECORD + done)
                        if got == 0:
                            raise RuntimeError(f"{p} shrank")
                        np.copyto(flat[done : done + got], arr[:got], casting="unsafe")
                        done += got
                    n += BATCH
                os.close(fd)
        return n

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--data", default=os.environ.get("STOKER_CACHE", ".stoker-cache") + "/sample-16x4096x128")
    args = ap.parse_args()
    paths = sorted(str(p) for p in cached_sample(args.data).glob("img_*.bin"))[:4]
    out = np.empty((BATCH, RECORD), np.float32)
    contenders = {"mmap": mmap_cast, **{f"pread {c >> 10} KiB": pread_cast(c) for c in (64 << 10, 256 << 10, 1 << 20)}}
    mmap_cast(paths, out, 0.5)  # warm the page cache
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.rounds):
        for name in contenders if r % 2 == 0 else reversed(contenders):
            t = time.perf_counter()
            n = contenders[name](paths, out, args.seconds)
            rates[name].append(n / (time.perf_counter() - t))
    print(f"| contender | records/s median | / mmap per round: median (min..max) of {args.rounds} |")
    print("|---|---:|---:|")
    for name, rs in rates.items():
        ratios = [a / b for a, b in zip(rs, rates["mmap"], strict=True)]
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
        print(f"| {name} | {statistics.median(rs):,.0f} | {spread} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
