"""`stoker bench`: stream a dataset with stoker and with the machine's ceiling loops on the same
files, in alternated rounds, and report records/s, the ratio and a verdict.

The contenders themselves (the child processes, the ceiling loops) are `stoker.cli.contenders`;
their names are re-exported here, and `python -m stoker.cli.bench CONTENDER JSON` still runs one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpecError
from ..machine import available_cores, cores_phrase
from ..spec import resolve_cast
from .bench_steps import add_step_args, add_stepped, report_steps
from .config import add_dir_args, add_field_args, dataset_from_fields, directory_layout, field_specs
from .contenders import (
    CEILING_LOOPS,
    COMPRESSED_CEILING_LOOPS,
    JUDGE_MIN_BATCHES,
    JUDGE_STARTUP_TIMES,
    Measurement,
    batch_rows,
    burn,
    child_json,
    child_main,
    evict_page_cache,
    measure,
    output_buffer,
    rounds_figures,
    run_child,
    summarize,
    too_short,
)
from .output import Progress, counted
from .sample import cached_sample
from .steps import parse_steps

__all__ = [
    "CEILING_LOOPS",
    "COMPRESSED_CEILING_LOOPS",
    "JUDGE_MIN_BATCHES",
    "JUDGE_STARTUP_TIMES",
    "Measurement",
    "add_parser",
    "batch_rows",
    "burn",
    "cache_dir",
    "child_json",
    "evict_page_cache",
    "measure",
    "output_buffer",
    "run",
    "run_child",
    "summarize",
]

# `benchmarks/compare.py` is the checkout's, not the package's: looked for here, under the
# current directory, unless --benchmarks names the folder.
COMPARE_SCRIPT = Path("benchmarks") / "compare.py"

EXAMPLES = """\
examples:
  stoker bench                         # a ~1 GiB sample, written once into ~/.cache/stoker, against the ceiling
  stoker bench data/                   # a directory: its stoker.toml (or the `stoker sample` layout)
  stoker bench --config data/stoker.toml --batch-size 512 --cast image=float16
  stoker bench --field 'x=data/*.bin:uint8:64x64x3' --rounds 5 --seconds 5
  stoker bench --step 1,2,5,20         # will a training step of 1..20 ms wait? AU, cores, CPU-s/GB
  stoker bench --step 2 --cold --json  # after dropping the page cache; every figure as JSON
  stoker bench --compare --workloads W1,W3    # tf.data, DataLoader and Grain beside stoker (from a checkout)
