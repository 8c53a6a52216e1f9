"""Globs, pairing of files into groups, compression detection and record counts."""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

import stoker
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, build, check_batches, write_dataset
from tests.helpers.resources import consume


def _raw(path: Path, n: int, record: int = 4) -> Path:
    path.write_bytes(bytes(range(256)) * (n * record // 256) + bytes(n * record % 256))
    return path


def test_glob_matches_are_sorted_by_code_point(tmp_path: Path) -> None:
    names = ["b_2.bin", "B_1.bin", "a_10.bin", "a_9.bin", "_0.bin"]
    for name in names:
        _raw(tmp_path / name, 3)
    ds = stoker.Dataset(x=stoker.Field(str(tmp_path / "*.bin"), "int32"))
    got = [os.path.basename(g.paths["x"]) for g in ds.groups]
    assert got == sorted(names)  # code point: 'B' < '_' < 'a' < 'b'; '10' < '9'


def test_explicit_list_keeps_its_order(tmp_path: Path) -> None:
    paths = [str(_raw(tmp_path / f"f_{i}.bin", i + 1)) for i in (2, 0, 1)]
    ds = stoker.Dataset(x=stoker.Field(paths, "int32"))
    assert [g.paths["x"] for g in ds.groups] == paths
    assert [g.records for g in ds.groups] == [3, 1, 2]
    assert [g.index for g in ds.groups] == [0, 1, 2]


def test_list_of_globs_concatenates_each_sorted(tmp_path: Path) -> None:
    for name in ["b_1.bin", "b_0.bin", "a_1.bin", "a_0.bin"]:
        _raw(tmp_path / name, 1)
    ds = stoker.Dataset(x=stoker.Field([str(tmp_path / "b_*.bin"), str(tmp_path / "a_*.bin")], "int32"))
    assert [os.path.basename(g.paths["x"]) for g in ds.groups] == ["b_0.bin", "b_1.bin", "a_0.bin", "a_1.bin"]


def test_group_i_is_the_ith_file_of_every_field(tmp_path: Path) -> None:
    ds = build(tmp_path, [4, 5, 6], {"image": IMG, "label": LAB_GZ})
    assert len(ds.groups) == 3
    for g in ds.groups:
        assert os.path.basename(g.paths["image"]) == f"img_{g.index:04d}.bin"
        assert os.path.basename(g.paths["label"]) == f"out_{g.index:04d}.bin.gz"
    assert [g.records for g in ds.groups] == [4, 5, 6]
    assert isinstance(ds.groups[0], stoker.Group)


def test_numbers_agree_despite_zero_padding(tmp_path: Path) -> None:
    _raw(tmp_path / "img_0007.bin", 2)
    (tmp_path / "out_7.bin.gz").write_bytes(gzip.compress(bytes(8)))
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int32"),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
    )
    assert len(ds) == 2


def test_disagreeing_numbers_raise_pairing_error_naming_both_files(tmp_path: Path) -> None:
    _raw(tmp_path / "img_0007.bin", 2)
    (tmp_path / "out_0008.bin.gz").write_bytes(gzip.compress(bytes(8)))
    with pytest.raises(stoker.PairingError) as info:
        stoker.Dataset(
            image=stoker.Field(str(tmp_path / "img_*.bin"), "int32"),
            label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
        )
    msg = str(info.value)
    assert "img_0007.bin" in msg and "out_0008.bin.gz" in msg
    assert "pair_key" in msg
    assert info.value.path is not None and info.value.path.endswith("out_0008.bin.gz")


def test_pair_key_empty_string_disables_the_check(tmp_path: Path) -> None:
    _raw(tmp_path / "img_0007.bin", 2)
    (tmp_path / "out_0008.bin.gz").write_bytes(gzip.compress(bytes(8)))
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int32"),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
        pair_key="",
    )
    assert len(ds) == 2


