"""Seek points inside gzip members and zlib streams: exact from every point, used, never trusted when wrong."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from isal import isal_zlib

import stoker
from stoker.cli import main
from stoker.engine import decoded, records
from stoker.engine.records import RecordReader
from stoker.io import index, inflate, seekpoints
from stoker.io.files import FileInfo
from stoker.io.index import INDEX_NAME
from stoker.io.seekpoints import SeekPoint
from tests.helpers.data import FieldPlan, build, encode, field_for, make_values, reference, resign, write_dataset
from tests.helpers.resources import consume

SPACING = 16 * 1024
IMG = FieldPlan("img", "int32", (64,), kind="gzip", header=3, footer=5)  # 256-byte records, many deflate blocks
LAB = FieldPlan("lab", "int16", (32,), kind="zlib", header=2, footer=1)
MULTI = FieldPlan("img", "int32", (64,), kind="multi", header=3, footer=5)
COUNTS = [3000, 40, 1700]


class Opened:
    """Every Inflater stoker constructs, kept so a test can see where it started and how far it went."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[inflate.Inflater] = []
        original = inflate.Inflater.__init__

        def opening(inf: inflate.Inflater, *args: object, **kw: object) -> None:
            original(inf, *args, **kw)  # type: ignore[arg-type]
            self.made.append(inf)

        monkeypatch.setattr(inflate.Inflater, "__init__", opening)

    def of(self, path: str) -> list[inflate.Inflater]:
        return [inf for inf in self.made if inf.path == path]


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Opened:
    return Opened(monkeypatch)


def compress(data: bytes, how: str, level: int) -> bytes:
    if how == "gzip":
        return gzip.compress(data, compresslevel=level)
    if how == "zlib":
        return zlib.compress(data, level)
    if how == "isal":
        return isal_zlib.compress(data, min(level, 3), wbits=31)
    if how == "members":  # gzip -c a >> f; gzip -c b >> f; with zero padding after
        cut = len(data) * 2 // 5
        return gzip.compress(data[:cut], compresslevel=level) + gzip.compress(data[cut:], compresslevel=9) + b"\0" * 7
    raise ValueError(how)


def windows_of(ds: stoker.Dataset, g: int = 0, name: str = "x") -> str:
    """The windows file the index names for field ``name`` of group ``g``."""
    (path,) = {p.window.path for p in ds._catalog.seek_points[(g, name)] if p.window is not None}
    return path


def indexed(tmp_path: Path, plans: dict[str, FieldPlan], counts: list[int] = COUNTS) -> stoker.Dataset:
    write_dataset(tmp_path, counts, plans)
    fields = {n: field_for(tmp_path, p) for n, p in plans.items()}
    stoker.write_index(stoker.Dataset(fields, index="ignore"), spacing=SPACING)
    return stoker.Dataset(fields)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Points 7 and 4 bits into a byte, then stored blocks (random bytes at level 9): a decoder fed
