"""to_tf's eager iterator: TensorFlow's OwnedIterator less two per-batch costs its batches do not need.

It reads private TensorFlow internals (`OwnedIterator._next_internal`, `_iterator_resource`
and others, `IteratorGetNext`); each is checked once per process, and where this
TensorFlow lacks one, to_tf's dataset is iterated by TensorFlow's own iterator instead,
with a warning (same batches, more CPU per batch).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import tensorflow as tf

# What to_tf's eager iterator is made of (see _EagerBatches): where any module, or any attribute
# in _EAGER_ATTRIBUTES, is missing, to_tf's dataset is iterated by TensorFlow's own iterator.
try:
    from tensorflow.python.data.ops.dataset_ops import UnaryUnchangedStructureDataset as _Unchanged
    from tensorflow.python.data.ops.iterator_ops import OwnedIterator as _OwnedIterator
    from tensorflow.python.eager import context as _context
    from tensorflow.python.framework import ops as _ops
    from tensorflow.python.ops.gen_dataset_ops import iterator_get_next as _iterator_get_next
except ImportError:  # pragma: no cover - depends on the TensorFlow installed; tests force the path
    _Unchanged = _OwnedIterator = _context = _ops = _iterator_get_next = None

__all__ = ["eager_batches"]

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


def eager_batches(dataset: tf.data.Dataset) -> tf.data.Dataset:
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
          against the spec (`stoker.tf.spec.checked`); the tensors come in `tf.nest`'s order of the
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
