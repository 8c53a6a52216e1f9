"""stoker against tf.data on W1: the seed's pipeline, its interleave version, a hand-tuned pipeline,
native_dataset, to_tf.

Every contender produces float32 images (256, 128, 128, 1) + float32 labels (256,) from the same
files and a consumer that only iterates and counts: a Python loop over the iterator, and, for
the TF contenders marked "in graph", a tf.function that pulls 50 batches from the iterator per
call, as Keras' fit does (its train function calls ``next(iterator)`` inside the graph), so no
Python runs per batch on the consumer's side. The contenders marked "1 inter-op thread" are the
same graph consumers after ``tf.config.threading.set_inter_op_parallelism_threads(1)``. "tf.data
hand-tuned" is the fastest plain tf.data pipeline we could write by hand for these files: each record
of the image files is a whole batch (4096 records per file is a multiple of 256), the gzip
labels likewise, per-pair zip inside a parallel deterministic interleave, one decode + cast per
batch in a parallel map. "numpy_function bridge" is to_tf with
``STOKER_TF_BRIDGE=numpy_function``: the fallback used where the native op cannot be compiled.
Rounds alternate the contenders, each in a fresh process (this kind of machine drifts by tens of
percent within a minute); ratios are taken within a round, then their median is reported. Each
contender runs ``--warmup`` seconds (and at least one batch or call) unmeasured before its timed
seconds: all are timed in their steady state.

    python benchmarks/tf_compare.py [--rounds 5] [--seconds 3] [--warmup 1] [--data DIR] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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

BATCH = 256
INREZ = 128
CONTENDERS = {
    "tf.data seed": "seed",
    "tf.data seed + interleave": "seed_interleave",
    "tf.data hand-tuned": "best",
    "stoker native_dataset": "native",
    "stoker numpy": "numpy",
    "stoker to_tf": "to_tf",
    "stoker to_tf, numpy_function bridge": "to_tf_pyfunc",
    "tf.data hand-tuned (in graph)": "best_graph",
    "stoker to_tf (in graph)": "to_tf_graph",
    "tf.data hand-tuned (in graph, 1 inter-op thread)": "best_graph_interop1",
    "stoker to_tf (in graph, 1 inter-op thread)": "to_tf_graph_interop1",
}
STEPS_PER_CALL = 50


def _files(data: Path) -> tuple[list[str], list[str]]:
    return sorted(str(p) for p in data.glob("img_*.bin")), sorted(str(p) for p in data.glob("out_*.bin.gz"))


def _seed(data: Path, interleave: bool) -> Any:
    """The seed question's pipeline; with ``interleave``, its accepted answer's version."""
    import tensorflow as tf

    img_files, out_files = _files(data)

    def images(files: Any) -> Any:
        d = tf.data.FixedLengthRecordDataset(files, INREZ * INREZ)
        d = d.map(lambda s: tf.reshape(tf.io.decode_raw(s, tf.int8), (INREZ, INREZ, 1)))
        return d.map(lambda x: tf.cast(x, dtype=tf.float32))

    def labels(files: Any) -> Any:
        d = tf.data.FixedLengthRecordDataset(files, 4, compression_type="GZIP")
        return d.map(lambda s: tf.io.decode_raw(s, tf.float32))

    if interleave:
        pairs = tf.data.Dataset.from_tensor_slices((img_files, out_files))
        xsrc = pairs.interleave(
            lambda i, o: tf.data.Dataset.zip((images(i), labels(o))), num_parallel_calls=tf.data.AUTOTUNE
        )
        xsrc = xsrc.batch(BATCH)
    else:
        xsrc = tf.data.Dataset.zip((images(img_files), labels(out_files))).batch(BATCH)
    return xsrc.repeat().prefetch(tf.data.AUTOTUNE)


def _best(data: Path) -> Any:
    """Hand-tuned tf.data: whole batches as records, one decode per batch, parallel and deterministic."""
    import tensorflow as tf

    img_files, out_files = _files(data)

    def pair(i: Any, o: Any) -> Any:
        x = tf.data.FixedLengthRecordDataset(i, BATCH * INREZ * INREZ, buffer_size=BATCH * INREZ * INREZ)
        y = tf.data.FixedLengthRecordDataset(o, 4 * BATCH, compression_type="GZIP")
        return tf.data.Dataset.zip((x, y))

    def decode(x: Any, y: Any) -> Any:
        image = tf.reshape(tf.io.decode_raw(x, tf.int8), (BATCH, INREZ, INREZ, 1))
        return tf.cast(image, tf.float32), tf.io.decode_raw(y, tf.float32)

    pairs = tf.data.Dataset.from_tensor_slices((img_files, out_files))
    xsrc = pairs.interleave(pair, cycle_length=2, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    xsrc = xsrc.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return xsrc.repeat().prefetch(tf.data.AUTOTUNE)


def _dataset(data: Path) -> Any:
    import stoker

    return stoker.Dataset(
        image=stoker.Field(str(data / "img_*.bin"), "int8", (INREZ, INREZ, 1)),
        label=stoker.Field(str(data / "out_*.bin.gz"), "float32", compression="gzip"),
    )


def _batches(kind: str, data: Path) -> Iterator[Any]:
    if kind in ("seed", "seed_interleave"):
        return iter(_seed(data, kind == "seed_interleave"))
    if kind == "best":
        return iter(_best(data))
    ds = _dataset(data)
    if kind == "native":
        from stoker.tf import native_dataset

        return iter(native_dataset(ds, BATCH, cast={"image": "float32"}, epochs=None))
    loader = ds.loader(BATCH, cast={"image": "float32"}, epochs=None)
    return iter(loader.to_tf()) if kind == "to_tf" else iter(loader)


def _child_in_graph(kind: str, data: Path, seconds: float, warmup: float) -> dict[str, float]:
    """The batches pulled inside a tf.function, STEPS_PER_CALL per call (Keras' fit loop)."""
    import tensorflow as tf

    began = time.perf_counter()

    ds = _best(data) if kind == "best" else _dataset(data).loader(BATCH, cast={"image": "float32"}, epochs=None).to_tf()
    it = iter(ds)

    @tf.function
    def steps(iterator: Any) -> Any:
        n = tf.constant(0, tf.int64)
        for _ in tf.range(STEPS_PER_CALL):
            batch = next(iterator)
            labels = batch[1] if isinstance(batch, tuple) else batch["label"]
            n += tf.shape(labels, out_type=tf.int64)[0]
        return n

    steps(it)  # trace and warm up outside the timed window
    while time.perf_counter() - began < warmup:
        steps(it)
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += int(steps(it))
    return {"records": n, "seconds": time.perf_counter() - start}


def _child(kind: str, data: Path, seconds: float, warmup: float) -> dict[str, float]:
    if kind.endswith("_interop1"):
        # TensorFlow's inter-op pool of one thread (set before TensorFlow's runtime starts): the
        # graph's ops, GetNext included, then run on that thread instead of hopping between pool
        # threads that spin for work between hops.
        import tensorflow as tf

        tf.config.threading.set_inter_op_parallelism_threads(1)
        kind = kind.removesuffix("_interop1")
    if kind == "to_tf_pyfunc":
        os.environ["STOKER_TF_BRIDGE"] = "numpy_function"
        kind = "to_tf"
    if kind.endswith("_graph"):
        return _child_in_graph(kind.removesuffix("_graph"), data, seconds, warmup)
    if kind != "numpy":
        # Imported before the warm-up's clock starts, as _child_in_graph does: TensorFlow's import
        # can use up the whole warm-up, leaving the eager TF contenders timed from their first
        # batch, start-up included (measured: benchmarks/results/tf_compare_history.md).
        import tensorflow  # noqa: F401
    began = time.perf_counter()
    return time_batches(_batches(kind, data), seconds, warmup=warmup, began=began)  # build and trace untimed


def _run(kind: str, data: Path, seconds: float, warmup: float) -> Run:
    argv = [__file__, "--child", kind, "--data", str(data), "--seconds", str(seconds), "--warmup", str(warmup)]
    return child_json(kind, argv, env={"TF_CPP_MIN_LOG_LEVEL": "2"})


RATIOS = [
    ("tf.data seed + interleave", "tf.data seed"),
    ("tf.data hand-tuned", "tf.data seed"),
    ("stoker native_dataset", "tf.data seed"),
    ("stoker native_dataset", "tf.data hand-tuned"),
    ("stoker to_tf", "tf.data hand-tuned"),
    ("stoker to_tf", "tf.data seed"),
    ("stoker to_tf", "stoker numpy"),
    ("stoker to_tf, numpy_function bridge", "stoker numpy"),
    ("stoker to_tf", "stoker to_tf, numpy_function bridge"),
    ("stoker to_tf (in graph)", "stoker numpy"),
    ("stoker to_tf (in graph)", "tf.data hand-tuned (in graph)"),
    ("stoker to_tf (in graph, 1 inter-op thread)", "stoker numpy"),
    ("stoker to_tf (in graph, 1 inter-op thread)", "stoker to_tf (in graph)"),
    ("tf.data hand-tuned (in graph, 1 inter-op thread)", "tf.data hand-tuned (in graph)"),
    ("stoker to_tf (in graph, 1 inter-op thread)", "tf.data hand-tuned (in graph, 1 inter-op thread)"),
    ("stoker native_dataset", "stoker numpy"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds each contender runs before it is timed")
    ap.add_argument("--data", default=default_cache() + "/sample-16x4096x128")
    add_out_argument(ap)
    ap.add_argument("--child", choices=sorted(CONTENDERS.values()), help=argparse.SUPPRESS)
    args = ap.parse_args()
    data = Path(args.data)
    if args.child:
        print(json.dumps(_child(args.child, data, args.seconds, args.warmup)))
        return 0
    cached_sample(data)
    rounds = alternate(
        list(CONTENDERS), args.rounds, lambda name: _run(CONTENDERS[name], data, args.seconds, args.warmup)
    )
    cores = len(os.sched_getaffinity(0))
    title = (f"tf.data vs stoker on W1 ({cores} cores, {args.rounds} alternated rounds of {args.seconds:g}s after "
             f"{args.warmup:g}s of warm-up, warm page cache; float32 images, batch {BATCH})")  # fmt: skip
    body = summary_table(rounds) + "\n" + ratio_table(rounds, RATIOS)
    write_results("tf_compare", title, body, script=__file__, out=args.out, frameworks=["tensorflow"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
