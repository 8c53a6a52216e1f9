"""Random access (ds[i], ds.read), subsets (select, split) and evaluation mode (pad_last)."""

from __future__ import annotations

import gc
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker
import stoker.dataset
import stoker.engine.records
from stoker.engine.records import RecordReader
from stoker.plan.batches import BatchPlan, Plan, PlanConfig
from stoker.testing import assert_resumable
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, build, check_batches, reference
from tests.helpers.resources import open_paths

LAB_MULTI = FieldPlan("out", "float32", (), kind="multi")
LAB_ZLIB = FieldPlan("lab", "int16", (2,), kind="zlib", header=3, footer=2)
COUNTS = [13, 0, 7, 21, 3, 9]


@pytest.fixture
def ds(tmp_path: Path) -> stoker.Dataset:
    return build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ, "aux": LAB_ZLIB})


def flat_reference(ds: stoker.Dataset) -> dict[str, np.ndarray]:
    """Every record of every field, in global index order, read independently of stoker."""
    ref = reference(ds)
    return {n: np.concatenate([r[n] for r in ref]) for n in ds.fields}


def global_index(ds: stoker.Dataset, groups: np.ndarray, index: np.ndarray) -> np.ndarray:
    firsts = np.concatenate([[0], np.cumsum([ds.records_in(g) for g in range(ds.num_groups)])])
    return firsts[groups] + index


def real_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    valid = batch["__valid__"]
    return {k: v[valid] for k, v in batch.items()}


# -- ds[i] and ds.read ----------------------------------------------------------------
def test_getitem_returns_every_record_with_negative_indices(ds: stoker.Dataset) -> None:
    ref = flat_reference(ds)
    n = len(ds)
    for i in range(n):
        rec = ds[i]
        for name, spec in ds.fields.items():
            assert isinstance(rec[name], np.ndarray) and rec[name].shape == spec.shape
            assert np.array_equal(rec[name], ref[name][i])
            assert np.array_equal(ds[i - n][name], ref[name][i])


@pytest.mark.parametrize("i", [53, -54, 10**12])
def test_getitem_out_of_range_is_an_index_error_naming_the_file(ds: stoker.Dataset, i: int) -> None:
    with pytest.raises(stoker.RecordIndexError, match="out of range.*53 records") as e:
        ds[i]
    assert isinstance(e.value, IndexError) and isinstance(e.value, stoker.StokerError)
    assert e.value.index == i and e.value.path is not None and "img_0000.bin" in str(e.value)


@pytest.mark.parametrize(
    "i", [2**63, 2**64 - 1, 2**70, -(2**63) - 1, np.uint64(2**64 - 1), np.uint64(2**63), np.int64(-(2**63))]
)
def test_an_index_past_int64_is_out_of_range_on_every_entry_never_another_record(ds: stoker.Dataset, i: Any) -> None:
    """Checked as Python ints before any cast: 2**64 - 1 as int64 is -1, the last record."""
    sub = ds.select(groups=[0, 3])
    as_array = np.array([i], np.uint64 if 0 <= i < 2**64 else object)
    calls = {
        "ds[i]": lambda: ds[i],
        "ds.read": lambda: ds.read([i]),
        "ds.read(array)": lambda: ds.read(as_array),
        "__getitems__": lambda: ds.__getitems__([0, i]),
        "read_records": lambda: stoker.dataset.read_records(ds, [i]),
        "read_one": lambda: stoker.dataset.read_one(ds, i),
        "subset[i]": lambda: sub[i],
        "subset.read": lambda: sub.read([i]),
    }
    for what, call in calls.items():
        with pytest.raises(stoker.RecordIndexError, match=f"record index {int(i)} is out of range") as e:
            call()
        assert e.value.index == int(i), what
        assert "img_0000.bin" in str(e.value) and e.value.path is not None, what
        assert f"with {len(sub) if what.startswith('subset') else 53} records" in str(e.value), what
    for kw in ({"records": [i]}, {"groups": [1, i]}, {"records": as_array}):
        for base in (ds, sub):
            with pytest.raises(stoker.RecordIndexError, match=f"{int(i)} is out of range for") as e:
                base.select(**kw)
            assert "img_0000.bin" in str(e.value) and e.value.index == int(i)


