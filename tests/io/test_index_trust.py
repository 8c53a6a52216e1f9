"""The index as one generation, refused whole when malformed, and kept outside read-only data.

Each finding of an adversarial review has its test here: a re-index killed between its windows
files and its index (simulated, and a real ``kill -9``), index values no writer writes (deep
nesting, Infinity, 2**64, negative bits, huge lengths, wrong types), FIFOs and zip bombs in
place of index files, counts an index gets wrong, and read-only data directories.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

import stoker
from stoker.cli import main
from stoker.engine import decoded, records
from stoker.io import index, seekpoints
from stoker.io.index import ENV_INDEX_DIR, INDEX_NAME
from tests.helpers.data import FieldPlan, field_for, reference, resign, write_dataset
from tests.helpers.resources import consume

SPACING = 16 * 1024
IMG = FieldPlan("img", "int32", (64,), kind="gzip", header=3, footer=5)  # 256-byte records
LAB = FieldPlan("lab", "int16", (32,), kind="zlib", header=2, footer=1)  # 64-byte records
COUNTS = [2000, 900]
GLOBAL = dict(shuffle="global", seed=3, memory_budget="400KiB", prefetch=2)  # beyond it: every read from points


def fields_of(root: Path) -> dict[str, stoker.Field]:
    return {"x": field_for(root, IMG), "y": field_for(root, LAB)}


def make(root: Path, *, spacing: int = SPACING, **kw: Any) -> stoker.Dataset:
    """The two fields written under ``root`` and indexed; the Dataset that reads them through the index."""
    write_dataset(root, COUNTS, {"x": IMG, "y": LAB})
    stoker.write_index(stoker.Dataset(fields_of(root), index="ignore"), spacing=spacing, **kw)
    return stoker.Dataset(fields_of(root), **kw)


def right_or_stoker_error(ds_of: Callable[[], stoker.Dataset], truth: list[dict[str, np.ndarray]]) -> list[str]:
    """Open, read every 7th record from seek points, and shuffle globally beyond memory_budget:
    each gives exactly the files' records or a StokerError naming a file. Returns what each gave."""
    outcomes = []
    flat = {n: np.concatenate([t[n] for t in truth]) for n in truth[0]}
    try:
        ds = ds_of()
        picks = np.arange(0, sum(COUNTS), 7)
        with mock.patch.object(records, "DEFAULT_CACHE_BYTES", 0):  # nothing held decoded: points decide
            got = ds.read(picks)
        assert all(np.array_equal(got[n], flat[n][picks]) for n in flat), "wrong records from seek points"
        outcomes.append("read: right")
    except stoker.StokerError as e:
        assert e.path is not None and e.path in str(e), e
        return [f"{type(e).__name__}: {e}"]
    batches, err = consume(ds.loader(64, with_index=True, **GLOBAL), timeout=60)  # type: ignore[arg-type]
    seen = []
    for b in batches:
        for n in flat:
            want = np.stack([truth[g][n][i] for g, i in zip(b["__group__"], b["__index__"], strict=True)])
            assert np.array_equal(b[n], want), f"wrong records of {n!r} under global shuffle"
        seen += list(zip(b["__group__"].tolist(), b["__index__"].tolist(), strict=True))
    if err is None:
        assert sorted(seen) == [(g, i) for g, c in enumerate(COUNTS) for i in range(c)], "records lost"
        outcomes.append("global shuffle: right")
    else:
        assert isinstance(err, stoker.StokerError) and err.path in str(err), repr(err)
        outcomes.append(f"global shuffle: {type(err).__name__}")
    return outcomes


def windows_files(root: Path) -> set[str]:
    return {p.name for p in root.glob(".stoker-windows.*")}


def named_windows(root: Path) -> set[str]:
    doc = json.loads((root / INDEX_NAME).read_text())
    return {e["windows"] for e in doc["files"].values() if "windows" in e}


# -- one generation: a re-index killed at any moment --------------------------------------


