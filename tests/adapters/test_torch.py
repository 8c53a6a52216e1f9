"""stoker.torch: zero-copy tensors, exact resume, DataLoader workers without duplicates."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.distributed
import torch.utils.data
from hypothesis import given
from hypothesis import strategies as st

import stoker
import stoker.torch
from stoker.cli.sample import expected_label
from stoker.engine.executor import AlignedPool
from stoker.testing import assert_same_batches
from stoker.torch import StokerIterableDataset, shard_from_distributed, to_torch, worker_shard
from tests.helpers import REPO
from tests.helpers.data import sample_images, small_sample
from tests.helpers.resources import Allocations

pytestmark = pytest.mark.torch

ROOT = REPO
RES = 16
PAIRS, RECORDS = 2, 64


@pytest.fixture
def sample(tmp_path: Path) -> stoker.Dataset:
    return small_sample(tmp_path, pairs=PAIRS, records=RECORDS, inrez=RES)


def check_against_files(ds: stoker.Dataset, batches: list[dict[str, torch.Tensor]]) -> list[int]:
    """Each record equals the files' record named by its label; returns the labels in order."""
    images = sample_images(ds)
    seen: list[int] = []
    for b in batches:
        labels = b["label"].numpy().astype(np.int64)
        assert np.array_equal(b["image"].numpy().astype(np.int8), images[labels])
        seen.extend(labels.tolist())
    return seen


def as_numpy(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, np.ndarray]]:
    return [{k: v.numpy() for k, v in b.items()} for b in batches]


# -- to_torch -----------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [False, "global"])
def test_to_torch_yields_the_numpy_batches_as_tensors(sample: stoker.Dataset, shuffle: object) -> None:
    kw = {"epochs": 2, "shuffle": shuffle, "seed": 3, "with_index": True, "cast": {"image": "float32"}}
    with sample.loader(24, **kw) as loader:  # type: ignore[arg-type]
        expected = [dict(b) for b in loader]
    with sample.loader(24, **kw).to_torch() as batches:  # type: ignore[arg-type]
        got = list(batches)
    assert all(isinstance(t, torch.Tensor) for b in got for t in b.values())
    assert got[0]["image"].dtype == torch.float32 and got[0]["__index__"].dtype == torch.int64
    assert_same_batches(expected, as_numpy(got))
    assert sorted(check_against_files(sample, got)) == sorted(list(range(PAIRS * RECORDS)) * 2)


class RecordingPool(AlignedPool):
    """AlignedPool that remembers every array it hands out (a batch may be a view into one,
    see tests.helpers.resources.Allocations)."""

    addresses: ClassVar[Allocations] = Allocations()

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        arr = super().array(shape, dtype)
        RecordingPool.addresses.add(arr)
        return arr


def test_to_torch_on_cpu_is_zero_copy_over_stokers_buffers(sample: stoker.Dataset) -> None:
    # Guard: fails if a copy sneaks into the CPU path (torch.tensor, .clone, ascontiguousarray...).
    RecordingPool.addresses = Allocations()
    loader = sample.loader(16)
    loader.use_allocator(lambda pooled: RecordingPool(pooled))
    with to_torch(loader) as batches:
        for b in batches:
            for name, t in b.items():
                assert t.data_ptr() in RecordingPool.addresses, f"{name} was copied"
                assert t.data_ptr() % 64 == 0