def test_getitem_rejects_non_integers(ds: stoker.Dataset) -> None:
    with pytest.raises(stoker.SpecError, match="must be an integer"):
        ds[1.5]  # type: ignore[index]
    with pytest.raises(stoker.SpecError, match="must be an integer"):
        ds[True]  # type: ignore[index]


def test_read_any_order_with_repeats_and_cast(ds: stoker.Dataset) -> None:
    ref = flat_reference(ds)
    idx = np.array([52, 0, 5, 5, -1, 20, 13, 0])
    got = ds.read(idx, cast={"image": "float32"})
    assert got["image"].dtype == np.float32 and got["label"].dtype == np.float32
    for name in ds.fields:
        assert np.array_equal(got[name], ref[name][idx].astype(got[name].dtype))
    empty = ds.read([])
    assert all(len(v) == 0 for v in empty.values())
    sliced = ds[10:20:3]
    assert np.array_equal(sliced["aux"], ref["aux"][10:20:3])


@pytest.mark.parametrize("shuffle", [False, "global", "files"])
def test_read_equals_loader_contents(ds: stoker.Dataset, shuffle: Any) -> None:
    seed = 3 if shuffle else None
    with ds.loader(8, with_index=True, shuffle=shuffle, seed=seed) as loader:
        for batch in loader:
            got = ds.read(global_index(ds, batch["__group__"], batch["__index__"]))
            for name in ds.fields:
                assert np.array_equal(got[name], batch[name])


def test_read_errors_name_the_file(ds: stoker.Dataset) -> None:
    path = ds.files[3]["image"].path
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - IMG.stored_dtype.itemsize * 36)
    with pytest.raises(stoker.CorruptDataError, match="img_0003.bin") as e:
        ds.read([25])
    assert e.value.path == path and e.value.field == "image"
    with pytest.raises(stoker.RecordIndexError, match="-54 is out of range"):
        ds.read([0, -54])
    with pytest.raises(stoker.SpecError, match="integers"):
        ds.read([0.5])


def test_corrupt_compressed_group_raises_naming_file_on_random_access(tmp_path: Path) -> None:
    ds = build(tmp_path, [5, 6], {"image": IMG, "label": LAB_GZ})
    ref = flat_reference(ds)
    path = ds.files[1]["label"].path
    data = bytearray(Path(path).read_bytes())
    data[-8] ^= 0xFF  # the CRC: the stream decodes but fails its check
    Path(path).write_bytes(bytes(data))
    assert np.array_equal(ds.read([0, 4])["label"], ref["label"][[0, 4]])
    with pytest.raises(stoker.CorruptDataError, match="out_0001.bin.gz") as e:
        ds[7]
    assert e.value.path == path


@pytest.mark.parametrize("indexed", [False, True])
def test_reader_without_cache_seeks_and_equals_reference(tmp_path: Path, indexed: bool) -> None:
    ds = build(tmp_path, [40, 17, 33], {"image": IMG, "label": LAB_MULTI})
    if indexed:
        stoker.write_index(ds)
        ds = stoker.Dataset(ds.fields)
        assert len(ds._catalog.seek_points[(0, "label")]) == 3  # three gzip members per file
    ref = flat_reference(ds)
    reader = RecordReader(ds._catalog, cache_bytes=0)  # never decode a file whole
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(ds), 200)
    g, r = (np.searchsorted([0, 40, 57, 90], idx, side="right") - 1), None
    r = idx - np.array([0, 40, 57, 90])[g]
    out = {n: np.empty((len(idx), *f.shape), f.dtype) for n, f in ds.fields.items()}
    reader.read_into(g, r, out)
    for name in ds.fields:
        assert np.array_equal(out[name], ref[name][idx])


def test_random_access_files_are_released_with_the_dataset(tmp_path: Path) -> None:
    ds = build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    ds.read(np.arange(len(ds)))
    assert open_paths(tmp_path)  # raw files stay mapped between reads
    del ds
    gc.collect()
    assert open_paths(tmp_path) == []


def test_loader_over_a_record_subset_closes_its_files(ds: stoker.Dataset, tmp_path: Path) -> None:
    sub = ds.select(records=slice(3, 50, 2))
    with sub.loader(4, threads=2) as loader:
        it = iter(loader)
        next(it)
        assert open_paths(tmp_path)
    assert open_paths(tmp_path) == []
    list(sub.loader(4))
    assert open_paths(tmp_path) == []


