"""A/B of two source trees of stoker on W1 (benchmarks/w1.py's stoker contenders), in one process.

Each tree's package is copied under its own name (`stoker_a`, `stoker_b`; its compiled kernels
with it) so both load side by side; one W1 loader of each (batch 256, images cast, an endless
pass) is warmed up, then the two are timed in alternating slices of `--slice` seconds, the
order swapped every pair. On a shared machine the load of other processes then hits both sides
of a pair within seconds of each other. Prints the median records/s of each and the per-pair
ratios B/A (median, min..max), and appends them to results/w1_history.md (results/w1.md, the
table of benchmarks/w1.py's last run, stays as it is).

    python benchmarks/ab_trees.py --a /path/to/main/src --b src [--pairs 30] [--slice 1]
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import add_out_argument, command_line, default_cache, machine
from stoker.cli.sample import cached_sample


def _load(src: str, name: str, into: Path) -> Any:
    """The `stoker` package of the tree at `src`, imported as `name`."""
    shutil.copytree(Path(src) / "stoker", into / name)
    kernels = into / name / "kernels.py"  # the one absolute import of the package: its compiled kernels
    kernels.write_text(kernels.read_text().replace('"stoker._kernels"', f'"{name}._kernels"'))
    return importlib.import_module(name)


def _rate(batches: Any, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += len(next(batches)["label"])
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the first tree's src directory (the baseline)")
    ap.add_argument("--b", required=True, help="the second tree's src directory")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--slice", type=float, default=1.0, help="seconds each side runs per pair")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--data", default=default_cache() + "/sample-16x4096x128")
    add_out_argument(ap)
    args = ap.parse_args()
    data = cached_sample(args.data)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        pkgs = {"A": _load(args.a, "stoker_a", Path(tmp)), "B": _load(args.b, "stoker_b", Path(tmp))}
        for out in ("float32", "int8"):
            loaders, its = {}, {}
            for side, pkg in pkgs.items():
                image = pkg.Field(str(data / "img_*.bin"), "int8", (128, 128, 1))
                ds = pkg.Dataset(
                    image=image, label=pkg.Field(str(data / "out_*.bin.gz"), "float32", compression="gzip")
                )
                loaders[side] = ds.loader(256, cast={"image": out}, epochs=None)
                its[side] = iter(loaders[side])
                _rate(its[side], args.warmup)  # threads, autotune's climb, maps, buffers
            rates: dict[str, list[float]] = {"A": [], "B": []}
            for k in range(args.pairs):
                for side in ("A", "B") if k % 2 == 0 else ("B", "A"):
                    rates[side].append(_rate(its[side], args.slice))
            ratios = [b / a for a, b in zip(rates["A"], rates["B"], strict=True)]
            rows.append(
                f"| {out} | {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f}) | "
                f"{statistics.median(rates['A']):,.0f} | {statistics.median(rates['B']):,.0f} | "
                f"{loaders['A'].threads} / {loaders['B'].threads} |"
            )
            for loader in loaders.values():
                loader.close()
    body = (
        f"A: `{args.a}`, B: `{args.b}`\n\n| output | B/A per pair, median (min..max) | A records/s | B records/s "
        "| threads A / B |\n|---|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )
    title = f"W1 A/B of two trees in one process ({args.pairs} alternated pairs of {args.slice:g}s)"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    entry = f"## {stamp}: {title}\n\nCommand: `{command_line(__file__, None)}`\n\nMachine: {machine(())}\n\n{body}"
    print(entry)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with (Path(args.out) / "w1_history.md").open("a") as f:
        f.write("\n" + entry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
