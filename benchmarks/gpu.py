"""W1 onto a CUDA GPU: stoker's batches through ``to_torch`` and ``to_jax`` to the device, beside the host ceilings.

Needs a CUDA machine (PyTorch with CUDA, optionally JAX with its CUDA plugin); CI has none, so
nothing here runs in the test suite. Two parts:

- ``--check``: correctness of the asynchronous paths. Batches go to the GPU without any
  synchronization in the loop (pinned host buffers, ``non_blocking`` copies; JAX's
  ``device_put``), a checksum kernel is queued behind each copy, and only at the end are the
  checksums compared with an independent numpy reading of the same records. A host buffer
  recycled while its copy is still in flight would show as a wrong checksum. Held batches
  (every tenth, kept on the device to the end) are compared whole.
- the benchmark: contenders in fresh processes, rounds alternating the order, each timed in its
  steady state after ``--warmup`` seconds: the host ceiling loop and stoker's numpy iteration
  (float32 and int8 out), ``to_torch("cuda")`` pinned with int8 shipped and cast on the device
  (the recommended setup), pinned with float32 cast on the host, unpinned with the cast on the
  device, ``to_jax`` on the GPU (float32 and int8), and the bare host-to-device copy of one
  pinned batch buffer again and again (the PCIe ceiling for each dtype). A GPU consumer is
  timed to the end of its last copy (``torch.cuda.synchronize`` / ``block_until_ready``).

    python benchmarks/gpu.py --check
    python benchmarks/gpu.py [--rounds 3] [--seconds 2] [--warmup 1] [--data DIR] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

import stoker
from harness import (
    Run,
    add_out_argument,
    alternate,
    cached_sample,
    child_json,
    default_cache,
    stoker_child,
    summary_table,
    time_batches,
    write_results,
)

BATCH = 256
RES = 128
CONTENDERS = {
    "ceiling float32 (host)": "ceiling:float32",
    "ceiling int8 (host)": "ceiling:int8",
    "stoker numpy float32 (host)": "numpy:float32",
    "stoker numpy int8 (host)": "numpy:int8",
    "to_torch cuda pinned, int8 + cast on device": "torch:pinned:int8",
    "to_torch cuda pinned, float32 cast on host": "torch:pinned:float32",
    "to_torch cuda unpinned, int8 + cast on device": "torch:unpinned:int8",
    "to_jax gpu, float32 cast on host": "jax:float32",
    "to_jax gpu, int8": "jax:int8",
    "H2D copy of a pinned int8 batch (PCIe ceiling)": "h2d:int8",
    "H2D copy of a pinned float32 batch (PCIe ceiling)": "h2d:float32",
}


def dataset(data: Path) -> stoker.Dataset:
    return stoker.Dataset(
        image=stoker.Field(str(data / "img_*.bin"), "int8", (RES, RES, 1)),
        label=stoker.Field(str(data / "out_*.bin.gz"), "float32", compression="gzip"),
    )


def child(kind: str, data: Path, seconds: float, warmup: float) -> dict[str, float]:
    family, *rest = kind.split(":")
    ds = dataset(data)
    if family == "numpy":
        with ds.loader(BATCH, epochs=None, cast={"image": rest[0]}) as loader:
            return time_batches(iter(loader), seconds, warmup=warmup)
    if family == "torch":
        import torch

        pinned, dtype = rest[0] == "pinned", rest[1]
        loader = ds.loader(BATCH, epochs=None, cast={"image": dtype})
        cast = {"image": torch.float32} if dtype == "int8" else None
        with loader.to_torch("cuda", pin_memory=pinned, cast_on_device=cast) as batches:
            return time_batches(iter(batches), seconds, warmup=warmup, sync=lambda _: torch.cuda.synchronize())
    if family == "jax":
        import jax

        loader = ds.loader(BATCH, epochs=None, cast={"image": rest[0]})
        with loader.to_jax() as batches:
            return time_batches(iter(batches), seconds, warmup=warmup, sync=jax.block_until_ready)
    if family == "h2d":
        import torch

        itemsize = np.dtype(rest[0]).itemsize
        host = torch.empty(BATCH * RES * RES * itemsize, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty_like(host, device="cuda")
        began = time.perf_counter()
        while time.perf_counter() - began < warmup:
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        n = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(10):
                dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            n += 10 * BATCH
        return {"records": n, "seconds": time.perf_counter() - start}
    raise ValueError(f"unknown contender {kind!r}")


def ceiling(data: Path, dtype: str, seconds: float, warmup: float) -> Run:
    paths = sorted(str(p) for p in data.glob("img_*.bin"))
    cfg = {"paths": paths, "header": 0, "shape": [RES, RES, 1], "src_dtype": "|i1", "out_dtype": dtype,
           "batch": BATCH, "loop": "mmap_kept", "threads": len(os.sched_getaffinity(0)), "seconds": seconds,
           "warmup": warmup}  # fmt: skip
    return stoker_child(f"ceiling {dtype}", "ceiling", cfg)


def run(kind: str, data: Path, seconds: float, warmup: float) -> Run:
    if kind.startswith("ceiling:"):
        out = ceiling(data, kind.split(":")[1], seconds, warmup)
    else:
        argv = [__file__, "--child", kind, "--data", str(data), "--seconds", str(seconds), "--warmup", str(warmup)]
        out = child_json(kind, argv, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    # The images' bytes per record as produced on the host or shipped to the device.
    return {**out, "image_bytes": RES * RES * (1 if kind.endswith("int8") else 4)}


# -- correctness of the asynchronous paths --------------------------------------------------------
def _totals(rows: np.ndarray) -> tuple[int, int]:
    """A batch's checksums from its images' per-row sums: their total and their row-weighted total."""
    rows = rows.astype(np.int64)
    return int(rows.sum()), int((rows * np.arange(1, len(rows) + 1, dtype=np.int64)).sum())


def _reference(ds: stoker.Dataset, batches: int) -> list[tuple[tuple[int, int], np.ndarray]]:
    """Per batch: the int8 images' checksums and the labels (numpy, no GPU)."""
    out = []
    with ds.loader(BATCH, epochs=None) as loader:
        for _, batch in zip(range(batches), loader, strict=False):
            rows = batch["image"].reshape(len(batch["image"]), -1).astype(np.int64).sum(axis=1)
            out.append((_totals(rows), batch["label"].copy()))
    return out