# -- select / split --------------------------------------------------------------------
def test_select_groups_keeps_their_order_and_maps_index_to_root(ds: stoker.Dataset) -> None:
    sub = ds.select(groups=[3, 0, 5])
    assert isinstance(sub, stoker.Subset) and len(sub) == 21 + 13 + 9
    assert [g.index for g in sub.groups] == [3, 0, 5]
    ref = reference(ds)
    assert np.array_equal(sub[0]["label"], ref[3]["label"][0])
    assert np.array_equal(sub[21]["label"], ref[0]["label"][0])
    seq = check_batches(ds, sub.loader(5, with_index=True), complete=False)
    assert sorted(seq) == sorted((g, i) for g in (3, 0, 5) for i in range(COUNTS[g]))


def test_select_records_slice_and_array_compose(ds: stoker.Dataset) -> None:
    ref = flat_reference(ds)
    sub = ds.select(records=slice(10, 40))
    assert len(sub) == 30
    assert np.array_equal(sub.read(np.arange(30))["image"], ref["image"][10:40])
    inner = sub.select(records=[29, 0, 7])  # ascending order of the subset's own indices
    assert np.array_equal(inner.read([0, 1, 2])["aux"], ref["aux"][[10, 17, 39]])
    both = ds.select(groups=[3, 0], records=slice(19, 23))  # records of the selected groups
    assert np.array_equal(both.read([0, 1, 2, 3])["label"], ref["label"][[39, 40, 0, 1]])  # group 3 starts at 20


def test_select_errors(ds: stoker.Dataset) -> None:
    with pytest.raises(stoker.SpecError, match="repeated"):
        ds.select(groups=[1, 1])
    with pytest.raises(stoker.RecordIndexError, match="groups: 6 is out of range"):
        ds.select(groups=[6])
    with pytest.raises(stoker.RecordIndexError, match="records: 53 is out of range"):
        ds.select(records=[53])
    with pytest.raises(stoker.SpecError, match="slice or a 1-D"):
        ds.select(records=[[1]])


@pytest.mark.parametrize("by", ["group", "record"])
def test_split_is_disjoint_complete_and_deterministic(ds: stoker.Dataset, by: str) -> None:
    parts = ds.split({"train": 0.7, "val": 0.2, "test": 0.1}, seed=5, by=by)
    again = ds.split({"train": 0.7, "val": 0.2, "test": 0.1}, seed=5, by=by)
    other = ds.split({"train": 0.7, "val": 0.2, "test": 0.1}, seed=6, by=by)
    seen: list[tuple[int, int]] = []
    for name, part in parts.items():
        batches = list(part.loader(4, with_index=True))
        pairs = [p for b in batches for p in zip(b["__group__"].tolist(), b["__index__"].tolist(), strict=True)]
        check_batches(ds, batches, complete=False)
        again_pairs = [
            p
            for b in again[name].loader(4, with_index=True)
            for p in zip(b["__group__"].tolist(), b["__index__"].tolist(), strict=True)
        ]
        assert pairs == again_pairs
        seen.extend(pairs)
    assert sorted(seen) == sorted((g, i) for g, n in enumerate(COUNTS) for i in range(n))
    units = ds.num_groups if by == "group" else len(ds)
    assert [len(p.groups) if by == "group" else len(p) for p in parts.values()] == [
        round(units * 0.7),
        round(units * 0.2),
        units - round(units * 0.7) - round(units * 0.2),
    ]
    assert any(p.subset_key() != o.subset_key() for p, o in zip(parts.values(), other.values(), strict=True))


def test_split_validates_fractions_and_seed(ds: stoker.Dataset) -> None:
    with pytest.raises(stoker.SpecError, match="sum to"):
        ds.split({"a": 0.5, "b": 0.4}, seed=0)
    with pytest.raises(stoker.SpecError, match="seed"):
        ds.split({"a": 1.0}, seed=-1)
    with pytest.raises(stoker.SpecError, match="by="):
        ds.split({"a": 1.0}, seed=0, by="file")
    with pytest.raises(stoker.SpecError, match=r"fractions\['a'\]"):
        ds.split({"a": 1.5, "b": -0.5}, seed=0)


