"""native_dataset: a Dataset's records as a pure tf.data graph (TPU, tf.data service), in the loader's order.

Built the way tf.data is fastest: per-group zip inside an interleave, whole blocks per
element, one vectorized decode per block, parallel and deterministic; `shuffle="files"`
draws its permutations in the graph by stateless ops. It shares nothing with to_tf's
bridge: TensorFlow's own file system reads the files.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import tensorflow as tf

from ..errors import SpecError
from ..plan.batches import default_block_length, default_cycle_length
from ..spec import positive, resolve_cast

if TYPE_CHECKING:
    from ..dataset import Dataset

__all__ = ["native_dataset"]

# tf.io.decode_raw's out_type set; other dtypes (uint32, uint64) decode as bytes + bitcast.
_DECODE_RAW = {
    np.dtype(t) for t in ("bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16")
}
_TF_COMPRESSION = {None: "", "gzip": "GZIP", "zlib": "ZLIB"}


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
    other fields (stoker.io.files); the loader confirms it at the stream's end (CorruptDataError).
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
    passes = positive("epochs", epochs)
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
    cycle = positive("cycle_length", cycle_length) or default_cycle_length(ds.num_groups)
    block = positive("block_length", block_length) or default_block_length(max(f.record_bytes for f in fields.values()))
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

    # Each block a batch (batch_size == block, every group a whole number of blocks, W1's (benchmarks/w1.py)
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
