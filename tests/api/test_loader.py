"""The loader end to end on real files: contents, order, epochs, threads, ownership, lifetime, errors."""

from __future__ import annotations

import gc
import gzip
import itertools
import math
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, build, check_batches, read_records, tf_interleave, write_dataset
from tests.helpers.resources import consume, open_paths, stoker_threads, wait_no_stoker_threads

COUNTS = [13, 0, 7, 21, 3, 1]
LAYOUTS = {
    "raw+gzip": {"image": IMG, "label": LAB_GZ},
    "raw+zlib": {"image": IMG, "label": FieldPlan("out", "float32", kind="zlib")},
    "raw+multi-member-gzip": {"image": IMG, "label": FieldPlan("out", "float32", kind="multi")},
    "gzip-zero-padding": {"image": IMG, "label": FieldPlan("out", "float32", kind="gzip", pad=777)},
    "gzip-by-magic-no-suffix": {"image": IMG, "label": FieldPlan("out", "float32", kind="gzip-nosuffix")},
    "header-footer": {
        "image": FieldPlan("img", "int8", (6, 6, 1), header=10, footer=3),
        "label": FieldPlan("out", "float32", kind="gzip", header=5, footer=7),
        "z": FieldPlan("zz", "uint16", (3,), kind="zlib", header=2, footer=9),
    },
    "big-endian": {
        "image": FieldPlan("img", "int32", (3,), byte_order="big"),
        "label": FieldPlan("out", "float64", kind="gzip", byte_order="big"),
    },
    "three-fields": {"image": IMG, "label": LAB_GZ, "mask": FieldPlan("msk", "uint16", (3,), kind="zlib")},
    "inrez97": {"image": FieldPlan("img", "int8", (97, 97, 1)), "label": LAB_GZ},
    "dtypes": {
        "a": FieldPlan("a", "uint16", (2,)),
        "b": FieldPlan("b", "int64"),
        "c": FieldPlan("c", "float64", kind="gzip"),
        "d": FieldPlan("d", "bool", (5,), kind="zlib"),
    },
    "gzip-only": {"label": LAB_GZ},
    "raw-only-scalar": {"x": FieldPlan("x", "float32")},
}
SETTINGS = [(4, None, None, False), (5, 2, 3, True), (1, 7, 1, False), (64, 1, 2, False), (6, 3, 4, True)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("bs", "cycle", "block", "drop"), SETTINGS)
def test_every_record_equals_an_independent_reading(tmp_path: Path, layout: str, bs, cycle, block, drop) -> None:
    ds = build(tmp_path, COUNTS, LAYOUTS[layout])
    loader = ds.loader(bs, cycle_length=cycle, block_length=block, drop_remainder=drop, with_index=True, threads=2)
    batches = list(loader)
    n = sum(COUNTS)
    assert len(batches) == len(loader) == (n // bs if drop else math.ceil(n / bs))
    assert all(len(b["__group__"]) == bs for b in batches[:-1])
    assert len(batches[-1]["__group__"]) == (bs if drop else n - bs * (len(batches) - 1))
    seq = check_batches(ds, batches, complete=not drop)
    assert seq == tf_interleave(COUNTS, loader.cycle_length, loader.block_length)[: len(seq)]


def test_sample_dataset_pairs_every_image_with_its_label(tmp_path: Path) -> None:
    stoker.write_sample(tmp_path, pairs=3, records=40, inrez=8)
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (8, 8, 1)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32", compression="gzip"),
    )
    seen = []
    for b in ds.loader(16, cycle_length=2, block_length=5):
        assert np.array_equal(b["label"], stoker.cli.sample.expected_label(b["image"]))
        seen.extend(b["label"].astype(int).tolist())
    assert sorted(seen) == list(range(120))


def test_cast_one_dtype_for_every_field(pair_ds: stoker.Dataset) -> None:
    batches = list(pair_ds.loader(8, cast="float32", with_index=True))
    check_batches(pair_ds, batches, cast={"image": "float32", "label": "float32"})


def test_cast_per_field(tmp_path: Path) -> None:
    ds = build(tmp_path, [5, 9], LAYOUTS["big-endian"])
    cast = {"image": "float32", "label": "int64"}
    batches = list(ds.loader(4, cast=cast, with_index=True))
    check_batches(ds, batches, cast=cast)
    assert batches[0]["image"].dtype == np.float32 and batches[0]["label"].dtype == np.int64