SUBSETS = {
    "groups": lambda ds: ds.select(groups=[5, 0, 3]),
    "records": lambda ds: ds.split({"a": 0.6, "b": 0.4}, seed=1, by="record")["a"],
}


@pytest.mark.parametrize("kind", list(SUBSETS))
@pytest.mark.parametrize("shuffle", [False, "global", "files"])
def test_loader_features_work_on_subsets(ds: stoker.Dataset, kind: str, shuffle: Any) -> None:
    sub = SUBSETS[kind](ds)
    seed = 9 if shuffle else None
    expected = sorted(
        zip(*(a.tolist() for a in _root_pairs(sub)), strict=True)  # every record of the subset once
    )
    seqs = []
    for i in range(3):
        loader = sub.loader(4, with_index=True, shuffle=shuffle, seed=seed, shard=(i, 3), even=False)
        seqs.extend(check_batches(ds, loader, complete=False))
    assert sorted(seqs) == expected
    assert_resumable(lambda: sub.loader(3, epochs=2, shuffle=shuffle, seed=seed, with_index=True), steps=4)


@pytest.mark.parametrize("cast", [None, "float32"])
def test_a_record_subsets_global_shuffle_keeps_its_files_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cast: str | None
) -> None:
    """Its batches read from most of its 80 files: the reader keeps as many mapped as a pass
    keeps open (more than its least, 64), so each file is opened once in the epoch; the records
    of all of a batch's files are copied (and cast) by one gather per field."""
    root = build(tmp_path, [6] * 80, {"image": IMG, "label": LAB_GZ})
    sub = root.split({"a": 0.9, "b": 0.1}, seed=0, by="record")["a"]
    opened: dict[str, int] = {}
    real_open = stoker.engine.records.open_local

    def counted(name: str, path: str) -> int:
        opened[path] = opened.get(path, 0) + 1
        return real_open(name, path)

    monkeypatch.setattr(stoker.engine.records, "open_local", counted)
    loader = sub.loader(8, with_index=True, shuffle="global", seed=4, threads=1, cast=cast)
    seq = check_batches(root, loader, complete=False, cast=None if cast is None else {"image": cast, "label": cast})
    assert sorted(seq) == sorted(zip(*(a.tolist() for a in _root_pairs(sub)), strict=True))
    assert len(opened) == 80 and max(opened.values()) == 1


def _root_pairs(sub: stoker.Subset) -> tuple[np.ndarray, np.ndarray]:
    from stoker.dataset import locate, to_root

    return to_root(sub, *locate(sub, np.arange(len(sub))))


def test_resume_state_distinguishes_subsets(ds: stoker.Dataset) -> None:
    parts = ds.split({"a": 0.5, "b": 0.5}, seed=2, by="record")
    loader = parts["a"].loader(4)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(stoker.StateError, match="subset"):
        parts["b"].loader(4, state=state)
    with pytest.raises(stoker.StateError):
        ds.loader(4, state=state)
    parts["a"].loader(4, state=state)  # the same subset resumes


@pytest.mark.torch
def test_to_torch_on_a_record_subset(ds: stoker.Dataset) -> None:
    import torch

    sub = ds.split({"a": 0.5, "b": 0.5}, seed=2, by="record")["b"]
    ref = sub.read(np.arange(len(sub)))
    got = list(sub.loader(8, pad_last=True).to_torch())
    labels = torch.cat([b["label"][b["__valid__"]] for b in got])
    assert np.array_equal(labels.numpy(), ref["label"])


@pytest.mark.tf
def test_to_tf_on_a_group_subset(ds: stoker.Dataset) -> None:
    sub = ds.select(groups=[3, 5])
    ref = sub.read(np.arange(len(sub)))
    got = [b["aux"].numpy() for b in sub.loader(8).to_tf()]
    assert np.array_equal(np.concatenate(got), ref["aux"])
    padded = list(sub.loader(8, pad_last=True).to_tf())
    assert all(b["aux"].shape[0] == 8 for b in padded)
    got = np.concatenate([b["aux"].numpy()[b["__valid__"].numpy()] for b in padded])
    assert np.array_equal(got, ref["aux"])


