"""stoker's default order is tf.data's deterministic interleave, checked against TensorFlow itself."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf  # make test installs TF; a missing TF fails loudly, never skips

import stoker

pytestmark = pytest.mark.tf


def _write(tmp: Path, counts: list[int], record: int = 12) -> stoker.Dataset:
    base = 0
    for g, n in enumerate(counts):
        body = np.zeros((n, record), np.uint8)
        body[:, :4] = np.arange(base, base + n, dtype="<u4").view(np.uint8).reshape(n, 4)
        (tmp / f"img_{g:03d}.bin").write_bytes(body.tobytes())
        (tmp / f"lab_{g:03d}.bin.gz").write_bytes(gzip.compress(np.arange(base, base + n, dtype="<f4").tobytes()))
        base += n
    return stoker.Dataset(
        image=stoker.Field(str(tmp / "img_*.bin"), "uint8", (record,)),
        label=stoker.Field(str(tmp / "lab_*.bin.gz"), "float32"),
    )


def _tf_sequence(ds: stoker.Dataset, cycle: int, block: int) -> list[tuple[int, int]]:
    """(global index from the image bytes) in tf.data's order, reading the same files."""
    img = [ds.files[g]["image"].path for g in range(ds.num_groups)]
    lab = [ds.files[g]["label"].path for g in range(ds.num_groups)]
    rb = ds.fields["image"].record_bytes

    def per_group(i: tf.Tensor, o: tf.Tensor) -> tf.data.Dataset:
        a = tf.data.FixedLengthRecordDataset(i, rb).map(lambda s: tf.io.decode_raw(s, tf.uint8)[:4])
        b = tf.data.FixedLengthRecordDataset(o, 4, compression_type="GZIP").map(
            lambda s: tf.io.decode_raw(s, tf.float32)[0]
        )
        return tf.data.Dataset.zip((a, b))

    files = tf.data.Dataset.from_tensor_slices((img, lab))
    seq = files.interleave(per_group, cycle_length=cycle, block_length=block)
    out = []
    for head, label in seq.as_numpy_iterator():
        out.append((int(np.frombuffer(head.tobytes(), "<u4")[0]), int(label)))
    return out


@pytest.mark.parametrize(
    ("counts", "cycle", "block"),
    [
        ([5, 0, 3, 9, 1], 2, 3),  # an empty group and groups shorter than a block
        ([7, 7, 7], 4, 2),  # cycle_length larger than the number of groups
        ([1, 2, 3, 4, 5, 6], 3, 1),
        ([10, 4, 0, 0, 8], 1, 4),
        ([3, 11, 2, 6], 2, 5),
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_order_equals_tf_data_interleave(
    tmp_path: Path, counts: list[int], cycle: int, block: int, threads: int
) -> None:
    ds = _write(tmp_path, counts)
    expected = _tf_sequence(ds, cycle, block)
    got = []
    with ds.loader(4, cycle_length=cycle, block_length=block, threads=threads, prefetch=2) as loader:
        for batch in loader:
            ids = batch["image"][:, :4].copy().view("<u4").reshape(-1)
            got.extend(zip(ids.tolist(), batch["label"].astype(int).tolist(), strict=True))
    assert got == expected
    assert all(i == lab for i, lab in got)  # every image met its own label


def test_default_lengths_match_tf_data_with_the_same_settings(tmp_path: Path) -> None:
    ds = _write(tmp_path, [40, 3, 25, 17, 31, 2], record=256 * 1024)  # block_length default = 16
    loader = ds.loader(7)
    assert (loader.cycle_length, loader.block_length) == (4, 16)
    got = [int(x) for b in loader for x in b["label"]]
    assert got == [i for i, _ in _tf_sequence(ds, loader.cycle_length, loader.block_length)]
