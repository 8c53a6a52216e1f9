"""W1-big: the seed's layout, larger than this machine's RAM, read cold from the disk.

The dataset (generated once, kept out of CI) holds enough 64 MiB image files of 4096 int8
128x128 frames, with their gzip float32 labels, to exceed the RAM by ``--over`` (default 10%).
Before every contender's run the files are synced and dropped from the page cache, so each
run starts cold and reads from the disk. Contenders alternate, each in a fresh process:

- ``disk``: the disk's sequential read rate: one thread per core, each reading its share of the
  image files front to back in 8 MiB ``preadv`` calls into a reused buffer (no cast);
- ``disk ahead``: the same, each file first advised whole with ``POSIX_FADV_WILLNEED`` so the
  kernel keeps the disk's queue full (the faster of the two is the disk's rate here);
- ``disk streams``: the ``disk`` loop with four threads per core (four times as many files read
  at once), each advising the next 32 MiB of its file with ``POSIX_FADV_WILLNEED`` after every
  read and dropping what it has read with ``POSIX_FADV_DONTNEED``: the disk always has many
  requests queued, and the page cache does not fill up (what stoker's readahead does, in the
  simplest loop we could write);
- ``disk direct``: the device's own limit, past the page cache: four threads per core, each
  reading its files front to back in 8 MiB ``O_DIRECT`` reads into an aligned buffer, so the
  kernel neither caches nor reads ahead and what is timed is the disk answering requests;
- ``disk+cast``: the same as ``disk`` plus the cast of every chunk to float32 (the cold ceiling);
- ``stoker float32`` / ``stoker int8``: ``ds.loader(256)`` with and without the cast;
- ``stoker float32 no-readahead``: the same with ``stoker.io.readahead`` switched off, to show what
  the readahead and drop-behind buy;
- ``disk random``: the disk's rate for W3's access pattern, random 16 KiB records: four threads
  per core, each asking the disk for 256 records drawn at random from all the image files at
  once (``POSIX_FADV_WILLNEED`` on each), then reading them with ``preadv`` (no cast);
- ``stoker float32 shuffle=global``: ``ds.loader(256, shuffle="global", seed=0)`` cast to
  float32 (W3 larger than RAM: every record from the disk, in random order).

Each run lasts ``--seconds`` (default 25) or one whole epoch, whichever ends first
(``--seconds 0``: the epoch, whose length follows the disk's rate, which varies on a shared
VM: see results/w1_big_history.md). Reported per contender: records/s, MB/s of image bytes, and how much the
page cache grew during the run (with drop-behind, stoker keeps only a window of pages per open
file, so a dataset larger than RAM does not push the training process's own file pages out).
Every run also reports its CPU-seconds per GB of image bytes (its process's user and system
time). Ratios are taken per round, then their median and spread. ``--only`` runs a subset of the
contenders (a quicker cold comparison of the device, int8 and float32, for example).

    python benchmarks/w1_big.py [--rounds 3] [--seconds 25] [--over 0.1] [--cache .stoker-cache]
                                [--only NAME,NAME...] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness import (
    add_out_argument,
    alternate,
    cached_sample,
    child_json,
    default_cache,
    evict_page_cache,
    median_of,
    physical_memory,
    ratio_table,
    summary_table,
    write_results,
)

RES = 128
RECORDS = 4096
RECORD_BYTES = RES * RES
CHUNK = 8 << 20
STREAMS_PER_CORE = 4
STREAM_AHEAD = 32 << 20
DISK_LOOPS = ("disk", "disk ahead", "disk streams")  # the fastest in a round is the disk's rate
RANDOM_BATCH = 256  # records a random-read thread asks the disk for at once
CONTENDERS = (
    *DISK_LOOPS, "disk direct", "disk+cast", "stoker float32", "stoker int8", "stoker float32 no-readahead",
    "disk random", "stoker float32 shuffle=global",
)  # fmt: skip


def cached_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1])
    return 0


def run_threads(target: Any, args: list[tuple[Any, ...]]) -> float:
    """Seconds from starting one thread per `args` entry, running `target(*entry)`, to joining them all."""
    start = time.perf_counter()
    workers = [threading.Thread(target=target, args=a) for a in args]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def disk_child(paths: list[str], cast: bool, seconds: float, ahead: bool = False, streams: int = 1) -> dict[str, Any]:
    threads = len(os.sched_getaffinity(0)) * streams
    until = time.perf_counter() + seconds if seconds else math.inf
    done: list[int] = []

    def read(share: list[str]) -> None:
        buf = np.empty(CHUNK, np.uint8)
        out = np.empty(CHUNK, np.float32) if cast else None
        n = 0
        for p in share:
            fd = os.open(p, os.O_RDONLY)
            try:
                if ahead:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                off = 0
                while (got := os.preadv(fd, [buf], off)) > 0:
                    if streams > 1:  # a window in flight ahead, nothing kept behind
                        os.posix_fadvise(fd, off + got, STREAM_AHEAD, os.POSIX_FADV_WILLNEED)
                        os.posix_fadvise(fd, 0, off, os.POSIX_FADV_DONTNEED)
                    if out is not None:
                        np.copyto(out[:got], buf[:got].view(np.int8), casting="unsafe")
                    n += got
                    off += got
                    if time.perf_counter() >= until:
                        break
            finally:
                os.close(fd)
            if time.perf_counter() >= until:
                break
        done.append(n)

    seconds = run_threads(read, [(paths[i::threads],) for i in range(threads)])
    return {"bytes": sum(done), "seconds": seconds}


def direct_child(paths: list[str], seconds: float) -> dict[str, Any]:
    """The device's rate past the page cache: O_DIRECT reads into page-aligned buffers."""
    threads = len(os.sched_getaffinity(0)) * STREAMS_PER_CORE
    until = time.perf_counter() + seconds if seconds else math.inf
    done: list[int] = []

    def read(share: list[str]) -> None:
        buf = mmap.mmap(-1, CHUNK)  # anonymous maps are page-aligned, as O_DIRECT needs
        n = 0
        for p in share:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                off = 0
                while (got := os.preadv(fd, [buf], off)) > 0:
                    n += got
                    off += got
                    if time.perf_counter() >= until:
                        break
            finally:
                os.close(fd)
            if time.perf_counter() >= until:
                break
        buf.close()
        done.append(n)

    seconds = run_threads(read, [(paths[i::threads],) for i in range(threads)])
    return {"bytes": sum(done), "seconds": seconds}


