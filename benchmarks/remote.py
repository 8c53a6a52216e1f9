"""W1 from S3 (moto's server on localhost) vs local disk, and Ray Data vs stoker, same files.

W1's layout (128x128 int8 images + gzip float32 labels, float32 output, batch 256) with
fewer pairs than W1's 16 (default 4 pairs x 4096 records, 256 MiB) so the upload into
moto stays short. moto serves from its own process. Contenders, alternated round after
round in this one process (Ray is started once, 2 CPUs, outside the timings):

- ``local``: ``ds.loader`` over the files on disk (warm page cache);
- ``s3``: the same loader over ``s3://`` URLs of the same files on the local moto server
  (the default 4 MiB blocks: one 4 MiB ranged read of images per batch of 256);
- ``s3 ceiling``: the server's own pace, every image file fetched as concurrent 8 MiB
  ranged GETs by fsspec with nothing decoded (moto reads a whole object for every ranged
  GET, so it, not the client, limits this figure);
- ``ray``: ``stoker.ray.read(ds local).iter_batches(256)`` (one read task per group), whole
  passes only, each including Ray's start of the streaming execution, after one untimed
  warm-up pass that starts Ray's worker processes.

Prints per-contender medians and the medians of per-round ratios.

    python benchmarks/remote.py [--pairs 4] [--rounds 3] [--seconds 4] [--out benchmarks/results/remote.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3

import stoker
import stoker.remote
from stoker.bench import summarize
from stoker.sample import cached_sample


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto server did not start")


def _fields(base: str, options: dict[str, Any] | None = None) -> dict[str, stoker.Field]:
    return {
        "image": stoker.Field(f"{base}/img_*.bin", "int8", (128, 128, 1), storage_options=options),
        "label": stoker.Field(f"{base}/out_*.bin.gz", "float32", compression="gzip", storage_options=options),
    }


def _timed(
    batches: Callable[[], Iterator[dict[str, Any]]], seconds: float, *, whole_passes: bool = False
) -> tuple[int, float]:
    """Records delivered in ``seconds`` (passes repeated), and the time taken.

    ``whole_passes``: stop only between passes (a Ray pass cut short cancels its tasks, and
    Ray replaces their worker processes, which costs seconds at the next pass's start).
    """
    n = 0
    start = time.perf_counter()
    until = start + seconds
    while time.perf_counter() < until:
        it = iter(batches())
        try:
            for batch in it:
                n += len(batch["label"])
                if time.perf_counter() >= until and not whole_passes:
                    break
        finally:
            # Stop the pass now (a Ray execution left to the GC keeps holding its CPUs).
            close = getattr(it, "close", None)
            if close is not None:
                close()
    return n, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", default="benchmarks/results/remote.md")
    args = ap.parse_args()
    cache = os.environ.get("STOKER_CACHE", ".stoker-cache")
    data = cached_sample(f"{cache}/sample-{args.pairs}x4096x128", pairs=args.pairs)

    import ray

    import stoker.ray

    moto, endpoint = _start_moto()
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        t0 = time.perf_counter()
        client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="bench", aws_secret_access_key="bench",
        )  # fmt: skip
        client.create_bucket(Bucket="stoker-w1")
        for p in sorted(data.glob("*.bin*")):
            client.upload_file(str(p), "stoker-w1", f"data/{p.name}")
        print(f"uploaded {args.pairs} pairs to moto in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        options = {
            "key": "bench",
            "secret": "bench",
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        local = stoker.Dataset(_fields(str(data)))
        s3 = stoker.Dataset(_fields("s3://stoker-w1/data", options))
        assert len(local) == len(s3)

        def loader(ds: stoker.Dataset, **kw: Any) -> Callable[[], Iterator[dict[str, Any]]]:
            return lambda: iter(ds.loader(256, cast={"image": "float32"}, **kw))

        fs, _ = stoker.remote.filesystem("s3://stoker-w1", options)
        image_urls = [g.paths["image"] for g in s3.groups]

        def s3_ceiling() -> Iterator[dict[str, Any]]:
            # The server's own pace: each image file as concurrent 8 MiB ranged GETs, no decoding.
            part = stoker.remote.PART_BYTES
            for url in image_urls:
                size = fs.size(url)
                starts = list(range(0, size, part))
                fs.cat_ranges([url] * len(starts), starts, [min(s + part, size) for s in starts])
                yield {"label": range(size // (128 * 128))}

        rds = stoker.ray.read(local, cast={"image": "float32"})
        contenders: dict[str, Callable[[], Iterator[dict[str, Any]]]] = {
            "local": loader(local),
            "s3": loader(s3),
            "s3 ceiling": s3_ceiling,
            "ray": lambda: rds.iter_batches(batch_size=256, batch_format="numpy"),
        }
        # Untimed warm-up: Ray starts its worker processes on the first pass (~10 s here).
        for name, batches in contenders.items():
            _timed(batches, 0.5, whole_passes=name == "ray")
        results: dict[str, list[float]] = {name: [] for name in contenders}
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for name in order:
                n, secs = _timed(contenders[name], args.seconds, whole_passes=name == "ray")
                results[name].append(n / secs)
                print(f"  round {r + 1}: {name:<10} {n / secs:>10,.0f} records/s", file=sys.stderr)
    finally:
        ray.shutdown()
        moto.terminate()
        moto.wait()

    record_bytes = 128 * 128 + 4
    lines = [
        f"# Remote and Ray results ({time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores shared with other "
        f"work, {args.rounds} alternated rounds of {args.seconds:g}s; W1 layout with {args.pairs} pairs x 4096 "
        "records, float32 output, batch 256)",
        "",
        "| contender | records/s median | min | max | MB/s (stored bytes) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, rates in results.items():
        med, lo, hi = summarize(rates)
        lines.append(f"| {name} | {med:,.0f} | {lo:,.0f} | {hi:,.0f} | {med * record_bytes / 1e6:,.0f} |")
    lines += ["", "| ratio (per round, same round) | median | min | max |", "|---|---:|---:|---:|"]
    for a, b in (("s3", "local"), ("s3", "s3 ceiling"), ("ray", "local")):
        ratios = [x / y for x, y in zip(results[a], results[b], strict=True)]
        med, lo, hi = summarize(ratios)
        lines.append(f"| {a} / {b} | {med:.2f} | {lo:.2f} | {hi:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
