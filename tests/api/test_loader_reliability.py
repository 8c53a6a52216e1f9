"""Reliability: every bad input a clear StokerError, files changing under the reader, faults in workers.

Each error test checks the message names the file (and field, record, offset where they apply).
The outcomes for files that change while a loader reads them are the ones docs/reliability.md's
section promises; these tests are what holds it to them.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import gc
import gzip
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
import stoker.engine.decoded
import stoker.engine.descriptors
import stoker.engine.maps
import stoker.engine.openfiles
import stoker.loader
from stoker.cli.config import fields_from_config
from tests.helpers import REPO, indexed
from tests.helpers.data import (
    IMG,
    LAB_GZ,
    FieldPlan,
    build,
    encode,
    make_values,
    reference,
    tf_interleave,
    write_dataset,
)
from tests.helpers.resources import consume, mapped_paths, stoker_threads, wait_no_stoker_threads

PAIR = {"image": IMG, "label": LAB_GZ}


def _changed(err: BaseException | None) -> bool:
    """Whether `err` is the refusal of a file changed since the Dataset was built."""
    return isinstance(err, stoker.CorruptDataError) and "changed since the Dataset was built" in str(err)


def _pair_ds(tmp: Path) -> stoker.Dataset:
    return stoker.Dataset(
        image=stoker.Field(str(tmp / "img_*.bin"), "int8", (6, 6, 1)),
        label=stoker.Field(str(tmp / "out_*.bin.gz"), "float32"),
    )


def _assert_rows(batches: list[dict[str, np.ndarray]], ref: list[dict[str, np.ndarray]]) -> None:
    """Every delivered row equals ``ref[group][field][index]`` (a reading taken beforehand)."""
    for k, b in enumerate(batches):
        for name in ref[0]:
            want = np.stack([ref[g][name][i] for g, i in zip(b["__group__"].tolist(), b["__index__"].tolist())])
            assert np.array_equal(b[name], want.astype(b[name].dtype)), f"batch {k}, field {name!r} is wrong"


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open_fds() -> set[tuple[str, str]]:
    """Each open descriptor with what it points to (a number reused for another file differs)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor)
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return out


# -- bad inputs -------------------------------------------------------------------------------


def test_a_directory_matched_by_the_glob_is_a_spec_error_naming_it(tmp_path: Path) -> None:
    write_dataset(tmp_path, [3, 3], {"image": IMG})
    (tmp_path / "img_0002.bin").mkdir()
    with pytest.raises(stoker.SpecError, match="directory") as info:
        stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)))
    assert info.value.path == str(tmp_path / "img_0002.bin") and str(tmp_path / "img_0002.bin") in str(info.value)
    assert info.value.field == "image"


def test_a_symlink_loop_matched_by_the_glob_is_a_read_error_naming_it(tmp_path: Path) -> None:
    write_dataset(tmp_path, [3], {"image": IMG})
    os.symlink(tmp_path / "img_0002.bin", tmp_path / "img_0001.bin")
    os.symlink(tmp_path / "img_0001.bin", tmp_path / "img_0002.bin")
    with pytest.raises(stoker.ReadError) as info:
        stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)))
    assert info.value.path == str(tmp_path / "img_0001.bin")
    assert "img_0001.bin" in str(info.value) and "symbolic links" in str(info.value)
    assert isinstance(info.value, OSError) and info.value.field == "image"


def test_different_file_counts_name_the_first_file_without_a_partner(tmp_path: Path) -> None:
    write_dataset(tmp_path, [2, 2, 2], {"image": IMG})
    write_dataset(tmp_path, [2, 2], {"label": LAB_GZ})
    with pytest.raises(stoker.PairingError) as info:
        _pair_ds(tmp_path)
    assert info.value.field == "image" and info.value.path == str(tmp_path / "img_0002.bin")
    assert "'image': 3 files" in str(info.value) and "'label': 2 files" in str(info.value)
    assert "img_0002.bin' of field 'image' has no partner" in str(info.value)


def test_a_fifo_matched_by_the_glob_is_a_spec_error_naming_it(tmp_path: Path) -> None:
    write_dataset(tmp_path, [3], {"image": IMG})
    os.mkfifo(tmp_path / "img_0001.bin")  # reading it would block forever
    with pytest.raises(stoker.SpecError, match="not a regular file") as info:
        stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)))
    assert info.value.path == str(tmp_path / "img_0001.bin") and "img_0001.bin" in str(info.value)


def test_a_dangling_symlink_is_a_spec_error_naming_it(tmp_path: Path) -> None:
    os.symlink(tmp_path / "gone.bin", tmp_path / "img_0000.bin")
    with pytest.raises(stoker.SpecError, match="does not exist") as info:
        stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8"))
    assert info.value.path == str(tmp_path / "img_0000.bin")


def test_zero_byte_raw_files_are_an_empty_group(tmp_path: Path) -> None:
    write_dataset(tmp_path, [4, 0, 5], {"image": IMG, "x": FieldPlan("x", "float64")})
    assert (tmp_path / "img_0001.bin").stat().st_size == 0
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
        x=stoker.Field(str(tmp_path / "x_*.bin"), "float64"),
    )
    assert [g.records for g in ds.groups] == [4, 0, 5]
    batches = list(ds.loader(3, with_index=True))
    _assert_rows(batches, reference(ds))
    assert sum(len(b["x"]) for b in batches) == 9


def test_a_zero_byte_raw_file_with_a_header_is_corrupt_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a_0.bin").write_bytes(b"")
    with pytest.raises(stoker.CorruptDataError, match="header_bytes=8") as info:
        stoker.Dataset(a=stoker.Field(str(tmp_path / "a_*.bin"), "int8", header_bytes=8))
    assert info.value.path == str(tmp_path / "a_0.bin") and "a_0.bin" in str(info.value)


def test_a_zero_byte_file_beside_a_full_one_is_a_pairing_error(tmp_path: Path) -> None:
    write_dataset(tmp_path, [4, 6], {"image": IMG, "x": FieldPlan("x", "float64")})
    os.truncate(tmp_path / "x_0001.bin", 0)
    with pytest.raises(stoker.PairingError) as info:
        stoker.Dataset(
            image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
            x=stoker.Field(str(tmp_path / "x_*.bin"), "float64"),
        )
    assert "x_0001.bin" in str(info.value) and "0 records" in str(info.value) and "6 records" in str(info.value)


@pytest.mark.parametrize("kind", ["gzip", "zlib"])
@pytest.mark.parametrize("where", ["header", "footer"])
def test_compressed_header_or_footer_larger_than_the_stream_fails_at_its_group(
    tmp_path: Path, kind: str, where: str
) -> None:
    label = FieldPlan("out", "float32", kind=kind, **{where: 64})  # type: ignore[arg-type]
    paths = write_dataset(tmp_path, [10, 10], {"image": IMG, "label": label})
    bad = paths["label"][1]
    bad.write_bytes((gzip.compress if kind == "gzip" else zlib.compress)(b"\x07" * 30))  # 30 bytes < 64
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
        label=stoker.Field([str(p) for p in paths["label"]], "float32", **{f"{where}_bytes": 64}),  # type: ignore[arg-type]
    )
    ref = reference(stoker.Dataset(image=ds.fields["image"]))
    got, err = consume(ds.loader(5, cycle_length=1, with_index=True))
    assert isinstance(err, stoker.CorruptDataError), err
    assert err.path == str(bad) and str(bad) in str(err) and err.field == "label"
    assert f"{where}_bytes=64" in str(err) and "30 bytes" in str(err)
    assert len(got) == 2  # group 0, whole and right; nothing of group 1
    _assert_rows([{k: v for k, v in b.items() if k != "label"} for b in got], ref)