@pytest.mark.parametrize("shuffle", [False, "global"])
def test_cast_to_bfloat16_rounds_every_field_as_ml_dtypes_does(tmp_path: Path, shuffle: object) -> None:
    """cast="bfloat16" (ml_dtypes' dtype, installed with TF and JAX): raw int8, uint16 and float32
    records and gzip/zlib ones, read in order or gathered by a global shuffle, equal ml_dtypes'
    own cast of the records, bit for bit (the float32 values here round, ties included)."""
    import ml_dtypes

    plans = {
        "image": IMG,
        "label": LAB_GZ,
        "mask": FieldPlan("msk", "uint16", (3,), kind="zlib"),
        "x": FieldPlan("x", "float32", (2,)),
        "w": FieldPlan("w", "uint16", (4,)),
    }
    ds = build(tmp_path, [13, 0, 7, 21], plans)
    kw = {"shuffle": shuffle, "seed": 5} if shuffle else {}
    batches = list(ds.loader(8, cast="BFloat16", with_index=True, **kw))  # type: ignore[arg-type]
    assert all(b[n].dtype == np.dtype(ml_dtypes.bfloat16) for b in batches for n in ds.fields)
    check_batches(ds, batches, cast=dict.fromkeys(ds.fields, "bfloat16"))
    (one,) = list(ds.loader(41, cast={"x": "bfloat16"}))
    assert one["x"].dtype.name == "bfloat16" and one["image"].dtype == np.int8 and one["label"].dtype == np.float32


@pytest.mark.parametrize("shuffle", [False, "global"])
@pytest.mark.parametrize("cast", [None, "float32", "float16"])
def test_fields_stored_as_bfloat16_are_read_bit_for_bit(tmp_path: Path, shuffle: object, cast: str | None) -> None:
    """Records stored as bfloat16 (ml_dtypes' dtype): raw (with a header), gzip and zlib, in
    order or gathered by a global shuffle, kept as bfloat16 or cast as ml_dtypes casts."""
    import ml_dtypes

    plans = {
        "emb": FieldPlan("emb", "bfloat16", (5, 3), header=6),
        "logit": FieldPlan("lg", "bfloat16", (2,), kind="gzip"),
        "aux": FieldPlan("aux", "bfloat16", (), kind="zlib"),
        "label": LAB_GZ,
    }
    ds = build(tmp_path, [13, 0, 7, 21], plans)
    assert ds.fields["emb"].dtype == np.dtype(ml_dtypes.bfloat16) and ds.fields["emb"].record_bytes == 30
    kw = {"shuffle": shuffle, "seed": 5} if shuffle else {}
    casts = dict.fromkeys(("emb", "logit", "aux"), cast) if cast else {}
    batches = list(ds.loader(8, cast=casts or None, with_index=True, **kw))  # type: ignore[arg-type]
    check_batches(ds, batches, cast=casts)
    for b in batches:  # bit for bit: bfloat16 values compared as their bits
        want = np.stack([ref for ref in _raw_bf16(tmp_path, b["__group__"], b["__index__"])])
        got = b["emb"] if cast is None else b["emb"].astype(ml_dtypes.bfloat16)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def _raw_bf16(tmp_path: Path, groups: np.ndarray, index: np.ndarray) -> list[np.ndarray]:
    """The "emb" records at (group, index), read with numpy from the files themselves."""
    import ml_dtypes

    files = {g: np.fromfile(tmp_path / f"emb_{g:04d}.bin", np.uint8)[6:] for g in set(groups.tolist())}
    return [
        files[g][i * 30 : (i + 1) * 30].view(ml_dtypes.bfloat16).reshape(5, 3)
        for g, i in zip(groups.tolist(), index.tolist())
    ]


def test_reads_go_into_the_batch_s_own_memory_never_into_a_copy() -> None:
    import ml_dtypes

    from stoker.engine.buffers import bytes_of as _bytes_of

    batch = np.zeros((4, 3), ml_dtypes.bfloat16)  # a dtype numpy exports no buffer for
    _bytes_of(batch[1:3])[:2] = b"\x80\x3f"  # bfloat16 1.0, written through the view
    assert float(batch[1, 0]) == 1.0
    with pytest.raises(TypeError, match="C-contiguous"):
        _bytes_of(np.zeros((4, 3), np.float32)[:, :2])


def test_a_bfloat16_field_refuses_big_endian_naming_the_way_to_read_it() -> None:
    import ml_dtypes

    for dtype in ("bfloat16", "BFloat16", ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)):
        assert stoker.Field("x_*.bin", dtype, (4,)).record_bytes == 8
    with pytest.raises(stoker.SpecError, match=r"bfloat16' is read little-endian only.*dtype='>u2'"):
        stoker.Field("x_*.bin", "bfloat16", byte_order="big")