def random_child(paths: list[str], seconds: float) -> dict[str, Any]:
    """Random whole records from every file, many asked of the disk at once (see ``disk random``)."""
    threads = len(os.sched_getaffinity(0)) * STREAMS_PER_CORE
    until = time.perf_counter() + seconds if seconds else math.inf
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    done: list[int] = []

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        buf = np.empty(RECORD_BYTES, np.uint8)
        n = 0
        while time.perf_counter() < until:
            picks = [(fds[f], r * RECORD_BYTES) for f, r in zip(
                rng.integers(0, len(fds), RANDOM_BATCH).tolist(), rng.integers(0, RECORDS, RANDOM_BATCH).tolist(),
                strict=True,
            )]  # fmt: skip
            for fd, off in picks:
                os.posix_fadvise(fd, off, RECORD_BYTES, os.POSIX_FADV_WILLNEED)
            for fd, off in picks:
                n += os.preadv(fd, [buf], off)
        done.append(n)

    seconds = run_threads(read, [(i,) for i in range(threads)])
    for fd in fds:
        os.close(fd)
    return {"bytes": sum(done), "seconds": seconds}


def stoker_child(
    data: Path, cast: str | None, readahead: bool, seconds: float, shuffle: str | None = None
) -> dict[str, Any]:
    import stoker
    from harness import Readahead

    if not readahead:
        Readahead.after_read = lambda self, *a, **k: False  # type: ignore[method-assign]
    ds = stoker.Dataset(
        image=stoker.Field(str(data / "img_*.bin"), dtype="int8", shape=(RES, RES, 1)),
        label=stoker.Field(str(data / "out_*.bin.gz"), dtype="float32", compression="gzip"),
    )
    until = time.perf_counter() + seconds if seconds else math.inf
    n = 0
    order = {"shuffle": shuffle, "seed": 0} if shuffle else {}
    with ds.loader(256, epochs=1, cast={"image": cast} if cast else None, **order) as loader:  # type: ignore[arg-type]
        start = time.perf_counter()
        for batch in loader:
            n += len(batch["image"])
            if time.perf_counter() >= until:
                break
        elapsed = time.perf_counter() - start
        tuning = loader.stats().tuning
    return {"bytes": n * RECORD_BYTES, "seconds": elapsed, "tuning": tuning}