@pytest.mark.parametrize("kind", ["gzip", "zlib"])
def test_a_bit_flip_in_a_compressed_file_yields_nothing_wrong_and_names_the_file(tmp_path: Path, kind: str) -> None:
    label = FieldPlan("out", "float32", kind=kind)
    paths = write_dataset(tmp_path, [300, 300, 300], {"image": IMG, "label": label})
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
        label=stoker.Field([str(p) for p in paths["label"]], "float32"),
    )
    ref = reference(ds)
    bad = paths["label"][1]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x04
    bad.write_bytes(bytes(data))
    got, err = consume(ds.loader(20, cycle_length=1, threads=2, with_index=True))
    assert isinstance(err, stoker.CorruptDataError), err
    assert err.path == str(bad) and str(bad) in str(err) and err.field == "label"
    assert len(got) == 300 // 20  # all of group 0; nothing of group 1 (decoded and verified whole first)
    _assert_rows(got, ref)


def test_a_truncated_gzip_yields_none_of_its_records_even_when_its_count_is_trusted(tmp_path: Path) -> None:
    paths = write_dataset(tmp_path, [40, 40], PAIR)
    ref = reference(_pair_ds(tmp_path))
    whole = gzip.compress(np.arange(40, 80, dtype="<f4").tobytes(), compresslevel=0)  # stored: a prefix decodes
    # Cut, then 4 bytes that read as the right ISIZE: the count is trusted, and those 4 bytes
    # decode as a label no CRC covers (2.2e-43, not 59.0). Nothing of this stream may be yielded.
    cut = whole[: len(whole) // 2] + (160).to_bytes(4, "little")
    paths["label"][1].write_bytes(cut)
    decodable = len(zlib.decompressobj(31).decompress(cut)) // 4
    ds = _pair_ds(tmp_path)
    assert ds.records_in(1) == 40 and 0 < decodable < 40  # counted from the trailer, nothing decoded
    got, err = consume(ds.loader(5, cycle_length=1, threads=2, with_index=True))
    assert isinstance(err, stoker.CorruptDataError), err
    assert err.path == str(paths["label"][1]) and err.field == "label" and err.index == decodable
    assert f"record {decodable} of group 1" in "\n".join(err.__notes__)
    assert len(got) == 8  # group 0; nothing of group 1
    _assert_rows(got, ref)


def test_a_corrupt_gzip_crc_yields_no_record_of_its_group(tmp_path: Path) -> None:
    paths = write_dataset(tmp_path, [30, 30, 30], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    bad = paths["label"][1]
    data = bytearray(bad.read_bytes())
    data[-8] ^= 0xFF  # the CRC32 of the trailer; every data byte intact
    bad.write_bytes(bytes(data))
    got, err = consume(ds.loader(7, cycle_length=2, block_length=4, threads=2, with_index=True))
    assert isinstance(err, stoker.CorruptDataError), err
    assert err.path == str(bad) and "out_0001.bin.gz" in str(err) and "crc" in str(err).lower()
    _assert_rows(got, ref)
    assert not any((b["__group__"] == 1).any() for b in got)
    assert len(got) == tf_interleave([30, 30, 30], 2, 4).index((1, 0)) // 7


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dtype": "int7"}, "dtype='int7'"),
        ({"dtype": "complex64"}, "dtype='complex64'"),
        ({"shape": (3, 0)}, "shape=(3, 0)"),
        ({"shape": (2.5,)}, "shape=(2.5,)"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": "8"}, "batch_size='8'"),
        ({"threads": -1}, "threads=-1"),
        ({"threads": 1.5}, "threads=1.5"),
        ({"memory_budget": "-5MiB"}, "memory_budget='-5MiB'"),
        ({"memory_budget": "12 parsecs"}, "memory_budget='12 parsecs'"),
        ({"memory_budget": 0}, "memory_budget=0"),
        ({"memory_budget": True}, "memory_budget=True"),
    ],
)
def test_an_invalid_value_is_a_spec_error_quoting_it(tmp_path: Path, kwargs: dict[str, object], needle: str) -> None:
    write_dataset(tmp_path, [4], {"image": IMG})
    field_kw = {k: kwargs[k] for k in ("dtype", "shape") if k in kwargs}
    loader_kw = {k: v for k, v in kwargs.items() if k not in field_kw}
    with pytest.raises(stoker.SpecError) as info:
        spec = {"dtype": "int8", "shape": (6, 6, 1), **field_kw}
        ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), spec["dtype"], spec["shape"]))
        ds.loader(loader_kw.pop("batch_size", 2), **loader_kw)  # type: ignore[arg-type]
    assert needle in str(info.value)


# -- byte order stated by the dtype -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [">u2", np.dtype(">u2"), ">H"])
def test_a_dtype_stating_big_endian_is_read_big_endian(tmp_path: Path, dtype: object) -> None:
    values = np.array([1, 258, 65535, 4096], dtype=np.uint16)
    (tmp_path / "a.bin").write_bytes(values.astype(">u2").tobytes())
    field = stoker.Field([str(tmp_path / "a.bin")], dtype)
    assert field.byte_order == "big" and field.dtype == np.dtype(">u2")
    (batch,) = stoker.Dataset(a=field).loader(4)
    assert batch["a"].tolist() == values.tolist() and batch["a"].dtype == np.dtype("=u2")


def test_byte_order_applies_to_a_dtype_that_states_none() -> None:
    assert stoker.Field("a", "u2").byte_order == "little"
    assert stoker.Field("a", "u2", byte_order="big").dtype == np.dtype(">u2")
    assert stoker.Field("a", np.float32, byte_order="big").dtype == np.dtype(">f4")
    assert stoker.Field("a", ">i1", byte_order="little").dtype == np.dtype("i1")  # one byte has no order
    assert stoker.Field("a", ">f8", byte_order="big").byte_order == "big"
    assert stoker.Field("a", "<f8", byte_order="little").dtype == np.dtype("<f8")


@pytest.mark.parametrize(("dtype", "order"), [(">u2", "little"), ("<f4", "big"), (np.dtype(">i8"), "little")])
def test_a_byte_order_contradicting_the_dtype_is_a_spec_error(dtype: object, order: str) -> None:
    with pytest.raises(stoker.SpecError, match="byte_order") as info:
        stoker.Field("a.bin", dtype, byte_order=order)  # type: ignore[arg-type]
    assert f"byte_order={order!r}" in str(info.value) and "endian" in str(info.value)


# -- unreadable files (tests run as root: drop privileges in a child) -----------------------------

