"""The index shared: two writers of one index directory, and a re-index under a running job."""

from __future__ import annotations

import gc
import gzip
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import stoker
from stoker.cli import main
from stoker.engine import records
from stoker.io import indexlock
from stoker.io.index import INDEX_NAME
from tests.helpers.data import FieldPlan, field_for, reference, write_dataset
from tests.helpers.resources import consume

IMG = FieldPlan("img", "int32", (64,), kind="gzip")  # 256-byte records: many seek points per file
COUNTS = [2000, 1500, 900]
SRC = str(Path(stoker.__file__).parents[1])


def fields_of(root: Path) -> dict[str, stoker.Field]:
    return {"x": field_for(root, IMG)}


def windows_files(root: Path) -> set[str]:
    return {p.name for p in root.glob(".stoker-windows.*")}


def named_windows(root: Path) -> set[str]:
    doc = json.loads((root / INDEX_NAME).read_text())
    return {e["windows"] for e in doc["files"].values() if "windows" in e}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


# Each writer, once its windows files are written, waits (a bounded while) for the other to have
# written its own before it writes the index: the interleaving two unlocked writers can take.
_WRITER = textwrap.dedent("""
    import os, sys, time
    import stoker
    from stoker.io import index
    me, peer, pattern, spacing = sys.argv[1:5]
    save = index._save
    def meet_then_save(*args, **kwargs):
        open(me, "w").close()
        deadline = time.monotonic() + 3
        while not os.path.exists(peer) and time.monotonic() < deadline:
            time.sleep(0.01)
        return save(*args, **kwargs)
    index._save = meet_then_save
    ds = stoker.Dataset(x=stoker.Field(pattern, "int32", (64,)), index="ignore")
    stoker.write_index(ds, spacing=int(spacing))
""")


def test_two_writers_at_once_leave_one_complete_index_whose_windows_all_exist(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_dataset(data, COUNTS, {"x": IMG})
    truth = reference(stoker.Dataset(fields_of(data), index="ignore"))
    pattern = str(data / "img_*.bin.gz")
    a, b = tmp_path / "a.scanned", tmp_path / "b.scanned"
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(me), str(peer), pattern, str(spacing)], env=env())
        for me, peer, spacing in [(a, b, 16_384), (b, a, 40_000)]
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0]
    named = named_windows(data)
    assert named and named == windows_files(data)  # every file it names exists, and nothing else is left
    ds = stoker.Dataset(fields_of(data))
    with mock.patch.object(records, "DEFAULT_CACHE_BYTES", 0):  # every read starts at a seek point
        got = ds.read(np.arange(0, len(ds), 7))
    assert np.array_equal(got["x"], np.concatenate([t["x"] for t in truth])[::7])


_HOLDER = textwrap.dedent("""
    import sys
    from stoker.io import indexlock
    with indexlock.writing([sys.argv[1]]):
        print("holding", flush=True)
        sys.stdin.read()  # until the test closes it
""")


def test_a_writer_that_waited_its_limit_fails_naming_the_index_directory_and_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dataset(tmp_path, COUNTS[:1], {"x": IMG})
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], env=env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        ds = stoker.Dataset(fields_of(tmp_path), index="ignore")
        with pytest.raises(stoker.WriteError, match=rf"index directory '{tmp_path}' is being written") as e:
            stoker.write_index(ds, wait=0.2)
        assert e.value.path == str(tmp_path) and f"pid {holder.pid} on " in str(e.value)
        pattern = str(tmp_path / "img_*.bin.gz")
        assert main(["index", "--field", f"x={pattern}:int32:64", "--wait", "0"]) != 0
        assert f"WriteError: index directory '{tmp_path}'" in capsys.readouterr().err
        assert not (tmp_path / INDEX_NAME).exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), wait=0)  # free again
    assert (tmp_path / INDEX_NAME).exists()


