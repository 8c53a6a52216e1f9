"""The persistent index: written atomically, used when it matches, never trusted when stale or old."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.cli import main
from stoker.engine import decoded
from stoker.io import index as index_module
from stoker.io import indexlock, inflate, seekpoints
from stoker.io.index import INDEX_NAME, INDEX_VERSION
from tests.helpers.data import IMG, FieldPlan, build, check_batches, reference, resign

Made = list[tuple[str, tuple[int, int]]]  # (path, start) of each Inflater constructed
IMG_GZ = FieldPlan("img", "int8", (6, 6, 1), kind="gzip")
LAB_GZ = FieldPlan("out", "float32", (), kind="gzip")
LAB_ZLIB = FieldPlan("lab", "int16", (), kind="zlib", header=2, footer=1)
LAB_MULTI = FieldPlan("out", "float32", (), kind="multi")
COUNTS = [13, 0, 7, 21, 3]


@pytest.fixture
def inflaters(monkeypatch: pytest.MonkeyPatch) -> Made:
    """(path, start) of every Inflater constructed (every decompression stoker starts), in order."""
    made: Made = []
    original = inflate.Inflater.__init__

    def counting(self: inflate.Inflater, path: str, *args: object, **kw: object) -> None:
        made.append((path, kw.get("start", (0, 0))))  # type: ignore[arg-type]
        original(self, path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(inflate.Inflater, "__init__", counting)
    scan = seekpoints.scan_file

    def scanning(path: str, kind: str, **kw: Any) -> seekpoints.Scan:
        made.append((path, (0, 0)))  # the index's own pass (libz) decompresses too
        return scan(path, kind, **kw)

    monkeypatch.setattr(seekpoints, "scan_file", scanning)
    return made


def compressed(tmp_path: Path) -> stoker.Dataset:
    """Every field compressed (gzip images, zlib labels): counts need decompression without an index."""
    return build(tmp_path, COUNTS, {"image": IMG_GZ, "label": LAB_ZLIB}, index="ignore")


def test_write_index_writes_one_versioned_file_beside_the_data(tmp_path: Path) -> None:
    ds = compressed(tmp_path)
    written = stoker.write_index(ds)
    assert written == [tmp_path / INDEX_NAME]
    doc = json.loads(written[0].read_text())
    assert doc["format"] == "stoker-index" and doc["version"] == INDEX_VERSION
    entry = doc["files"]["img_0003.bin.gz"]
    st = os.stat(tmp_path / "img_0003.bin.gz")
    assert (entry["size"], entry["mtime_ns"], entry["records"]) == (st.st_size, st.st_mtime_ns, 21)
    assert [m[:2] for m in entry["members"]] == [[0, 0]] and entry["decompressed_bytes"] == 21 * 36
    assert doc["files"]["lab_0003.bin.zz"]["records"] == 21
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == sorted([INDEX_NAME, indexlock.WRITER_LOCK, indexlock.READERS_LOCK])  # no temp left


def test_opening_with_the_index_decompresses_nothing(tmp_path: Path, inflaters: Made) -> None:
    fields = compressed(tmp_path).fields
    stoker.write_index(stoker.Dataset(fields, index="ignore"))
    inflaters.clear()
    ds = stoker.Dataset(fields)  # same files, index read
    assert len(ds) == sum(COUNTS) and ds.records_in(3) == 21
    assert inflaters == []
    without = stoker.Dataset(ds.fields, index="ignore")
    assert len(without) == sum(COUNTS)
    # Every file decompressed to count it: zlib labels have no trailer, so the gzip images'
    # trailers have nothing to agree with (see the next test for a group they do count).
    assert len(inflaters) == 2 * len(COUNTS)


def test_without_an_index_agreeing_single_member_gzip_fields_open_with_no_inflate(
    tmp_path: Path, inflaters: Made
) -> None:
    """W2's layout (gzip images, gzip labels, no raw field): each group is counted by its
    trailers, since they agree on a nonzero count and every file is proved one member. An
    empty group's trailers say 0, which is never trusted: its files are inflated to count
    them. Reading inflates each other file once."""
    ds = build(tmp_path, COUNTS, {"image": IMG_GZ, "label": LAB_GZ}, index="ignore")
    assert len(ds) == sum(COUNTS) and [g.records for g in ds.groups] == COUNTS
    empty = [infos[n].path for infos, c in zip(ds.files, COUNTS) if not c for n in ("image", "label")]
    assert sorted(path for path, _ in inflaters) == sorted(empty)
    inflaters.clear()
    with ds.loader(4, with_index=True) as loader:
        check_batches(ds, loader)
    files = [infos[n].path for infos, c in zip(ds.files, COUNTS) if c for n in ("image", "label")]
    assert sorted(path for path, _ in inflaters) == sorted(files)


def test_the_index_is_what_counts_not_the_data(tmp_path: Path) -> None:
    """Timing-free proof the data is not read: garbage of the same size and mtime opens fine."""
    ds = compressed(tmp_path)
    stoker.write_index(ds)
    path = ds.files[2]["label"].path
    st = os.stat(path)
    Path(path).write_bytes(b"\x78\x9c" + b"\xff" * (st.st_size - 2))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(stoker.Dataset(ds.fields)) == sum(COUNTS)  # counted from the index
    with pytest.raises(stoker.CorruptDataError, match="lab_0002.bin.zz"):
        len(stoker.Dataset(ds.fields, index="ignore"))


def test_stale_entry_is_an_error_naming_the_file(tmp_path: Path) -> None:
    ds = compressed(tmp_path)
    stoker.write_index(ds)
    path = Path(ds.files[3]["image"].path)
    path.write_bytes(path.read_bytes() + b"\0\0")  # zero padding: still valid gzip, new size
    with pytest.raises(stoker.StaleIndexError, match=r"stale for .*img_0003\.bin\.gz.*stoker index") as e:
        stoker.Dataset(ds.fields)
    assert e.value.path == str(path) and e.value.field == "image" and isinstance(e.value, ValueError)


def test_stale_after_touch_only(tmp_path: Path) -> None:
    ds = compressed(tmp_path)
    stoker.write_index(ds)
    path = ds.files[0]["label"].path
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(stoker.StaleIndexError, match="lab_0000.bin.zz"):
        stoker.Dataset(ds.fields)


def test_rebuild_rewrites_stale_entries_and_then_matches(tmp_path: Path, inflaters: Made) -> None:
    ds = compressed(tmp_path)
    stoker.write_index(ds)
    path = Path(ds.files[3]["label"].path)
    body = bytes(LAB_ZLIB.header) + np.arange(30, dtype="<i2").tobytes() + bytes(LAB_ZLIB.footer)
    path.write_bytes(zlib.compress(body))
    image = Path(ds.files[3]["image"].path)
    image.write_bytes(gzip.compress(np.zeros((30, 36), np.int8).tobytes()))
    inflaters.clear()
    rebuilt = stoker.Dataset(ds.fields, index="rebuild")
    assert sorted(os.path.basename(p) for p, _ in inflaters) == ["img_0003.bin.gz", "lab_0003.bin.zz"]
    assert rebuilt.records_in(3) == 30
    inflaters.clear()
    again = stoker.Dataset(ds.fields)
    assert again.records_in(3) == 30 and inflaters == []
    assert np.array_equal(again[13 + 7 + 29]["label"], np.int16(29))


def test_rebuild_creates_a_missing_index(tmp_path: Path) -> None:
    ds = compressed(tmp_path)
    assert not (tmp_path / INDEX_NAME).exists()
    stoker.Dataset(ds.fields, index="rebuild")
    assert (tmp_path / INDEX_NAME).exists()


def test_index_of_an_older_version_is_an_error_naming_it_then_rebuilt(tmp_path: Path, inflaters: Made) -> None:
    ds = compressed(tmp_path)
    (index,) = stoker.write_index(ds)
    doc = json.loads(index.read_text())
    doc["version"] = INDEX_VERSION - 1
    index.write_text(json.dumps(doc))
    with pytest.raises(stoker.StaleIndexError, match=rf"{INDEX_NAME}.*version {INDEX_VERSION - 1}") as e:
        stoker.Dataset(ds.fields)
    assert e.value.path == str(index)
    stoker.Dataset(ds.fields, index="rebuild")
    assert json.loads(index.read_text())["version"] == INDEX_VERSION
    inflaters.clear()
    assert len(stoker.Dataset(ds.fields)) == sum(COUNTS) and inflaters == []


@pytest.mark.parametrize("content", [b"{not json", b'{"format": "other"}'])
def test_unreadable_index_is_an_error_naming_it(tmp_path: Path, content: bytes) -> None:
    ds = compressed(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(content)
    with pytest.raises(stoker.StaleIndexError, match=INDEX_NAME) as e:
        stoker.Dataset(ds.fields)
    assert e.value.path == str(tmp_path / INDEX_NAME)


def test_malformed_entry_is_an_error_naming_index_and_file(tmp_path: Path) -> None:
    ds = compressed(tmp_path)
    (index,) = stoker.write_index(ds)
    doc = json.loads(index.read_text())
    del doc["files"]["img_0002.bin.gz"]["members"]
    index.write_text(json.dumps(doc))
    with pytest.raises(stoker.StaleIndexError, match=r"malformed entry for .*img_0002\.bin\.gz") as e:
        stoker.Dataset(ds.fields)
    assert e.value.path == str(index)


@pytest.mark.parametrize("signed", [False, True], ids=["edited", "edited-and-signed"])
def test_entry_whose_size_is_not_whole_records_is_the_index_s_fault(tmp_path: Path, signed: bool) -> None:
    """Edited alone, the entry's own check refuses it; signed again, the check of the file's start
    (which binds the decompressed size) does: either way the index is named, not the data."""
    ds = compressed(tmp_path)
    (index,) = stoker.write_index(ds)
    doc = json.loads(index.read_text())
    entry = doc["files"]["img_0004.bin.gz"]
    entry["decompressed_bytes"] += 1
    if signed:
        resign(entry)
    index.write_text(json.dumps(doc))
    why = "does not match .*img_0004\\.bin\\.gz.*at its seek point" if signed else "malformed entry .*check"
    with pytest.raises(stoker.StaleIndexError, match=rf"stoker-index\.json.*{why}.*rebuild") as e:
        stoker.Dataset(ds.fields)
    assert e.value.path == str(index) and e.value.field == "image"


def test_entry_that_is_not_whole_records_under_a_changed_field_is_the_data_s_error(tmp_path: Path) -> None:
    """The index is right (its check holds): the field's layout no longer fits the file."""
    ds = compressed(tmp_path)
    stoker.write_index(ds)
    fields = {"image": stoker.Field(str(tmp_path / "img_*.bin.gz"), "int8", (5,)), "label": ds.fields["label"]}
    with pytest.raises(stoker.CorruptDataError, match=r"img_0000\.bin\.gz.*per its index") as e:
        stoker.Dataset(fields)
    assert e.value.path == ds.files[0]["image"].path and not isinstance(e.value, stoker.StaleIndexError)