def test_bfloat16_batches_become_torch_bfloat16_tensors_on_stokers_buffers(sample: stoker.Dataset) -> None:
    """numpy has no bfloat16 of its own and torch.from_numpy refuses ml_dtypes' one: the bits go
    through an int16 view of the same buffer, so the tensors are still the loader's memory."""
    import ml_dtypes

    with sample.loader(16) as plain:
        expected = [dict(b) for b in plain]
    RecordingPool.addresses = Allocations()
    loader = sample.loader(16, cast="bfloat16")
    loader.use_allocator(lambda pooled: RecordingPool(pooled))
    seen = 0
    with to_torch(loader) as batches:
        for b, e in zip(batches, expected, strict=True):
            for name, t in b.items():
                assert t.dtype == torch.bfloat16, name
                assert t.data_ptr() in RecordingPool.addresses, f"{name} was copied"
                bits = t.view(torch.int16).numpy().view(np.uint16)
                assert np.array_equal(bits, e[name].astype(ml_dtypes.bfloat16).view(np.uint16)), name
                seen += 1
    assert seen == 2 * len(expected)
    # The same through a DataLoader worker process, pickled across.
    ids = StokerIterableDataset(sample, batch_size=16, cast={"image": "bfloat16"})
    got = list(torch.utils.data.DataLoader(ids, batch_size=None, num_workers=1))
    assert [b["image"].dtype for b in got] == [torch.bfloat16] * len(expected)
    for b, e in zip(got, expected, strict=True):
        assert torch.equal(b["image"], torch.from_numpy(e["image"]).to(torch.bfloat16))
        assert torch.equal(b["label"], torch.from_numpy(e["label"]))


def test_a_dtype_torch_lacks_fails_naming_its_field(sample: stoker.Dataset) -> None:
    import ml_dtypes

    def to_fp8(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {**batch, "image": (batch["image"] % 8).astype(ml_dtypes.float8_e4m3b11fnuz)}

    message = "to_torch: field 'image' is float8_e4m3b11fnuz, which PyTorch has no dtype for"
    with sample.loader(16, transform=to_fp8).to_torch() as batches, pytest.raises(stoker.SpecError, match=message):
        next(iter(batches))


def test_held_tensors_never_change_while_the_loader_goes_on(sample: stoker.Dataset) -> None:
    # A small budget forces stoker to recycle buffers as soon as it may: held ones it may not.
    loader = sample.loader(8, epochs=4, shuffle="global", seed=1, memory_budget=8 * 300 * 4, prefetch=2, threads=2)
    held, snapshots = [], []
    with loader.to_torch() as batches:
        for b in batches:
            if len(held) < 12:
                held.append(b)
                snapshots.append({k: v.clone() for k, v in b.items()})
    for b, s in zip(held, snapshots, strict=True):
        for k in b:
            assert torch.equal(b[k], s[k])
    check_against_files(sample, held)
    assert all(np.array_equal(expected_label(b["image"].numpy()), b["label"].numpy()) for b in held)


def test_pin_memory_without_cuda_warns_and_leaves_batches_as_they_are(sample: stoker.Dataset) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    loader = sample.loader(32)
    factory = loader.allocator
    with pytest.warns(RuntimeWarning, match="pin_memory=True has no effect"):
        batches = loader.to_torch(pin_memory=True)
    assert loader.allocator is factory and batches.pin_memory is False
    with batches:
        got = list(batches)
    with sample.loader(32) as again:
        assert_same_batches([dict(b) for b in again], as_numpy(got))


def test_pinned_pool_recycles_a_buffer_only_once_every_view_is_gone(
    sample: stoker.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No CUDA here: stand in pageable memory for pinned, to check the pool's bookkeeping.
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **kw: empty(*a, **kw))
    pool = stoker.torch.PinnedPool(max_pooled_bytes=1 << 20)
    a = pool.array((4, 8), np.dtype(np.float32))
    view = a[1:]
    address = a.ctypes.data
    del a
    assert pool.array((4, 8), np.dtype(np.float32)).ctypes.data != address  # a view is alive
    del view
    assert pool.array((4, 8), np.dtype(np.float32)).ctypes.data == address
    loader = sample.loader(16, epochs=2, memory_budget=16 * 300 * 6, prefetch=2)
    loader.use_allocator(stoker.torch.PinnedPool)
    with sample.loader(16, epochs=2) as plain:
        expected = [dict(b) for b in plain]
    with loader.to_torch() as batches:
        assert_same_batches(expected, as_numpy(list(batches)))


def test_cast_on_device_casts_after_the_transfer(sample: stoker.Dataset) -> None:
    with sample.loader(32) as loader:
        expected = [dict(b) for b in loader]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sample.loader(32).to_torch(device="cpu", cast_on_device={"image": torch.float32}) as batches:
            got = list(batches)
    assert got[0]["image"].dtype == torch.float32 and got[0]["label"].dtype == torch.float32
    for e, g in zip(expected, got, strict=True):
        assert np.array_equal(e["image"].astype(np.float32), g["image"].numpy())


def test_loader_to_torch_takes_the_device_by_position_as_the_readme_shows(sample: stoker.Dataset) -> None:
    with sample.loader(32) as loader:
        expected = [dict(b) for b in loader]
    with sample.loader(32).to_torch("cpu", False, {"image": torch.float32}) as batches:
        assert batches.device == torch.device("cpu") and batches.cast_on_device == {"image": torch.float32}
        got = list(batches)
    for e, g in zip(expected, got, strict=True):
        assert np.array_equal(e["image"].astype(np.float32), g["image"].numpy())


def test_to_torch_rejects_unknown_fields_and_non_dtypes(sample: stoker.Dataset) -> None:
    with sample.loader(8) as loader:
        with pytest.raises(stoker.SpecError, match="unknown field 'pixels'"):
            to_torch(loader, cast_on_device={"pixels": torch.float32})
        with pytest.raises(stoker.SpecError, match=r"must be a torch\.dtype"):
            to_torch(loader, cast_on_device={"image": "float32"})  # type: ignore[dict-item]
        with pytest.raises(stoker.SpecError, match="not a torch device"):
            to_torch(loader, device="warp-drive")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent (CI has no GPU)")
@pytest.mark.parametrize("pin_memory", [False, True])
def test_to_torch_on_cuda_without_cuda_is_refused_when_built_naming_the_fix(
    sample: stoker.Dataset, pin_memory: bool
) -> None:
    with sample.loader(8) as loader:
        with pytest.raises(stoker.SpecError, match=r"CUDA is not available.*pass device=None"):
            to_torch(loader, "cuda", pin_memory=pin_memory)
        with pytest.raises(stoker.SpecError, match="CUDA is not available"):
            loader.to_torch(torch.device("cuda:1"))


@pytest.mark.parametrize("k", [0, 1, 5, 9])
def test_to_torch_resumes_exactly_after_any_batch(sample: stoker.Dataset, k: int) -> None:
    def make() -> stoker.Loader:
        return sample.loader(24, epochs=2, shuffle="global", seed=5)

    with make().to_torch() as whole:
        reference = as_numpy(list(whole))
    with make().to_torch() as first:
        it = iter(first)
        before = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
    with make().to_torch() as second:
        second.load_state_dict(state)
        after = list(second)
    assert_same_batches(reference, as_numpy(before + after))


# -- sharding helpers ------------------------------------------------------------------
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 60))
def test_worker_shards_split_each_rank_shard_exactly(count: int, workers: int, total: int) -> None:
    everything: list[int] = []
    for i in range(count):
        rank = set(range(i, total, count))
        mine: list[int] = []
        for w in range(workers):
            j, c = worker_shard((i, count), w, workers)
            mine.extend(range(j, total, c))
        assert sorted(mine) == sorted(rank)
        everything.extend(mine)
    assert sorted(everything) == list(range(total))


