"""TensorFlow adapter: a loader as a `tf.data.Dataset`, and a pure-graph tf.data pipeline.

Two ways in, for two needs, and a third for `tf.distribute`:

- `to_tf` (`loader.to_tf()`): stoker's engine feeds `tf.data` through one op,
  `StokerNextBatch` (`_tfbridge.c`, compiled at first use against TensorFlow's C API):
  it takes the GIL once per batch, pulls the loader's next batch and wraps each array's
  memory as a tensor, zero-copy, keeping the array alive as long as the tensor. stoker's
  batch buffers are page aligned; less aligned arrays (a transform's output) are copied.
  stoker never rewrites a buffer while an array on it is alive, so a tensor you hold never
  changes under you (tests check both). Where the op cannot be built (no C compiler),
  `tf.numpy_function` does the same with more CPU per batch (see `bridge`); the op
  exists because `from_generator`, converting numpy batches or yielding DLPack tensors,
  costs far more TF CPU per batch (measured: benchmarks/results/tf_compare_history.md).
- `distributed_dataset`: `to_tf()` of each worker's own shard under a `tf.distribute`
  strategy, each record once per epoch over all replicas.
- `native_dataset`: the same records in the same order as `ds.loader(...)` with
  `shuffle=False`, as a serializable tf.data graph (TPU, tf.data service), built the
  way tf.data is fastest: per-group zip inside an interleave, whole blocks per element,
  one vectorized decode per block, parallel and deterministic.

TensorFlow is imported here only: `import stoker` needs numpy alone.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import itertools
import json
import math
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

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
# What to_tf's eager iterator is made of (see _EagerBatches): where any module, or any attribute
# in _EAGER_ATTRIBUTES, is missing, to_tf's dataset is iterated by TensorFlow's own iterator.
try:
    from tensorflow.python.data.ops.dataset_ops import UnaryUnchangedStructureDataset as _Unchanged
    from tensorflow.python.data.ops.iterator_ops import OwnedIterator as _OwnedIterator
    from tensorflow.python.eager import context as _context
    from tensorflow.python.framework import ops as _ops
    from tensorflow.python.ops.gen_dataset_ops import iterator_get_next as _iterator_get_next
except ImportError:  # pragma: no cover - as above
    _Unchanged = _OwnedIterator = _context = _ops = _iterator_get_next = None

from ..engine.executor import ALIGNMENT
from ..errors import SpecError
from ..plan.batches import default_block_length, default_cycle_length
from ..spec import resolve_cast
from ..transforms import batch_rng

if TYPE_CHECKING:
    from ..dataset import Dataset
    from ..engine.fusion import Stage
    from ..loader import Loader

__all__ = ["as_tensor", "bridge", "distributed_dataset", "element_spec", "native_dataset", "to_tf"]

# tf.io.decode_raw's out_type set; other dtypes (uint32, uint64) decode as bytes + bitcast.
_DECODE_RAW = {
    np.dtype(t) for t in ("bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16")
}
_TF_COMPRESSION = {None: "", "gzip": "GZIP", "zlib": "ZLIB"}


def as_tensor(array: np.ndarray) -> tf.Tensor:
    """`array` as an eager tensor: zero-copy via DLPack when TensorFlow can alias it, else a copy.

    TensorFlow aliases DLPack memory that is 64-byte aligned and C-contiguous, and keeps
    the producer (the numpy array) alive as long as the tensor. Less aligned memory must
    not be aliased: TF 2.21 accepts it, then aborts the process in the first op that
    checks alignment (a strided slice does). Such arrays are copied into TF's own memory.
    """
    if array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0 and array.dtype.isnative:
        if array.dtype.kind == "V":  # ml_dtypes' bfloat16: DLPack has no such numpy dtype; its bits do
            bits = tf.experimental.dlpack.from_dlpack(array.view(f"i{array.dtype.itemsize}").__dlpack__())
            return tf.bitcast(bits, tf.as_dtype(array.dtype))
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(np.ascontiguousarray(array))


def element_spec(loader: Loader) -> dict[str, tf.TensorSpec]:
    """The `element_spec` of `to_tf(loader)`: static batch dimension with drop_remainder.

    Built-in transforms (`stoker.transforms`) declare what they make of each field; a
    user function in `transform=` is run once on a batch of zeros of the shapes and
    dtypes it receives, and the spec is read off its output. A leading dimension equal to
    the batch size is the batch dimension (static with drop_remainder, else None).
    """
    batch = loader.batch_size if loader.drop_remainder else None
    stage = loader._stage
    if stage is None or stage.exact:
        return {
            name: tf.TensorSpec((batch, *loader.shapes[name]), tf.as_dtype(dtype))
            for name, dtype in loader.dtypes.items()
        }
    return _traced_spec(stage, loader.batch_size, batch)


def _traced_spec(stage: Stage, rows: int, batch: int | None) -> dict[str, tf.TensorSpec]:
    """Run the user functions after the built-in head on zeros; the spec of what comes out."""
    out: Mapping[str, np.ndarray] = {n: np.zeros((rows, *s), d) for n, (s, d) in stage.records.items()}
    for k in range(stage.head, len(stage.transforms)):
        fn = stage.transforms[k]
        try:
            out = fn(dict(out), batch_rng(stage.seed, 0, 0, k))
        except Exception as e:
            raise SpecError(
                f"to_tf runs transform {k} ({getattr(fn, '__name__', repr(fn))}) once on a batch of zeros to learn "
                f"the element_spec, and it raised {type(e).__name__}: {e}; pass to_tf(element_spec=...) instead"
            ) from e
        if not isinstance(out, Mapping) or not all(isinstance(v, np.ndarray) for v in out.values()):
            raise SpecError(f"transform {k} returned {type(out).__name__}, expected a dict of numpy arrays")
    spec = {}
    for name, array in out.items():
        if array.ndim and array.shape[0] == rows:
            shape: tuple[int | None, ...] = (batch, *array.shape[1:])
        elif array.ndim:  # not one row per record: its length may differ from batch to batch
            shape = (None, *array.shape[1:])
        else:
            shape = ()
        spec[name] = tf.TensorSpec(shape, tf.as_dtype(array.dtype.newbyteorder("=")))
    return spec


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
    `_BatchIterator`). A dataset built on it (`.map`,
    `.prefetch`) is iterated by TensorFlow's own iterator, as any other.

    Consumed inside a `tf.function` (Keras' `fit`) on a host with few cores, call
    `tf.config.threading.set_inter_op_parallelism_threads(1)` before TensorFlow's first op:
    the graph's ops then stay on one thread instead of hopping between spinning pool threads
    that take CPU from the loader's workers (measured: benchmarks/results/tf_compare_history.md;
    README, From tf.data).

    Args:
        element_spec: the spec of each element, for a `transform=` that cannot run on a
            batch of zeros (see `element_spec`, which is used otherwise). Every batch
            is checked against it.

    Example:
        >>> loader = ds.loader(256, cast={"image": "float32"}, drop_remainder=True)  # doctest: +SKIP
        >>> model.fit(loader.to_tf().map(lambda b: (b["image"], b["label"])), epochs=2)  # doctest: +SKIP
    """
    _check_distribution(loader)
    spec = dict(_element_spec(loader) if element_spec is None else element_spec)
    for name, s in spec.items():
        if not isinstance(s, tf.TensorSpec):
            raise SpecError(f"element_spec[{name!r}]={s!r} must be a tf.TensorSpec", field=name)
    names = list(spec)
    dtypes = [np.dtype(spec[n].dtype.as_numpy_dtype) for n in names]
    shapes = [spec[n].shape for n in names]
    seen: list[tuple[int, ...] | None] = [None] * len(names)  # shapes found compatible (see _checked)

    def open_pass() -> int:
        return _open_pass(loader, names, dtypes, shapes, seen)

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
        return _eager_batches(_public_chain(open_pass, names, dtypes, shapes, tout).with_options(options))
    op = _native()[0]

    def call(k: tf.Tensor) -> dict[str, tf.Tensor]:
        values = op(k, Tout=tout) if op is not None else tf.numpy_function(_py_next, [k], tout, stateful=True)
        for value, shape in zip(values, shapes, strict=True):
            value.set_shape(shape)
        return dict(zip(names, values, strict=True))

    def init(_: tf.Tensor) -> tf.Tensor:
        key = tf.numpy_function(lambda: np.int64(open_pass()), [], tf.int64, stateful=True)
        key.set_shape(())
        return key

    def finalize(k: tf.Tensor) -> tf.Tensor:
        # Native: a close the op finds Python gone for is a quiet no-op, so an iterator
        # TensorFlow destroys after the interpreter has exited logs nothing.
        done = op(-k, Tout=[]) if op is not None else tf.numpy_function(_py_next, [-k], [], stateful=True)
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
    return _eager_batches(tf.data.Dataset.from_tensors(np.int64(0)).flat_map(one_pass).with_options(options))