_UNREADABLE = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import stoker

    d = sys.argv[1]
    if os.geteuid() == 0:  # root reads anything: become nobody
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    fields = dict(
        image=stoker.Field(d + "/img_*.bin", "int8", (6, 6, 1)),
        label=stoker.Field(d + "/out_*.bin.gz", "float32"),
    )
    out = {}
    os.chmod(d + "/img_0001.bin", 0)
    try:
        stoker.Dataset(**fields)
    except stoker.StokerError as e:
        out["build"] = [type(e).__name__, str(e), e.path, e.field]
    os.chmod(d + "/img_0001.bin", 0o644)
    ds = stoker.Dataset(**fields)
    expect = {g: np.fromfile(d + f"/img_{g:04d}.bin", np.int8).reshape(-1, 6, 6, 1) for g in range(3)}
    os.chmod(d + "/out_0002.bin.gz", 0)  # readable when the Dataset was built, not when its group is read
    groups, wrong = [], 0
    try:
        for b in ds.loader(5, cycle_length=1, with_index=True):
            groups.extend(b["__group__"].tolist())
            wrong += sum(not np.array_equal(r, expect[g][i])
                         for g, i, r in zip(b["__group__"], b["__index__"], b["image"]))
    except stoker.StokerError as e:
        out["read"] = [type(e).__name__, str(e), e.path, e.field]
    out["groups"], out["wrong"] = groups, wrong
    print(json.dumps(out))
    """
)


def test_an_unreadable_file_is_a_read_error_naming_it_at_build_and_at_its_batch() -> None:
    # pytest's tmp dirs are private to root; the child (nobody) needs a directory it can enter.
    d = Path(tempfile.mkdtemp(prefix="stoker-unreadable-"))
    try:
        d.chmod(0o755)
        write_dataset(d, [10, 10, 10], PAIR)
        for p in d.iterdir():
            if os.geteuid() == 0:  # the child runs as nobody and must own what it chmods
                os.chown(p, 65534, 65534)
            p.chmod(0o644)
        proc = subprocess.run([sys.executable, "-c", _UNREADABLE, str(d)], capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(d)
    kind, msg, path, field = out["build"]
    assert (kind, path, field) == ("ReadError", str(d / "img_0001.bin"), "image")
    assert "img_0001.bin" in msg and "Permission denied" in msg
    kind, msg, path, field = out["read"]
    assert (kind, path, field) == ("ReadError", str(d / "out_0002.bin.gz"), "label")
    assert "out_0002.bin.gz" in msg and "Permission denied" in msg
    assert out["groups"] == [0] * 10 + [1] * 10 and out["wrong"] == 0


# -- files changing under the reader --------------------------------------------------------------


def _open_everything(
    tmp: Path, epochs: int = 2, cast: str | None = None
) -> tuple[stoker.Dataset, Iterator[dict[str, np.ndarray]], list]:
    """A pass whose first batch has opened every group (so every file is open), that first batch."""
    write_dataset(tmp, [60, 60, 60], PAIR)
    ds = _pair_ds(tmp)
    it = iter(ds.loader(6, epochs=epochs, cycle_length=3, block_length=2, threads=2, prefetch=2, with_index=True,
                        cast=cast))  # fmt: skip
    first = next(it)
    assert sorted(set(first["__group__"].tolist())) == [0, 1, 2]
    return ds, it, [first]


def test_a_file_deleted_while_open_is_read_to_its_end_and_its_next_open_names_it(tmp_path: Path) -> None:
    ds, it, got = _open_everything(tmp_path)
    ref = reference(ds)
    for g in range(3):
        os.unlink(tmp_path / f"img_{g:04d}.bin")
        os.unlink(tmp_path / f"out_{g:04d}.bin.gz")
    more, err = consume(it)
    got += more
    assert len(got) == 30  # the whole first epoch: Linux keeps the inodes of open files
    _assert_rows(got, ref)
    assert isinstance(err, stoker.ReadError), err  # the second epoch opens the files again
    assert "img_0000.bin" in str(err) and "No such file" in str(err) and err.path == str(tmp_path / "img_0000.bin")


@pytest.mark.parametrize("cast", [None, "float32"])  # float32: read through the map kept from epoch 0
def test_a_file_replaced_by_rename_is_read_to_its_end_and_refused_from_the_next_epoch(
    tmp_path: Path, cast: str | None
) -> None:
    ds, it, got = _open_everything(tmp_path, cast=cast)
    old = reference(ds)
    for g in range(3):
        for plan in PAIR.values():
            path = tmp_path / f"{plan.prefix}_{g:04d}{'.bin' if plan.kind == 'raw' else '.bin.gz'}"
            new = tmp_path / "incoming"
            new.write_bytes(encode(plan, make_values(plan, 60, 1000 + 60 * g, salt=5)))
            os.replace(new, path)
    more, err = consume(it)
    got += more
    assert len(got) == 30  # the whole first epoch, from the files it holds open
    _assert_rows(got, old)
    assert _changed(err), err  # the second epoch opens them again
    assert err.path == str(tmp_path / "img_0000.bin") and "img_0000.bin" in str(err) and "another inode" in str(err)


def _mappings(path: Path) -> int:
    """Memory maps of ``path`` in this process (from /proc/self/maps)."""
    return mapped_paths(path).count(str(path))


@pytest.mark.parametrize("drop_behind", [False, True])
def test_maps_of_finished_files_are_kept_for_the_next_epoch_only_while_the_dataset_fits_in_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drop_behind: bool
) -> None:
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    fds = _fd_count()
    # One group at a time, 4 batches each, one worker a batch ahead: when the second batch of
    # group 1 arrives, group 0 of this epoch is done and the next epoch has not begun.
    # True: as for a dataset larger than half the RAM.
    monkeypatch.setattr(stoker.loader, "drop_behind_for", lambda raw_bytes: drop_behind)
    loader = ds.loader(10, epochs=2, cycle_length=1, cast="float32", threads=1, prefetch=1, with_index=True)
    first = tmp_path / "img_0000.bin"
    got = []
    with loader:
        for batch in loader:
            got.append(batch)
            if len(got) == 6:
                assert set(batch["__group__"].tolist()) == {1}
                assert _mappings(first) == (0 if drop_behind else 1)
    _assert_rows(got, ref)
    assert len(got) == 16
    assert _mappings(first) == 0 and _mappings(tmp_path / "img_0001.bin") == 0  # released with the pass
    assert _fd_count() == fds


def _map_ranges(path: Path) -> list[str]:
    """The address range of each memory map of ``path`` in this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return [line.split()[0] for line in f if line.rstrip("\n").endswith(" " + str(path))]


def test_kept_maps_are_bounded_and_the_first_kept_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond the limit the map given back last is closed, not the oldest: epochs visit the
    files in the same order, so keeping the first maps finds them again on every epoch (closing
    the oldest would close each map just before its next visit)."""
    monkeypatch.setattr(stoker.engine.descriptors, "max_kept_maps", lambda: 1)  # as under a low mapping limit
    write_dataset(tmp_path, [40, 40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    fds = _fd_count()
    first, second = tmp_path / "img_0000.bin", tmp_path / "img_0001.bin"
    loader = ds.loader(10, epochs=2, cycle_length=1, cast="float32", threads=1, prefetch=1, with_index=True)
    got = []
    kept_at = []
    with loader:
        for batch in loader:
            got.append(batch)
            if len(got) == 10:  # group 2's second batch: groups 0 and 1 of this epoch are done
                assert set(batch["__group__"].tolist()) == {2}
                kept_at = _map_ranges(first)
                assert len(kept_at) == 1  # the first map kept ...
                assert _mappings(second) == 0  # ... the second closed when given back
            if len(got) == 14:  # the second epoch's group 0 read through the map kept
                assert set(batch["__group__"].tolist()) == {0}
                assert _map_ranges(first) == kept_at
            if len(got) == 22:  # its group 2: group 1's new map was closed again, group 0's stays
                assert set(batch["__group__"].tolist()) == {2}
                assert _map_ranges(first) == kept_at and _mappings(second) == 0
    _assert_rows(got, ref)
    assert len(got) == 24
    assert all(_mappings(tmp_path / f"img_{g:04d}.bin") == 0 for g in range(3))
    assert _fd_count() == fds


def test_kept_maps_are_bounded_by_the_mapping_limit_not_the_descriptor_limit() -> None:
    """The kernels' maps hold no descriptor, so a low descriptor limit (1024 on most Linux
    systems) bounds only the files held open, not the maps kept (a quarter of vm.max_map_count,
    at most 16384)."""
    script = (
        "import resource, stoker.kernels\n"
        "from stoker.engine import descriptors\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "assert not stoker.kernels.maps_hold_descriptors()\n"
        "print(descriptors.max_open_files(), descriptors.pass_open_files(), descriptors.max_kept_maps())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    with open("/proc/sys/vm/max_map_count") as f:
        mappings = int(f.read())
    # a pass keeps half the limit open at most (its least, 64, would be every descriptor)
    assert done.stdout.split() == ["16", "32", str(min(16384, mappings // 4))]


# Run in a child process with a given descriptor limit: a global shuffle over the raw files of
# sys.argv[1], one epoch; prints what the limit became, the loader's note on open files, the
# most times one image file was opened, and whether every record came once, intact.
_OPEN_FILES_SCRIPT = """
import collections, json, resource, sys
import numpy as np, stoker, stoker.engine.openfiles
root, soft, hard, shuffle = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
opens = collections.Counter()
real_open = stoker.engine.openfiles.open_local
def counted(name, path):
    opens[path] += 1
    return real_open(name, path)