def test_big_endian_values_are_decoded_to_native(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(np.array([1, 256, -2], ">i4").tobytes())
    ds = stoker.Dataset(a=stoker.Field([str(tmp_path / "a.bin")], "int32", byte_order="big"))
    (b,) = list(ds.loader(3))
    assert b["a"].tolist() == [1, 256, -2]
    assert b["a"].dtype == np.dtype("=i4")


def test_scalar_field_gives_one_dimensional_arrays(pair_ds: stoker.Dataset) -> None:
    b = next(iter(pair_ds.loader(5)))
    assert b["label"].shape == (5,)
    assert b["image"].shape == (5, 6, 6, 1)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_output_is_identical_for_any_threads_and_prefetch(tmp_path: Path, threads: int) -> None:
    ds = build(tmp_path, [30, 0, 17, 45, 9], LAYOUTS["three-fields"])
    reference = [dict(b) for b in ds.loader(7, threads=1, prefetch=1, block_length=4, with_index=True)]
    check_batches(ds, reference)
    for prefetch in (1, 2, 5, 12):
        got = list(ds.loader(7, threads=threads, prefetch=prefetch, block_length=4, with_index=True))
        assert len(got) == len(reference)
        for a, b in zip(reference, got):
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype


def test_held_batches_are_distinct_and_stay_correct(tmp_path: Path) -> None:
    ds = build(tmp_path, [40, 40, 40], {"image": IMG, "label": LAB_GZ})
    batches = list(ds.loader(4, threads=4, prefetch=2, memory_budget="64KiB", with_index=True))
    gc.collect()
    check_batches(ds, batches)  # nothing overwritten while held
    arrays = [b[k] for b in batches for k in b]
    for i, a in enumerate(arrays):
        for b in arrays[i + 1 :]:
            assert not np.shares_memory(a, b)


def test_batches_are_plain_aligned_ndarrays(tmp_path: Path) -> None:
    ds = build(tmp_path, [9, 5], {"image": FieldPlan("img", "int8", (97, 97, 1)), "label": LAB_GZ})
    for cast in (None, "float32"):
        for b in ds.loader(3, cast=cast, with_index=True):
            for name, arr in b.items():
                assert type(arr) is np.ndarray, name
                assert not isinstance(arr, np.memmap)
                assert arr.ctypes.data % 64 == 0, name
                assert arr.flags.c_contiguous and arr.flags.writeable


def test_epochs_repeat_the_same_order_and_batches_never_span_epochs(pair_ds: stoker.Dataset) -> None:
    n = len(pair_ds)
    for drop in (False, True):
        loader = pair_ds.loader(10, epochs=3, drop_remainder=drop, with_index=True)
        per = n // 10 if drop else math.ceil(n / 10)
        assert len(loader) == per
        batches = list(loader)
        assert len(batches) == 3 * per
        epochs = [batches[e * per : (e + 1) * per] for e in range(3)]
        for e in epochs:
            assert sum(len(b["label"]) for b in e) == (per * 10 if drop else n)
            for a, b in zip(epochs[0], e):
                assert np.array_equal(a["__index__"], b["__index__"]) and np.array_equal(a["image"], b["image"])
        check_batches(pair_ds, batches, epochs=3, complete=not drop)


def test_epochs_none_repeats_forever(pair_ds: stoker.Dataset) -> None:
    n = len(pair_ds)
    per = math.ceil(n / 8)
    with pair_ds.loader(8, epochs=None, with_index=True) as loader:
        assert len(loader) == per
        batches = list(itertools.islice(loader, 4 * per + 1))
    check_batches(pair_ds, batches[: 4 * per], epochs=4)
    assert np.array_equal(batches[4 * per]["__index__"], batches[0]["__index__"])


def test_iterating_twice_gives_the_same_batches(pair_ds: stoker.Dataset) -> None:
    loader = pair_ds.loader(6, with_index=True)
    first = [b["__index__"].tolist() for b in loader]
    assert [b["__index__"].tolist() for b in loader] == first


# -- lifetime ---------------------------------------------------------------------------------


def _big(tmp_path: Path) -> stoker.Dataset:
    return build(tmp_path, [200] * 6, {"image": IMG, "label": LAB_GZ, "z": FieldPlan("zz", "int16", kind="zlib")})


def test_loader_is_a_context_manager_with_idempotent_close(tmp_path: Path) -> None:
    ds = _big(tmp_path)
    loader = ds.loader(4, threads=3)
    with loader as entered:
        assert entered is loader
        next(iter(loader))
    loader.close()
    loader.close()
    assert wait_no_stoker_threads() == []
    assert open_paths(tmp_path) == []
    with pytest.raises(stoker.SpecError):
        iter(loader)


def test_threads_start_at_first_next_not_at_loader_or_iter(tmp_path: Path) -> None:
    ds = _big(tmp_path)
    loader = ds.loader(4, threads=3)
    assert stoker_threads() == []
    it = iter(loader)
    assert stoker_threads() == []
    assert open_paths(tmp_path) == []
    next(it)
    assert stoker_threads()
    loader.close()


def test_breaking_out_early_leaves_no_thread_and_no_open_file(tmp_path: Path) -> None:
    ds = _big(tmp_path)
    loader = ds.loader(4, threads=4, prefetch=8, cycle_length=6, block_length=3)
    for k, _ in enumerate(loader):
        if k == 3:
            break
    assert wait_no_stoker_threads() == []
    assert open_paths(tmp_path) == []


def test_dropping_an_unfinished_iterator_leaves_no_thread_and_no_open_file(tmp_path: Path) -> None:
    ds = _big(tmp_path)
    loader = ds.loader(4, threads=4, cycle_length=6, block_length=3)
    it = iter(loader)
    next(it)
    next(it)
    del it
    gc.collect()
    assert wait_no_stoker_threads() == []
    assert open_paths(tmp_path) == []


def test_dropping_the_loader_mid_pass_leaves_nothing(tmp_path: Path) -> None:
    ds = _big(tmp_path)
    it = iter(ds.loader(4, threads=4, cycle_length=6, block_length=3))
    next(it)
    del it
    gc.collect()
    assert wait_no_stoker_threads() == []
    assert open_paths(tmp_path) == []


def test_a_finished_pass_leaves_no_open_file(tmp_path: Path) -> None:
    ds = _big(tmp_path)
    loader = ds.loader(64, threads=3)
    for _ in loader:
        pass
    assert wait_no_stoker_threads() == []
    assert open_paths(tmp_path) == []


def test_a_new_iter_closes_the_previous_pass(tmp_path: Path) -> None:
    ds = _big(tmp_path)
    loader = ds.loader(4, threads=2)
    it1 = iter(loader)
    next(it1)
    it2 = iter(loader)
    assert next(it2)["label"].shape == (4,)
    loader.close()


# -- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -1}, "batch_size"),
        ({"batch_size": 1.5}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"epochs": 0}, "epochs"),
        ({"epochs": -2}, "epochs"),
        ({"epochs": 1.0}, "epochs"),
        ({"cast": {"nope": "float32"}}, "nope"),
        ({"cast": "notadtype"}, "notadtype"),
        ({"cast": {"image": "complex64"}}, "image"),
        ({"cast": {"label": "U3"}}, "label"),
        ({"memory_budget": "1KiB"}, "memory_budget"),
        ({"memory_budget": 100}, "memory_budget"),
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"memory_budget": "0MiB"}, "memory_budget"),
        ({"memory_budget": "64KiB", "prefetch": 100}, "prefetch"),
        ({"prefetch": 0}, "prefetch"),
        ({"threads": 0}, "threads"),
        ({"threads": 2.0}, "threads"),
        ({"cycle_length": 0}, "cycle_length"),
        ({"block_length": -1}, "block_length"),
        ({"drop_remainder": 1}, "drop_remainder"),
        ({"with_index": "yes"}, "with_index"),
    ],
)
def test_bad_loader_arguments_raise_spec_error_at_loader(pair_ds: stoker.Dataset, kwargs: dict, needle: str) -> None:
    kwargs = {"batch_size": 256, **kwargs}
    bs = kwargs.pop("batch_size")
    with pytest.raises(stoker.SpecError, match=needle):
        pair_ds.loader(bs, **kwargs)


