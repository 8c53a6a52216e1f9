"""The core contract end to end: real files, every record checked against an independent reading."""

from __future__ import annotations

import gc
import gzip
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker.cli.sample import expected_label
from tests.helpers.resources import open_paths, stoker_threads


def _records(n: int, record: int, base: int) -> np.ndarray:
    """Records whose first 4 bytes are their global index; the rest a pattern of it."""
    idx = np.arange(base, base + n, dtype=np.int64)
    body = ((np.arange(record, dtype=np.int64)[None, :] * 7 + idx[:, None]) & 0xFF).astype(np.uint8)
    body[:, :4] = np.arange(base, base + n, dtype="<u4").view(np.uint8).reshape(n, 4)
    return body


def _write_pairs(tmp: Path, counts: list[int], *, inrez: int = 5, label_kind: str = "gzip",
                 header: int = 0, footer: int = 0) -> stoker.Dataset:  # fmt: skip
    base = 0
    suffix = {"gzip": ".bin.gz", "zlib": ".bin.zz", "raw": ".bin", "multi": ".bin.gz"}[label_kind]
    for g, n in enumerate(counts):
        img = _records(n, inrez * inrez, base).tobytes()
        (tmp / f"img_{g:03d}.bin").write_bytes(b"H" * header + img + b"F" * footer)
        lab = b"h" * header + np.arange(base, base + n, dtype="<f4").tobytes() + b"f" * footer
        if label_kind == "gzip":
            lab = gzip.compress(lab)
        elif label_kind == "zlib":
            lab = zlib.compress(lab)
        elif label_kind == "multi":
            lab = gzip.compress(lab[: len(lab) // 2]) + gzip.compress(lab[len(lab) // 2 :])
        (tmp / f"out_{g:03d}{suffix}").write_bytes(lab)
        base += n
    return stoker.Dataset(
        image=stoker.Field(str(tmp / "img_*.bin"), "uint8", (inrez, inrez), header_bytes=header, footer_bytes=footer),
        label=stoker.Field(str(tmp / f"out_*{suffix}"), "float32", header_bytes=header, footer_bytes=footer),
    )


def _index_of(images: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(images.reshape(len(images), -1)[:, :4]).astype(np.uint8)
    return flat.view("<u4").reshape(-1).astype(np.int64)


def _check_batches(ds: stoker.Dataset, batches: list[dict[str, np.ndarray]], inrez: int) -> None:
    """Every record equals an independent reading; pairs aligned; each record exactly once."""
    counts = [g.records for g in ds.groups]
    firsts = np.concatenate([[0], np.cumsum(counts)])
    seen = []
    for b in batches:
        ids = _index_of(b["image"])
        assert np.array_equal(b["label"], ids.astype(np.float32))
        groups = np.searchsorted(firsts, ids, side="right") - 1
        expected = np.stack([_records(1, inrez * inrez, int(i))[0] for i in ids]).reshape(b["image"].shape)
        assert np.array_equal(b["image"], expected)
        if "__group__" in b:
            assert np.array_equal(b["__group__"], groups)
            assert np.array_equal(b["__index__"], ids - firsts[groups])
        seen.extend(ids.tolist())
    assert sorted(seen) == list(range(int(firsts[-1])))


@pytest.mark.parametrize("label_kind", ["gzip", "zlib", "multi", "raw"])
@pytest.mark.parametrize(("header", "footer"), [(0, 0), (3, 5)])
def test_every_record_matches_the_files_for_each_compression(tmp_path: Path, label_kind: str, header: int,
                                                             footer: int) -> None:  # fmt: skip
    ds = _write_pairs(tmp_path, [13, 0, 7, 21], label_kind=label_kind, header=header, footer=footer)
    assert len(ds) == 41
    batches = list(ds.loader(6, block_length=4, with_index=True))
    assert [len(b["label"]) for b in batches] == [6] * 6 + [5]
    _check_batches(ds, batches, 5)


def test_output_is_identical_whatever_threads_and_prefetch(tmp_path: Path) -> None:
    ds = _write_pairs(tmp_path, [30, 11, 25, 4, 19])
    runs = []
    for threads, prefetch in [(1, 1), (2, 2), (4, 3), (3, 8)]:
        runs.append([b["image"].copy() for b in ds.loader(8, block_length=3, threads=threads, prefetch=prefetch)])
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], other, strict=True))


