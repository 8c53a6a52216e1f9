"""Copying raw records with a cast: from a memory map (stoker's path) or through pread (no SIGBUS).

A raw file truncated between stoker's size check and its copy from the memory map raises SIGBUS
there, which stoker's kernels now catch (a guard around their reads; docs/reliability.md). Reading
through ``os.preadv`` into a small staging buffer, then casting, was the alternative considered:
it turns the cut into a short read. This measures what it would cost: int8 -> float32 batches of
256 W1 records (16 KiB each) from warm files, one thread, contenders alternated within each round;
writes medians and per-round ratios.

    python benchmarks/raw_copy.py [--rounds 7] [--seconds 1] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from harness import (
    Run,
    add_out_argument,
    alternate,
    cached_sample,
    default_cache,
    ratio_table,
    summary_table,
    write_results,
)

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
    ap.add_argument("--data", default=default_cache() + "/sample-16x4096x128")
    add_out_argument(ap)
    args = ap.parse_args()
    paths = sorted(str(p) for p in cached_sample(args.data).glob("img_*.bin"))[:4]
    out = np.empty((BATCH, RECORD), np.float32)
    contenders = {"mmap": mmap_cast, **{f"pread {c >> 10} KiB": pread_cast(c) for c in (64 << 10, 256 << 10, 1 << 20)}}
    mmap_cast(paths, out, 0.5)  # warm the page cache

    def run(name: str) -> Run:
        t = time.perf_counter()
        n = contenders[name](paths, out, args.seconds)
        elapsed = time.perf_counter() - t
        return {"records": n, "seconds": elapsed, "records_per_s": n / elapsed}

    rounds = alternate(list(contenders), args.rounds, run)
    body = summary_table(rounds) + "\n" + ratio_table(rounds, [(name, "mmap") for name in contenders if name != "mmap"])
    title = f"Raw records cast from a memory map or through pread, one thread ({args.rounds} alternated rounds)"
    write_results("raw_copy", title, body, script=__file__, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
