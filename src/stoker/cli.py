"""The ``stoker`` command: a thin layer over the public API (sample, inspect, index, bench)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .dataset import Dataset, resolve_cast
from .errors import PairingError, SpecError, StokerError
from .machine import available_cores, cores_phrase
from .sample import CONFIG_NAME, cached_sample, write_sample
from .spec import Field

__all__ = ["dataset_from_fields", "main", "parse_field"]

_COMPRESSION_WORDS = {"gzip": "gzip", "zlib": "zlib", "none": None, "raw": None, "auto": "auto"}


def parse_field(text: str) -> dict[str, Any]:
    """``NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]`` (shape as ``128x128x1``) -> field settings."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise SpecError(f"--field {text!r} must look like NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]")
    parts = rest.split(":")
    # The glob may itself hold ':'; dtype, shape and compression are the known tail words.
    tail: list[str] = []
    while len(parts) > 1 and len(tail) < 3:
        tail.insert(0, parts.pop())
    files = ":".join(parts)
    if not tail:
        raise SpecError(f"--field {text!r} names no dtype; use NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]")
    spec: dict[str, Any] = {"name": name, "files": files, "dtype": tail[0], "shape": [], "compression": "auto"}
    for word in tail[1:]:
        if word.lower() in _COMPRESSION_WORDS:
            spec["compression"] = _COMPRESSION_WORDS[word.lower()]
        elif word and all(p.isdigit() for p in word.lower().split("x")):
            spec["shape"] = [int(p) for p in word.lower().split("x")]
        else:
            raise SpecError(f"--field {text!r}: {word!r} is neither a shape like 128x128x1 nor a compression")
    return spec


def _fields_from_config(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise SpecError(f"cannot read config {path!r}: {e.strerror}", path=path) from e
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"config {path!r} is not valid TOML: {e}", path=path) from e
    table = doc.get("fields")
    if not isinstance(table, Mapping) or not table:
        raise SpecError(f"config {path!r} has no [fields.NAME] tables", path=path)
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for name, spec in table.items():
        if not isinstance(spec, Mapping) or "files" not in spec or "dtype" not in spec:
            raise SpecError(f"config {path!r}: [fields.{name}] needs files and dtype", path=path, field=name)
        files = spec["files"]
        if isinstance(files, str):
            files = files if os.path.isabs(files) else os.path.join(base, files)
        elif isinstance(files, list):
            files = [p if os.path.isabs(p) else os.path.join(base, p) for p in files]
        out.append({**spec, "name": name, "files": files})
    return out


def dataset_from_fields(
    specs: Sequence[Mapping[str, Any]], *, pair_key: str | None = None, index: str = "auto"
) -> Dataset:
    """A Dataset from field settings as ``parse_field`` or a config file give them."""
    fields = {}
    for s in specs:
        compression = s.get("compression", "auto")
        if isinstance(compression, str) and compression.lower() in ("none", "raw"):
            compression = None
        fields[s["name"]] = Field(
            s["files"],
            s["dtype"],
            tuple(s.get("shape", ())),
            header_bytes=int(s.get("header_bytes", 0)),
            footer_bytes=int(s.get("footer_bytes", 0)),
            compression=compression,
            byte_order=s.get("byte_order"),
        )
    return Dataset(fields, pair_key=pair_key, index=index)


