"""stoker beside its peers and the machine's ceiling, workload by workload, in one run.

Every contender runs in a fresh process; each round runs every contender of a workload
once, in alternating order; ratios are taken within a round, then their median and spread
are reported (this kind of machine drifts by tens of percent within a minute). Every
contender, the ceiling included, runs ``--warmup`` seconds (and at least one batch) before it
is timed, so each is measured in its steady state: start-ups (threads, first maps, first touch of
new buffers, graph tracing) are excluded alike. W1-cold has no warm-up beyond its first batch:
its one cold pass would be half spent.

Workloads (all on the same files; batch 256):

- ``W1``: the seed's layout (16 x 4096 int8 128x128 frames + gzip float32 labels), float32 out, warm cache;
- ``W1-int8``: the same, no cast;
- ``W1-cold``: float32 out, ``os.sync()`` then every file evicted from the page cache
  (``posix_fadvise(DONTNEED)``) before each contender's run; ceiling = cold read + cast;
- ``W2``: the images themselves gzip-compressed (smooth, compressible frames), float32 out;
  ceiling = each file inflated front to back (isal) + cast;
- ``W3``: a global shuffle of all records, float32 out; ceiling = W1's sequential copy + cast;
- ``W1-busy``: float32 out, the consumer keeps the CPU ``BUSY_MS`` per batch as a training step
  on the host would; ceiling = that consumer alone (batches cost nothing to load).

Contenders, each in its fastest reasonable configuration we know:

- ``ceiling``: stoker.cli.bench's fastest ceiling loop, one thread per core: ``mmap_kept`` (the
  compiled streamed cast from memory maps made once per file for the run) for W1, W1-int8 and
  W3; ``mmap_stream`` (maps made at each visit) for W1-cold's one cold pass; ``inflate_cast``
  (isal inflate into a reused buffer, then the same cast) for W2;
- ``tf.data seed`` / ``tf.data interleave``: the seed question's pipeline and its interleave version;
- ``tf.data best``: ``stoker.tf.native_dataset`` (block reads, one decode per block, parallel interleave);
- ``torch DataLoader``: a map-style dataset with ``__getitems__`` reading a whole batch per call
  (one slice of a memory map + cast; a gather when shuffled), ``num_workers`` = cores; on W2 an
  ``IterableDataset`` streaming each gzip file (random access into gzip does not exist);
- ``grain``: a batched source (element i = batch i, read as one slice) with ``num_threads`` = cores;
- ``stoker numpy`` and the adapters ``to_torch``, ``to_jax``, ``to_tf`` (W1 only).

    python benchmarks/compare.py [--rounds 5] [--seconds 2.5] [--warmup 1] [--workloads W1,W2]
                                 [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from harness import (
    LoaderStats,
    Rounds,
    Run,
    Spread,
    add_out_argument,
    alternate,
    burn,
    cached_sample,
    child_json,
    dataset_from_fields,
    default_cache,
    evict_page_cache,
    stoker_child,
    table,
    time_batches,
    write_results,
)

RES = 128
BATCH = 256
BUSY_MS = 5.0  # longer than stoker's own W1 float32 step (measured: benchmarks/results/compare_history.md)
SEED = 1234

WORKLOADS: dict[str, list[str]] = {
    "W1": ["ceiling", "tf.data seed", "tf.data interleave", "tf.data best", "torch DataLoader", "grain",
           "stoker numpy", "stoker to_torch", "stoker to_jax", "stoker to_tf"],
    "W1-int8": ["ceiling", "tf.data best", "torch DataLoader", "grain", "stoker numpy"],
    "W1-cold": ["ceiling", "tf.data best", "torch DataLoader", "grain", "stoker numpy"],
    "W2": ["ceiling", "tf.data best", "torch DataLoader", "stoker numpy"],
    "W3": ["ceiling", "torch DataLoader", "grain", "stoker numpy"],
    "W1-busy": ["ceiling", "tf.data best", "torch DataLoader", "grain", "stoker numpy"],
}  # fmt: skip
NOT_RUN = {
    ("W2", "grain"): "needs random access; a gzip stream has none (decompressing all to RAM first is not streaming)",
    ("W3", "tf.data best"): "tf.data has no global shuffle short of a dataset-sized shuffle buffer",
}


def cores() -> int:
    return len(os.sched_getaffinity(0))


# -- data ---------------------------------------------------------------------------------
def w1_data(cache: Path) -> Path:
    return cached_sample(cache / "sample-16x4096x128")


def w2_data(cache: Path, pairs: int = 16, records: int = 4096) -> Path:
    """Smooth frames (8x8-pixel blocks plus 1-bit noise, ~4x compressible), gzip level 1, + W1's labels."""
    out = cache / f"w2-{pairs}x{records}x{RES}"
    if (out / ".complete").exists():
        return out
    print(f"generating W2 once into {out} ...", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from isal.igzip import compress
    except ImportError:  # pragma: no cover
        compress = gzip.compress
    rng = np.random.default_rng(0)
    for g in range(pairs):
        coarse = rng.integers(-100, 100, size=(records, RES // 8, RES // 8), dtype=np.int8)
        frames = np.repeat(np.repeat(coarse, 8, axis=1), 8, axis=2)
        frames += rng.integers(0, 2, size=frames.shape, dtype=np.int8)
        (out / f"img_{g:04d}.bin.gz").write_bytes(compress(frames.tobytes(), 1))
        labels = np.arange(g * records, (g + 1) * records, dtype="<f4")
        (out / f"out_{g:04d}.bin.gz").write_bytes(gzip.compress(labels.tobytes(), 1))
    (out / ".complete").write_text("ok\n")
    return out


def data_for(workload: str, cache: Path) -> Path:
    return w2_data(cache) if workload == "W2" else w1_data(cache)


def out_dtype(workload: str) -> str:
    return "int8" if workload == "W1-int8" else "float32"


def stoker_fields(workload: str, data: Path) -> list[dict[str, Any]]:
    image = {"name": "image", "files": str(data / "img_*.bin"), "dtype": "int8", "shape": [RES, RES, 1]}
    if workload == "W2":
        image = {**image, "files": str(data / "img_*.bin.gz"), "compression": "gzip"}
    label = {"name": "label", "files": str(data / "out_*.bin.gz"), "dtype": "float32", "compression": "gzip"}
    return [image, label]


# -- peers ----------------------------------------------------------------------------------
class BatchSource:
    """Whole batches of W1 records from memory maps: one slice per group a batch touches."""

    def __init__(self, data: Path, dtype: str, shuffle: bool) -> None:
        self.images = sorted(str(p) for p in data.glob("img_*.bin"))
        labels = sorted(data.glob("out_*.bin.gz"))
        self.labels = np.concatenate([np.frombuffer(gzip.decompress(p.read_bytes()), "<f4") for p in labels])
        self.counts = [os.path.getsize(p) // (RES * RES) for p in self.images]
        self.firsts = np.concatenate([[0], np.cumsum(self.counts)])
        self.dtype = np.dtype(dtype)
        self.order = np.random.default_rng(SEED).permutation(len(self)) if shuffle else None
        self.maps: list[np.ndarray] | None = None  # opened lazily: once per worker process

    def __len__(self) -> int:
        return int(self.firsts[-1])

    def read(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Records ``index`` (any order) as one resident (n, 128, 128, 1) array + labels."""
        if self.maps is None:
            pairs = zip(self.images, self.counts, strict=True)
            self.maps = [np.memmap(p, np.int8, "r", shape=(n, RES, RES, 1)) for p, n in pairs]
        if self.order is not None:
            index = self.order[index]
        out = np.empty((len(index), RES, RES, 1), self.dtype)
        groups = np.searchsorted(self.firsts, index, side="right") - 1
        if len(index) and groups[0] == groups[-1] and index[-1] - index[0] == len(index) - 1:
            g = int(groups[0])  # contiguous: one slice, cast in the copy
            np.copyto(out, self.maps[g][index[0] - self.firsts[g] : index[-1] + 1 - self.firsts[g]], casting="unsafe")
        else:
            for g in np.unique(groups):
                rows = np.flatnonzero(groups == g)
                out[rows] = self.maps[g][np.sort(index[rows]) - self.firsts[g]][np.argsort(np.argsort(index[rows]))]
        return out, self.labels[index]

    # torch's map-style protocol: the DataLoader hands a whole batch of indices to __getitems__.
    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])

    def __getitems__(self, indices: list[int]) -> Any:
        import torch

        image, label = self.read(np.asarray(indices, dtype=np.int64))
        return torch.from_numpy(image), torch.from_numpy(label)


class GrainBatches:
    """Grain source whose element i is batch i (one bulk read), so Grain moves batches, not records."""

    def __init__(self, source: BatchSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source) // BATCH

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        image, label = self.source.read(np.arange(i * BATCH, (i + 1) * BATCH))
        return {"image": image, "label": label}


def _identity(x: Any) -> Any:
    return x


def _torch_gzip_stream(data: Path, dtype: str) -> Any:
    import torch.utils.data
    from isal.igzip import decompress

    images = sorted(data.glob("img_*.bin.gz"))
    labels = sorted(data.glob("out_*.bin.gz"))

    class Stream(torch.utils.data.IterableDataset):
        """Each worker inflates whole files of its share and yields batches cut from them."""

        def __iter__(self) -> Iterator[Any]:
            info = torch.utils.data.get_worker_info()
            k, n = (info.id, info.num_workers) if info else (0, 1)
            for img, lab in list(zip(images, labels, strict=True))[k::n]:
                frames = np.frombuffer(decompress(img.read_bytes()), np.int8).reshape(-1, RES, RES, 1)
                ys = np.frombuffer(decompress(lab.read_bytes()), "<f4")
                for i in range(0, len(frames), BATCH):
                    yield torch.from_numpy(frames[i : i + BATCH].astype(dtype)), torch.from_numpy(ys[i : i + BATCH])

    return Stream()


def batches(kind: str, workload: str, data: Path) -> Iterator[Any]:
    """An endless iterator of batches of contender ``kind`` on ``workload``."""
    dtype = out_dtype(workload)
    if kind in ("tf.data seed", "tf.data interleave"):
        sys.path.insert(0, str(Path(__file__).parent))
        from tf_compare import _seed  # the seed pipeline, written once, for W1

        return iter(_seed(data, kind == "tf.data interleave"))
    if kind == "tf.data best":
        from stoker.tf import native_dataset

        ds = dataset_from_fields(stoker_fields(workload, data))
        return iter(native_dataset(ds, BATCH, cast={"image": dtype}, epochs=None))
    if kind.startswith("stoker to_"):
        loader = dataset_from_fields(stoker_fields(workload, data)).loader(BATCH, epochs=None, cast={"image": dtype})
        return iter(getattr(loader, kind.split()[1])())
    if kind == "torch DataLoader":
        import torch.utils.data

        if workload == "W2":
            dl = torch.utils.data.DataLoader(
                _torch_gzip_stream(data, dtype), batch_size=None, num_workers=cores(), persistent_workers=True
            )
        else:
            src = BatchSource(data, dtype, shuffle=workload == "W3")
            dl = torch.utils.data.DataLoader(
                src, batch_size=BATCH, collate_fn=_identity, num_workers=cores(), persistent_workers=True
            )

        def endless() -> Iterator[Any]:
            while True:
                yield from dl

        return endless()
    if kind == "grain":
        import grain

        src = BatchSource(data, dtype, shuffle=workload == "W3")
        opts = grain.ReadOptions(num_threads=cores(), prefetch_buffer_size=2 * cores())
        return iter(grain.MapDataset.source(GrainBatches(src)).repeat().to_iter_dataset(opts))
    raise ValueError(kind)


def warmup_for(workload: str, warmup: float) -> float:
    """Seconds run before the timed ones: none for W1-cold (its one cold pass would be half spent)."""
    return 0.0 if workload == "W1-cold" else warmup


# The framework each contender imports, by a word of its name.
FRAMEWORKS = {"tf.data": "tensorflow", "to_tf": "tensorflow", "torch": "torch", "to_jax": "jax", "grain": "grain"}


def child(kind: str, workload: str, data: Path, seconds: float, warmup: float = 0.0) -> dict[str, float]:
    # The contender's framework is imported before the warm-up's clock starts, since TensorFlow's
    # import can use up the whole warm-up and leave the TF contenders timed from their first
    # batch, start-up included (measured: benchmarks/results/tf_compare_history.md).
    for word, module in FRAMEWORKS.items():
        if word in kind:
            importlib.import_module(module)
    began = time.perf_counter()
    it = batches(kind, workload, data)
    busy = BUSY_MS / 1000 if workload == "W1-busy" else 0.0
    # Start-up, the first batch and the warm-up excluded, for every contender alike.
    out = time_batches(it, seconds, warmup=warmup, began=began, step=(lambda: burn(busy)) if busy else None)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return out


def consumer_alone(seconds: float, warmup: float = 0.0) -> dict[str, float]:
    """W1-busy's ceiling: the consumer's step with batches that cost nothing to load."""
    burn(warmup)
    n = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        burn(BUSY_MS / 1000)
        n += BATCH
    return {"records": n, "seconds": elapsed}


# -- one run of one contender -----------------------------------------------------------------
def run_one(kind: str, workload: str, data: Path, seconds: float, warmup: float = 0.0) -> Run:
    """Records/s (and stoker's stats) of one contender, in a fresh process."""
    dtype = out_dtype(workload)
    warmup = warmup_for(workload, warmup)
    if workload == "W1-cold":
        os.sync()
        evict_page_cache([str(p) for p in data.iterdir() if p.name.startswith(("img_", "out_"))])
    if kind == "stoker numpy":
        # The images alone are cast, as the ceiling and the peers cast them; labels stay float32.
        cfg: dict[str, Any] = {"fields": stoker_fields(workload, data), "batch": BATCH, "cast": {"image": dtype},
                               "seconds": seconds, "shuffle": "global" if workload == "W3" else None,
                               "busy_ms": BUSY_MS if workload == "W1-busy" else 0,
                               "warmup": warmup or True}  # fmt: skip
        return stoker_child(f"{workload} {kind}", "stoker", cfg)
    if kind == "ceiling" and workload != "W1-busy":
        w2 = workload == "W2"
        paths = sorted(str(p) for p in data.glob("img_*.bin.gz" if w2 else "img_*.bin"))
        # Warm workloads: files mapped once for the run (mmap_kept, the fastest loop we know; stoker
        # keeps its maps across epochs too). W1-cold: mapped per visit, the cold pass as before.
        loop = "inflate_cast" if w2 else "mmap_stream" if workload == "W1-cold" else "mmap_kept"
        cfg = {"paths": paths, "header": 0, "shape": [RES, RES, 1], "src_dtype": "|i1", "out_dtype": dtype,
               "batch": BATCH, "loop": loop, "threads": cores(), "seconds": seconds, "warmup": warmup}  # fmt: skip
        return stoker_child(f"{workload} {kind}", "ceiling", cfg)
    argv = [__file__, "--child", kind, "--workload", workload, "--data", str(data), "--seconds", str(seconds),
            "--warmup", str(warmup)]  # fmt: skip
    return child_json(f"{workload} {kind}", argv, env={"TF_CPP_MIN_LOG_LEVEL": "2"})


# -- report -------------------------------------------------------------------------------------
def _rounds(rates: dict[str, list[float | None]]) -> Rounds:
    """A workload's records/s per contender and round (None: failed) as the harness's rounds."""
    runs = {k: [{"records_per_s": x} if x else None for x in rs] for k, rs in rates.items()}
    return Rounds(tuple(rates), runs)  # type: ignore[arg-type]


def spread(values: list[float]) -> dict[str, float]:
    s = Spread.of(values)
    return {"median": s.median, "min": s.low, "max": s.high}


def report(results: dict[str, Any], meta: dict[str, Any]) -> str:
    """The table of every workload's contenders: medians, ratios to the ceiling and from stoker."""
    rows: list[list[object]] = []
    for w, res in results.items():
        rounds = _rounds(res["rates"])
        for kind in rounds.contenders:
            if not rounds.ok(kind):
                rows.append([w, kind, "failed", "", "", "", ""])
                continue
            s = rounds.spread(kind)
            cells: list[object] = [w, kind, f"{s.median:,.0f}", f"{s.low:,.0f}", f"{s.high:,.0f}"]
            for a, b in ((kind, "ceiling"), ("stoker numpy", kind)):
                r = rounds.ratios(a, b) if a != b else []
                cells.append(Spread.of(r).text(brackets="[]") if r else "")
            rows.append(cells)
        rows += [[w, kind, f"not run: {why}", "", "", "", ""] for (ww, kind), why in NOT_RUN.items() if ww == w]
    lines = [
        f"{meta['rounds']} alternated rounds of {meta['seconds']:g}s after {meta.get('warmup', 0):g}s of warm-up, "
        f"batch {BATCH}. Ratios are per round (same round), then median [min..max].",
        "",
        table(["workload", "contender", "records/s median", "min", "max", "/ ceiling", "stoker numpy / this"], rows,
              align="llrrrrr"),
    ]  # fmt: skip
    verdicts = [(w, res["verdict"]) for w, res in results.items() if res.get("verdict")]
    if verdicts:
        lines += ["stoker's own verdict (`stoker.doctor.verdict` on the median round's `loader.stats()`):", ""]
        lines += [f"- {w}: {v}" for w, v in verdicts]
    return "\n".join(lines) + "\n"


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.8), squeeze=False)
    for ax, w in zip(axes[0], names, strict=True):
        rates = results[w]["rates"]
        kinds = [k for k in rates if k != "ceiling" and any(rates[k])]
        med = [statistics.median([x for x in rates[k] if x]) / 1e3 for k in kinds]
        colors = ["tab:orange" if k.startswith("stoker") else "tab:gray" for k in kinds]
        ax.bar(range(len(kinds)), med, color=colors)
        if any(rates.get("ceiling", [])):
            ceiling = statistics.median([x for x in rates["ceiling"] if x]) / 1e3
            ax.axhline(ceiling, color="tab:red", linestyle="--", label=f"ceiling {ceiling:,.0f}k")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_xticks(range(len(kinds)), kinds, rotation=60, ha="right", fontsize=8)
        ax.set_title(w)
        ax.set_ylabel("thousand records/s (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds each contender runs before it is timed")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    ap.add_argument("--contenders", default=None, help="comma-separated subset of contenders (ceiling is always run)")
    ap.add_argument("--cache", default=default_cache())
    add_out_argument(ap)  # compare.md and its history, compare.json, compare.png
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        out = consumer_alone(args.seconds, args.warmup) if args.child == "consumer alone" else (
            child(args.child, args.workload, Path(args.data), args.seconds, args.warmup))  # fmt: skip
        print(json.dumps(out))
        return 0
    from stoker.doctor import verdict

    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    only = None if args.contenders is None else {c.strip() for c in args.contenders.split(",")} | {"ceiling"}
    cache = Path(args.cache)
    results: dict[str, Any] = {}
    for w in chosen:
        data = data_for(w, cache)
        kinds = [k for k in WORKLOADS[w] if only is None or k in only]

        def run(kind: str, w: str = w, data: Path = data) -> Run:
            which = "consumer alone" if (kind, w) == ("ceiling", "W1-busy") else kind
            return run_one(which, w, data, args.seconds, args.warmup)

        # A contender that fails is reported and left out of its round; the others go on.
        rounds = alternate(kinds, args.rounds, run, keep_going=True, label=f"{w} ")
        rates = {k: [r["records_per_s"] if r else None for r in rounds.runs[k]] for k in kinds}
        stats = [(r["records_per_s"], r["stats"]) for k in kinds for r in rounds.ok(k) if r.get("stats")]
        res: dict[str, Any] = {"rates": rates}
        if stats:
            stats.sort(key=lambda x: x[0])
            median_stats = LoaderStats.from_dict(stats[len(stats) // 2][1])
            ratio = rounds.ratios("stoker numpy", "ceiling")
            res["verdict"] = verdict(median_stats, statistics.median(ratio) if ratio and w != "W1-busy" else None)
            res["stoker_stats"] = median_stats.to_dict()
        results[w] = res
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cores": cores(), "rounds": args.rounds,
            "seconds": args.seconds, "warmup": args.warmup, "busy_ms": BUSY_MS}  # fmt: skip
    title = f"stoker vs peers and the ceiling ({cores()} cores, batch {BATCH})"
    write_results("compare", title, report(results, meta), script=__file__, out=args.out, argv=argv,
                  frameworks=["tensorflow", "torch", "jax", "grain"])  # fmt: skip
    folder = Path(args.out)
    summary = {
        w: {k: spread([x for x in rs if x]) for k, rs in res["rates"].items() if any(rs)} for w, res in results.items()
    }
    ratios: dict[str, dict[str, Any]] = {}
    for w, res in results.items():
        rounds = _rounds(res["rates"])
        ratios[w] = {k: spread(r) for k in rounds.contenders if k != "ceiling" and (r := rounds.ratios(k, "ceiling"))}
    (folder / "compare.json").write_text(json.dumps({"meta": meta, "results": results, "summary": summary,
                                                  "ratio_to_ceiling": ratios}, indent=1))  # fmt: skip
    try:
        chart(results, folder / "compare.png")
    except ImportError:
        print("matplotlib is not installed: no chart (pip install 'stoker[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
