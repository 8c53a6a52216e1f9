"""Random access and the persistent index, measured.

1. Time to first batch over 10,000 small gzip groups (gzip images + gzip labels, 16 records
   each), with and without the index: ``Dataset(...)``, then ``len(ds)`` (every count), then
   the first batch of ``shuffle="global"``. Without the index every file is decompressed
   to count it; with it none is.
   Also 200 larger gzip groups (256 images of 4 KiB, 1 MiB decoded per file, + gzip labels):
   open + ``len(ds)`` + the first batch in file order, with and without the index.
2. Random access on W1 raw (the seed's layout, ``stoker.cli.sample.cached_sample``):
   ``ds.read`` of 256 random indices, and ``ds[i]`` one record at a time.
3. Random access on W2 (``benchmarks/compare.py``'s generator: smooth 128x128 int8 frames,
   each file ONE gzip member of 4096 records, 64 MiB decoded; the first 4 files), indexed
   with seek points every 1 MiB: through the seek points only (``cache_bytes=0``: decode from
   the nearest point before each wanted run), and through the decoded in-memory form (default
   cache). For contrast, the same files without seek points (``index="ignore"``: the file
   start is the only point; a single-member file has no other) with ``cache_bytes=0``.
   Each seek-point read is checked against the decoded form before timing. Also the loader
   with ``shuffle="global"`` and ``memory_budget="64MiB"`` (the 256 MiB of decoded images do not
   fit, so they are read through the seek points), batches of 256.

Contenders alternate round by round in one process (warm page cache); medians of rounds
and per-round ratios are written.

    python benchmarks/access.py [--rounds 3] [--seconds 2] [--parts first,mid,random] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import gzip
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import stoker

sys.path.insert(0, str(Path(__file__).parent))
from compare import w2_data  # W2 is defined once, by the comparison benchmark
from harness import (
    RecordReader,
    Run,
    add_out_argument,
    alternate,
    cached_sample,
    default_cache,
    median_of,
    ratio_table,
    summary_table,
    write_results,
)

CACHE = Path(default_cache())


def many_groups(directory: Path, groups: int = 10_000, records: int = 16, frame: int = 64) -> Path:
    """``groups`` pairs of small gzip files, written once (marker file last)."""
    marker = directory / ".complete"
    if marker.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    print(f"writing {groups} small gzip groups into {directory} ...", file=sys.stderr)
    rng = np.random.default_rng(0)
    for g in range(groups):
        img = rng.integers(-128, 128, (records, frame), dtype=np.int8)
        (directory / f"img_{g:05d}.bin.gz").write_bytes(gzip.compress(img.tobytes(), compresslevel=1))
        lab = np.arange(g * records, (g + 1) * records, dtype="<f4")
        (directory / f"out_{g:05d}.bin.gz").write_bytes(gzip.compress(lab.tobytes(), compresslevel=1))
    marker.write_text("ok\n")
    return directory


def mid_groups(directory: Path, w1: Path, groups: int = 200, records: int = 256) -> Path:
    """``groups`` pairs: gzip 64x64 int8 images cut from W1's bytes (1 MiB per file) + gzip labels."""
    marker = directory / ".complete"
    if marker.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    print(f"writing {groups} gzip groups of 1 MiB into {directory} ...", file=sys.stderr)
    size = records * 4096
    with open(w1 / "img_0000.bin", "rb") as src:
        for g in range(groups):
            chunk = src.read(size)
            if len(chunk) < size:
                src.seek(0)
                chunk = src.read(size)
            (directory / f"img_{g:04d}.bin.gz").write_bytes(gzip.compress(chunk, compresslevel=1))
            lab = np.arange(g * records, (g + 1) * records, dtype="<f4")
            (directory / f"out_{g:04d}.bin.gz").write_bytes(gzip.compress(lab.tobytes(), compresslevel=1))
    marker.write_text("ok\n")
    return directory


