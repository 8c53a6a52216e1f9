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
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, encode, make_values, reference, write_dataset
from tests.helpers.resources import consume

PAIR = {"image": IMG, "label": LAB_GZ}


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
def test_a_file_replaced_by_rename_is_read_new_from_its_next_open_even_in_the_same_epoch(
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
    for g in range(3):
        incoming = tmp_path / "incoming"
        incoming.write_bytes(encode(plan, make_values(plan, 20, 1000 + 20 * g, salt=5)))
        os.replace(incoming, _path(tmp_path, plan, g))
    new = reference(ds)
    more, err = consume(it)
    assert err is None
    rows = _which(got + more, name, old, new)
    epoch0, epoch1 = rows[:60], rows[60:]
    assert {w for g, _, w in epoch0 if g == first} == {"old"}  # open: read to its end
    assert {w for g, _, w in epoch0 if g != first} == {"new"}  # opened after the rename
    assert {w for _, _, w in epoch1} == {"new"}
    again, err = consume(ds.loader(5, with_index=True, **order))  # the next pass
    assert err is None and {w for _, _, w in _which(again, name, old, new)} == {"new"}


@pytest.mark.parametrize("shuffle", [None, "global"])
def test_a_raw_file_rewritten_in_place_at_the_same_size_yields_the_new_bytes_silently(
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
    new = reference(ds)
    more, err = consume(it)
    assert err is None  # nothing notices: not the size, not the map
    rows = _which(got + more, "image", old, new)
    assert {w for *_, w in rows[:5]} == {"old"}
    # The rest of the epoch and the next are the new bytes, but for the few records read ahead
    # before the write (at most a prefetch window, 2 of 44 batches here).
    later = rows[5:]
    assert sum(w == "new" for *_, w in later) >= len(later) - 20, later
    assert {w for *_, w in rows[220:]} == {"new"}
    again, err = consume(ds.loader(5, cast="float32", with_index=True, **order))  # the next pass
    assert err is None and {w for *_, w in _which(again, "image", old, new)} == {"new"}


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
