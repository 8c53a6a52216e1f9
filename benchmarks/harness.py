"""What every script under benchmarks/ shares: child runs, rounds, medians, ratios, tables, results files.

A benchmark names its contenders, says how one of them runs once (usually in a fresh child
process: `child_json`), and hands both to `alternate`, which runs every contender
once per round, in the opposite order every other round (this kind of machine drifts by tens of
percent within a minute, so a contender is compared with the others of its own round). The
figures come back as `Rounds`: medians and spreads per contender, per-round ratios
against a baseline. `summary_table` and `ratio_table` render them as markdown, and
`write_results` writes `results/NAME.md` (the exact command, the machine, the table) and
appends the same to `results/NAME_history.md`.

stoker's internals that the benchmarks drive (the ceiling loops and the loader's child of
`stoker.cli.bench`, the cached sample, the loader's stats) are imported here and nowhere else under
benchmarks/, so a move of those modules changes this file only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stoker.cli import dataset_from_fields
from stoker.cli.bench import (
    CEILING_LOOPS,
    COMPRESSED_CEILING_LOOPS,
    batch_rows,
    burn,
    evict_page_cache,
    output_buffer,
)
from stoker.cli.sample import cached_sample, expected_label
from stoker.cli.steps import Stepped
from stoker.cli.steps import take as take_stepped
from stoker.engine.records import RecordReader
from stoker.engine.stats import LoaderStats
from stoker.io.readahead import Readahead, physical_memory

__all__ = [
    "CEILING_LOOPS",
    "COMPRESSED_CEILING_LOOPS",
    "RESULTS",
    "ChildFailed",
    "Column",
    "LoaderStats",
    "Readahead",
    "RecordReader",
    "Rounds",
    "Run",
    "Spread",
    "Stepped",
    "add_out_argument",
    "alternate",
    "burn",
    "cached_sample",
    "child_json",
    "command_line",
    "dataset_from_fields",
    "default_cache",
    "evict_page_cache",
    "expected_label",
    "machine",
    "median_of",
    "output_buffer",
    "physical_memory",
    "ratio_table",
    "stoker_child",
    "summary_table",
    "table",
    "take_stepped",
    "versus_table",
    "time_batches",
    "write_results",
]

RESULTS = Path(__file__).resolve().parent / "results"
# Where a failing child's stderr is cut: its traceback's end says what went wrong.
STDERR_TAIL = 2000

Run = dict[str, Any]  # one contender's figures from one round, as its child printed them


class ChildFailed(RuntimeError):
    """A benchmark child exited non-zero (or printed no JSON); carries the end of its stderr."""

    def __init__(self, contender: str, returncode: int, stderr: str) -> None:
        self.contender = contender
        self.returncode = returncode
        self.stderr_tail = stderr[-STDERR_TAIL:]
        super().__init__(f"benchmark child {contender!r} failed (exit status {returncode}):\n{self.stderr_tail}")


def default_cache() -> str:
    """Where the benchmarks keep generated data: $STOKER_CACHE, else .stoker-cache (as `stoker bench`)."""
    return os.environ.get("STOKER_CACHE", ".stoker-cache")


def _with_rates(out: Run) -> Run:
    """Add records/s (and MB/s where bytes were counted) to a child's figures."""
    if "records" in out and "seconds" in out and "records_per_s" not in out:
        out["records_per_s"] = out["records"] / out["seconds"] if out["seconds"] else 0.0
        if "bytes_read" in out:
            out["mb_per_s"] = out["bytes_read"] / out["seconds"] / 1e6 if out["seconds"] else 0.0
    return out


def child_json(
    contender: str, args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
) -> Run:
    """Run `python args...` in a fresh process; return the JSON object on the last line it prints.

    `records_per_s` (and `mb_per_s` with `bytes_read`) are added where the child reported
    `records` and `seconds`. A child that fails, prints no JSON or outlives `timeout` seconds
    raises `ChildFailed` naming `contender`, with the end of its stderr. `env`: variables
    set for the child on top of this process's environment.
    """
    try:
        proc = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, check=False, timeout=timeout,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        raise ChildFailed(contender, -9, f"{err}\n(killed after {timeout:g} s)") from None
    if proc.returncode != 0:
        raise ChildFailed(contender, proc.returncode, proc.stderr)
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        raise ChildFailed(contender, 0, f"{proc.stderr}\n(no JSON object on the last line of its output)")
    return _with_rates(out)


def stoker_child(contender: str, kind: str, cfg: Mapping[str, Any]) -> Run:
    """One run of stoker's loader (`kind="stoker"`) or a ceiling loop (`"ceiling"`), as
    `stoker.cli.bench` measures them (see its docstring for `cfg`), in a fresh process."""
    return child_json(contender, ["-m", "stoker.cli.bench", kind, json.dumps(dict(cfg))])


