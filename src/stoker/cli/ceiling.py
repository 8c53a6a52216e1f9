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
`stepped` is `mmap_kept` fed to a consumer that takes each batch with an emulated training
step after it (`step_ms`, `step_kind`: `stoker bench --step`): one producer thread per core
fills buffers from a small pool, the consumer steps on each and hands its buffer back, the
plainest loop that overlaps loading with a step.

With `evict` in the config, every file's pages are dropped from the page cache first
(cold-cache runs: the ceiling is then a cold read plus the cast).
`warmup` in a config runs the loops that long before their timed `seconds` begin (see
`stoker.cli.contenders`).
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..engine.executor import AlignedPool
from ..kernels import cast_into
from ..spec import resolve_dtype
from . import steps

__all__ = [
    "CEILING_LOOPS",
    "COMPRESSED_CEILING_LOOPS",
    "drop_page_cache",
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
    batch: int, loop: str, begin: float, until: float, tallies: list[_Tally], once: bool = False,
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
            if once:
                break
        return
    kept: dict[str, mmap.mmap] = {}
    passes = 0
    while time.perf_counter() < until and not (once and passes):
        passes += 1
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
    evicted = drop_page_cache(paths) if cfg.get("evict") else None
    if cfg["loop"] == "stepped":
        return {**_run_stepped(cfg), "evicted": evicted}

    def run(*args: Any) -> None:
        try:
            _ceiling_worker(*args)
        except BaseException as e:
            failed.append(e)

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
                bool(cfg.get("once")),
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
    return {"records": records, "seconds": elapsed, "bytes_read": records * rb, "cpu_seconds": cpu, "evicted": evicted}


def _run_stepped(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `stepped` loop: producers fill pooled buffers, this thread takes them with the step."""
    threads, paths, header, batch = cfg["threads"], cfg["paths"], cfg["header"], cfg["batch"]
    once = bool(cfg.get("once"))  # one pass over the files (a cold run), not until the window ends
    shape = tuple(cfg["shape"])
    src_dt, out_dt = resolve_dtype(cfg["src_dtype"]), resolve_dtype(cfg["out_dtype"])
    rb = int(np.prod(shape)) * src_dt.itemsize
    # A buffer per producer in the making and as many ready: a prefetch of `threads` batches.
    free: queue.Queue[np.ndarray] = queue.Queue()
    for _ in range(2 * threads + 1):
        free.put(output_buffer((batch, *shape), out_dt))
    ready: queue.Queue[tuple[np.ndarray, int] | BaseException | None] = queue.Queue()  # None: a producer done
    stop = threading.Event()

    def produce(mine: Sequence[str]) -> None:
        try:
            kept = [(mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ), fd) for fd in
                    (os.open(p, os.O_RDONLY) for p in mine)]  # fmt: skip
            try:
                passes = 0
                while not stop.is_set() and not (once and passes):
                    passes += 1
                    for m, _ in kept:
                        records = (len(m) - header) // rb
                        for i in range(0, records, batch):
                            k = min(batch, records - i)
                            while not stop.is_set():
                                try:
                                    out = free.get(timeout=0.05)
                                    break
                                except queue.Empty:
                                    continue
                            else:
                                return
                            src = np.frombuffer(m, src_dt, count=k * rb // src_dt.itemsize, offset=header + i * rb)
                            cast_into(out[:k], src.reshape(k, *shape))
                            del src
                            ready.put((out, k))
            finally:
                for m, fd in kept:
                    m.close()
                    os.close(fd)
            ready.put(None)  # this producer's pass is done (`once`)
        except BaseException as e:
            ready.put(e)

    def taken() -> Any:
        held: np.ndarray | None = None
        running = threads
        while True:
            if held is not None:
                free.put(held)
                held = None
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
                if not running:
                    return
                continue
            held = item[0]
            yield item

    workers = [threading.Thread(target=produce, args=(paths[i::threads] or paths,)) for i in range(threads)]
    for w in workers:
        w.start()
    try:
        batches = taken()
        kind = cfg.get("step_kind") or "sleep"
        step = cfg["step_ms"] / 1000
        if warmup_seconds(cfg):
            steps.take(batches, seconds=warmup_seconds(cfg), step=step, kind=kind, rows=lambda b: b[1], record_bytes=rb)
        out = steps.take(batches, seconds=cfg["seconds"], step=step, kind=kind, rows=lambda b: b[1], record_bytes=rb)
    finally:
        stop.set()
        for w in workers:
            w.join()
    return {"records": out.records, "seconds": out.seconds, "bytes_read": out.bytes_read,
            "cpu_seconds": out.cpu_seconds, "stepped": out.to_dict()}  # fmt: skip


def warmup_seconds(cfg: dict[str, Any]) -> float:
    """The config's warm-up in seconds (`true`: none beyond stoker's first batch)."""
    w = cfg.get("warmup") or 0
    return 0.0 if w is True else float(w)


def drop_page_cache(paths: Sequence[str]) -> str:
    """Drop the files' pages from the page cache before a cold run, and say how: the whole
    cache through /proc/sys/vm/drop_caches where this process may write it (root), else
    `posix_fadvise(DONTNEED)` on each file, which drops only its clean pages (`os.sync()`
    first writes the dirty ones), else a sentence saying why it could not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return "drop_caches: /proc/sys/vm/drop_caches (the whole page cache)"
    except OSError as e:
        why = f"/proc/sys/vm/drop_caches: {e.strerror or e}"
    if not hasattr(os, "posix_fadvise"):
        return f"could not drop the page cache: {why}, and this system has no posix_fadvise"
    try:
        evict_page_cache(paths)
    except OSError as e:
        return f"could not drop the page cache: {why}; posix_fadvise on {e.filename}: {e.strerror}"
    return f"fadvise: posix_fadvise(DONTNEED) on each file (not {why})"


def evict_page_cache(paths: Sequence[str]) -> None:
    """Drop the files' pages from the page cache (no root needed), for cold-cache runs."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
