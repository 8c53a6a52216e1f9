"""The `stoker` command: a thin layer over the public API (sample, inspect, index, bench)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..dataset import Dataset
from ..errors import CorruptDataError, PairingError, ReadError, SpecError, StaleIndexError, StokerError
from ..machine import available_cores, cores_phrase
from ..spec import resolve_cast
from .config import build_fields, dataset_from_fields, fields_from_config, parse_field
from .sample import CONFIG_NAME, cached_sample, directory_contents, write_sample

__all__ = ["dataset_from_fields", "main", "parse_field"]


def _field_specs(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    if args.config and args.field:
        raise SpecError("give --field or --config, not both")
    if args.config:
        return fields_from_config(args.config)
    if args.field:
        return [parse_field(f) for f in args.field]
    return None


def _sample_fields(directory: Path, inrez: int | None) -> list[dict[str, Any]]:
    """A sample directory's fields: from its `stoker.toml` unless `--inrez` says otherwise.

    Where it has none, the `stoker sample` layout is assumed, and that is said on stderr."""
    specs, layout, assumed = _sample_layout(directory, inrez)
    if assumed:
        print(f"stoker: {layout}", file=sys.stderr)
    return specs


def _sample_layout(directory: Path, inrez: int | None) -> tuple[list[dict[str, Any]], str, bool]:
    """(fields, a sentence saying where they came from, whether they were assumed)."""
    config = directory / CONFIG_NAME
    if inrez is None and config.is_file():
        return fields_from_config(str(config)), f"from {config}", False
    given = inrez is not None
    inrez = 128 if inrez is None else inrez
    specs: list[dict[str, Any]] = [
        {"name": "image", "files": str(directory / "img_*.bin"), "dtype": "int8", "shape": [inrez, inrez, 1]},
        {"name": "label", "files": str(directory / "out_*.bin.gz"), "dtype": "float32", "compression": "gzip"},
    ]
    shape = f"{inrez}x{inrez}x1"
    if given:
        return specs, f"the `stoker sample` layout with --inrez {inrez} (image int8 {shape}, label float32 gzip)", False
    return (
        specs,
        (
            f"{directory} has no {CONFIG_NAME}: assumed the `stoker sample` layout (img_*.bin int8 {shape}, "
            "out_*.bin.gz float32 gzip); give another with --inrez N, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] "
            "or --config FILE"
        ),
        True,
    )


class _Progress:
    """Progress of a long step on stderr: a bar redrawn in place on a terminal; elsewhere (a
    log, a pipe) a plain line at most every `LINE_SECONDS`, and one at the end."""

    LINE_SECONDS = 10.0
    WIDTH = 30

    def __init__(self, total: int, label: str, unit: str = "") -> None:
        self.total, self.label, self.unit, self.done = total, label, unit, 0
        self.live = sys.stderr.isatty()
        self.started = self.said = time.perf_counter()

    def step(self, note: str = "") -> None:
        self.done += 1
        now = time.perf_counter()
        part = f"{self.done}/{self.total}{' ' + self.unit if self.unit else ''}"
        finished = self.done >= self.total
        if self.live:
            filled = self.WIDTH * self.done // max(1, self.total)
            bar = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}]"
            sys.stderr.write(f"\r{self.label} {bar} {part} {note}".rstrip() + ("\n" if finished else ""))
            sys.stderr.flush()
        elif finished or now - self.said >= self.LINE_SECONDS:
            self.said = now
            share = self.done / max(1, self.total)
            print(f"{self.label}: {part} ({share:.0%}) after {now - self.started:.1f}s", file=sys.stderr, flush=True)


def cmd_sample(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    present = directory_contents(out)
    if present and not args.force:
        shown = ", ".join(p.name for p in present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise SpecError(
            f"stoker sample: {args.dir!r} is not empty ({shown}); writing there would mix a new sample with "
            "what is there. Give an empty or new directory, or --force to replace a sample's own files "
            "(img_*.bin, out_*.bin.gz, stoker.toml, its index) and leave everything else",
            path=args.dir,
        )
    t = time.perf_counter()
    bar = _Progress(args.pairs, "sample", "pairs")
    write_sample(
        out,
        pairs=args.pairs,
        records=args.records,
        inrez=args.inrez,
        replace=args.force,
        progress=lambda done, total: bar.step(),
    )
    total = args.pairs * args.records * (args.inrez * args.inrez)
    print(f"wrote {args.pairs} pairs x {args.records} records ({_size(total)} of images) to {out} "
          f"in {time.perf_counter() - t:.1f}s")  # fmt: skip
    return 0


def _size(nbytes: float) -> str:
    """Bytes in one style everywhere `inspect` prints them: B below 1 KiB, else KiB/MiB/GiB/TiB."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            break
    return f"{nbytes:.1f} {unit}"