def _check_path(
    name: str, device_batches: Any, row_sums: Any, to_numpy: Any, held_dtype: str,
    ds: stoker.Dataset, ref: list[tuple[tuple[int, int], np.ndarray]],
) -> str | None:  # fmt: skip
    """Run ``device_batches`` with no synchronization, ``row_sums(images)`` queued on the device
    behind each copy; compare only at the end. None, or what went wrong."""
    sums: list[tuple[Any, Any]] = []
    held: list[tuple[int, Any]] = []
    with device_batches as batches:
        for k, batch in zip(range(len(ref)), batches, strict=False):
            sums.append((row_sums(batch["image"]), batch["label"]))
            if k % 10 == 0:
                held.append((k, batch["image"]))
    bad = [k for k, (rows, lab) in enumerate(sums)
           if _totals(to_numpy(rows)) != ref[k][0] or not np.array_equal(to_numpy(lab), ref[k][1])]  # fmt: skip
    with ds.loader(BATCH, epochs=None, cast={"image": held_dtype}) as again:
        expect = {k: b["image"].copy() for k, b in zip(range(len(ref)), again, strict=False) if k % 10 == 0}
    bad_held = [k for k, img in held if not np.array_equal(to_numpy(img), expect[k])]
    dtype = held[0][1].dtype if held else "-"
    print(f"{name}: {len(sums)} batches, checksums wrong in {len(bad)}, held batches changed: {len(bad_held)} "
          f"(images {dtype} on the device)")  # fmt: skip
    return f"{name}: batches {bad[:10]} wrong, held {bad_held[:10]} changed" if bad or bad_held else None


def check(data: Path, batches: int) -> int:
    ds = dataset(data)
    ref = _reference(ds, batches)
    failures: list[str | None] = []
    import torch

    paths = ((True, "int8"), (True, "float32"), (False, "int8")) if torch.cuda.is_available() else ()
    if not paths:
        print("CUDA is not available: to_torch('cuda') not checked")
    for pinned, host_dtype in paths:
        cast = {"image": torch.float32} if host_dtype == "int8" else None
        failures.append(_check_path(
            f"to_torch cuda pin_memory={pinned}, images {host_dtype} on the host",
            ds.loader(BATCH, epochs=None, cast={"image": host_dtype}).to_torch("cuda", pinned, cast),
            lambda images: images.reshape(images.shape[0], -1).to(torch.int64).sum(dim=1),
            lambda t: t.cpu().numpy(), "float32", ds, ref,
        ))  # fmt: skip
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("jax not installed: to_jax not checked")
    else:
        for host_dtype in ("float32", "int8"):
            failures.append(_check_path(
                f"to_jax on {jax.devices()[0]}, images {host_dtype}",
                ds.loader(BATCH, epochs=None, cast={"image": host_dtype}).to_jax(),
                # int32 row sums are exact: a row holds 16384 values of at most 128 in magnitude.
                lambda images: images.reshape(images.shape[0], -1).astype(jnp.int32).sum(axis=1),
                np.asarray, host_dtype, ds, ref,
            ))  # fmt: skip
    for f in failures:
        if f is not None:
            print("FAILED:", f)
    return 1 if any(failures) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds each contender runs before it is timed")
    ap.add_argument("--data", default=default_cache() + "/sample-16x4096x128")
    add_out_argument(ap)
    ap.add_argument("--check", action="store_true", help="check the asynchronous paths' batches, then stop")
    ap.add_argument("--batches", type=int, default=300, help="batches per path in --check")
    ap.add_argument("--only", default=None, help="comma-separated subset of contenders' keys")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    data = Path(args.data)
    if args.child:
        print(json.dumps(child(args.child, data, args.seconds, args.warmup)))
        return 0
    cached_sample(data)
    if args.check:
        return check(data, args.batches)
    keys = None if args.only is None else set(args.only.split(","))
    names = [n for n, k in CONTENDERS.items() if keys is None or k in keys]
    # A contender that fails (no GPU for JAX, say) is reported and left out of its round.
    rounds = alternate(names, args.rounds, lambda n: run(CONTENDERS[n], data, args.seconds, args.warmup),
                       keep_going=True)  # fmt: skip
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass

    def gb_per_s(runs: list[Run]) -> str:
        return f"{statistics.median(r['records_per_s'] * r['image_bytes'] for r in runs) / 1e9:.2f}"

    title = (f"W1 onto the GPU ({len(os.sched_getaffinity(0))} cores, {gpu}, {args.rounds} alternated rounds of "
             f"{args.seconds:g}s after {args.warmup:g}s of warm-up, batch {BATCH}, 128x128 images, "
             "warm page cache)")  # fmt: skip
    body = summary_table(rounds, columns={"image GB/s (as produced or shipped)": gb_per_s})
    write_results("gpu", title, body, script=__file__, out=args.out, frameworks=["torch", "jax"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