def test_shard_from_distributed_uses_the_process_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert shard_from_distributed() == (0, 1)
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert shard_from_distributed() == (0, 1)
        monkeypatch.setattr(dist, "get_rank", lambda: 3)
        monkeypatch.setattr(dist, "get_world_size", lambda: 8)
        assert shard_from_distributed() == (3, 8)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_import_stoker_imports_neither_torch_nor_jax() -> None:
    code = "import stoker, sys; assert not {'torch', 'jax'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_stoker_torch_sees_the_real_torch() -> None:
    assert stoker.torch.torch is torch and hasattr(torch, "from_numpy")


# -- StokerIterableDataset ---------------------------------------------------------------
def labels_of(batches: object) -> list[int]:
    return [int(x) for b in batches for x in b["label"].tolist()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("shuffle", [False, "global"])
def test_iterable_dataset_in_process_gives_the_loaders_batches(sample: stoker.Dataset, shuffle: object) -> None:
    with sample.loader(20, shuffle=shuffle, seed=2) as loader:  # type: ignore[arg-type]
        expected = [dict(b) for b in loader]
    batches = StokerIterableDataset(sample, 20, shuffle=shuffle, seed=2)
    got = list(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=0))
    assert_same_batches(expected, as_numpy(got))


@pytest.mark.parametrize(
    ("shuffle", "context", "even"),
    [(False, "fork", True), ("global", "fork", False), ("global", "spawn", True)],
)
def test_iterable_dataset_workers_read_every_record_once(
    sample: stoker.Dataset, shuffle: object, context: str, even: bool
) -> None:
    batches = StokerIterableDataset(sample, 10, shuffle=shuffle, seed=4, even=even, threads=1)
    dl = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2, multiprocessing_context=context)
    got = list(dl)
    assert sorted(labels_of(got)) == list(range(PAIRS * RECORDS))
    check_against_files(sample, got)


