"""W1 records/s against the worker count: stoker autotuned and at fixed counts, beside the ceiling loop.

For many-core hosts, where the workers' per-batch Python (under the GIL) bounds how many of them
pay: prints one line per contender (records/s, threads and prefetch chosen, CPU cores busy, the
autotune's summary). One fresh process per contender, each timed after ``--warmup`` seconds.

    python benchmarks/threads.py [--data DIR] [--seconds 2] [--warmup 1] [--threads 4,8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from stoker.bench import run_child
from stoker.sample import cached_sample
from stoker.stats import LoaderStats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("STOKER_CACHE", ".stoker-cache") + "/sample-16x4096x128")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--threads", default="4,8", help="fixed worker counts to run beside the autotuned default")
    ap.add_argument("--out", default=None, help="also write the lines as JSON to this file")
    args = ap.parse_args()
    data = cached_sample(Path(args.data))
    fields = [
        {"name": "image", "files": str(data / "img_*.bin"), "dtype": "int8", "shape": [128, 128, 1]},
        {"name": "label", "files": str(data / "out_*.bin.gz"), "dtype": "float32", "compression": "gzip"},
    ]
    paths = sorted(str(p) for p in data.glob("img_*.bin"))
    cores = len(os.sched_getaffinity(0))
    counts: list[int | None] = [None, *(int(t) for t in args.threads.split(",") if t)]
    rows = []
    for out in ("float32", "int8"):
        for threads in counts:
            cfg = {"fields": fields, "batch": 256, "cast": {"image": out}, "seconds": args.seconds,
                   "warmup": args.warmup, "threads": threads}  # fmt: skip
            m = run_child("stoker", cfg)
            s = LoaderStats.from_dict(m.stats or {})
            rows.append({"contender": f"stoker {out} threads={threads or 'auto'}", "records_per_s": m.records_per_s,
                         "threads": s.threads, "prefetch": s.prefetch, "cores_busy": m.cpu_seconds / m.seconds,
                         "autotune": s.tuning.get("autotune", "")})  # fmt: skip
            print(rows[-1], flush=True)
        cfg = {"paths": paths, "header": 0, "shape": [128, 128, 1], "src_dtype": "|i1", "out_dtype": out,
               "batch": 256, "loop": "mmap_kept", "threads": cores, "seconds": args.seconds,
               "warmup": args.warmup}  # fmt: skip
        m = run_child("ceiling", cfg)
        rows.append({"contender": f"ceiling {out} threads={cores}", "records_per_s": m.records_per_s,
                     "cores_busy": m.cpu_seconds / m.seconds})  # fmt: skip
        print(rows[-1], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
