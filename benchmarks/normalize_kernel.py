"""The fused Normalize kernel alone, against the plain cast, on one thread (no loader, no files).

What a worker spends on one batch's images, without reading or bookkeeping: the compiled
one-pass kernel (``stoker.engine.fusion.OnePass``, the hand-written row and unit loops where they
apply) running a chain on records already in memory, against ``stoker.kernels.cast_into``'s
plain cast of the same records. Two layouts:

- ``w1``: 256 records of 128x128x1 int8 (the seed's frames), one mean/std, flipped along W
  in half the records;
- ``rgb``: 64 records of 128x128x3 uint8 (ImageNet's per-channel mean/std), with and without
  a flip along W.

Each chain writes into one of six page-aligned output buffers in turn (memory as the
loader's batches), after 5 unmeasured calls. Contenders alternate within each round; the
medians of the per-round times and their ratios to the cast of the same round are written.

    python benchmarks/normalize_kernel.py [--rounds 5] [--calls 40] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from harness import Run, add_out_argument, alternate, output_buffer, ratio_table, summary_table, write_results
from stoker.engine.fusion import Stage
from stoker.kernels import cast_into
from stoker.transforms import Cast, Normalize, RandomFlip

IMAGENET_MEAN = [123.675, 116.28, 103.53]
IMAGENET_STD = [58.395, 57.12, 57.375]


def _contenders() -> dict[str, tuple[np.ndarray, Callable[[np.ndarray], Any], np.dtype]]:
    rng = np.random.default_rng(0)
    out: dict[str, tuple[np.ndarray, Callable[[np.ndarray], Any], np.dtype]] = {}
    layouts = {
        "w1": (rng.integers(-128, 128, size=(256, 128, 128, 1), dtype=np.int8), -0.5, 127.5),
        "rgb": (rng.integers(0, 256, size=(64, 128, 128, 3), dtype=np.uint8), IMAGENET_MEAN, IMAGENET_STD),
    }
    for layout, (x, mean, std) in layouts.items():
        record = {"image": (x.shape[1:], np.dtype(np.float32))}
        stored = {"image": x.dtype}
        chains: dict[str, list[Any]] = {
            "normalize": [Normalize(mean=mean, std=std, fields="image")],
            "normalize+flip": [Normalize(mean=mean, std=std, fields="image"), RandomFlip(fields="image", axis=1)],
        }
        if layout == "w1":
            chains["normalize+flip float16"] = [*chains["normalize+flip"], Cast("float16", fields="image")]
        out[f"{layout} cast"] = (x, lambda y, x=x: cast_into(y, x), np.dtype(np.float32))
        for name, chain in chains.items():
            stage = Stage(chain, seed=0, shard=(0, 1), records=record, stored=stored)
            one = stage.kernels["image"]
            draws = {k: rng.random(len(x)) < 0.5 for k in range(len(chain))}
            dtype = stage.records["image"][1]
            out[f"{layout} {name}"] = (x, lambda y, one=one, x=x, draws=draws: one.run(x, y, draws, 0), dtype)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=40)
    add_out_argument(ap)
    args = ap.parse_args()
    contenders = _contenders()

    def run(name: str) -> Run:
        x, fn, dtype = contenders[name]
        outs = [output_buffer(x.shape, dtype) for _ in range(6)]
        for k in range(5):
            fn(outs[k % 6])
        start = time.perf_counter()
        for k in range(args.calls):
            fn(outs[k % 6])
        return {"us_per_call": (time.perf_counter() - start) / args.calls * 1e6, "records": len(x)}

    rounds = alternate(list(contenders), args.rounds, run, show="us_per_call")
    table = summary_table(rounds, metric="us_per_call", label="us per call", first="chain",
                          columns={"records": lambda runs: runs[0]["records"]})  # fmt: skip
    pairs = [(name, f"{name.split()[0]} cast") for name in contenders if not name.endswith(" cast")]
    body = table + "\n" + ratio_table(rounds, pairs, metric="us_per_call")
    title = f"The fused Normalize kernel alone against the plain cast, one thread ({args.rounds} alternated rounds)"
    write_results("normalize_kernel", title, body, script=__file__, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
