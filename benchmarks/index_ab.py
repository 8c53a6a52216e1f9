"""What the index's checks cost: two source trees of stoker, alternated round by round.

Each round runs one process per tree (in alternating order) that measures, on its own copy
of the data and its own index (index formats differ between versions):

- opening 10,000 small gzip groups (gzip images + gzip labels, 16 records each) through the
  index: ``Dataset(...)`` + ``len(ds)`` (every entry parsed and checked, no decompression);
- random access on W2 (``benchmarks/compare.py``'s generator, 4 single-member gzip files of
  64 MiB decoded, seek points every 1 MiB) through seek points only, 1 and 256 records a call
  (every read verifies its point's check and its window's CRC).

Per-round ratios new / old are written with their median and range; the machine's load drifts,
so only ratios from the same round mean anything.

    python benchmarks/index_ab.py --old ../main/src --new src [--rounds 7] [--seconds 1] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import Run, add_out_argument, alternate, child_json, default_cache, versus_table, write_results

CACHE = Path(default_cache())

# Runs in a child process with one tree on PYTHONPATH: prints one JSON line of measurements.
_MEASURE = r"""
import json, sys, time
from pathlib import Path
import numpy as np
import stoker
from stoker.engine.records import RecordReader
small, w2, seconds = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
fields = {"image": stoker.Field(str(small / "img_*.bin.gz"), "int8", (64,)),
          "label": stoker.Field(str(small / "out_*.bin.gz"), "float32")}
w2_fields = {"image": stoker.Field(str(w2 / "img_*.bin.gz"), "int8", (128, 128, 1))}
if sys.argv[4] == "index":
    stoker.write_index(stoker.Dataset(fields, index="ignore"))
    stoker.write_index(stoker.Dataset(w2_fields, index="ignore"))
    print("{}")
    sys.exit()
t = time.perf_counter()
ds = stoker.Dataset(fields)
n = len(ds)
open_s = time.perf_counter() - t
assert n == 160_000 and ds._catalog.seek_points
w2_ds = stoker.Dataset(w2_fields)
n2 = len(w2_ds)
firsts = np.arange(0, n2 + 1, 4096)
reader = RecordReader(w2_ds._catalog, cache_bytes=0)
rng = np.random.default_rng(1)
def rate(k):
    done, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        idx = rng.integers(0, n2, k)
        g = np.searchsorted(firsts, idx, side="right") - 1
        reader.read_into(g, idx - firsts[g], {"image": np.empty((k, 128, 128, 1), np.int8)})
        done += k
    return done / (time.perf_counter() - t)
print(json.dumps({"open_s": open_s, "seek_1": rate(1), "seek_256": rate(256)}))
"""


def copy_of(src: Path, dst: Path) -> Path:
    """The data files of ``src`` (no index), copied once."""
    if not (dst / ".complete").exists():
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for f in src.glob("*.bin.gz"):
            shutil.copy2(f, dst / f.name)
        (dst / ".complete").write_text("ok\n")
    return dst


def run(name: str, tree: str, small: Path, w2: Path, seconds: float, what: str) -> Run:
    argv = ["-c", _MEASURE, str(small), str(w2), str(seconds), what]
    return child_json(f"{name} ({what})", argv, env={"PYTHONPATH": os.path.abspath(tree)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the src directory of the version to compare against")
    ap.add_argument("--new", required=True, help="the src directory of the version measured")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=1.0)
    add_out_argument(ap)
    args = ap.parse_args()
    from access import many_groups
    from compare import w2_data

    small, w2 = many_groups(CACHE / "access-10000x16"), w2_data(CACHE, pairs=4)
    trees = {"new": args.new, "old": args.old}
    data = {k: (copy_of(small, CACHE / f"index-ab-{k}" / "small"), copy_of(w2, CACHE / f"index-ab-{k}" / "w2"))
            for k in trees}  # fmt: skip
    for k, tree in trees.items():
        run(k, tree, *data[k], args.seconds, "index")
    rounds = alternate(
        list(trees), args.rounds, lambda k: run(k, trees[k], *data[k], args.seconds, "measure"), show=None
    )
    names = {"open_s": "10,000 gzip groups: Dataset + len, s", "seek_1": "W2 seek points, 1 a call, records/s",
             "seek_256": "W2 seek points, 256 a call, records/s"}  # fmt: skip
    header = ["", "old median", "new median", "new/old per round"]
    body = versus_table(rounds, [(name, "new", "old", key) for key, name in names.items()], header, fmt="{:.3f}")
    title = f"What the index's checks cost: old = `{args.old}`, new = `{args.new}` ({args.rounds} alternated rounds)"
    write_results("index_ab", title, body, script=__file__, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