stoker.engine.openfiles.open_local = counted
ds = stoker.Dataset(image=stoker.Field(root + "/img_*.bin", "int8", (6, 6, 1)),
                    label=stoker.Field(root + "/out_*.bin.gz", "float32"))
kw = dict(shuffle="global", seed=3) if shuffle == "global" else {}
seen = set()
intact = True
with ds.loader(8, threads=1, with_index=True, **kw) as loader:  # one thread: no two open one file
    for batch in loader:
        for img, g, i in zip(batch["image"], batch["__group__"], batch["__index__"]):
            seen.add((int(g), int(i)))
            path = root + "/img_%04d.bin" % g
            want = np.fromfile(path, np.int8, count=36, offset=int(i) * 36).reshape(6, 6, 1)
            intact = intact and bool((img == want).all())
    note = loader.stats().tuning.get("open files")
print(json.dumps({"soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "note": note,
                  "opens": max(opens.values()), "records": len(seen), "intact": intact}))
"""


def _global_shuffle_under(root: Path, soft: int, hard: int, shuffle: str = "global") -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_FILES_SCRIPT, str(root), str(soft), str(hard), shuffle],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def _hard_descriptor_limit() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 16 if hard == resource.RLIM_INFINITY else hard


def test_a_global_shuffle_raises_the_soft_descriptor_limit_to_keep_every_file_open(tmp_path: Path) -> None:
    """80 raw files, soft limit 64: a pass would keep 64 open and reopen the others batch after
    batch; the soft limit is raised (within the hard one) to four times the files, so each file
    is opened once in the epoch, and the loader says so."""
    write_dataset(tmp_path, [6] * 80, PAIR)
    hard = min(512, _hard_descriptor_limit())
    assert hard >= 320, f"this test needs a hard descriptor limit of at least 320 (have {hard})"
    got = _global_shuffle_under(tmp_path, 64, hard)
    assert got["soft"] == 320
    assert got["note"] == "descriptor soft limit raised from 64 to 320 to keep 80 open"
    assert got["opens"] == 1
    assert got["records"] == 480 and got["intact"]


def test_a_global_shuffle_under_a_hard_limit_it_cannot_pass_says_how_many_files_stay_open(tmp_path: Path) -> None:
    write_dataset(tmp_path, [6] * 80, PAIR)
    got = _global_shuffle_under(tmp_path, 200, 200)  # a quarter is 50: the pass keeps its least, 64
    assert got["soft"] == 200
    assert got["note"] == (
        "64 of 80 open at once, the others reopened as batches need them "
        "(at most a quarter of the descriptor limit, and 1024)"
    )
    assert got["opens"] > 1  # what the raise saves where it can
    assert got["records"] == 480 and got["intact"]


def test_a_sequential_pass_leaves_the_descriptor_limit_alone(tmp_path: Path) -> None:
    """In order, a pass holds a few files at a time: nothing to raise, nothing said."""
    write_dataset(tmp_path, [6] * 80, PAIR)
    got = _global_shuffle_under(tmp_path, 64, min(512, _hard_descriptor_limit()), shuffle="none")
    assert got["soft"] == 64 and got["note"] is None and got["opens"] == 1
    assert got["records"] == 480 and got["intact"]


def test_a_global_shuffles_epochs_share_each_files_map_while_both_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A global shuffle reads from every file up to an epoch's last batch, so the next epoch's
    first batches open every file while the last still reads it: both read through one map, not
    a map each, made and faulted in again at every epoch."""
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    real_map_file = stoker.engine.openfiles.map_file
    made: list[str] = []

    def map_file(fd: int, size: int) -> Any:
        made.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_map_file(fd, size)

    monkeypatch.setattr(stoker.engine.openfiles, "map_file", map_file)
    fds = _fd_count()
    loader = ds.loader(4, epochs=8, shuffle="global", seed=3, cast="float32", threads=2, prefetch=4, with_index=True)
    with loader:
        got = list(loader)
        # Once per file, or once per worker where both opened it at the same moment in the
        # first epoch (KeptMaps.lend keeps the first map and closes the other); a map per
        # epoch would be 8 a file.
        counts = collections.Counter(made)
        assert sorted(counts) == [str(tmp_path / f"img_{g:04d}.bin") for g in range(2)]
        assert max(counts.values()) <= 2, counts
        assert _mappings(tmp_path / "img_0000.bin") == 1  # kept for a next pass
    assert len(got) == 8 * 20
    _assert_rows(got, ref)
    assert _mappings(tmp_path / "img_0000.bin") == 0 and _fd_count() == fds


def test_kept_maps_lend_one_map_per_unchanged_file_and_close_each_once_nobody_holds_it(tmp_path: Path) -> None:
    from stoker.kernels import map_file

    path = tmp_path / "img_0000.bin"
    path.write_bytes(bytes(range(256)) * 64)

    def mapped() -> tuple[Any, tuple[int, int, int, int]]:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            return map_file(fd, st.st_size), stoker.engine.maps.identity_of(st, st.st_size)
        finally:
            os.close(fd)

    def maps() -> int:  # of the file at ``path`` now, or of the one it replaced ("(deleted)")
        return len(mapped_paths(path))

    kept = stoker.engine.maps.KeptMaps(limit=1)
    old, ident = mapped()
    assert kept.take(str(path), ident) is None
    assert kept.lend(str(path), ident, old) is old
    twin, _ = mapped()  # another holder mapped the same file meanwhile: it gets the first map
    assert kept.lend(str(path), ident, twin) is old and maps() == 1
    assert kept.take(str(path), ident) == (old, False)  # held, not idle
    for _ in range(3):
        kept.put(str(path), ident, old)
    assert len(kept) == 1 and maps() == 1
    assert kept.take(str(path), ident) == (old, True)  # kept after its holders read through it
    incoming = tmp_path / "incoming"
    incoming.write_bytes(bytes(64 * 256))
    os.replace(incoming, path)
    new, new_ident = mapped()
    assert new_ident != ident
    assert kept.take(str(path), new_ident) is None  # the old file's map is still held: it stays
    assert kept.lend(str(path), new_ident, new) is new and maps() == 2
    kept.put(str(path), new_ident, new)  # not kept while the old file's map is held
    assert len(kept) == 0 and maps() == 1
    kept.put(str(path), ident, old)  # kept once given back ...
    assert len(kept) == 1 and maps() == 1
    assert kept.take(str(path), new_ident) is None  # ... and closed when the new file is asked for
    assert len(kept) == 0 and maps() == 0
    new, new_ident = mapped()
    assert kept.lend(str(path), new_ident, new) is new
    kept.close()
    assert maps() == 1  # held: unmapped when given back
    kept.put(str(path), new_ident, new)
    assert len(kept) == 0 and maps() == 0