def distributed_dataset(
    strategy: tf.distribute.Strategy,
    ds: Dataset,
    global_batch_size: int,
    *,
    map_func: Callable[[dict[str, tf.Tensor]], Any] | None = None,
    **loader_kwargs: Any,
) -> Any:
    """`ds`'s records spread over every replica of `strategy`, each record once per epoch.

    Built on `strategy.distribute_datasets_from_function`: each input pipeline (one per
    worker) iterates `ds.loader(per_replica_batch, shard=(input_pipeline_id,
    num_input_pipelines), **loader_kwargs).to_tf()`, where `per_replica_batch` is
    `global_batch_size` over `strategy.num_replicas_in_sync`; each worker reads only its own
    shard of every epoch's sequence, which one seed (`loader_kwargs`' `seed`) orders the same
    on every worker. Where the workers are several processes, they compare their loaders'
    configurations (one collective) and raise a SpecError naming what differs (a seed drawn
    per worker, say), which would lose records without a word.

    Args:
        strategy: any `tf.distribute.Strategy` (MultiWorkerMirroredStrategy, MirroredStrategy, ...).
        ds: the Dataset.
        global_batch_size: records per step over all replicas; a multiple of the replicas in sync.
        map_func: applied to each batch in the graph (`Dataset.map`), e.g. `lambda b: (b["image"],
            b["label"])` for Keras' `fit`, which wants `(x, y)`.
        **loader_kwargs: passed to `Dataset.loader` (`shuffle`, `seed`, `cast`,
            `drop_remainder`, `epochs`, ...), all but `shard`, which this sets.

    Returns:
        A `tf.distribute.DistributedDataset`, for a custom loop (`strategy.run`) or Keras' `fit`.

    Example:
        >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()  # doctest: +SKIP
        >>> batches = stoker.tf.distributed_dataset(
        ...     strategy, ds, 512, shuffle="global", seed=7, cast={"image": "float32"}, drop_remainder=True
        ... )  # doctest: +SKIP
        >>> for batch in batches:  # doctest: +SKIP
        ...     strategy.run(train_step, args=(batch,))
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int | np.integer):
        raise SpecError(f"{global_batch_size=} must be a positive integer")
    replicas = strategy.num_replicas_in_sync
    if global_batch_size < 1 or global_batch_size % replicas:
        raise SpecError(
            f"{global_batch_size=} must be a positive multiple of the strategy's {replicas} replicas in sync, "
            "so every replica takes the same batch"
        )
    if "shard" in loader_kwargs:
        raise SpecError(
            f"distributed_dataset shards by input pipeline itself; drop shard={loader_kwargs['shard']!r}",
        )
    loaders: list[Loader] = []

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        shard = (context.input_pipeline_id, context.num_input_pipelines)
        loader = ds.loader(context.get_per_replica_batch_size(int(global_batch_size)), shard=shard, **loader_kwargs)
        loaders.append(loader)
        dataset = to_tf(loader)
        return dataset if map_func is None else dataset.map(map_func)

    distributed = strategy.distribute_datasets_from_function(dataset_fn)
    if loaders and loaders[0].shard[1] > 1:
        _check_agreement(strategy, loaders[0])
    return distributed


def _check_agreement(strategy: tf.distribute.Strategy, loader: Loader) -> None:
    """A SpecError on every worker whose loader orders an epoch otherwise than the others'.

    Each replica contributes a hash of every part of its loader's fingerprint (the dataset's
    files and counts, shuffle, seed, window, interleave: what orders the epoch's sequence, as
    `state_dict` records it); one gather compares them.
    """
    parts = loader.state_dict()["parts"]
    names = sorted(parts)
    mine = tf.constant([[int(parts[n][:15], 16) for n in names]], tf.int64)  # 60 bits of each part's sha256
    values = strategy.experimental_distribute_values_from_function(lambda _: mine)
    everyone = strategy.gather(values, axis=0).numpy()
    differ = [n for j, n in enumerate(names) if (everyone[:, j] != everyone[0, j]).any()]
    if differ:
        raise SpecError(
            f"distributed_dataset: the workers' loaders differ in {', '.join(differ)} (this worker's: "
            f"{', '.join(f'{n}={_fingerprint_value(loader, n)!r}' for n in differ)}); every worker must order the "
            "epoch alike (one seed for all), or their shards would overlap and leave records out"
        )


def _fingerprint_value(loader: Loader, part: str) -> object:
    """What a part of the loader's fingerprint is, for an error message (its value, or "...")."""
    value = getattr(loader, part, "...")
    return value if isinstance(value, int | str | bool) or value is None else "..."


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


