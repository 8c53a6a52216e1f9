"""TensorFlow adapter: a loader as a ``tf.data.Dataset``, and a pure-graph tf.data pipeline.

Two ways in, for two needs:

- :func:`to_tf` (``loader.to_tf()``): stoker's engine feeds ``tf.data`` through a
  ``tf.numpy_function`` that returns each batch's arrays; TensorFlow aliases a numpy
  array **without a copy** when it is 64-byte aligned and C-contiguous, and keeps it
  alive as long as the tensor. stoker's batch buffers are page aligned; numpy's own
  (16-byte aligned) are copied, which is why numpy arrays through ``from_generator``
  measured ≈ 13k records/s on 256 x 128x128 float32 batches. Measured on W1 (2 cores):
  this bridge costs ≈ 1.5 ms of CPU per batch in TensorFlow, ``from_generator`` yielding
  DLPack tensors (:func:`as_tensor`) ≈ 1.9 ms. stoker never rewrites a buffer while an
  array on it is alive, so a tensor you hold never changes under you (tests check both).
- :func:`native_dataset`: the same records in the same order as ``ds.loader(...)`` with
  ``shuffle=False``, as a serializable tf.data graph (TPU, tf.data service), built the
  way tf.data is fastest: per-group zip inside an interleave, whole blocks per element,
  one vectorized decode per block, parallel and deterministic.

TensorFlow is imported here only: ``import stoker`` needs numpy alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from .dataset import resolve_cast
from .engine import ALIGNMENT
from .errors import SpecError
from .plan import default_block_length, default_cycle_length
from .transforms import batch_rng

if TYPE_CHECKING:
    from .dataset import Dataset
    from .loader import Loader
    from .transforms import Stage

__all__ = ["as_tensor", "element_spec", "native_dataset", "to_tf"]

# tf.io.decode_raw's out_type set; other dtypes (uint32, uint64) decode as bytes + bitcast.
_DECODE_RAW = {
    np.dtype(t) for t in ("bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16")
}
_TF_COMPRESSION = {None: "", "gzip": "GZIP", "zlib": "ZLIB"}
_TRUE, _FALSE = np.array(True), np.array(False)


def as_tensor(array: np.ndarray) -> tf.Tensor:
    """``array`` as an eager tensor: zero-copy via DLPack when TensorFlow can alias it, else a copy.

    TensorFlow aliases DLPack memory that is 64-byte aligned and C-contiguous, and keeps
    the producer (the numpy array) alive as long as the tensor. Less aligned memory must
    not be aliased: TF 2.21 accepts it, then aborts the process in the first op that
    checks alignment (a strided slice does). Such arrays are copied into TF's own memory.
    """
    if array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0 and array.dtype.isnative:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(np.ascontiguousarray(array))


def element_spec(loader: Loader) -> dict[str, tf.TensorSpec]:
    """The ``element_spec`` of ``to_tf(loader)``: static batch dimension with drop_remainder.

    Built-in transforms (``stoker.transforms``) declare what they make of each field; a
    user function in ``transform=`` is run once on a batch of zeros of the shapes and
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
    """The loader's batches as a ``tf.data.Dataset`` of dicts field -> tensor, zero-copy.

    Each iteration of the returned dataset (each Keras epoch, each ``for``) starts a fresh
    pass ``iter(loader)``, which closes a pass still open on the same loader; the pass
    closes, with its threads and files, when TensorFlow lets go of the iterator. Use
    ``epochs=None`` on the loader for a dataset that repeats without restarting.

    Args:
        element_spec: the spec of each element, for a ``transform=`` that cannot run on a
            batch of zeros (see :func:`element_spec`, which is used otherwise). Every batch
            is checked against it.

    Example:
        >>> loader = ds.loader(256, cast={"image": "float32"}, drop_remainder=True)  # doctest: +SKIP
        >>> model.fit(loader.to_tf().map(lambda b: (b["image"], b["label"])), epochs=2)  # doctest: +SKIP
    """
    spec = dict(_element_spec(loader) if element_spec is None else element_spec)
    for name, s in spec.items():
        if not isinstance(s, tf.TensorSpec):
            raise SpecError(f"element_spec[{name!r}]={s!r} must be a tf.TensorSpec", field=name)
    names = list(spec)
    dtypes = [np.dtype(spec[n].dtype.as_numpy_dtype) for n in names]
    shapes = [spec[n].shape for n in names]
    # What a finished pass returns to the take_while below (any shape: it is never delivered).
    done = [np.zeros([d or 0 for d in shape.as_list()] if shape.rank is not None else (0,), dt)
            for shape, dt in zip(shapes, dtypes, strict=True)]  # fmt: skip
    passes: dict[int, tuple[Iterator[Any], list[int]]] = {}
    ids = itertools.count()

    def open_pass() -> Iterator[np.int64]:
        """One element per iteration of the dataset: the key of a fresh pass."""
        key = next(ids)
        it = iter(loader)
        passes[key] = (it, [0])
        try:
            yield np.int64(key)
        finally:
            # Runs on exhaustion, and on GeneratorExit when TF drops an iterator early.
            del passes[key]
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def next_batch(key: np.ndarray) -> list[np.ndarray]:
        it, count = passes[int(key)]
        try:
            batch = next(it)
        except StopIteration:
            return [_FALSE, *done]
        out: list[np.ndarray] = [_TRUE]
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            array = batch.get(name)
            if array is not None and not array.dtype.isnative:  # a transform's big-endian output
                array = array.astype(array.dtype.newbyteorder("="))
            if array is None or array.dtype != dtype or not shape.is_compatible_with(array.shape):
                got = "no such field" if array is None else f"{array.dtype}{list(array.shape)}"
                raise SpecError(
                    f"to_tf: batch {count[0]} field {name!r} is {got}, the element_spec says "
                    f"{dtype}{shape.as_list() if shape.rank is not None else '[...]'}; pass to_tf(element_spec=...) "
                    "matching what transform= returns",
                    field=name,
                )
            # numpy_function aliases a 64-byte aligned, C-contiguous, native-order array and
            # keeps it alive as long as the tensor (stoker's buffers are page aligned); it
            # copies less aligned memory (tests guard both).
            out.append(array if array.flags.c_contiguous else np.ascontiguousarray(array))
        count[0] += 1
        return out

    tout = [tf.bool, *(spec[n].dtype for n in names)]

    def batches(key: tf.Tensor) -> tf.data.Dataset:
        def call(k: tf.Tensor) -> tuple[tf.Tensor, ...]:
            return tuple(tf.numpy_function(next_batch, [k], tout, stateful=True))

        def shaped(ok: tf.Tensor, *values: tf.Tensor) -> dict[str, tf.Tensor]:
            for value, shape in zip(values, shapes, strict=True):
                value.set_shape(shape)
            return dict(zip(names, values, strict=True))

        return tf.data.Dataset.from_tensors(key).repeat().map(call).take_while(lambda ok, *_: ok).map(shaped)

    # measured (W1, 2 cores, 16 MiB batches): this numpy_function bridge costs ~1.5 ms of CPU per
    # batch in TF against ~1.9 ms for from_generator yielding DLPack tensors (eager py_func and
    # from_generator's per-element structure checks); see benchmarks/tf_compare.py.
    keys = tf.data.Dataset.from_generator(open_pass, output_signature=tf.TensorSpec((), tf.int64))
    return keys.flat_map(batches)