def test_a_reindex_at_another_spacing_leaves_a_running_job_its_seek_points(tmp_path: Path) -> None:
    write_dataset(tmp_path, COUNTS, {"x": IMG})
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=16_384)
    ds = stoker.Dataset(fields_of(tmp_path))
    truth = reference(ds)
    old = named_windows(tmp_path)
    reindex = [sys.executable, "-m", "stoker.cli", "index", "--field", f"x={tmp_path}/img_*.bin.gz:int32:64",
               "--spacing", "40000"]  # fmt: skip
    epochs = 3

    def job(ds: stoker.Dataset) -> Iterator[dict[str, np.ndarray]]:
        loader = ds.loader(64, with_index=True, shuffle="global", seed=5, memory_budget="400KiB", prefetch=2)
        with loader:
            for epoch in range(epochs):
                for k, batch in enumerate(loader):
                    yield batch
                    if (epoch, k) == (0, 5):  # mid-pass: another process re-indexes and removes what it replaced
                        subprocess.run(reindex, env=env(), check=True, timeout=120, capture_output=True)
                        assert named_windows(tmp_path).isdisjoint(old)

    with mock.patch.object(records, "DEFAULT_CACHE_BYTES", 0):  # nothing held decoded: every read from a point
        batches, err = consume(job(ds), timeout=120)
    assert err is None, repr(err)
    seen = []
    for b in batches:
        want = np.stack([truth[g]["x"][i] for g, i in zip(b["__group__"], b["__index__"], strict=True)])
        assert np.array_equal(b["x"], want)
        seen += list(zip(b["__group__"].tolist(), b["__index__"].tolist(), strict=True))
    assert sorted(seen) == sorted([(g, i) for g, c in enumerate(COUNTS) for i in range(c)] * epochs)
    del ds, batches
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=40_000)
    assert windows_files(tmp_path) == named_windows(tmp_path)  # the job gone, its generation goes too


def test_a_data_change_under_a_job_is_still_a_stale_index_error_naming_the_file(tmp_path: Path) -> None:
    paths = write_dataset(tmp_path, COUNTS, {"x": IMG})["x"]
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=16_384)
    ds = stoker.Dataset(fields_of(tmp_path))
    changed = paths[0]
    changed.write_bytes(gzip.compress(gzip.decompress(changed.read_bytes()), compresslevel=9))  # same records
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=40_000)
    with mock.patch.object(records, "DEFAULT_CACHE_BYTES", 0), pytest.raises(stoker.StokerError) as e:
        ds.read(np.arange(100, COUNTS[0], 50))
    # The file is not the one the Dataset was built on: refused as such, before its index is consulted.
    assert "changed since the Dataset was built" in str(e.value) or isinstance(e.value, stoker.StaleIndexError)
    assert e.value.path is not None and e.value.path in str(e.value)


def test_a_process_reading_through_the_index_holds_its_readers_lock_until_its_dataset_goes(tmp_path: Path) -> None:
    write_dataset(tmp_path, COUNTS[:1], {"x": IMG})
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=16_384)
    ds = stoker.Dataset(fields_of(tmp_path))
    assert readers_lock_seen(tmp_path) == "held"
    del ds
    gc.collect()
    assert readers_lock_seen(tmp_path) == "free"


def test_a_forked_child_holds_its_own_readers_lock_after_the_parent_lets_go(tmp_path: Path) -> None:
    write_dataset(tmp_path, COUNTS[:1], {"x": IMG})
    stoker.write_index(stoker.Dataset(fields_of(tmp_path), index="ignore"), spacing=16_384)
    ds = stoker.Dataset(fields_of(tmp_path))
    go, done = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child holds ds until the parent closes the pipe, then leaves
        try:
            os.close(done)
            os.read(go, 1)
        finally:
            os._exit(0)
    os.close(go)
    try:
        del ds
        gc.collect()
        assert readers_lock_seen(tmp_path) == "held"  # by the child's copy of ds: record locks are per process
    finally:
        os.close(done)
        os.waitpid(pid, 0)
    assert readers_lock_seen(tmp_path) == "free"


_PROBE = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("free")
    except OSError:
        print("held")
""")


def readers_lock_seen(root: Path) -> str:
    """ "held" while some other process reads through the index in `root`, else "free"."""
    lock = str(root / indexlock.READERS_LOCK)
    return subprocess.run([sys.executable, "-c", _PROBE, lock], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()  # fmt: skip
