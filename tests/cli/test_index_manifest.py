"""`stoker index URL --index-dir DIR`: a sample in a bucket (fsspec's memory filesystem) indexed
into a manifest that a Dataset is then built from, each record with its own label."""

from __future__ import annotations

import gzip
from pathlib import Path

import fsspec
import numpy as np
import pytest

import stoker
from stoker.cli import main
from stoker.io.manifest import MANIFEST_NAME
from tests.helpers.indexed import ids_of

pytestmark = pytest.mark.remote


def test_index_of_a_url_writes_a_manifest_the_dataset_is_built_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fs = fsspec.filesystem("memory")
    base = "memory://cli-manifest/data"
    for g in range(3):
        ids = np.arange(g * 4, g * 4 + 4, dtype="<u4")
        fs.pipe(f"{base}/img_{g:04d}.bin", ids.tobytes())
        fs.pipe(f"{base}/out_{g:04d}.bin.gz", gzip.compress(ids.astype("<f4").tobytes()))
    assert main(["index", base, "--inrez", "2", "--index-dir", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / MANIFEST_NAME}" in capsys.readouterr().out
    ds = stoker.Dataset(
        image=stoker.Field(f"{base}/img_*.bin", "int8", (2, 2, 1)),
        label=stoker.Field(f"{base}/out_*.bin.gz", "float32", compression="gzip"),
        index_dir=tmp_path,
    )
    # An image without a label, put there since: a listing would find it unpaired; the manifest never lists.
    fs.pipe(f"{base}/img_0003.bin", np.arange(12, 16, dtype="<u4").tobytes())
    with ds.loader(5, shuffle="global", seed=1) as loader:
        got = ids_of(list(loader))
    assert sorted(got.tolist()) == list(range(12))


def test_index_of_url_fields_given_with_field(tmp_path: Path) -> None:
    """`--field NAME=URL:DTYPE[:SHAPE]`: the URL's own ':' is not taken for the dtype's."""
    fs = fsspec.filesystem("memory")
    base = "memory://cli-manifest-fields/data"
    for g in range(2):
        ids = np.arange(g * 4, g * 4 + 4, dtype="<u4")
        fs.pipe(f"{base}/img_{g:04d}.bin", ids.tobytes())
        fs.pipe(f"{base}/out_{g:04d}.bin.gz", gzip.compress(ids.astype("<f4").tobytes()))
    argv = ["index", "--field", f"image={base}/img_*.bin:int8:2x2x1", "--field", f"label={base}/out_*.bin.gz:float32"]
    assert main([*argv, "--index-dir", str(tmp_path)]) == 0
    ds = stoker.Dataset(
        image=stoker.Field(f"{base}/img_*.bin", "int8", (2, 2, 1)),
        label=stoker.Field(f"{base}/out_*.bin.gz", "float32"),
        index_dir=tmp_path,
    )
    np.testing.assert_array_equal(ids_of([ds.read([1, 6])]), [1, 6])