def time_batches(
    batches: Iterator[Any],
    seconds: float,
    *,
    warmup: float = 0.0,
    began: float | None = None,
    step: Callable[[], None] | None = None,
    sync: Callable[[Any], None] | None = None,
) -> dict[str, float]:
    """Records per second of `batches` in their steady state, for the benchmark scripts' children.

    The first batch, then every batch until `warmup` seconds after `began` (default: now;
    pass the time before the pipeline was built to count its start-up into the warm-up), run
    unmeasured; then `seconds` are timed. `step()` runs after each batch but the first (a
    consumer's own work); `sync(batch)` waits for a device before the clock starts and stops.
    """
    began = time.perf_counter() if began is None else began
    batch = next(batches)
    while time.perf_counter() - began < warmup:
        batch = next(batches)
        if step is not None:
            step()
    if sync is not None:
        sync(batch)
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(batches)
        n += batch_rows(batch)
        if step is not None:
            step()
    if sync is not None:
        sync(batch)
    return {"records": n, "seconds": time.perf_counter() - start}


@dataclass(frozen=True)
class Spread:
    """Median, min and max of some figures."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        vs = list(values)
        if not vs:
            raise ValueError("no figures to summarize (every run of the contender failed)")
        return cls(statistics.median(vs), min(vs), max(vs))

    def text(self, fmt: str = "{:.2f}", brackets: str = "()") -> str:
        """`median (min..max)`, each in `fmt`."""
        return f"{fmt.format(self.median)} {brackets[0]}{fmt.format(self.low)}..{fmt.format(self.high)}{brackets[1]}"


@dataclass
class Rounds:
    """Every contender's figures, round by round (None where its run failed), and the order run."""

    contenders: tuple[str, ...]
    runs: dict[str, list[Run | None]] = field(default_factory=dict)
    order: list[tuple[int, str]] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return max((len(v) for v in self.runs.values()), default=0)

    def ok(self, contender: str) -> list[Run]:
        """The contender's runs that did not fail."""
        return [r for r in self.runs.get(contender, []) if r is not None]

    def values(self, contender: str, metric: str = "records_per_s") -> list[float]:
        return [float(r[metric]) for r in self.ok(contender)]

    def spread(self, contender: str, metric: str = "records_per_s") -> Spread:
        return Spread.of(self.values(contender, metric))

    def ratios(self, contender: str, baseline: str | Sequence[str], metric: str = "records_per_s") -> list[float]:
        """`contender / baseline` in each round where both ran; a sequence of baselines: the
        best of them in that round (e.g. the fastest ceiling loop)."""
        names = [baseline] if isinstance(baseline, str) else list(baseline)
        out = []
        for r, run in enumerate(self.runs.get(contender, [])):
            bases = [self.runs.get(n, [])[r] if r < len(self.runs.get(n, [])) else None for n in names]
            if run is None or any(b is None for b in bases):
                continue
            best = max(float(b[metric]) for b in bases if b is not None)
            if best:
                out.append(float(run[metric]) / best)
        return out


def alternate(
    contenders: Sequence[str],
    rounds: int,
    run: Callable[[str], Run],
    *,
    keep_going: bool = False,
    show: str | None = "records_per_s",
    label: str = "",
) -> Rounds:
    """Run every contender once per round, `rounds` times, in reverse order every other round.

    `run(name)` measures one contender once and returns its figures. With `keep_going`, a
    run raising `ChildFailed` is reported on stderr and recorded as None (the others go
    on); else it propagates. Each result's `show` figure is printed to stderr as it comes,
    prefixed by `label`.
    """
    out = Rounds(tuple(contenders), {name: [] for name in contenders})
    for r in range(rounds):
        for name in contenders if r % 2 == 0 else reversed(contenders):
            out.order.append((r, name))
            result: Run | None
            try:
                result = run(name)
            except ChildFailed as e:
                if not keep_going:
                    raise
                print(f"  {e}", file=sys.stderr)
                result = None
            out.runs[name].append(result)
            if show is not None:
                unit = {"records_per_s": "records/s", "mb_per_s": "MB/s"}.get(show, show)
                figure = f"{result[show]:>12,.0f} {unit}" if result else "failed"
                print(f"  {label}round {r + 1}: {name:<32} {figure}", file=sys.stderr, flush=True)
    return out


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> str:
    """A markdown table; `align`: one letter per column, `l` or `r` (default: the first
    column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


Column = Callable[[list[Run]], object]  # an extra cell of a contender's row, from its runs


def median_of(metric: str, fmt: str = "{:,.0f}") -> Column:
    """A column: the median of `metric` over a contender's runs."""
    return lambda runs: fmt.format(statistics.median(float(r[metric]) for r in runs)) if runs else ""