# What _BatchIterator reads of TensorFlow's OwnedIterator, beside its modules: an instance's
# attributes (probed on a small iterator) and the iterator's own method it replaces.
_EAGER_ATTRIBUTES = ("_iterator_resource", "_flat_output_types", "_flat_output_shapes", "_element_spec")
_eager_missing: list[str] = []  # "" or what this TensorFlow lacks, once probed
_warned_eager: list[bool] = []


def _missing_eager() -> str:
    """What of TensorFlow's iterator internals _BatchIterator needs this TensorFlow lacks ("" if none).

    Probed once per process on a one-element iterator, so a TensorFlow that renamed one falls
    back when to_tf's dataset is made, not at its first `next()`.
    """
    if _Unchanged is None:
        return "tf.data's iterator modules"
    if not _eager_missing:
        missing = [f"OwnedIterator.{n}" for n in ("_next_internal",) if not callable(getattr(_OwnedIterator, n, None))]
        if not callable(getattr(_context.context().executor, "is_async", None)):
            missing.append("Executor.is_async")
        if not missing:
            probe = _OwnedIterator(tf.data.Dataset.from_tensors(np.int64(0)))
            missing = [f"OwnedIterator.{n}" for n in _EAGER_ATTRIBUTES if not hasattr(probe, n)]
        _eager_missing.append(", ".join(missing))
    return _eager_missing[0]