def _count_image_preadv(monkeypatch: pytest.MonkeyPatch, images: set[str]) -> list[str]:
    """Every read of one of ``images`` by ``os.preadv`` from now on (the readahead's cache probes
    keep the real call, bound at import, so they are not counted)."""
    real_preadv = os.preadv
    reads: list[str] = []

    def preadv(fd: int, buffers: list, offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path in images:
            reads.append(path)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return reads


@pytest.mark.parametrize("drop_behind", [False, True])
def test_uncast_runs_copy_from_a_kept_map_after_the_first_epoch_and_read_with_preadv_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drop_behind: bool
) -> None:
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    reads = _count_image_preadv(monkeypatch, {str(tmp_path / f"img_{g:04d}.bin") for g in range(2)})
    monkeypatch.setattr(stoker.loader, "drop_behind_for", lambda raw_bytes: drop_behind)
    loader = ds.loader(10, epochs=2, cycle_length=1, threads=1, prefetch=1, with_index=True)
    with loader:
        got = list(loader)
    assert len(got) == 16
    _assert_rows(got, ref)
    assert all(b["image"].dtype == np.int8 for b in got)
    # One run per batch. Epoch 0 reads each with preadv; epoch 1 opens each file after its
    # epoch-0 runs are done (one group at a time), so finds its map kept, except under
    # drop-behind, which keeps none.
    assert len(reads) == (16 if drop_behind else 8)


def test_the_next_pass_of_a_loader_finds_the_maps_of_the_last_with_no_file_open_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass per epoch (a PyTorch loop) reads through the maps the last pass kept; close() unmaps."""
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    images = {str(tmp_path / f"img_{g:04d}.bin") for g in range(2)}
    reads = _count_image_preadv(monkeypatch, images)
    fds = _fd_count()
    loader = ds.loader(10, epochs=1, cycle_length=1, threads=1, prefetch=1, with_index=True)
    first = list(loader)
    _assert_rows(first, ref)
    assert len(reads) == 8  # a first visit reads with preadv
    assert wait_no_stoker_threads() == [] and _fd_count() == fds  # no file open between passes ...
    assert all(_mappings(Path(p)) == 1 for p in images)  # ... but both files still mapped
    for _ in range(2):
        again = list(loader)
        _assert_rows(again, ref)
        assert len(again) == 8 and len(reads) == 8  # copied from the kept maps: no read at all
        assert all(_mappings(Path(p)) == 1 for p in images) and _fd_count() == fds
    loader.close()
    assert all(_mappings(Path(p)) == 0 for p in images)
    dropped = ds.loader(10, cast="float32")
    list(dropped)
    assert _mappings(tmp_path / "img_0000.bin") == 1
    del dropped
    gc.collect()
    assert _mappings(tmp_path / "img_0000.bin") == 0  # dropping the loader unmaps too


def test_a_file_replaced_between_passes_is_refused_not_read_through_the_kept_map(tmp_path: Path) -> None:
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    loader = ds.loader(10, cycle_length=1, cast="float32", threads=1, with_index=True)
    old_ref = reference(ds)
    _assert_rows(list(loader), old_ref)
    image = tmp_path / "img_0001.bin"
    incoming = tmp_path / "incoming"  # same size, other records: a new inode under the old name
    incoming.write_bytes(encode(IMG, make_values(IMG, 40, 7000)))
    os.replace(incoming, image)
    with loader:
        got, err = consume(loader)
    assert _changed(err) and err.path == str(image) and "img_0001.bin" in str(err)
    assert len(got) == 4  # group 0, unchanged
    _assert_rows(got, old_ref)
    assert _mappings(image) == 0


def test_without_descriptor_free_maps_each_pass_releases_its_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where maps hold a descriptor (no compiled kernels), nothing stays mapped between passes."""
    monkeypatch.setattr(stoker.loader, "loader_kept_maps", lambda: None)
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    fds = _fd_count()
    loader = ds.loader(10, epochs=2, cycle_length=1, cast="float32", threads=1, with_index=True)
    _assert_rows(list(loader), reference(ds))
    assert wait_no_stoker_threads() == [] and _fd_count() == fds
    assert _mappings(tmp_path / "img_0000.bin") == 0 and _mappings(tmp_path / "img_0001.bin") == 0


@pytest.mark.parametrize("cast", [None, "float32"])
def test_a_file_cut_between_epochs_is_not_read_through_the_map_kept_from_before(
    tmp_path: Path, cast: str | None
) -> None:
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    loader = ds.loader(10, epochs=2, cycle_length=1, cast=cast, threads=1, prefetch=1, with_index=True)
    got = []
    with loader:
        it = iter(loader)
        for _ in range(6):  # group 0 of epoch 0 done and its map kept; see the test above
            got.append(next(it))
        assert _mappings(tmp_path / "img_0000.bin") == 1
        os.truncate(tmp_path / "img_0000.bin", 36 * 25 + 5)  # records 0..24 remain
        more, err = consume(it)
    got += more
    assert isinstance(err, stoker.CorruptDataError), err
    assert err.path == str(tmp_path / "img_0000.bin") and "img_0000.bin" in str(err) and err.index == 25
    assert len(got) == 8 + 2  # epoch 0, then epoch 1's batches 0 and 1 (records 0..19)
    _assert_rows(got, ref)


def test_global_shuffle_keeps_the_labels_it_decoded_and_refuses_a_renamed_file_from_the_next_pass(
    tmp_path: Path,
) -> None:
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    old = reference(ds)
    loader = ds.loader(8, epochs=2, shuffle="global", seed=5, threads=2, with_index=True)
    it = iter(loader)
    got = [next(it)]
    for g in range(2):
        incoming = tmp_path / "incoming"
        incoming.write_bytes(encode(LAB_GZ, make_values(LAB_GZ, 40, 500 + 40 * g, salt=3)))
        os.replace(incoming, tmp_path / f"out_{g:04d}.bin.gz")
    more, err = consume(it)
    assert err is None
    _assert_rows(got + more, old)  # both epochs of this pass: the labels decoded at its start
    new, err = consume(loader)
    assert _changed(err) and new == [], err
    assert err.path in {str(tmp_path / f"out_{g:04d}.bin.gz") for g in range(2)} and "out_000" in str(err)


@pytest.mark.parametrize("cast", [None, "float32"])
def test_a_file_truncated_in_place_fails_at_the_batch_holding_its_first_missing_record(
    tmp_path: Path, cast: str | None
) -> None:
    write_dataset(tmp_path, [400], {"image": IMG})
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)))
    ref = reference(ds)
    it = iter(ds.loader(10, threads=2, prefetch=2, cast=cast, with_index=True))
    got = [next(it)]
    # Cut inside record 123: records 0..122 remain. Batch 12 holds record 123, well past the
    # batches already read ahead (at most prefetch + threads), so it is read after the cut.
    os.truncate(tmp_path / "img_0000.bin", 36 * 123 + 17)
    more, err = consume(it)
    got += more
    assert isinstance(err, stoker.CorruptDataError), err
    assert err.path == str(tmp_path / "img_0000.bin") and "img_0000.bin" in str(err)
    assert err.index == 123 and err.offset == 36 * 123 + 17 and "record 123" in str(err)
    assert len(got) == 12
    _assert_rows(got, ref)


