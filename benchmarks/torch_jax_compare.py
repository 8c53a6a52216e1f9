"""W1 through the framework adapters, beside PyTorch's DataLoader and Grain, on the same files.

Contenders (float32 images, batch 256, labels decoded from the gzip files):

- ``stoker numpy``: ``ds.loader(256, cast={"image": "float32"})``, the reference;
- ``stoker.to_torch``: the same loader through ``loader.to_torch()`` (CPU tensors, zero-copy);
- ``stoker.to_jax``: the same loader through ``loader.to_jax()`` (CPU device, prefetch 2);
- ``torch DataLoader``: map-style, per-record ``__getitem__`` (image from ``np.memmap``,
  cast to float32; label from a decoded array), default collate, ``num_workers`` = cores;
- ``grain``: ``grain.MapDataset.source(...)`` over the same random-access source,
  ``.batch(256)``, ``.to_iter_dataset(ReadOptions(num_threads=cores))``.

Every contender runs in a fresh process, rounds alternate the order, and each runs ``--warmup``
seconds (and at least one batch) unmeasured before its timed seconds, so all are timed in their
steady state (worker start-up and first-batch latency are excluded alike). Writes a markdown
table of medians and per-round ratios (benchmarks/results/torch_jax.md).

    python benchmarks/torch_jax_compare.py [--rounds 3] [--seconds 3] [--warmup 1] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness import (
    Run,
    add_out_argument,
    alternate,
    cached_sample,
    child_json,
    default_cache,
    ratio_table,
    summary_table,
    time_batches,
    write_results,
)

RES = 128
BATCH = 256
CONTENDERS = ("stoker numpy", "stoker.to_torch", "stoker.to_jax", "torch DataLoader", "grain")


def cores() -> int:
    return len(os.sched_getaffinity(0))


class RecordSource:
    """Random access to W1 records: image by memory map, label from the decoded label files."""

    def __init__(self, data: str) -> None:
        self.images = sorted(str(p) for p in Path(data).glob("img_*.bin"))
        labels = sorted(Path(data).glob("out_*.bin.gz"))
        self.labels = np.concatenate([np.frombuffer(gzip.decompress(p.read_bytes()), "<f4") for p in labels])
        self.counts = [os.path.getsize(p) // (RES * RES) for p in self.images]
        self.firsts = np.concatenate([[0], np.cumsum(self.counts)])
        self.maps: list[np.memmap] | None = None  # opened lazily: once per worker process

    def __len__(self) -> int:
        return int(self.firsts[-1])

    def record(self, i: int) -> tuple[np.ndarray, np.float32]:
        if self.maps is None:
            pairs = zip(self.images, self.counts, strict=True)
            self.maps = [np.memmap(p, np.int8, "r", shape=(n, RES, RES, 1)) for p, n in pairs]
        g = int(np.searchsorted(self.firsts, i, side="right")) - 1
        return self.maps[g][i - self.firsts[g]].astype(np.float32), self.labels[i]


def batches(name: str, data: str) -> Any:
    """An endless iterator of batches for contender ``name``."""
    if name.startswith("stoker"):
        import stoker

        ds = stoker.Dataset(
            image=stoker.Field(f"{data}/img_*.bin", "int8", (RES, RES, 1)),
            label=stoker.Field(f"{data}/out_*.bin.gz", "float32"),
        )
        loader = ds.loader(BATCH, epochs=None, cast={"image": "float32"})
        if name == "stoker.to_torch":
            return iter(loader.to_torch())
        if name == "stoker.to_jax":
            return iter(loader.to_jax())
        return iter(loader)
    source = RecordSource(data)
    if name == "torch DataLoader":
        import torch.utils.data

        class MapStyle(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return len(source)

            def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
                image, label = source.record(i)
                return torch.from_numpy(image), torch.tensor(label)

        def endless() -> Any:
            dl = torch.utils.data.DataLoader(MapStyle(), batch_size=BATCH, num_workers=cores(), persistent_workers=True)
            while True:
                yield from dl

        return endless()
    if name == "grain":
        import grain

        class Source:
            def __len__(self) -> int:
                return len(source)

            def __getitem__(self, i: int) -> dict[str, Any]:
                image, label = source.record(i)
                return {"image": image, "label": label}

        opts = grain.ReadOptions(num_threads=cores(), prefetch_buffer_size=4 * BATCH)
        return iter(grain.MapDataset.source(Source()).repeat().batch(BATCH).to_iter_dataset(opts))
    raise ValueError(name)


# The framework each contender imports (its adapter module included), by its name.
FRAMEWORKS = {
    "stoker.to_torch": ("torch", "stoker.torch"),
    "torch DataLoader": ("torch",),
    "stoker.to_jax": ("jax", "stoker.jax"),
    "grain": ("grain",),
}


def child(name: str, data: str, seconds: float, warmup: float = 0.0) -> dict[str, float]:
    # Imported before the warm-up's clock starts, as compare.py does: JAX's and PyTorch's imports
    # took seconds and used up the warm-up, which then timed the adapters from their first batches,
    # start-up and autotune's first trials included, while numpy's contender was timed warm.
    for module in FRAMEWORKS.get(name, ()):
        importlib.import_module(module)
    began = time.perf_counter()
    it = batches(name, data)
    out = time_batches(it, seconds, warmup=warmup, began=began)  # start-up and first batch excluded alike
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return out


def run_child(name: str, data: str, seconds: float, warmup: float = 0.0) -> Run:
    return child_json(name, [__file__, "--child", name, "--data", data, "--seconds", str(seconds),
                             "--warmup", str(warmup)])  # fmt: skip


def available(name: str) -> bool:
    if name not in FRAMEWORKS:
        return True
    framework = FRAMEWORKS[name][0]
    try:
        __import__(framework)
    except ImportError:
        print(f"  {name}: {framework} is not installed; skipped", file=sys.stderr)
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds each contender runs before it is timed")
    ap.add_argument("--data", default=default_cache() + "/sample-16x4096x128")
    add_out_argument(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.data, args.seconds, args.warmup)))
        return 0
    data = cached_sample(args.data)
    names = [n for n in CONTENDERS if available(n)]
    # A contender that fails is reported and left out of its round; the others go on.
    rounds = alternate(
        names, args.rounds, lambda n: run_child(n, str(data), args.seconds, args.warmup), keep_going=True
    )
    pairs = [
        ("stoker.to_torch", "stoker numpy"),
        ("stoker.to_jax", "stoker numpy"),
        ("stoker.to_torch", "torch DataLoader"),
        ("stoker.to_torch", "grain"),
    ]
    title = (f"stoker adapters vs DataLoader and Grain on W1 ({cores()} cores, {args.rounds} alternated rounds of "
             f"{args.seconds:g}s after {args.warmup:g}s of warm-up, float32 images, batch 256, "
             "warm page cache)")  # fmt: skip
    body = summary_table(rounds) + "\n" + ratio_table(rounds, pairs)
    write_results("torch_jax", title, body, script=__file__, out=args.out, frameworks=["torch", "jax", "grain"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