def _eager_batches(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset`, whose iterators made eagerly skip two of TensorFlow's costs per element
    (see _BatchIterator); `dataset` itself where this TensorFlow lacks what that needs, or
    where it is built in a graph (its iterators are TensorFlow's there anyway)."""
    if not tf.executing_eagerly():
        return dataset
    missing = _missing_eager()
    if missing and not _warned_eager:
        _warned_eager.append(True)
        warnings.warn(
            f"stoker.tf: TensorFlow {tf.__version__} has no {missing} (stoker is checked on the version its [tf] "
            "extra pins); to_tf's datasets are iterated by TensorFlow's own iterator (same batches, ~80 us more "
            "CPU per batch in an eager loop)",
            RuntimeWarning,
            stacklevel=4,
        )
    return dataset if missing else _EagerBatches(dataset)


if _Unchanged is not None:

    class _BatchIterator(_OwnedIterator):
        """TensorFlow's eager iterator less two costs of each `next()` that to_tf's batches do
        not need, together a large share of the consuming thread's CPU a batch (measured:
        benchmarks/results/tf_compare_history.md).

        - `execution_mode(SYNC)` around each `IteratorGetNext`: it makes a new executor,
          swaps it in and waits on both, so that the end of the data raises at the call even
          under an asynchronous executor. Under the synchronous one, TensorFlow's default, the
          op runs synchronously anyway; under an asynchronous one this iterator takes
          TensorFlow's own path.
        - rebuilding the dict through `structure.from_compatible_tensor_list`: each tensor
          already has its spec's dtype (the op's output types) and a shape the bridge checked
          against the spec (`_checked`); the tensors come in `tf.nest`'s order of the
          spec's keys, and the dict is built in the spec's own order, as TensorFlow builds it.

        Inside a `tf.function` (an iterator made eagerly and used in a graph, as Keras does),
        TensorFlow's own path runs.
        """

        def __init__(self, dataset: tf.data.Dataset) -> None:
            super().__init__(dataset)
            spec = self._element_spec
            at = {name: j for j, name in enumerate(tf.nest.flatten({name: name for name in spec}))}
            self._stoker_slots = [(name, at[name]) for name in spec]

        def _next_internal(self) -> Any:
            if not _context.executing_eagerly() or _context.context().executor.is_async():
                return super()._next_internal()
            values = _iterator_get_next(
                self._iterator_resource, output_types=self._flat_output_types, output_shapes=self._flat_output_shapes
            )
            return {name: values[j] for name, j in self._stoker_slots}

    class _EagerBatches(_Unchanged):
        """to_tf's dataset, unchanged (the same graph, `element_spec` and options), whose
        iterators made eagerly are `_BatchIterator`. What the user builds on it (`map`,
        `prefetch`, a distribution) is TensorFlow's own dataset and iterator."""

        def __init__(self, dataset: tf.data.Dataset) -> None:
            super().__init__(dataset, dataset._variant_tensor)

        def __iter__(self) -> Any:
            if not _context.executing_eagerly():
                return super().__iter__()
            with _ops.colocate_with(self._variant_tensor):
                return _BatchIterator(self)


def _missing_internals() -> str:
    """The tf.data internals the one-stage pipeline needs that this TensorFlow lacks ("" if none)."""
    return " and ".join(
        n for n, v in (("_MapDataset", _MapDataset), ("_GeneratorDataset", _GeneratorDataset)) if v is None
    )


def _open_pass(
    loader: Loader,
    names: list[str],
    dtypes: list[np.dtype],
    shapes: list[tf.TensorShape],
    seen: list[tuple[int, ...] | None],
) -> int:
    """Start a pass of `loader`; its batches are pulled under the key returned, its close under -key.

    The pass's end closes the loader's pass at once (threads and files); its entries stay until
    the close call, so a late call finds its key (a pull gets the end again, a close nothing).
    """
    key = next(_KEYS)
    it = iter(loader)
    count = itertools.count()

    def end() -> None:
        close = getattr(it, "close", None)
        if close is not None:
            close()
        _drain()

    def pull() -> list[np.ndarray] | None:
        try:
            batch = next(it)
        except StopIteration:
            end()
            return None
        return _checked(batch, next(count), names, dtypes, shapes, seen)

    def close() -> list[np.ndarray]:
        _PASSES.pop(key, None)
        _PASSES.pop(-key, None)
        _CARRIED.pop(key, None)
        end()
        return []

    _PASSES[key] = pull
    _PASSES[-key] = close
    carried = [i for i, dtype in enumerate(dtypes) if dtype.kind == "V"]
    if carried:
        _CARRIED[key] = carried
    return key


def _py_next(key: np.ndarray) -> list[np.ndarray]:
    """The tf.numpy_function bridge (StopIteration is tf.errors.OutOfRangeError)."""
    values = _next_values(int(key))
    if values is None:
        raise StopIteration
    return values


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
            _next_values(-key)

    def flagged(key: np.ndarray) -> list[np.ndarray]:
        values = _next_values(int(key))
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


def _checked(
    batch: Mapping[str, np.ndarray],
    index: int,
    names: list[str],
    dtypes: list[np.dtype],
    shapes: list[tf.TensorShape],
    seen: list[tuple[int, ...] | None] | None = None,
) -> list[np.ndarray]:
    """The batch's arrays in spec order, native byte order and C-contiguous; a SpecError if one does not fit.

    `seen`: per field, the last array shape found compatible with the spec; an array of that
    very shape skips `TensorShape.is_compatible_with` (Python that builds a TensorShape from
    the array's shape), which would otherwise dominate the check.
    """
    out: list[np.ndarray] = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        array = batch.get(name)
        if array is not None and array.dtype != dtype and not array.dtype.isnative:  # a transform's big-endian output
            array = array.astype(array.dtype.newbyteorder("="))
        if (
            array is None
            or array.dtype != dtype
            or ((seen is None or array.shape != seen[i]) and not shape.is_compatible_with(array.shape))
        ):
            got = "no such field" if array is None else f"{array.dtype}{list(array.shape)}"
            raise SpecError(
                f"to_tf: batch {index} field {name!r} is {got}, the element_spec says "
                f"{dtype}{shape.as_list() if shape.rank is not None else '[...]'}; pass to_tf(element_spec=...) "
                "matching what transform= returns",
                field=name,
            )
        if seen is not None:
            seen[i] = array.shape
        # Both bridges alias a 64-byte aligned, C-contiguous, native-order array and keep it
        # alive as long as the tensor (stoker's buffers are page aligned); they copy less
        # aligned memory (tests guard both).
        out.append(array if array.flags.c_contiguous else np.ascontiguousarray(array))
    return out


# Open passes of every to_tf dataset: under key, the pass's next batch (None at its end); under
# -key, its close (an empty list). Keys start at 1, so no key is its own negative.
_PASSES: dict[int, Callable[[], list[np.ndarray] | None]] = {}
_KEYS = itertools.count(1)
# Per open pass with any: the positions of its values in a dtype numpy exports no buffer for
# (ml_dtypes' bfloat16, kind "V"); the op gets their bits as an integer view of the same
# memory, and its Tout type (tf.bfloat16) says what they are. tf.numpy_function takes them as
# they are.
_CARRIED: dict[int, list[int]] = {}


def _next_values(key: int) -> list[np.ndarray] | None:
    """The next batch's arrays of pass `key` (None at its end), or a pass's close under -key."""
    fn = _PASSES.get(key)
    if fn is None:
        if key < 0:  # closed already
            return []
        raise KeyError(f"to_tf: no open pass {key}")
    return fn()


def _native_next(key: int) -> list[np.ndarray] | None:
    """Called by the StokerNextBatch op (`_tfbridge.c`) with the GIL held."""
    values = _next_values(key)
    carried = _CARRIED.get(key)
    if carried and values:
        for i in carried:
            values[i] = values[i].view(f"i{values[i].dtype.itemsize}")
    return values


BRIDGE_ENV = "STOKER_TF_BRIDGE"
_bridge_lock = threading.Lock()
_bridge: list[Any] = []  # [op or None, why not native] once decided
_loaded: list[Any] = []  # the op, once its library is loaded (a process registers it once)
_drains: list[Any] = []  # the library's stoker_tfbridge_drain, once loaded


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
    op, why = _native()
    return "native" if op is not None else f"numpy_function: {why}"


def _native() -> tuple[Any, str]:
    with _bridge_lock:
        if not _bridge:
            choice = os.environ.get(BRIDGE_ENV, "auto")
            if choice not in ("auto", "native", "numpy_function"):
                raise SpecError(f"{BRIDGE_ENV}={choice!r}: expected auto, native or numpy_function")
            if choice == "numpy_function":
                _bridge.extend([None, f"{BRIDGE_ENV}=numpy_function"])
            else:
                try:
                    _bridge.extend([_load_bridge(), ""])
                except (OSError, subprocess.SubprocessError, tf.errors.OpError) as e:
                    if choice == "native":
                        raise
                    warnings.warn(
                        f"stoker.tf: the native tf.data bridge could not be built ({e}); "
                        "to_tf falls back to tf.numpy_function (same batches, more CPU per batch)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    _bridge.extend([None, str(e)])
        return _bridge[0], _bridge[1]


def _load_bridge() -> Any:
    if not _loaded:
        path = _build_bridge()
        op = getattr(tf.load_op_library(str(path)), "stoker_next_batch", None)
        if op is None:  # the op was registered already, from another copy of the library
            raise OSError(f"{path} registered no StokerNextBatch op: another copy of it is loaded in this process")
        # PyDLL: called with the GIL held, as the function needs (the same loaded library).
        _drains.append(ctypes.PyDLL(str(path)).stoker_tfbridge_drain)
        _loaded.append(op)
    return _loaded[0]


def _drain() -> None:
    """Release the arrays of tensors TensorFlow dropped on its own threads since the op's last
    call (`_tfbridge.c` defers them to a thread that holds the GIL): at a pass's end, so its
    last batches' buffers go back to the loader without waiting for another pass."""
    for drain in _drains:
        drain()


def _bridge_dir() -> Path:
    """Where the bridge is cached: `$STOKER_CACHE/tfbridge`, else the user's cache directory
    (see `_private_dir` for when it is used)."""
    base = os.environ.get("STOKER_CACHE")
    if base:
        return Path(base) / "tfbridge"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoker" / "tfbridge"


def _only_mine(st: os.stat_result, kind: Callable[[int], bool]) -> bool:
    """Whether `st` (of lstat: a symlink is not followed) is of `kind`, owned by this user,
    and writable by no group or other user: what may hold or be a library this process loads."""
    return kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_dir(path: Path) -> Path | None:
    """`path` when it is a directory only this user can write to, made (mode 0700) if missing;
    else None. A directory of this user's that others may write to (made under a looser umask)
    is first narrowed to 0700. Another user's directory, or a symlink, is never used: anyone
    who can write where the bridge is cached can make this process load their code."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(path, 0o700)
            st = os.lstat(path)
    except OSError:
        return None
    return path if _only_mine(st, stat.S_ISDIR) else None


def _build_bridge() -> Path:
    """Compile `_tfbridge.c` into a shared library once per source, TensorFlow and Python version."""
    source = Path(__file__).with_name("_tfbridge.c")
    tf_dir = Path(tf.sysconfig.get_lib())
    framework = tf_dir / "libtensorflow_framework.so.2"
    include = Path(sysconfig.get_paths()["include"])
    tf_include = tf.sysconfig.get_include()
    needs = {
        source: "the bridge's source",
        framework: "TensorFlow's framework library",
        include / "Python.h": "the Python headers",
        Path(tf_include) / "tensorflow" / "c" / "kernels.h": "TensorFlow's C API headers",
    }
    for need, what in needs.items():
        if not need.exists():
            raise FileNotFoundError(f"{what} not found: {need}")
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    command = [
        *compiler, "-O2", "-shared", "-fPIC", "-I", tf_include, "-I", str(include),
        str(source), "-L", str(tf_dir), "-l:" + framework.name, "-Wl,-rpath," + str(tf_dir),
    ]  # fmt: skip
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join([tf.__version__, sys.version, *command]).encode())
    name = f"_tfbridge-{digest.hexdigest()[:16]}.so"
    # The cache directory, else (read-only home, or one others may write to) the temp dir's
    # stoker-tfbridge-UID, else, where another user made that one, a fresh private directory.
    fallback = Path(tempfile.gettempdir()) / f"stoker-tfbridge-{os.getuid()}"
    cache = _private_dir(_bridge_dir()) or _private_dir(fallback)
    if cache is None:
        warnings.warn(
            f"stoker.tf: neither {_bridge_dir()} nor {fallback} is a directory only you can write to "
            "(yours, no group or other write, not a symlink); the native bridge is built in a private "
            "temporary directory and not cached",
            RuntimeWarning,
            stacklevel=3,
        )
        cache = Path(tempfile.mkdtemp(prefix="stoker-tfbridge-"))
        atexit.register(shutil.rmtree, cache, ignore_errors=True)  # the loaded library stays mapped
    out = cache / name
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        pass
    else:
        if _only_mine(st, stat.S_ISREG):
            return out
        warnings.warn(
            f"stoker.tf: {out} is not a file only you can write to (owner uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)}); it is not loaded but built again",
            RuntimeWarning,
            stacklevel=3,
        )
        out.unlink()  # the directory is this user's alone
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run([*command, "-o", str(tmp)], capture_output=True, text=True, check=False, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, which may let a group write it
        os.replace(tmp, out)  # atomic: a concurrent build of the same file is harmless
    finally:
        tmp.unlink(missing_ok=True)
    return out


_element_spec = element_spec


def _check_positive(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise SpecError(f"{name}={value!r} must be a positive integer or None")
    return int(value)


def _decode(strings: tf.Tensor, stored: np.dtype, shape: tuple[int, ...], out: np.dtype, rows: int = -1) -> tf.Tensor:
    """A block of raw bytes (scalar string) -> `(k, *shape)` tensor of `out` (`k` static
    where `rows` is given)."""
    native = stored.newbyteorder("=")
    little = stored.byteorder == "<" or (stored.byteorder in "=|" and np.little_endian)
    if native in _DECODE_RAW:
        flat = tf.io.decode_raw(strings, tf.as_dtype(native), little_endian=little)
    else:
        raw = tf.reshape(tf.io.decode_raw(strings, tf.uint8), (-1, native.itemsize))
        if little != np.little_endian:
            raw = tf.reverse(raw, axis=[1])
        flat = tf.bitcast(raw, tf.as_dtype(native))
    values = tf.reshape(flat, (rows, *shape))
    return values if out == native else tf.cast(values, tf.as_dtype(out))


def _counted(
    parts: dict[str, tf.data.Dataset], row: Mapping[str, tf.Tensor], block: int, checked: Mapping[str, int]
) -> tf.data.Dataset:
    """The group's fields zipped, failing (naming the field and file) where a field in
    `checked` (name -> record bytes) holds other blocks than the group's count says.

    A compressed stream's record count comes from its trailer where that agrees with the
    other fields (stoker.files); the loader confirms it at the stream's end (CorruptDataError).
    tf.data's zip would stop at the shortest field instead, dropping the rest of the group
    without a word. So each field ends in an empty block, a block that no record makes: the
    zipped group is then `blocks + 1` elements long, and each checked field's block must be
    `block` records (the group's last: its short tail) before the last element and empty in
    it, else the Assert fails the pipeline; the last element is dropped. Elements are
    `(index, blocks)`, the index left for the decode map to drop: with the check in a map
    and a filter and a map after it, the guard cost a visible share of the records/s; as one
    filter feeding the decode, nothing measurable (see benchmarks/results/tf_compare_history.md).
    """
    blocks = row["full"] + tf.sign(row["tail"])
    end = tf.data.Dataset.from_tensors(tf.constant(b""))

    def check(i: tf.Tensor, zipped: Mapping[str, tf.Tensor]) -> tf.Tensor:
        records = tf.where(i < row["full"], tf.constant(block, tf.int64), tf.where(i < blocks, row["tail"], 0))
        asserts = []
        for name, rb in checked.items():
            size = tf.cast(tf.strings.length(zipped[name]), tf.int64)
            asserts.append(tf.debugging.Assert(
                tf.equal(size, records * rb),
                [f"stoker: field {name!r}: file", row[f"path/{name}"], "holds a different number of records than "
                 "the group's count (its gzip trailer, or its zlib stream counted before the pipeline was built, and "
                 "the other fields' files) says (the loader raises CorruptDataError on it): "
                 "block", tf.strings.as_string(i), "(from 0) of the group's", tf.strings.as_string(blocks)],
            ))  # fmt: skip
        with tf.control_dependencies(asserts):
            return tf.less(i, blocks)  # the empty end leaves

    zipped = tf.data.Dataset.zip({n: p.concatenate(end) for n, p in parts.items()})
    return zipped.enumerate().filter(check)  # (index, blocks): the decode map drops the index


def native_dataset(
    ds: Dataset,
    batch_size: int,
    *,
    cycle_length: int | None = None,
    block_length: int | None = None,
    cast: Any = None,
    drop_remainder: bool = False,
    epochs: int | None = 1,
    shuffle: Literal[False, "files"] | None = False,
    seed: int | None = None,
    num_parallel_calls: int | None = tf.data.AUTOTUNE,
    deterministic: bool = True,
) -> tf.data.Dataset:
    """`ds`'s records as a pure tf.data graph, in the order of `ds.loader(batch_size)`.

    `epochs` passes (None: forever), each in `shuffle=False` order, batches never
    spanning two, as the loader's. They repeat inside the graph, ahead of its prefetch, so
    the next epoch's first blocks are read while the last batches are taken; a `.repeat()`
    after the graph drains it at every epoch's end. The order: tf.data's interleave over the
    groups with the same `cycle_length` and `block_length` defaults as the loader. Per
    group, each field's `FixedLengthRecordDataset` is read a whole block per element (a
    compressed stream in chunks of records that tile the group's blocks) and zipped with the
    other fields, so images and labels stay together inside the group; one decode per block
    (`decode_raw` + byte order + reshape + cast) runs in parallel; `rebatch` cuts the
    blocks into batches with a single copy, or is left out where each block is a batch.
    Serializable: works with `tf.data.experimental.service` (`processing_mode="distributed_epoch"` hands out
    whole groups to workers; order across workers is then not defined) and TPUs.

    `shuffle="files"` (with `seed=`): each epoch opens the groups in a permutation of its
    own and reads each group's blocks in a permutation of their own, drawn in the graph by
    stateless ops (`tf.random.experimental.index_shuffle` keyed by seed, epoch and group), so
    the same seed gives the same batches on every run and every tf.data service worker;
    records within a block stay together (a smaller `block_length` shuffles finer). Raw
    files are read a block at a time at its offset; a compressed field's group is read whole
    (it cannot seek) and kept decompressed while the group is open. The epochs run on in one
    interleave, each `(epoch, group)` an element of the graph's source (`distributed_epoch`
    hands those to the workers), so near an epoch's end its last groups and the next epoch's
    first share the open slots, and a batch there may hold records of both; over `E` epochs
    every record comes `E` times. A `.repeat()` after the graph would replay the first
    epoch's order: pass `epochs=` instead. `"global"` (a record-level shuffle) is the
    loader's: `ds.loader(..., shuffle="global").to_tf()`.

    Fields must be files TensorFlow's file system opens (local paths, and URLs of its
    registered schemes, such as `gs://`); any other URL (`s3://`, fsspec's others) is a
    SpecError naming the field: stoker's own reader opens them, through `loader.to_tf()`.

    Every group's record counts are checked before the graph is built (this may
    decompress compressed files whose gzip trailer disagrees), raising PairingError. A
    compressed stream that then holds more or fewer records than its trailer said fails the
    pipeline (InvalidArgumentError naming the field and file, where the loader raises
    CorruptDataError), rather than tf.data's zip cutting the group short without a word.

    Example:
        >>> tfds = stoker.tf.native_dataset(ds, 256, cast={"image": "float32"})
        >>> for batch in tfds:
        ...     train_step(batch["image"], batch["label"])
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise SpecError(f"{batch_size=} must be a positive integer")
    if not isinstance(drop_remainder, bool):
        raise SpecError(f"drop_remainder={drop_remainder!r} must be True or False")
    passes = _check_positive("epochs", epochs)
    if shuffle is None:
        shuffle = False
    if shuffle not in (False, "files"):
        raise SpecError(
            f"native_dataset: shuffle={shuffle!r} must be False or 'files' (a record-level shuffle is the loader's: "
            "ds.loader(..., shuffle='global', seed=...).to_tf())"
        )
    if shuffle and (isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < 1 << 63):
        raise SpecError(
            f"native_dataset: shuffle={shuffle!r} needs seed= an integer in [0, 2**63) (got seed={seed!r}); stoker "
            "never seeds from the clock, so the same seed gives the same order on any machine"
        )
    fields = ds.fields
    _check_tf_opens(ds)
    cycle = _check_positive("cycle_length", cycle_length) or default_cycle_length(ds.num_groups)
    block = _check_positive("block_length", block_length) or default_block_length(
        max(f.record_bytes for f in fields.values())
    )
    out_dtypes = resolve_cast(fields, cast)
    counts = [ds.records_in(g) for g in range(ds.num_groups)]  # raises PairingError
    # Per field, statically: a field with any compressed file streams its records (tf.data
    # cannot seek in a compressed stream); raw fields read whole blocks as one record each,
    # the group's short last block by a header offset (a free seek).
    compressed = {n: any(infos[n].compression is not None for infos in ds.files) for n in fields}
    # A compressed stream is read in chunks of records that tile both the group's blocks and
    # its short last block (gcd of block and count), one element each, since one element per
    # record of small labels costs tf.data a per-element overhead on every record.
    chunks = [math.gcd(block, n) for n in counts]
    # A group ends in a short block; where none does, every chunk is a whole block (the gcd
    # of block and a multiple of it) and needs no batch + join.
    short_blocks = any(n % block for n in counts)
    columns: dict[str, Any] = {
        "full": np.array([n // block for n in counts], np.int64),
        "tail": np.array([n % block for n in counts], np.int64),
        "chunks_per_block": np.array([block // c for c in chunks], np.int64),
    }
    for name in fields:
        columns[f"path/{name}"] = np.array([infos[name].path for infos in ds.files], dtype=object)
        columns[f"compression/{name}"] = np.array(
            [_TF_COMPRESSION[infos[name].compression] for infos in ds.files], dtype=object
        )

    def group(row: Mapping[str, tf.Tensor]) -> tf.data.Dataset:
        parts = {}
        for name, spec in fields.items():
            path, kind = row[f"path/{name}"], row[f"compression/{name}"]
            rb = spec.record_bytes
            if compressed[name]:
                per_block = row["chunks_per_block"]
                records = tf.data.FixedLengthRecordDataset(
                    path, (block // per_block) * rb, header_bytes=spec.header_bytes, footer_bytes=spec.footer_bytes,
                    compression_type=kind, buffer_size=1 << 20,
                )  # fmt: skip
                parts[name] = records if not short_blocks else records.batch(per_block).map(tf.strings.reduce_join)
            else:
                whole = tf.data.FixedLengthRecordDataset(
                    path, block * rb, header_bytes=spec.header_bytes,
                    footer_bytes=spec.footer_bytes + row["tail"] * rb, buffer_size=block * rb,
                )  # fmt: skip
                if not short_blocks:
                    parts[name] = whole
                    continue
                # tail == 0 leaves an empty body: no record.
                short = tf.data.FixedLengthRecordDataset(
                    path, tf.maximum(row["tail"], 1) * rb,
                    header_bytes=spec.header_bytes + row["full"] * block * rb, footer_bytes=spec.footer_bytes,
                )  # fmt: skip
                parts[name] = whole.concatenate(short)
        if not any(compressed.values()):
            return tf.data.Dataset.zip(parts)
        return _counted(parts, row, block, {n: f.record_bytes for n, f in fields.items() if compressed[n]})

    # Each block a batch (batch_size == block, every group a whole number of blocks, W1's
    # layout): the blocks are the batches, so no rebatch, and the cast is in the decode.
    # Otherwise cast on whichever side of rebatch holds the narrower dtype, so rebatch's one
    # copy moves the fewest bytes (int8 -> float32 images: 4x fewer).
    exact = batch_size == block and not short_blocks
    late = set() if exact else {n for n, f in fields.items() if out_dtypes[n].itemsize > f.dtype.itemsize}
    rows = block if exact and drop_remainder else -1  # a static batch dimension where promised

    def decode(*element: Any) -> dict[str, tf.Tensor]:
        blocks = element[-1]  # (index, blocks) where _counted checks the group
        return {
            n: _decode(blocks[n], f.dtype, f.shape, f.native_dtype if n in late else out_dtypes[n], rows)
            for n, f in fields.items()
        }

    def widen(batch: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return {n: tf.cast(t, tf.as_dtype(out_dtypes[n])) if n in late else t for n, t in batch.items()}

    # Each element of a group is one block, so block_length=1 here is the loader's
    # (cycle_length, block_length) interleave over records (a short last block moves the
    # cycle on in both).
    if shuffle:
        key = int(seed)  # type: ignore[arg-type]  # checked above
        source = _shuffled_slots(columns, ds.num_groups, passes, key)
        each: Callable[[Mapping[str, tf.Tensor]], tf.data.Dataset] = functools.partial(
            _shuffled_group, fields=fields, block=block, compressed=compressed, seed=key
        )
        passes = 1  # the epochs are the slots'
    else:
        source, each = tf.data.Dataset.from_tensor_slices(columns), group
    blocks = source.interleave(
        each, cycle_length=cycle, block_length=1, num_parallel_calls=num_parallel_calls, deterministic=deterministic
    )
    decoded = blocks.map(decode, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    batches = decoded if exact else decoded.rebatch(batch_size, drop_remainder=drop_remainder)
    if late:
        batches = batches.map(widen, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    if passes != 1:
        batches = batches.repeat(passes)
    return batches.prefetch(tf.data.AUTOTUNE)


def _check_tf_opens(ds: Dataset) -> None:
    """A SpecError naming the first field whose file TensorFlow's file system has no scheme for."""
    schemes = set(tf.io.gfile.get_registered_schemes())
    for infos in ds.files:
        for name, info in infos.items():
            scheme = info.path.split("://", 1)[0] if "://" in info.path else ""
            if scheme not in schemes:
                opens = ", ".join(f"{s}://" for s in sorted(schemes) if s)
                raise SpecError(
                    f"native_dataset: field {name!r} is at {info.path!r}, a {scheme}:// URL TensorFlow's file system "
                    f"cannot open (it opens local paths and {opens}); stoker's own reader opens any fsspec URL: "
                    "use ds.loader(...).to_tf() for this dataset",
                    field=name,
                    path=info.path,
                )


# Streams of the stateless draws of a "files" shuffle, folded into (seed, epoch): the group
# order is stream 0, group g's block order stream g + 1.
_GROUP_ORDER = 0


def _key(seed: int, epoch: tf.Tensor, stream: tf.Tensor | int) -> tf.Tensor:
    """The `[2]` int64 key of one stateless permutation: `(seed, epoch, stream)` folded together."""
    key = tf.random.experimental.stateless_fold_in(tf.constant([seed, 0], tf.int64), epoch, alg="philox")
    return tf.random.experimental.stateless_fold_in(key, tf.cast(stream, tf.int64), alg="philox")


def _shuffled_slots(columns: Mapping[str, Any], num_groups: int, passes: int | None, seed: int) -> tf.data.Dataset:
    """One element per `(epoch, group)`, each epoch's groups in a permutation of their own.

    The source is a range over the slots, so tf.data service's `distributed_epoch` hands
    each (epoch, group) to whichever worker asks, and every element carries its epoch.
    """
    table = {name: tf.constant(column) for name, column in columns.items()}
    last = tf.constant(num_groups - 1, tf.int64)
    slots = tf.data.Dataset.range(num_groups * passes) if passes is not None else tf.data.Dataset.counter()

    def row(slot: tf.Tensor) -> dict[str, tf.Tensor]:
        epoch = slot // num_groups
        group = tf.random.experimental.index_shuffle(slot % num_groups, _key(seed, epoch, _GROUP_ORDER), last)
        out = {name: tf.gather(column, group) for name, column in table.items()}
        out["epoch"], out["group"] = epoch, group
        return out

    return slots.map(row)


def _shuffled_group(
    row: Mapping[str, tf.Tensor], *, fields: Mapping[str, Any], block: int, compressed: Mapping[str, bool], seed: int
) -> tf.data.Dataset:
    """One group's blocks, zipped across fields, in the permutation of `(seed, epoch, group)`.

    A raw field's block is read at its offset (a seek); a compressed field's group is read
    whole first (a stream cannot seek), checked against the group's count, and cut.
    """
    full, tail = row["full"], row["tail"]
    count = full * block + tail
    blocks = full + tf.sign(tail)
    whole = {}
    for name, spec in fields.items():
        if not compressed[name]:
            continue
        rb = spec.record_bytes
        chunk = (block // row["chunks_per_block"]) * rb
        stream = tf.data.FixedLengthRecordDataset(
            row[f"path/{name}"], chunk, header_bytes=spec.header_bytes, footer_bytes=spec.footer_bytes,
            compression_type=row[f"compression/{name}"], buffer_size=1 << 20,
        )  # fmt: skip
        # One batch of every chunk (count // chunks + 1 leaves room for the extra chunks of a
        # longer stream, which the check below then sees), joined into one string.
        joined = stream.batch(count * rb // chunk + 1).map(tf.strings.reduce_join)
        data = joined.reduce(tf.constant(b""), lambda a, x: a + x)
        size = tf.cast(tf.strings.length(data), tf.int64)
        held = tf.debugging.Assert(
            tf.equal(size, count * rb),
            [f"stoker: field {name!r}: file", row[f"path/{name}"], "holds a different number of records than the "
             "group's count (its gzip trailer, or its zlib stream counted before the pipeline was built, and the "
             "other fields' files) says (the loader raises CorruptDataError on it):", tf.strings.as_string(size // rb),
             "records, not", tf.strings.as_string(count)],
        )  # fmt: skip
        with tf.control_dependencies([held]):
            whole[name] = tf.identity(data)

    def one_block(k: tf.Tensor) -> tf.data.Dataset:
        records = tf.where(k < full, tf.constant(block, tf.int64), tail)
        first = k * block
        parts = {}
        for name, spec in fields.items():
            rb = spec.record_bytes
            if compressed[name]:
                parts[name] = tf.data.Dataset.from_tensors(tf.strings.substr(whole[name], first * rb, records * rb))
            else:
                parts[name] = tf.data.FixedLengthRecordDataset(
                    row[f"path/{name}"], records * rb, header_bytes=spec.header_bytes + first * rb,
                    footer_bytes=spec.footer_bytes + (count - first - records) * rb, buffer_size=records * rb,
                )  # fmt: skip
        return tf.data.Dataset.zip(parts)

    key = _key(seed, row["epoch"], row["group"] + 1)
    order = tf.data.Dataset.range(blocks).map(
        lambda i: tf.random.experimental.index_shuffle(i, key, tf.maximum(blocks - 1, 0))
    )
    return order.flat_map(one_block)