def test_index_mode_is_validated(tmp_path: Path) -> None:
    with pytest.raises(stoker.SpecError, match="index='always'"):
        build(tmp_path, [2], {"label": LAB_GZ}, index="always")


def test_files_the_index_does_not_cover_are_counted_as_without_it(tmp_path: Path, inflaters: Made) -> None:
    ds = compressed(tmp_path)
    (index,) = stoker.write_index(ds)
    doc = json.loads(index.read_text())
    del doc["files"]["lab_0003.bin.zz"]  # as if the file was added after indexing
    index.write_text(json.dumps(doc))
    inflaters.clear()
    again = stoker.Dataset(ds.fields)
    assert again.records_in(3) == 21 and len(again) == sum(COUNTS)
    assert [os.path.basename(p) for p, _ in inflaters] == ["lab_0003.bin.zz"]


def test_member_starts_are_seek_points_for_random_access(tmp_path: Path, inflaters: Made) -> None:
    ds = build(tmp_path, [300, 90], {"image": IMG, "label": LAB_MULTI})
    ref = np.concatenate([r["label"] for r in reference(ds)])
    stoker.write_index(ds)
    ds = stoker.Dataset(ds.fields)
    points = ds._catalog.seek_points[(0, "label")]
    assert len(points) == 3 and points[0][:2] == (0, 0) and points[1][1] == 400  # 1200 bytes in 3 members
    from stoker.engine.records import RecordReader

    reader = RecordReader(ds._catalog, cache_bytes=0)  # force decoding from seek points
    out = {"image": np.empty((1, 6, 6, 1), np.int8), "label": np.empty(1, np.float32)}
    inflaters.clear()
    reader.read_into(np.array([0]), np.array([250]), out)
    assert out["label"][0] == ref[250]
    # the reader started at the third member, not at the start of the file
    assert inflaters == [(ds.files[0]["label"].path, points[2])]
    idx = np.arange(len(ds))[::-7]
    assert np.array_equal(ds.read(idx)["label"], ref[idx])