def test_memory_budget_counts_index_arrays_and_casts(pair_ds: stoker.Dataset) -> None:
    # 100 records: image 36 B + label 4 B = 4000 B; float32 cast of image: 144+4 -> 14800 B.
    pair_ds.loader(100, memory_budget=4000, prefetch=1)
    with pytest.raises(stoker.SpecError, match="memory_budget"):
        pair_ds.loader(100, memory_budget=4000, with_index=True)
    with pytest.raises(stoker.SpecError, match="memory_budget"):
        pair_ds.loader(100, memory_budget=14000, cast="float32")


# -- errors at their batch --------------------------------------------------------------------


def _position_of(seq: list[tuple[int, int]], group: int, index: int = 0) -> int:
    return seq.index((group, index))


def _deliver(loader) -> tuple[list[dict[str, np.ndarray]], BaseException | None]:
    return consume(loader)


COUNTS_E = [30, 25, 0, 40, 20]


@pytest.mark.parametrize("threads", [1, 4])
def test_gzip_count_mismatch_is_raised_at_the_batch_that_would_first_hold_the_group(
    tmp_path: Path, threads: int
) -> None:
    write_dataset(tmp_path, COUNTS_E, {"image": IMG, "label": LAB_GZ})
    bad = tmp_path / "out_0003.bin.gz"
    bad.write_bytes(gzip.compress(np.arange(41, dtype="<f4").tobytes()))  # 41 labels for 40 images
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"))  # fmt: skip
    bs = 7
    got, err = _deliver(ds.loader(bs, cycle_length=2, block_length=4, threads=threads, with_index=True))
    assert isinstance(err, stoker.PairingError)
    assert "img_0003.bin" in str(err) and "out_0003.bin.gz" in str(err) and "40" in str(err) and "41" in str(err)
    seq = tf_interleave(COUNTS_E, 2, 4)
    assert len(got) == _position_of(seq, 3) // bs
    check_batches(ds, got, complete=False)
    assert not any(3 in b["__group__"] for b in got)


