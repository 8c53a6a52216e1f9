"""stoker.tf: the zero-copy tf.data bridge, Keras, and the native tf.data graph."""

from __future__ import annotations

import gc
import gzip
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf  # make test installs TF; a missing TF fails loudly, never skips

import stoker
from stoker.cli.sample import expected_label
from stoker.engine.executor import AlignedPool
from stoker.tf import as_tensor, native_dataset
from tests.helpers import HELPERS, REPO
from tests.helpers.data import small_sample
from tests.helpers.netns import run_loopback_only
from tests.helpers.resources import record_allocations

pytestmark = pytest.mark.tf

ROOT = REPO


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    return small_sample(tmp_path_factory.mktemp("sample"), pairs=3, records=64)


def _numpy_batches(loader: stoker.Loader) -> list[dict[str, np.ndarray]]:
    return [{k: v.copy() for k, v in b.items()} for b in loader]


def _open_paths() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed since listdir
            continue
    return out


def _stoker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stoker-worker")]


# -- to_tf --------------------------------------------------------------------------


def test_element_spec_is_exact_with_static_batch_when_dropping_remainder(sample: stoker.Dataset) -> None:
    loader = sample.loader(32, cast={"image": "float32"}, drop_remainder=True, with_index=True)
    spec = loader.to_tf().element_spec
    assert spec == {
        "image": tf.TensorSpec((32, 16, 16, 1), tf.float32),
        "label": tf.TensorSpec((32,), tf.float32),
        "__group__": tf.TensorSpec((32,), tf.int64),
        "__index__": tf.TensorSpec((32,), tf.int64),
    }
    assert spec == stoker.tf.element_spec(loader)
    loose = sample.loader(32).to_tf().element_spec
    assert loose["image"].shape.as_list() == [None, 16, 16, 1] and loose["image"].dtype == tf.int8
    assert loose["label"].shape.as_list() == [None]  # a field of shape () is (n,)


def test_to_tf_values_equal_numpy_iteration_and_each_iteration_is_a_fresh_pass(sample: stoker.Dataset) -> None:
    loader = sample.loader(24, cast={"image": "float32"}, threads=2)
    expected = _numpy_batches(loader)
    tfds = loader.to_tf()
    for _ in range(2):  # a second iteration starts again from the first batch
        got = [{k: v.numpy() for k, v in b.items()} for b in tfds]
        assert len(got) == len(expected) == 8  # 192 records in batches of 24
        for g, e in zip(got, expected, strict=True):
            assert g.keys() == e.keys()
            for k in e:
                np.testing.assert_array_equal(g[k], e[k])
                assert g[k].dtype == e[k].dtype


def test_held_tensors_never_change_while_the_loader_recycles_buffers(sample: stoker.Dataset) -> None:
    # A budget of a few batches forces buffer reuse; every held tensor must keep its own.
    loader = sample.loader(8, cast={"image": "float32"}, epochs=3, memory_budget=8 * 16 * 16 * 4 * 6, threads=2)
    held = list(loader.to_tf())
    assert len(held) == 3 * 24
    for _ in loader:  # keep the engine busy writing fresh batches meanwhile
        pass
    gc.collect()
    expected = _numpy_batches(sample.loader(8, cast={"image": "float32"}, epochs=3))
    for h, e in zip(held, expected, strict=True):
        np.testing.assert_array_equal(h["image"].numpy(), e["image"])
        np.testing.assert_array_equal(h["label"].numpy(), e["label"])
        np.testing.assert_array_equal(h["label"].numpy(), expected_label(h["image"].numpy().astype(np.int8)))


def test_as_tensor_aliases_aligned_memory_and_keeps_it_from_reuse() -> None:
    """Guard of the fast path: fails if the DLPack bridge starts copying or lets go too early."""
    pool = AlignedPool(max_pooled_bytes=1 << 30)
    a = pool.array((256, 32, 32), np.dtype(np.float32))
    a[:] = 1.5
    address = a.ctypes.data
    t = as_tensor(a)
    assert np.from_dlpack(t).ctypes.data == address  # zero copy: the tensor is the array
    del a
    gc.collect()
    b = pool.array((256, 32, 32), np.dtype(np.float32))  # must not get the tensor's region
    assert b.ctypes.data != address and pool.allocated == 2
    b[:] = -7.0
    assert float(tf.reduce_min(t)) == float(tf.reduce_max(t)) == 1.5
    del b, t
    gc.collect()
    pool.array((256, 32, 32), np.dtype(np.float32))  # both regions free again: reused
    assert pool.allocated == 2