def test_resume_inside_a_large_compressed_file_starts_at_a_member(
    tmp_path: Path, inflaters: Made, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decoded, "VERIFY_WHOLE_BYTES", 0)  # stream files as if they were large
    build(tmp_path, [300, 30], {"label": LAB_MULTI})
    fields = {"label": stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32")}
    stoker.write_index(stoker.Dataset(fields, index="ignore"))
    ds = stoker.Dataset(fields)
    full = list(ds.loader(50, with_index=True, cycle_length=1))
    loader = ds.loader(50, with_index=True, cycle_length=1)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    loader.close()
    inflaters.clear()
    rest = list(ds.loader(50, with_index=True, cycle_length=1, state=state))
    assert len(rest) == len(full) - 5
    for a, b in zip(rest, full[5:], strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    # The first decompression of the resumed file starts at the member holding record 250 (member 3).
    # (Another worker may open group 1, the next batch's, first: which file comes first is a race.)
    path = ds.files[0]["label"].path
    first = next(made for made in inflaters if made[0] == path)
    assert first == (path, ds._catalog.seek_points[(0, "label")][2])


def test_cli_index_for_the_sample_layout_and_for_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", str(tmp_path), "--pairs", "3", "--records", "20", "--inrez", "4"]) == 0
    assert main(["index", str(tmp_path), "--inrez", "4"]) == 0
    out = capsys.readouterr().out
    assert "indexed 6 files of 3 groups (60 records)" in out and INDEX_NAME in out
    doc = json.loads((tmp_path / INDEX_NAME).read_text())
    assert doc["files"]["out_0002.bin.gz"]["records"] == 20
    (tmp_path / INDEX_NAME).unlink()
    assert main(["index", "--field", f"label={tmp_path}/out_*.bin.gz:float32:gzip"]) == 0
    assert sorted(json.loads((tmp_path / INDEX_NAME).read_text())["files"]) == [f"out_{g:04d}.bin.gz" for g in range(3)]


def test_cli_index_errors_print_type_and_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["index"]) == 2
    assert "SpecError: index needs a sample DIR" in capsys.readouterr().err
    assert main(["index", "--field", f"label={tmp_path}/none_*.gz:float32"]) == 2
    err = capsys.readouterr().err
    assert "SpecError" in err and "none_*.gz" in err


def test_cli_index_replaces_a_stale_index(tmp_path: Path) -> None:
    main(["sample", str(tmp_path), "--pairs", "2", "--records", "5", "--inrez", "4"])
    main(["index", str(tmp_path), "--inrez", "4"])
    label = tmp_path / "out_0001.bin.gz"
    label.write_bytes(label.read_bytes() + b"\0")
    fields = {"label": stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32")}
    with pytest.raises(stoker.StaleIndexError):
        stoker.Dataset(fields)
    assert main(["index", str(tmp_path), "--inrez", "4"]) == 0
    assert len(stoker.Dataset(fields)) == 10


@pytest.mark.parametrize(
    "where", [("decompressed_bytes",), ("members", 0, 0), ("members", 0, 1), ("members", 0, 2), ("check",)]
)
@pytest.mark.parametrize("by", [1, -1, 36])
def test_an_edited_one_member_entry_is_refused_naming_the_index(
    tmp_path: Path, where: tuple[Any, ...], by: int
) -> None:
    """The entry most files have (one member, no block point) is checked on a shorter path: the same rules."""
    ds = compressed(tmp_path)
    (path,) = stoker.write_index(ds)
    doc = json.loads(path.read_text())
    entry = doc["files"]["img_0003.bin.gz"]
    assert "points" not in entry and len(entry["members"]) == 1
    target: Any = entry
    for k in where[:-1]:
        target = target[k]
    target[where[-1]] += by
    path.write_text(json.dumps(doc))
    with pytest.raises(stoker.StaleIndexError, match=r"entry 'img_0003\.bin\.gz'") as e:
        stoker.Dataset(ds.fields)
    assert e.value.path == str(path)


def test_the_short_path_for_one_member_entries_gives_what_the_general_one_does(tmp_path: Path) -> None:
    ds = compressed(tmp_path)
    (path,) = stoker.write_index(ds)
    for base, entry in json.loads(path.read_text())["files"].items():
        info = next(i[n] for i in ds.files for n in i if i[n].path.endswith("/" + base))
        general = index_module._parse(str(path), info, {**entry, "points": []})
        assert index_module._parse(str(path), info, entry) == general and general[1][0].check is not None
