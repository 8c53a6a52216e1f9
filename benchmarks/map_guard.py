"""The cost of reading maps safely: this tree against another checkout (``--base``, its ``src``
with the kernels built), for the SIGBUS guard around the kernels' reads of memory maps and the
copy out of the map that records numpy casts now take (docs/reliability.md).

Two parts, contenders alternated within each round:

- the kernels' calls, both builds loaded side by side in one process (per call, microseconds);
- stoker's loader, each run in a fresh process per tree (records/s after 1 s of warm-up), on
  4 files of 4096 records of 16 KiB: int8 cast to float32 (the kernels), int32 cast to float64
  (numpy's cast, of records now copied out of the map first), int32 uncast (a byte copy from
  the maps kept from the first epoch), in order and globally shuffled.

    python benchmarks/map_guard.py --base /path/to/other/checkout/src [--rounds 5] [--seconds 3]
                                   [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from harness import Run, add_out_argument, alternate, child_json, default_cache, versus_table, write_results

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

_LOADER = r"""
import json, sys, time, stoker
d, kind, order, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
if kind == "int8":
    ds, cast = stoker.Dataset(image=stoker.Field(d + "/i8_*.bin", "int8", (128, 128))), "float32"
else:
    ds = stoker.Dataset(image=stoker.Field(d + "/i32_*.bin", "int32", (64, 64)))
    cast = "float64" if kind == "int32" else None
kw = {"shuffle": "global", "seed": 1} if order == "global" else {}
n, start, t0 = 0, None, time.perf_counter()
with ds.loader(256, epochs=None, cast=cast, **kw) as loader:
    for b in loader:
        now = time.perf_counter()
        if start is None:
            start = now if now - t0 > 1.0 else None
        else:
            n += len(b["image"])
            if now - start > seconds:
                break
print(json.dumps({"records_per_s": n / (time.perf_counter() - start)}))
"""


def _kernels(src: Path, name: str) -> Any:
    path = glob.glob(str(src / "stoker" / "_kernels*.so"))[0]
    spec = importlib.util.spec_from_file_location(f"{name}._kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _calls(k: Any, mapped: Any) -> dict[str, Callable[[], object]]:
    src = np.frombuffer(mapped, np.int8)
    at = int(src.__array_interface__["data"][0])
    big, small = np.empty((256, 16384), np.float32), np.empty(256, np.float32)
    records = src[: 256 * 16384].reshape(256, 16384)
    rows = np.arange(256, dtype=np.int64)
    addresses = at + np.random.default_rng(0).integers(0, 4096, 256).astype(np.int64) * 16384
    return {
        "cast_into, 256 x 16 KiB int8 -> float32": lambda: k.cast_into(big, records, 1 << 20),
        "cast_into, 256 labels (1 KiB)": lambda: k.cast_into(small, src[:256], 1 << 20),
        "gather_records, 256 x 16 KiB": lambda: k.gather_records("b", "f", big, 256, rows, addresses, True),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other checkout's src directory (kernels built)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--data", default=default_cache() + "/map-guard")
    add_out_argument(ap)
    args = ap.parse_args()
    trees = {"base": Path(args.base).resolve(), "this": SRC}
    data = Path(args.data)
    if not data.exists():
        data.mkdir(parents=True)
        for g in range(4):
            rng = np.random.default_rng(g)
            rng.integers(-128, 128, (4096, 16384), dtype=np.int8).tofile(data / f"i8_{g}.bin")
            rng.integers(-1000, 1000, (4096, 4096), dtype=np.int32).tofile(data / f"i32_{g}.bin")

    fd = os.open(data / "i8_0.bin", os.O_RDONLY)
    kernels = {t: _kernels(p, f"map_guard_{t}") for t, p in trees.items()}
    if hasattr(kernels["this"], "guard_maps"):
        kernels["this"].guard_maps()
    maps = {t: k.FileMap(fd, os.fstat(fd).st_size) for t, k in kernels.items()}
    os.close(fd)
    calls = {t: _calls(k, maps[t]) for t, k in kernels.items()}
    kinds = [(k, o) for k in ("int8", "int32", "int32 uncast") for o in ("sequential", "global")]
    # Each contender is one figure of one tree, the two trees' side by side in every round.
    contenders = [(t, c) for c in calls["this"] for t in trees] + [(t, f"{k}, {o}") for k, o in kinds for t in trees]

    def run(name: str) -> Run:
        t, what = name.split(": ", 1)
        if what in calls[t]:
            fn = calls[t][what]
            fn()
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 0.2:
                fn()
                n += 1
            return {"us": (time.perf_counter() - start) / n * 1e6}
        k, o = what.split(", ")
        argv = ["-c", _LOADER, str(data), k.split()[0] if k != "int32 uncast" else "copy", o, str(args.seconds)]
        return child_json(name, argv, env={"PYTHONPATH": str(trees[t])})

    rounds = alternate([f"{t}: {what}" for t, what in contenders], args.rounds, run, show=None)
    ratio = "this/base per round (median, min..max)"
    body = versus_table(rounds, [(c, f"this: {c}", f"base: {c}", "us") for c in calls["this"]],
                        ["kernel call", "base us", "this us", ratio], ratio_fmt="{:.3f}")  # fmt: skip
    out = {"int8": "int8 -> float32", "int32": "int32 -> float64", "int32 uncast": "int32 uncast"}
    loader_rows = [(f"{out[k]}, {o}", f"this: {k}, {o}", f"base: {k}, {o}", "records_per_s") for k, o in kinds]
    body += "\n" + versus_table(rounds, loader_rows, ["loader", "base records/s", "this records/s", ratio],
                                fmt="{:,.0f}", ratio_fmt="{:.3f}")  # fmt: skip
    title = f"map_guard: this tree against `{args.base}` ({args.rounds} alternated rounds)"
    write_results("map_guard", title, body, script=__file__, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