def test_list_of_loader_holds_distinct_correct_aligned_resident_batches(tmp_path: Path) -> None:
    ds = _write_pairs(tmp_path, [50, 50])
    batches = list(ds.loader(7, cast={"image": "float32"}, prefetch=2))
    for b in batches:
        assert type(b["image"]) is np.ndarray and not isinstance(b["image"], np.memmap)
        assert b["image"].ctypes.data % 64 == 0 and b["label"].ctypes.data % 64 == 0
        assert b["image"].dtype == np.float32 and b["label"].shape == (len(b["image"]),)
    ptrs = {b["image"].ctypes.data for b in batches}
    assert len(ptrs) == len(batches)  # no buffer recycled while the caller holds it
    as_int = [{"image": b["image"].astype(np.uint8), "label": b["label"]} for b in batches]
    _check_batches(ds, as_int, 5)


def test_buffers_are_recycled_only_after_the_caller_drops_them(tmp_path: Path) -> None:
    ds = _write_pairs(tmp_path, [400])
    it = iter(ds.loader(10, threads=1, prefetch=1))
    held = next(it)["image"]
    snapshot = held.copy()
    for _ in range(20):
        next(it)
    assert np.array_equal(held, snapshot)
    it.close()  # type: ignore[attr-defined]


def test_epochs_lengths_and_drop_remainder(tmp_path: Path) -> None:
    ds = _write_pairs(tmp_path, [10, 7])
    loader = ds.loader(4, epochs=3)
    assert len(loader) == 5
    sizes = [len(b["label"]) for b in loader]
    assert sizes == [4, 4, 4, 4, 1] * 3  # batches never span epochs
    dropped = ds.loader(4, epochs=2, drop_remainder=True)
    assert len(dropped) == 4
    assert [len(b["label"]) for b in dropped] == [4] * 8
    forever = iter(ds.loader(5, epochs=None))
    # 17 records in batches of 5: 5, 5, 5, 2 per epoch, repeating with no end.
    assert [len(next(forever)["label"]) for _ in range(12)] == [5, 5, 5, 2] * 3
    forever.close()  # type: ignore[attr-defined]


def test_three_fields_odd_frame_size_and_big_endian(tmp_path: Path) -> None:
    stoker.write_sample(tmp_path, pairs=3, records=17, inrez=97)
    for g in range(3):
        (tmp_path / f"w_{g:04d}.bin").write_bytes(np.arange(g * 17, g * 17 + 17, dtype=">i2").tobytes())
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (97, 97, 1)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
        weight=stoker.Field(str(tmp_path / "w_*.bin"), "int16", byte_order="big"),
    )
    batches = list(ds.loader(10, cast="float64"))
    assert [len(b["label"]) for b in batches] == [10] * 5 + [1]
    for b in batches:
        assert np.array_equal(expected_label(b["image"].astype(np.int8)), b["label"])
        assert np.array_equal(b["weight"], b["label"])
        assert b["weight"].dtype == np.float64


def _worker_threads() -> list[threading.Thread]:
    gc.collect()  # a dropped iterator stops its threads when collected; check right after
    return stoker_threads()


def test_threads_start_at_first_batch_and_stop_on_break_close_or_drop(tmp_path: Path) -> None:
    ds = _write_pairs(tmp_path, [200, 200, 200])
    loader = ds.loader(4, threads=2)
    it = iter(loader)
    assert _worker_threads() == []  # nothing started before the first next()
    next(it)
    assert len(_worker_threads()) == 2
    for _ in it:
        break
    del it
    assert _worker_threads() == [] and open_paths(tmp_path) == []
    with ds.loader(4) as ctx:
        assert ctx.__class__.__name__ == "Loader"
        next(iter(ctx))
    ctx.close()  # idempotent
    assert _worker_threads() == [] and open_paths(tmp_path) == []
    dropped = iter(ds.loader(4))
    next(dropped)
    del dropped
    assert _worker_threads() == [] and open_paths(tmp_path) == []


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_corrupt_gzip_raises_at_its_batch_after_every_earlier_batch(tmp_path: Path, threads: int) -> None:
    ds_paths = _write_pairs(tmp_path, [100, 100], label_kind="gzip")
    bad = tmp_path / "out_001.bin.gz"
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))
    del ds_paths
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "uint8", (5, 5)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
    )
    delivered = []
    with pytest.raises(stoker.CorruptDataError) as info:
        for b in ds.loader(10, cycle_length=1, threads=threads, prefetch=4):
            delivered.append(b)
    assert "out_001.bin.gz" in str(info.value) and info.value.path == str(bad)
    # Group 0 is read whole first (cycle_length=1): its 10 batches all arrive, correct.
    assert len(delivered) >= 10
    for b in delivered:
        assert np.array_equal(b["label"], _index_of(b["image"]).astype(np.float32))