def summary_table(
    rounds: Rounds,
    *,
    metric: str = "records_per_s",
    label: str = "records/s",
    fmt: str = "{:,.0f}",
    columns: Mapping[str, Column] | None = None,
    first: str = "contender",
) -> str:
    """One row per contender: the median, min and max of `metric`, then `columns`."""
    columns = columns or {}
    header = [first, f"{label} median", "min", "max", *columns]
    rows: list[list[object]] = []
    for name in rounds.contenders:
        runs = rounds.ok(name)
        if not runs:
            rows.append([name, "failed", "", "", *("" for _ in columns)])
            continue
        s = rounds.spread(name, metric)
        rows.append([name, fmt.format(s.median), fmt.format(s.low), fmt.format(s.high),
                     *(col(runs) for col in columns.values())])  # fmt: skip
    return table(header, rows)


Pair = tuple[str, str | Sequence[str]] | tuple[str, str | Sequence[str], str]


def ratio_table(rounds: Rounds, pairs: Iterable[Pair], *, metric: str = "records_per_s", fmt: str = "{:.2f}") -> str:
    """One row per `(contender, baseline[, label])`: the median, min and max of the per-round
    ratios contender / baseline (a sequence of baselines: the best of them each round). Pairs
    with no round where both ran are left out."""
    rows = []
    for pair in pairs:
        a, b = pair[0], pair[1]
        named = b if isinstance(b, str) else "best of " + ", ".join(b)
        text = pair[2] if len(pair) == 3 else f"{a} / {named}"
        rs = rounds.ratios(a, b, metric)
        if rs:
            s = Spread.of(rs)
            rows.append([text, fmt.format(s.median), fmt.format(s.low), fmt.format(s.high)])
    return table(["ratio (per round, same round)", "median", "min", "max"], rows)


def versus_table(
    rounds: Rounds,
    rows: Iterable[tuple[str, str, str, str]],
    header: Sequence[str],
    *,
    fmt: str = "{:,.2f}",
    ratio_fmt: str = "{:.2f}",
) -> str:
    """One row per `(label, contender, baseline, metric)`: the baseline's median, the
    contender's, and the per-round ratios contender / baseline as `median (min..max)` (an A/B
    of two versions, figure by figure). `header`: the four column titles."""
    cells = []
    for label, a, b, metric in rows:
        rs = rounds.ratios(a, b, metric)
        if not rs:
            cells.append([label, "failed", "failed", ""])
            continue
        base, this = rounds.spread(b, metric).median, rounds.spread(a, metric).median
        cells.append([label, fmt.format(base), fmt.format(this), Spread.of(rs).text(ratio_fmt)])
    return table(header, cells)


def add_out_argument(ap: argparse.ArgumentParser) -> None:
    """`--out DIR`: where NAME.md and NAME_history.md are written (default benchmarks/results)."""
    ap.add_argument("--out", default=str(RESULTS), help="directory for the results table and its history")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# Distributions a framework also ships as (TensorFlow's CPU-only wheel is a distribution of its own).
_ALSO_AS = {"tensorflow": ("tensorflow-cpu",)}


def _version(dist: str) -> str | None:
    for name in (dist, *_ALSO_AS.get(dist, ())):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine(frameworks: Sequence[str] = ()) -> str:
    """One line: cores, CPU model, RAM, OS, Python, and numpy's and `frameworks`' versions."""
    cores = len(os.sched_getaffinity(0))
    versions = [f"{d} {v}" for d in ("numpy", *frameworks) if (v := _version(d))]
    versions += [f"{d} not installed" for d in frameworks if _version(d) is None]
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cores} cores ({os.cpu_count()} online), {_cpu_model()}, {physical_memory() / 2**30:.1f} GiB RAM, "
        f"{platform.system()} {platform.machine()}, Python {platform.python_version()}, {', '.join(versions)}; "
        f"load average {load} when written"
    )


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """`python benchmarks/SCRIPT.py ARGS`: the command that made a table (`argv`: sys.argv[1:])."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", f"benchmarks/{Path(script).name}", *args])


def write_results(
    name: str,
    title: str,
    body: str,
    *,
    script: str,
    out: str | Path = RESULTS,
    argv: Sequence[str] | None = None,
    frameworks: Sequence[str] = (),
    now: float | None = None,
) -> Path:
    """Write `out/NAME.md` (title, command, machine, `body`), append it to `out/NAME_history.md`
    under a UTC timestamp, print it, and return the table's path.

    `script`: the benchmark's `__file__`; `argv`: its arguments (default sys.argv[1:]);
    `frameworks`: the distributions whose versions the machine line gives beside numpy's.
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(now))
    head = f"Command: `{command_line(script, argv)}`\n\nMachine: {machine(frameworks)}\n"
    latest = f"# {title}\n\n{head}\n{body.rstrip()}\n"
    path = folder / f"{name}.md"
    path.write_text(latest)
    history = folder / f"{name}_history.md"
    if not history.exists():
        history.write_text(
            f"# History of `{command_line(script, [])}` runs\n\nEach run as it was recorded, newest last.\n"
        )
    with history.open("a") as f:
        f.write(f"\n## {stamp}: {title}\n\n{head}\n{body.rstrip()}\n")
    print(latest)
    return path
