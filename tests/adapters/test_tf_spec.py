"""to_tf's element_spec follows transform=, every batch is checked against it, and odd arrays are copied safely."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import stoker
from stoker.tf import element_spec
from stoker.transforms import Normalize, RandomCrop
from tests.helpers.data import small_sample

pytestmark = pytest.mark.tf


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    return small_sample(tmp_path_factory.mktemp("sample"), pairs=2, records=40)


def shrink(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A user function changing shape and dtype, adding a field and a per-batch value."""
    image = batch["image"]
    return {
        "image": image[:, ::2, ::2, 0].astype(np.float16),
        "label": batch["label"],
        "weight": np.ones(len(image), np.float64),
        "mean": np.asarray(image.mean(), np.float32),
    }


def _values(tfds: tf.data.Dataset) -> list[dict[str, np.ndarray]]:
    return [{k: v.numpy() for k, v in b.items()} for b in tfds]


@pytest.mark.parametrize("drop", [True, False])
def test_element_spec_follows_a_user_transform(sample: stoker.Dataset, drop: bool) -> None:
    loader = sample.loader(16, transform=shrink, drop_remainder=drop)
    batch = 16 if drop else None
    assert loader.to_tf().element_spec == {
        "image": tf.TensorSpec((batch, 8, 8), tf.float16),
        "label": tf.TensorSpec((batch,), tf.float32),
        "weight": tf.TensorSpec((batch,), tf.float64),
        "mean": tf.TensorSpec((), tf.float32),
    }
    got = _values(loader.to_tf())
    expected = [{k: v.copy() for k, v in b.items()} for b in loader]
    assert len(got) == len(expected) == 5  # 80 records in 16s
    for g, e in zip(got, expected, strict=True):
        for k in e:
            np.testing.assert_array_equal(g[k], e[k])
            assert g[k].dtype == e[k].dtype


def test_element_spec_follows_built_in_transforms_without_running_them(sample: stoker.Dataset) -> None:
    loader = sample.loader(
        8, drop_remainder=True, seed=3,
        transform=[RandomCrop(size=(12, 10), fields="image"), Normalize(scale=1 / 128, fields="image")],
    )  # fmt: skip
    spec = element_spec(loader)
    assert spec["image"] == tf.TensorSpec((8, 12, 10, 1), tf.float32)
    assert loader.to_tf().element_spec == spec
    first = next(iter(loader.to_tf()))
    assert first["image"].shape == (8, 12, 10, 1) and first["image"].dtype == tf.float32


def test_a_transform_that_fails_on_zeros_asks_for_element_spec(sample: stoker.Dataset) -> None:
    def needs_data(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        if not batch["image"].any():
            raise ValueError("all-zero batch")
        return {"image": batch["image"].astype(np.float32)}

    loader = sample.loader(16, transform=needs_data, drop_remainder=True)
    with pytest.raises(stoker.SpecError, match=r"transform 0 \(needs_data\).*all-zero batch.*element_spec=") as e:
        loader.to_tf()
    assert isinstance(e.value.__cause__, ValueError)
    spec = {"image": tf.TensorSpec((16, 16, 16, 1), tf.float32)}
    tfds = loader.to_tf(element_spec=spec)
    assert tfds.element_spec == spec
    got = _values(tfds)
    assert len(got) == 5
    np.testing.assert_array_equal(got[0]["image"], next(iter(loader))["image"].astype(np.float32))


def test_a_batch_that_does_not_match_the_spec_names_the_field_and_batch(sample: stoker.Dataset) -> None:
    def ragged(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        keep = 4 if batch["image"].any() else 1  # 1 row on zeros, 4 on data
        return {"image": batch["image"][:keep], "label": batch["label"]}

    loader = sample.loader(16, transform=ragged, drop_remainder=True)
    # Zeros give 1 row: not the batch size, so the batch dimension is unknown (None) ...
    assert element_spec(loader)["image"].shape.as_list() == [None, 16, 16, 1]
    # ... and a spec that claims 16 rows is caught on the first batch, naming the field.
    spec = {"image": tf.TensorSpec((16, 16, 16, 1), tf.int8), "label": tf.TensorSpec((16,), tf.float32)}
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"batch 0 field 'image' is int8\[4, 16, 16, 1\]"):
        _values(loader.to_tf(element_spec=spec))
    with pytest.raises(stoker.SpecError, match=r"element_spec\['label'\]=.*must be a tf.TensorSpec"):
        loader.to_tf(element_spec={"label": (16,)})


def test_a_shape_that_changes_after_good_batches_is_still_caught(sample: stoker.Dataset) -> None:
    """Shapes already found to fit skip the spec check; a new shape is checked again."""
    loader = sample.loader(24)  # 80 records: batches of 24, 24, 24, then 8
    spec = {"image": tf.TensorSpec((24, 16, 16, 1), tf.int8), "label": tf.TensorSpec((24,), tf.float32)}
    got = []
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"batch 3 field 'image' is int8\[8, 16, 16, 1\]"):
        for batch in loader.to_tf(element_spec=spec):
            got.append(batch["label"].numpy())
    assert [len(g) for g in got] == [24, 24, 24]


def test_arrays_tensorflow_cannot_alias_are_copied(sample: stoker.Dataset) -> None:
    """A transform's odd arrays (misaligned, strided, byte-swapped) arrive intact, and slicing them is safe."""

    def odd(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        n = len(batch["label"])
        raw = np.zeros(4 * n + 64, np.uint8)
        offset = (16 - raw.ctypes.data) % 64 or 16  # 16-byte aligned, never 64
        label = raw[offset : offset + 4 * n].view(np.float32)
        label[:] = batch["label"]
        return {"label": label, "image": batch["image"][:, ::-1], "index": np.arange(n, dtype=">i4")}

    loader = sample.loader(16, transform=odd, drop_remainder=True)
    expected = [{k: v.copy() for k, v in b.items()} for b in loader]  # one pass at a time per loader
    for got, e in zip(loader.to_tf(), expected, strict=True):
        np.testing.assert_array_equal(got["label"][1:5].numpy(), e["label"][1:5])
        np.testing.assert_array_equal(got["image"].numpy(), e["image"])
        np.testing.assert_array_equal(got["index"].numpy(), np.arange(16))


def test_to_tf_feeds_a_distribution_strategy(sample: stoker.Dataset) -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    loader = sample.loader(16, cast={"image": "float32"}, drop_remainder=True)
    dist = strategy.experimental_distribute_dataset(loader.to_tf())

    @tf.function
    def step(batch: dict[str, tf.Tensor]) -> tf.Tensor:
        per_replica = strategy.run(lambda b: tf.reduce_sum(b["label"]), args=(batch,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    total = sum(float(step(b)) for b in dist)
    expected = sum(float(b["label"].sum()) for b in loader)
    assert total == pytest.approx(expected, rel=1e-6)
