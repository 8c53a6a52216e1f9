"""Measure stoker against the machine's own ceiling on the same files, in the same run.

Each contender runs in a fresh child process (`python -m stoker.cli.bench CONTENDER JSON`)
so one cannot warm or starve the other through shared state; rounds alternate the
contenders because this kind of machine drifts by tens of percent within a minute.

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

`warmup` in a config (seconds, for stoker and the ceiling alike) runs the contender that
long before its timed `seconds` begin, so both are measured in their steady state: the
start-up (threads, first maps of the files, first touch of new buffers, decoding the label
files, autotune's first window) is left out of both. `warmup: true` leaves out stoker's
first batch only.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine.executor import AlignedPool
from ..kernels import cast_into
from ..spec import resolve_dtype

__all__ = [
    "CEILING_LOOPS",
    "COMPRESSED_CEILING_LOOPS",
    "Measurement",
    "batch_rows",
    "burn",
    "child_json",
    "measure",
    "output_buffer",
    "run_child",
    "summarize",
]


@dataclass(frozen=True)
class Measurement:
    contender: str
    records: int
    seconds: float
    bytes_read: int
    stats: dict[str, Any] | None = None  # stoker's loader.stats().to_dict(), for stoker contenders
    cpu_seconds: float = 0.0
    # stoker: from iter(loader) to its first batch (threads, file maps, the first new buffers).
    first_batch_seconds: float | None = None

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e6


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


def _run_ceiling(cfg: dict[str, Any]) -> dict[str, Any]:
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
        _evict_page_cache(paths)
    # Before the clock starts: "bfloat16" imports ml_dtypes, which took longer than a short
    # timed window (a ceiling of zero records).
    out_dtype = resolve_dtype(cfg["out_dtype"])
    src_dtype = resolve_dtype(cfg["src_dtype"])
    start = time.perf_counter()
    begin = start + _warmup_seconds(cfg)
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


def _warmup_seconds(cfg: dict[str, Any]) -> float:
    """The config's warm-up in seconds (`true`: none beyond stoker's first batch)."""
    w = cfg.get("warmup") or 0
    return 0.0 if w is True else float(w)


def batch_rows(batch: Any) -> int:
    """Records in a batch: a dict of arrays or tensors (its first field), or a tuple (its first item)."""
    first = batch[0] if isinstance(batch, list | tuple) else next(iter(batch.values()))
    return int(first.shape[0])


def burn(seconds: float) -> None:
    """Keep this thread on the CPU for `seconds`, as a training step on the host would."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for i in range(1000):
            x += i


def _drain_until(batches: Iterator[Any], until: float, busy: float) -> None:
    """Take batches until `until` (each followed by `busy` seconds of work), holding none after.

    A batch still referenced when the clock starts, as a loop variable left over from the
    warm-up would be, keeps the buffer it shares with the batches assembled beside it: the pool
    then made a fresh one inside the timed window, a stall of a first touch the loader would not
    have paid. A training loop holds no batch across its steps either.
    """
    for _ in batches:
        if busy:
            burn(busy)
        if time.perf_counter() >= until:
            break


def _run_stoker(cfg: dict[str, Any]) -> dict[str, Any]:
    from .config import dataset_from_fields

    ds = dataset_from_fields(cfg["fields"])
    total_bytes = sum(f.record_bytes for f in ds.fields.values())
    n = 0
    cold = bool(cfg.get("evict"))
    if cold:
        _evict_page_cache([i.path for infos in ds.files for i in infos.values()])
    busy = float(cfg.get("busy_ms") or 0) / 1000
    shuffle: Any = cfg.get("shuffle") or False
    # pass_per_epoch: `for epoch ...: for batch in loader` (PyTorch's way, and Keras' fit over
    # to_tf): each epoch is a new pass, its start-up timed with the rest.
    per_epoch = bool(cfg.get("pass_per_epoch"))
    # Cold: one epoch at most, since a second one would find the first one's pages cached.
    with ds.loader(
        cfg["batch"],
        epochs=1 if cold or per_epoch else None,
        cast=cfg["cast"] or None,
        threads=cfg.get("threads"),
        prefetch=cfg.get("prefetch"),
        cycle_length=cfg.get("cycle_length"),
        block_length=cfg.get("block_length"),
        shuffle=shuffle,
        seed=0 if shuffle else None,
        **({"memory_budget": cfg["memory_budget"]} if cfg.get("memory_budget") else {}),  # else the loader's default
    ) as loader:

        def epoch_after_epoch() -> Iterator[dict[str, np.ndarray]]:
            while True:
                yield from loader

        began = time.perf_counter()
        batches = epoch_after_epoch() if per_epoch and not cold else iter(loader)
        first: float | None = None
        if cfg.get("warmup"):  # start-up and first batch excluded, as peers' benchmarks do
            next(batches)
            first = time.perf_counter() - began
            # A warm-up in seconds: the steady state is timed, as the ceiling's is.
            warm_until = began + _warmup_seconds(cfg)
            if time.perf_counter() < warm_until:
                _drain_until(batches, warm_until, busy)
        cpu = time.process_time()
        start = time.perf_counter()
        until = start + cfg["seconds"]
        for batch in batches:
            if first is None:
                first = time.perf_counter() - began
            n += batch_rows(batch)
            if busy:
                burn(busy)
            if time.perf_counter() >= until:
                break
        elapsed = time.perf_counter() - start
        stats = loader.stats().to_dict()
    return {
        "records": n, "seconds": elapsed, "bytes_read": n * total_bytes, "stats": stats,
        "cpu_seconds": time.process_time() - cpu, "first_batch_seconds": first,
    }  # fmt: skip


def _evict_page_cache(paths: Sequence[str]) -> None:
    """Drop the files' pages from the page cache (no root needed), for cold-cache runs."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child_json(name: str, args: Sequence[str], *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python args...` in a fresh process and return the JSON object on the last line it
    prints; a RuntimeError naming `name`, with the end of its stderr, if it fails. Every
    benchmark child (this module's and the scripts' under benchmarks/) is run this way.

    `env`: variables set for the child on top of this process's environment.
    """
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=False,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {name!r} failed:\n{proc.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def run_child(contender: str, cfg: dict[str, Any]) -> Measurement:
    """Run one contender for `cfg['seconds']` in a fresh process and return its figures."""
    out = child_json(contender, ["-m", "stoker.cli.bench", contender, json.dumps(cfg)])
    return Measurement(
        contender, out["records"], out["seconds"], out["bytes_read"], out.get("stats"), out.get("cpu_seconds", 0.0),
        out.get("first_batch_seconds"),
    )  # fmt: skip


def measure(
    contenders: dict[str, dict[str, Any]], *, rounds: int, on_result: Callable[[int, Measurement], None] | None = None
) -> dict[str, list[Measurement]]:
    """Alternate every contender once per round, `rounds` times."""
    results: dict[str, list[Measurement]] = {name: [] for name in contenders}
    for r in range(rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            kind = "stoker" if name.startswith("stoker") else "ceiling"
            m = run_child(kind, contenders[name])
            m = dataclasses.replace(m, contender=name)
            results[name].append(m)
            if on_result is not None:
                on_result(r, m)
    return results


def summarize(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def _child_main(argv: Sequence[str]) -> int:
    contender, raw = argv
    cfg = json.loads(raw)
    out = _run_stoker(cfg) if contender == "stoker" else _run_ceiling(cfg)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
