"""A pickled Dataset or Subset is the same dataset in the process that unpickles it (a DataLoader
worker started by spawn or forkserver): its fields, pair_key, index options and selected records
travel with its catalog, whose lock is made anew there."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import stoker
from tests.helpers.indexed import ids_of, write_dataset

COUNTS = (30, 40, 25)


def every(ds: stoker.Dataset) -> list[int]:
    return ids_of([ds.read(np.arange(len(ds)))]).tolist()


def test_a_split_and_a_selection_pickle_with_their_records(tmp_path: Path) -> None:
    ds = write_dataset(tmp_path, COUNTS)
    parts = ds.split({"train": 0.6, "val": 0.4}, seed=3, by="record")
    picked = ds.select(groups=[2, 0]).select(records=slice(5, 50, 3))
    for subset in (parts["train"], parts["val"], picked):
        again = pickle.loads(pickle.dumps(subset))
        assert isinstance(again, stoker.Subset) and every(again) == every(subset)
        with again.loader(7, shuffle="global", seed=1) as a, subset.loader(7, shuffle="global", seed=1) as b:
            assert ids_of([dict(x) for x in a]).tolist() == ids_of([dict(x) for x in b]).tolist()
            assert a.state_dict()["fingerprint"] == b.state_dict()["fingerprint"]


def test_index_options_travel(tmp_path: Path) -> None:
    ds = write_dataset(tmp_path / "data", COUNTS)
    stoker.write_index(ds, index_dir=tmp_path / "idx")
    path = ds.files[1]["label"].path
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the index is stale for it now
    with pytest.raises(stoker.StaleIndexError):
        stoker.Dataset(ds.fields, index_dir=tmp_path / "idx")
    ignoring = stoker.Dataset(ds.fields, pair_key="", index="ignore", index_dir=tmp_path / "idx")
    again = pickle.loads(pickle.dumps(ignoring.split({"a": 0.5, "b": 0.5}, seed=0)["a"]))
    assert again.root.pair_key == "" and every(again) == every(ignoring.split({"a": 0.5, "b": 0.5}, seed=0)["a"])
    assert again.root._catalog.index_dir == str(tmp_path / "idx")