@pytest.mark.parametrize("shuffle", [False, "files", "global"])
def test_a_file_cut_before_the_pass_fails_at_the_first_batch_missing_a_record(tmp_path: Path, shuffle: object) -> None:
    write_dataset(tmp_path, [50, 50, 50], {"image": IMG, "x": FieldPlan("x", "int16", (2,))})
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
        x=stoker.Field(str(tmp_path / "x_*.bin"), "int16", (2,)),
    )
    ref = reference(ds)
    kw = {"shuffle": shuffle, "seed": 3, "block_length": 4, "threads": 2, "with_index": True}
    order = [(b["__group__"].tolist(), b["__index__"].tolist()) for b in ds.loader(8, **kw)]  # type: ignore[arg-type]
    os.truncate(tmp_path / "x_0001.bin", 4 * 30)  # group 1 keeps records 0..29 of field x
    expected = next(k for k, (g, i) in enumerate(order) if any(a == 1 and b >= 30 for a, b in zip(g, i)))
    got, err = consume(ds.loader(8, **kw))  # type: ignore[arg-type]
    assert isinstance(err, stoker.CorruptDataError), err
    assert err.path == str(tmp_path / "x_0001.bin") and err.field == "x" and "x_0001.bin" in str(err)
    g, i = order[expected]
    assert err.index is not None and err.index >= 30 and (1, err.index) in set(zip(g, i))
    assert len(got) == expected
    _assert_rows(got, ref)


def test_a_file_deleted_during_a_global_shuffle_fails_the_next_epochs_first_batch_reading_it(tmp_path: Path) -> None:
    """Epoch 0 reads on from the files it opened; epoch 1 opens them again and fails at its first
    batch that reads the deleted file, naming it, having let go of the files held for that
    batch: nothing stays open."""
    write_dataset(tmp_path, [50, 50, 50], {"image": IMG, "x": FieldPlan("x", "int16", (2,))})
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
        x=stoker.Field(str(tmp_path / "x_*.bin"), "int16", (2,)),
    )
    ref = reference(ds)
    kw: dict[str, Any] = {"epochs": 2, "shuffle": "global", "seed": 3, "threads": 2, "prefetch": 2, "with_index": True}
    order = [b["__group__"].tolist() for b in ds.loader(8, **kw)]
    expected = next(k for k in range(19, len(order)) if 1 in order[k])  # epoch 0 is batches 0..18
    fds = _fd_count()
    loader = ds.loader(8, **kw)
    it = iter(loader)
    got = [next(it)]
    os.unlink(tmp_path / "img_0001.bin")
    more, err = consume(it)
    got += more
    assert isinstance(err, stoker.ReadError), err
    assert err.path == str(tmp_path / "img_0001.bin") and "img_0001.bin" in str(err) and "No such file" in str(err)
    assert len(got) == expected
    _assert_rows(got, ref)
    loader.close()
    assert wait_no_stoker_threads() == [] and _fd_count() == fds


@pytest.mark.parametrize("when", ["before the pass", "during the pass"])
def test_a_grown_file_is_read_while_open_as_the_dataset_saw_it_and_refused_at_its_next_open(
    tmp_path: Path, when: str
) -> None:
    write_dataset(tmp_path, [40, 40], {"image": IMG, "x": FieldPlan("x", "float64")})
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
        x=stoker.Field(str(tmp_path / "x_*.bin"), "float64"),
    )
    ref = reference(ds)

    def grow() -> None:
        for g in range(2):
            with open(tmp_path / f"img_{g:04d}.bin", "ab") as f:
                f.write(b"\x55" * 36 * 7)

    if when == "before the pass":
        grow()
    it = iter(ds.loader(6, epochs=2, cycle_length=1, cast={"image": "float32"}, with_index=True, threads=2))
    got = []
    if when == "during the pass":
        got.append(next(it))
        grow()
    more, err = consume(it)
    got += more
    assert _changed(err) and "grown from 1440 to 1692 bytes" in str(err), err
    assert err.path in {str(tmp_path / f"img_{g:04d}.bin") for g in range(2)}
    _assert_rows(got, ref)  # only records the Dataset saw, read up to its sizes
    # During the pass: what is open is read on; the next open of either file is refused.
    assert len(got) == 0 if when == "before the pass" else 1 <= len(got) < 28


