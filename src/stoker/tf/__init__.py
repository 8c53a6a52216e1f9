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

One job per module: `spec` (the element_spec, inferred and checked), `op` (the compiled
bridge: build, cache, load), `passes` (the loader passes the bridges pull from),
`iterator` (the eager fast path over TensorFlow's iterator internals), `dataset` (to_tf,
with its tf.distribute options and checks), `distribute` (distributed_dataset), `native`
(native_dataset) and `tensor` (as_tensor).

TensorFlow is imported by this package only: `import stoker` needs numpy alone.
"""

from .dataset import bridge, to_tf
from .distribute import distributed_dataset
from .native import native_dataset
from .spec import element_spec
from .tensor import as_tensor

__all__ = ["as_tensor", "bridge", "distributed_dataset", "element_spec", "native_dataset", "to_tf"]