_element_spec = element_spec


def _check_positive(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise SpecError(f"{name}={value!r} must be a positive integer or None")
    return int(value)


def _decode(strings: tf.Tensor, stored: np.dtype, shape: tuple[int, ...], out: np.dtype) -> tf.Tensor:
    """A block of raw bytes (scalar string) -> ``(k, *shape)`` tensor of ``out``."""
    native = stored.newbyteorder("=")
    little = stored.byteorder == "<" or (stored.byteorder in "=|" and np.little_endian)
    if native in _DECODE_RAW:
        flat = tf.io.decode_raw(strings, tf.as_dtype(native), little_endian=little)
    else:
        raw = tf.reshape(tf.io.decode_raw(strings, tf.uint8), (-1, native.itemsize))
        if little != np.little_endian:
            raw = tf.reverse(raw, axis=[1])
        flat = tf.bitcast(raw, tf.as_dtype(native))
    values = tf.reshape(flat, (-1, *shape))
    return values if out == native else tf.cast(values, tf.as_dtype(out))


def native_dataset(
    ds: Dataset,
    batch_size: int,
    *,
    cycle_length: int | None = None,
    block_length: int | None = None,
    cast: Any = None,
    drop_remainder: bool = False,
    num_parallel_calls: int | None = tf.data.AUTOTUNE,
    deterministic: bool = True,
) -> tf.data.Dataset:
    """``ds``'s records as a pure tf.data graph, in the order of ``ds.loader(batch_size)``.

    One epoch, ``shuffle=False`` order: tf.data's interleave over the groups with the same
    ``cycle_length`` and ``block_length`` defaults as the loader. Per group, each field's
    ``FixedLengthRecordDataset`` is read a whole block per element and zipped with the
    other fields, so images and labels stay together inside the group; one decode per
    block (``decode_raw`` + byte order + reshape + cast) runs in parallel; ``rebatch``
    cuts the blocks into batches with a single copy. Serializable: works with
    ``tf.data.experimental.service`` (``processing_mode="distributed_epoch"`` hands out
    whole groups to workers; order across workers is then not defined) and TPUs.

    Every group's record counts are checked before the graph is built (this may
    decompress compressed files whose gzip trailer disagrees), raising PairingError.

    Example:
        >>> tfds = stoker.tf.native_dataset(ds, 256, cast={"image": "float32"})  # doctest: +SKIP
        >>> for batch in tfds:  # doctest: +SKIP
        ...     train_step(batch["image"], batch["label"])
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise SpecError(f"{batch_size=} must be a positive integer")
    if not isinstance(drop_remainder, bool):
        raise SpecError(f"drop_remainder={drop_remainder!r} must be True or False")
    fields = ds.fields
    cycle = _check_positive("cycle_length", cycle_length) or default_cycle_length(ds.num_groups)
    block = _check_positive("block_length", block_length) or default_block_length(
        max(f.record_bytes for f in fields.values())
    )
    out_dtypes = resolve_cast(fields, cast)
    counts = [ds.records_in(g) for g in range(ds.num_groups)]  # raises PairingError
    # Per field, statically: a field with any compressed file streams records and batches
    # them (tf.data cannot seek in a compressed stream); raw fields read whole blocks as
    # one record each, the group's short last block by a header offset (a free seek).
    compressed = {n: any(infos[n].compression is not None for infos in ds.files) for n in fields}
    columns: dict[str, Any] = {
        "full": np.array([n // block for n in counts], np.int64),
        "tail": np.array([n % block for n in counts], np.int64),
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
                records = tf.data.FixedLengthRecordDataset(
                    path, rb, header_bytes=spec.header_bytes, footer_bytes=spec.footer_bytes,
                    compression_type=kind, buffer_size=1 << 20,
                )  # fmt: skip
                parts[name] = records.batch(block).map(tf.strings.reduce_join)
            else:
                whole = tf.data.FixedLengthRecordDataset(
                    path, block * rb, header_bytes=spec.header_bytes,
                    footer_bytes=spec.footer_bytes + row["tail"] * rb, buffer_size=block * rb,
                )  # fmt: skip
                # tail == 0 leaves an empty body: no record.
                short = tf.data.FixedLengthRecordDataset(
                    path, tf.maximum(row["tail"], 1) * rb,
                    header_bytes=spec.header_bytes + row["full"] * block * rb, footer_bytes=spec.footer_bytes,
                )  # fmt: skip
                parts[name] = whole.concatenate(short)
        return tf.data.Dataset.zip(parts)

    # Cast on whichever side of rebatch holds the narrower dtype, so rebatch's one copy
    # moves the fewest bytes (int8 -> float32 images: 4x fewer).
    late = {n for n, f in fields.items() if out_dtypes[n].itemsize > f.dtype.itemsize}

    def decode(blocks: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return {
            n: _decode(blocks[n], f.dtype, f.shape, f.native_dtype if n in late else out_dtypes[n])
            for n, f in fields.items()
        }

    def widen(batch: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return {n: tf.cast(t, tf.as_dtype(out_dtypes[n])) if n in late else t for n, t in batch.items()}

    # Each element of a group is one block, so block_length=1 here is the loader's
    # (cycle_length, block_length) interleave over records (a short last block moves the
    # cycle on in both).
    groups = tf.data.Dataset.from_tensor_slices(columns)
    blocks = groups.interleave(
        group, cycle_length=cycle, block_length=1, num_parallel_calls=num_parallel_calls, deterministic=deterministic
    )
    decoded = blocks.map(decode, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    batches = decoded.rebatch(batch_size, drop_remainder=drop_remainder)
    if late:
        batches = batches.map(widen, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
    return batches.prefetch(tf.data.AUTOTUNE)