"""


def cache_dir() -> Path:
    """Where `stoker bench` keeps its generated sample: $STOKER_CACHE, else the user's cache
    directory ($XDG_CACHE_HOME/stoker, else ~/.cache/stoker), as the TF bridge's cache."""
    given = os.environ.get("STOKER_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoker"


def _run_compare(args: argparse.Namespace) -> int:
    """`stoker bench --compare`: benchmarks/compare.py of a checkout of stoker's repository."""
    script = Path(args.benchmarks) / "compare.py" if args.benchmarks else COMPARE_SCRIPT
    if not script.is_file() and args.benchmarks:
        raise SpecError(
            f"--compare: {script} is not there; --benchmarks names the benchmarks folder of a checkout of "
            "stoker's repository",
            path=str(script),
        )
    if not script.is_file():
        raise SpecError(
            "--compare needs a checkout of stoker's repository (benchmarks/compare.py); run it from there",
            path=str(script),
        )
    rounds = 5 if args.rounds is None else args.rounds  # the minimum for a comparison with peers
    argv = [sys.executable, str(script), "--rounds", str(rounds), "--seconds", str(args.seconds),
            "--warmup", str(args.warmup)]  # fmt: skip
    if args.workloads:
        argv += ["--workloads", args.workloads]
    return subprocess.run(argv, check=False).returncode


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse numbers no measurement can be made with, before any child process starts."""
    for flag, value, ok, need in (
        ("--rounds", args.rounds, args.rounds is None or args.rounds >= 1, "at least 1"),
        ("--seconds", args.seconds, args.seconds > 0, "more than 0"),
        ("--warmup", args.warmup, args.warmup >= 0, "0 or more"),
        ("--batch-size", args.batch_size, args.batch_size >= 1, "at least 1"),
    ):
        if not ok:
            raise SpecError(f"stoker bench {flag} {value:g}: must be {need}")


def _dtype_arg(dtype: np.dtype) -> str:
    """A dtype as the ceiling's child process reads it back (stoker.spec.resolve_dtype)."""
    return dtype.name if dtype.kind == "V" else dtype.str  # ml_dtypes' bfloat16: '<V2' would lose it


def _parse_cast(text: str | None) -> str | dict[str, str] | None:
    """`--cast`: one dtype for every field, `NAME=DTYPE[,NAME=DTYPE]` (the loader's cast map),
    or `none` (the stored dtypes: None)."""
    if text is None or text in ("none", "None", ""):
        return None
    if "=" not in text:
        return text
    cast: dict[str, str] = {}
    for item in text.split(","):
        name, sep, dtype = item.partition("=")
        if not sep or not name.strip() or not dtype.strip():
            raise SpecError(f"--cast {text!r}: {item!r} is not NAME=DTYPE (or give one dtype for every field)")
        cast[name.strip()] = dtype.strip()
    return cast


def _specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The fields to measure: --field/--config, a DIR, else the generated sample in cache_dir()."""
    specs = field_specs(args)
    if specs is not None:
        if args.dir:
            raise SpecError("give a DIR or --field/--config, not both")
        return specs
    if args.dir:
        return directory_layout(Path(args.dir), args.inrez, say_assumed=True)[0]
    inrez = 128 if args.inrez is None else args.inrez
    writing = Progress(args.pairs, "sample", "pairs")
    directory = cached_sample(
        cache_dir() / f"sample-{args.pairs}x{args.records}x{inrez}",
        pairs=args.pairs, records=args.records, inrez=inrez, progress=lambda done, total: writing.step(),
    )  # fmt: skip
    return directory_layout(directory, None)[0]


def run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    steps = parse_steps(args.step) if args.step else []
    if args.json and not args.compare:
        # The table and verdicts go to stderr, so stdout is the one JSON object.
        figures: dict[str, Any] = {}
        with contextlib.redirect_stdout(sys.stderr):
            code = _measure(args, steps, figures)
        print(json.dumps(figures, indent=1))
        return code
    return _measure(args, steps, {})


def _measure(args: argparse.Namespace, steps: list[float], figures: dict[str, Any]) -> int:
    """Run the contenders, print the report, and fill `figures` with every number in it."""
    if args.compare:
        if steps or args.cold or args.json:
            raise SpecError("--step, --cold and --json measure stoker against its ceiling; give them without --compare")
        given = [f for f, v in (("--threads", args.threads), ("--prefetch", args.prefetch),
                                ("--memory-budget", args.memory_budget), ("--cycle-length", args.cycle_length),
                                ("--block-length", args.block_length)) if v is not None]  # fmt: skip
        if given:
            raise SpecError(
                f"stoker bench --compare runs every contender in its own best configuration; {', '.join(given)} "
                "set stoker's loader for a run without --compare"
            )
        return _run_compare(args)
    rounds = 3 if args.rounds is None else args.rounds
    specs = _specs(args)
    ds = dataset_from_fields(specs, pair_key=args.pair_key)
    cast = _parse_cast(args.cast)
    settings = {"threads": args.threads, "prefetch": args.prefetch, "memory_budget": args.memory_budget,
                "cycle_length": args.cycle_length, "block_length": args.block_length}  # fmt: skip
    # Its argument checks (cast, threads, prefetch, memory_budget, interleave) here, not in a child's traceback.
    ds.loader(args.batch_size, cast=cast, **{k: v for k, v in settings.items() if v is not None}).close()
    # `warmup: True` at least: stoker's window starts after its first batch, never at iter().
    # Cold: one pass each, timed after its first batch; a warm-up or a second pass would read from memory.
    cold = {"evict": True, "once": True} if args.cold else {}
    contenders: dict[str, dict[str, Any]] = {
        "stoker": {"fields": specs, "batch": args.batch_size, "cast": cast, "seconds": args.seconds,
                   "warmup": args.warmup or True, "pair_key": args.pair_key, **settings, **cold},
    }  # fmt: skip
    add_stepped(contenders, "stoker", "stoker", steps, args.step_kind)
    widest = max(ds.fields, key=lambda n: ds.fields[n].record_bytes)
    if not args.no_ceiling:
        f = ds.fields[widest]
        out_dtype = _dtype_arg(resolve_cast(ds.fields, cast)[widest])
        paths = [i[widest].path for i in ds.files]
        # The widest field bounds the copy; compressed, its decompression bounds it instead.
        compressed = any(i[widest].compression is not None for i in ds.files)
        for loop in ("inflate_cast",) if compressed else ("mmap_kept", "mmap_stream", "preadv_cast"):
            contenders[f"ceiling:{loop}"] = {
                "paths": paths, "header": f.header_bytes, "shape": list(f.shape), "src_dtype": _dtype_arg(f.dtype),
                "out_dtype": out_dtype, "batch": args.batch_size, "loop": loop, "threads": available_cores(),
                "seconds": args.seconds, "warmup": 0 if args.cold else args.warmup, **cold,
            }  # fmt: skip
        if not compressed:
            add_stepped(contenders, "ceiling:mmap_kept", "ceiling:stepped", steps, args.step_kind)
    shown = ", ".join(f"{k}={v}" for k, v in cast.items()) if isinstance(cast, dict) else cast or "none"
    bar = Progress(rounds * len(contenders), "bench", "runs")
    done: dict[str, list[Measurement]] = {name: [] for name in contenders}

    def finished(r: int, m: Measurement) -> None:
        done[m.contender].append(m)
        bar.step(m.contender)

    try:  # the header too: a Ctrl-C the moment it is printed is a Ctrl-C during the rounds
        print(f"{ds!r}: {counted(len(ds), 'record')}; batch {args.batch_size}, cast {shown}; "
              f"{counted(rounds, 'alternated round')} of {args.seconds:g}s, each after {args.warmup:g}s of warm-up",
              flush=True)  # fmt: skip
        measure(contenders, rounds=rounds, on_result=finished)
    except KeyboardInterrupt:
        whole = min(len(ms) for ms in done.values())
        print(f"\ninterrupted: {counted(whole, 'round')} of {rounds} finished", flush=True)
        if whole:
            _report({name: ms[:whole] for name, ms in done.items()}, widest, args, steps, figures)
        return 130
    _report(done, widest, args, steps, figures)
    return 0


def _report(
    results: dict[str, list[Measurement]], widest: str, args: argparse.Namespace, steps: list[float],
    figures: dict[str, Any],
) -> None:  # fmt: skip
    """The table of every contender's rounds, stoker over the ceiling, the verdict, and under
    --step what each step sees."""
    from ..doctor import verdict
    from ..engine.stats import LoaderStats

    rounds = len(results["stoker"])
    figures.update({
        "batch_size": args.batch_size, "rounds": rounds, "seconds": args.seconds, "warmup": args.warmup,
        "cold": next((m.evicted for m in results["stoker"] if m.evicted), None) if args.cold else None,
        "contenders": {name: rounds_figures(ms) for name, ms in results.items()},
    })  # fmt: skip
    if args.cold:
        print(f"cold: page cache dropped before each run by {figures['cold']}")
    print(f"{'contender':<26} {'records/s (median)':>19} {'min':>10} {'max':>10} {'MB/s':>8}")
    for name, ms in results.items():
        med, lo, hi = summarize([m.records_per_s for m in ms])
        mb = summarize([m.mb_per_s for m in ms])[0]
        print(f"{name:<26} {med:>19,.0f} {lo:>10,.0f} {hi:>10,.0f} {mb:>8,.0f}")
    ceilings = [k for k in results if k.startswith("ceiling") and "step=" not in k]
    # Per round: stoker over the best ceiling loop of that same round (a round whose ceiling
    # loops made no record in their timed window, files with no records, gives no ratio).
    best = [max(results[c][r].records_per_s for c in ceilings) for r in range(rounds)] if ceilings else []
    ratios = [results["stoker"][r].records_per_s / b for r, b in enumerate(best) if b > 0]
    ratio: float | None = None
    if ceilings and not ratios:
        print("stoker / ceiling: not measured (the ceiling loops made no record in their timed window)")
    elif ceilings:
        med, lo, hi = summarize(ratios)
        ratio = med
        loops = ", ".join(c.split(":", 1)[1] for c in ceilings)
        print(f"stoker / ceiling: median {med:.2f} (rounds {lo:.2f}..{hi:.2f}): {med:.0%} of ceiling "
              f"(ceiling: field {widest!r} on the same files, {loops})")  # fmt: skip
    else:
        print("ceiling not measured (--no-ceiling)")
    # The stoker round at the median rate stands for the run: its stage split and CPU.
    figures["ceiling_ratio"] = ratio
    if steps:
        report_steps(results, steps, args.batch_size, args.step_kind, figures)
    runs = sorted(results["stoker"], key=lambda m: m.records_per_s)
    median_run = runs[len(runs) // 2]
    if not median_run.stats:
        return
    stats = LoaderStats.from_dict(median_run.stats)
    # Its timed rate, as the table counts it: the stats' own rate spans the loader's start-up
    # and warm-up too, and reads lower.
    print(f"stoker (median round): {median_run.records_per_s:,.0f} records/s, {median_run.mb_per_s:,.0f} MB/s; "
          f"CPU {stats.cpu_utilization:.0%} of {cores_phrase(stats.cores)}; {stats.settings}")  # fmt: skip
    print(f"you waited on stoker {stats.wait_fraction:.0%} of the loop; stoker waited on you "
          f"{stats.consumer_fraction:.0%}")  # fmt: skip
    firsts = [m.first_batch_seconds for m in results["stoker"] if m.first_batch_seconds is not None]
    if firsts:
        med, lo, hi = summarize(firsts)
        print(f"first batch after {med * 1000:,.0f} ms (rounds {lo * 1000:,.0f}..{hi * 1000:,.0f}): "
              "start-up, from iter(loader): threads, file maps, the first new buffers")  # fmt: skip
    print(stats.stage_split)
    if stats.busy_split:
        print(stats.busy_split)
    short = too_short(median_run, args.batch_size, 0.0 if args.cold else args.warmup, cold=args.cold)
    figures["verdict"] = short or verdict(stats, ratio)
    print(f"verdict: {figures['verdict']}")
    for said in figures.get("step_verdicts", []):
        print(f"verdict: {said}")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="stream the dataset and compare with the machine's ceiling on the same files",
        description="Stream the dataset with stoker and with plain loops that only read and cast "
        "the widest field (the ceiling), in alternated rounds; print records/s, the ratio and "
        "a verdict. Without DIR, --field or --config: a generated sample, written once into "
        "$XDG_CACHE_HOME/stoker (else ~/.cache/stoker; $STOKER_CACHE overrides both).",
        epilog=EXAMPLES,
    )
    add_dir_args(
        p,
        "default: a generated sample",
        inrez_help="frame size of a sample DIR without a stoker.toml, or of the generated sample (default: 128)",
    )
    add_field_args(p)
    p.add_argument("--batch-size", type=int, default=256, help="records per batch (default: 256)")
    p.add_argument(
        "--cast",
        default="float32",
        help="output dtype of every field, or NAME=DTYPE[,NAME=DTYPE] per field ('none' to keep stored types) "
        "(default: float32)",
    )
    p.add_argument("--rounds", type=int, default=None, help="alternated rounds (default: 3; 5 with --compare)")
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per contender per round (default: 3)")
    p.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds each contender runs before it is timed: its steady state is measured (default: 1)",
    )
    p.add_argument("--threads", type=int, default=None, help="stoker's worker threads (default: autotuned)")
    p.add_argument("--prefetch", type=int, default=None, help="batches in flight (default: from memory_budget)")
    p.add_argument(
        "--memory-budget",
        default=None,
        help="the loader's memory_budget, e.g. 1GiB (default: a quarter of the memory this process "
        "may use, at least 512MiB, and of the address space `ulimit -v` leaves: "
        "stoker.machine.default_memory_budget)",
    )
    p.add_argument("--cycle-length", type=int, default=None, help="files read side by side (default: min(files, 4))")
    p.add_argument("--block-length", type=int, default=None,
                   help="records read from a file before the next (default: ~4 MiB of the widest field)")  # fmt: skip
    p.add_argument("--no-ceiling", action="store_true", help="measure stoker alone (default: off)")
    add_step_args(p)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run (the whole cache as "
                   "root, else each file's pages) and say how; each run then reads the files once, timed after "
                   "its first batch, with no warm-up (default: off)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object on stdout (default: off)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="run benchmarks/compare.py of a checkout of stoker's repository: tf.data, DataLoader, Grain and "
        "stoker per workload (default: off)",
    )
    p.add_argument(
        "--benchmarks",
        metavar="DIR",
        default=None,
        help="with --compare: the checkout's benchmarks folder (default: ./benchmarks)",
    )
    p.add_argument(
        "--workloads", help="with --compare: comma-separated subset of W1,W1-int8,W1-cold,W2,W3,W1-busy (default: all)"
    )
    p.add_argument("--pairs", type=int, default=16, help="generated sample's pairs (default: 16)")
    p.add_argument("--records", type=int, default=4096, help="generated sample's records per file (default: 4096)")
    p.set_defaults(run=run)
    return p


if __name__ == "__main__":  # a contender's child process, as `python -m stoker.cli.contenders`
    raise SystemExit(child_main(sys.argv[1:]))