@pytest.mark.parametrize("threads", [1, 4])
def test_zlib_count_mismatch_is_raised_at_the_batch_that_would_first_hold_the_group(
    tmp_path: Path, threads: int
) -> None:
    write_dataset(tmp_path, COUNTS_E, {"image": IMG, "label": FieldPlan("out", "float32", kind="zlib")})
    (tmp_path / "out_0004.bin.zz").write_bytes(zlib.compress(np.arange(19, dtype="<f4").tobytes()))
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.zz"), "float32"))  # fmt: skip
    bs = 9
    got, err = _deliver(ds.loader(bs, cycle_length=2, block_length=4, threads=threads, with_index=True))
    assert isinstance(err, stoker.PairingError)
    assert "out_0004.bin.zz" in str(err) and "19" in str(err) and "20" in str(err)
    assert len(got) == _position_of(tf_interleave(COUNTS_E, 2, 4), 4) // bs
    check_batches(ds, got, complete=False)


@pytest.mark.parametrize("threads", [1, 4])
def test_truncated_gzip_fails_naming_the_file_no_later_than_the_first_missing_record(
    tmp_path: Path, threads: int
) -> None:
    # The cut-off trailer disagrees with the images: the count is settled (and fails) when the group opens.
    write_dataset(tmp_path, COUNTS_E, {"image": IMG, "label": LAB_GZ})
    bad = tmp_path / "out_0003.bin.gz"
    whole = gzip.compress(np.arange(40, dtype="<f4").tobytes(), compresslevel=0)  # stored: a prefix survives
    bad.write_bytes(whole[: len(whole) // 2])
    available = len(zlib.decompressobj(31).decompress(whole[: len(whole) // 2])) // 4
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"))  # fmt: skip
    bs = 7
    got, err = _deliver(ds.loader(bs, cycle_length=2, block_length=4, threads=threads, with_index=True))
    assert isinstance(err, stoker.CorruptDataError)
    assert str(bad) in str(err) and err.path == str(bad)
    seq = tf_interleave(COUNTS_E, 2, 4)
    assert _position_of(seq, 3) // bs <= len(got) <= _position_of(seq, 3, available) // bs
    _check_good_rows(tmp_path, got, bad_group=3, bad_labels=np.arange(40, dtype="<f4")[:available])


def _check_good_rows(tmp: Path, got, *, bad_group: int, bad_labels: np.ndarray) -> None:
    """Delivered rows equal the files (the damaged file: its intact prefix)."""
    for b in got:
        for g, i, img, lab in zip(b["__group__"], b["__index__"], b["image"], b["label"]):
            want_img = read_records(tmp / f"img_{g:04d}.bin", stoker.Field("x", "int8", (6, 6, 1)))[i]
            assert np.array_equal(img, want_img)
            if g == bad_group:
                assert i < len(bad_labels) and lab == bad_labels[i]
            else:
                want = read_records(tmp / f"out_{g:04d}.bin.gz", stoker.Field("x", "float32"))[i]
                assert lab == want


def test_truncated_gzip_with_a_trusted_count_yields_none_of_its_group(
    tmp_path: Path,
) -> None:
    # The truncated file's last 4 bytes happen to read as the right ISIZE: the count is trusted.
    write_dataset(tmp_path, [30, 40], {"image": IMG, "label": LAB_GZ})
    bad = tmp_path / "out_0001.bin.gz"
    whole = gzip.compress(np.arange(40, dtype="<f4").tobytes(), compresslevel=0)
    cut = whole[: len(whole) // 2] + (160).to_bytes(4, "little")
    bad.write_bytes(cut)
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"))  # fmt: skip
    assert ds.records_in(1) == 40  # the trailer agrees with the images: trusted, nothing decompressed
    bs = 5
    got, err = _deliver(ds.loader(bs, cycle_length=2, block_length=3, with_index=True, threads=2))
    assert isinstance(err, stoker.CorruptDataError) and str(bad) in str(err)
    # A stream cut before its end cannot be verified (bytes after the cut decode as data no CRC
    # covers: here the fake trailer becomes a label), so none of its records is yielded.
    assert len(got) == _position_of(tf_interleave([30, 40], 2, 3), 1) // bs
    assert err.index == len(zlib.decompressobj(31).decompress(cut)) // 4
    _check_good_rows(tmp_path, got, bad_group=1, bad_labels=np.arange(0, dtype="<f4"))


@pytest.mark.parametrize("threads", [1, 4])
def test_trailing_garbage_after_gzip_fails_naming_the_file_after_good_batches(tmp_path: Path, threads: int) -> None:
    write_dataset(tmp_path, COUNTS_E, {"image": IMG, "label": LAB_GZ})
    bad = tmp_path / "out_0001.bin.gz"
    bad.write_bytes(gzip.compress(np.arange(30, 55, dtype="<f4").tobytes()) + b"this is not gzip")
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"))  # fmt: skip
    bs = 6
    got, err = _deliver(ds.loader(bs, cycle_length=2, block_length=4, threads=threads, with_index=True))
    assert isinstance(err, stoker.CorruptDataError)
    assert str(bad) in str(err) and err.path == str(bad)
    seq = tf_interleave(COUNTS_E, 2, 4)
    assert _position_of(seq, 1) // bs <= len(got) <= _position_of(seq, 1, 24) // bs
    _check_good_rows(tmp_path, got, bad_group=1, bad_labels=np.arange(30, 55, dtype="<f4"))


@pytest.mark.parametrize("flip", [1 / 3, 1 / 2, 2 / 3])
def test_bit_flip_in_gzip_yields_nothing_wrong_and_names_the_file(tmp_path: Path, flip: float) -> None:
    n = 20000
    img = np.zeros((n, 4), np.uint8)
    img[:] = np.arange(n, dtype="<u4").view(np.uint8).reshape(n, 4)
    (tmp_path / "img_0.bin").write_bytes(img.tobytes())
    comp = bytearray(gzip.compress(np.arange(n, dtype="<f4").tobytes(), compresslevel=6))
    comp[int(len(comp) * flip)] ^= 0x01
    bad = tmp_path / "out_0.bin.gz"
    bad.write_bytes(bytes(comp))
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "uint8", (4,)),
                        label=stoker.Field(str(bad), "float32"))  # fmt: skip
    got, err = _deliver(ds.loader(1000, threads=2))
    assert isinstance(err, stoker.CorruptDataError)
    assert str(bad) in str(err) and err.path == str(bad)
    wrong = [k for k, b in enumerate(got) if not np.array_equal(b["label"], b["image"].view("<u4")[:, 0])]
    assert wrong == [], f"batches {wrong} were yielded with labels that are not in the file"


SHORT = [3, 9, 5, 7, 4, 8, 6, 3, 9, 5, 7, 4] * 3  # groups of a few records: batches of many runs


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cast", [None, {"image": "float32"}, "float32", "float16"])
@pytest.mark.parametrize("shard", [(0, 1), (1, 2)])
def test_batches_of_many_short_runs_hold_every_record_of_every_field(tmp_path: Path, threads, cast, shard) -> None:
    # Each batch reads each raw field of ~6 files in one kernel call (see Assembler._read_raws):
    # uncast runs by preadv on a file's first visit and from its kept map in later epochs,
    # cast runs from the map; a second shard's runs take every other record (step 2).
    ds = build(tmp_path, SHORT, {"image": IMG, "wide": FieldPlan("wide", "int16", (8, 8)), "label": LAB_GZ})
    loader = ds.loader(32, epochs=3, cast=cast, shard=shard, with_index=True, threads=threads, cycle_length=1)
    batches = list(loader)
    assert max(len(np.unique(b["__group__"])) for b in batches) >= 5
    seq = check_batches(ds, batches, cast={n: cast for n in ds.fields} if isinstance(cast, str) else cast,
                        complete=False)  # fmt: skip
    records = [(g, i) for g, n in enumerate(SHORT) for i in range(n)]
    assert sorted(seq) == sorted(records[shard[0] :: shard[1]] * 3)  # the shard's records, each once an epoch
    assert wait_no_stoker_threads() == []
    assert open_paths(tmp_path) == []
    # A file is closed once its last run is read: with the pass still open, none is left.
    with ds.loader(32, cast=cast, shard=shard, threads=threads, cycle_length=1) as one:
        it = iter(one)
        assert len([next(it) for _ in range(len(one))]) == len(one)
        assert open_paths(tmp_path) == []


def test_a_file_cut_short_among_many_short_runs_fails_naming_it(tmp_path: Path) -> None:
    write_dataset(tmp_path, SHORT, {"image": IMG, "label": LAB_GZ})
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"))  # fmt: skip
    bad = tmp_path / "img_0005.bin"
    os.truncate(bad, 36 * 6)  # 2 of its 8 records gone
    for cast in (None, "float32"):
        got, err = _deliver(ds.loader(32, epochs=2, cast=cast, with_index=True, cycle_length=1, threads=2))
        assert isinstance(err, stoker.CorruptDataError)
        assert str(bad) in str(err) and err.path == str(bad) and err.index == 6
        assert len(got) == (sum(SHORT[:5]) + 6) // 32  # every batch before the one holding record 6
        check_batches(ds, got, cast={"image": cast, "label": cast} if cast else None, complete=False)


@pytest.mark.parametrize("cast", [None, "float32"])
def test_raw_file_truncated_after_dataset_fails_naming_the_file(tmp_path: Path, cast) -> None:
    write_dataset(tmp_path, COUNTS_E, {"image": IMG, "label": LAB_GZ})
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"))  # fmt: skip
    bad = tmp_path / "img_0003.bin"
    os.truncate(bad, 36 * 10)
    bs = 7
    got, err = _deliver(ds.loader(bs, cycle_length=2, block_length=4, cast=cast, with_index=True, threads=3))
    assert isinstance(err, stoker.CorruptDataError)
    assert str(bad) in str(err) and err.path == str(bad)
    # Its first 10 records are still there: the error comes at the batch holding record 10.
    assert len(got) == _position_of(tf_interleave(COUNTS_E, 2, 4), 3, 10) // bs
    assert err.index == 10
    check_batches(ds, got, cast={"image": cast, "label": cast} if cast else None, complete=False)


def test_raw_file_truncated_during_a_pass_fails_naming_the_file(tmp_path: Path) -> None:
    write_dataset(tmp_path, [400], {"image": IMG})
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)))
    good = read_records(tmp_path / "img_0000.bin", ds.fields["image"]).copy()
    loader = ds.loader(10, threads=1, prefetch=1, with_index=True)
    it = iter(loader)
    first = next(it)
    os.truncate(tmp_path / "img_0000.bin", 36 * 50)
    got, err = _deliver(it)
    assert isinstance(err, stoker.CorruptDataError)
    assert "img_0000.bin" in str(err)
    for b in [first, *got]:
        assert np.array_equal(b["image"], good[b["__index__"]])
    assert wait_no_stoker_threads() == []


# -- tf.data as a differential reference ------------------------------------------------------


@pytest.mark.tf
@pytest.mark.slow
def test_same_bytes_as_tf_data_fixed_length_records_with_gzip_labels(tmp_path: Path) -> None:
    import tensorflow as tf

    inrez = 16
    stoker.write_sample(tmp_path, pairs=5, records=37, inrez=inrez)
    os.truncate(tmp_path / "img_0002.bin", 0)  # an empty group
    (tmp_path / "out_0002.bin.gz").write_bytes(gzip.compress(b""))
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (inrez, inrez, 1)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32", compression="gzip"),
    )
    imgs = [g.paths["image"] for g in ds.groups]
    labs = [g.paths["label"] for g in ds.groups]
    for bs, cycle, block in [(16, None, None), (10, 2, 3), (7, 8, 5), (64, 1, 1)]:
        loader = ds.loader(bs, cycle_length=cycle, block_length=block, threads=2)

        def per_group(i, o):
            a = tf.data.FixedLengthRecordDataset(i, inrez * inrez)
            b = tf.data.FixedLengthRecordDataset(o, 4, compression_type="GZIP")
            return tf.data.Dataset.zip((a, b))

        ref = (
            tf.data.Dataset.from_tensor_slices((imgs, labs))
            .interleave(per_group, cycle_length=loader.cycle_length, block_length=loader.block_length)
            .batch(bs)
        )
        got = list(loader)
        want = list(ref.as_numpy_iterator())
        assert len(got) == len(want)
        for b, (img_bytes, lab_bytes) in zip(got, want):
            assert b["image"].tobytes() == b"".join(img_bytes)
            assert b["label"].tobytes() == b"".join(lab_bytes)