def test_reindex_interrupted_after_its_windows_before_its_index_reads_the_old_generation(tmp_path: Path) -> None:
    ds = make(tmp_path)
    truth = reference(ds)
    old = named_windows(tmp_path)
    assert old == windows_files(tmp_path) and len(old) == 4

    def interrupted(path: str, doc: Any) -> None:
        raise KeyboardInterrupt  # Ctrl-C, OOM or kill -9 right before the index's rename

    with mock.patch.object(index, "_write_atomic", interrupted), pytest.raises(KeyboardInterrupt):
        stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=40_000)
    assert named_windows(tmp_path) == old and len(windows_files(tmp_path)) == 8  # the new ones wrote aside
    assert right_or_stoker_error(lambda: stoker.Dataset(fields_of(tmp_path)), truth) == [
        "read: right", "global shuffle: right",
    ]  # fmt: skip
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=40_000)
    assert old <= windows_files(tmp_path)  # `ds` reads through them still: kept while it lives
    assert right_or_stoker_error(lambda d=ds: d, truth) == ["read: right", "global shuffle: right"]
    del ds
    gc.collect()
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=40_000)
    assert windows_files(tmp_path) == named_windows(tmp_path) and not old & windows_files(tmp_path)
    assert right_or_stoker_error(lambda: stoker.Dataset(fields_of(tmp_path)), truth) == [
        "read: right", "global shuffle: right",
    ]  # fmt: skip


def test_windows_of_another_build_under_the_indexed_name_are_refused_naming_them(tmp_path: Path) -> None:
    ds = make(tmp_path)
    (entry_name,) = [w for w in named_windows(tmp_path) if "img_0000" in w]
    newer = tmp_path / "newer"
    newer.mkdir()
    for f in tmp_path.glob("img_0000*"):
        os.link(f, newer / f.name)  # the same data file, indexed again at another spacing
    stoker.write_index(stoker.Dataset({"x": field_for(newer, IMG)}, index="ignore"), spacing=40_000)
    (other,) = newer.glob(".stoker-windows.img_0000*")
    os.replace(other, tmp_path / entry_name)
    with pytest.raises(stoker.StaleIndexError, match=r"not the one written with the index") as e:
        read_from_points(ds)
    assert e.value.path == str(tmp_path / entry_name) and INDEX_NAME in str(e.value)


def read_from_points(ds: stoker.Dataset) -> None:
    """Every 7th record, nothing held decoded: each read starts at a seek point."""
    with mock.patch.object(records, "DEFAULT_CACHE_BYTES", 0):
        ds.read(np.arange(0, len(ds), 7))


def test_a_full_reindex_removes_old_builds_unfinished_writes_and_version_2_windows_of_its_files(
    tmp_path: Path,
) -> None:
    make(tmp_path)
    leftovers = [".stoker-windows.img_0000.bin.gz", f".stoker-windows.img_0001.bin.gz.{'ab' * 16}.x1y2z3_q.tmp",
                 f".stoker-windows.img_0001.bin.gz.{'cd' * 16}"]  # fmt: skip
    unrelated = [".stoker-windows.other.bin.gz", "img_0000.bin.gz.note"]
    for name in leftovers + unrelated:
        (tmp_path / name).write_bytes(b"x")
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=40_000)
    left = {p.name for p in tmp_path.iterdir()}
    assert not set(leftovers) & left and set(unrelated) <= left
    assert windows_files(tmp_path) - {".stoker-windows.other.bin.gz"} == named_windows(tmp_path)


_KILL_BEFORE_RENAME = """
import os, signal, sys
from stoker.io import index
from stoker.cli import main
def killed(path, doc):
    os.kill(os.getpid(), signal.SIGKILL)
index._write_atomic = killed
sys.exit(main(sys.argv[1:]))
"""
# Says when its imports are done, so a kill can be timed within the work itself.
_PLAIN = "import sys\nfrom stoker.cli import main\nprint('ready', flush=True)\nsys.exit(main(sys.argv[1:]))\n"