def test_a_gzip_file_grown_by_a_member_is_refused_before_any_of_its_records(tmp_path: Path) -> None:
    paths = write_dataset(tmp_path, [20, 20], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    with open(paths["label"][0], "ab") as f:
        f.write(gzip.compress(np.arange(5, dtype="<f4").tobytes()))
    got, err = consume(ds.loader(5, cycle_length=1, with_index=True))
    assert _changed(err), err
    assert err.path == str(paths["label"][0]) and "out_0000.bin.gz" in str(err) and "grown" in str(err)
    assert got == []
    _assert_rows(got, ref)


# -- faults in workers -----------------------------------------------------------------------------


def test_an_os_error_in_a_worker_keeps_its_worker_traceback_and_names_the_file(tmp_path: Path) -> None:
    write_dataset(tmp_path, [30, 30], PAIR)
    ds = _pair_ds(tmp_path)
    victim = tmp_path / "img_0001.bin"
    os.unlink(victim)
    victim.mkdir()  # a directory where the file was: open() succeeds, reading fails
    got, err = consume(ds.loader(10, cycle_length=1, threads=2))
    assert isinstance(err, stoker.ReadError), err
    assert err.path == str(victim) and str(victim) in str(err) and err.field == "image"
    assert len(got) == 3
    frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
    assert "acquire" in frames and "work" in frames  # raised in the worker, traceback kept
    assert any("stoker-worker" in note and "batch 3 of epoch 0" in note for note in err.__notes__)


def test_an_unexpected_worker_exception_keeps_type_and_traceback_and_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_dataset(tmp_path, [30, 30], {"image": IMG})
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)))
    target = str(tmp_path / "img_0001.bin")
    real_preadv = os.preadv

    def flaky_preadv(fd: int, buffers: list, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == target and offset >= 36 * 12:
            raise RuntimeError("injected fault in the disk driver")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", flaky_preadv)
    got, err = consume(ds.loader(6, cycle_length=1, threads=2, prefetch=3))
    assert type(err) is RuntimeError and str(err) == "injected fault in the disk driver"
    assert len(got) == 5 + 2  # group 0 (30 records), then group 1's records 0..11
    frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
    assert frames[-1] == "flaky_preadv" and "_pread" in frames and "work" in frames
    notes = "\n".join(err.__notes__)
    assert target in notes and "field 'image'" in notes and "records 12..17" in notes
    assert "stoker-worker" in notes and "batch 7 of epoch 0" in notes


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed-in-turns", "decoded-whole"])
def test_a_later_batch_failing_first_neither_hangs_nor_drops_an_earlier_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    # Batches 2 and 3 both read group 0's labels. Batch 3 fails on its image while batch 2 is
    # still reading its own: batch 2 must still be delivered, then batch 3's error.
    if streamed:  # files above this size are read in turns by ticket; make these labels one
        monkeypatch.setattr(stoker.engine.decoded, "VERIFY_WHOLE_BYTES", 0)
    write_dataset(tmp_path, [30, 30], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    target = str(tmp_path / "img_0000.bin")
    real_preadv = os.preadv
    failed = threading.Event()

    def preadv(fd: int, buffers: list, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == target:
            if offset == 36 * 10:
                failed.wait(5)  # batch 2 reads its image only after batch 3 has failed
            elif offset == 36 * 15:
                failed.set()
                raise RuntimeError("batch 3 fails first")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    got, err = consume(ds.loader(5, cycle_length=1, threads=2, prefetch=2, with_index=True), timeout=15)
    assert type(err) is RuntimeError and str(err) == "batch 3 fails first"
    assert len(got) == 3
    _assert_rows(got, ref)


def test_an_io_error_is_a_read_error_naming_file_field_record_and_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_dataset(tmp_path, [30, 30], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    image, label = str(tmp_path / "img_0001.bin"), str(tmp_path / "out_0001.bin.gz")
    real_preadv, real_pread = os.preadv, os.pread

    def preadv(fd: int, buffers: list, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == image and offset >= 36 * 10:
            raise OSError(errno.EIO, os.strerror(errno.EIO))  # what a failing disk returns
        return real_preadv(fd, buffers, offset)

    def pread(fd: int, n: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}") == label:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    got, err = consume(ds.loader(5, cycle_length=1, threads=2, with_index=True))
    assert isinstance(err, stoker.ReadError) and isinstance(err.__cause__, OSError), err
    assert (err.path, err.field, err.index, err.offset) == (image, "image", 10, 360)
    assert image in str(err) and "record 10" in str(err) and "offset 360" in str(err) and "Input/output" in str(err)
    assert len(got) == 8  # group 0, then group 1's records 0..9
    _assert_rows(got, ref)
    monkeypatch.setattr(os, "preadv", real_preadv)
    monkeypatch.setattr(os, "pread", pread)
    got, err = consume(ds.loader(5, cycle_length=1, threads=2, with_index=True))
    assert isinstance(err, stoker.ReadError), err
    assert (err.path, err.field, err.offset) == (label, "label", 0) and label in str(err)
    assert len(got) == 6
    _assert_rows(got, ref)


_INTERRUPT = textwrap.dedent(
    """
    import gc, json, os, signal, sys, threading, time
    import stoker

    # Python leaves SIGINT ignored where its parent ignored it (a job started in the background
    # by a shell without job control: `nohup cmd &`), and then no Ctrl-C below would arrive.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    d, mode = sys.argv[1], sys.argv[2]
    ds = stoker.Dataset(image=stoker.Field(d + "/img_*.bin", "int8", (6, 6, 1)),
                        label=stoker.Field(d + "/out_*.bin.gz", "float32"))
    def fds():
        return len(os.listdir("/proc/self/fd"))
    def others():
        return [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    before = (threading.active_count(), fds())
    results = {}
    for run in range(int(sys.argv[3])):
      for where in sys.argv[4:]:
        # "again": Ctrl-C every 0.3 s until the loop has ended (a user pressing again; later presses
        # land inside close() itself). "once": one press, which must end the loop by itself: none
        # may be swallowed ("Exception ignored"), as one raised inside a Python finalizer would be.
        ended = threading.Event()
        def press(first=0.03 + 0.05 * run):
            if not ended.wait(first):
                os.kill(os.getpid(), signal.SIGINT)
            while not ended.wait(0.3 if mode == "again" else 30):
                os.kill(os.getpid(), signal.SIGINT)
        timer = threading.Thread(target=press)
        batches, pressed = 0, None
        try:
            threads = None if "autotune" in where else 3  # autotune adds workers as it measures
            for b in ds.loader(4, epochs=None, threads=threads, shuffle="files", seed=1):
                batches += 1
                if batches == 1:  # the threads are running: interrupt them a little later
                    timer.start()
                if where == "in the loop body":
                    time.sleep(0.01)
        except KeyboardInterrupt:
            ended.set()
        else:
            raise SystemExit("the loop ended without KeyboardInterrupt")
        timer.join()
        gc.collect()  # an interrupted pass held in a reference cycle is closed when collected
        # close() joins the workers; one that a Ctrl-C cut short before it set the stop flag leaves
        # them to leave by themselves, within stoker.engine.executor.WAIT_SECONDS (0.1 s): wait up to 1 s.
        deadline = time.monotonic() + 1.0
        while (others() or fds() != before[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        results[f"{where} #{run}"] = {"batches": batches, "threads": others(), "fds": fds()}
    print(json.dumps({"before": before, "results": results}))
    """
)


@pytest.mark.parametrize("where", ["in the loop body", "inside next()", "inside next(), autotune"])
@pytest.mark.parametrize("mode", ["again", "once"])
def test_keyboard_interrupt_during_iteration_stops_every_thread(tmp_path: Path, where: str, mode: str) -> None:
    write_dataset(tmp_path, [200, 150, 90], PAIR)
    # A child process: a stray SIGINT must never reach the test runner itself. Several runs in it:
    # where a Ctrl-C lands is a matter of timing (a lock taken in Python code once kept 3 runs in 10
    # of "inside next()" from stopping; see stoker.engine.executor._State).
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT, str(tmp_path), mode, "5", where], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    threads_before, fds_before = out["before"]
    assert threads_before == 1
    assert len(out["results"]) == 5
    for run, r in out["results"].items():
        assert r["batches"] > 0, run
        assert r["threads"] == [], f"{run}: threads left {r['threads']}"
        assert r["fds"] == fds_before, run


# What a Ctrl-C may interrupt: threading's Python code that takes a lock (Condition and Event,
# Thread.start waiting on one) can be left holding it. Thread.join handles an interrupt itself.
_LOCKING = {"__enter__", "__exit__", "wait", "wait_for", "set", "start", "_acquire_restore", "_release_save"}


@pytest.mark.parametrize("threads", [3, None])
def test_the_consumer_and_close_run_no_python_locking_code(tmp_path: Path, threads: int | None) -> None:
    write_dataset(tmp_path, [200, 150, 90], PAIR)
    ds = _pair_ds(tmp_path)
    len(ds)
    entered: set[str] = set()

    def profile(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename == threading.__file__:
            entered.add(frame.f_code.co_name)

    loader = ds.loader(4, epochs=None, threads=threads, shuffle="files", seed=1)
    sys.setprofile(profile)  # this thread only: the consumer's side
    try:
        it = iter(loader)
        until = time.monotonic() + 0.5  # autotune (threads=None) measures windows of 0.15 s
        while time.monotonic() < until:
            next(it)
        loader.close()
    finally:
        sys.setprofile(None)
    assert not entered & _LOCKING, sorted(entered)
    assert wait_no_stoker_threads() == []


def _ends(how: str, loader: stoker.Loader) -> None:
    """Leave a pass unfinished in one of the ways a user can."""
    if how == "close":
        it = iter(loader)
        next(it)
        next(it)
        loader.close()
    elif how == "break":
        for k, _ in enumerate(loader):
            if k == 3:
                break
    elif how == "gc of the iterator":
        it = iter(loader)
        next(it)
        del it
    elif how == "gc of the loader":
        it = iter(loader)
        next(it)
        del it, loader
    elif how == "exception in the body":
        with pytest.raises(ZeroDivisionError), loader:
            for _ in loader:
                _ = 1 / 0
    elif how == "iter again":
        it = iter(loader)
        next(it)
        it2 = iter(loader)
        next(it2)
        loader.close()
    gc.collect()


@pytest.mark.parametrize("shuffle", [False, "files", "global"])
@pytest.mark.parametrize(
    "how", ["close", "break", "gc of the iterator", "gc of the loader", "exception in the body", "iter again"]
)
def test_unfinished_passes_leave_no_thread_and_no_file_descriptor(tmp_path: Path, how: str, shuffle: object) -> None:
    fields = {"image": IMG, "label": LAB_GZ, "z": FieldPlan("zz", "int16", (2,), kind="zlib")}
    ds = build(tmp_path, [300, 200, 250, 100], fields)
    len(ds)  # settle counts now: nothing of the Dataset itself is open afterwards
    fds, threads = _open_fds(), set(threading.enumerate())
    loader = ds.loader(5, epochs=None, threads=3, prefetch=4, shuffle=shuffle, seed=7)  # type: ignore[arg-type]
    _ends(how, loader)
    del loader
    assert wait_no_stoker_threads() == []
    # Nothing opened or started here is left; what an earlier test left (an S3 test's server
    # threads and sockets) may close meanwhile, so these compare sets, not counts.
    assert set(threading.enumerate()) - threads == set()
    assert _open_fds() - fds == set()


def test_a_finished_error_leaves_no_thread_and_no_file_descriptor(tmp_path: Path) -> None:
    paths = write_dataset(tmp_path, [100, 100, 100], PAIR)
    data = bytearray(paths["label"][2].read_bytes())
    data[len(data) // 2] ^= 0x10
    paths["label"][2].write_bytes(bytes(data))
    ds = _pair_ds(tmp_path)
    fds = _fd_count()
    with pytest.raises(stoker.CorruptDataError):
        for _ in ds.loader(4, threads=3, cycle_length=2):
            pass
    assert stoker_threads() == [] or wait_no_stoker_threads() == []
    assert _fd_count() == fds


# -- the docs' error messages are real --------------------------------------------------------------

_ERROR_LINE = re.compile(r"^\s*((?:SpecError|PairingError|CorruptDataError|ReadError|StateError): .*)$", re.MULTILINE)


def _quoted_messages() -> list[str]:
    """The `Type: message` lines quoted in the README's and docs/'s ```text blocks."""
    quoted = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for block in re.findall(r"```text\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL):
            quoted += _ERROR_LINE.findall(block)
    return quoted


def test_the_error_messages_the_docs_quote_are_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_dataset(Path("data"), [64] * 4, {"image": FieldPlan("img", "int8", (128, 128, 1)), "label": LAB_GZ})

    def dataset() -> stoker.Dataset:
        return stoker.Dataset(
            image=stoker.Field("data/img_*.bin", "int8", (128, 128, 1)),
            label=stoker.Field("data/out_*.bin.gz", "float32"),
        )

    said: list[str] = []

    def say(action) -> None:
        with pytest.raises(stoker.StokerError) as info:
            action()
        said.append(f"{type(info.value).__name__}: {info.value}")

    say(lambda: stoker.Field("data/img_*.bin", ">i2", byte_order="little"))
    os.rename("data/out_0002.bin.gz", "data/out_0007.bin.gz")
    say(dataset)
    os.rename("data/out_0007.bin.gz", "data/out_0002.bin.gz")
    ds = dataset()
    os.truncate("data/img_0003.bin", 128 * 128 * 40 + 100)
    say(lambda: list(ds.loader(32)))
    os.unlink("data/img_0001.bin")
    os.symlink("img_0001.bin", "data/img_0001.bin")
    say(dataset)
    loader = ds.loader(32, epochs=None, shuffle="global", seed=1)
    say(lambda: ds.loader(32, epochs=None, shuffle="global", seed=2, state=loader.state_dict()))
    Path("data/stoker.toml").write_text(
        '[fields.image]\nfiles = "img_*.bin"\ndtype = "int8"\nshape = [128, 128, 1]\nheader_byte = 16\n'
    )
    say(lambda: fields_from_config("data/stoker.toml"))
    quoted = _quoted_messages()
    assert quoted, "the README and docs/ quote no error message"
    assert [m for m in quoted if m not in said] == []


def test_a_ready_batch_is_not_held_back_while_its_worker_waits_on_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker sends the consumer's wake-up for a batch with its next copy kernel (see
    stoker.engine.executor); a read that may wait on the disk sends it first."""
    write_dataset(tmp_path, [40], PAIR)
    ds = _pair_ds(tmp_path)
    image = str(tmp_path / "img_0000.bin")
    real_preadv = os.preadv
    got_first = threading.Event()

    def preadv(fd: int, buffers: list, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == image and offset == 36 * 10:
            got_first.wait(5)  # batch 1's read waits (a slow disk) until batch 0 is delivered
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with ds.loader(10, threads=1, prefetch=3, with_index=True) as loader:
        it = iter(loader)
        t = time.perf_counter()
        first = next(it)
        waited = time.perf_counter() - t
        got_first.set()
        rest = list(it)
    assert waited < 0.4, waited  # not the consumer's 0.5 s poll
    _assert_rows([first, *rest], reference(ds))


def test_a_pass_whose_loader_was_dropped_still_keeps_its_maps_for_its_next_epoch(tmp_path: Path) -> None:
    """``iter(ds.loader(...))`` keeps only the pass: its epochs must still find the maps kept."""
    write_dataset(tmp_path, [40, 40], PAIR)
    ds = _pair_ds(tmp_path)
    ref = reference(ds)
    it = iter(ds.loader(10, epochs=2, cycle_length=1, cast="float32", threads=1, prefetch=1, with_index=True))
    gc.collect()  # the loader itself is gone now
    got = [next(it) for _ in range(6)]  # group 0 of epoch 0 done: its map is kept for epoch 1
    assert _mappings(tmp_path / "img_0000.bin") == 1
    got += list(it)
    _assert_rows(got, ref)
    assert len(got) == 16
    del it
    gc.collect()
    assert _mappings(tmp_path / "img_0000.bin") == 0 and _mappings(tmp_path / "img_0001.bin") == 0


# -- gzip trailers that miscount ---------------------------------------------------------------------


def _loader_run(ds: stoker.Dataset, **kw: Any) -> tuple[list, BaseException | None]:
    """Batches of a pass and the error ending it, whether raised building the loader or reading."""
    try:
        loader = ds.loader(4, **kw)
    except stoker.StokerError as e:
        return [], e
    return consume(loader)


@pytest.mark.parametrize("shuffle", [None, "files", "global"])
def test_a_multi_member_gzip_whose_last_trailer_matches_its_partner_yields_no_misaligned_record(
    tmp_path: Path, shuffle: str | None
) -> None:
    """Group 1's labels are two members, 5 labels then 20: the trailer says 20 (the last
    member's size), the raw images hold 20, and the file holds 25 labels."""
    ds = indexed.write_dataset(tmp_path, [20, 20, 20])
    labels = tmp_path / "out_0001.bin.gz"
    stray = gzip.compress(np.arange(500, 505, dtype="<f4").tobytes())
    labels.write_bytes(stray + gzip.compress(np.arange(20, 40, dtype="<f4").tobytes()))
    assert int.from_bytes(labels.read_bytes()[-4:], "little") == 20 * 4  # the trailer agrees with the images
    ds = indexed.open_dataset(tmp_path)
    got, err = _loader_run(ds, epochs=2, shuffle=shuffle, seed=3, cycle_length=1, threads=2)
    indexed.ids_of(got)  # every delivered image met its own label
    assert isinstance(err, stoker.PairingError), err
    assert err.path in {str(labels), str(tmp_path / "img_0001.bin")}, err.path  # the group's files
    assert f"25 records in {str(labels)!r}" in str(err) and "no record of this group is yielded" in str(err)
