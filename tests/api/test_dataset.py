"""Dataset construction: fields, names, lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker.spec import shape_hint
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, build, read_records, write_dataset


def test_len_and_groups(pair_ds: stoker.Dataset) -> None:
    assert len(pair_ds) == 13 + 0 + 7 + 21 + 3
    assert pair_ds.num_groups == 5
    assert [g.records for g in pair_ds.groups] == [13, 0, 7, 21, 3]
    assert pair_ds.record_bytes == {"image": 36, "label": 4}
    assert "5 groups" in repr(pair_ds)


def test_fields_as_mapping_or_keywords_are_the_same(tmp_path: Path) -> None:
    build(tmp_path, [2], {"image": IMG, "label": LAB_GZ})
    f1 = stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1))
    f2 = stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32")
    a = stoker.Dataset({"image": f1, "label": f2})
    b = stoker.Dataset(image=f1, label=f2)
    assert a.groups == b.groups


@pytest.mark.parametrize("bad", [{}, {"__x": "F"}, {"": "F"}, {"x": "not a field"}])
def test_bad_field_maps_raise_spec_error(tmp_path: Path, bad: dict) -> None:
    build(tmp_path, [2], {"image": IMG})
    f = stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1))
    fields = {k: (f if v == "F" else v) for k, v in bad.items()}
    with pytest.raises(stoker.SpecError):
        stoker.Dataset(fields)


def test_field_given_twice_raises(tmp_path: Path) -> None:
    build(tmp_path, [2], {"image": IMG})
    f = stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1))
    with pytest.raises(stoker.SpecError, match="twice"):
        stoker.Dataset({"image": f}, image=f)


def test_non_string_pair_key_raises(tmp_path: Path) -> None:
    build(tmp_path, [2], {"image": IMG})
    with pytest.raises(stoker.SpecError, match="pair_key"):
        stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)), pair_key=3)  # type: ignore[arg-type]


def _independent(ds: stoker.Dataset) -> dict[str, np.ndarray]:
    """Every record of every field, read without stoker (tests.helpers.data.read_records), in global order."""
    return {n: np.concatenate([read_records(g.paths[n], f) for g in ds.groups]) for n, f in ds.fields.items()}


def test_getitems_reads_a_list_of_records_in_one_bulk_read(
    pair_ds: stoker.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    truth = _independent(pair_ds)
    reads = []
    real = stoker.Dataset.read
    monkeypatch.setattr(
        stoker.Dataset, "read", lambda self, idx, **kw: reads.append(list(idx)) or real(self, idx, **kw)
    )
    got = pair_ds.__getitems__([40, 0, 13, 13])
    assert reads == [[40, 0, 13, 13]]
    assert [set(r) for r in got] == [{"image", "label"}] * 4
    for r, i in zip(got, [40, 0, 13, 13]):
        assert r["image"].shape == (6, 6, 1) and r["label"].shape == ()  # as ds[i] gives them
        assert np.array_equal(r["image"], truth["image"][i]) and r["label"] == truth["label"][i]
    assert pair_ds.__getitems__([]) == []
    with pytest.raises(stoker.RecordIndexError):
        pair_ds.__getitems__([0, 44])


@pytest.mark.torch
@pytest.mark.parametrize("how", ["batch_size", "batch_sampler"])
def test_torch_dataloader_batches_through_getitems(
    pair_ds: stoker.Dataset, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    import torch
    import torch.utils.data as tud

    truth = _independent(pair_ds)
    calls = []
    real = stoker.Dataset.__getitems__
    monkeypatch.setattr(stoker.Dataset, "__getitems__", lambda self, idx: calls.append(len(idx)) or real(self, idx))
    order = torch.randperm(len(pair_ds), generator=torch.Generator().manual_seed(0)).tolist()
    if how == "batch_size":
        loader = tud.DataLoader(pair_ds, batch_size=8, sampler=order)
    else:
        loader = tud.DataLoader(pair_ds, batch_sampler=tud.BatchSampler(order, batch_size=8, drop_last=False))
    batches = list(loader)
    assert calls == [8, 8, 8, 8, 8, 4]  # one call per batch, never one per record
    images = torch.cat([b["image"] for b in batches]).numpy()
    labels = torch.cat([b["label"] for b in batches]).numpy()
    assert batches[0]["image"].shape == (8, 6, 6, 1) and batches[0]["image"].dtype == torch.int8
    assert np.array_equal(images, truth["image"][order]) and np.array_equal(labels, truth["label"][order])


def test_grain_map_dataset_reads_a_stoker_dataset_and_its_batched_reads(pair_ds: stoker.Dataset) -> None:
    import grain
    from grain._src.python.dataset.base import SupportsBatchedReadRandomAccessDataSource

    truth = _independent(pair_ds)
    assert isinstance(pair_ds, SupportsBatchedReadRandomAccessDataSource)  # Grain's protocol for batched reads
    mds = grain.MapDataset.source(pair_ds)
    # MapDataset._getitems is how Grain's transformations read several records at once.
    got = mds._getitems([3, 30, 3])
    assert [float(r["label"]) for r in got] == truth["label"][[3, 30, 3]].tolist()
    batched = list(mds.shuffle(seed=1).batch(10))
    assert [len(b["label"]) for b in batched] == [10, 10, 10, 10, 4]
    labels = np.concatenate([b["label"] for b in batched])
    assert sorted(labels.tolist()) == sorted(truth["label"].tolist())
    first = batched[0]
    for image, label in zip(first["image"], first["label"]):
        (i,) = np.flatnonzero(truth["label"] == label)
        assert np.array_equal(image, truth["image"][i])


def test_split_that_would_leave_a_part_empty_raises_naming_it(tmp_path: Path) -> None:
    ds = build(tmp_path, [5, 5], {"image": IMG, "label": LAB_GZ})
    with pytest.raises(stoker.SpecError, match=r"of 2 groups \(by='group'\) leaves 'val' empty .*split by='record'"):
        ds.split({"train": 0.9, "val": 0.1}, seed=0)
    with pytest.raises(stoker.SpecError, match=r"leaves 'b', 'c' empty"):
        ds.split({"a": 0.98, "b": 0.01, "c": 0.01}, seed=0, by="record")
    parts = ds.split({"train": 0.9, "val": 0.1}, seed=0, by="record")  # 9 and 1 of 10 records
    assert [len(p) for p in parts.values()] == [9, 1]


def test_a_shape_off_by_a_whole_ratio_gets_the_shape_that_fits(tmp_path: Path) -> None:
    # 16x16 frames read as 8x8: four times the records of the labels.
    write_dataset(tmp_path, [3], {"image": FieldPlan("img", "int8", (16, 16, 1)), "label": LAB_GZ})
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (8, 8, 1)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
    )
    with pytest.raises(stoker.PairingError) as e:
        len(ds)
    message = str(e.value)
    assert "field 'image': 12 records" in message and "field 'label': 3 records" in message
    assert "hint: field 'image' counts 4x the records of field 'label'" in message
    assert "shape=(16, 16, 1) (256 bytes a record) fits" in message
    # A ratio that is not a square scales the first side; a count that is no multiple gets no hint.
    assert "shape=(24, 8, 1)" in shape_hint(ds.fields, {"image": 9, "label": 3})
    assert shape_hint(ds.fields, {"image": 7, "label": 3}) == ""
    assert "or shape=(2,) for field 'label'" in shape_hint(
        {"image": ds.fields["image"], "label": stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32", (4,))},
        {"image": 4, "label": 2},
    )