def test_as_tensor_aliases_bfloat16_memory_too() -> None:
    """ml_dtypes' bfloat16 has no DLPack code: its bits go as int16 and become bfloat16 by
    tf.bitcast, which keeps the memory (so the tensor is still the array)."""
    import ml_dtypes

    pool = AlignedPool(max_pooled_bytes=0)
    a = pool.array((64, 8), np.dtype(ml_dtypes.bfloat16))
    a[:] = np.arange(512, dtype=np.float32).reshape(64, 8)
    t = as_tensor(a)
    assert t.dtype == tf.bfloat16
    assert np.from_dlpack(tf.bitcast(t, tf.int16)).ctypes.data == a.ctypes.data
    np.testing.assert_array_equal(tf.cast(t, tf.float32).numpy(), a.astype(np.float32))


def test_as_tensor_copies_memory_tensorflow_cannot_alias() -> None:
    # 16-byte aligned (numpy's default): TF 2.21 would alias it and abort in a strided slice.
    raw = np.zeros(4096 + 64, np.uint8)
    offset = (16 - raw.ctypes.data) % 64 or 16
    odd = raw[offset : offset + 4096].view(np.float32)
    assert odd.ctypes.data % 64 != 0
    odd[:] = np.arange(1024)
    t = as_tensor(odd)
    assert np.from_dlpack(t).ctypes.data != odd.ctypes.data
    np.testing.assert_array_equal(t[1:5].numpy(), [1, 2, 3, 4])
    swapped = np.arange(6, dtype=">u2")
    np.testing.assert_array_equal(as_tensor(swapped).numpy(), np.arange(6))


def test_to_tf_delivers_the_loaders_own_buffers(sample: stoker.Dataset) -> None:
    """End-to-end guard: every tensor out of the tf.data iterator is a buffer the loader allocated."""
    loader = sample.loader(16, cast={"image": "float32"})
    addresses = record_allocations(loader)
    seen = 0
    for batch in loader.to_tf():
        for tensor in batch.values():
            assert np.from_dlpack(tensor).ctypes.data in addresses
            seen += 1
    assert seen == 2 * 12


def test_early_break_leaves_no_worker_thread(sample: stoker.Dataset) -> None:
    loader = sample.loader(4, epochs=None, threads=2)
    tfds = loader.to_tf()
    for i, _ in enumerate(tfds):
        if i == 3:
            assert _stoker_threads()  # the pass is running ...
            break
    deadline = time.monotonic() + 10
    while _stoker_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert _stoker_threads() == []  # ... and stopped once TF let go of the iterator
    under = str(Path(sample.files[0]["image"].path).parent)
    assert [p for p in _open_paths() if p.startswith(under)] == []  # and its files are closed