# -- evaluation mode -------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("shuffle", [False, "global", "files"])
@pytest.mark.parametrize("batch", [1, 4, 5])
def test_pad_last_every_record_once_full_batches_same_count(
    ds: stoker.Dataset, shards: int, shuffle: Any, batch: int
) -> None:
    seed = 4 if shuffle else None
    counts, seen = set(), []
    for i in range(shards):
        loader = ds.loader(batch, with_index=True, pad_last=True, shard=(i, shards), shuffle=shuffle, seed=seed)
        batches = list(loader)
        counts.add(len(batches))
        assert len(loader) == len(batches)
        for b in batches:
            assert all(len(v) == batch for v in b.values()) and b["__valid__"].dtype == bool
            pad = ~b["__valid__"]
            assert not b["image"][pad].any() and (b["__group__"][pad] == -1).all()
            assert b["__valid__"].tolist() == sorted(b["__valid__"].tolist(), reverse=True)  # padding last
        seen.extend(check_batches(ds, [real_rows(b) for b in batches], complete=False))
    assert len(counts) == 1, f"shards yield different numbers of batches: {counts}"
    assert counts == {math.ceil(math.ceil(len(ds) / shards) / batch)}
    assert sorted(seen) == sorted((g, i) for g, n in enumerate(COUNTS) for i in range(n))


def _plan_records(plan: BatchPlan) -> list[tuple[int, int]]:
    if plan.gather is not None:
        return list(zip(plan.gather.groups.tolist(), plan.gather.index.tolist(), strict=True))
    return [(r.group, r.start + k * r.step) for r in plan.runs for k in range(r.count)]


@settings(max_examples=150, deadline=None)
@given(
    counts=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    batch=st.integers(1, 7),
    shards=st.integers(1, 6),
    shuffle=st.sampled_from([False, "global", "files"]),
    cycle=st.integers(1, 3),
    block=st.integers(1, 4),
)
def test_pad_last_plan_property(
    counts: list[int], batch: int, shards: int, shuffle: Any, cycle: int, block: int
) -> None:
    """The pure plan alone: records once over shards, full batches, one batch count, valid rows first."""
    seen: list[tuple[int, int]] = []
    lengths = set()
    for i in range(shards):
        config = PlanConfig(batch, False, cycle, block, shuffle, 7 if shuffle else None, 2, (i, shards), True, True)
        plans = list(Plan(len(counts), counts.__getitem__, config).epoch(0))
        lengths.add(len(plans))
        for p in plans:
            assert p.rows == batch and p.valid is not None and 0 <= p.valid <= batch
            records = _plan_records(p)
            assert len(records) == p.valid
            seen.extend(records)
        if plans:
            assert plans[-1].position >= sum(counts)
    assert lengths == {math.ceil(math.ceil(sum(counts) / shards) / batch)}
    assert sorted(seen) == [(g, k) for g, n in enumerate(counts) for k in range(n)]


def test_pad_last_on_a_record_subset_over_uneven_shards(ds: stoker.Dataset) -> None:
    sub = ds.split({"a": 0.3, "b": 0.7}, seed=0, by="record")["a"]
    seen, counts = [], set()
    for i in range(4):
        batches = list(sub.loader(3, with_index=True, pad_last=True, shard=(i, 4)))
        counts.add(len(batches))
        seen.extend(check_batches(ds, [real_rows(b) for b in batches], complete=False))
    assert len(counts) == 1
    assert sorted(seen) == sorted(zip(*(a.tolist() for a in _root_pairs(sub)), strict=True))


def test_pad_last_resumes_and_state_after_epoch_end_is_the_end(ds: stoker.Dataset) -> None:
    assert_resumable(lambda: ds.loader(4, epochs=2, pad_last=True, shard=(2, 3), shuffle="global", seed=1), steps=3)
    for i in range(3):
        loader = ds.loader(4, epochs=1, pad_last=True, shard=(i, 3))
        it = iter(loader)
        for _ in range(len(loader)):  # to its last batch (once the pass ends, it stands at the next pass)
            next(it)
        assert loader.state_dict()["position"] >= len(ds)  # every shard: the epoch is consumed


def test_pad_last_with_drop_remainder_is_an_error(ds: stoker.Dataset) -> None:
    with pytest.raises(stoker.SpecError, match="pad_last"):
        ds.loader(4, pad_last=True, drop_remainder=True)
    with pytest.raises(stoker.SpecError, match="pad_last"):
        ds.loader(4, pad_last=1)  # type: ignore[arg-type]
