"""Files that change while a loader reads them: each row of docs/reliability.md's table ("Files that
change while a loader reads them") as it really behaves. See also tests/api/test_loader_reliability.py (files
deleted, truncated, grown, rewritten between passes) and tests/test_kernels_map_faults.py (cut mid-copy).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stoker
from tests.helpers import indexed
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, encode, make_values, reference, write_dataset
from tests.helpers.resources import consume

PAIR = {"image": IMG, "label": LAB_GZ}


def _changed(err: BaseException | None) -> bool:
    """Whether `err` is the refusal of a file changed since the Dataset was built."""
    return isinstance(err, stoker.CorruptDataError) and "changed since the Dataset was built" in str(err)


def _ds(tmp: Path) -> stoker.Dataset:
    return stoker.Dataset(
        image=stoker.Field(str(tmp / "img_*.bin"), "int8", (6, 6, 1)),
        label=stoker.Field(str(tmp / "out_*.bin.gz"), "float32"),
    )


def _path(tmp: Path, plan: FieldPlan, g: int) -> Path:
    return tmp / f"{plan.prefix}_{g:04d}{'.bin' if plan.kind == 'raw' else '.bin.gz'}"


def _which(batches: list[dict[str, np.ndarray]], name: str, old: list, new: list) -> list[tuple[int, int, str]]:
    """(group, record, "old" or "new") of every delivered row of field ``name``; a row that is
    neither fails the test."""
    rows = []
    for b in batches:
        for k, (g, i) in enumerate(zip(b["__group__"].tolist(), b["__index__"].tolist(), strict=True)):
            if np.array_equal(b[name][k], old[g][name][i]):
                rows.append((g, i, "old"))
            elif np.array_equal(b[name][k], new[g][name][i]):
                rows.append((g, i, "new"))
            else:
                pytest.fail(f"group {g} record {i} of {name!r} is neither the old nor the new file's")
    return rows


@pytest.mark.parametrize("kind", ["raw", "gzip"])
@pytest.mark.parametrize("shuffle", [None, "files"])
def test_a_file_replaced_by_rename_is_read_to_its_end_while_open_and_refused_at_its_next_open(
    tmp_path: Path, kind: str, shuffle: str | None
) -> None:
    write_dataset(tmp_path, [20, 20, 20], PAIR)
    ds = _ds(tmp_path)
    old = reference(ds)
    order = {"shuffle": shuffle, "seed": 1} if shuffle else {}
    loader = ds.loader(5, epochs=2, cycle_length=1, threads=1, prefetch=1, with_index=True, **order)
    it = iter(loader)
    got = [next(it)]  # the first group's files are open; the other groups' are not yet
    first = int(got[0]["__group__"][0])
    plan, name = (IMG, "image") if kind == "raw" else (LAB_GZ, "label")
    replaced = {str(_path(tmp_path, plan, g)) for g in range(3)}
    for g in range(3):
        incoming = tmp_path / "incoming"
        incoming.write_bytes(encode(plan, make_values(plan, 20, 1000 + 20 * g, salt=5)))
        os.replace(incoming, _path(tmp_path, plan, g))
    more, err = consume(it)
    assert _changed(err), err
    assert err.path in replaced and os.path.basename(err.path) in str(err) and "changed since" in str(err)
    rows = _which(got + more, name, old, old)  # only the files the Dataset saw
    assert {g for g, _, _ in rows} == {first} and len(rows) == 20  # the open group read to its end
    again, err = consume(ds.loader(5, with_index=True, **order))  # the next pass: refused at once
    assert _changed(err) and err.path in replaced and again == []
    fresh = _ds(tmp_path)  # a new Dataset reads the new files
    new = reference(fresh)
    got, err = consume(fresh.loader(5, with_index=True, **order))
    assert err is None and {w for _, _, w in _which(got, name, old, new)} == {"new"}


@pytest.mark.parametrize("shuffle", [None, "global"])
def test_a_raw_file_rewritten_in_place_yields_the_new_bytes_only_while_open_and_is_refused_at_its_next_open(
    tmp_path: Path, shuffle: str | None
) -> None:
    write_dataset(tmp_path, [200, 20], PAIR)
    ds = _ds(tmp_path)
    old = reference(ds)
    order = {"shuffle": shuffle, "seed": 2} if shuffle else {}
    loader = ds.loader(5, epochs=2, cycle_length=1, threads=1, prefetch=1, cast="float32", with_index=True, **order)
    it = iter(loader)
    got = [next(it)]
    for g, n in ((0, 200), (1, 20)):
        with open(_path(tmp_path, IMG, g), "r+b") as f:  # same inode, same size, other records
            f.write(encode(IMG, make_values(IMG, n, 5000 + 300 * g, salt=9)))
        os.utime(_path(tmp_path, IMG, g), ns=(1, 1))  # a new mtime, whatever the clock's resolution
    new = reference(ds)
    more, err = consume(it)
    # An open file's new bytes cannot be told from its old ones; its next open can.
    assert _changed(err), err
    assert err.path in {str(_path(tmp_path, IMG, g)) for g in range(2)} and "modified" in str(err)
    assert {w for *_, w in _which(got, "image", old, new)} == {"old"}
    _which(more, "image", old, new)  # every row old or new, none torn
    again, err = consume(ds.loader(5, cast="float32", with_index=True, **order))  # the next pass
    assert _changed(err) and again == []


def test_a_file_deleted_between_passes_is_a_read_error_at_its_first_batch(tmp_path: Path) -> None:
    write_dataset(tmp_path, [20, 20, 20], PAIR)
    ds = _ds(tmp_path)
    loader = ds.loader(5, cycle_length=1, with_index=True)
    first, err = consume(loader)
    assert err is None and len(first) == 12
    os.unlink(_path(tmp_path, IMG, 1))
    got, err = consume(loader)
    assert isinstance(err, stoker.ReadError) and err.path == str(_path(tmp_path, IMG, 1)), err
    assert "img_0001.bin" in str(err) and "No such file" in str(err)
    assert len(got) == 4  # group 0's batches, then the first batch of group 1 fails


_TRITON = "import sys\nfor name in sys.argv[1:]:\n    __import__(name)\nprint('imported')"


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.torch
@pytest.mark.parametrize(
    "order, crashes",
    [
        (["tensorflow", "triton"], True),  # what torch's optimizers import: they import triton
        (["torch", "tensorflow", "triton"], True),  # importing torch first is not enough
        (["triton", "tensorflow", "torch.optim"], False),  # the workaround docs/reliability.md gives
        (["torch._dynamo", "tensorflow", "triton"], False),
    ],
)
def test_importing_tensorflow_before_triton_crashes_and_triton_first_does_not(order: list[str], crashes: bool) -> None:
    """Not stoker's bug (TensorFlow 2.21 with triton 3.7), but docs/reliability.md names it
    and its workaround; this keeps that text true."""
    done = subprocess.run([sys.executable, "-c", _TRITON, *order], capture_output=True, text=True, timeout=300)
    if crashes:
        assert done.returncode == -11, (done.returncode, done.stderr[-2000:])  # SIGSEGV
    else:
        assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-2000:]


def _replace_group_by_rename(directory: Path, g: int, counts: list[int], first_id: int) -> None:
    """Write group ``g`` anew (its images and labels carrying ids from ``first_id``) beside the
    dataset and rename both files over the old ones, as a tool that regenerates a group does."""
    fresh = directory / "fresh"
    indexed.write_dataset(fresh, [first_id, counts[g]])  # group 1 of `fresh` holds ids first_id..
    for name in (f"img_{1:04d}.bin", f"out_{1:04d}.bin.gz"):
        os.replace(fresh / name, directory / name.replace("_0001", f"_{g:04d}"))


@pytest.mark.parametrize("shuffle", ["global", "files", None])
def test_a_group_replaced_by_rename_during_a_pass_never_pairs_new_images_with_kept_labels(
    tmp_path: Path, shuffle: str | None
) -> None:
    counts = [30, 30, 30]
    ds = indexed.write_dataset(tmp_path / "d", counts)
    loader = ds.loader(8, epochs=3, shuffle=shuffle, seed=4, cycle_length=1, threads=2, prefetch=1)
    it = iter(loader)
    got = [next(it)]
    _replace_group_by_rename(tmp_path / "d", 1, counts, 1000)
    more, err = consume(it)
    ids = indexed.ids_of(got + more)  # every image met its own label
    assert set(ids.tolist()) <= set(range(90))  # only records the Dataset saw: none of the new ids
    assert _changed(err), err
    assert err.path in {str(tmp_path / "d" / n) for n in ("img_0001.bin", "out_0001.bin.gz")}
    assert os.path.basename(err.path) in str(err) and "build a new Dataset" in str(err)
    fresh = indexed.open_dataset(tmp_path / "d")  # a new Dataset reads the group as it is now
    ids = indexed.ids_of(list(fresh.loader(8, epochs=2, shuffle=shuffle, seed=4)))
    assert sorted(ids.tolist()) == sorted([*range(30), *range(1000, 1030), *range(60, 90)] * 2)


def test_random_access_refuses_a_group_replaced_by_rename_after_its_files_were_read(tmp_path: Path) -> None:
    counts = [30, 30, 30]
    ds = indexed.write_dataset(tmp_path / "d", counts)
    first = ds.read(np.arange(90))
    indexed.ids_of([first])  # the labels are decoded and kept, the images mapped
    _replace_group_by_rename(tmp_path / "d", 1, counts, 1000)
    changed = r"(img_0001\.bin|out_0001\.bin\.gz)' changed since the Dataset was built"
    with pytest.raises(stoker.CorruptDataError, match=changed) as caught:
        ds.read(np.array([5, 35, 70]))
    assert caught.value.path in {str(tmp_path / "d" / n) for n in ("img_0001.bin", "out_0001.bin.gz")}
    assert indexed.ids_of([ds.read(np.array([5, 70]))]).tolist() == [5, 70]  # the other groups still read