def child(kind: str, data: Path, seconds: float) -> dict[str, Any]:
    paths = sorted(str(p) for p in data.glob("img_*.bin"))
    before = cached_kib()
    cpu = os.times()
    if kind == "disk random":
        out = random_child(paths, seconds)
    elif kind == "disk direct":
        out = direct_child(paths, seconds)
    elif kind.startswith("disk"):
        out = disk_child(
            paths, kind == "disk+cast", seconds, ahead=kind == "disk ahead",
            streams=STREAMS_PER_CORE if kind == "disk streams" else 1,
        )  # fmt: skip
    else:
        out = stoker_child(
            data, None if "int8" in kind else "float32", "no-readahead" not in kind, seconds,
            "global" if "shuffle=global" in kind else None,
        )  # fmt: skip
    out["cache_growth_mib"] = (cached_kib() - before) / 1024
    used = os.times()
    out["cpu_s_per_gb"] = (used.user + used.system - cpu.user - cpu.system) / (out["bytes"] / 1e9)
    return out


def run(kind: str, data: Path, seconds: float) -> dict[str, Any]:
    os.sync()
    evict_page_cache([str(p) for p in data.iterdir() if p.name.startswith(("img_", "out_"))])
    out = child_json(kind, [__file__, "--child", kind, "--data", str(data), "--seconds", str(seconds)])
    out["mb_per_s"] = out["bytes"] / out["seconds"] / 1e6
    out["records_per_s"] = out["bytes"] / RECORD_BYTES / out["seconds"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--over", type=float, default=0.1, help="dataset size above the RAM, as a fraction of it")
    ap.add_argument("--cache", default=default_cache())
    ap.add_argument("--only", help="comma-separated contenders to run (default: all)")
    add_out_argument(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, Path(args.data), args.seconds)))
        return 0
    ram = physical_memory()
    pairs = math.ceil(ram * (1 + args.over) / (RECORDS * RECORD_BYTES))
    data = cached_sample(Path(args.cache) / f"w1-big-{pairs}x{RECORDS}x{RES}", pairs=pairs, records=RECORDS)
    size = sum(p.stat().st_size for p in data.glob("img_*.bin"))
    contenders = list(CONTENDERS)
    if args.only:
        contenders = [c.strip() for c in args.only.split(",")]
        if unknown := sorted(set(contenders) - set(CONTENDERS)):
            ap.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    rounds = alternate(contenders, args.rounds, lambda kind: run(kind, data, args.seconds), show="mb_per_s")
    ratios = [
        ("stoker float32", "stoker int8"),
        ("stoker float32", "disk direct"),
        ("stoker int8", "disk direct"),
        ("stoker int8", DISK_LOOPS, "stoker int8 / best disk loop"),
        ("stoker float32", DISK_LOOPS, "stoker float32 / best disk loop"),
        ("stoker int8", "disk streams"),
        ("stoker int8", "disk"),
        ("stoker int8", "disk ahead"),
        ("stoker float32", "disk+cast"),
        ("stoker float32", "disk"),
        ("stoker float32", "disk ahead"),
        ("stoker float32", "stoker float32 no-readahead"),
        ("stoker float32 shuffle=global", "disk random"),
    ]
    table = summary_table(rounds, metric="mb_per_s", label="MB/s", columns={
        "records/s median": median_of("records_per_s"),
        "page cache growth (MiB, median)": median_of("cache_growth_mib"),
        "CPU-s per GB (median)": median_of("cpu_s_per_gb", "{:.2f}"),
    })  # fmt: skip
    stoker_runs = [run for name in contenders if name.startswith("stoker") for run in rounds.ok(name)]
    readahead = stoker_runs[0].get("tuning", {}).get("readahead") if stoker_runs else None
    body = (table + "\n" + ratio_table(rounds, ratios, metric="mb_per_s")
            + f"\nstoker's readahead setting in these runs: {readahead}\n")  # fmt: skip
    title = (f"W1-big ({len(os.sched_getaffinity(0))} cores, RAM {ram / 2**30:.1f} GiB, images {size / 2**30:.1f} GiB "
             f"in {pairs} files, cold cache before every run, {args.rounds} alternated rounds of "
             f"{args.seconds:g}s)")  # fmt: skip
    write_results("w1_big", title, body, script=__file__, out=args.out)
    (Path(args.out) / "w1_big.json").write_text(json.dumps(rounds.runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
