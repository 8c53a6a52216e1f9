"""The ceiling `stoker bench` measures stoker against: the machine's own fastest simple loop
over the same files, run in a child process by `stoker.cli.contenders`.

The ceiling is the fastest of a few simple loops over the raw bytes of the widest raw
field, one thread per core, each producing resident ndarrays of the loader's output
dtype, batch by batch. A buffer reused per thread (the output, the staging buffer) is memory
as stoker's batches get (`output_buffer`: page aligned, huge pages advised):

- `mmap_cast`: `np.copyto` with casting straight from a memory map of the file into
  an output buffer reused per thread (one pass);
- `mmap_cast_fresh`: the same into a fresh `np.empty` per batch;
- `preadv_cast`: whole-batch `os.preadv` into a staging buffer, then `np.copyto`;
- `mmap_stream`: `stoker.kernels.cast_into` (the compiled cast stoker itself uses, with
  streaming stores; a plain `memcpy` when no cast) straight from a memory map into an
  output buffer reused per thread. Without the compiled kernels it is `mmap_cast` again.
- `mmap_kept`: `mmap_stream` with each file mapped once for the whole run instead of at
  every visit, so a file read again finds its pages mapped already (no page faults, no
  unmapping). stoker keeps its maps across
  epochs the same way where the dataset fits the page cache.

For a compressed field the ceiling is `inflate_cast`: each file inflated front to back, a
batch at a time, by the fastest inflate installed (isal, else zlib) straight into a reused
staging buffer, then cast into the output by `stoker.kernels.cast_into` (no engine, no
pairing, no checks).
With `evict` in the config, every file's pages are dropped from the page cache first
(cold-cache runs: the ceiling is then a cold read plus the cast).
`warmup` in a config runs the loops that long before their timed `seconds` begin (see
`stoker.cli.contenders`).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..engine.executor import AlignedPool
from ..kernels import cast_into
from ..spec import resolve_dtype

__all__ = [
    "CEILING_LOOPS",
    "COMPRESSED_CEILING_LOOPS",
    "evict_page_cache",
    "output_buffer",
    "run_ceiling",
    "warmup_seconds",
]


class _Tally:
    """Records a ceiling thread makes, counted from the first batch done at or after `begin`."""

    __slots__ = ("base", "begun", "ended", "n")

    def __init__(self) -> None:
        self.n = 0
        self.base = 0
        self.begun: float | None = None
        self.ended = 0.0

    def add(self, k: int, begin: float, until: float) -> bool:
        """Count `k` records; True once the timed window is over."""
        self.n += k
        now = time.perf_counter()
        if self.begun is None and now >= begin:
            self.begun, self.base = now, self.n
        self.ended = now
        return now >= until


def output_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A ceiling loop's reused buffer: memory as stoker's own batches get (page aligned, advised
    to use transparent huge pages from 2 MiB, stoker.engine.executor.HUGE_PAGE_MIN_BYTES), since a
    ceiling on plain malloc'd memory reads too low (measured: benchmarks/results/w1_history.md)."""
    return AlignedPool(0).array(shape, dtype)