def test_truncated_gzip_and_trailing_garbage_name_the_file(tmp_path: Path) -> None:
    _write_pairs(tmp_path, [50], label_kind="gzip")
    f = tmp_path / "out_000.bin.gz"
    good = f.read_bytes()
    for content in (good[:-12], good + b"garbage!"):
        f.write_bytes(content)
        ds = stoker.Dataset(
            image=stoker.Field(str(tmp_path / "img_*.bin"), "uint8", (5, 5)),
            label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
        )
        with pytest.raises((stoker.CorruptDataError, stoker.PairingError)) as info:
            list(ds.loader(8))
        assert "out_000.bin.gz" in str(info.value)


def test_raw_file_truncated_after_dataset_built_is_an_error_naming_it(tmp_path: Path) -> None:
    ds = _write_pairs(tmp_path, [40])
    img = tmp_path / "img_000.bin"
    img.write_bytes(img.read_bytes()[: 25 * 10])
    for cast in (None, "float32"):
        with pytest.raises(stoker.CorruptDataError) as info:
            list(ds.loader(8, cast=cast))
        assert "img_000.bin" in str(info.value)


def test_record_count_mismatch_raw_at_dataset_and_gzip_at_its_batch(tmp_path: Path) -> None:
    _write_pairs(tmp_path, [20, 20], label_kind="raw")
    (tmp_path / "out_001.bin").write_bytes(np.arange(19, dtype="<f4").tobytes())
    with pytest.raises(stoker.PairingError) as info:
        stoker.Dataset(
            image=stoker.Field(str(tmp_path / "img_*.bin"), "uint8", (5, 5)),
            label=stoker.Field(str(tmp_path / "out_*.bin"), "float32"),
        )
    assert "out_001.bin" in str(info.value) and "img_001.bin" in str(info.value)
    gz = tmp_path / "gz"
    gz.mkdir()
    _write_pairs(gz, [20, 20], label_kind="gzip")
    (gz / "out_001.bin.gz").write_bytes(gzip.compress(np.arange(20, 39, dtype="<f4").tobytes()))
    ds = stoker.Dataset(
        image=stoker.Field(str(gz / "img_*.bin"), "uint8", (5, 5)),
        label=stoker.Field(str(gz / "out_*.bin.gz"), "float32"),
    )
    delivered = []
    with pytest.raises(stoker.PairingError) as info2:
        for b in ds.loader(5, cycle_length=1):
            delivered.append(b)
    assert "out_001.bin.gz" in str(info2.value)
    assert len(delivered) == 4  # all of group 0, nothing of group 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0}, {"batch_size": -1}, {"batch_size": 1.5}, {"batch_size": True},
        {"epochs": 0}, {"cast": {"nope": "float32"}}, {"cast": "object"}, {"memory_budget": "64B"},
        {"memory_budget": "lots"}, {"prefetch": 10_000, "memory_budget": "1MiB"}, {"threads": 0},
    ],
)  # fmt: skip
def test_bad_loader_arguments_raise_spec_error(tmp_path: Path, kwargs: dict[str, object]) -> None:
    ds = _write_pairs(tmp_path, [10])
    args = {"batch_size": 4, **kwargs}
    with pytest.raises(stoker.SpecError):
        ds.loader(**args)  # type: ignore[arg-type]


def test_pair_key_numbers_must_agree_unless_disabled(tmp_path: Path) -> None:
    (tmp_path / "img_0007.bin").write_bytes(b"\0" * 8)
    (tmp_path / "out_8.bin").write_bytes(b"\0" * 8)
    fields = {
        "image": stoker.Field(str(tmp_path / "img_*.bin"), "uint8", (4,)),
        "label": stoker.Field(str(tmp_path / "out_*.bin"), "float32"),
    }
    with pytest.raises(stoker.PairingError) as info:
        stoker.Dataset(fields)
    assert "img_0007.bin" in str(info.value) and "out_8.bin" in str(info.value)
    assert len(stoker.Dataset(fields, pair_key="")) == 2


def test_many_zlib_groups_cost_no_decompression_before_the_first_batch(tmp_path: Path) -> None:
    for g in range(2000):
        (tmp_path / f"img_{g:05d}.bin").write_bytes(np.full((3, 16), g % 256, np.uint8).tobytes())
        (tmp_path / f"out_{g:05d}.bin.zz").write_bytes(zlib.compress(np.arange(3, dtype="<f4").tobytes()))
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "uint8", (16,)),
        label=stoker.Field(str(tmp_path / "out_*.bin.zz"), "float32"),
    )
    it = iter(ds.loader(8, threads=1, prefetch=1))
    next(it)
    counted = sum(c is not None for c in ds._catalog._counts)
    it.close()  # type: ignore[attr-defined]
    # Only the groups the interleave has opened (plus one batch of look-ahead) were counted.
    assert counted <= 16
