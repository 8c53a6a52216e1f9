"""W1: the seed's layout (16 pairs x 4096 records of 128x128 int8 + gzip float32 labels, ~1 GiB).

Alternates, round after round, each contender in a fresh process: stoker and the ceiling
loops (see stoker.cli.bench) with float32 output, the same with int8 output, stoker and the kept-map
loop with float16 output, and stoker at
batch_size 16 to show engine overhead at small batches, the two shuffle modes, and W3-cold
(global shuffle and sequential with the page cache evicted before each round). Warm contenders,
stoker and the ceiling loops alike, run ``--warmup`` seconds before they are timed (their
steady state: stoker's thread start-up, first maps and new buffers, and the ceiling loops' first
pass over fresh maps excluded, as benchmarks/compare.py does for every contender); cold ones are
timed from their second batch. Writes per-contender medians and the per-round ratios
stoker / best ceiling loop of the same round (median and spread).

    python benchmarks/w1.py [--rounds 5] [--seconds 3] [--warmup 1] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os

from harness import (
    CEILING_LOOPS,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds each warm contender runs before it is timed")
    ap.add_argument("--data", default=default_cache() + "/sample-16x4096x128")
    add_out_argument(ap)
    args = ap.parse_args()
    data = cached_sample(args.data)
    fields = [
        {"name": "image", "files": str(data / "img_*.bin"), "dtype": "int8", "shape": [128, 128, 1]},
        {"name": "label", "files": str(data / "out_*.bin.gz"), "dtype": "float32", "compression": "gzip"},
    ]
    paths = sorted(str(p) for p in data.glob("img_*.bin"))
    threads = len(os.sched_getaffinity(0))
    warm = args.warmup or True  # seconds; True: the first batch only
    contenders: dict[str, dict[str, object]] = {}
    for out in ("float32", "int8"):
        # The images alone are cast, as the ceiling loops cast them; labels stay float32.
        contenders[f"stoker {out}"] = {
            "fields": fields,
            "batch": 256,
            "cast": {"image": out},
            "seconds": args.seconds,
            "warmup": warm,
        }
        for loop in CEILING_LOOPS:
            contenders[f"ceiling:{loop} {out}"] = {
                "paths": paths, "header": 0, "shape": [128, 128, 1], "src_dtype": "|i1", "out_dtype": out,
                "batch": 256, "loop": loop, "threads": threads, "seconds": args.seconds, "warmup": args.warmup,
            }  # fmt: skip
    # float16 output (mixed precision), against the kept-map loop alone (the best in every run).
    contenders["stoker float16"] = {**contenders["stoker float32"], "cast": {"image": "float16"}}
    contenders["ceiling:mmap_kept float16"] = {**contenders["ceiling:mmap_kept float32"], "out_dtype": "float16"}
    # A new pass per epoch, as a PyTorch loop or Keras' fit iterates (an epoch of the dataset
    # is short, so the seconds hold several passes and their start-ups).
    contenders["stoker float32 pass per epoch"] = {
        "fields": fields, "batch": 256, "cast": {"image": "float32"}, "seconds": args.seconds, "warmup": warm,
        "pass_per_epoch": True,
    }  # fmt: skip
    contenders["stoker float32 batch16"] = {
        "fields": fields, "batch": 16, "cast": "float32", "seconds": args.seconds, "warmup": warm,
    }  # fmt: skip
    for mode in ("global", "files"):
        contenders[f"stoker float32 shuffle={mode}"] = {
            "fields": fields, "batch": 256, "cast": "float32", "seconds": args.seconds, "shuffle": mode,
            "warmup": warm,
        }  # fmt: skip
    # W3-cold: the page cache evicted (posix_fadvise DONTNEED on every file) at the start of the
    # round, the larger-than-RAM case; sequential cold beside it for the disk's own pace.
    for mode in ("global", False):
        name = "stoker float32 cold" + (f" shuffle={mode}" if mode else "")
        contenders[name] = {
            "fields": fields, "batch": 256, "cast": "float32", "seconds": args.seconds, "shuffle": mode,
            "evict": True,
        }  # fmt: skip

    def run(name: str) -> Run:
        return stoker_child(name, "stoker" if name.startswith("stoker") else "ceiling", contenders[name])

    rounds = alternate(list(contenders), args.rounds, run)
    pairs: list[tuple[str, str | list[str], str]] = []
    for out in ("float32", "int8"):
        for against in ("best", *CEILING_LOOPS):
            loops = CEILING_LOOPS if against == "best" else (against,)
            pairs.append(
                (f"stoker {out}", [f"ceiling:{loop} {out}" for loop in loops], f"stoker {out} / {against} ceiling")
            )
    pairs += [
        ("stoker float16", "ceiling:mmap_kept float16", "stoker float16 / mmap_kept ceiling"),
        ("stoker float32 batch16", "stoker float32", "stoker batch 16 / batch 256 (float32)"),
        ("stoker float32 pass per epoch", "stoker float32", "stoker pass per epoch / one pass (float32)"),
        *((f"stoker float32 shuffle={m}", "stoker float32", f"stoker shuffle={m} / sequential (float32)")
          for m in ("global", "files")),
        ("stoker float32 cold shuffle=global", "stoker float32 cold",
         "stoker shuffle=global / sequential, both cold (float32)"),
    ]  # fmt: skip
    body = summary_table(rounds, columns={"MB/s": median_of("mb_per_s")}) + "\n" + ratio_table(rounds, pairs)
    title = (f"W1 results ({threads} cores, {args.rounds} alternated rounds of {args.seconds:g}s after "
             f"{args.warmup:g}s of warm-up, warm page cache)")  # fmt: skip
    write_results("w1", title, body, script=__file__, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
