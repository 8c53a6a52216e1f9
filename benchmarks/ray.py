"""Ray Data against the local loader on W1 int8 (16 x 4096 records of 128x128 int8 + gzip float32
labels, no cast), batch 256, one pass per epoch as a training loop iterates.

Each contender runs in a fresh process, rounds alternate the order. A contender first runs
``--warmup`` passes unmeasured (Ray: its worker processes start, files enter the page cache),
then passes for ``--seconds``. Per pass it times the start-up (from asking for the pass to its
first batch) apart from the steady state (every later batch), and reports the steady records/s
(records after each pass's first batch over the time after it), the records/s over whole passes
(start-ups included), the median per-pass start-up, and the CPU seconds each process spent per
pass (the driver, Ray's worker processes, raylet, GCS, ...), read from /proc for the driver's
whole process tree. A Ray contender's last pass prints ``ds.stats()``.

    python benchmarks/ray.py [--rounds 5] [--seconds 6] [--warmup 1] [--records 4096]
        [--only NAME ...] [--out benchmarks/results]

The table goes to ``ray.md``; with ``--records`` other than W1's 4096 (longer passes, where a
pass's start-up weighs less), to ``ray-RECORDS.md``.

Contenders: ``local`` (``ds.loader(256, epochs=1)``, default threads), and Ray on a local
cluster of the machine's CPUs (an object store of one pass and 1 GiB more, 2 GiB at least) reading through
``stoker.ray.read(ds, batch_size=256)``: with stoker's default task count, with the 200 tasks
Ray asks a datasource for by default, with Ray Data's per-operator resource reservation off
(``DataContext.op_resource_reservation_enabled = False``), Ray's floor at both settings: the
same tasks and blocks with no file read at all (each block a view of zeros made once per worker
process), and the consumer's floor: ``iter_batches`` over the dataset's blocks already in the
object store (``materialize()`` once, before the passes), Ray's iteration with no execution.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import (
    Rounds,
    add_out_argument,
    alternate,
    cached_sample,
    child_json,
    default_cache,
    median_of,
    ratio_table,
    summary_table,
    table,
    write_results,
)

# This script is named like the package it measures: its own directory, first on the import
# path when it runs, would make ``import ray`` import this file.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]

BATCH = 256

# name -> settings: read= stoker.ray.read's arguments, ctx= DataContext attributes,
# iter= iter_batches' arguments.
RAY_CONTENDERS: dict[str, dict[str, Any]] = {
    # stoker's own task count (StokerDatasource.default_tasks): one per 128 MiB block, >= 2 per CPU.
    "ray": {},
    # What Ray asks a datasource for by default (DataContext.read_op_min_num_blocks): 200 tasks.
    "ray, 200 tasks": {"read": {"override_num_blocks": 200}},
    # Ray Data's per-operator reservation off: the read's outputs may use the whole object store.
    "ray, reservation off": {"ctx": {"op_resource_reservation_enabled": False}},
    # Ray's own floor: stoker's tasks and blocks, each block a view of zeros made once per worker
    # process instead of read from the files (Ray moving the bytes), at Ray's default settings and
    # at the best setting above.
    "ray floor: no file read": {"floor": True},
    "ray floor: no file read, reservation off": {"floor": True, "ctx": {"op_resource_reservation_enabled": False}},
    # The consumer's floor: the blocks already in the object store, each pass only iterates them
    # (Ray Data's iter_batches with no tasks to run); it needs an object store that holds them.
    "ray floor: iterate blocks already in the object store": {"materialized": True},
}
_ZEROS: dict[str, Any] = {}  # per worker process: the floor's zeros


def _floor_source(source: Any) -> Any:
    """A Datasource with ``source``'s tasks and blocks whose blocks are views of zeros."""
    from ray.data.block import BlockAccessor
    from ray.data.datasource import Datasource, ReadTask

    def blocks(rows: list[int]) -> Any:
        import numpy as np

        if "image" not in _ZEROS:
            _ZEROS.update(image=np.zeros((max(rows), 128, 128, 1), np.int8), label=np.zeros(max(rows), np.float32))
        for n in rows:
            yield BlockAccessor.batch_to_block({k: v[:n] for k, v in _ZEROS.items()})

    class Floor(Datasource):  # type: ignore[misc]
        def estimate_inmemory_data_size(self) -> int:
            return int(source.estimate_inmemory_data_size())

        def get_read_tasks(self, parallelism: int, **kw: Any) -> list[Any]:
            out = []
            for task in source.get_read_tasks(parallelism, **kw):
                rows = [sum(p.stop - p.start for p in b) for b in task.read_fn._blocks()]
                out.append(ReadTask(lambda rows=rows: blocks(rows), task.metadata))
            return out

    return Floor()


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process and every process below it, by kind (/proc)."""
    procs: dict[int, tuple[int, str, float]] = {}  # pid -> (parent, name, cpu seconds)
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd on: state, ppid, ...
        procs[int(entry)] = (int(rest[1]), name, (int(rest[11]) + int(rest[12])) / tick)
    mine = {os.getpid()}
    grew = True
    while grew:
        below = {pid for pid, (parent, _, _) in procs.items() if parent in mine} - mine
        grew = bool(below)
        mine |= below
    out: dict[str, float] = {}
    for pid in mine:
        _, name, cpu = procs[pid]
        if pid == os.getpid():
            kind = "driver"
        elif name.startswith("ray::_"):
            kind = name  # Ray's own actors (stats, autoscaling coordinator)
        elif name.startswith("ray::"):
            kind = "Ray worker processes (read tasks)"
        elif name.startswith(("raylet", "gcs_server")):
            kind = name
        else:
            kind = "other Ray processes (agents, log monitor, ...)"
        out[kind] = out.get(kind, 0.0) + cpu
    return out


def _passes(make_pass: Any, seconds: float, warmup: int, expected: int) -> dict[str, Any]:
    """Warm-up passes, then passes for ``seconds``: steady records/s, start-ups, CPU per pass.
    Every timed pass must deliver ``expected`` records (the dataset's), or the contender fails."""
    first_pass = None
    for w in range(warmup):
        t = time.perf_counter()
        for _ in make_pass():
            pass
        if w == 0:
            first_pass = time.perf_counter() - t
    cpu0 = _cpu_seconds()
    starts: list[float] = []
    records = 0
    first_records = 0
    steady = 0.0
    began = time.perf_counter()
    while time.perf_counter() - began < seconds or len(starts) < 2:
        t0 = time.perf_counter()
        batches = iter(make_pass())
        first = len(next(batches)["image"])
        t1 = time.perf_counter()
        starts.append(t1 - t0)
        rest = sum(len(batch["image"]) for batch in batches)
        steady += time.perf_counter() - t1
        if first + rest != expected:
            raise RuntimeError(f"a pass delivered {first + rest} records, the dataset has {expected}")
        first_records += first
        records += rest
    cpu1 = _cpu_seconds()
    whole = time.perf_counter() - began
    cpu = {k: (v - cpu0.get(k, 0.0)) / len(starts) for k, v in cpu1.items()}
    return {
        "records_per_s": records / steady, "whole_records_per_s": (records + first_records) / whole,
        "startup_s": statistics.median(starts), "passes": len(starts), "pass_s": whole / len(starts),
        "cpu_per_pass": cpu, "first_pass_s": first_pass,
    }  # fmt: skip


def _dataset(data: str) -> Any:
    import stoker

    return stoker.Dataset(
        image=stoker.Field(f"{data}/img_*.bin", "int8", (128, 128, 1)),
        label=stoker.Field(f"{data}/out_*.bin.gz", "float32"),
    )


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    ds = _dataset(cfg["data"])
    if cfg["kind"] == "local":
        with ds.loader(BATCH, epochs=1) as loader:
            return _passes(lambda: loader, cfg["seconds"], cfg["warmup"], len(ds))
    import ray

    import stoker.ray

    ray.init(
        num_cpus=cfg["cpus"], object_store_memory=cfg["store_gib"] << 30, include_dashboard=False,
        log_to_driver=False, configure_logging=False,
    )  # fmt: skip
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    for key, value in cfg.get("ctx", {}).items():
        setattr(ctx, key, value)
    if cfg.get("floor"):
        source = stoker.ray.StokerDatasource(ds, batch_size=BATCH)
        rds = ray.data.read_datasource(_floor_source(source), override_num_blocks=source.default_tasks())
    else:
        rds = stoker.ray.read(ds, batch_size=BATCH, **cfg.get("read", {}))
    if cfg.get("materialized"):
        rds = rds.materialize()
    iter_args = cfg.get("iter", {})
    out = _passes(
        lambda: rds.iter_batches(batch_size=BATCH, batch_format="numpy", **iter_args), cfg["seconds"], cfg["warmup"],
        len(ds),
    )  # fmt: skip
    out["stats"] = rds.stats()
    ray.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured passes before the timed ones")
    ap.add_argument("--records", type=int, default=4096, help="records per group (W1: 4096)")
    ap.add_argument("--only", nargs="*", help="contender names to run (default: all)")
    add_out_argument(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    data = str(cached_sample(f"{default_cache()}/sample-16x{args.records}x128", records=args.records))
    cpus = len(os.sched_getaffinity(0))
    # Room in the object store for one whole pass (the materialized contender holds one), 2 GiB at least.
    ds = _dataset(data)
    pass_bytes = len(ds) * sum(field.record_bytes for field in ds.fields.values())
    store_gib = max(2, -(-pass_bytes // (1 << 30)) + 1)
    base = {"data": data, "seconds": args.seconds, "warmup": args.warmup, "cpus": cpus, "store_gib": store_gib}
    contenders = {"local": {**base, "kind": "local"}}
    contenders.update({name: {**base, "kind": "ray", **cfg} for name, cfg in RAY_CONTENDERS.items()})
    if args.only:
        contenders = {k: v for k, v in contenders.items() if k in args.only or k == "local"}
    rounds = alternate(list(contenders), args.rounds,
                       lambda name: child_json(name, [__file__, "--child", json.dumps(contenders[name])]))  # fmt: skip
    what = "W1 int8" if args.records == 4096 else f"W1's layout with {args.records} records a file"
    title = f"Ray Data vs the local loader, {what} ({cpus} cores, {args.rounds} alternated rounds)"
    name = "ray" if args.records == 4096 else f"ray-{args.records}"
    body = _report(args, rounds, cpus, store_gib)
    write_results(name, title, body, script=__file__, out=args.out, frameworks=["ray"])
    return 0


def _report(args: argparse.Namespace, rounds: Rounds, cpus: int, store_gib: int) -> str:
    results = {name: rounds.ok(name) for name in rounds.contenders}
    lines = [
        f"16 groups x {args.records} records of 128x128 int8 + gzip float32 labels, "
        f"no cast, batch {BATCH}, one pass per epoch; Ray: a local cluster of {cpus} CPUs, {store_gib} GiB "
        "object store, `stoker.ray.read(ds, batch_size=256, ...)`. Steady: records after each pass's first "
        "batch over the time after it. Whole passes: every record over the passes' whole time, start-ups "
        "included. Start-up: from asking for a pass to its first batch (median over passes).",
        "",
        summary_table(rounds, label="steady records/s", columns={
            "whole passes, records/s": median_of("whole_records_per_s"),
            "start-up s/pass": median_of("startup_s", "{:.3f}"),
            "pass s": median_of("pass_s", "{:.3f}"),
            "CPU s/pass": lambda ms: f"{statistics.median(sum(m['cpu_per_pass'].values()) for m in ms):.2f}",
        }),
        ratio_table(rounds, [(n, "local", f"{n} / local, steady records/s") for n in results if n != "local"]),
        ratio_table(rounds, [(n, "local", f"{n} / local, whole passes") for n in results if n != "local"],
                    metric="whole_records_per_s"),
    ]  # fmt: skip
    lines += ["", "Per-pass start-up on its own line (median over rounds of each round's median):", ""]
    for name, ms in results.items():
        first = [m["first_pass_s"] for m in ms if m["first_pass_s"] is not None]
        lines.append(
            f"- {name}: {statistics.median(m['startup_s'] for m in ms):.3f} s per pass to its first batch"
            + (f"; the first pass of a process (workers starting): {statistics.median(first):.2f} s whole" if first
               else "")
        )  # fmt: skip
    lines += ["", "Where the CPU goes, seconds per pass (median over rounds):", ""]
    kinds = sorted({k for ms in results.values() for m in ms for k in m["cpu_per_pass"]})
    rows = []
    for kind in kinds:
        cells = [statistics.median(m["cpu_per_pass"].get(kind, 0.0) for m in ms) for ms in results.values()]
        if max(cells) >= 0.005:
            rows.append([kind, *(f"{c:.3f}" for c in cells)])
    lines.append(table(["process", *results], rows))
    for name, ms in results.items():
        if ms and "stats" in ms[-1]:
            lines += ["", f"`ds.stats()` of the last pass of `{name}` (last round):", "", "```"]
            lines += [ln.rstrip() for ln in ms[-1]["stats"].strip().splitlines()]
            lines += ["```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
