"""to_tf: a loader's batches as a `tf.data.Dataset`, and the tf.distribute options and checks it carries.

Each iteration of the dataset opens a pass of the loader (`stoker.tf.passes`) whose batches
one map stage pulls through the native op (`stoker.tf.op`) or `tf.numpy_function`; a
TensorFlow without the tf.data internals that stage is built of gets a chain of public
tf.data instead. Under tf.distribute the dataset says how it may be auto-sharded, and a
loader whose records a multi-worker job would lose or repeat is refused here.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

# tf.data's map with use_inter_op_parallelism and preserve_cardinality exposed, and the
# generator dataset with init/next/finalize functions that from_generator is built on:
# internal to TensorFlow (checked on the version constraints/ci.txt pins). A TensorFlow
# that moves either gets from_generator and the public map -> take_while -> map chain
# instead (see to_tf), with a warning.
try:
    from tensorflow.python.data.ops.map_op import _MapDataset
except ImportError:  # pragma: no cover - depends on the TensorFlow installed; tests force the path
    _MapDataset = None
try:
    from tensorflow.python.data.ops.from_generator_op import _GeneratorDataset
except ImportError:  # pragma: no cover - as above
    _GeneratorDataset = None

from ..errors import SpecError
from .iterator import eager_batches
from .op import BRIDGE_ENV, native_op
from .passes import next_values, open_pass, py_next
from .spec import element_spec as inferred_spec

if TYPE_CHECKING:
    from ..loader import Loader

__all__ = ["bridge", "to_tf"]


def bridge() -> str:
    """Which bridge `to_tf` uses in this process: `"native"`, or why not.

    `"native"`: the StokerNextBatch op, compiled at first use from `_tfbridge.c`
    against the installed TensorFlow's C API (under a second, cached per TensorFlow and source
    version under `$STOKER_CACHE/tfbridge`, else `~/.cache/stoker/tfbridge`, or the
    temp directory where that cannot be made). Else `"numpy_function: <reason>"`: no C
    compiler or Python headers, or `STOKER_TF_BRIDGE=numpy_function` set; same batches,
    more CPU per batch (measured: benchmarks/results/tf_compare_history.md).
    `STOKER_TF_BRIDGE=native` makes a failed build an error instead of a fallback.
    """
    missing = _missing_internals()
    if missing:
        return f"numpy_function: TensorFlow {tf.__version__} has no tf.data {missing} (public map/take_while chain)"
    op, why = native_op()
    return "native" if op is not None else f"numpy_function: {why}"


def _missing_internals() -> str:
    """The tf.data internals the one-stage pipeline needs that this TensorFlow lacks ("" if none)."""
    return " and ".join(
        n for n, v in (("_MapDataset", _MapDataset), ("_GeneratorDataset", _GeneratorDataset)) if v is None
    )


def to_tf(loader: Loader, *, element_spec: Mapping[str, tf.TensorSpec] | None = None) -> tf.data.Dataset:
    """The loader's batches as a `tf.data.Dataset` of dicts field -> tensor, zero-copy.

    Each iteration of the returned dataset (each Keras epoch, each `for`) starts a fresh
    pass `iter(loader)`, which closes a pass still open on the same loader; the pass
    closes, with its threads and files, when TensorFlow lets go of the iterator. Use
    `epochs=None` on the loader for a dataset that repeats without restarting. The
    dataset carries `tf.data.Options` with `inject_prefetch=False`: the loader runs
    ahead already, and TensorFlow's added prefetch thread only adds a thread hop per batch; a
    `.prefetch()` you add yourself is kept.

    Under `tf.distribute` (`strategy.experimental_distribute_dataset`, Keras' `fit`), a
    sharded loader's dataset carries `auto_shard_policy=OFF`: its records already are this
    worker's, so TensorFlow must not keep only a part of each batch; each batch is then split
    among all replicas in sync (the loader's `batch_size` is the global batch). An unsharded
    loader's carries `DATA`: every worker reads everything and keeps its part of each batch,
    once per record only where every worker's loader gives the same batches. So where this
    process is a worker of a multi-worker cluster (`TF_CONFIG`, or a
    MultiWorkerMirroredStrategy in scope), an unsharded loader with a shuffle, or a loader
    sharded among another number of workers, is a SpecError: stoker cannot see the other
    workers' seeds. See `distributed_dataset`, the one call that shards and batches right.

    Iterated eagerly (`for batch in loader.to_tf()`, a custom training loop), the dataset
    gives an iterator that skips two of TensorFlow's per-element costs it does not need (see
    `stoker.tf.iterator`). A dataset built on it (`.map`, `.prefetch`) is iterated by
    TensorFlow's own iterator, as any other.

    Consumed inside a `tf.function` (Keras' `fit`) on a host with few cores, call
    `tf.config.threading.set_inter_op_parallelism_threads(1)` before TensorFlow's first op:
    the graph's ops then stay on one thread instead of hopping between spinning pool threads
    that take CPU from the loader's workers (measured: benchmarks/results/tf_compare_history.md;
    docs/guides/keras-tfdata.md, "Few cores").

    Args:
        element_spec: the spec of each element, for a `transform=` that cannot run on a
            batch of zeros (see `element_spec`, which is used otherwise). Every batch
            is checked against it.

    Example:
        >>> loader = ds.loader(256, cast={"image": "float32"}, drop_remainder=True)  # doctest: +SKIP
        >>> model.fit(loader.to_tf().map(lambda b: (b["image"], b["label"])), epochs=2)  # doctest: +SKIP
    """
    _check_distribution(loader)
    spec = dict(inferred_spec(loader) if element_spec is None else element_spec)
    for name, s in spec.items():
        if not isinstance(s, tf.TensorSpec):
            raise SpecError(f"element_spec[{name!r}]={s!r} must be a tf.TensorSpec", field=name)
    names = list(spec)
    dtypes = [np.dtype(spec[n].dtype.as_numpy_dtype) for n in names]
    shapes = [spec[n].shape for n in names]
    seen: list[tuple[int, ...] | None] = [None] * len(names)  # shapes found compatible (see checked)

    def opened() -> int:
        return open_pass(loader, names, dtypes, shapes, seen)

    tout = [spec[n].dtype for n in names]
    missing = _missing_internals()
    if missing and os.environ.get(BRIDGE_ENV) == "native":
        raise RuntimeError(
            f"{BRIDGE_ENV}=native: TensorFlow {tf.__version__} has no tf.data {missing}, which the "
            "native bridge's one-stage map needs; unset it to use the public chain"
        )
    options = tf.data.Options()
    # inject_prefetch: TF would add a prefetch thread after the last stage; the loader already
    # runs ahead, and that extra thread hop per batch only costs CPU on few cores (measured:
    # benchmarks/results/tf_compare_history.md). A prefetch the user adds downstream is kept.
    options.experimental_optimization.inject_prefetch = False
    options.experimental_distribute.auto_shard_policy = _auto_shard_policy(loader)
    if missing:
        return eager_batches(_public_chain(opened, names, dtypes, shapes, tout).with_options(options))
    op = native_op()[0]

    def call(k: tf.Tensor) -> dict[str, tf.Tensor]:
        values = op(k, Tout=tout) if op is not None else tf.numpy_function(py_next, [k], tout, stateful=True)
        for value, shape in zip(values, shapes, strict=True):
            value.set_shape(shape)
        return dict(zip(names, values, strict=True))

    def init(_: tf.Tensor) -> tf.Tensor:
        key = tf.numpy_function(lambda: np.int64(opened()), [], tf.int64, stateful=True)
        key.set_shape(())
        return key

    def finalize(k: tf.Tensor) -> tf.Tensor:
        # Native: a close the op finds Python gone for is a quiet no-op, so an iterator
        # TensorFlow destroys after the interpreter has exited logs nothing.
        done = op(-k, Tout=[]) if op is not None else tf.numpy_function(py_next, [-k], [], stateful=True)
        with tf.control_dependencies(done if isinstance(done, list) else [done]):
            return tf.constant(0, tf.int64)

    def one_pass(token: tf.Tensor) -> tf.data.Dataset:
        # A pass per iterator: TensorFlow runs `init` at its first element, repeats the key
        # (the identity costs no op), and runs `finalize` when it destroys the iterator (an
        # early break, a dropped iterator); the pass's own end closes it at once. One map
        # stage per batch: the bridge runs on the thread that asks (no inter-op thread hop),
        # and its OutOfRange at the end of the pass ends the stage (preserve_cardinality=False;
        # tf.data's public map would turn it into an error).
        keys = _GeneratorDataset(token, init, lambda k: k, finalize, tf.TensorSpec((), tf.int64))
        return _MapDataset(keys, call, use_inter_op_parallelism=False, preserve_cardinality=False)

    # Inside flat_map: tf.data's graph optimizations see a function, not a GeneratorDataset
    # they cannot serialize (which would log a warning and skip them).
    return eager_batches(tf.data.Dataset.from_tensors(np.int64(0)).flat_map(one_pass).with_options(options))


# What the public chain's bridge returns first: whether the pass delivered a batch.
_TRUE, _FALSE = np.array(True), np.array(False)
_warned_public: list[bool] = []


def _public_chain(
    open_pass: Callable[[], int],
    names: list[str],
    dtypes: list[np.dtype],
    shapes: list[tf.TensorShape],
    tout: list[tf.DType],
) -> tf.data.Dataset:
    """`to_tf`'s dataset from public tf.data alone, for a TensorFlow without the internals it uses.

    A pass per iterator comes from `from_generator` (whose generator closes the pass when
    TensorFlow drops it). The public `map` keeps cardinality: an OutOfRange from inside it is
    an error, not the end of the pass. So the bridge returns a flag first (False once the pass
    is over, with empty arrays that never leave `take_while`), through `tf.numpy_function`
    (the native op ends a pass by OutOfRange): same batches, ~3 stages and more CPU per batch
    than the one-stage map.
    """
    if not _warned_public:
        _warned_public.append(True)
        warnings.warn(
            f"stoker.tf: TensorFlow {tf.__version__} has no tf.data {_missing_internals()} (stoker is checked on "
            "the version its CI pins); to_tf uses public map/take_while with tf.numpy_function "
            "instead (same batches, more CPU per batch)",
            RuntimeWarning,
            stacklevel=4,
        )
    ended = [
        np.zeros([d or 0 for d in shape.as_list()] if shape.rank is not None else (0,), dtype)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    ]

    def passes() -> Iterator[np.int64]:
        """One element per iteration of the dataset: the key of a fresh pass."""
        key = open_pass()
        try:
            yield np.int64(key)
        finally:  # on exhaustion, and on GeneratorExit when TF drops an iterator early
            next_values(-key)

    def flagged(key: np.ndarray) -> list[np.ndarray]:
        values = next_values(int(key))
        return [_FALSE, *ended] if values is None else [_TRUE, *values]

    def call(k: tf.Tensor) -> tuple[tf.Tensor, ...]:
        return tuple(tf.numpy_function(flagged, [k], [tf.bool, *tout], stateful=True))

    def shaped(ok: tf.Tensor, *values: tf.Tensor) -> dict[str, tf.Tensor]:
        for value, shape in zip(values, shapes, strict=True):
            value.set_shape(shape)
        return dict(zip(names, values, strict=True))

    def batches(key: tf.Tensor) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensors(key).repeat().map(call).take_while(lambda ok, *_: ok).map(shaped)

    keys = tf.data.Dataset.from_generator(passes, output_signature=tf.TensorSpec((), tf.int64))
    return keys.flat_map(batches)


def _auto_shard_policy(loader: Loader) -> tf.data.experimental.AutoShardPolicy:
    """What tf.distribute's auto-shard may do to to_tf's dataset: nothing where the loader is sharded.

    DATA for an unsharded loader is what TensorFlow's AUTO comes to for this dataset (it has no
    file source to shard), without its failed try at FILE first.
    """
    policy = tf.data.experimental.AutoShardPolicy
    return policy.OFF if loader.shard[1] > 1 else policy.DATA


def _cluster() -> tuple[int, str] | None:
    """`(workers, where seen)` where this process is one of several tf.distribute workers, else None.

    Workers as MultiWorkerMirroredStrategy counts them (chief and worker tasks). A cluster with
    parameter servers, or a task that is neither (an evaluator), builds no per-worker dataset
    through `experimental_distribute_dataset`: None.
    """
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            # Every worker holds as many replicas as this one (the strategy requires it).
            workers = strategy.num_replicas_in_sync // max(1, len(strategy.extended.worker_devices))
            return (workers, "the MultiWorkerMirroredStrategy in scope") if workers > 1 else None
    try:
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        cluster, task = config.get("cluster") or {}, (config.get("task") or {}).get("type")
        workers = len(cluster.get("chief") or []) + len(cluster.get("worker") or [])
    except (ValueError, AttributeError, TypeError):  # not a TF_CONFIG TensorFlow reads: TensorFlow says so
        return None
    if workers < 2 or cluster.get("ps") or task not in ("chief", "worker"):
        return None
    return workers, f"TF_CONFIG: {workers} workers"


def _check_distribution(loader: Loader) -> None:
    """A SpecError where tf.distribute's auto-shard would lose or repeat records without a word.

    An unsharded loader's dataset is DATA-sharded: each worker keeps its part of every batch,
    once per record only if every worker shuffles alike, and no worker can see the others'
    seeds. A sharded one is left whole: its shards must be the workers.
    """
    cluster = _cluster()
    if cluster is None:
        return
    workers, where = cluster
    index, count = loader.shard
    fix = (
        "give each worker shard=(task_index, num_workers) and the same seed (each then reads only its own "
        "records), or use stoker.tf.distributed_dataset(strategy, ds, global_batch_size, ...)"
    )
    if count == 1 and loader.shuffle:
        raise SpecError(
            f"to_tf: an unsharded loader with shuffle={loader.shuffle!r} (seed={loader.seed}) on one of several "
            f"workers ({where}): tf.distribute's auto-shard would keep this worker's part of each batch, which "
            "delivers every record once only if every worker shuffles with the same seed, and stoker cannot "
            f"see the other workers' seeds; {fix}"
        )
    if count > 1 and count != workers:
        raise SpecError(
            f"to_tf: the loader is shard {index} of {count}, but this process is one of {workers} workers "
            f"({where}); tf.distribute reads one dataset per worker, so {count} shards would "
            f"{'never be read in part' if count > workers else 'repeat records'}; {fix}"
        )