def test_the_next_pass_starts_on_the_batch_buffers_of_the_last(tmp_path: Path) -> None:
    """A pass per epoch reuses the loader's buffers (no fresh pages each epoch); a new allocator replaces them."""
    from stoker.engine.executor import AlignedPool

    ds = _big(tmp_path)
    made: list[list[int]] = [[], []]

    def counting(k: int) -> Any:
        class Counting(AlignedPool):
            def _new_region(self, nbytes: int) -> object:
                made[k].append(nbytes)
                return super()._new_region(nbytes)

        return lambda pooled: Counting(pooled)

    loader = ds.loader(4, threads=2, prefetch=3, cast="float32")
    loader.use_allocator(counting(0))
    expected = [{k: v.copy() for k, v in b.items()} for b in loader]
    first = len(made[0])
    assert 0 < first <= 3 * (3 + 2 + 2)  # three fields: a window of batches, the workers', the consumer's
    for _ in range(3):
        for got, want in zip(loader, expected, strict=True):
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])
    assert len(made[0]) == first  # every later pass ran on the first pass's buffers
    loader.use_allocator(counting(1))  # as an adapter asking for pinned memory does
    assert len(list(loader)) == len(expected) and made[1] and len(made[0]) == first
    loader.close()


def test_a_thread_climb_not_finished_in_a_pass_goes_on_in_the_next(tmp_path: Path) -> None:
    """The next pass continues autotune's climb (a new one would start from a trial count)."""
    ds = _big(tmp_path)
    loader = ds.loader(4, cast="float32")  # threads chosen by measuring
    first = iter(loader)
    next(first)  # the climb is still in its start-up window
    climb = loader.autotune.climb
    assert climb is not None and not climb.done
    second = iter(loader)  # closes the first pass
    next(second)
    assert loader.autotune.climb is climb and second._tuner is climb  # type: ignore[attr-defined]
    assert loader._pipeline.executor.threads == climb.threads  # type: ignore[attr-defined]
    loader.close()
    assert wait_no_stoker_threads() == []