def test_iterable_dataset_workers_within_a_rank_shard(sample: stoker.Dataset) -> None:
    seen = []
    for rank in range(3):
        batches = StokerIterableDataset(sample, 7, shard=(rank, 3), even=False, threads=1)
        seen.append(labels_of(torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2)))
    for rank, labels in enumerate(seen):
        assert sorted(labels) == list(range(rank, PAIRS * RECORDS, 3))  # shuffle=False: position == record


def test_iterable_dataset_set_epoch_changes_the_shuffle(sample: stoker.Dataset) -> None:
    batches = StokerIterableDataset(sample, 32, shuffle="global", seed=9)
    first = labels_of(batches)
    batches.set_epoch(1)
    second = labels_of(batches)
    assert sorted(first) == sorted(second) and first != second
    with sample.loader(32, epochs=2, shuffle="global", seed=9) as loader:
        assert labels_of(loader) == first + second


def test_iterable_dataset_pickles_without_its_lock(sample: stoker.Dataset) -> None:
    import pickle

    batches = StokerIterableDataset(sample, 16, shuffle="global", seed=1)
    again = pickle.loads(pickle.dumps(batches))
    assert labels_of(again) == labels_of(batches)


def test_iterable_dataset_rejects_settings_early(sample: stoker.Dataset) -> None:
    with pytest.raises(stoker.SpecError, match="needs seed"):
        StokerIterableDataset(sample, 16, shuffle="global")
    with pytest.raises(stoker.SpecError, match="shard="):
        StokerIterableDataset(sample, 16, shard=(2, 2))
    with pytest.raises(stoker.StateError):
        StokerIterableDataset(sample, 16).load_state_dict({"version": 1, "fingerprint": "nope"})


@pytest.mark.parametrize(("workers", "k"), [(0, 3), (2, 0), (2, 3), (2, 6)])
def test_stateful_dataloader_resumes_exactly(sample: stoker.Dataset, workers: int, k: int) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> object:
        batches = StokerIterableDataset(sample, 10, shuffle="global", seed=7, threads=1)
        return sdl.StatefulDataLoader(batches, batch_size=None, num_workers=workers)

    reference = as_numpy(list(make()))  # type: ignore[call-overload]
    first = make()
    it = iter(first)  # type: ignore[call-overload]
    before = [next(it) for _ in range(k)]
    state = first.state_dict()  # type: ignore[attr-defined]
    assert '"fingerprint"' in json.dumps(state, default=str)  # stoker's state, not a fast-forward count
    del it
    second = make()
    second.load_state_dict(state)  # type: ignore[attr-defined]
    after = list(second)  # type: ignore[call-overload]
    assert_same_batches(reference, as_numpy(before + after))


# -- the example -------------------------------------------------------------------------
def test_torch_train_example_trains_a_few_steps(tmp_path: Path) -> None:
    # Run as a user runs it, in its own process: torch's and TensorFlow's native runtimes,
    # both loaded in the test process by then, crashed it once (SIGSEGV) in a full CI run.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "torch_train.py"), "--data", str(tmp_path / "data"), "--steps", "30"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "position 64" in proc.stdout  # 30 steps of 32 over 4 batches an epoch