# `inspect` prints a row per group up to this many groups, a summary beyond (rows with --groups).
SUMMARY_OVER = 20
_VALUES_SHOWN = 8  # values of a record printed by --values before "..."


def _problem_word(e: StokerError) -> str:
    """What a row says of a group that cannot be read (the error is printed below the table)."""
    if isinstance(e, PairingError):
        return "MISMATCH"
    if isinstance(e, CorruptDataError):
        return "CORRUPT"
    if isinstance(e, StaleIndexError):
        return "STALE"
    return "ERROR"


def _inspect_rows(
    specs: list[dict[str, Any]], pair_key: str | None
) -> tuple[Dataset | None, list[dict[str, Any]], dict[str, Any]]:
    """(the Dataset where it builds, one row per group, the fields' layouts).

    A row: `group`, `records` (None where unknown), `files` (per field: path, bytes,
    compression, and the word marking a bad file), `problem` (the error's text). Where one
    bad file stops the whole Dataset from building, each group is looked at on its own, so
    the other groups' rows are still there.
    """
    try:
        ds: Dataset | None = dataset_from_fields(specs, pair_key=pair_key)
    except (CorruptDataError, ReadError, StaleIndexError, PairingError) as whole:
        ds = None
        error: StokerError = whole
    if ds is not None:
        rows = []
        for g, infos in enumerate(ds.files):
            files = {
                n: {"path": i.path, "bytes": i.size, "compression": i.compression or "raw", "mark": None}
                for n, i in infos.items()
            }
            row: dict[str, Any] = {"group": g, "records": None, "files": files, "status": "ok", "problem": None}
            try:
                row["records"] = ds.records_in(g)
            except StokerError as e:  # keep going: the user wants every broken group, not the first
                _fail(row, e)
            rows.append(row)
        layouts = {
            n: {"dtype": f.dtype.name, "shape": list(f.shape), "record_bytes": f.record_bytes}
            for n, f in ds.fields.items()
        }
        return ds, rows, layouts
    from ..io.files import expand_files

    fields = build_fields(specs)
    paths = {n: expand_files(n, f) for n, f in fields.items()}
    if len({len(p) for p in paths.values()}) > 1:
        raise error  # files that pair by position cannot be told apart
    by_name = {s["name"]: s for s in specs}
    rows = []
    for g in range(len(next(iter(paths.values())))):
        files = {n: {"path": paths[n][g], "bytes": _file_bytes(paths[n][g]), "compression": "?", "mark": None}
                 for n in fields}  # fmt: skip
        row = {"group": g, "records": None, "files": files, "status": "ok", "problem": None}
        for n, f in files.items():  # each file alone first, so the row marks the one that is bad
            try:
                info = dataset_from_fields([{**by_name[n], "files": [f["path"]]}]).files[0][n]
                f["bytes"], f["compression"] = info.size, info.compression or "raw"
            except StokerError as e:
                if row["problem"] is None:
                    row["status"], row["problem"] = _problem_word(e), f"{type(e).__name__}: {e}"
                f["mark"] = _problem_word(e)
        if row["problem"] is None:
            try:
                group = [{**s, "files": [paths[s["name"]][g]]} for s in specs]
                row["records"] = dataset_from_fields(group, pair_key=pair_key).records_in(0)
            except StokerError as e:
                _fail(row, e)
        rows.append(row)
    layouts = {
        n: {"dtype": f.dtype.name, "shape": list(f.shape), "record_bytes": f.record_bytes} for n, f in fields.items()
    }
    return None, rows, layouts


