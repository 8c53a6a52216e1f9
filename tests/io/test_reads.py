"""stoker.io.reads.seek_read: records of a compressed file, in any order, each run decoded from
the seek point before it, equal to the file's own records; a stream that ends early is a
CorruptDataError naming the file, the record and the decompressed offset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker.errors import CorruptDataError
from stoker.io.reads import seek_read
from tests.helpers.data import FieldPlan, build, read_records

# 64-byte records, gzip: 20000 of them span several deflate blocks, each a seek point (the
# index places one at the first block boundary after every `spacing` decompressed bytes).
N = 20000
WIDE_GZ = FieldPlan("wide", "float32", (16,), kind="gzip")


def _indexed(tmp_path: Path, records: int) -> tuple[stoker.Dataset, np.ndarray]:
    ds = build(tmp_path, [records], {"wide": WIDE_GZ})
    stoker.write_index(ds, spacing=1024)
    ds = stoker.Dataset(ds.fields)  # opened again: the index gives it seek points
    info = ds.files[0]["wide"]
    return ds, read_records(info.path, ds.fields["wide"])


def _read(ds: stoker.Dataset, local: list[int]) -> np.ndarray:
    catalog = ds.catalog
    points = sorted(catalog.seek_points[(0, "wide")], key=lambda p: p[1])
    assert len(points) > 4  # the index placed seek points inside the stream
    return seek_read("wide", ds.fields["wide"], ds.files[0]["wide"], points, np.array(local), ds.records_in(0))


@pytest.mark.parametrize(
    "local",
    [[0], [N - 1], [5, 6, 7, 8], [15000, 3, 7700, 3, 19998, 16, 17], list(range(N))[::-1], [9001, 9002, 150, 151]],
)
def test_records_read_from_seek_points_equal_the_files_own(tmp_path: Path, local: list[int]) -> None:
    ds, records = _indexed(tmp_path, N)
    np.testing.assert_array_equal(_read(ds, local), records[local])


def test_a_record_past_the_streams_end_is_an_error_naming_the_file_record_and_offset(tmp_path: Path) -> None:
    ds, _ = _indexed(tmp_path, N)
    info = ds.files[0]["wide"]
    with pytest.raises(CorruptDataError) as got:
        _read(ds, [3, N + 50])  # a record past the last
    error = got.value
    assert error.path == info.path and info.path in str(error)
    assert error.index == N and error.offset == N * 64 and f"inside record {N} of {N}" in str(error)