# the bytes re-packed from the point's bit read each stored block's length from the wrong bytes.
@example(seed=0, size=99_998, alphabet=256, how="members", level=9, spacing=20_000)
@example(seed=0, size=99_998, alphabet=256, how="members", level=0, spacing=1)
@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.integers(1, 300_000),
    alphabet=st.sampled_from([2, 7, 40, 256]),
    how=st.sampled_from(["gzip", "zlib", "isal", "members"]),
    level=st.integers(0, 9),
    spacing=st.sampled_from([1, 3000, 20_000]),
)
def test_every_seek_point_decodes_exactly_what_plain_decompression_gives(
    tmp_path: Path, seed: int, size: int, alphabet: int, how: str, level: int, spacing: int
) -> None:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, alphabet, size, dtype=np.uint8)
    data[rng.integers(0, size, size // 3)] = 0  # runs and repeats: back-references across blocks
    data = data.tobytes()
    path = tmp_path / "f.z"
    path.write_bytes(compress(data, how, level))
    kind = "zlib" if how == "zlib" else "gzip"
    st_ = path.stat()
    info = FileInfo(str(path), st_.st_size, st_.st_mtime_ns, kind, None)
    entry = index.scan("f", info, str(tmp_path), spacing=spacing)
    assert entry.decompressed_bytes == len(data)
    _, points = index.parse_entry(str(tmp_path / INDEX_NAME), info, entry.to_json(0))
    assert all(p.check is not None for p in points)  # every point is verified when used
    assert [p.decompressed for p in points] == sorted(p.decompressed for p in points)
    for point in points:
        want = int(rng.integers(0, 70_000))
        with inflate.Inflater(str(path), kind, start=point) as inf:
            got = bytearray(want)
            n = inf.readinto(memoryview(got))
            assert bytes(got[:n]) == data[point.decompressed : point.decompressed + want]
    if points:  # one point read to the very end: across later members, ending where the file ends
        point = points[int(rng.integers(0, len(points)))]
        with inflate.Inflater(str(path), kind, start=point) as inf:
            rest = bytearray(len(data) + 1)
            assert inf.readinto(memoryview(rest)) == len(data) - point.decompressed
            assert bytes(rest[: len(data) - point.decompressed]) == data[point.decompressed :] and inf.at_end()


@pytest.mark.parametrize("plan", [IMG, MULTI, LAB], ids=["gzip", "gzip-members", "zlib"])
def test_index_holds_block_points_and_reads_equal_the_files_at_random_records(tmp_path: Path, plan: FieldPlan) -> None:
    ds = indexed(tmp_path, {"x": plan})
    points = ds._catalog.seek_points[(0, "x")]
    inner = [p for p in points if p.window is not None]
    assert len(inner) >= 5 and all(0 <= p.bits < 8 for p in inner)
    gaps = np.diff([p.decompressed for p in inner])
    assert (gaps >= SPACING).all()
    assert (tmp_path / inner[0].window.path).exists() and inner[0].window.path.startswith(str(tmp_path))  # type: ignore[union-attr]
    ref = np.concatenate([r["x"] for r in reference(ds)])
    reader = RecordReader(ds._catalog, cache_bytes=0)  # every read from a seek point
    rng = np.random.default_rng(5)
    idx = rng.integers(0, len(ds), 300)
    groups = np.searchsorted(np.cumsum(COUNTS), idx, side="right")
    local = idx - np.concatenate([[0], np.cumsum(COUNTS)])[groups]
    out = {"x": np.empty((len(idx), *plan.shape), plan.dtype)}
    reader.read_into(groups, local, out)
    assert np.array_equal(out["x"], ref[idx])
    assert np.array_equal(ds.read(idx[::-1])["x"], ref[idx[::-1]])  # the default (cached) path agrees


def test_random_access_inflates_from_the_nearest_point_not_the_member_start(tmp_path: Path, opened: Opened) -> None:
    ds = indexed(tmp_path, {"x": IMG})
    path = ds.files[0]["x"].path
    ref = reference(ds)[0]["x"]
    reader = RecordReader(ds._catalog, cache_bytes=0)
    record = 2900  # byte 742403 of 768008, in the one member
    out = {"x": np.empty((1, 64), np.int32)}
    reader.read_into(np.array([0]), np.array([record]), out)
    assert np.array_equal(out["x"][0], ref[record])
    (inf,) = opened.of(path)
    start = inf.members[0][1]
    target = IMG.header + record * 256
    assert 0 < target - start < SPACING + 128 * 1024  # from the last point before it (a block lies past SPACING)
    inflated = inf.produced - start
    assert inflated <= target - start + 256  # up to the wanted record, nothing more
    # without the index the same read inflates everything before the record
    plain = stoker.Dataset(ds.fields, index="ignore")
    RecordReader(plain._catalog, cache_bytes=0).read_into(np.array([0]), np.array([record]), out)
    assert opened.of(path)[-1].members[0] == (0, 0) and opened.of(path)[-1].produced == target + 256


def test_resume_and_shards_start_inside_a_single_member(
    tmp_path: Path, opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decoded, "VERIFY_WHOLE_BYTES", 0)  # stream files as if they were large
    ds = indexed(tmp_path, {"x": IMG, "y": LAB})
    full = list(ds.loader(100, with_index=True, cycle_length=1))
    loader = ds.loader(100, with_index=True, cycle_length=1)
    it = iter(loader)
    for _ in range(25):  # record 2500 of group 0
        next(it)
    state = loader.state_dict()
    loader.close()
    opened.made.clear()
    rest = list(ds.loader(100, with_index=True, cycle_length=1, state=state))
    assert len(rest) == len(full) - 25
    for a, b in zip(rest, full[25:], strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    for name in ("x", "y"):
        first = opened.of(ds.files[0][name].path)[0]
        assert first.members[0][1] > 0.8 * 2500 * ds.fields[name].record_bytes  # a block point, not the start
    ref = reference(ds)
    sharded = list(ds.loader(100, with_index=True, shard=(1, 2), cycle_length=1))
    for b in sharded:
        for g, i, x in zip(b["__group__"], b["__index__"], b["x"], strict=True):
            assert np.array_equal(x, ref[g]["x"][i])


def test_select_of_records_reads_through_seek_points(
    tmp_path: Path, opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = indexed(tmp_path, {"x": IMG, "y": LAB})
    ref = np.concatenate([r["x"] for r in reference(ds)])
    monkeypatch.setattr(records, "DEFAULT_CACHE_BYTES", 0)  # files count as too large to hold decoded
    batches = list(ds.select(records=slice(2600, 2700)).loader(50))
    assert np.array_equal(np.concatenate([b["x"] for b in batches]), ref[2600:2700])
    starts = [inf.members[0][1] for inf in opened.of(ds.files[0]["x"].path)]
    assert starts and min(starts) > 0


def test_a_missing_windows_file_is_an_error_naming_it_when_used(tmp_path: Path) -> None:
    ds = indexed(tmp_path, {"x": IMG})
    sidecar = windows_of(ds)
    os.unlink(sidecar)
    assert len(ds) == sum(COUNTS)  # opening never reads windows
    reader = RecordReader(ds._catalog, cache_bytes=0)
    with pytest.raises(stoker.StaleIndexError, match=r"\.stoker-windows\.img_0000\.bin\.gz.*cannot be read") as e:
        reader.read_into(np.array([0]), np.array([2900]), {"x": np.empty((1, 64), np.int32)})
    assert e.value.path == sidecar and e.value.field == "x"


@pytest.mark.parametrize("damage", ["other-data", "garbage"])
def test_a_windows_file_that_does_not_match_is_an_error_naming_it(tmp_path: Path, damage: str) -> None:
    ds = indexed(tmp_path, {"x": IMG})
    sidecar = Path(windows_of(ds))
    blob = bytearray(sidecar.read_bytes())
    if damage == "other-data":  # a windows file written for another version of the data file
        blob[8:16] = (12345).to_bytes(8, "little")
    else:
        blob[30:] = b"\x55" * (len(blob) - 30)
    sidecar.write_bytes(bytes(blob))
    reader = RecordReader(ds._catalog, cache_bytes=0)
    with pytest.raises(stoker.StaleIndexError, match=r"\.stoker-windows\.img_0000\.bin\.gz") as e:
        reader.read_into(np.array([0]), np.array([2900]), {"x": np.empty((1, 64), np.int32)})
    assert e.value.path == str(sidecar)


def test_a_data_file_changed_after_indexing_is_stale_not_read_through_old_points(tmp_path: Path) -> None:
    ds = indexed(tmp_path, {"x": IMG})
    path = Path(ds.files[0]["x"].path)
    path.write_bytes(gzip.compress(zlib.decompress(path.read_bytes(), 31), compresslevel=9))
    with pytest.raises(stoker.StaleIndexError, match=r"stale for .*img_0000\.bin\.gz"):
        stoker.Dataset(ds.fields)
    rebuilt = stoker.Dataset(ds.fields, index="rebuild")  # default spacing: fewer points, still exact
    ref = reference(rebuilt)[0]["x"]
    reader = RecordReader(rebuilt._catalog, cache_bytes=0)
    out = {"x": np.empty((1, 64), np.int32)}
    reader.read_into(np.array([0]), np.array([2999]), out)
    assert np.array_equal(out["x"][0], ref[2999])


def test_a_version_1_index_without_points_is_refused_then_rebuilt(tmp_path: Path) -> None:
    ds = build(tmp_path, COUNTS, {"x": IMG}, index="ignore")
    (path,) = stoker.write_index(ds)
    doc = json.loads(path.read_text())
    doc["version"] = 1
    for entry in doc["files"].values():
        entry.pop("points", None), entry.pop("windows", None)
    path.write_text(json.dumps(doc))
    with pytest.raises(stoker.StaleIndexError, match=rf"{INDEX_NAME}.*version 1"):
        stoker.Dataset(ds.fields)
    again = stoker.Dataset(ds.fields, index="rebuild")
    assert json.loads(path.read_text())["version"] == index.INDEX_VERSION
    assert stoker.Dataset(ds.fields)._catalog.seek_points.keys() == again._catalog.seek_points.keys()


def test_corrupt_index_file_is_an_error_naming_it(tmp_path: Path) -> None:
    ds = indexed(tmp_path, {"x": IMG})
    path = tmp_path / INDEX_NAME
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(stoker.StaleIndexError, match=rf"{INDEX_NAME}.*cannot be read") as e:
        stoker.Dataset(ds.fields)
    assert e.value.path == str(path)


def test_malformed_point_is_an_error_naming_index_and_file(tmp_path: Path) -> None:
    ds = indexed(tmp_path, {"x": IMG})
    path = tmp_path / INDEX_NAME
    doc = json.loads(path.read_text())
    doc["files"]["img_0000.bin.gz"]["points"][0] = [1, 2]
    path.write_text(json.dumps(doc))
    with pytest.raises(stoker.StaleIndexError, match=r"malformed entry for .*img_0000\.bin\.gz"):
        stoker.Dataset(ds.fields)


def test_without_libz_the_index_holds_member_starts_and_reads_stay_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seekpoints, "available", lambda: False)
    ds = indexed(tmp_path, {"x": MULTI})
    points = ds._catalog.seek_points[(0, "x")]
    assert len(points) == 3 and all(p.window is None for p in points)  # the three members only
    assert not list(tmp_path.glob(".stoker-windows.*"))
    ref = np.concatenate([r["x"] for r in reference(ds)])
    reader = RecordReader(ds._catalog, cache_bytes=0)
    out = {"x": np.empty((2, 64), np.int32)}
    reader.read_into(np.array([0, 2]), np.array([2999, 5]), out)
    assert np.array_equal(out["x"], ref[[2999, 3000 + 40 + 5]])


def test_spacing_is_validated_and_the_cli_takes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = build(tmp_path, [3000], {"x": FieldPlan("img", "int32", (64,), kind="gzip")}, index="ignore")
    with pytest.raises(stoker.SpecError, match="spacing=0"):
        stoker.write_index(ds, spacing=0)
    spec = f"x={tmp_path}/img_*.bin.gz:int32:64"
    assert main(["index", "--field", spec, "--spacing", "100000"]) == 0
    coarse = len(stoker.Dataset(ds.fields)._catalog.seek_points[(0, "x")])
    assert main(["index", "--field", spec, "--spacing", "20000"]) == 0
    fine = stoker.Dataset(ds.fields)._catalog.seek_points[(0, "x")]
    assert coarse < len(fine) and isinstance(fine[1], SeekPoint) and fine[1].window is not None
    assert main(["index", "--field", spec, "--spacing", "-1"]) != 0
    assert "SpecError: spacing=-1" in capsys.readouterr().err


def test_a_read_that_stops_just_before_the_end_still_gets_the_last_bytes(tmp_path: Path) -> None:
    """zlib may take all input while a size-limited call still holds output: not a truncation."""
    body = zlib.decompress(encode(LAB, make_values(LAB, 3000, 0)))
    path = tmp_path / "lab.zz"
    path.write_bytes(zlib.compress(body, 1))
    with inflate.Inflater(str(path), "zlib") as inf:
        buf = bytearray(len(body) - 1)
        assert inf.readinto(memoryview(buf)) == len(body) - 1 and inf.skip(1) == 1 and inf.at_end()
    cut = tmp_path / "cut.zz"
    cut.write_bytes(path.read_bytes()[:-300])
    with inflate.Inflater(str(cut), "zlib") as inf, pytest.raises(inflate.TruncatedStreamError, match="cut.zz"):
        inf.skip(len(body))


def test_index_and_windows_files_get_the_mode_of_a_plain_file(tmp_path: Path) -> None:
    """mkstemp's 0600 would lock everyone else out of a shared dataset's index."""
    umask = os.umask(0o022)
    try:
        indexed(tmp_path, {"x": IMG})
    finally:
        os.umask(umask)
    for f in [tmp_path / INDEX_NAME, *tmp_path.glob(".stoker-windows.*")]:
        assert f.stat().st_mode & 0o777 == 0o644, f


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab1.9_-", max_size=12), st.text(alphabet="a/.", max_size=6))
def test_opening_splits_names_as_os_path_splitext_does(name: str, directory: str) -> None:
    from stoker.io.files import _stem, _suffix

    assert _stem(name) == os.path.splitext(name)[0]
    path = directory + name
    assert _suffix(path) == os.path.splitext(path)[1]


def test_global_shuffle_beyond_the_memory_budget_reads_through_seek_points(tmp_path: Path, opened: Opened) -> None:
    write_dataset(tmp_path, COUNTS, {"x": IMG, "y": LAB})
    fields = {"x": field_for(tmp_path, IMG), "y": field_for(tmp_path, LAB)}
    budget = dict(memory_budget="600KiB", prefetch=2)  # 1.2 MB + 0.3 MB decoded do not fit
    with pytest.raises(stoker.SpecError, match="index them with `stoker index`"):
        stoker.Dataset(fields, index="ignore").loader(64, shuffle="global", seed=3, **budget)
    stoker.write_index(stoker.Dataset(fields, index="ignore"), spacing=SPACING)
    ds = stoker.Dataset(fields)
    ref = reference(ds)
    opened.made.clear()
    batches = list(ds.loader(64, shuffle="global", seed=3, with_index=True, **budget))
    seen = np.concatenate([b["__group__"] * 10_000 + b["__index__"] for b in batches])
    assert len(seen) == len(ds) and len(np.unique(seen)) == len(ds)  # each record once
    for b in batches:
        for g, i, x, y in zip(b["__group__"], b["__index__"], b["x"], b["y"], strict=True):
            assert np.array_equal(x, ref[g]["x"][i]) and np.array_equal(y, ref[g]["y"][i])
    starts = [inf.members[0][1] for inf in opened.of(ds.files[0]["x"].path)]
    assert max(starts) > 0.5 * 3000 * 256  # decoding began at points deep inside the one member


def test_sharded_streams_jump_ahead_to_seek_points(
    tmp_path: Path, opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decoded, "VERIFY_WHOLE_BYTES", 0)  # stream files as if they were large
    ds = indexed(tmp_path, {"x": IMG})
    ref = reference(ds)
    opened.made.clear()
    kw = dict(shuffle="files", seed=1, block_length=200, cycle_length=2, with_index=True)
    batches = [b for s in range(3) for b in ds.loader(64, shard=(s, 3), **kw)]  # type: ignore[arg-type]
    seen = np.concatenate([b["__group__"] * 10_000 + b["__index__"] for b in batches])
    assert len(seen) == len(ds) and len(np.unique(seen)) == len(ds)
    for b in batches:
        for g, i, x in zip(b["__group__"], b["__index__"], b["x"], strict=True):
            assert np.array_equal(x, ref[g]["x"][i])
    # a shard skips the blocks of the others: it jumps to a point instead of inflating them
    assert any(inf.members[0][1] > SPACING for inf in opened.of(ds.files[0]["x"].path))


def _shift(column: int, by: int, *, key: str = "points") -> Callable[[dict[str, Any]], None]:
    def edit(entry: dict[str, Any]) -> None:
        for p in entry[key][1 if key == "members" else 0 :]:
            p[column] = (p[column] + by) % 8 if column == 1 and key == "points" else p[column] + by

    return edit


def _swap_windows(entry: dict[str, Any]) -> None:
    points = entry["points"]
    for a, b in zip(points[::2], points[1::2]):
        a[3:6], b[3:6] = b[3:6], a[3:6]


LIES: dict[str, tuple[FieldPlan, Callable[[dict[str, Any]], None]]] = {
    "decompressed offset a record on": (IMG, _shift(2, 256)),
    "decompressed offset a record back": (IMG, _shift(2, -256)),
    "decompressed offset a byte on": (IMG, _shift(2, 1)),
    "compressed offset a byte on": (IMG, _shift(0, 1)),
    "bit one on": (IMG, _shift(1, 1)),
    "another point's window": (IMG, _swap_windows),
    "a member start a record on": (MULTI, _shift(1, 256, key="members")),
    "a member start's byte on": (MULTI, _shift(0, 1, key="members")),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_seek_point_that_lies_is_a_stale_index_error_naming_the_index_on_every_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lie: str
) -> None:
    """Points edited as the review did, and the entry signed again as if stoker wrote it: random
    access, a resume and a shard inside the file, and a global shuffle beyond memory_budget each
    raise naming the index (the issue saw ds[750] give record 749's image with label 750)."""
    plan, edit = LIES[lie]
    ds = indexed(tmp_path, {"x": plan, "y": LAB})
    monkeypatch.setattr(decoded, "VERIFY_WHOLE_BYTES", 0)  # stream files as if they were large
    monkeypatch.setattr(records, "DEFAULT_CACHE_BYTES", 0)  # random access from points, nothing held
    loader = ds.loader(100, with_index=True, cycle_length=1)
    it = iter(loader)
    for _ in range(25):  # record 2500 of group 0, inside its one member
        next(it)
    state = loader.state_dict()
    loader.close()
    path = tmp_path / INDEX_NAME
    doc = json.loads(path.read_text())
    edit(doc["files"]["img_0000.bin.gz"])
    resign(doc["files"]["img_0000.bin.gz"])
    path.write_text(json.dumps(doc))
    ds = stoker.Dataset(ds.fields)
    ref = reference(ds)

    def named(e: BaseException) -> None:
        assert isinstance(e, stoker.StaleIndexError), repr(e)
        assert e.path == str(path) and "img_0000.bin.gz" in str(e) and "stoker index" in str(e), e

    with pytest.raises(stoker.StaleIndexError) as e:  # every point used: the lie is found
        ds.read(np.arange(0, 3000, 7))
    named(e.value)
    try:  # one point used: right (that point may be true) or refused
        assert np.array_equal(ds[2950]["x"], ref[0]["x"][2950])
    except stoker.StaleIndexError as e:
        named(e)
    for kw in ({"state": state}, {"shard": (1, 2)}, dict(shuffle="global", seed=3, memory_budget="600KiB", prefetch=2)):
        batches, err = consume(ds.loader(100, with_index=True, cycle_length=1, **kw), timeout=60)  # type: ignore[arg-type]
        if err is not None:
            named(err)
        for b in batches:  # all of it without an error, or what came before the error: right
            for g, i, x in zip(b["__group__"], b["__index__"], b["x"], strict=True):
                assert np.array_equal(x, ref[g]["x"][i]), f"{lie}: wrong record {i} of group {g} ({kw})"