def timed(fn: Callable[[], int], seconds: float) -> float:
    """Records per second of ``fn`` (returns records done per call) over about ``seconds``."""
    done, t0 = 0, time.perf_counter()
    while True:
        done += fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return done / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--groups", type=int, default=10_000)
    ap.add_argument("--parts", default="first,mid,random", help="which measurements: first, mid, random")
    add_out_argument(ap)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    sections = []
    if "first" in parts:
        sections.append(first_batch(args))
    w1 = cached_sample(CACHE / "sample-16x4096x128")
    if "mid" in parts:
        sections.append(mid_files(args, w1))
    if "random" in parts:
        sections.append(random_access(args, w1))
    title = f"Random access, seek points and the persistent index (warm page cache, {args.rounds} alternated rounds)"
    write_results("access", title, "\n".join(sections), script=__file__, out=args.out)
    return 0


def first_batch(args: argparse.Namespace) -> str:
    # -- 1. time to first batch ---------------------------------------------------------
    small = many_groups(CACHE / f"access-{args.groups}x16", args.groups)
    fields = {
        "image": stoker.Field(str(small / "img_*.bin.gz"), "int8", (64,)),
        "label": stoker.Field(str(small / "out_*.bin.gz"), "float32"),
    }
    t = time.perf_counter()
    stoker.write_index(stoker.Dataset(fields, index="ignore"))
    index_seconds = time.perf_counter() - t
    modes = {"no index": "ignore", "index": "auto"}
    runs = dict.fromkeys(modes, 0)  # each round's seed, the same for both contenders

    def run(name: str) -> Run:
        t0 = time.perf_counter()
        ds = stoker.Dataset(fields, index=modes[name])
        n = len(ds)
        t1 = time.perf_counter()
        runs[name] += 1
        with ds.loader(256, shuffle="global", seed=runs[name] - 1) as loader:
            batch = next(iter(loader))
        t2 = time.perf_counter()
        assert n == args.groups * 16 and len(batch["label"]) == 256
        return {"open_len_s": t1 - t0, "first_batch_s": t2 - t0}

    rounds = alternate(list(modes), args.rounds, run, show=None)
    table = summary_table(rounds, metric="first_batch_s", label="first global batch s", fmt="{:.3f}",
                          columns={"open + len(ds) s median": median_of("open_len_s", "{:.3f}")})  # fmt: skip
    return (
        f"## {args.groups:,}-group time to first batch\n\n{args.groups} groups x 2 gzip files; writing the index "
        f"took {index_seconds:.1f}s.\n\n{table}\n"
        + ratio_table(rounds, [("no index", "index", "first batch, no index / index")], metric="first_batch_s")
    )


def mid_files(args: argparse.Namespace, w1: Path) -> str:
    mid = mid_groups(CACHE / "access-200x1MiB", w1)
    mid_fields = {
        "image": stoker.Field(str(mid / "img_*.bin.gz"), "int8", (64, 64, 1)),
        "label": stoker.Field(str(mid / "out_*.bin.gz"), "float32"),
    }
    stoker.write_index(stoker.Dataset(mid_fields, index="ignore"))
    modes = {"no index": "ignore", "index": "auto"}

    def run(name: str) -> Run:
        t0 = time.perf_counter()
        ds = stoker.Dataset(mid_fields, index=modes[name])
        n = len(ds)
        with ds.loader(256) as loader:
            next(iter(loader))
        assert n == 200 * 256
        return {"seconds": time.perf_counter() - t0}

    rounds = alternate(list(modes), args.rounds, run, show=None)
    table = summary_table(rounds, metric="seconds", label="open + len(ds) + first batch s", fmt="{:.3f}")
    return f"## 200 groups of 1 MiB gzip images + gzip labels: open + len(ds) + first batch\n\n{table}\n" + ratio_table(
        rounds, [("no index", "index")], metric="seconds"
    )