def test_loader_config_checks_its_arguments_once_and_is_frozen(tmp_path: Path) -> None:
    """LoaderConfig holds the checks Loader made of its arguments: the same errors, counts as
    plain ints, and no field changed after it is built."""
    import dataclasses

    from stoker.loader import LoaderConfig

    config = LoaderConfig(batch_size=np.int64(4), epochs=None, shuffle=None, seed=np.int64(3), shard=[1, 2])
    assert (config.batch_size, config.epochs, config.shuffle, config.seed, config.shard) == (4, None, False, 3, (1, 2))
    assert type(config.batch_size) is int and type(config.seed) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 8  # type: ignore[misc]
    for kw, message in [
        ({"batch_size": 0}, "batch_size=0 must be a positive integer"),
        ({"batch_size": 2, "threads": True}, "threads=True must be a positive integer or None"),
        ({"batch_size": 2, "pad_last": True, "drop_remainder": True}, "choose one"),
        ({"batch_size": 2, "shuffle": "files"}, "needs seed= a non-negative integer"),
        ({"batch_size": 2, "workers": "fork"}, "workers='fork' must be 'thread' or 'process'"),
        ({"batch_size": 2, "workers": "process"}, "none was given"),
        ({"batch_size": 2, "even": 1}, "even=1 must be True or False"),
        ({"batch_size": 2, "memory_budget": "lots"}, "memory_budget"),
        ({"batch_size": 2, "num_parallel_reads": -1}, "num_parallel_reads=-1 must be a positive integer or None"),
    ]:
        with pytest.raises(stoker.SpecError, match=message):
            LoaderConfig(**kw)  # type: ignore[arg-type]
    ds = build(tmp_path, [5, 3], {"image": IMG})
    with ds.loader(2, window=3, threads=1) as loader:
        assert loader.config == LoaderConfig(batch_size=2, window=3, threads=1)
        with pytest.raises(stoker.SpecError, match="window=0 must be a positive integer"):
            ds.loader(2, window=0)