def _field_specs(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    if args.config and args.field:
        raise SpecError("give --field or --config, not both")
    if args.config:
        return _fields_from_config(args.config)
    if args.field:
        return [parse_field(f) for f in args.field]
    return None


def _sample_fields(directory: Path, inrez: int | None) -> list[dict[str, Any]]:
    """A sample directory's fields: from its ``stoker.toml`` unless ``--inrez`` says otherwise."""
    config = directory / CONFIG_NAME
    if inrez is None and config.is_file():
        return _fields_from_config(str(config))
    inrez = 128 if inrez is None else inrez
    return [
        {"name": "image", "files": str(directory / "img_*.bin"), "dtype": "int8", "shape": [inrez, inrez, 1]},
        {"name": "label", "files": str(directory / "out_*.bin.gz"), "dtype": "float32", "compression": "gzip"},
    ]


class _Progress:
    """A one-line progress bar on stderr (silent when stderr is not a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.live = sys.stderr.isatty()

    def step(self, note: str = "") -> None:
        self.done += 1
        if self.live:
            width = 30
            filled = width * self.done // max(1, self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {note}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def cmd_sample(args: argparse.Namespace) -> int:
    t = time.perf_counter()
    out = write_sample(args.dir, pairs=args.pairs, records=args.records, inrez=args.inrez)
    total = args.pairs * args.records * (args.inrez * args.inrez)
    print(f"wrote {args.pairs} pairs x {args.records} records ({total / 2**20:.1f} MiB of images) to {out} "
          f"in {time.perf_counter() - t:.1f}s")  # fmt: skip
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    specs = _field_specs(args)
    if specs is None:
        if not args.dir:
            raise SpecError("inspect needs a sample DIR, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] or --config")
        specs = _sample_fields(Path(args.dir), args.inrez)
    ds = dataset_from_fields(specs, pair_key=args.pair_key)
    names = list(ds.fields)
    print(f"{ds.num_groups} groups, fields: " + ", ".join(
        f"{n} ({f.dtype.name}{list(f.shape)}, {f.record_bytes} B/record)" for n, f in ds.fields.items()))  # fmt: skip
    print(f"{'group':>5}  {'records':>9}  " + "  ".join(f"{n} (bytes, compression)" for n in names))
    total = 0
    problems: list[str] = []
    for g, infos in enumerate(ds.files):
        cells = [f"{infos[n].path} ({infos[n].size}, {infos[n].compression or 'raw'})" for n in names]
        try:
            records = str(ds.records_in(g))
            total += int(records)
        except PairingError as e:  # keep going: the user wants every broken group, not the first
            records = "MISMATCH"
            problems.append(str(e))
        print(f"{g:>5}  {records:>9}  " + "  ".join(cells))
    nbytes = sum(sum(i.size for i in infos.values()) for infos in ds.files)
    print(f"total: {total} records, {nbytes / 2**20:.1f} MiB on disk")
    if problems:
        print(f"sync: OUT OF SYNC in {len(problems)} group(s); no record of those groups would be yielded:")
        for p in problems:
            print(f"  {p}")
        return 1
    print("sync: every group's fields hold the same number of records (in sync)")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from .index import write_index
    from .seekpoints import SPACING

    specs = _field_specs(args)
    if specs is None:
        if not args.dir:
            raise SpecError("index needs a sample DIR, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] or --config")
        specs = _sample_fields(Path(args.dir), args.inrez)
    t = time.perf_counter()
    # The index on disk is what is being rewritten: never read it (it may be stale or old).
    ds = dataset_from_fields(specs, pair_key=args.pair_key, index="ignore")
    written = write_index(ds, spacing=SPACING if args.spacing is None else args.spacing)
    nfiles = ds.num_groups * len(ds.fields)
    print(f"indexed {nfiles} files of {ds.num_groups} groups ({len(ds)} records) in {time.perf_counter() - t:.1f}s")
    for path in written:
        print(f"wrote {path}")
    return 0


def _bench_cache() -> Path:
    return Path(os.environ.get("STOKER_CACHE", ".stoker-cache"))


def _run_compare(args: argparse.Namespace) -> int:
    """``stoker bench --compare``: benchmarks/compare.py of the source checkout stoker runs from."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
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
    from .bench import measure, summarize
    from .doctor import verdict
    from .stats import LoaderStats

    specs = _field_specs(args)
    if specs is None:
        directory = cached_sample(
            _bench_cache() / f"sample-{args.pairs}x{args.records}x{args.inrez}",
            pairs=args.pairs, records=args.records, inrez=args.inrez,
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
    bar = _Progress(args.rounds * len(contenders), "bench")
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
        # Its timed rate, as the table counts it (the stats' own rate spans the loader's start-up
        # and warm-up too: 527k beside a 591k median in a make demo).
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
    p.add_argument("--field", action="append", metavar="NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]",
                   help="a field of the dataset (repeat for each field)")  # fmt: skip
    p.add_argument("--config", metavar="stoker.toml", help="read [fields.NAME] tables from a TOML file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description="Feed accelerators from fixed-length record files.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample", help="write a dataset in the seed's layout (int8 images + gzip float32 labels)")
    p.add_argument("dir")
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--records", type=int, default=4096)
    p.add_argument("--inrez", type=int, default=128)
    p.set_defaults(run=cmd_sample)
    p = sub.add_parser("inspect", help="groups, records, bytes, compression and whether the fields are in sync")
    p.add_argument("dir", nargs="?", help="a directory written by `stoker sample`")
    p.add_argument("--inrez", type=int, default=None, help="frame size of a sample DIR (default: its stoker.toml)")
    p.add_argument("--pair-key", default=None, help="regex that must agree across a group's basenames")
    _add_field_args(p)
    p.set_defaults(run=cmd_inspect)
    p = sub.add_parser("index", help="write the persistent index (record counts, gzip seek points) beside the data")
    p.add_argument("dir", nargs="?", help="a directory written by `stoker sample`")
    p.add_argument("--inrez", type=int, default=None, help="frame size of a sample DIR (default: its stoker.toml)")
    p.add_argument("--pair-key", default=None, help="regex that must agree across a group's basenames")
    p.add_argument(
        "--spacing",
        type=int,
        default=None,
        help="decompressed bytes between seek points inside a gzip member or zlib stream (default 1 MiB)",
    )
    _add_field_args(p)
    p.set_defaults(run=cmd_index)
    p = sub.add_parser("bench", help="stream the dataset and compare with the machine's ceiling on the same files")
    _add_field_args(p)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--cast",
        default="float32",
        help="output dtype of every field, or NAME=DTYPE[,NAME=DTYPE] per field ('none' to keep stored types)",
    )
    p.add_argument("--rounds", type=int, default=None, help="alternated rounds (default 3; 5 with --compare)")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds each contender runs before it is timed: its steady state is measured (default 1)",
    )
    p.add_argument("--threads", type=int, default=None, help="stoker's worker threads (default: autotuned)")
    p.add_argument("--prefetch", type=int, default=None, help="batches in flight (default: from memory_budget)")
    p.add_argument("--memory-budget", default=None, help="the loader's memory_budget, e.g. 1GiB (default 512MiB)")
    p.add_argument("--cycle-length", type=int, default=None, help="files read side by side (default: min(files, 4))")
    p.add_argument("--block-length", type=int, default=None,
                   help="records read from a file before the next (default: ~4 MiB of the widest field)")  # fmt: skip
    p.add_argument("--no-ceiling", action="store_true")
    p.add_argument("--compare", action="store_true",
                   help="run benchmarks/compare.py: tf.data, DataLoader, Grain and stoker per workload")  # fmt: skip
    p.add_argument("--workloads", help="with --compare: comma-separated subset (W1,W1-int8,W1-cold,W2,W3,W1-busy)")
    p.add_argument("--pairs", type=int, default=16, help="sample size when no fields are given")
    p.add_argument("--records", type=int, default=4096)
    p.add_argument("--inrez", type=int, default=128)
    p.set_defaults(run=cmd_bench)
    return parser


def _parse_cast(text: str | None) -> str | dict[str, str] | None:
    """``--cast``: one dtype for every field, ``NAME=DTYPE[,NAME=DTYPE]`` (the loader's cast map),
    or ``none`` (the stored dtypes: None)."""
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


if __name__ == "__main__":
    raise SystemExit(main())
