"""Dataset construction: fields, names, lengths."""

from __future__ import annotations

from pathlib import Path

import pytest

import stoker
from conftest import IMG, LAB_GZ, build


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
