"""to_tf's native bridge (the StokerNextBatch op built from _tfbridge.c) and its numpy_function fallback."""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf  # make test installs TF; a missing TF fails loudly, never skips
from tensorflow.python.data.ops import iterator_ops
from tensorflow.python.data.util import structure
from tensorflow.python.eager import context
from tensorflow.python.ops import gen_dataset_ops

import stoker
import stoker.tf as stf
from stoker.cli.sample import expected_label
from stoker.engine.executor import AlignedPool
from stoker.tf import dataset as tf_dataset
from stoker.tf import iterator as tf_iterator
from stoker.tf import op as tf_op
from stoker.tf import passes as tf_passes
from tests.helpers.data import small_sample
from tests.helpers.resources import record_allocations

pytestmark = pytest.mark.tf


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    return small_sample(tmp_path_factory.mktemp("sample"), pairs=3, records=64)


@pytest.fixture
def fresh_bridge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The bridge decided again in this test (env and cache dir as the test sets them), then restored."""
    saved = list(tf_op._bridge)
    tf_op._bridge.clear()
    monkeypatch.delenv("STOKER_TF_BRIDGE", raising=False)  # auto, whatever the outer environment says
    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    yield
    tf_op._bridge[:] = saved


def _values(tfds: tf.data.Dataset) -> list[dict[str, np.ndarray]]:
    return [{k: v.numpy() for k, v in b.items()} for b in tfds]


def test_the_native_bridge_is_built_and_in_the_pipeline(sample: stoker.Dataset) -> None:
    """Guard of the fast path: make test's venv has a compiler and headers, so anything else is a regression."""
    assert stf.bridge() == "native"
    tfds = sample.loader(16).to_tf()
    graph = tfds._as_serialized_graph().numpy()  # the dataset's graph, with its functions
    assert b"StokerNextBatch" in graph
    assert len(_values(tfds)) == 12