def test_keras_fit_runs_on_the_sample(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("keras_fit", ROOT / "examples" / "keras_fit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.train(tmp_path, steps=3, epochs=2)
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert module.main([str(tmp_path), "--steps", "2", "--epochs", "1"]) == 0


def test_keras_fit_runs_as_a_script_with_one_inter_op_thread(tmp_path: Path) -> None:
    """As a user runs it: the inter-op setting comes before TensorFlow's first op, or it raises."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "keras_fit.py"), str(tmp_path), "--steps", "2", "--epochs", "2"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"]
    assert all(np.isfinite(float(line.rsplit(" ", 1)[1])) for line in lines)
    names = {p.name for p in tmp_path.iterdir()}  # the sample it wrote and trained on
    assert {"img_0000.bin", "img_0001.bin", "out_0000.bin.gz", "out_0001.bin.gz"} <= names


# -- native_dataset -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "cycle", "block", "drop", "cast"),
    [
        (24, None, None, False, {"image": "float32"}),
        (7, 2, 5, True, {"image": "float32"}),
        (24, None, None, False, "bfloat16"),
        # Blocks that are the batches (64 records a group): no rebatch, the cast in the decode.
        (16, 2, 16, False, {"image": "float32"}),
        (16, None, 16, True, "float16"),
        # Labels read in chunks of 4 records (gcd of block 12 and 64), 3 to a block, 1 to the tail.
        (10, 3, 12, False, {"image": "float32"}),
    ],
)
def test_native_dataset_equals_the_loader(
    sample: stoker.Dataset, batch: int, cycle: int | None, block: int | None, drop: bool, cast: object
) -> None:
    """Bit for bit: tf.cast rounds float32 to bfloat16 to nearest even, as ml_dtypes does."""
    kw = {"cycle_length": cycle, "block_length": block, "cast": cast, "drop_remainder": drop}
    expected = _numpy_batches(sample.loader(batch, **kw))  # type: ignore[arg-type]
    native = native_dataset(sample, batch, **kw)  # type: ignore[arg-type]
    assert native.element_spec["image"].shape.as_list() == [batch if drop else None, 16, 16, 1]
    assert native.element_spec["label"].shape.as_list() == [batch if drop else None]
    got = list(native.as_numpy_iterator())
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        for name in ("image", "label"):
            assert g[name].dtype == e[name].dtype
            np.testing.assert_array_equal(g[name].view(f"u{g[name].itemsize}"), e[name].view(f"u{e[name].itemsize}"))


@pytest.mark.parametrize(
    ("batch", "drop"),
    [(16, False), (20, False), (20, True)],  # each block a batch; rebatched, 9.6 batches an epoch
)
def test_native_dataset_repeats_epochs_as_the_loader(sample: stoker.Dataset, batch: int, drop: bool) -> None:
    """Batches never span two epochs, and epochs=None repeats forever."""
    kw = {"cycle_length": 2, "block_length": 16, "cast": {"image": "float32"}, "drop_remainder": drop}
    expected = _numpy_batches(sample.loader(batch, epochs=3, **kw))  # type: ignore[arg-type]
    per_epoch = 3 * 64 / batch
    assert len(expected) == 3 * (math.floor(per_epoch) if drop else math.ceil(per_epoch))
    got = list(native_dataset(sample, batch, epochs=3, **kw).as_numpy_iterator())  # type: ignore[arg-type]
    forever = list(native_dataset(sample, batch, epochs=None, **kw).take(len(expected)).as_numpy_iterator())  # type: ignore[arg-type]
    for run in (got, forever):
        assert len(run) == len(expected)
        for g, e in zip(run, expected, strict=True):
            for name in ("image", "label"):
                np.testing.assert_array_equal(g[name], e[name])


@pytest.mark.parametrize("epochs", [0, -1, 1.5, True])
def test_native_dataset_refuses_bad_epochs(sample: stoker.Dataset, epochs: object) -> None:
    with pytest.raises(stoker.SpecError, match="epochs"):
        native_dataset(sample, 16, epochs=epochs)  # type: ignore[arg-type]


@pytest.mark.parametrize("shuffle", [False, "files"])
def test_native_dataset_refuses_a_multi_member_stream_whose_last_trailer_matches_its_partner(
    tmp_path: Path, shuffle: bool | str
) -> None:
    """Two gzip members, the last one's trailer saying 1 record as the image file holds: a
    trailer is trusted only for a file proved one member, so this one is counted (3 records)
    and the group is a PairingError before any record, for native_dataset as for the loader,
    never cut at its shortest field (tf.data's zip) with the first record yielded alone."""
    np.arange(4, dtype=np.uint8).tofile(tmp_path / "img_0.bin")
    (tmp_path / "out_0.bin.gz").write_bytes(
        gzip.compress(np.float32([1, 2]).tobytes()) + gzip.compress(np.float32([3]).tobytes())
    )
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "uint8", (4,)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
    )
    with pytest.raises(stoker.PairingError, match=r"3 records in '[^']*out_0\.bin\.gz'"):
        native_dataset(ds, 8, shuffle=shuffle, seed=1)  # type: ignore[arg-type]
    with pytest.raises(stoker.PairingError, match="out_0.bin.gz"):
        list(ds.loader(8))


@pytest.mark.parametrize("shuffle", [False, "files"])  # zipped streams; the group's stream read whole
@pytest.mark.parametrize("block", [1, None])  # the extra records as blocks of their own; in the group's one block
def test_native_dataset_fails_on_a_stream_longer_than_the_dataset_counted(
    tmp_path: Path, block: int | None, shuffle: bool | str
) -> None:
    """A label stream that grew a member after the Dataset counted it (native_dataset reads
    through TensorFlow's own file ops, not stoker's opens): the graph finds the records past the
    count at the stream's end and fails naming the file, rather than cut the group at its
    shortest field (tf.data's zip) and yield the first record alone."""
    np.arange(4, dtype=np.uint8).tofile(tmp_path / "img_0.bin")
    (tmp_path / "out_0.bin.gz").write_bytes(gzip.compress(np.float32([1]).tobytes()))
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "uint8", (4,)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
    )
    assert len(ds) == 1
    (tmp_path / "out_0.bin.gz").write_bytes(
        gzip.compress(np.float32([1, 2]).tobytes()) + gzip.compress(np.float32([3]).tobytes())
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"field \\?'label\\?': file\] \[[^]]*out_0\.bin\.gz\]"):
        list(native_dataset(ds, 8, block_length=block, shuffle=shuffle, seed=1).as_numpy_iterator())  # type: ignore[arg-type]


def test_native_dataset_checks_counts_before_building(tmp_path: Path) -> None:
    (tmp_path / "a_0.bin").write_bytes(bytes(12))
    (tmp_path / "b_0.bin.gz").write_bytes(gzip.compress(bytes(8)))  # 2 records against 3
    ds = stoker.Dataset(
        a=stoker.Field(str(tmp_path / "a_*.bin"), "uint32"), b=stoker.Field(str(tmp_path / "b_*.bin.gz"), "uint32")
    )
    with pytest.raises(stoker.PairingError):
        native_dataset(ds, 4)


# -- native_dataset(shuffle="files") --------------------------------------------------


def _labels(tfds: tf.data.Dataset) -> list[int]:
    return [int(x) for b in tfds.as_numpy_iterator() for x in b["label"]]


def test_files_shuffle_permutes_groups_and_their_blocks_each_epoch_and_repeats_for_a_seed(
    sample: stoker.Dataset,
) -> None:
    """One group at a time (cycle_length=1): each epoch is every record once, each group's
    records come together in blocks of 8 whose order is not the file's, and the next epoch
    opens the groups in another order; the same seed gives the same batches."""
    kw = {"cycle_length": 1, "block_length": 8, "shuffle": "files", "epochs": 2}
    labels = _labels(native_dataset(sample, 16, seed=11, **kw))  # type: ignore[arg-type]
    assert labels == _labels(native_dataset(sample, 16, seed=11, **kw))  # type: ignore[arg-type]
    assert labels != _labels(native_dataset(sample, 16, seed=12, **kw))  # type: ignore[arg-type]
    n = len(sample)
    epochs = [labels[:n], labels[n:]]
    groups = []
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
        order = [epoch[i] // 64 for i in range(0, n, 64)]  # 64 records a group, read one at a time
        assert [x // 64 for x in epoch] == [g for g in order for _ in range(64)]
        blocks = [epoch[i] // 8 for i in range(0, n, 8)]
        assert all(epoch[i : i + 8] == list(range(b * 8, b * 8 + 8)) for i, b in zip(range(0, n, 8), blocks))
        assert blocks != sorted(blocks)  # within groups, blocks out of file order
        groups.append(order)
    assert epochs[0] != epochs[1]
    assert sorted(groups[0]) == sorted(groups[1]) == [0, 1, 2]


@pytest.mark.parametrize("kind", ["raw", "gzip", "zlib"])
def test_files_shuffle_reads_every_record_of_each_kind_of_file_once_with_its_pair(tmp_path: Path, kind: str) -> None:
    """Headers, footers, big-endian values, short last blocks and an empty group: the shuffled
    batches hold the loader's records, each record with its own partner."""
    counts, record = [7, 0, 12, 1, 5], 6
    paths = _write_kind(tmp_path, kind, counts, record)
    (tmp_path / "pair").mkdir()
    pairs = _write_kind(tmp_path / "pair", "raw", counts, 2)
    ds = stoker.Dataset(
        x=stoker.Field(paths, "uint16", (3,), header_bytes=_HEADER, footer_bytes=_FOOTER, byte_order="big"),
        y=stoker.Field(pairs, "uint16", header_bytes=_HEADER, footer_bytes=_FOOTER),
    )

    def records(batches: Iterable[Mapping[str, np.ndarray]]) -> list[tuple[bytes, int]]:
        return [(b["x"][i].tobytes(), int(b["y"][i])) for b in batches for i in range(len(b["y"]))]

    expected = records(ds.loader(4))
    got = records(native_dataset(ds, 4, block_length=3, shuffle="files", seed=5, epochs=2).as_numpy_iterator())
    assert sorted(got) == sorted(expected * 2)
    assert got[: len(expected)] != expected  # not the file order


def test_files_shuffle_forever_keeps_drawing_new_epochs(sample: stoker.Dataset) -> None:
    n = len(sample)
    forever = native_dataset(sample, 16, cycle_length=1, shuffle="files", seed=3, epochs=None)
    labels = [int(x) for b in forever.take(3 * n // 16).as_numpy_iterator() for x in b["label"]]
    epochs = [labels[k * n : (k + 1) * n] for k in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shuffle": "global", "seed": 1}, "must be False or 'files'.*shuffle='global', seed=...\\).to_tf"),
        ({"shuffle": "files"}, "needs seed= an integer"),
        ({"shuffle": "files", "seed": -1}, "needs seed= an integer"),
        ({"shuffle": "files", "seed": True}, "needs seed= an integer"),
    ],
)
def test_native_dataset_refuses_a_shuffle_it_cannot_draw(
    sample: stoker.Dataset, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(stoker.SpecError, match=message):
        native_dataset(sample, 16, **kwargs)  # type: ignore[arg-type]


@pytest.mark.remote
def test_a_field_tensorflow_cannot_open_is_a_spec_error_naming_it_and_the_path_that_works(tmp_path: Path) -> None:
    """An fsspec URL (memory:// here, s3:// alike) builds a Dataset fine; native_dataset refuses it
    at the call, naming the field, and loader.to_tf() reads it."""
    import fsspec  # the [remote] extra, which make test installs

    sample = small_sample(tmp_path, pairs=2, records=16, inrez=4)
    mem = fsspec.filesystem("memory")
    base = f"memory:///stoker-{tmp_path.name}"
    for p in tmp_path.glob("out_*"):
        mem.pipe(f"{base}/{p.name}", p.read_bytes())
    try:
        ds = stoker.Dataset(image=sample.fields["image"], label=stoker.Field(f"{base}/out_*.bin.gz", "float32"))
        with pytest.raises(
            stoker.SpecError, match=r"field 'label' is at 'memory:///.*out_0000\.bin\.gz', a memory:// URL"
        ) as e:
            native_dataset(ds, 8)
        assert e.value.field == "label" and "use ds.loader(...).to_tf()" in str(e.value)
        assert sorted(int(x) for b in ds.loader(8).to_tf() for x in b["label"].numpy()) == list(range(32))
    finally:
        mem.rm(base, recursive=True)


# -- semantics against FixedLengthRecordDataset -----------------------------------------

_HEADER, _FOOTER = 5, 3


def _write_kind(tmp: Path, kind: str, counts: list[int], record: int) -> list[str]:
    rng = np.random.default_rng(len(kind))
    paths = []
    for g, n in enumerate(counts):
        body = rng.integers(0, 256, size=_HEADER + n * record + _FOOTER, dtype=np.uint8).tobytes()
        suffix = {"raw": ".bin", "gzip": ".bin.gz", "zlib": ".bin.zz"}[kind]
        path = tmp / f"{kind}_{g:02d}{suffix}"
        data = {"raw": body, "gzip": gzip.compress(body), "zlib": zlib.compress(body)}[kind]
        path.write_bytes(data)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("kind", ["raw", "gzip", "zlib"])
@pytest.mark.parametrize(
    ("batch", "block"),
    [
        (4, 3),  # compressed streams read a record at a time in groups of 7, 1 and 5; 3 in 12
        (4, 2),  # chunks of 2 records in the group of 12, of 1 elsewhere
        (1, 1),  # each block a batch: no rebatch
    ],
)
def test_records_equal_fixed_length_record_dataset_byte_for_byte(
    tmp_path: Path, kind: str, batch: int, block: int
) -> None:
    counts, record = [7, 0, 12, 1, 5], 6
    paths = _write_kind(tmp_path, kind, counts, record)
    tf_kind = {"raw": "", "gzip": "GZIP", "zlib": "ZLIB"}[kind]
    expected = [
        r
        for p in paths
        for r in tf.data.FixedLengthRecordDataset(
            p, record, header_bytes=_HEADER, footer_bytes=_FOOTER, compression_type=tf_kind
        ).as_numpy_iterator()
    ]
    assert len(expected) == sum(counts)
    # Big-endian uint16 x 3 per record: exercises byte order in both stoker and native_dataset.
    field = stoker.Field(paths, "uint16", (3,), header_bytes=_HEADER, footer_bytes=_FOOTER, byte_order="big")
    ds = stoker.Dataset(x=field)
    got = [r.astype(">u2").tobytes() for b in ds.loader(4, cycle_length=1) for r in b["x"]]
    assert got == expected
    native = native_dataset(ds, batch, cycle_length=1, block_length=block)
    got_native = [r.astype(">u2").tobytes() for b in native.as_numpy_iterator() for r in b["x"]]
    assert got_native == expected


def test_native_dataset_decodes_dtypes_decode_raw_lacks(tmp_path: Path) -> None:
    values = np.arange(10, dtype=np.uint64) * (1 << 40) + 3
    (tmp_path / "u_0.bin").write_bytes(values.astype(">u8").tobytes())
    (tmp_path / "v_0.bin").write_bytes(values.astype("<u4").tobytes())
    ds = stoker.Dataset(
        u=stoker.Field(str(tmp_path / "u_*.bin"), "uint64", byte_order="big"),
        v=stoker.Field(str(tmp_path / "v_*.bin"), "uint32"),
    )
    (batch,) = list(native_dataset(ds, 16, block_length=4).as_numpy_iterator())
    np.testing.assert_array_equal(batch["u"], values)
    np.testing.assert_array_equal(batch["v"], values.astype(np.uint32))
    assert batch["u"].dtype == np.uint64 and batch["v"].dtype == np.uint32


def test_bfloat16_fields_reach_tensorflow_with_their_bits(tmp_path: Path) -> None:
    """Records stored as bfloat16 (every bit pattern, NaN payloads included): to_tf and
    native_dataset give tf.bfloat16 tensors with the files' bits, and cast float32 as ml_dtypes does."""
    import ml_dtypes

    bits = np.arange(2**16, dtype=np.uint16).reshape(-1, 8)
    (tmp_path / "e_0.bin").write_bytes(bits[:4096].tobytes())
    (tmp_path / "e_1.bin").write_bytes(bits[4096:].tobytes())
    ds = stoker.Dataset(e=stoker.Field(str(tmp_path / "e_*.bin"), "bfloat16", (8,)))
    native = [b["e"] for b in native_dataset(ds, 512)]
    bridged = [b["e"] for b in ds.loader(512).to_tf()]
    for got in (native, bridged):
        assert all(t.dtype == tf.bfloat16 for t in got)
        assert np.array_equal(np.concatenate([tf.bitcast(t, tf.uint16).numpy() for t in got]), bits)
    widened = np.concatenate([b["e"].numpy() for b in native_dataset(ds, 512, cast={"e": "float32"})])
    want = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(widened.view(np.uint32), want.view(np.uint32))


# -- tf.data service ----------------------------------------------------------------


@pytest.fixture(scope="module")
def service_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """What a tf.data service of a dispatcher and 2 workers delivered for each case of
    tests/helpers/tf_service.py, run in a loopback-only network namespace (its servers bind every interface)."""
    directory = tmp_path_factory.mktemp("service")
    small_sample(directory / "data", pairs=3, records=64)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        str(HELPERS / "tf_service.py"),
        str(directory / "data"),
        str(directory / "out.json"),
        "16",
    ]
    log = directory / "log.txt"
    (rc,) = run_loopback_only([command], [log], timeout=300, env=env)
    assert rc == 0, f"the tf.data service run exited {rc}:\n{log.read_text()[-3000:]}"
    return json.loads((directory / "out.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["distributed_epoch", "FILE_OR_DATA"])
@pytest.mark.parametrize("case", ["plain", "files", "files-2-epochs"])
def test_tf_data_service_delivers_every_record_once_per_epoch(
    service_results: dict[str, dict[str, object]], mode: str, case: str
) -> None:
    """Two workers: groups handed out as they ask (distributed_epoch), or each worker its own
    share of a graph they all build alike (a static sharding policy), plain and shuffled by files."""
    got = service_results[f"{mode}-{case}"]
    labels, epochs = got["labels"], got["epochs"]
    assert sorted(labels) == sorted(list(range(3 * 64)) * epochs)  # type: ignore[operator]
    assert got["expected"] == labels  # each image with its own label