def test_pair_key_regex_chooses_what_must_agree(tmp_path: Path) -> None:
    # Numbers disagree in the run id, agree in the shard: default fails, pair_key passes.
    _raw(tmp_path / "run1_shard_03.bin", 1)
    _raw(tmp_path / "run2_shard_03.lab", 1)
    fields = {
        "a": stoker.Field(str(tmp_path / "*.bin"), "int32"),
        "b": stoker.Field(str(tmp_path / "*.lab"), "int32"),
    }
    with pytest.raises(stoker.PairingError):
        stoker.Dataset(fields)
    assert len(stoker.Dataset(fields, pair_key=r"shard_(\d+)")) == 1
    with pytest.raises(stoker.PairingError, match="run1_shard_03.bin"):
        stoker.Dataset(fields, pair_key=r"run(\d)")


def test_pair_key_that_does_not_match_a_basename_names_the_file(tmp_path: Path) -> None:
    _raw(tmp_path / "a_1.bin", 1)
    _raw(tmp_path / "b_1.lab", 1)
    with pytest.raises(stoker.PairingError, match="a_1.bin"):
        stoker.Dataset(
            a=stoker.Field(str(tmp_path / "*.bin"), "int32"),
            b=stoker.Field(str(tmp_path / "*.lab"), "int32"),
            pair_key=r"zzz(\d+)",
        )


def test_different_file_counts_per_field_raise_pairing_error(tmp_path: Path) -> None:
    write_dataset(tmp_path, [2, 2, 2], {"image": IMG})
    write_dataset(tmp_path, [2, 2], {"label": LAB_GZ})
    with pytest.raises(stoker.PairingError, match="different numbers of files") as info:
        stoker.Dataset(
            image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
            label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
        )
    assert "3 files" in str(info.value) and "2 files" in str(info.value)


def test_raw_record_count_mismatch_is_raised_at_dataset_naming_files_and_counts(tmp_path: Path) -> None:
    a = FieldPlan("a", "int16", (3,))
    b = FieldPlan("b", "uint8", (5,))
    write_dataset(tmp_path, [4, 6], {"a": a})
    write_dataset(tmp_path, [4, 7], {"b": b})
    with pytest.raises(stoker.PairingError) as info:
        stoker.Dataset(
            a=stoker.Field(str(tmp_path / "a_*.bin"), "int16", (3,)),
            b=stoker.Field(str(tmp_path / "b_*.bin"), "uint8", (5,)),
        )
    msg = str(info.value)
    assert "a_0001.bin" in msg and "b_0001.bin" in msg
    assert "6 records" in msg and "7 records" in msg
    assert "group 1" in msg


def test_raw_body_not_a_multiple_of_record_size_is_corrupt_naming_file_size_and_record(tmp_path: Path) -> None:
    p = tmp_path / "x_0.bin"
    p.write_bytes(bytes(3 + 10 * 12 + 5 + 7))  # header 3, 10 records of 12, footer 7, 5 extra bytes
    with pytest.raises(stoker.CorruptDataError) as info:
        stoker.Dataset(x=stoker.Field(str(p), "int32", (3,), header_bytes=3, footer_bytes=7))
    msg = str(info.value)
    assert str(p) in msg and "12-byte" in msg and str(3 + 10 * 12 + 5 + 7) in msg
    assert info.value.path == str(p)
    assert info.value.index == 10
    assert info.value.offset == 3 + 120


def test_raw_file_smaller_than_header_plus_footer_is_corrupt(tmp_path: Path) -> None:
    p = tmp_path / "x.bin"
    p.write_bytes(bytes(5))
    with pytest.raises(stoker.CorruptDataError, match="x.bin"):
        stoker.Dataset(x=stoker.Field(str(p), "int8", header_bytes=4, footer_bytes=4))


