"""W1 records/s against the worker count: stoker autotuned and at fixed counts, beside the ceiling loop.

For many-core hosts, where the workers' per-batch Python (under the GIL) bounds how many of them
pay: one row per contender (records/s, threads and prefetch chosen, CPU cores busy, the
autotune's summary). One fresh process per contender, each timed after ``--warmup`` seconds;
contenders alternate over ``--rounds`` rounds, medians and ratios to the ceiling of the same
round and output dtype are given.

    python benchmarks/threads.py [--data DIR] [--rounds 1] [--seconds 2] [--warmup 1] [--threads 4,8]
                                 [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import Counter
from collections.abc import Callable

from harness import (
    Column,
    LoaderStats,
    Run,
    add_out_argument,
    alternate,
    cached_sample,
    default_cache,
    median_of,
    ratio_table,
    stoker_child,
    summary_table,
    write_results,
)


def _stats(run: Run) -> LoaderStats:
    return LoaderStats.from_dict(run.get("stats") or {})


def _most_common(values: list[object]) -> object:
    return Counter(values).most_common(1)[0][0] if values else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=default_cache() + "/sample-16x4096x128")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--threads", default="4,8", help="fixed worker counts to run beside the autotuned default")
    add_out_argument(ap)
    args = ap.parse_args()
    data = cached_sample(args.data)
    fields = [
        {"name": "image", "files": str(data / "img_*.bin"), "dtype": "int8", "shape": [128, 128, 1]},
        {"name": "label", "files": str(data / "out_*.bin.gz"), "dtype": "float32", "compression": "gzip"},
    ]
    paths = sorted(str(p) for p in data.glob("img_*.bin"))
    cores = len(os.sched_getaffinity(0))
    counts: list[int | None] = [None, *(int(t) for t in args.threads.split(",") if t)]
    configs: dict[str, tuple[str, dict[str, object]]] = {}
    for out in ("float32", "int8"):
        for threads in counts:
            configs[f"stoker {out} threads={threads or 'auto'}"] = ("stoker", {
                "fields": fields, "batch": 256, "cast": {"image": out}, "seconds": args.seconds,
                "warmup": args.warmup, "threads": threads})  # fmt: skip
        configs[f"ceiling {out} threads={cores}"] = ("ceiling", {
            "paths": paths, "header": 0, "shape": [128, 128, 1], "src_dtype": "|i1", "out_dtype": out,
            "batch": 256, "loop": "mmap_kept", "threads": cores, "seconds": args.seconds,
            "warmup": args.warmup})  # fmt: skip
    rounds = alternate(list(configs), args.rounds, lambda name: stoker_child(name, *configs[name]))

    def stat(get: Callable[[LoaderStats], object]) -> Column:
        def cell(runs: list[Run]) -> object:
            if not runs[0].get("stats"):
                return ""
            values = [get(_stats(r)) for r in runs]
            return statistics.median(values) if isinstance(values[0], int | float) else _most_common(values)

        return cell

    columns = {
        "threads": stat(lambda s: s.threads),
        "prefetch": stat(lambda s: s.prefetch),
        "cores busy": lambda runs: f"{statistics.median(r['cpu_seconds'] / r['seconds'] for r in runs):.2f}",
        "MB/s": median_of("mb_per_s"),
        "autotune": stat(lambda s: s.tuning.get("autotune", "")),
    }
    pairs = [(name, f"ceiling {name.split()[1]} threads={cores}") for name in configs if name.startswith("stoker")]
    body = summary_table(rounds, columns=columns) + "\n" + ratio_table(rounds, pairs)
    title = (f"W1 against the worker count ({cores} cores, {args.rounds} alternated rounds of {args.seconds:g}s "
             f"after {args.warmup:g}s of warm-up, batch 256)")  # fmt: skip
    write_results("threads", title, body, script=__file__, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