def test_an_executor_of_ones_own_runs_the_passes_through_the_protocol_alone(tmp_path: Path) -> None:
    """A custom Executor (not a ThreadExecutor) says what the loader needs: `threads`, whether
    autotune may resize it, and it sets the stop flag the loader gives when its map closes."""
    from stoker.engine.executor import StopFlag, ThreadExecutor

    class Recording:
        resizable = False

        def __init__(self) -> None:
            self.threads = 2
            self.stops: list[StopFlag | None] = []

        def map_ordered(self, fn: Any, tasks: Any, *, window: int, defer_wake: bool = False, stop: Any = None) -> Any:
            self.stops.append(stop)
            return ThreadExecutor(self.threads, name="stoker-worker").map_ordered(
                fn, tasks, window=window, defer_wake=defer_wake, stop=stop
            )

    ds = build(tmp_path, [13, 7, 21], {"image": IMG, "label": LAB_GZ})
    executor = Recording()
    from stoker.loader import Loader, LoaderConfig

    with Loader(ds, LoaderConfig(batch_size=4, executor=executor, with_index=True)) as loader:
        check_batches(ds, list(loader), epochs=1)
        it = iter(loader)
        next(it)
        assert executor.threads == 2 and len(executor.stops) == 2
        assert executor.stops[0] is not None and executor.stops[0].is_set()  # the first pass closed its map
        assert executor.stops[1] is not None and not executor.stops[1].is_set()
        # One flag: a worker waiting for its turn on a stream wakes when the map closes.
        assert it._batches.stop is executor.stops[1] and it._assembler.stop is executor.stops[1]  # type: ignore[attr-defined]
        it.close()  # type: ignore[attr-defined]
        assert executor.stops[1].is_set()
    assert wait_no_stoker_threads() == []