def _ceiling_worker(
    paths: Sequence[str], header: int, shape: tuple[int, ...], src_dt: np.dtype, out_dt: np.dtype,
    batch: int, loop: str, begin: float, until: float, tallies: list[_Tally],
) -> None:  # fmt: skip
    rb = int(np.prod(shape)) * src_dt.itemsize
    out = output_buffer((batch, *shape), out_dt)
    staging = output_buffer((batch * rb,), np.dtype(np.uint8))
    tally = _Tally()
    tallies.append(tally)
    if loop == "inflate_cast":
        from ..io.inflate import Inflater

        while time.perf_counter() < until:
            for p in paths:
                with Inflater(p, "zlib" if p.endswith((".zz", ".zlib")) else "gzip") as inf:
                    inf.skip(header)
                    while time.perf_counter() < until:
                        k = inf.readinto(memoryview(staging)) // rb  # type: ignore[arg-type]
                        if k == 0:
                            break
                        cast_into(out[:k], staging[: k * rb].view(src_dt).reshape(k, *shape))
                        if tally.add(k, begin, until):
                            break
                if time.perf_counter() >= until:
                    break
        return
    kept: dict[str, mmap.mmap] = {}
    while time.perf_counter() < until:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                records = (size - header) // rb
                if loop == "mmap_kept":
                    m = kept.get(p)
                    if m is None:
                        m = kept[p] = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                else:
                    m = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if loop != "preadv_cast" else None
                for i in range(0, records, batch):
                    k = min(batch, records - i)
                    if loop == "mmap_cast_fresh":
                        out = np.empty((batch, *shape), out_dt)
                    if m is not None:
                        src = np.frombuffer(m, src_dt, count=k * rb // src_dt.itemsize, offset=header + i * rb)
                        if loop in ("mmap_stream", "mmap_kept"):
                            cast_into(out[:k], src.reshape(k, *shape))
                        else:
                            np.copyto(out[:k], src.reshape(k, *shape), casting="unsafe")
                        del src
                    else:
                        view = memoryview(staging)[: k * rb]  # type: ignore[arg-type]
                        os.preadv(fd, [view], header + i * rb)
                        np.copyto(out[:k], staging[: k * rb].view(src_dt).reshape(k, *shape), casting="unsafe")
                    if tally.add(k, begin, until):
                        break
                if m is not None and loop != "mmap_kept":
                    m.close()
            finally:
                os.close(fd)
            if time.perf_counter() >= until:
                break
    for m in kept.values():
        m.close()


CEILING_LOOPS = ("mmap_cast", "mmap_cast_fresh", "preadv_cast", "mmap_stream", "mmap_kept")
COMPRESSED_CEILING_LOOPS = ("inflate_cast",)


def run_ceiling(cfg: dict[str, Any]) -> dict[str, Any]:
    threads = cfg["threads"]
    paths = cfg["paths"]
    tallies: list[_Tally] = []
    failed: list[BaseException] = []

    def run(*args: Any) -> None:
        try:
            _ceiling_worker(*args)
        except BaseException as e:
            failed.append(e)

    if cfg.get("evict"):
        evict_page_cache(paths)
    # Before the clock starts: "bfloat16" imports ml_dtypes, which took longer than a short
    # timed window (a ceiling of zero records).
    out_dtype = resolve_dtype(cfg["out_dtype"])
    src_dtype = resolve_dtype(cfg["src_dtype"])
    start = time.perf_counter()
    begin = start + warmup_seconds(cfg)
    until = begin + cfg["seconds"]
    workers = [
        threading.Thread(
            target=run,
            args=(
                paths[i::threads] or paths,
                cfg["header"],
                tuple(cfg["shape"]),
                src_dtype,
                out_dtype,
                cfg["batch"],
                cfg["loop"],
                begin,
                until,
                tallies,
            ),
        )
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    time.sleep(max(0.0, begin - time.perf_counter()))
    cpu = time.process_time()
    for w in workers:
        w.join()
    cpu = time.process_time() - cpu
    # Each thread counts from its first batch done in the timed window; the window is from
    # the earliest such batch to the last batch done.
    timed = [t for t in tallies if t.begun is not None]
    records = sum(t.n - t.base for t in timed)
    elapsed = max(t.ended for t in timed) - min(t.begun for t in timed if t.begun is not None) if timed else 0.0
    if not records:  # nothing done in the window (no records in the files): the whole run's pace, zero
        elapsed = time.perf_counter() - start
    if failed:  # a loop that cannot run on these files says why, not "no record in the window"
        raise failed[0]
    rb = int(np.prod(cfg["shape"])) * src_dtype.itemsize
    return {"records": records, "seconds": elapsed, "bytes_read": records * rb, "cpu_seconds": cpu}


def warmup_seconds(cfg: dict[str, Any]) -> float:
    """The config's warm-up in seconds (`true`: none beyond stoker's first batch)."""
    w = cfg.get("warmup") or 0
    return 0.0 if w is True else float(w)


def evict_page_cache(paths: Sequence[str]) -> None:
    """Drop the files' pages from the page cache (no root needed), for cold-cache runs."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
