"""The contenders `stoker bench` measures: stoker and the machine's own ceiling on the same files
(the ceiling's loops: `stoker.cli.ceiling`).

Each contender runs in a fresh child process (`python -m stoker.cli.contenders CONTENDER JSON`)
so one cannot warm or starve the other through shared state; rounds alternate the
contenders because this kind of machine drifts by tens of percent within a minute.
With `evict` in the config, every file's pages are dropped from the page cache first
(cold-cache runs).

`warmup` in a config (seconds, for stoker and the ceiling alike) runs the contender that
long before its timed `seconds` begin, so both are measured in their steady state: the
start-up (threads, first maps of the files, first touch of new buffers, decoding the label
files, autotune's first window) is left out of both. `warmup: true` leaves out stoker's
first batch only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import steps
from .ceiling import (
    CEILING_LOOPS,
    COMPRESSED_CEILING_LOOPS,
    drop_page_cache,
    evict_page_cache,
    output_buffer,
    run_ceiling,
    warmup_seconds,
)
from .output import counted

__all__ = [
    "CEILING_LOOPS",
    "COMPRESSED_CEILING_LOOPS",
    "Measurement",
    "batch_rows",
    "burn",
    "child_json",
    "child_main",
    "evict_page_cache",
    "measure",
    "output_buffer",
    "rounds_figures",
    "run_child",
    "summarize",
    "too_short",
]

# A verdict needs a steady state: a timed window of at least this many of stoker's batches, and
# warm-up and window together this many times its start-up (iter() to the first batch) or more;
# the stats a verdict reads span all three, and a run mostly start-up blames what start-up costs.
JUDGE_MIN_BATCHES = 32
JUDGE_STARTUP_TIMES = 5


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
    # Under --step: the window's stoker.cli.steps.Stepped.to_dict().
    stepped: dict[str, Any] | None = None
    # Under --cold: how the page cache was dropped before the run (stoker.cli.ceiling.drop_page_cache).
    evicted: str | None = None

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e6


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


def _drain_until(batches: Iterator[Any], until: float, busy: float, step: Callable[[], None] | None = None) -> None:
    """Take batches until `until` (each followed by `busy` seconds of work), holding none after.

    A batch still referenced when the clock starts, as a loop variable left over from the
    warm-up would be, keeps the buffer it shares with the batches assembled beside it: the pool
    then made a fresh one inside the timed window, a stall of a first touch the loader would not
    have paid. A training loop holds no batch across its steps either.
    """
    for _ in batches:
        if busy:
            burn(busy)
        if step is not None:
            step()
        if time.perf_counter() >= until:
            break


def _run_stoker(cfg: dict[str, Any]) -> dict[str, Any]:
    from .config import dataset_from_fields

    ds = dataset_from_fields(cfg["fields"], pair_key=cfg.get("pair_key"))
    total_bytes = sum(f.record_bytes for f in ds.fields.values())
    n = 0
    cold = bool(cfg.get("evict"))
    evicted = drop_page_cache([i.path for infos in ds.files for i in infos.values()]) if cold else None
    step_ms = cfg.get("step_ms")
    step = None if not step_ms else steps.pause(step_ms / 1000, cfg.get("step_kind") or "sleep")
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
            # Not when cold: a warm-up would read the pass it is meant to time.
            warm_until = began + (0.0 if cold else warmup_seconds(cfg))
            if time.perf_counter() < warm_until:
                _drain_until(batches, warm_until, busy, step)
        if step_ms:
            stepped = steps.take(
                batches, seconds=cfg["seconds"], step=step_ms / 1000, kind=cfg.get("step_kind") or "sleep",
                rows=batch_rows, record_bytes=total_bytes,
            )  # fmt: skip
            return {
                "records": stepped.records, "seconds": stepped.seconds, "bytes_read": stepped.bytes_read,
                "stats": loader.stats().to_dict(), "cpu_seconds": stepped.cpu_seconds, "first_batch_seconds": first,
                "stepped": stepped.to_dict(), "evicted": evicted,
            }  # fmt: skip
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
        "cpu_seconds": time.process_time() - cpu, "first_batch_seconds": first, "evicted": evicted,
    }  # fmt: skip


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
    out = child_json(contender, ["-m", "stoker.cli.contenders", contender, json.dumps(cfg)])
    return Measurement(
        contender, out["records"], out["seconds"], out["bytes_read"], out.get("stats"), out.get("cpu_seconds", 0.0),
        out.get("first_batch_seconds"), out.get("stepped"), out.get("evicted"),
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


def rounds_figures(ms: Sequence[Measurement]) -> dict[str, list[float]]:
    """A contender's figures, round by round, as `stoker bench --json` gives them."""
    return {"records_per_s": [m.records_per_s for m in ms], "mb_per_s": [m.mb_per_s for m in ms],
            "cpu_seconds": [m.cpu_seconds for m in ms], "seconds": [m.seconds for m in ms]}  # fmt: skip


def summarize(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def child_main(argv: Sequence[str]) -> int:
    contender, raw = argv
    cfg = json.loads(raw)
    out = _run_stoker(cfg) if contender == "stoker" else run_ceiling(cfg)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))


def too_short(run: Measurement, batch_size: int, warmup: float, *, cold: bool = False) -> str | None:
    """Why the median round cannot be judged (what its stats span mostly start-up), or None."""
    batches = -(-run.records // batch_size)
    startup = run.first_batch_seconds or 0.0
    if batches >= JUDGE_MIN_BATCHES and warmup + run.seconds >= JUDGE_STARTUP_TIMES * startup:
        return None
    fix = "read more or larger files, or give a smaller --batch-size" if cold else "give more --seconds or --warmup"
    return (
        f"too short to judge: the timed window held {counted(batches, 'batch', 'batches')} in {run.seconds:.2f}s "
        f"after a start-up of {startup * 1000:,.0f} ms and {warmup:g}s of warm-up; a verdict needs "
        f"{JUDGE_MIN_BATCHES} batches or more, and warm-up and window together {JUDGE_STARTUP_TIMES}x the start-up "
        f"or longer: {fix}"
    )