def test_missing_file_is_spec_error_naming_it(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(stoker.SpecError, match="nope.bin") as info:
        stoker.Dataset(x=stoker.Field([missing], "int8"))
    assert info.value.path == missing


def test_empty_glob_is_spec_error_naming_the_pattern(tmp_path: Path) -> None:
    pattern = str(tmp_path / "none_*.bin")
    with pytest.raises(stoker.SpecError, match="matched no file") as info:
        stoker.Dataset(x=stoker.Field(pattern, "int8"))
    assert pattern in str(info.value)


def test_directory_instead_of_file_is_spec_error(tmp_path: Path) -> None:
    (tmp_path / "d.bin").mkdir()
    with pytest.raises(stoker.SpecError, match="directory"):
        stoker.Dataset(x=stoker.Field([str(tmp_path / "d.bin")], "int8"))


@pytest.mark.parametrize(
    ("name", "data", "kind"),
    [
        ("a.bin.gz", gzip.compress(bytes(8)), "gzip"),
        ("a.gzip", gzip.compress(bytes(8)), "gzip"),
        ("a.GZ", gzip.compress(bytes(8)), "gzip"),
        ("a.zz", zlib.compress(bytes(8)), "zlib"),
        ("a.zlib", zlib.compress(bytes(8)), "zlib"),
        ("a.bin", bytes(8), None),
        ("a.dat", gzip.compress(bytes(8)), "gzip"),  # magic bytes, no suffix
    ],
    ids=["a.bin.gz", "a.gzip", "a.GZ", "a.zz", "a.zlib", "a.bin", "a.dat-gzip-magic"],  # gzip bytes hold a time
)
def test_auto_compression_by_suffix_and_magic(tmp_path: Path, name: str, data: bytes, kind: str | None) -> None:
    (tmp_path / name).write_bytes(data)
    ds = stoker.Dataset(x=stoker.Field([str(tmp_path / name)], "float32"))
    assert ds.files[0]["x"].compression == kind
    assert len(ds) == 2


def test_compression_none_reads_a_gz_named_file_as_raw(tmp_path: Path) -> None:
    (tmp_path / "a.bin.gz").write_bytes(bytes(12))
    ds = stoker.Dataset(x=stoker.Field([str(tmp_path / "a.bin.gz")], "float32", compression=None))
    assert ds.files[0]["x"].compression is None
    assert len(ds) == 3


def test_declared_gzip_without_magic_is_corrupt_naming_file(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(bytes(12))
    with pytest.raises(stoker.CorruptDataError, match="a.bin"):
        stoker.Dataset(x=stoker.Field([str(tmp_path / "a.bin")], "float32", compression="gzip"))


def test_declared_zlib_without_header_is_corrupt_naming_file(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"\xff" * 12)
    with pytest.raises(stoker.CorruptDataError, match="a.bin"):
        stoker.Dataset(x=stoker.Field([str(tmp_path / "a.bin")], "float32", compression="zlib"))


@pytest.mark.parametrize("suffix", [".gz", ".zz"])
def test_empty_compressed_file_is_corrupt_naming_file(tmp_path: Path, suffix: str) -> None:
    (tmp_path / f"a{suffix}").write_bytes(b"")
    with pytest.raises(stoker.CorruptDataError, match=f"a\\{suffix}"):
        stoker.Dataset(x=stoker.Field([str(tmp_path / f"a{suffix}")], "float32"))


def test_building_a_dataset_decompresses_nothing_when_trailers_agree(tmp_path: Path, monkeypatch) -> None:
    ds_paths = write_dataset(tmp_path, [5, 6], {"image": IMG, "label": LAB_GZ})
    import stoker.io.files as files

    def fail(*a, **k):
        raise AssertionError("decompressed while building the Dataset")

    monkeypatch.setattr(files, "decompressed_size", fail)
    ds = stoker.Dataset(
        image=stoker.Field([str(p) for p in ds_paths["image"]], "int8", (6, 6, 1)),
        label=stoker.Field([str(p) for p in ds_paths["label"]], "float32"),
    )
    assert len(ds) == 11  # trailers agree with the raw counts: still nothing decompressed


def test_gzip_trailer_disagreeing_is_settled_by_decompressing(tmp_path: Path) -> None:
    write_dataset(tmp_path, [5], {"image": IMG})
    body = np.arange(5, dtype="<f4").tobytes()
    data = bytearray(gzip.compress(body))
    data[-4:] = (999).to_bytes(4, "little")  # wrong ISIZE, right CRC and data
    (tmp_path / "out_0000.bin.gz").write_bytes(bytes(data))
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
    )
    with pytest.raises(stoker.CorruptDataError, match="out_0000.bin.gz"):
        # a wrong ISIZE is a corrupt trailer: reading it through must fail naming the file
        list(ds.loader(2))


def test_compressed_count_mismatch_is_raised_when_the_group_opens(tmp_path: Path) -> None:
    write_dataset(tmp_path, [4, 5], {"image": IMG})
    (tmp_path / "out_0000.bin.gz").write_bytes(gzip.compress(np.arange(4, dtype="<f4").tobytes()))
    (tmp_path / "out_0001.bin.gz").write_bytes(gzip.compress(np.arange(6, dtype="<f4").tobytes()))
    ds = stoker.Dataset(  # no error yet: counts of compressed files settle lazily
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"),
    )
    assert ds.records_in(0) == 4
    with pytest.raises(stoker.PairingError) as info:
        ds.records_in(1)
    msg = str(info.value)
    assert "img_0001.bin" in msg and "out_0001.bin.gz" in msg and "5 records" in msg and "6 records" in msg


def test_multi_member_gzip_is_counted_by_decompressing(tmp_path: Path) -> None:
    ds = build(tmp_path, [9, 4], {"image": IMG, "label": FieldPlan("out", "float32", kind="multi")})
    assert [g.records for g in ds.groups] == [9, 4]


def test_multi_member_gzip_alone_is_counted_by_decompressing(tmp_path: Path) -> None:
    # No raw field to disagree with: the last member's ISIZE must not be taken as the count.
    ds = build(tmp_path, [9, 12], {"label": FieldPlan("out", "float32", kind="multi")})
    assert [g.records for g in ds.groups] == [9, 12]
    assert len(ds) == 21


def test_two_multi_member_gzip_fields_are_counted_by_decompressing(tmp_path: Path) -> None:
    ds = build(tmp_path, [9], {"a": FieldPlan("a", "float32", kind="multi"),
                               "b": FieldPlan("b", "int32", kind="multi")})  # fmt: skip
    assert len(ds) == 9


def test_zlib_counts_settle_when_the_group_opens(tmp_path: Path) -> None:
    ds = build(tmp_path, [3, 0, 8], {"image": IMG, "label": FieldPlan("out", "float32", kind="zlib")})
    assert ds.files[0]["label"].compression == "zlib"
    assert [ds.records_in(g) for g in range(3)] == [3, 0, 8]


def test_records_in_out_of_range_raises_index_error(pair_ds: stoker.Dataset) -> None:
    with pytest.raises(IndexError):
        pair_ds.records_in(pair_ds.num_groups)


# -- groups of gzip fields only: counted by their trailers when provably single members -------


def _member(data: bytes, **kw: int) -> bytes:
    return gzip.compress(data, compresslevel=1, mtime=0, **kw)


def _proved(path: Path) -> bool:
    from stoker.io.files import one_gzip_member

    return one_gzip_member(str(path), path.stat().st_size)


def test_one_gzip_member_is_proved_by_the_absence_of_a_second_member_header(tmp_path: Path) -> None:
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    cases = {
        "one": (_member(noise), True),
        "padded": (_member(noise) + bytes(5), True),  # one member; its zero trailer is refused elsewhere
        "two": (_member(b"a" * 1000) + _member(b"b" * 1000), False),
        "empty-after": (_member(noise) + _member(b""), False),
        "empty-before": (_member(b"") + _member(noise), False),
        # The magic with a header gzip(1) never writes (XFL 7): not a member the scan counts.
        "fake": (_member(b"z" * 100) + b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x07\x03" + bytes(8), True),
        "cut-header": (_member(b"z" * 100) + b"\x1f\x8b\x08\x00", False),  # too short to judge: not proved
        "tiny": (b"\x1f\x8b\x08" + bytes(10), False),
    }
    for name, (data, want) in cases.items():
        p = tmp_path / f"{name}.gz"
        p.write_bytes(data)
        assert _proved(p) is want, name
    assert not __import__("stoker.io.files").io.files.one_gzip_member("s3://bucket/one.gz", 1 << 20)  # never remote


def test_a_second_member_header_cut_by_the_scan_chunk_boundary_is_still_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stoker.io import files

    first = _member(bytes(range(256)) * 20)
    p = tmp_path / "cut.gz"
    p.write_bytes(first + _member(b"y" * 100))
    for chunk in range(len(first) - 12, len(first) + 12):  # the magic or its header across the boundary
        monkeypatch.setattr(files, "_SCAN_CHUNK", chunk)
        assert not _proved(p), chunk
    q = tmp_path / "one.gz"
    q.write_bytes(first)
    for chunk in (1, 2, 9, 10, 11, 64):
        monkeypatch.setattr(files, "_SCAN_CHUNK", chunk)
        assert _proved(q), chunk


IMG_GZ = FieldPlan("img", "int8", (6, 6, 1), kind="gzip")


def _decompressions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from stoker.io import files

    made: list[str] = []
    original = files.decompressed_size

    def counting(path: str, *a: object, **kw: object) -> int:
        made.append(os.path.basename(path))
        return original(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(files, "decompressed_size", counting)
    return made


@pytest.mark.parametrize(
    ("plans", "why"),
    [
        ({"image": IMG_GZ}, "one gzip field: nothing to agree with"),
        ({"image": IMG_GZ, "label": FieldPlan("out", "float32", kind="zlib")}, "zlib has no trailer"),
        ({"image": IMG_GZ, "label": FieldPlan("out", "float32", kind="multi")}, "a multi-member field"),
        ({"image": IMG_GZ, "label": FieldPlan("out", "float32", kind="gzip-empty")}, "an empty member follows"),
        ({"image": IMG_GZ.__class__("img", "int8", (6, 6, 1), kind="gzip", pad=6),
          "label": FieldPlan("out", "float32", kind="gzip", pad=6)}, "zero padding: trailers of 0"),
        ({"image": IMG_GZ, "label": FieldPlan("out", "float32", kind="gzip", pad=1)}, "trailers disagree"),
    ],
)  # fmt: skip
def test_gzip_only_groups_the_rule_cannot_prove_are_counted_by_decompressing_and_read_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plans: dict[str, FieldPlan], why: str
) -> None:
    made = _decompressions(monkeypatch)
    ds = build(tmp_path, [9, 4, 0], plans)
    assert [g.records for g in ds.groups] == [9, 4, 0], why
    assert len(made) == 3 * len(plans), why  # every file of every group inflated to count it
    with ds.loader(4, with_index=True) as loader:
        check_batches(ds, loader)


def test_agreeing_single_member_trailers_count_the_group_and_the_streams_are_still_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _decompressions(monkeypatch)
    ds = build(tmp_path, [9, 4], {"image": IMG_GZ, "label": LAB_GZ})
    assert [g.records for g in ds.groups] == [9, 4] and made == []
    with ds.loader(4, with_index=True) as loader:
        check_batches(ds, loader)
    # An image of 5 records whose trailer says 4, agreeing with its label: a second member
    # whose header the scan does not take for one (XFL 7; zlib reads it all the same). The
    # stream's end is checked, and the group fails there.
    records = np.arange(5 * 36, dtype=np.int8).tobytes()
    second = bytearray(_member(records[36:]))
    second[8] = 7
    (tmp_path / "img_0001.bin.gz").write_bytes(_member(records[:36]) + bytes(second))
    ds = stoker.Dataset(ds.fields)
    assert ds.records_in(1) == 4 and made == []
    got, err = consume(ds.loader(4, with_index=True))
    assert isinstance(err, stoker.CorruptDataError) and "img_0001.bin.gz" in str(err), err
    check_batches(ds, got, complete=False)  # what came before the error is right


def _lying_pair(tmp: Path, counts: list[int], lie: int) -> stoker.Dataset:
    """Two gzip fields, 4-byte records, each file followed by one zero byte: with 256*k records
    the last 4 bytes read as a trailer of k records in both fields, agreeing and nonzero."""
    tmp.mkdir(parents=True, exist_ok=True)
    base = 0
    for g, n in enumerate(counts):
        pad = b"\0" if g == lie else b""
        img = (np.arange(base * 4, (base + n) * 4) % 251).astype(np.int8)
        (tmp / f"img_{g}.bin.gz").write_bytes(_member(img.tobytes()) + pad)
        (tmp / f"out_{g}.bin.gz").write_bytes(_member(np.arange(base, base + n, dtype="<f4").tobytes()) + pad)
        base += n
    return stoker.Dataset(
        image=stoker.Field(str(tmp / "img_*.bin.gz"), "int8", (4,)),
        label=stoker.Field(str(tmp / "out_*.bin.gz"), "float32"),
    )


_LIES = [{}, {"drop_remainder": True}, {"shard": (0, 2)}, {"shard": (1, 2), "drop_remainder": True},
         {"shard": (1, 3), "even": False}, {"cycle_length": 1}, {"shuffle": "files", "seed": 3},
         {"shuffle": "global", "seed": 3}, {"pad_last": True, "shard": (1, 2)}]  # fmt: skip


@pytest.mark.parametrize(
    ("lie", "kw"),
    [(0, kw) for kw in _LIES] + [(2, kw) for kw in _LIES] + [(2, {"resume": 3}), (2, {"resume": 3, "shard": (1, 2)})],
)
def test_trailers_that_lie_alike_end_in_an_error_naming_the_file_never_in_missing_records(
    tmp_path: Path, lie: int, kw: dict[str, object]
) -> None:
    """Both fields' trailers miscount group ``lie`` alike (2 records where 512 are), so the rule
    trusts them; the group's streams are read to their end wherever its records go (shards,
    a dropped remainder, a resumed run), and the error comes at the latest at the last batch."""
    counts = [41, 30, 20]  # as believed, 73 or 52 records: the lying group's end in a remainder
    counts[lie] = 512
    ds = _lying_pair(tmp_path, counts, lie)
    assert ds.records_in(lie) == 2  # the lie is believed when the group opens
    kw = dict(kw)
    resume = int(kw.pop("resume", 0))  # type: ignore[call-overload]
    state = None
    if resume:  # saved after a few batches that come before the lying group's end
        with ds.loader(8, with_index=True, **kw) as first:  # type: ignore[arg-type]
            batches = iter(first)
            for _ in range(resume):
                next(batches)
            state = first.state_dict()
    got, err = consume(ds.loader(8, with_index=True, state=state, **kw))  # type: ignore[arg-type]
    assert isinstance(err, stoker.CorruptDataError), err
    assert f"_{lie}.bin.gz" in str(err) and err.path is not None and err.path.endswith(f"_{lie}.bin.gz")
    real = [{k: v[b["__valid__"]] for k, v in b.items()} if "__valid__" in b else b for b in got]  # pad_last
    rows = check_batches(ds, real, complete=False)  # every record delivered is the one it says it is
    assert len(rows) == len(set(rows))


def test_an_explicit_path_holding_glob_characters_is_that_file(tmp_path: Path) -> None:
    _raw(tmp_path / "img_[0].bin", 2)
    _raw(tmp_path / "img_0.bin", 5)  # what the name read as a glob matches
    ds = stoker.Dataset(x=stoker.Field([str(tmp_path / "img_[0].bin")], "int32"))
    assert [g.paths["x"] for g in ds.groups] == [str(tmp_path / "img_[0].bin")] and len(ds) == 2
    alone = stoker.Dataset(x=stoker.Field(str(tmp_path / "img_[0].bin"), "int32"))  # a str names it too
    assert [g.paths["x"] for g in alone.groups] == [str(tmp_path / "img_[0].bin")]


def test_a_file_under_a_directory_whose_name_holds_glob_characters_opens(tmp_path: Path) -> None:
    run = tmp_path / "run[1]"
    run.mkdir()
    paths = [str(_raw(run / f"img_{i}.bin", i + 1)) for i in range(2)]
    ds = stoker.Dataset(x=stoker.Field(paths, "int32"))
    assert [g.paths["x"] for g in ds.groups] == paths and len(ds) == 3
    # A glob in it: its name is glob syntax, and the error says how to escape it.
    with pytest.raises(stoker.SpecError, match=r"matched no file; the directory .*run\[1\]' exists.*glob\.escape"):
        stoker.Dataset(x=stoker.Field(str(run / "img_*.bin"), "int32"))
    escaped = stoker.Dataset(x=stoker.Field(glob.escape(str(run)) + "/img_*.bin", "int32"))
    assert [g.paths["x"] for g in escaped.groups] == paths


def test_a_name_with_glob_characters_and_no_such_file_is_a_glob(tmp_path: Path) -> None:
    for i in (1, 0, 2):
        _raw(tmp_path / f"a_{i}.bin", 1)
    ds = stoker.Dataset(x=stoker.Field([str(tmp_path / "a_[12].bin"), str(tmp_path / "a_0.bin")], "int32"))
    assert [os.path.basename(g.paths["x"]) for g in ds.groups] == ["a_1.bin", "a_2.bin", "a_0.bin"]


@pytest.mark.parametrize("how", ["listed twice", "spelled twice", "matched by two globs", "listed and matched"])
def test_the_same_file_twice_in_a_field_is_a_spec_error_naming_it(tmp_path: Path, how: str) -> None:
    a, b = str(_raw(tmp_path / "a_0.bin", 3)), str(_raw(tmp_path / "a_1.bin", 3))
    files = {
        "listed twice": [a, b, a],
        "spelled twice": [a, str(tmp_path / "." / "a_0.bin")],
        "matched by two globs": [str(tmp_path / "a_*.bin"), str(tmp_path / "a_0*.bin")],
        "listed and matched": [b, str(tmp_path / "a_*.bin")],
    }[how]
    with pytest.raises(stoker.SpecError, match=r"a_[01]\.bin' is file \d and file \d of the field") as info:
        stoker.Dataset(x=stoker.Field(files, "int32"))
    assert info.value.field == "x" and info.value.path is not None and "a_" in info.value.path


def _raw_starting_like_gzip(tmp_path: Path, name: str, records: int = 6) -> Path:
    """A raw file of uint8 records of shape (4,) whose first record is 1f 8b 08 00."""
    values = np.arange(records * 4, dtype=np.uint8).reshape(records, 4)
    values[0] = [0x1F, 0x8B, 0x08, 0x00]
    path = tmp_path / name
    path.write_bytes(values.tobytes())
    return path


def test_a_raw_bin_starting_with_gzip_magic_is_refused_naming_compression_none_and_read_with_it(
    tmp_path: Path,
) -> None:
    path = _raw_starting_like_gzip(tmp_path, "a.bin")
    with pytest.raises(stoker.SpecError, match=r"a\.bin.*compression=None") as caught:
        stoker.Dataset(x=stoker.Field([str(path)], "uint8", (4,)))
    assert caught.value.path == str(path) and caught.value.field == "x"
    ds = stoker.Dataset(x=stoker.Field([str(path)], "uint8", (4,), compression=None))  # the fix it names
    assert ds.files[0]["x"].compression is None
    np.testing.assert_array_equal(ds.read(np.arange(6))["x"], np.frombuffer(path.read_bytes(), np.uint8).reshape(6, 4))


def test_a_raw_file_starting_with_gzip_magic_that_raw_records_cannot_fill_is_taken_for_gzip(tmp_path: Path) -> None:
    path = tmp_path / "a.dat"
    path.write_bytes(gzip.compress(bytes(64)) + b"\x00")  # 1 byte of padding: never a whole number of records
    assert (path.stat().st_size) % 4
    ds = stoker.Dataset(x=stoker.Field([str(path)], "float32"))
    assert ds.files[0]["x"].compression == "gzip" and len(ds) == 16


@pytest.mark.parametrize(
    ("name", "data", "compression", "says"),
    [
        ("a.bin.gz", bytes(12), "auto", "compression='auto' and its suffix '.gz'"),
        ("a.zz", b"\xff" * 12, "auto", "compression='auto' and its suffix '.zz'"),
        ("a.bin", bytes(12), "gzip", "compression='gzip'"),
        ("a.gz", b"", "auto", "compression='auto'"),
    ],
    ids=["gz-suffix-raw-bytes", "zz-suffix-raw-bytes", "declared-gzip-raw-bytes", "empty-gz"],
)
def test_every_detection_error_names_the_file_and_compression_none(
    tmp_path: Path, name: str, data: bytes, compression: str, says: str
) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(stoker.CorruptDataError) as caught:
        stoker.Dataset(x=stoker.Field([str(tmp_path / name)], "float32", compression=compression))
    assert caught.value.path == str(tmp_path / name) and name in str(caught.value)
    assert says in str(caught.value) and "compression=None" in str(caught.value)