def random_access(args: argparse.Namespace, w1: Path) -> str:
    # -- 2. W1 raw random access ------------------------------------------------------------
    w1_ds = stoker.Dataset(
        image=stoker.Field(str(w1 / "img_*.bin"), "int8", (128, 128, 1)),
        label=stoker.Field(str(w1 / "out_*.bin.gz"), "float32"),
    )
    n1 = len(w1_ds)
    rng = np.random.default_rng(1)
    w1_ds.read(np.arange(0, n1, 4096))  # decode the labels once (cached, 16 KiB a group)

    def read_batch() -> int:
        w1_ds.read(rng.integers(0, n1, 256))
        return 256

    def read_one() -> int:
        for i in rng.integers(0, n1, 64).tolist():
            w1_ds[i]
        return 64

    # -- 3. W2 gzip images -------------------------------------------------------------------
    w2_dir = w2_data(CACHE, pairs=4)
    w2_field = {"image": stoker.Field(str(w2_dir / "img_*.bin.gz"), "int8", (128, 128, 1))}
    t = time.perf_counter()
    written = stoker.write_index(stoker.Dataset(w2_field, index="ignore"))
    w2_index_s = time.perf_counter() - t
    w2_ds = stoker.Dataset(w2_field)
    n2 = len(w2_ds)
    firsts = np.arange(0, n2 + 1, 4096)
    w2_points = sum(len(p) for p in w2_ds._catalog.seek_points.values())
    w2_windows = sum(f.stat().st_size for f in w2_dir.glob(".stoker-windows.*"))
    w2_gz = sum(f.stat().st_size for f in w2_dir.glob("img_*.bin.gz"))
    seek_reader = RecordReader(w2_ds._catalog, cache_bytes=0)
    cache_reader = RecordReader(w2_ds._catalog)  # the default: decoded files kept, 256 MiB
    plain_reader = RecordReader(stoker.Dataset(w2_field, index="ignore")._catalog, cache_bytes=0)

    def w2_read(reader: RecordReader, k: int) -> Callable[[], int]:
        def go() -> int:
            idx = rng.integers(0, n2, k)
            g = np.searchsorted(firsts, idx, side="right") - 1
            out = {"image": np.empty((k, 128, 128, 1), np.int8)}
            reader.read_into(g, idx - firsts[g], out)
            return k

        return go

    check = np.random.default_rng(7).integers(0, n2, 64)
    g = np.searchsorted(firsts, check, side="right") - 1
    a, b = ({"image": np.empty((64, 128, 128, 1), np.int8)} for _ in range(2))
    seek_reader.read_into(g, check - firsts[g], a)
    cache_reader.read_into(g, check - firsts[g], b)  # also fills the cache before timing
    assert np.array_equal(a["image"], b["image"])
    # Global shuffle with the decoded images over memory_budget: read through the seek points.
    over_budget = w2_ds.loader(256, epochs=None, shuffle="global", seed=5, memory_budget="64MiB", prefetch=2)
    over_budget_batches = iter(over_budget)

    def global_over_budget() -> int:
        return len(next(over_budget_batches)["image"])

    contenders = {
        "W1 raw ds.read(256 random)": read_batch,
        "W1 raw ds[i]": read_one,
        "W2 gzip, seek points, batch 256": w2_read(seek_reader, 256),
        "W2 gzip, seek points, 1 record": w2_read(seek_reader, 1),
        "W2 gzip, no seek points, 1 record": w2_read(plain_reader, 1),
        "W2 gzip, decoded cache, batch 256": w2_read(cache_reader, 256),
        "W2 gzip, global shuffle over budget, loader": global_over_budget,
    }
    rounds = alternate(
        list(contenders), args.rounds, lambda name: {"records_per_s": timed(contenders[name], args.seconds)}
    )
    over_budget.close()
    pair = (
        "W2 gzip, seek points, 1 record",
        "W2 gzip, no seek points, 1 record",
        "W2 1-record reads, seek points / none",
    )
    return (
        f"## Random access ({args.rounds} rounds of {args.seconds:g}s)\n\n{summary_table(rounds)}\n"
        f"{ratio_table(rounds, [pair], fmt='{:.0f}')}\n"
        f"W2 index: {len(written)} file(s), {w2_points} seek points over {n2 * 16384 >> 20} MiB decoded; windows "
        f"{w2_windows / 2**20:.1f} MiB = {100 * w2_windows / w2_gz:.1f}% of the {w2_gz / 2**20:.0f} MiB compressed; "
        f"built in {w2_index_s:.1f}s\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
