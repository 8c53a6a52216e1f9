"""Will the accelerator starve? Accelerator utilization (AU) under an emulated training step, and
what loading costs the host, for stoker and its peers on W1.

MLPerf Storage scores a storage system by AU: the emulated step's time over the wall time,
passing at 90%. Here every contender's consumer takes a batch, then sleeps ``STEP`` ms (the host
thread idle, as while an accelerator computes), for ``--seconds`` after ``--warmup`` seconds of the
same; AU is the time in the step over the wall time (`stoker.cli.steps.take`, which `stoker bench
--step` uses too). The host's cost is the CPU time of the contender's whole process tree over
the window (the DataLoader's worker processes included), as cores (CPU seconds over wall
seconds) and CPU seconds per GB of records delivered.

Contenders (W1: 16 x 4096 int8 128x128 frames + gzip float32 labels, float32 images out, batch
256, warm cache), each built as benchmarks/compare.py builds it:

- ``stoker``: its loader, as ``stoker bench`` runs it;
- ``ceiling``: the stepped ceiling loop of ``stoker bench --step`` (one producer thread per core
  into pooled buffers, the consumer steps on each);
- ``tf.data best``: ``stoker.tf.native_dataset``;
- ``grain``: a batched source, ``num_threads`` = cores;
- ``torch DataLoader``: ``__getitems__`` reading whole batches, ``num_workers`` = cores.

Every (contender, step) runs in a fresh process, once per round, in alternated order.
``--baseline SRC`` adds ``stoker baseline``: the loader of another tree's sources (``SRC``, its
``src/`` folder, e.g. main's worktree), run as ``stoker`` is, to weigh a change in the same rounds.
``--busy N`` runs N processes that spin on the CPU beside every contender (the other work of a
shared machine, made the same for each) and writes ``au_busy.*`` instead of ``au.*``.

    python benchmarks/au.py [--rounds 3] [--seconds 2] [--warmup 1] [--steps 1,2,5,20]
                            [--contenders stoker,ceiling,...] [--baseline SRC] [--busy N]
                            [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import compare
from harness import (
    Rounds,
    Run,
    Spread,
    Stepped,
    add_out_argument,
    alternate,
    batch_rows,
    child_json,
    default_cache,
    stoker_child,
    table,
    take_stepped,
    write_results,
)

CONTENDERS = ("stoker", "ceiling", "tf.data best", "grain", "torch DataLoader")
BASELINE = "stoker baseline"
STEPS = (1.0, 2.0, 5.0, 20.0)
RECORD_BYTES = compare.RES * compare.RES + 4  # an int8 frame and its float32 label, as stored


def tree_cpu() -> float:
    """CPU seconds of this process and every process under it (the DataLoader's workers)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # a worker that ended since it was listed
            total += sum(p.cpu_times()[:2])
    return total


def child(kind: str, data: Path, step_ms: float, seconds: float, warmup: float) -> dict[str, Any]:
    """One peer under a step: its batches taken with the step, in this process."""
    for word, module in compare.FRAMEWORKS.items():
        if word in kind:
            importlib.import_module(module)
    it = compare.batches(kind, "W1", data)
    step = step_ms / 1000
    next(it)  # start-up and the first batch excluded, as for stoker
    take_stepped(it, seconds=warmup, step=step, kind="sleep", rows=batch_rows, record_bytes=RECORD_BYTES)
    cpu = tree_cpu()
    s = take_stepped(it, seconds=seconds, step=step, kind="sleep", rows=batch_rows, record_bytes=RECORD_BYTES)
    s = dataclasses.replace(s, cpu_seconds=tree_cpu() - cpu)
    return {"records": s.records, "seconds": s.seconds, "stepped": s.to_dict()}


def run_one(kind: str, step_ms: float, data: Path, seconds: float, warmup: float, baseline: str | None) -> Run:
    name = f"{kind} @{step_ms:g}ms"
    step = {"step_ms": step_ms, "step_kind": "sleep", "seconds": seconds, "warmup": warmup}
    if kind in ("stoker", BASELINE):
        cfg = {"fields": compare.stoker_fields("W1", data), "batch": compare.BATCH, "cast": {"image": "float32"},
               **step}  # fmt: skip
        if kind == BASELINE:
            assert baseline is not None
            args = ["-m", "stoker.cli.bench", "stoker", json.dumps(cfg)]
            return child_json(name, args, env={"PYTHONPATH": baseline})
        return stoker_child(name, "stoker", cfg)
    if kind == "ceiling":
        paths = sorted(str(p) for p in data.glob("img_*.bin"))
        cfg = {"paths": paths, "header": 0, "shape": [compare.RES, compare.RES, 1], "src_dtype": "|i1",
               "out_dtype": "float32", "batch": compare.BATCH, "loop": "stepped", "threads": compare.cores(),
               **step}  # fmt: skip
        return stoker_child(name, "ceiling", cfg)
    argv = [__file__, "--child", kind, "--data", str(data), "--step", str(step_ms), "--seconds", str(seconds),
            "--warmup", str(warmup)]  # fmt: skip
    return child_json(name, argv, env={"TF_CPP_MIN_LOG_LEVEL": "2"})


SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    sum(range(10000))\n"


@contextlib.contextmanager
def busy(processes: int, seconds: float) -> Iterator[None]:
    """`processes` processes spinning on the CPU while the block runs (at most `seconds`), each
    stopped by its PID after it."""
    spinning = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in spinning:
            p.kill()
            p.wait(timeout=10)


def baseline_name(src: str | None) -> str | None:
    """The baseline's sources as a reader can find them again: its folder and git commit."""
    if src is None:
        return None
    head = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{src} at {head.stdout.strip()}" if head.returncode == 0 else src


def _figures(rounds: Rounds, name: str) -> list[Stepped]:
    return [Stepped.from_dict(r["stepped"]) for r in rounds.ok(name)]


def report(rounds: Rounds, kinds: list[str], steps: list[float], meta: dict[str, Any]) -> str:
    def cell(kind: str, ms: float, figure: str, fmt: str) -> str:
        values = [getattr(s, figure) for s in _figures(rounds, f"{kind} @{ms:g}ms")]
        return Spread.of(values).text(fmt, brackets="[]") if values else "failed"

    head = ["contender", *(f"{ms:g} ms" for ms in steps)]
    au = table(head, [[k, *(cell(k, ms, "utilization", "{:.1%}") for ms in steps)] for k in kinds])
    cpu = table(head, [[k, *(cell(k, ms, "cpu_seconds_per_gb", "{:.2f}") for ms in steps)] for k in kinds])
    cores = table(head, [[k, *(cell(k, ms, "cores", "{:.2f}") for ms in steps)] for k in kinds])
    return "\n".join([
        f"{meta['rounds']} alternated rounds of {meta['seconds']:g}s after {meta['warmup']:g}s of warm-up, each "
        f"(contender, step) in a fresh process; W1, float32 images out, batch {compare.BATCH}, warm cache, "
        f"{meta['cores']} cores. A sleep of the step after every batch; median [min..max] of the rounds.",
        *([f"`{BASELINE}`: the loader of {meta['baseline']}, run as `stoker` is, in the same rounds."]
          if meta.get("baseline") else []),
        *([f"Beside every run, {meta['busy']} process(es) spinning on the CPU (the other work of a shared machine)."]
          if meta.get("busy") else []),
        "",
        "Accelerator utilization (time in the step / wall time; MLPerf Storage passes at 90%):",
        "",
        au,
        "CPU seconds per GB of records delivered (the contender's whole process tree):",
        "",
        cpu,
        "Cores used (CPU seconds / wall seconds):",
        "",
        cores,
    ])  # fmt: skip


COLORS = {"stoker": "tab:orange", BASELINE: "tab:brown", "ceiling": "black", "tf.data best": "tab:blue",
          "grain": "tab:green", "torch DataLoader": "tab:purple"}  # fmt: skip


def medians(rounds: Rounds, kinds: list[str], steps: list[float]) -> dict[str, dict[str, dict[str, float]]]:
    """Each contender's median AU, CPU-s/GB and cores at each step it ran."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind in kinds:
        for ms in steps:
            figures = _figures(rounds, f"{kind} @{ms:g}ms")
            if figures:
                out.setdefault(kind, {})[f"{ms:g}"] = {
                    f: Spread.of(getattr(s, f) for s in figures).median
                    for f in ("utilization", "cpu_seconds_per_gb", "cores", "records_per_s")
                }
    return out


def chart(figures: dict[str, dict[str, dict[str, float]]], steps: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for kind, by_step in figures.items():
        at = [float(ms) for ms in by_step]
        style: dict[str, Any] = {"color": COLORS.get(kind), "marker": "o", "label": kind}
        if kind == "stoker":
            style["linewidth"] = 2.5
        if kind == "ceiling":
            style["linestyle"] = ":"
        left.plot(at, [100 * f["utilization"] for f in by_step.values()], **style)
        right.plot(at, [f["cpu_seconds_per_gb"] for f in by_step.values()], **style)
    left.axhline(90, color="tab:red", linestyle="--", linewidth=1, label="MLPerf Storage pass (90%)")
    right.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter

    right.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    right.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    for ax, title in ((left, "accelerator utilization, % (median)"), (right, "CPU seconds per GB (median)")):
        ax.set_xscale("log")
        ax.set_xticks(steps, [f"{ms:g}" for ms in steps])
        ax.set_xlabel("emulated step per batch of 256, ms")
        ax.set_title(title)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds each contender runs with the step untimed")
    ap.add_argument("--steps", default=",".join(f"{s:g}" for s in STEPS), help="milliseconds per batch")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset of the contenders")
    ap.add_argument("--baseline", help="another tree's src/ folder, run as the contender 'stoker baseline'")
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU beside every contender")
    ap.add_argument("--cache", default=default_cache())
    add_out_argument(ap)  # au.md and its history, au.json (every run's figures), au.png; au_busy.* with --busy
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--step", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, Path(args.data), args.step, args.seconds, args.warmup)))
        return 0
    kinds = [k.strip() for k in args.contenders.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in CONTENDERS]
    if unknown:
        ap.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    if args.baseline:
        if not (Path(args.baseline) / "stoker" / "__init__.py").is_file():
            ap.error(f"--baseline {args.baseline} is not a src/ folder holding stoker/")
        kinds.insert(kinds.index("stoker") + 1 if "stoker" in kinds else 0, BASELINE)
    steps = [float(s) for s in args.steps.split(",")]
    data = compare.w1_data(Path(args.cache))
    runs = {f"{k} @{ms:g}ms": (k, ms) for ms in steps for k in kinds}

    # A contender that fails is reported and left out of its round; the others go on.
    def one(name: str) -> Run:
        with busy(args.busy, seconds=120):
            return run_one(*runs[name], data, args.seconds, args.warmup, args.baseline)

    rounds = alternate(list(runs), args.rounds, one, keep_going=True)
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cores": compare.cores(), "rounds": args.rounds,
            "seconds": args.seconds, "warmup": args.warmup, "baseline": baseline_name(args.baseline),
            "busy": args.busy}  # fmt: skip
    title = f"Accelerator utilization under an emulated step ({compare.cores()} cores, W1, batch {compare.BATCH})"
    results = "au_busy" if args.busy else "au"
    if args.busy:
        title += f", {args.busy} process(es) spinning beside it"
    write_results(results, title, report(rounds, kinds, steps, meta), script=__file__, out=args.out, argv=argv,
                  frameworks=["tensorflow", "torch", "grain"])  # fmt: skip
    figures = medians(rounds, kinds, steps)
    runs_json = {name: rounds.runs[name] for name in runs}
    (Path(args.out) / f"{results}.json").write_text(
        json.dumps({"meta": meta, "medians": figures, "runs": runs_json}, indent=1)
    )
    try:
        chart(figures, steps, Path(args.out) / f"{results}.png")
    except ImportError:
        print("matplotlib is not installed: no chart (pip install 'stoker[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