def test_native_and_numpy_function_bridges_deliver_the_same_batches(
    sample: stoker.Dataset, fresh_bridge: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = sample.loader(20, cast={"image": "float32"}, with_index=True)
    native = _values(loader.to_tf())
    tf_op._bridge.clear()
    monkeypatch.setenv("STOKER_TF_BRIDGE", "numpy_function")
    assert stf.bridge() == "numpy_function: STOKER_TF_BRIDGE=numpy_function"
    tfds = loader.to_tf()
    assert b"StokerNextBatch" not in tfds._as_serialized_graph().numpy()
    fallback = _values(tfds)
    expected = [{k: v.copy() for k, v in b.items()} for b in loader]
    assert len(native) == len(fallback) == len(expected) == 10  # 192 records in batches of 20
    for a, b, e in zip(native, fallback, expected, strict=True):
        for k in e:
            np.testing.assert_array_equal(a[k], e[k])
            np.testing.assert_array_equal(b[k], e[k])
        np.testing.assert_array_equal(a["label"], expected_label(a["image"].astype(np.int8)))


def test_an_eager_loop_gets_stokers_iterator_and_a_graph_or_an_async_executor_tensorflows_own(
    sample: stoker.Dataset,
) -> None:
    """Guard of the eager fast path (stoker.tf.iterator._BatchIterator: no executor made per batch, no
    dict rebuilt by tf.data's structure code), and of where it must step aside."""
    loader = sample.loader(20, cast={"image": "float32"}, with_index=True)
    tfds = loader.to_tf()
    spec = tfds.element_spec
    assert list(spec) != tf.nest.flatten({k: k for k in spec})  # tf.nest's order is not the spec's
    expected = [{k: v.copy() for k, v in b.items()} for b in loader]
    assert len(expected) == 10  # 192 records in batches of 20

    def check(got: list[dict[str, np.ndarray]]) -> None:
        assert len(got) == len(expected)
        for a, e in zip(got, expected, strict=True):
            assert list(a) == list(spec)  # the spec's order, as TensorFlow's iterator gives it
            for k in e:
                np.testing.assert_array_equal(a[k], e[k])
                assert a[k].dtype == spec[k].dtype.as_numpy_dtype

    it = iter(tfds)
    assert isinstance(it, tf_iterator._BatchIterator)
    check([{k: v.numpy() for k, v in b.items()} for b in it])
    with context.execution_mode(context.ASYNC):  # the end must raise at the call: TensorFlow's sync path
        check(_values(tfds))
    it = iter(tfds)  # made eagerly, used in a graph (as Keras does): TensorFlow's graph op

    @tf.function
    def step() -> dict[str, tf.Tensor]:
        return next(it)

    check([{k: v.numpy() for k, v in step().items()} for _ in expected])
    with pytest.raises(tf.errors.OutOfRangeError):
        step()
    assert type(iter(tfds.map(lambda b: b))) is not tf_iterator._BatchIterator  # what the user builds is TensorFlow's


def test_bfloat16_batches_pass_either_bridge_bit_for_bit_and_the_op_copies_nothing(
    sample: stoker.Dataset, fresh_bridge: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy exports no buffer for ml_dtypes' bfloat16: the op takes its bits through an int16
    view of the batch buffer (tf.bitcast shares a tensor's memory, so its address is the one the
    loader allocated); tf.numpy_function takes bfloat16 arrays as they are."""
    import ml_dtypes

    with sample.loader(20) as plain:
        expected = [{k: v.astype(ml_dtypes.bfloat16).view(np.uint16) for k, v in b.items()} for b in plain]
    loader = sample.loader(20, cast="bfloat16")
    addresses = record_allocations(loader)
    native = []
    for b in loader.to_tf():
        assert b["image"].dtype == b["label"].dtype == tf.bfloat16
        for t in b.values():
            assert np.from_dlpack(tf.bitcast(t, tf.int16)).ctypes.data in addresses
        native.append({k: tf.bitcast(v, tf.uint16).numpy() for k, v in b.items()})
    tf_op._bridge.clear()
    monkeypatch.setenv("STOKER_TF_BRIDGE", "numpy_function")
    fallback = [{k: tf.bitcast(v, tf.uint16).numpy() for k, v in b.items()} for b in loader.to_tf()]
    assert len(native) == len(fallback) == len(expected) == 10
    for a, b, e in zip(native, fallback, expected, strict=True):
        for k in e:
            np.testing.assert_array_equal(a[k], e[k])
            np.testing.assert_array_equal(b[k], e[k])


def _new_workers(before: set[str]) -> list[str]:
    """stoker worker threads running now that were not in ``before`` (thread names)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("stoker-worker") and t.name not in before]


def _wait_for_new_workers_to_end(before: set[str]) -> None:
    """Wait (10 s at most) for the workers of an abandoned TF iterator's pass to stop."""
    gc.collect()
    deadline = time.monotonic() + 10
    while _new_workers(before):
        assert time.monotonic() < deadline, "a worker outlived the abandoned TF iterator"
        time.sleep(0.05)


def test_a_failed_build_falls_back_with_a_warning_or_raises_when_native_is_required(
    sample: stoker.Dataset, fresh_bridge: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tf_op, "_loaded", [])  # as in a process that has not built it yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match=r"native tf.data bridge could not be built.*no-such-compiler"):
        why = stf.bridge()
    assert why.startswith("numpy_function: ") and "no-such-compiler" in why
    assert len(_values(sample.loader(32).to_tf())) == 6  # the fallback still delivers every batch
    tf_op._bridge.clear()
    monkeypatch.setenv("STOKER_TF_BRIDGE", "native")
    with pytest.raises(OSError, match="no-such-compiler"):
        stf.bridge()
    tf_op._bridge.clear()
    monkeypatch.setenv("STOKER_TF_BRIDGE", "fast")
    with pytest.raises(stoker.SpecError, match=r"STOKER_TF_BRIDGE='fast'.*auto, native or numpy_function"):
        stf.bridge()


def test_the_build_is_cached_per_source_and_reused(fresh_bridge: None, tmp_path: Path) -> None:
    path = tf_op._build_bridge()
    assert path.parent == tmp_path / "cache" / "tfbridge"
    built = list(path.parent.glob("_tfbridge-*"))
    assert built == [path] and path.stat().st_size > 0  # no temporary file left beside it
    mtime = path.stat().st_mtime_ns
    assert tf_op._build_bridge() == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    assert b"StokerNextBatch" in path.read_bytes()


def test_an_unusable_cache_directory_builds_in_the_temp_directory(
    fresh_bridge: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("STOKER_CACHE", str(blocker / "cache"))  # mkdir fails, even for root
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = tf_op._build_bridge()
    assert path.parent == tmp_path / "tmp" / f"stoker-tfbridge-{os.getuid()}" and path.stat().st_size > 0


def _corrupt_second_label_file(tmp_path: Path) -> stoker.Dataset:
    """Two groups of 64 records; the second group's gzip label file is corrupt mid-stream."""
    stoker.write_sample(tmp_path, pairs=2, records=64, inrez=8)
    bad = tmp_path / "out_0001.bin.gz"
    body = bytearray(bad.read_bytes())
    body[len(body) // 2 : len(body) // 2 + 16] = b"\xff" * 16  # inside the deflate stream
    bad.write_bytes(bytes(body))
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (8, 8, 1)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
    )
    return ds


def test_a_corrupt_file_fails_the_tf_iterator_naming_the_file_after_the_good_batches(tmp_path: Path) -> None:
    ds = _corrupt_second_label_file(tmp_path)
    got = []
    with pytest.raises(tf.errors.OpError, match=r"out_0001\.bin\.gz") as e:
        for batch in ds.loader(16, threads=2).to_tf():
            got.append(batch["label"].numpy())
    assert "CorruptDataError" in e.value.message or "ReadError" in e.value.message
    assert len(got) == 4  # every batch of the good first group was delivered first
    for labels in got:
        assert labels.shape == (16,)


def test_tensors_dropped_inside_a_graph_return_their_buffers_by_the_next_batch_and_the_pass_end(
    sample: stoker.Dataset,
) -> None:
    """In a graph consumer TensorFlow drops tensors on its own threads, which do not hold the
    GIL: the op releases their arrays at its next call, and the pass's end releases the rest."""
    if stf.bridge() != "native":
        pytest.fail(f"the native bridge is expected on this machine: {stf.bridge()}")
    loader = sample.loader(8, epochs=6, threads=1, prefetch=2)
    addresses = record_allocations(loader)
    dataset = loader.to_tf()

    @tf.function
    def checked_total() -> tf.Tensor:
        total = tf.constant(0.0, tf.float64)
        for batch in dataset:  # a dataset loop in the graph: no Python per batch
            first = tf.reshape(batch["image"], [tf.shape(batch["image"])[0], -1])[:, :4]
            index = tf.cast(tf.bitcast(first, tf.uint32), tf.float32)  # as stoker.cli.sample.expected_label
            tf.debugging.assert_equal(batch["label"], index, message="label does not match its image")
            total += tf.cast(tf.reduce_sum(batch["label"]), tf.float64)
        return total

    got = float(checked_total())
    want = sum(float(b["label"].sum(dtype=np.float64)) for b in sample.loader(8, epochs=6))
    assert got == pytest.approx(want, rel=1e-9)
    # Two fields, a window of a few batches: arrays released only at the end would make ~288.
    assert len(addresses) <= 24, len(addresses)
    gc.collect()
    pool = loader._pipeline.pool.inner  # type: ignore[union-attr]  # record_allocations wraps the loader's pool
    assert isinstance(pool, AlignedPool)
    assert len(pool._out) == len(pool._dropped)  # every array handed out has been let go

    # A pass left after three batches: the op is not called again, so the pass's end releases them.
    @tf.function
    def first_three() -> tf.Tensor:
        total = tf.constant(0.0, tf.float64)
        for batch in dataset.take(3):
            total += tf.cast(tf.reduce_sum(batch["label"]), tf.float64)
        return total

    assert float(first_three()) == pytest.approx(float(np.arange(24, dtype=np.float64).sum()))
    deadline = time.monotonic() + 10
    while len(pool._out) != len(pool._dropped):  # TF closes the abandoned pass on its own thread
        assert time.monotonic() < deadline, f"{len(pool._out) - len(pool._dropped)} arrays never let go"
        gc.collect()
        time.sleep(0.05)


def test_tensors_let_go_return_their_buffers_to_the_loader(sample: stoker.Dataset) -> None:
    """The op's tensors release their arrays when TensorFlow drops them, so buffers are recycled."""
    loader = sample.loader(8, epochs=6, threads=1, prefetch=2)
    addresses = record_allocations(loader)
    n = 0
    for batch in loader.to_tf():
        assert int(tf.size(batch["label"])) == 8
        n += 1
        del batch
    gc.collect()
    assert n == 6 * 24
    # Two fields, a window of a few batches: a leaked array per batch would make ~288 addresses.
    assert len(addresses) <= 24, len(addresses)


def test_an_unaligned_array_from_a_transform_is_copied_and_correct(sample: stoker.Dataset) -> None:
    def shifted(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        raw = np.empty(batch["label"].nbytes + 64, np.uint8)
        offset = (16 - raw.ctypes.data) % 64 or 16  # 16-byte aligned, never 64
        odd = raw[offset : offset + batch["label"].nbytes].view(np.float32)
        odd[:] = batch["label"]
        return {"label": odd, "image": batch["image"]}

    loader = sample.loader(16, transform=shifted)
    expected = [b["label"].copy() for b in sample.loader(16)]
    got = [(b["label"].numpy(), b["label"][1:5].numpy()) for b in loader.to_tf()]  # a strided slice checks alignment
    assert len(got) == len(expected) == 12
    for (whole, part), e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(whole, e)
        np.testing.assert_array_equal(part, e[1:5])


def _rename_next_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorFlow's eager iterator with its ``_next_internal`` method under another name."""
    owned = iterator_ops.OwnedIterator
    monkeypatch.setattr(owned, "_next_element", owned._next_internal, raising=False)
    monkeypatch.delattr(owned, "_next_internal")

    def next_(self: Any) -> Any:
        try:
            return self._next_element()
        except tf.errors.OutOfRangeError:
            raise StopIteration from None

    monkeypatch.setattr(owned, "__next__", next_)


def _rename_flat_output_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorFlow's eager iterator keeping its output types in an attribute of another name."""
    owned = iterator_ops.OwnedIterator
    create = owned._create_iterator

    def create_(self: Any, dataset: tf.data.Dataset) -> None:
        create(self, dataset)
        self._output_types = self.__dict__.pop("_flat_output_types")

    def next_internal(self: Any) -> Any:
        values = gen_dataset_ops.iterator_get_next(
            self._iterator_resource, output_types=self._output_types, output_shapes=self._flat_output_shapes
        )
        return structure.from_compatible_tensor_list(self._element_spec, values)

    monkeypatch.setattr(owned, "_create_iterator", create_)
    monkeypatch.setattr(owned, "_next_internal", next_internal)


@pytest.mark.parametrize(
    ("renamed", "rename"),
    [("_next_internal", _rename_next_internal), ("_flat_output_types", _rename_flat_output_types)],
)
def test_a_tensorflow_that_renamed_an_iterator_internal_gets_the_plain_dataset_when_to_tf_is_called(
    sample: stoker.Dataset, monkeypatch: pytest.MonkeyPatch, renamed: str, rename: Callable[[pytest.MonkeyPatch], None]
) -> None:
    """stoker's eager iterator reads OwnedIterator's internals; a TensorFlow without one of them
    gets to_tf's dataset as TensorFlow's own (with a warning), not a failure at the first next()."""
    rename(monkeypatch)
    monkeypatch.setattr(tf_iterator, "_eager_missing", [])  # probed again, on this "TensorFlow"
    monkeypatch.setattr(tf_iterator, "_warned_eager", [])
    loader = sample.loader(20, cast={"image": "float32"}, with_index=True)
    with pytest.warns(RuntimeWarning, match=f"has no OwnedIterator.{renamed} .*TensorFlow's own iterator"):
        tfds = loader.to_tf()
    assert not isinstance(tfds, tf_iterator._EagerBatches)
    assert type(iter(tfds)) is iterator_ops.OwnedIterator
    expected = [{k: v.copy() for k, v in b.items()} for b in loader]
    got = _values(tfds)
    assert len(got) == len(expected) == 10
    for a, e in zip(got, expected, strict=True):
        for k in e:
            np.testing.assert_array_equal(a[k], e[k])


@pytest.mark.parametrize("missing", ["_MapDataset", "_GeneratorDataset"])
def test_a_tensorflow_without_the_internals_gets_the_public_chain_and_the_same_batches(
    sample: stoker.Dataset, fresh_bridge: None, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """A TensorFlow that moved one of tf.data's internals to_tf uses: it warns once and still delivers."""
    monkeypatch.setattr(tf_dataset, missing, None)  # what the guarded import leaves on such a TensorFlow
    monkeypatch.setattr(tf_dataset, "_warned_public", [])
    assert stf.bridge().startswith(f"numpy_function: TensorFlow {tf.__version__} has no tf.data {missing}")
    loader = sample.loader(20, cast={"image": "float32"}, with_index=True, drop_remainder=True)
    with pytest.warns(RuntimeWarning, match=f"no tf.data {missing}"):
        tfds = loader.to_tf()
    assert tfds.element_spec["image"].shape.as_list() == [20, 16, 16, 1]  # static batch dim kept
    assert b"StokerNextBatch" not in tfds._as_serialized_graph().numpy()
    expected = [{k: v.copy() for k, v in b.items()} for b in loader]
    for _ in range(2):  # a second iteration is a fresh pass, as with the one-stage map
        got = _values(tfds)
        assert len(got) == len(expected) == 9  # 192 records, drop_remainder
        for a, e in zip(got, expected, strict=True):
            for k in e:
                np.testing.assert_array_equal(a[k], e[k])
    monkeypatch.setenv("STOKER_TF_BRIDGE", "native")
    with pytest.raises(RuntimeError, match=f"STOKER_TF_BRIDGE=native.*no tf.data {missing}"):
        loader.to_tf()


def test_the_public_chain_fails_naming_the_file_after_the_good_batches_and_leaves_no_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tf_dataset, "_MapDataset", None)
    monkeypatch.setattr(tf_dataset, "_warned_public", [True])  # warned already: this test is about errors
    ds = _corrupt_second_label_file(tmp_path)
    got = []
    with pytest.raises(tf.errors.OpError, match=r"out_0001\.bin\.gz"):
        for batch in ds.loader(16, threads=2).to_tf():
            got.append(batch["label"].numpy())
    assert len(got) == 4  # every batch of the good first group was delivered first
    before = {t.name for t in threading.enumerate()}
    for i, _ in enumerate(ds.loader(4, threads=2, epochs=None).to_tf()):  # an early break, mid-pass
        if i == 3:
            break
    _wait_for_new_workers_to_end(before)


def test_the_numpy_function_bridge_closes_an_abandoned_pass(
    sample: stoker.Dataset, fresh_bridge: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the op, the pass's close runs through tf.numpy_function when TF destroys the iterator."""
    monkeypatch.setenv("STOKER_TF_BRIDGE", "numpy_function")
    before = {t.name for t in threading.enumerate()}
    open_before = set(tf_passes._PASSES)
    for i, _ in enumerate(sample.loader(4, threads=2, epochs=None).to_tf()):
        if i == 3:
            assert _new_workers(before)
            break
    _wait_for_new_workers_to_end(before)
    assert set(tf_passes._PASSES) <= open_before, "the abandoned pass is still registered"


_HELD_AT_EXIT = """
import sys
import stoker
ds = stoker.Dataset(
    image=stoker.Field(sys.argv[1] + "/img_*.bin", dtype="int8", shape=(16, 16, 1)),
    label=stoker.Field(sys.argv[1] + "/out_*.bin.gz", dtype="float32"),
)
it = iter(ds.loader(8, epochs=None).to_tf())  # a module global: alive until the interpreter exits
for _ in range(3):
    next(it)
print("pulled 3")
"""


@pytest.mark.parametrize("bridge", ["auto", "numpy_function"])
def test_an_iterator_alive_at_exit_ends_the_process_quietly(sample: stoker.Dataset, bridge: str) -> None:
    """TensorFlow destroys such an iterator after Python has exited; the native close then has nothing
    to do and says nothing (tf.data's from_generator logs "Error occurred when finalizing")."""
    import subprocess
    import sys

    data = str(Path(sample.files[0]["image"].path).parent)
    env = dict(os.environ, STOKER_TF_BRIDGE=bridge, TF_CPP_MIN_LOG_LEVEL="0")
    proc = subprocess.run(
        [sys.executable, "-c", _HELD_AT_EXIT, data], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "pulled 3"
    if bridge == "auto":
        assert "finalizing" not in proc.stderr and "Error" not in proc.stderr, proc.stderr[-2000:]