def _stoker_index(root: Path, spacing: int, script: str = _PLAIN) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(stoker.__file__).parents[1])}
    argv = [sys.executable, "-c", script, "index", "--config", str(_config(root)), "--spacing", str(spacing)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ready(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"


@pytest.mark.slow
def test_kill_9_of_stoker_index_at_any_moment_leaves_right_records_or_a_stoker_error(tmp_path: Path) -> None:
    """A real SIGKILL: once exactly before the index's rename, then at spread moments of a run."""
    ds = make(tmp_path)
    truth = reference(ds)
    proc = _stoker_index(tmp_path, 40_000, _KILL_BEFORE_RENAME)
    assert proc.wait(timeout=120) == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    assert len(windows_files(tmp_path)) > len(named_windows(tmp_path))  # killed with new windows aside
    assert right_or_stoker_error(lambda: stoker.Dataset(fields_of(tmp_path)), truth) == [
        "read: right", "global shuffle: right",
    ]  # fmt: skip
    proc = _stoker_index(tmp_path, 24_000)
    _ready(proc)
    t = time.perf_counter()
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    work = time.perf_counter() - t  # scanning, windows files (each fsync'ed), the index
    states = set()
    spacing = [SPACING, 40_000, 24_000, 20_000, 32_000]
    for k, fraction in enumerate([0.1, 0.3, 0.5, 0.7, 0.9]):
        proc = _stoker_index(tmp_path, spacing[k])
        _ready(proc)
        time.sleep(work * fraction)
        proc.kill()
        proc.wait(timeout=60)
        states.add((len(windows_files(tmp_path)), len(named_windows(tmp_path))))
        outcome = right_or_stoker_error(lambda: stoker.Dataset(fields_of(tmp_path)), truth)
        assert outcome == ["read: right", "global shuffle: right"] or "Error" in outcome[0], outcome
    print(f"after each kill, (windows files, windows the index names): {sorted(states)}")


# -- index values no writer writes: a StaleIndexError naming the index and the entry ----------------


def _edit_entry(root: Path, base: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    path = root / INDEX_NAME
    doc = json.loads(path.read_text())
    edit(doc["files"][base])
    path.write_text(json.dumps(doc))
    return path


def _set(key: str, *at: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(entry: dict[str, Any]) -> None:
        target: Any = entry
        if not at:
            entry[key] = value
            return
        target = entry[key]
        for i in at[:-1]:
            target = target[i]
        target[at[-1]] = value

    return edit


MALFORMED = {
    "a huge float": (_set("decompressed_bytes", value=1e300), r"decompressed_bytes is 1e\+300"),
    "2**64 offset": (_set("points", 0, 0, value=2**64), r"points\[0\]\[0\] is 18446744073709551616"),
    "negative bit": (_set("points", 0, 1, value=-1), r"points\[0\]\[1\] is -1"),
    "window length 10**12": (_set("points", 0, 4, value=10**12), r"points\[0\]\[4\] is 1000000000000"),
    "a string offset": (_set("members", 0, 0, value="0"), r"members\[0\]\[0\] is '0'"),
    "a float offset": (_set("points", 1, 2, value=65516.0), r"points\[1\]\[2\] is 65516.0"),
    "a bool bit": (_set("points", 0, 1, value=True), r"points\[0\]\[1\] is True"),
    "null members": (_set("members", value=None), r"members is None"),
    "a point of 6": (_set("points", 0, value=[1, 2, 3, 4, 5, 6]), r"points\[0\] is \[1, 2, 3, 4, 5, 6\]"),
    "an object entry": (lambda e: e.update(points={"a": 1}), r"points is \{'a': 1\}"),
    "windows elsewhere": (_set("windows", value="../secret"), r"windows is '../secret'"),
    "windows absolute": (_set("windows", value="/etc/passwd"), r"windows is '/etc/passwd'"),
    "build not hex": (_set("build", value="zz"), r"build is 'zz'"),
    "a second member before the first": (lambda e: e["members"].append([0, 0, 0]), r"members\[1\]"),
    "edited, check not": (_set("points", 0, 2, value=1), r"check \d+ is not the CRC-32 of its values"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_entry_is_a_stale_index_error_naming_index_entry_and_value(tmp_path: Path, case: str) -> None:
    make(tmp_path)
    edit, says = MALFORMED[case]
    path = _edit_entry(tmp_path, "img_0000.bin.gz", edit)
    with pytest.raises(stoker.StaleIndexError, match=rf"{INDEX_NAME}.*entry 'img_0000\.bin\.gz'.*{says}") as e:
        stoker.Dataset(fields_of(tmp_path))
    assert e.value.path == str(path) and e.value.field == "x" and "\n" not in str(e.value)
    stoker.Dataset(fields_of(tmp_path), index="rebuild")  # rebuild replaces what it refused
    assert len(stoker.Dataset(fields_of(tmp_path))) == sum(COUNTS)


@pytest.mark.parametrize(
    "text, says",
    [
        ("[" * 100_000 + "]" * 100_000, "RecursionError"),
        ('{"format": "stoker-index", "version": 3, "files": {"a": ' + "9" * 5000 + "}}", "digits"),
        ('{"format": "stoker-index", "version": 3, "files": {"a": {"size": Infinity}}}', "Infinity is not a number"),
        ('{"format": "stoker-index", "version": 3, "files": {"a": [NaN]}}', "NaN is not a number"),
        ("\xff\xfe{", "cannot be read"),
    ],
    ids=["deep nesting", "5000 digits", "Infinity", "NaN", "not UTF-8"],
)
def test_an_index_file_no_parser_takes_is_a_stale_index_error_naming_it(tmp_path: Path, text: str, says: str) -> None:
    make(tmp_path)
    (tmp_path / INDEX_NAME).write_bytes(text.encode("latin-1"))
    with pytest.raises(stoker.StaleIndexError, match=rf"{INDEX_NAME}.*{says}") as e:
        stoker.Dataset(fields_of(tmp_path))
    assert e.value.path == str(tmp_path / INDEX_NAME)


def test_an_index_of_version_2_is_refused_with_how_to_rebuild_then_rebuilt(tmp_path: Path) -> None:
    make(tmp_path)
    path = tmp_path / INDEX_NAME
    doc = json.loads(path.read_text())
    doc["version"] = 2
    path.write_text(json.dumps(doc))
    (tmp_path / ".stoker-windows.img_0000.bin.gz").write_bytes(b"STKWIN01")  # what version 2 wrote
    with pytest.raises(stoker.StaleIndexError, match=r"version 2, this stoker reads version 3; rebuild it with "
                       r"`stoker index` or Dataset\(\.\.\., index='rebuild'\)"):  # fmt: skip
        stoker.Dataset(fields_of(tmp_path))
    stoker.Dataset(fields_of(tmp_path), index="rebuild")
    assert json.loads(path.read_text())["version"] == 3
    assert not (tmp_path / ".stoker-windows.img_0000.bin.gz").exists()


@contextlib.contextmanager
def never_hangs(path: Path, timeout: float = 20.0) -> Iterator[Callable[[Callable[[], Any]], Any]]:
    """Run a call in a thread; fail instead of hanging if it blocks (a FIFO's open), then unblock it."""

    def run(call: Callable[[], Any]) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = call()
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            with contextlib.suppress(OSError):  # a writer lets a blocked reader's open() return
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            t.join(5)
            pytest.fail(f"blocked on {path} for {timeout}s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    yield run


def test_a_fifo_in_place_of_the_index_is_refused_not_waited_on(tmp_path: Path) -> None:
    make(tmp_path)
    path = tmp_path / INDEX_NAME
    path.unlink()
    os.mkfifo(path)
    with never_hangs(path) as run, pytest.raises(stoker.StaleIndexError, match=r"is not a regular file") as e:
        run(lambda: stoker.Dataset(fields_of(tmp_path)))
    assert e.value.path == str(path)


def test_a_fifo_in_place_of_a_windows_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    ds = make(tmp_path)
    (name,) = [w for w in named_windows(tmp_path) if "img_0000" in w]
    sidecar = tmp_path / name
    sidecar.unlink()
    os.mkfifo(sidecar)
    with never_hangs(sidecar) as run, pytest.raises(stoker.StaleIndexError, match=r"is not a regular file") as e:
        run(lambda: read_from_points(ds))
    assert e.value.path == str(sidecar) and INDEX_NAME in str(e.value)


def test_a_zip_bomb_window_is_refused_in_bounded_time_and_memory(tmp_path: Path) -> None:
    ds = make(tmp_path)
    (name,) = [w for w in named_windows(tmp_path) if "img_0000" in w]
    sidecar = tmp_path / name
    bomb = zlib.compress(b"\0" * (30 << 20), 9)  # 30 MiB from ~30 KB: within a window's largest length
    assert len(bomb) <= seekpoints.MAX_PACKED
    offset = sidecar.stat().st_size
    with sidecar.open("ab") as f:
        f.write(bomb)

    def aim(entry: dict[str, Any]) -> None:
        for p in entry["points"]:
            p[3:5] = [offset, len(bomb)]
        resign(entry)  # a consistent edit: only the window's own checks stand in the way

    _edit_entry(tmp_path, "img_0000.bin.gz", aim)
    ds = stoker.Dataset(fields_of(tmp_path))
    tracemalloc.start()
    t = time.perf_counter()
    try:
        with pytest.raises(stoker.StaleIndexError, match=r"does not hold one window of at most 32768 bytes") as e:
            read_from_points(ds)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.path == str(sidecar)
    assert peak < 8 << 20, f"{peak} bytes allocated to refuse a window"  # not the bomb's 30 MiB
    assert time.perf_counter() - t < 30  # a bound against a hang, not a timing claim


# -- counts an index gets wrong: confirmed at the stream's end, the index named -------------------


@pytest.mark.parametrize("records", [-3, 3], ids=["understated", "overstated"])
def test_a_count_the_index_gets_wrong_is_a_stale_index_error_naming_it_on_every_path(
    tmp_path: Path, records: int
) -> None:
    """Both fields' entries edited alike and signed: they still pair, so only reading can tell."""
    ds = make(tmp_path)
    truth = reference(ds)
    for base, plan in [("img_0000.bin.gz", IMG), ("lab_0000.bin.zz", LAB)]:
        rb = int(np.prod(plan.shape)) * np.dtype(plan.dtype).itemsize

        def edit(entry: dict[str, Any], rb: int = rb) -> None:
            entry["decompressed_bytes"] += records * rb
            entry["points"] = [p for p in entry["points"] if p[2] <= entry["decompressed_bytes"]]
            resign(entry)

        path = _edit_entry(tmp_path, base, edit)
    ds = stoker.Dataset(fields_of(tmp_path))
    assert ds.records_in(0) == COUNTS[0] + records  # opening believes it: the checks come when reading
    says = rf"{INDEX_NAME}"
    # global shuffle beyond memory_budget: every point's check binds the file's size
    batches, err = consume(ds.loader(64, with_index=True, **GLOBAL), timeout=60)  # type: ignore[arg-type]
    assert isinstance(err, stoker.StaleIndexError) and err.path == str(path), repr(err)
    # a stream from the file's start (files decoded whole, and streamed as large files are)
    for whole in (True, False):
        with mock.patch.object(decoded, "VERIFY_WHOLE_BYTES", 1 << 40 if whole else 0):
            batches, err = consume(ds.loader(100, with_index=True, cycle_length=1), timeout=60)
        assert isinstance(err, stoker.StaleIndexError), repr(err)
        assert err.path == str(path) and re.search(says, str(err)) and "gzip trailer" not in str(err)
        for b in batches:  # what came before the error is right
            for g, i, x in zip(b["__group__"], b["__index__"], b["x"], strict=True):
                assert np.array_equal(x, truth[g]["x"][i])
    # ds[i] on a file small enough to decode whole
    with pytest.raises(stoker.StaleIndexError, match=says) as e:
        stoker.Dataset(fields_of(tmp_path))[5]
    assert e.value.path == str(path)


# -- the index outside the data: index_dir, $STOKER_INDEX_DIR, read-only data ---------------------


def _scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths of every file the index pass decompresses."""
    seen: list[str] = []
    scan = seekpoints.scan_file

    def scanning(path: str, kind: str, **kw: Any) -> seekpoints.Scan:
        seen.append(path)
        return scan(path, kind, **kw)

    monkeypatch.setattr(seekpoints, "scan_file", scanning)
    return seen


def test_index_dir_keeps_the_index_elsewhere_and_reads_through_it(tmp_path: Path, monkeypatch) -> None:
    data, other = tmp_path / "data", tmp_path / "indexes"
    write_dataset(data, COUNTS, {"x": IMG, "y": LAB})
    before = {p.name for p in data.iterdir()}
    cfg = _config(data)
    assert main(["index", "--config", str(cfg), "--spacing", str(SPACING), "--index-dir", str(other)]) == 0
    assert {p.name for p in data.iterdir()} == before  # nothing written beside the data
    (home,) = other.iterdir()
    assert home.name.startswith("data-") and (home / INDEX_NAME).exists() and windows_files(home)
    assert json.loads((home / INDEX_NAME).read_text())["data_dir"] == str(data)
    scans = _scans(monkeypatch)
    ds = stoker.Dataset(fields_of(data), index_dir=other)
    assert len(ds) == sum(COUNTS) and not scans
    assert all(p.window is None or p.window.path.startswith(str(home)) for p in ds._catalog.seek_points[(0, "x")])
    truth = reference(ds)
    assert right_or_stoker_error(lambda: stoker.Dataset(fields_of(data), index_dir=other), truth) == [
        "read: right", "global shuffle: right",
    ]  # fmt: skip
    plain = stoker.Dataset(fields_of(data))  # no index_dir, no variable: none beside the data
    assert not plain._catalog.seek_points


def test_the_environment_variable_names_the_index_dir_and_the_argument_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, other, third = tmp_path / "data", tmp_path / "env", tmp_path / "arg"
    write_dataset(data, COUNTS, {"x": IMG, "y": LAB})
    monkeypatch.setenv(ENV_INDEX_DIR, str(other))
    assert main(["index", "--config", str(_config(data)), "--spacing", str(SPACING)]) == 0
    assert not (data / INDEX_NAME).exists() and len(list(other.iterdir())) == 1
    assert stoker.Dataset(fields_of(data))._catalog.seek_points  # found through the variable
    assert not stoker.Dataset(fields_of(data), index_dir=third)._catalog.seek_points  # the argument wins
    with pytest.raises(stoker.SpecError, match="index_dir=5"):
        stoker.Dataset(fields_of(data), index_dir=5)  # type: ignore[arg-type]


def _config(data: Path) -> Path:
    """A config file of the two fields under ``data`` (header/footer bytes need one), beside ``data``."""
    cfg = data.parent / f"{data.name}-fields.toml"
    cfg.write_text(
        f'[fields.x]\nfiles = "{data}/img_*.bin.gz"\ndtype = "int32"\nshape = [64]\nheader_bytes = 3\n'
        "footer_bytes = 5\n"
        f'[fields.y]\nfiles = "{data}/lab_*.bin.zz"\ndtype = "int16"\nshape = [32]\nheader_bytes = 2\n'
        "footer_bytes = 1\n"
    )
    return cfg


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """A read-only view of a directory, as NFS exports or mounted buckets give.

    As root, permission bits stop nothing, so a read-only bind mount is made (the kernel then
    refuses every write with EROFS, as it would on a read-only NFS mount); as another user the
    directory is made unwritable (EACCES). Either way the test first shows a write really fails.
    """
    mounts: list[Path] = []
    chmodded: list[Path] = []

    def make_read_only(src: Path) -> Path:
        if os.geteuid() != 0:
            src.chmod(0o555)
            chmodded.append(src)
            view = src
        else:
            view = tmp_path / f"read-only-{len(mounts)}"
            view.mkdir()
            bind = subprocess.run(["mount", "--bind", str(src), str(view)], capture_output=True, text=True)
            if bind.returncode:
                pytest.skip(f"running as root and cannot bind-mount to make a read-only directory: {bind.stderr}")
            mounts.append(view)
            ro = subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True, text=True)
            if ro.returncode:
                pytest.skip(f"cannot remount the bind mount read-only: {ro.stderr}")
        with pytest.raises(OSError):  # the directory is really read-only to this process
            (view / "probe").write_bytes(b"")
        return view

    yield make_read_only
    for m in reversed(mounts):
        subprocess.run(["umount", str(m)], check=False)
    for c in chmodded:
        c.chmod(0o755)


def test_read_only_data_is_a_one_line_error_naming_it_before_any_work_then_index_dir_works(
    tmp_path: Path, read_only: Callable[[Path], Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    src = tmp_path / "data"
    write_dataset(src, COUNTS, {"x": IMG, "y": LAB})
    data = read_only(src)
    scans = _scans(monkeypatch)
    assert main(["index", "--config", str(_config(data)), "--spacing", str(SPACING)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("WriteError: ") and repr(str(data)) in err
    assert "--index-dir" in err and "index_dir" in err and ENV_INDEX_DIR in err
    with pytest.raises(stoker.WriteError, match=rf"{str(data)!r} is not writable") as e:
        stoker.Dataset(fields_of(data), index="rebuild")
    assert e.value.path == str(data) and isinstance(e.value, OSError)
    assert scans == []  # refused before decompressing anything
    other = tmp_path / "indexes"
    assert main(["index", "--config", str(_config(data)), "--spacing", str(SPACING), "--index-dir", str(other)]) == 0
    assert len(scans) == 4
    ds = stoker.Dataset(fields_of(data), index_dir=other)
    truth = reference(ds)
    assert right_or_stoker_error(lambda: stoker.Dataset(fields_of(data), index_dir=other), truth) == [
        "read: right", "global shuffle: right",
    ]  # fmt: skip
    stoker.Dataset(fields_of(data), index="rebuild", index_dir=other)  # nothing stale: nothing written


def test_an_unwritable_index_dir_is_a_write_error_naming_it(tmp_path: Path, read_only: Callable[[Path], Path]) -> None:
    src, locked = tmp_path / "data", tmp_path / "locked"
    write_dataset(src, COUNTS, {"x": IMG, "y": LAB})
    locked.mkdir()
    view = read_only(locked)
    with pytest.raises(stoker.WriteError, match=r"index directory .* is not writable") as e:
        stoker.write_index(stoker.Dataset(fields_of(src), index="ignore"), index_dir=view)
    assert e.value.path is not None and e.value.path.startswith(str(view))


def test_rebuild_over_a_writable_and_a_read_only_directory_scans_nothing_before_refusing(
    tmp_path: Path, read_only: Callable[[Path], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    writable, src = tmp_path / "writable", tmp_path / "src"
    write_dataset(writable, COUNTS, {"x": IMG})
    write_dataset(src, COUNTS, {"y": LAB})
    data = read_only(src)
    scans = _scans(monkeypatch)
    with pytest.raises(stoker.WriteError, match=re.escape(repr(str(data)))):
        stoker.Dataset({"x": field_for(writable, IMG), "y": field_for(data, LAB)}, index="rebuild")
    assert scans == [] and not (writable / INDEX_NAME).exists()


def test_a_data_file_with_a_name_near_the_limit_gets_windows_under_a_shortened_name(tmp_path: Path) -> None:
    long = "img_" + "n" * 226 + "_0000.bin.gz"  # 242 bytes: a windows file named after it whole would not fit
    write_dataset(tmp_path, [2000], {"x": IMG})
    os.rename(tmp_path / "img_0000.bin.gz", tmp_path / long)
    fields = {"x": stoker.Field(str(tmp_path / "img_*.bin.gz"), "int32", (64,), header_bytes=3, footer_bytes=5)}
    for spacing in (SPACING, 40_000):  # and again: the first build's windows file is found and removed
        stoker.write_index(stoker.Dataset(fields, index="ignore"), spacing=spacing)
        assert windows_files(tmp_path) == named_windows(tmp_path) and len(named_windows(tmp_path)) == 1
    assert all(len(n) <= 255 - 14 for n in windows_files(tmp_path))
    ds = stoker.Dataset(fields)
    with mock.patch.object(records, "DEFAULT_CACHE_BYTES", 0):
        assert np.array_equal(ds.read(np.arange(0, 2000, 7))["x"], reference(ds)[0]["x"][::7])