def _file_bytes(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _fail(row: dict[str, Any], e: StokerError) -> None:
    """Say in `row` why its group cannot be read, marking the file the error names (a count
    mismatch is the group's, not one file's)."""
    row["status"], row["problem"] = _problem_word(e), f"{type(e).__name__}: {e}"
    if not isinstance(e, PairingError):
        for f in row["files"].values():
            if e.path is not None and f["path"] == e.path:
                f["mark"] = row["status"]


def _relative_base(rows: list[dict[str, Any]]) -> str | None:
    """The directory every local file lies under (rows then show paths relative to it)."""
    paths = [f["path"] for r in rows for f in r["files"].values()]
    if not paths or any("://" in p for p in paths):
        return None
    base = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    rel = os.path.relpath(base)
    return base if rel.startswith("..") else rel


def cmd_inspect(args: argparse.Namespace) -> int:
    specs = _field_specs(args)
    if specs is not None:
        layout = "from --config " + args.config if args.config else "from --field"
    else:
        if not args.dir:
            raise SpecError("inspect needs a sample DIR, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] or --config")
        specs, layout, _ = _sample_layout(Path(args.dir), args.inrez)
    for flag, value in (("--values", args.values), ("--offset", args.offset)):
        if value < 0:
            raise SpecError(f"stoker inspect {flag} {value}: must be 0 or more")
    if not args.json:
        print(f"layout: {layout}", flush=True)  # said before anything is read: an error below may follow from it
    ds, rows, layouts = _inspect_rows(specs, args.pair_key)
    names = list(layouts)
    base = _relative_base(rows)
    bad = [r for r in rows if r["problem"] is not None]
    total = sum(r["records"] or 0 for r in rows if r["problem"] is None)
    nbytes = sum(f["bytes"] or 0 for r in rows for f in r["files"].values())
    values = _values(ds, specs, rows, args.values, args.offset) if args.values else []
    if args.json:
        doc = {
            "layout": layout,
            "fields": layouts,
            "base": base,
            "groups": [
                {**r, "files": {n: {**f, "path": _shown(f["path"], base)} for n, f in r["files"].items()}} for r in rows
            ],
            "total_records": total,
            "total_bytes": nbytes,
            "in_sync": not bad,
            "problems": [r["problem"] for r in bad],
            "values": [{"record": i, **{n: v.tolist() for n, v in rec.items()}} for i, rec in values],
        }
        print(json.dumps(doc, indent=2))
        return 1 if bad else 0
    print(
        f"{len(rows)} groups, fields: "
        + ", ".join(
            f"{n} ({lay['dtype']}{lay['shape']}, {_size(lay['record_bytes'])}/record)" for n, lay in layouts.items()
        )
    )
    if base is not None:
        print(f"files under {base}{os.sep}")
    shown = rows if args.groups or len(rows) <= SUMMARY_OVER else bad
    if len(rows) > SUMMARY_OVER and not args.groups:
        _print_summary(rows, names)
    if shown:
        if len(shown) < len(rows):
            print(f"groups that cannot be read ({len(shown)} of {len(rows)}):")
        table = [["group", "records", *(f"{n} (size, compression)" for n in names)]]
        for r in shown:
            records = str(r["records"]) if r["problem"] is None else r["status"]
            cells = []
            for n in names:
                f = r["files"][n]
                size = _size(f["bytes"]) if f["bytes"] is not None else "?"
                mark = f", {f['mark']}" if f["mark"] else ""
                cells.append(f"{_shown(f['path'], base)} ({size}, {f['compression']}{mark})")
            table.append([str(r["group"]), records, *cells])
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            right = [c.rjust(w) for c, w in zip(row[:2], widths, strict=False)]
            left = [c.ljust(w) for c, w in zip(row[2:], widths[2:], strict=False)]
            print("  ".join(right + left).rstrip())
    print(f"total: {total} records, {_size(nbytes)} on disk")
    for i, rec in values:
        print(f"record {i}: " + "; ".join(f"{n} {_record_text(v)}" for n, v in rec.items()))
    if bad:
        print(f"sync: OUT OF SYNC or unreadable in {len(bad)} group(s); no record of those groups would be yielded:")
        for r in bad:
            print(f"  group {r['group']}: {r['problem']}")
        return 1
    print("sync: every group's fields hold the same number of records (in sync)")
    return 0


def _shown(path: str, base: str | None) -> str:
    if base is None:
        return path
    return os.path.relpath(os.path.abspath(path), os.path.abspath(base))


def _print_summary(rows: list[dict[str, Any]], names: list[str]) -> None:
    counts = sorted(r["records"] for r in rows if r["problem"] is None)
    if counts:
        med = counts[len(counts) // 2]
        print(f"records per group: min {counts[0]}, median {med}, max {counts[-1]} (a row per group: --groups)")
    for n in names:
        files = [r["files"][n] for r in rows]
        sizes = sorted(f["bytes"] for f in files if f["bytes"] is not None)
        kinds = sorted({f["compression"] for f in files} - {"?"}) or ["?"]
        spread = f" ({_size(sizes[0])} to {_size(sizes[-1])} a file)" if sizes else ""
        print(f"field {n}: {len(files)} files, {_size(sum(sizes))}{spread}, {'/'.join(kinds)}")


def _values(
    ds: Dataset | None, specs: list[dict[str, Any]], rows: list[dict[str, Any]], count: int, offset: int
) -> list[tuple[int, dict[str, np.ndarray]]]:
    """`count` records from record `offset` on, over the groups that can be read."""
    good = [r["group"] for r in rows if r["problem"] is None]
    if not good:
        return []
    if ds is not None:
        readable: Dataset = ds if len(good) == len(rows) else ds.select(groups=good)
    else:
        by_name = {s["name"]: [rows[g]["files"][s["name"]]["path"] for g in good] for s in specs}
        readable = dataset_from_fields([{**s, "files": by_name[s["name"]]} for s in specs], pair_key="")
    n = len(readable)
    if offset >= n:
        raise SpecError(f"stoker inspect --offset {offset}: the readable groups hold {n} records")
    picked = np.arange(offset, min(n, offset + count))
    batch = readable.read(picked)
    return [(int(i), {k: v[j] for k, v in batch.items()}) for j, i in enumerate(picked)]


def _record_text(v: np.ndarray) -> str:
    """A record's values in a line: scalars whole, arrays by shape, first values, min and max."""
    if v.ndim == 0:
        return repr(v.item())
    flat = v.reshape(-1)
    head = ", ".join(repr(x) for x in flat[:_VALUES_SHOWN].tolist())
    more = ", ..." if flat.size > _VALUES_SHOWN else ""
    return f"{list(v.shape)} [{head}{more}] min {flat.min().item()!r} max {flat.max().item()!r}"


def cmd_index(args: argparse.Namespace) -> int:
    from ..io.index import write_index
    from ..io.indexlock import WRITE_WAIT
    from ..io.seekpoints import SPACING

    specs = _field_specs(args)
    if specs is None:
        if not args.dir:
            raise SpecError("index needs a sample DIR, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] or --config")
        specs = _sample_fields(Path(args.dir), args.inrez)
    t = time.perf_counter()
    # The index on disk is what is being rewritten: never read it (it may be stale or old).
    ds = dataset_from_fields(specs, pair_key=args.pair_key, index="ignore")
    bar = _Progress(ds.num_groups * len(ds.fields), "index", "files")
    written = write_index(
        ds,
        spacing=SPACING if args.spacing is None else args.spacing,
        index_dir=args.index_dir,
        progress=lambda path: bar.step(os.path.basename(path)),
        wait=WRITE_WAIT if args.wait is None else args.wait,
    )
    nfiles = ds.num_groups * len(ds.fields)
    print(f"indexed {nfiles} files of {ds.num_groups} groups ({len(ds)} records) in {time.perf_counter() - t:.1f}s")
    for path in written:
        print(f"wrote {path}")
    return 0


def _bench_cache() -> Path:
    return Path(os.environ.get("STOKER_CACHE", ".stoker-cache"))


def _run_compare(args: argparse.Namespace) -> int:
    """`stoker bench --compare`: benchmarks/compare.py of the source checkout stoker runs from."""
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "compare.py"
    if not script.is_file():
        raise SpecError(f"--compare runs {script}, which is not there: run it from a source checkout of stoker")
    rounds = 5 if args.rounds is None else args.rounds  # the minimum for peer comparisons
    argv = [sys.executable, str(script), "--rounds", str(rounds), "--seconds", str(args.seconds),
            "--warmup", str(args.warmup)]  # fmt: skip
    if args.workloads:
        argv += ["--workloads", args.workloads]
    import subprocess

    return subprocess.run(argv, check=False).returncode


def _check_bench_numbers(args: argparse.Namespace) -> None:
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


def cmd_bench(args: argparse.Namespace) -> int:
    _check_bench_numbers(args)
    if args.compare:
        given = [f for f, v in (("--threads", args.threads), ("--prefetch", args.prefetch),
                                ("--memory-budget", args.memory_budget), ("--cycle-length", args.cycle_length),
                                ("--block-length", args.block_length)) if v is not None]  # fmt: skip
        if given:
            raise SpecError(
                f"stoker bench --compare runs every contender in its own best configuration; {', '.join(given)} "
                "set stoker's loader for a run without --compare"
            )
        return _run_compare(args)
    if args.rounds is None:
        args.rounds = 3
    from ..doctor import verdict
    from ..engine.stats import LoaderStats
    from .bench import measure, summarize

    specs = _field_specs(args)
    if specs is None:
        writing = _Progress(args.pairs, "sample", "pairs")
        directory = cached_sample(
            _bench_cache() / f"sample-{args.pairs}x{args.records}x{args.inrez}",
            pairs=args.pairs, records=args.records, inrez=args.inrez, progress=lambda done, total: writing.step(),
        )  # fmt: skip
        specs = _sample_fields(directory, args.inrez)
    ds = dataset_from_fields(specs)
    cast = _parse_cast(args.cast)
    settings = {"threads": args.threads, "prefetch": args.prefetch, "memory_budget": args.memory_budget,
                "cycle_length": args.cycle_length, "block_length": args.block_length}  # fmt: skip
    # Its argument checks (cast, threads, prefetch, memory_budget, interleave) here, not in a
    # child's traceback.
    ds.loader(args.batch_size, cast=cast, **{k: v for k, v in settings.items() if v is not None}).close()
    contenders: dict[str, dict[str, Any]] = {
        "stoker": {
            "fields": specs,
            "batch": args.batch_size,
            "cast": cast,
            "seconds": args.seconds,
            "warmup": args.warmup or True,
            **settings,
        },
    }
    widest = max(ds.fields, key=lambda n: ds.fields[n].record_bytes)
    if not args.no_ceiling:
        f = ds.fields[widest]
        out = resolve_cast(ds.fields, cast)[widest]
        out_dtype = _dtype_arg(out)
        paths = [i[widest].path for i in ds.files]
        threads = available_cores()
        # The widest field bounds the copy; compressed, its decompression bounds it instead.
        compressed = any(i[widest].compression is not None for i in ds.files)
        for loop in ("inflate_cast",) if compressed else ("mmap_kept", "mmap_stream", "preadv_cast"):
            contenders[f"ceiling:{loop}"] = {
                "paths": paths, "header": f.header_bytes, "shape": list(f.shape), "src_dtype": _dtype_arg(f.dtype),
                "out_dtype": out_dtype, "batch": args.batch_size, "loop": loop, "threads": threads,
                "seconds": args.seconds, "warmup": args.warmup,
            }  # fmt: skip
    shown = ", ".join(f"{k}={v}" for k, v in cast.items()) if isinstance(cast, dict) else cast or "none"
    print(f"{ds!r}: {len(ds)} records; batch {args.batch_size}, cast {shown}; "
          f"{args.rounds} alternated rounds of {args.seconds:g}s, each after {args.warmup:g}s of warm-up")  # fmt: skip
    bar = _Progress(args.rounds * len(contenders), "bench", "runs")
    results = measure(contenders, rounds=args.rounds, on_result=lambda r, m: bar.step(f"{m.contender}"))
    print(f"{'contender':<22} {'records/s (median)':>19} {'min':>10} {'max':>10} {'MB/s':>8}")
    for name, ms in results.items():
        med, lo, hi = summarize([m.records_per_s for m in ms])
        mb = summarize([m.mb_per_s for m in ms])[0]
        print(f"{name:<22} {med:>19,.0f} {lo:>10,.0f} {hi:>10,.0f} {mb:>8,.0f}")
    ceilings = [k for k in results if k.startswith("ceiling")]
    # Per round: stoker over the best ceiling loop of that same round (a round whose ceiling
    # loops made no record in their timed window, files with no records, gives no ratio).
    best = [max(results[c][r].records_per_s for c in ceilings) for r in range(args.rounds)] if ceilings else []
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
    runs = sorted(results["stoker"], key=lambda m: m.records_per_s)
    median_run = runs[len(runs) // 2]
    if median_run.stats:
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
        print(f"verdict: {verdict(stats, ratio)}")
    return 0


def _add_field_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--field",
        action="append",
        metavar="NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]",
        help="a field of the dataset, repeated for each field; SHAPE as 128x128x1, COMPRESSION "
        "gzip, zlib, none or auto (default: no --field: DIR's fields)",
    )
    p.add_argument(
        "--config",
        metavar="stoker.toml",
        help="read [fields.NAME] tables from a TOML file (default: none; DIR/stoker.toml for a DIR)",
    )


def _add_dir_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("dir", nargs="?", help=f"a directory written by `stoker sample` ({what})")
    p.add_argument(
        "--inrez",
        type=int,
        default=None,
        help="frame size of a sample DIR (default: its stoker.toml; 128 where it has none)",
    )
    p.add_argument(
        "--pair-key",
        default=None,
        metavar="REGEX",
        help="regex whose match must agree across a group's basenames "
        "(default: the numbers in the basenames; '' turns the check off)",
    )


_SAMPLE_EXAMPLES = """\
examples:
  stoker sample data/                  # 16 pairs x 4096 records of 128x128 int8 frames (1 GiB) into data/
  stoker sample data/ --pairs 2 --records 100 --inrez 32
  stoker sample data/ --force          # replace an earlier sample there (its files and index only)
"""
_INSPECT_EXAMPLES = """\
examples:
  stoker inspect data/                 # a `stoker sample` directory (its stoker.toml says the fields)
  stoker inspect --field 'image=data/img_*.bin:int8:128x128x1' --field 'label=data/out_*.bin.gz:float32:gzip'
  stoker inspect --config data/stoker.toml --groups     # a row per group, however many
  stoker inspect data/ --values 3      # the first 3 records' values
  stoker inspect data/ --json | jq .total_records
"""
_INDEX_EXAMPLES = """\
examples:
  stoker index data/                   # count and seek-index every file of a `stoker sample` directory
  stoker index --config data/stoker.toml --spacing 4194304
"""
_BENCH_EXAMPLES = """\
examples:
  stoker bench                         # a ~1 GiB sample (written once into .stoker-cache/) against the ceiling
  stoker bench --config data/stoker.toml --batch-size 512 --cast image=float16
  stoker bench --field 'x=data/*.bin:uint8:64x64x3' --rounds 5 --seconds 5
  stoker bench --compare --workloads W1,W3    # tf.data, DataLoader and Grain beside stoker (source checkout)
"""


def _version() -> str:
    from .. import __version__
    from ..kernels import compiled

    kernels = "compiled kernels" if compiled() else "no compiled kernels: the numpy slow path"
    return f"stoker {__version__} ({kernels}; Python {sys.version.split()[0]})"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions wrapped as argparse wraps them; epilogs (the examples) kept line for line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    raw = _HelpFormatter
    parser = argparse.ArgumentParser(
        prog="stoker",
        description="Feed accelerators from fixed-length record files.",
        epilog="`stoker COMMAND --help` shows each command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "sample",
        help="write a dataset in the seed's layout (int8 images + gzip float32 labels)",
        description="Write a sample dataset: img_NNNN.bin (int8 frames, the record's index in "
        "its first 4 bytes) and out_NNNN.bin.gz (its float32 label), with a stoker.toml "
        "saying so.",
        epilog=_SAMPLE_EXAMPLES,
        formatter_class=raw,
    )
    p.add_argument("dir", help="the directory to write (new or empty, or a former sample's with --force)")
    p.add_argument("--pairs", type=int, default=16, help="image/label file pairs (default: 16)")
    p.add_argument("--records", type=int, default=4096, help="records per file (default: 4096)")
    p.add_argument("--inrez", type=int, default=128, help="frames are INREZ x INREZ x 1 int8 (default: 128)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a directory that is not empty, replacing only a sample's own files "
        "(img_*.bin, out_*.bin.gz, stoker.toml) and its index (default: refuse)",
    )
    p.set_defaults(run=cmd_sample)
    p = sub.add_parser(
        "inspect",
        help="groups, records, bytes, compression and whether the fields are in sync",
        description="Show how the fields' files pair into groups, their record counts, sizes "
        "and compression, and whether every group's fields agree. Exits 1 when a group is out "
        "of sync or cannot be read (its row says which file).",
        epilog=_INSPECT_EXAMPLES,
        formatter_class=raw,
    )
    _add_dir_args(p, "default: give --field or --config instead")
    _add_field_args(p)
    p.add_argument(
        "--groups",
        action="store_true",
        help=f"a row for every group (default: rows up to {SUMMARY_OVER} groups, a summary and the "
        "groups with problems beyond)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table (default: off)")
    p.add_argument(
        "--values",
        type=int,
        default=0,
        metavar="N",
        help="print the values of N records, from --offset on (default: 0, none)",
    )
    p.add_argument("--offset", type=int, default=0, metavar="I", help="the first record --values prints (default: 0)")
    p.set_defaults(run=cmd_inspect)
    p = sub.add_parser(
        "index",
        help="write the persistent index (record counts, gzip seek points) beside the data",
        epilog=_INDEX_EXAMPLES,
        formatter_class=raw,
    )
    _add_dir_args(p, "default: give --field or --config instead")
    p.add_argument(
        "--spacing",
        type=int,
        default=None,
        help="decompressed bytes between seek points inside a gzip member or zlib stream (default 1 MiB)",
    )
    p.add_argument(
        "--index-dir",
        default=None,
        help="keep the index here instead of beside the data (for read-only data; default $STOKER_INDEX_DIR); "
        "read it with Dataset(..., index_dir=) or the same variable",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long to wait for another writer of the same index to finish before failing (default 600)",
    )
    _add_field_args(p)
    p.set_defaults(run=cmd_index)
    p = sub.add_parser(
        "bench",
        help="stream the dataset and compare with the machine's ceiling on the same files",
        description="Stream the dataset with stoker and with plain loops that only read and cast "
        "the widest field (the ceiling), in alternated rounds; print records/s, the ratio and "
        "a verdict.",
        epilog=_BENCH_EXAMPLES,
        formatter_class=raw,
    )
    _add_field_args(p)
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
    p.add_argument(
        "--compare",
        action="store_true",
        help="run benchmarks/compare.py: tf.data, DataLoader, Grain and stoker per workload (default: off)",
    )
    p.add_argument(
        "--workloads", help="with --compare: comma-separated subset of W1,W1-int8,W1-cold,W2,W3,W1-busy (default: all)"
    )
    p.add_argument("--pairs", type=int, default=16, help="sample pairs when no fields are given (default: 16)")
    p.add_argument("--records", type=int, default=4096, help="sample records per file (default: 4096)")
    p.add_argument("--inrez", type=int, default=128, help="sample frame size (default: 128)")
    p.set_defaults(run=cmd_bench)
    return parser


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except StokerError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `stoker inspect ... | head`: the reader left; no traceback for that
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
