"""loader.stats(): counters from live loaders on real files, and the verdict read from them."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import stoker
import stoker.loader
from stoker import kernels
from stoker.doctor import verdict
from stoker.engine.autotune import ThreadTuner
from stoker.engine.stats import CPU_SAMPLE_SECONDS, LoaderStats
from stoker.io.files import open_local
from stoker.io.readahead import Readahead, drop_behind_for
from stoker.machine import physical_memory
from stoker.testing import assert_same_batches
from tests.helpers.data import LAB_GZ, FieldPlan, build, check_batches

WIDE_GZ = FieldPlan("wide", "int16", (64, 64), kind="gzip")
WIDE_RAW = FieldPlan("wide", "int16", (64, 64))


def _changed(err: BaseException | None) -> bool:
    """Whether `err` is the refusal of a file changed since the Dataset was built."""
    return isinstance(err, stoker.CorruptDataError) and "changed since the Dataset was built" in str(err)


def test_stats_before_any_batch_are_zero_and_say_so(pair_ds: stoker.Dataset) -> None:
    with pair_ds.loader(4) as loader:
        s = loader.stats()
        assert (s.batches, s.records, s.seconds, s.records_per_s) == (0, 0, 0.0, 0.0)
        assert "no batches" in verdict(s)


def test_stats_count_batches_records_and_bytes_per_field(pair_ds: stoker.Dataset) -> None:
    with pair_ds.loader(4, cast={"image": "float32"}, epochs=2) as loader:
        batches = list(loader)
        s = loader.stats()
    assert s.batches == len(batches)
    assert s.records == 2 * len(pair_ds)
    assert s.bytes == {n: sum(b[n].nbytes for b in batches) for n in ("image", "label")}
    assert s.bytes["image"] == 2 * len(pair_ds) * 36 * 4  # float32 out of int8 (6, 6, 1)
    assert s.source_bytes == 2 * len(pair_ds) * (36 + 4)
    assert (s.threads, s.prefetch, s.batch_size) == (loader.threads, loader.prefetch, 4)
    assert s.dtypes == {"image": "float32", "label": "float32"}


def test_stages_name_what_each_field_went_through(pair_ds: stoker.Dataset) -> None:
    with pair_ds.loader(4, cast={"image": "float32"}) as loader:
        list(loader)
        cast = loader.stats().field_stage_seconds
    with pair_ds.loader(4) as loader:
        list(loader)
        plain = loader.stats().field_stage_seconds
    assert cast["image"]["read+cast"] > 0 and "read" not in cast["image"]
    assert plain["image"]["read"] > 0 and "read+cast" not in plain["image"]
    assert cast["label"]["decompress"] > 0
    with pair_ds.loader(4, shuffle="global", seed=3) as loader:
        list(loader)
        shuffled = loader.stats().field_stage_seconds
    assert shuffled["image"]["gather"] > 0 and shuffled["label"]["gather"] > 0


def test_worker_stage_times_add_up_to_their_busy_time(tmp_path: Path) -> None:
    ds = build(tmp_path, [300] * 4, {"wide": WIDE_GZ, "label": LAB_GZ})
    with ds.loader(32, cast="float32") as loader:
        list(loader)
        s = loader.stats()
    stages = s.stage_seconds
    assert s.busy_seconds > 0
    assert sum(stages.values()) == pytest.approx(s.busy_seconds, rel=1e-6)
    assert s.stage_table()[0][2] == max(t for _, _, t, _ in s.stage_table())


def test_a_sleeping_consumer_is_counted_as_consumer_time_and_diagnosed_consumer_bound(
    pair_ds: stoker.Dataset,
) -> None:
    with pair_ds.loader(4) as loader:
        n = 0
        for _ in loader:
            time.sleep(0.02)
            n += 1
        s = loader.stats()
    assert s.consumer_seconds >= 0.02 * (n - 1)
    assert s.consumer_fraction > 0.5
    assert s.seconds == pytest.approx(s.wait_seconds + s.consumer_seconds)
    v = verdict(s)
    assert v.startswith("consumer-bound: the pipeline waits on you")
    assert f"{s.consumer_fraction:.0%}" in v


def test_a_compressed_wide_field_is_diagnosed_as_decompression_bound(tmp_path: Path) -> None:
    # 16 MiB of int16 per file to inflate: far more work than anything else in the batch.
    ds = build(tmp_path, [2048] * 3, {"wide": WIDE_GZ, "label": FieldPlan("lab", "float32")})
    with ds.loader(256, threads=1) as loader:
        for _ in loader:
            pass
        s = loader.stats()
    stage, name, _, _ = s.stage_table()[0]
    assert (stage, name) == ("decompress", "wide")
    assert "install isal" in verdict(s, backend="zlib")
    assert "decompression of field 'wide'" in verdict(s, backend="isal")
    # One thread on a machine with more cores: the setting that moves it is threads=.
    if s.cores > 1:
        assert "raise threads= (now 1" in verdict(s, backend="isal")


def test_near_the_ceiling_the_verdict_says_the_copy_is_the_limit(tmp_path: Path) -> None:
    ds = build(tmp_path, [300] * 2, {"wide": WIDE_RAW})
    with ds.loader(64, cast="float32") as loader:
        list(loader)
        s = loader.stats()
    assert verdict(s, 0.93).startswith("at 93% of this machine's ceiling: the copy is the limit")
    # A pass this short can look blocked or starved (see the per-batch test); the stage verdict here.
    below = verdict(dataclasses.replace(s, busy_runnable_seconds=None, assemble_seconds=0.0), 0.5)
    assert "at 50% of the ceiling" in below and "'wide'" in below


def test_stats_survive_json_and_print_one_screen(pair_ds: stoker.Dataset) -> None:
    with pair_ds.loader(4, epochs=1) as loader:
        list(loader)
        s = loader.stats()
    again = LoaderStats.from_dict(json.loads(json.dumps(s.to_dict())))
    assert again == s
    text = str(s)
    assert "records/s" in text and f"threads={s.threads}" in text and "worker time by stage" in text
    assert s.cpu_utilization >= 0 and s.cpu_seconds >= 0
    # Where the busy time went (a worker's first batch is sampled: known even on a short pass).
    split = re.search(r"workers' busy time: on a CPU (\d+)%, waiting for a CPU (\d+)%, blocked (\d+)%", text)
    assert split is not None, text
    assert abs(sum(int(x) for x in split.groups()) - 100) <= 2
    fixed = dataclasses.replace(s, busy_seconds=2.0, busy_cpu_seconds=1.0, busy_runnable_seconds=0.5)
    assert (
        fixed.busy_split
        == "workers' busy time: on a CPU 50%, waiting for a CPU 25%, blocked 25% (a lock, the GIL, a read)"
    )
    assert dataclasses.replace(s, busy_runnable_seconds=None).busy_split == ""
    assert "workers' busy time" not in str(dataclasses.replace(s, busy_runnable_seconds=None))


def test_stats_accumulate_over_passes_and_stay_readable_after_close(pair_ds: stoker.Dataset) -> None:
    loader = pair_ds.loader(8)
    list(loader)
    list(loader)
    loader.close()
    s = loader.stats()
    assert s.records == 2 * len(pair_ds)
    assert np.isfinite(s.records_per_s)


@pytest.mark.parametrize("cast", [None, "float32"])
def test_dropping_pages_behind_the_reader_changes_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cast: str | None
) -> None:
    ds = build(tmp_path, [700, 300, 900], {"wide": WIDE_RAW, "label": LAB_GZ})
    # As for a dataset larger than half the RAM.
    monkeypatch.setattr(stoker.loader, "drop_behind_for", lambda raw_bytes: True)
    loader = ds.loader(64, cast=cast, with_index=True, epochs=2)
    with loader:
        check_batches(ds, loader, cast={"wide": cast} if cast else None, epochs=2)
        assert "drop behind" in loader.stats().tuning["readahead"]


def test_only_datasets_larger_than_half_the_ram_drop_pages_behind(pair_ds: stoker.Dataset) -> None:
    ram = physical_memory()
    assert drop_behind_for(ram // 2 + 1) and not drop_behind_for(ram // 2)
    assert pair_ds.loader(4).drop_behind is False


def _evict(fd: int, size: int) -> None:
    """Drop the file's pages; pages still in another CPU's LRU batch survive one DONTNEED.

    Checked at 2 MiB: a RWF_NOWAIT read that misses starts the kernel's readahead from its own
    offset forward, so checking the page the test asks about next would bring it back.
    """
    probe = bytearray(1)
    for _ in range(200):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [probe], 2 << 20, os.RWF_NOWAIT)
        except BlockingIOError:
            return
        time.sleep(0.01)
    raise AssertionError("the kernel kept the test file's pages cached")


def test_readahead_advises_only_ranges_that_are_not_cached_already(tmp_path: Path) -> None:
    path = tmp_path / "frames.bin"
    size = 8 << 20
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written back, so the kernel can drop its pages below
        os.pread(fd, size, 0)  # every page cached: the advice would cost time and buy nothing
        warm = Readahead(drop_behind=False)
        assert warm.after_read(fd, None, size, 0, 1 << 20) is True  # the rest is cached: stop advising
        assert warm.advised == 0
        _evict(fd, size)  # cold: the range ahead must be asked for
        cold = Readahead(drop_behind=False)
        assert cold.after_read(fd, None, size, 0, 1 << 20) is False
        assert cold.advised == 1
        assert cold.after_read(fd, None, size, 1 << 20, 1 << 20, ahead=False) is False  # caller said stop
        assert cold.advised == 1
        cold.after_read(fd, None, size, size - (1 << 20), 1 << 20)  # nothing left ahead of the end
        assert cold.advised == 1
    finally:
        os.close(fd)


def _cached(fd: int, offset: int) -> bool:
    try:
        return os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT) == 1
    except BlockingIOError:
        return False


def _wait_cached(cached: Callable[[int, int], bool], fd: int, offset: int, length: int) -> None:
    """Poll until ``cached`` sees both ends of the record at ``offset`` of ``fd`` (advice is
    asynchronous), for up to 5 s."""
    for _ in range(500):
        if cached(fd, offset) and cached(fd, offset + length - 1):
            return
        time.sleep(0.01)
    raise AssertionError(f"record at {offset} of descriptor {fd} never reached the page cache")


def test_willneed_records_asks_the_disk_for_those_records_alone(tmp_path: Path) -> None:
    """Records 1 MiB apart, two of them following one another: each comes into the page cache
    (the reads are asynchronous: polled), and a record between them does not."""
    path = tmp_path / "frames.bin"
    size, record = 8 << 20, 16 << 10
    path.write_bytes(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        _evict(fd, size)
        asked = np.array([1 << 20, (1 << 20) + record, 3 << 20, 5 << 20])
        kernels.willneed_records(fd, asked, record)
        for off in asked.tolist():
            _wait_cached(_cached, fd, off, record)
        assert not _cached(fd, 4 << 20)  # not asked for (probed once: a miss starts a readahead)
    finally:
        os.close(fd)


def _in_cache(fd: int, offset: int) -> bool:
    """Whether the page at ``offset`` of ``fd`` is in the page cache, by mincore(2) on a map of
    it: unlike a read probe, asking never starts a readahead."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = offset // mmap.PAGESIZE * mmap.PAGESIZE
    with mmap.mmap(fd, mmap.PAGESIZE, access=mmap.ACCESS_READ, offset=page) as m:
        view = np.frombuffer(m, np.uint8)
        at = view.__array_interface__["data"][0]
        vec = (ctypes.c_ubyte * 1)()
        if libc.mincore(ctypes.c_void_p(at), ctypes.c_size_t(mmap.PAGESIZE), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del view
        return bool(vec[0] & 1)


def test_willneed_records_of_several_files_in_one_call_asks_each_its_own(tmp_path: Path) -> None:
    """Records of two files in one call: a record of the second file at the offset just past one
    of the first is its own request (not merged into the first file's), and each file's records
    come into the page cache, and nothing else does (checked by mincore, which reads nothing)."""
    size, record = 4 << 20, 16 << 10
    fds = []
    try:
        for name in ("a.bin", "b.bin"):
            path = tmp_path / name
            path.write_bytes(np.random.default_rng(len(fds)).integers(0, 256, size, dtype=np.uint8).tobytes())
            fds.append(os.open(path, os.O_RDONLY))
            os.fsync(fds[-1])
            _evict(fds[-1], size)
        a, b = fds
        asked_fds = np.array([a, b, b])
        asked = np.array([1 << 20, (1 << 20) + record, 3 << 20])
        kernels.willneed_records(asked_fds, asked, record)
        for fd, off in zip(asked_fds.tolist(), asked.tolist(), strict=True):
            _wait_cached(_in_cache, fd, off, record)
        assert not _in_cache(a, (1 << 20) + record) and not _in_cache(a, 3 << 20)  # asked of b only
        assert not _in_cache(b, 1 << 20)
        with pytest.raises(ValueError, match="2 descriptors for 3 records"):
            kernels.willneed_records(asked_fds[:2], asked, record)
    finally:
        for fd in fds:
            os.close(fd)


def _random_read_maps(paths: set[str]) -> dict[str, bool]:
    """This process's memory maps of ``paths``: whether each is advised MADV_RANDOM ("rr")."""
    found: dict[str, bool] = {}
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and "-" in parts[0] and parts[-1] in paths:
            current = parts[-1]
        elif line.startswith("VmFlags:") and current is not None:
            found[current] = "rr" in parts[1:]
            current = None
    return found


@pytest.mark.parametrize("cast", [None, "float32"])
def test_global_shuffle_larger_than_ram_asks_for_records_ahead_and_changes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cast: str | None
) -> None:
    """A global shuffle of a dataset larger than half the RAM (as if: drop_behind) asks the disk
    for each batch's records before they are copied, maps its files MADV_RANDOM, and keeps every
    file open for the epoch: 80 files, more than the 64 that used to be, each opened once per
    epoch instead of again and again as batches drew from all of them. The records are the same."""
    import stoker.engine.openfiles

    ds = build(tmp_path, [7 + g % 5 for g in range(80)], {"wide": WIDE_RAW, "label": LAB_GZ})
    opened: list[str] = []

    def counting(name: str, path: str) -> int:
        opened.append(path)
        return open_local(name, path)

    monkeypatch.setattr(stoker.engine.openfiles, "open_local", counting)
    # One worker: two opening a file at once keep one and close the other (a second open).
    # As for a dataset larger than half the RAM.
    monkeypatch.setattr(stoker.loader, "drop_behind_for", lambda raw_bytes: True)
    loader = ds.loader(16, cast=cast, with_index=True, epochs=2, shuffle="global", seed=2, threads=1)
    with loader:
        it = iter(loader)
        batches = [next(it)]
        images = {str(g.paths["wide"]) for g in ds.groups}
        maps = _random_read_maps(images)
        assert maps and all(maps.values()), maps
        batches += list(it)
        check_batches(ds, batches, cast={"wide": cast} if cast else None, epochs=2)
        assert it._assembler.parts.readahead.advised > 0  # type: ignore[attr-defined]
        assert "each record a few batches ahead" in loader.stats().tuning["readahead"]
    assert len(opened) <= 2 * len(images), len(opened)
    plain = ds.loader(16, cast=cast, with_index=True, epochs=2, shuffle="global", seed=2)
    assert not _random_read_maps(images)  # closed: no map left
    with plain:
        assert_same_batches(batches, list(plain))


def test_advising_ahead_asks_for_every_batch_once_and_in_time(tmp_path: Path) -> None:
    """Task k asks for batch k + depth (the first task for itself and the depth after it), so
    every batch is asked for once, never after its own task; a planning error still comes after
    every task planned before it."""
    from stoker.engine.pipeline import advising_ahead

    ds = build(tmp_path, [40, 25], {"wide": WIDE_RAW})
    plans = list(ds.loader(8, shuffle="global", seed=1, epochs=2)._plan.batches(2))
    assert len(plans) == 18
    for depth in (1, 3, len(plans) - 1, len(plans), len(plans) + 2):
        tasks = list(advising_ahead((stoker.engine.assembler.Task(p) for p in plans), depth))
        assert [t.plan for t in tasks] == plans
        asked = [(k, plans.index(p)) for k, t in enumerate(tasks) for p in t.ahead]
        assert sorted(j for _, j in asked) == list(range(len(plans)))
        assert all(k <= j <= k + depth for k, j in asked)

    def failing() -> Iterator[stoker.engine.assembler.Task]:
        yield from (stoker.engine.assembler.Task(p) for p in plans[:5])
        raise ValueError("planning failed at batch 5")

    for depth in (3, 9):
        gen = advising_ahead(failing(), depth)
        got = [next(gen) for _ in range(5)]
        assert [t.plan for t in got] == plans[:5]
        assert sorted(plans.index(p) for t in got for p in t.ahead) == list(range(5))
        with pytest.raises(ValueError, match="batch 5"):
            next(gen)


def _count_inflaters(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import stoker.engine.inflating

    opened: list[str] = []

    class Counting(stoker.engine.inflating.Inflater):
        def __init__(self, path: str, *args: object, **kw: object) -> None:
            opened.append(path)
            super().__init__(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(stoker.engine.inflating, "Inflater", Counting)
    return opened


def test_a_small_gzip_file_is_inflated_once_for_all_epochs_and_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Files under VERIFY_WHOLE_BYTES are decoded and checked whole; the end check must not
    # decompress them a second time (it did: stats showed the second pass as "assemble"), and
    # later epochs and passes find them decoded (stoker.engine.decoded.KeptDecoded).
    ds = build(tmp_path, [300, 200, 100], {"wide": WIDE_GZ, "label": LAB_GZ})
    opened = _count_inflaters(monkeypatch)
    with ds.loader(64, with_index=True, epochs=2) as loader:
        check_batches(ds, loader, epochs=2)
        check_batches(ds, loader, epochs=2)  # a second pass
    assert sorted(opened) == sorted(str(i[n].path) for i in ds.files for n in ("wide", "label"))
    # A pass of its own (no loader to keep them for) keeps them for its own later epochs only.
    opened.clear()
    with ds.loader(64, with_index=True, epochs=2) as other:
        check_batches(ds, other, epochs=2)
    assert len(opened) == 6


def test_a_kept_decoded_file_rewritten_between_passes_is_refused_not_served_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gzip

    from tests.helpers.resources import consume

    ds = build(tmp_path, [300, 200], {"wide": WIDE_RAW, "label": LAB_GZ})
    label = ds.files[1]["label"].path
    opened = _count_inflaters(monkeypatch)
    with ds.loader(100, with_index=True) as loader:
        first = np.concatenate([b["label"] for b in loader])
        # Same records, new values: the kept copy is of the file the Dataset saw, which is gone.
        with gzip.open(label, "wb") as f:
            f.write((np.arange(200, dtype=np.float32) * -1).tobytes())
        os.utime(label, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even on coarse clocks
        second, err = consume(loader)
    assert _changed(err) and err.path == label and os.path.basename(label) in str(err)
    assert np.array_equal(np.concatenate([b["label"] for b in second]), first[:300])  # group 0, unchanged
    assert opened.count(label) == 1 and opened.count(ds.files[0]["label"].path) == 1


def test_decoded_files_are_kept_only_within_the_memory_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = build(tmp_path, [300, 200], {"wide": WIDE_RAW, "label": LAB_GZ})
    opened = _count_inflaters(monkeypatch)
    batch_bytes = ds.loader(100, with_index=True).batch_bytes
    # What 4 batches in flight leave of this budget, an eighth of it, holds neither label file.
    budget = 4 * batch_bytes + 8 * 700
    with ds.loader(100, epochs=3, prefetch=4, threads=1, memory_budget=budget, with_index=True) as loader:
        assert loader._kept_decoded.limit < 800  # 300 float32 labels are 1200 bytes, 200 are 800
        check_batches(ds, loader, epochs=3)
    assert len(opened) == 6  # each file, each epoch
    opened.clear()
    with ds.loader(100, epochs=3, prefetch=4, threads=1, with_index=True) as loader:  # the default budget keeps both
        check_batches(ds, loader, epochs=3)
        assert loader._kept_decoded.held == 2000
    assert len(opened) == 2


def test_a_corrupt_small_gzip_file_is_never_kept_and_fails_every_pass_at_its_batch(tmp_path: Path) -> None:
    ds = build(tmp_path, [30, 20], {"wide": WIDE_RAW, "label": LAB_GZ})
    bad = Path(ds.files[1]["label"].path)
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the CRC no longer matches
    bad.write_bytes(bytes(raw))
    with ds.loader(10, cycle_length=1, threads=2) as loader:
        for _ in range(2):
            delivered = []
            with pytest.raises(stoker.CorruptDataError) as info:
                for b in loader:
                    delivered.append(b)
            assert info.value.path == str(bad) and bad.name in str(info.value)
            assert len(delivered) == 3  # group 0's batches, every one of them
        assert len(loader._kept_decoded) == 1  # group 0's labels, which decoded clean


# -- autotune ---------------------------------------------------------------------------------
def _until_tuned(
    loader: stoker.Loader, sleep: float = 0.0, limit: float = 30.0, spin: float = 0.0
) -> list[dict[str, np.ndarray]]:
    """Batches until autotune is done; after each the consumer sleeps `sleep` seconds (off the
    CPU, as while an accelerator computes) or spins on the CPU for `spin` seconds (a host step,
    as long on a loaded machine as on an idle one)."""
    got = []
    deadline = time.monotonic() + limit
    for batch in loader:
        got.append({k: v.copy() for k, v in batch.items() if k.startswith("__")})
        if sleep:
            time.sleep(sleep)
        end = time.perf_counter() + spin
        while time.perf_counter() < end:
            pass
        if loader.tuning or time.monotonic() > deadline:
            break
    return got


def test_autotuned_threads_change_nothing_in_the_sequence_and_show_in_stats(tmp_path: Path) -> None:
    ds = build(tmp_path, [500] * 6, {"wide": WIDE_RAW, "label": LAB_GZ})
    with ds.loader(16, epochs=None, cast="float32", with_index=True) as tuned:
        got = _until_tuned(tuned)
        s = tuned.stats()
    assert tuned.tuning, "autotune did not finish within the time limit"
    assert s.tuning["autotune"] == tuned.tuning and f"threads={tuned.threads} measured ({s.cores}: " in tuned.tuning
    assert 1 <= tuned.threads <= 2 * s.cores and s.threads == tuned.threads
    with ds.loader(16, epochs=None, cast="float32", with_index=True, threads=1) as fixed:
        want = [next(it) for it in [iter(fixed)] for _ in range(len(got))]
    for a, b in zip(got, want):
        assert np.array_equal(a["__group__"], b["__group__"]) and np.array_equal(a["__index__"], b["__index__"])


def test_a_slow_consumer_computing_on_the_host_makes_autotune_step_down_to_the_fewest_workers_that_keep_up(
    pair_ds: stoker.Dataset,
) -> None:
    with pair_ds.loader(2, epochs=None) as loader:
        _until_tuned(loader, spin=0.03)
        assert loader.threads == 1 and loader.stats().threads == 1
        assert "consumer-bound" in loader.tuning and "leave the consumer its CPU" in loader.tuning


def test_a_consumer_that_sleeps_through_its_step_keeps_two_workers_and_gets_every_record(tmp_path: Path) -> None:
    """A consumer away from the CPU (an accelerator step) needs no core: one worker alone would
    leave its look-ahead to drain whenever another process takes that worker's core."""
    from stoker.engine.autotune import AWAY_FLOOR

    ds = build(tmp_path, [500] * 4, {"wide": WIDE_RAW, "label": LAB_GZ})
    with ds.loader(16, epochs=None, cast="float32", with_index=True) as loader:
        got = _until_tuned(loader, sleep=0.01)
        s = loader.stats()
    assert loader.tuning, "autotune did not finish within the time limit"
    floor = min(AWAY_FLOOR, s.cores)
    assert loader.threads == floor and s.threads == floor, loader.tuning
    if floor > 1:
        assert "waits off the CPU" in loader.tuning and f"{floor} threads kept" in loader.tuning
    # The records in the order one worker gives them: the count of workers changes none.
    with ds.loader(16, epochs=None, cast="float32", with_index=True, threads=1) as fixed:
        want = [next(it) for it in [iter(fixed)] for _ in range(len(got))]
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a["__group__"], b["__group__"]) and np.array_equal(a["__index__"], b["__index__"])


def test_given_threads_are_not_tuned(pair_ds: stoker.Dataset) -> None:
    with pair_ds.loader(2, epochs=3, threads=3) as loader:
        list(loader)
        s = loader.stats()
    assert loader.tuning == "" and "autotune" not in s.tuning and s.threads == 3


def test_autotuned_prefetch_stays_within_the_memory_budget(tmp_path: Path) -> None:
    ds = build(tmp_path, [500] * 6, {"wide": WIDE_RAW})
    batch_bytes = 16 * 64 * 64 * 4
    with ds.loader(16, epochs=None, cast="float32", memory_budget=5 * batch_bytes) as loader:
        _until_tuned(loader)
        assert loader.tuning
        assert loader.prefetch * batch_bytes <= 5 * batch_bytes // 2


class Workers:
    """What the tuner asks of the pass's workers, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def add_worker(self) -> None:
        self.calls.append("add")

    def retire_worker(self) -> None:
        self.calls.append("retire")

    def set_window(self, window: int) -> None:
        self.calls.append(f"window {window}")


def test_the_tuner_keeps_a_worker_only_when_it_pays() -> None:
    from stoker.engine.autotune import ThreadTuner

    tuner = ThreadTuner(start=1, max_threads=4, tune_prefetch=True, fits=100)
    w = Workers()
    now = 0.0
    # Seconds per batch as the consumer sees them (it never keeps a batch): 1 thread 10 ms,
    # 2 threads 5 ms (pays, and still pays against 1 thread measured again), 3 threads 4.9 ms
    # (does not pay: taken back).
    per_batch = {1: 0.010, 2: 0.005, 3: 0.0049}
    for _ in range(1000):
        if tuner.done:
            break
        step = per_batch[tuner.threads]
        tuner.observe(w, now, now + step, now, 16)
        now += step
    assert tuner.done and tuner.threads == 2
    assert w.calls == [
        "add", "window 6",  # try 2 (the window follows: four batches more than the workers)
        "retire", "window 5",  # it paid: 1 again, to confirm
        "add", "add", "window 7",  # confirmed: back to 2 and on to 3
        "retire", "window 6",  # 3 did not pay
    ]  # fmt: skip
    assert "3 threads gave" in tuner.reason
    assert [t for t, _ in tuner.history] == [1, 2, 1, 3]


def test_the_tuner_tries_no_worker_more_than_the_memory_budget_leaves_batches_for() -> None:
    # A budget holding 3 batches beside what the loader keeps: prefetch 1 at any worker count.
    tuner, w, now = (
        ThreadTuner(start=2, max_threads=4, tune_prefetch=True, fits=3, batch_bytes=128 << 20),
        Workers(),
        0.0,
    )
    for _ in range(1000):
        if tuner.done:
            break
        tuner.observe(w, now, now + 0.01, now, 2048)
        now += 0.01
    assert tuner.done and tuner.threads == 2
    assert "add" not in w.calls
    assert tuner.reason == "memory_budget leaves room for prefetch=1, no batch for a worker more, so none was tried"
    # Room for more batches than workers: the climb goes on as before.
    roomy = ThreadTuner(start=2, max_threads=4, tune_prefetch=True, fits=100, batch_bytes=128 << 20)
    w = Workers()
    for _ in range(1000):
        if roomy.done or "add" in w.calls:
            break
        roomy.observe(w, now, now + 0.01, now, 2048)
        now += 0.01
    assert "add" in w.calls


def test_a_trial_worker_that_clearly_loses_is_taken_back_before_its_window_ends() -> None:
    from stoker.engine.autotune import CLEAR_LOSS, EARLY_FRACTION, MIN_BATCHES, MIN_SECONDS, ThreadTuner

    def time_at_three(per_batch_at_three: float) -> tuple[float, ThreadTuner, list[str]]:
        tuner, w, now = ThreadTuner(start=2, max_threads=4, tune_prefetch=True, fits=100), Workers(), 0.0
        spent = 0.0
        for _ in range(2000):
            if tuner.done:
                break
            step = {2: 0.005, 3: per_batch_at_three}[tuner.threads]
            if tuner.threads == 3:
                spent += step
            tuner.observe(w, now, now + step, now, 16)
            now += step
        assert tuner.done and tuner.threads == 2
        return spent, tuner, w.calls

    # Three workers at half the rate of two: beyond CLEAR_LOSS, so the trial ends once it holds
    # MIN_BATCHES and a third of a window, and the worker is taken back as a full window would.
    spent, tuner, calls = time_at_three(0.010)
    assert CLEAR_LOSS < 2  # the premise: half the rate of two is a clear loss
    assert spent == pytest.approx(max(MIN_BATCHES * 0.010, MIN_SECONDS * EARLY_FRACTION), abs=0.0101)
    assert spent < MIN_SECONDS
    assert calls == ["add", "window 7", "retire", "window 6"]
    assert "3 threads gave 0.50x of 2" in tuner.reason
    # A small loss (0.91x) is within what a full window must judge: it runs the whole window.
    spent, tuner, calls = time_at_three(0.0055)
    assert spent >= MIN_SECONDS
    assert calls == ["add", "window 7", "retire", "window 6"]
    assert "3 threads gave 0.91x of 2" in tuner.reason


def test_a_window_holding_a_fresh_buffer_s_first_touch_starts_again() -> None:
    """A trial of one worker more grows the look-ahead by a buffer, whose first touch can take
    longer than tens of batches (on a VM whose free memory the host takes back)."""
    from stoker.engine.autotune import MAX_RESTARTS, ThreadTuner

    def climb(report_fresh: bool) -> ThreadTuner:
        tuner = ThreadTuner(start=2, max_threads=4, tune_prefetch=True, fits=100, cores=2, cpu_clock=lambda: 0.0)
        w, now, fresh, at_three = Workers(), 0.0, 0, 0
        for _ in range(3000):
            if tuner.done:
                break
            # 3 workers pay (3 ms a batch against 5 ms); 4 do not. The trial's first window
            # allocates a buffer, and the third batch after it waits 50 ms for its first touch.
            step = {2: 0.005, 3: 0.003, 4: 0.0029}[tuner.threads]
            if tuner.threads == 3:
                at_three += 1
                fresh += at_three == 1
                step += 0.050 if at_three == 3 else 0.0
            tuner.observe(w, now, now + step, now, 16, fresh if report_fresh else 0)
            now += step
        assert tuner.done
        return tuner

    # Told of the fresh buffer, the trial is measured after it: 3 workers pay and are kept.
    tuner = climb(report_fresh=True)
    assert tuner.threads == 3 and "4 threads gave" in tuner.reason
    assert all(rate > 16 / 0.0031 for threads, rate in tuner.history if threads == 3)
    # Measured with the first touch in its window, the trial looked a clear loss.
    tuner = climb(report_fresh=False)
    assert tuner.threads == 2 and "3 threads gave 0." in tuner.reason

    # A pool that makes a buffer at every batch (a consumer keeping them all) restarts a window
    # at most MAX_RESTARTS times: the climb still ends.
    tuner, w, now = ThreadTuner(start=2, max_threads=4, tune_prefetch=True, fits=100), Workers(), 0.0
    for k in range(1, 3000):
        if tuner.done:
            break
        tuner.observe(w, now, now + 0.005, now, 16, k)
        now += 0.005
    assert tuner.done and tuner.history
    assert MAX_RESTARTS >= 1


def test_the_tuner_tries_no_worker_more_once_the_process_keeps_every_core_busy() -> None:
    from stoker.engine.autotune import SATURATED, ThreadTuner

    def climb(cores_busy: float) -> tuple[ThreadTuner, list[str]]:
        now = [0.0]  # the consumer's clock; the process's CPU clock runs cores_busy times as fast
        tuner = ThreadTuner(start=2, max_threads=4, tune_prefetch=True, fits=100, cores=2,
                            cpu_clock=lambda: cores_busy * now[0])  # fmt: skip
        w = Workers()
        for _ in range(2000):
            if tuner.done:
                break
            step = {2: 0.005, 3: 0.0049}[tuner.threads]  # a third worker would not pay either
            tuner.observe(w, now[0], now[0] + step, now[0], 16)
            now[0] += step
        assert tuner.done and tuner.threads == 2
        return tuner, w.calls

    # Two workers and the consumer keep 1.94 of 2 cores busy (W1 float32): CPU-bound, no trial.
    assert SATURATED * 2 <= 1.94
    tuner, calls = climb(1.94)
    assert calls == []
    assert tuner.reason == "CPU-bound: 1.94 of 2 cores busy at 2 thread(s), so no worker more was tried"
    assert [t for t, _ in tuner.history] == [2]
    assert "CPU-bound: 1.94 of 2 cores" in tuner.summary()
    # Workers waiting on a cold disk leave a core idle: the third worker is tried and judged.
    tuner, calls = climb(1.2)
    assert calls == ["add", "window 7", "retire", "window 6"]
    assert "3 threads gave 1.02x of 2" in tuner.reason


def _climb_on_many_cores(records_per_s: dict[int, float], busy: dict[int, float]) -> tuple[ThreadTuner, list[str]]:
    """A climb from 16 workers on 16 cores; at t workers batches of 256 come at records_per_s[t]
    and the process keeps busy[t] cores busy."""
    now, cpu = [0.0], [0.0]
    tuner = ThreadTuner(start=16, max_threads=32, tune_prefetch=True, fits=100, cores=16, cpu_clock=lambda: cpu[0])
    w = Workers()
    for _ in range(20000):
        if tuner.done:
            break
        step = 256 / records_per_s[tuner.threads]
        cpu[0] += busy[tuner.threads] * step
        tuner.observe(w, now[0], now[0] + step, now[0], 256)
        now[0] += step
    assert tuner.done
    return tuner, w.calls


def test_workers_that_wait_on_the_gil_are_halved_while_half_runs_as_fast() -> None:
    from stoker.engine.autotune import GAIN, HALVE_BELOW

    # W1 int8 on a 16-core host, as measured: 16 threads keep 3.6 cores busy and run slower
    # than 8, which keep 4.3 busy (below HALVE_BELOW of 8), and 4 (3.8 busy) run as fast as 8.
    assert HALVE_BELOW * 8 > 4.3 and HALVE_BELOW * 4 <= 3.8 and 1.22e6 * GAIN >= 1.18e6
    tuner, calls = _climb_on_many_cores({16: 919e3, 8: 1.18e6, 4: 1.22e6}, {16: 3.6, 8: 4.3, 4: 3.8})
    assert tuner.threads == 4
    assert calls == ["retire"] * 8 + ["window 12"] + ["retire"] * 4 + ["window 8"]
    assert tuner.reason == "4 threads ran 1.03x of 8 with half the workers (3.80 cores busy): kept"
    assert [t for t, _ in tuner.history] == [16, 8, 4]


def test_a_halving_that_runs_slower_is_taken_back_and_the_climb_goes_on() -> None:
    # Workers waiting on a cold disk also keep few cores busy; there half of them run slower.
    tuner, calls = _climb_on_many_cores({16: 600e3, 8: 400e3, 17: 601e3}, {16: 4.0, 8: 2.5, 17: 4.1})
    assert calls[:10] == ["retire"] * 8 + ["window 12"] + ["add"]  # halved, then taken back
    assert calls[10:17] == ["add"] * 7 and calls[17:20] == ["add", "window 21", "retire"]  # and one more tried
    assert tuner.threads == 16 and "17 threads gave 1.00x of 16" in tuner.reason
    assert [t for t, _ in tuner.history] == [16, 8, 17]


def test_workers_that_keep_their_cores_busy_are_not_halved() -> None:
    # One worker per core keeping 15 of the 16 cores busy: CPU-bound, neither halved nor climbed.
    tuner, calls = _climb_on_many_cores({16: 1.0e6}, {16: 15.0})
    assert calls == [] and tuner.threads == 16
    assert tuner.reason.startswith("CPU-bound: 15.00 of 16 cores busy")


def test_a_climb_handed_to_the_next_pass_goes_on_and_skips_that_pass_s_start_up() -> None:
    from stoker.engine.autotune import ThreadTuner

    per_batch = {1: 0.010, 2: 0.005, 3: 0.0049}  # as above: 2 threads pay, 3 do not
    tuner, w, now = ThreadTuner(start=1, max_threads=4, tune_prefetch=True, fits=100), Workers(), 0.0
    passes = 0
    while not tuner.done and passes < 200:
        passes += 1
        tuner.new_pass()
        for k in range(40):  # a pass of 40 batches: shorter than the climb, longer than a start-up
            # A new pass's first batches wait for threads and fresh pages: 200 ms each. Measured,
            # they would make any worker count look 20-40x slower than it is.
            step = 0.2 if k < 2 else per_batch[tuner.threads]
            tuner.observe(w, now, now + step, now, 16)
            now += step
            if tuner.done:
                break
    assert passes > 1 and tuner.done and tuner.threads == 2  # what one long pass finds
    assert [t for t, _ in tuner.history] == [1, 2, 1, 3]
    assert all(rate > 16 / 0.011 for _, rate in tuner.history)  # no window held a start-up batch


def test_the_tuner_drops_a_gain_that_was_only_the_pass_warming_up() -> None:
    from stoker.engine.autotune import ThreadTuner

    tuner = ThreadTuner(start=2, max_threads=4, tune_prefetch=True, fits=100)
    w = Workers()
    now = 0.0
    # The first epoch is slow whatever the thread count: 2 threads 5 ms a batch in it, then 3 ms;
    # 3 threads 3.2 ms once warm. The first window (2, cold) against the second (3, warm)
    # looks like 1.56x; 2 threads measured again (warm) shows it was the warming.
    for _ in range(2000):
        if tuner.done:
            break
        warm = now > 0.2
        step = {2: 0.003 if warm else 0.005, 3: 0.0032}[tuner.threads]
        tuner.observe(w, now, now + step, now, 16)
        now += step
    assert tuner.done and tuner.threads == 2
    assert w.calls == ["add", "window 7", "retire", "window 6"]
    assert "3 threads gave 0.94x of 2 measured after" in tuner.reason


def test_low_worker_cpu_is_storage_bound_only_when_the_bytes_came_from_the_disk(tmp_path: Path) -> None:
    ds = build(tmp_path, [300] * 2, {"wide": WIDE_RAW})
    with ds.loader(64, cast="float32", threads=2) as loader:
        list(loader)
        s = loader.stats()
    assert s.disk_read_bytes is not None and s.load_average >= 0
    # Workers that ran on a CPU a tenth of their busy time: the disk is to blame only if
    # the bytes came from it; otherwise the CPU went elsewhere.
    # (Without the kernel's scheduler statistics, which tell blocked from runnable: see below.)
    # (assemble_seconds=0: on a pass of ten batches, fresh buffers' first touch can put assemble on top.)
    starved = dataclasses.replace(
        s, busy_cpu_seconds=s.busy_seconds / 10, disk_read_bytes=0, busy_runnable_seconds=None, assemble_seconds=0.0
    )
    assert verdict(starved).startswith("CPU-starved: workers (read+cast of field 'wide') ran on a CPU only 10%")
    cold = dataclasses.replace(starved, disk_read_bytes=s.source_bytes)
    assert verdict(cold).startswith("storage-bound: reads of field 'wide' wait on the disk")


def test_workers_blocked_at_low_cpu_are_per_batch_bound_and_runnable_ones_cpu_starved(tmp_path: Path) -> None:
    ds = build(tmp_path, [300] * 2, {"wide": WIDE_RAW})
    with ds.loader(16, cast="float32", threads=2, epochs=None) as loader:
        it = iter(loader)
        began = time.perf_counter()
        while time.perf_counter() - began < 10 * CPU_SAMPLE_SECONDS:  # a span the CPU is sampled on
            next(it)
        s = loader.stats()
    # A real pass reads the kernel's scheduler statistics (Linux): time runnable but off a CPU,
    # and the whole machine's busy share over the same span.
    assert s.busy_runnable_seconds is not None and 0 <= s.busy_runnable_seconds <= s.busy_seconds
    assert s.machine_busy is not None and 0 <= s.machine_busy <= 1 and s.machine_cpus >= s.cores
    # Workers on a CPU half their busy time and blocked for the rest, the process at half its
    # cores, nothing read from the disk: they take turns at the GIL for per-batch work.
    gil = dataclasses.replace(
        s,
        busy_cpu_seconds=s.busy_seconds / 2,
        busy_runnable_seconds=s.busy_seconds / 20,
        cpu_seconds=s.wall_seconds * s.cores / 2,
        disk_read_bytes=0,
        assemble_seconds=0.0,  # the copy on top, as on a longer pass
    )
    assert gil.blocked_share == pytest.approx(0.9)
    got = verdict(gil, 0.3)
    assert s.coalesced > 1  # batches of 16 x 8 KiB are assembled together (stoker.engine.budget.COALESCE_BYTES)
    assert got.startswith(
        f"per-batch work limits you: {s.batches / s.seconds:,.0f} batches/s of 16 records, "
        f"assembled {s.coalesced} at a time at 30%"
    )
    alone = verdict(dataclasses.replace(gil, coalesced=1), 0.3)
    assert alone.startswith(f"per-batch work limits you: {s.batches / s.seconds:,.0f} batches/s of 16 records at 30%")
    assert "ran on a CPU only 50% of their busy time and were blocked 90% of the rest" in got
    assert got.endswith("raise batch_size (now 16); see: stoker explain per-batch-work")
    # The same workers runnable, waiting for a CPU, a third of their busy time: others have the cores.
    # The same workers runnable, waiting for a CPU, a third of their busy time, while the machine's
    # CPUs were all busy and this process used half of them: others have the cores.
    runnable = dataclasses.replace(
        gil, busy_runnable_seconds=s.busy_seconds / 3, machine_busy=1.0, machine_cpus=s.cores, threads=1
    )
    assert runnable.others_cpus == pytest.approx(s.cores / 2)
    assert verdict(runnable).startswith(
        "CPU-starved: workers (read+cast of field 'wide') waited for a CPU 33% of their busy time while the "
        f"process used 50% of {s.cores} cores: other processes take the CPU ({s.cores / 2:.1f} CPUs' worth of it"
    )
    # Waiting for a CPU with the machine otherwise idle: the process's own workers outnumber its cores.
    crowded = dataclasses.replace(runnable, machine_busy=0.5, threads=s.cores + 1)
    assert crowded.others_cpus == pytest.approx(0.0)
    assert verdict(crowded).startswith(
        f"workers outnumber the cores: {s.cores + 1} workers on {s.cores} cores waited for a CPU 33% of their busy "
        "time, with no other process on it: threads="
    )
    # Whether others ran is unknown (no /proc/stat): neither is claimed.
    unsure = dataclasses.replace(crowded, machine_busy=None)
    assert unsure.others_cpus is None
    assert not verdict(unsure).startswith(("CPU-starved", "workers outnumber", "per-batch"))
    # Cores saturated (the process's own threads), or the bytes from the disk: neither verdict.
    for other in (
        dataclasses.replace(gil, cpu_seconds=s.wall_seconds * s.cores),
        dataclasses.replace(runnable, cpu_seconds=s.wall_seconds * s.cores),
        dataclasses.replace(gil, disk_read_bytes=s.source_bytes),
    ):
        assert not verdict(other).startswith(("per-batch", "CPU-starved: workers (read+cast of field 'wide') waited"))
    # No scheduler statistics (not Linux): no guess between the two.
    unknown = dataclasses.replace(gil, busy_runnable_seconds=None)
    assert unknown.blocked_share is None and not verdict(unknown).startswith("per-batch")


def _copy_on_top(s: LoaderStats, stage: str, per_batch: float) -> LoaderStats:
    """``s`` with field 'wide''s copy (``stage``) its workers' only stage, per-batch work ``per_batch``
    times the copy's time beside it, the workers on a CPU throughout, one per core, memory no limit."""
    copy = sum(s.field_stage_seconds["wide"].values())
    return dataclasses.replace(
        s, field_stage_seconds={"wide": {stage: copy}}, busy_seconds=copy * (1 + per_batch),
        busy_cpu_seconds=copy * (1 + per_batch), busy_runnable_seconds=0.0, cpu_seconds=s.wall_seconds * s.cores,
        assemble_seconds=copy * per_batch, memory_budget=0, buffers_made=0, threads=s.cores,
    )  # fmt: skip


def test_below_the_ceiling_the_copy_verdict_names_per_batch_work_as_the_gap(tmp_path: Path) -> None:
    ds = build(tmp_path, [300] * 2, {"wide": WIDE_RAW})
    with ds.loader(64, cast="float32", threads=2) as loader:
        list(loader)
        s = loader.stats()
    # The copy on top, the workers on a CPU, per-batch work a fifth of worker time; one run an
    # assembly (the block advice is another test's).
    s = dataclasses.replace(_copy_on_top(s, "read+cast", 0.25), runs_per_assembly=1.0)
    below = verdict(s, 0.7)
    assert below.startswith("the copy of field 'wide' with its cast to float32 limits you (80% of worker time at 70%")
    assert below.endswith(
        "; the gap to the ceiling is stoker's per-batch work (assemble 20% of worker time): "
        "a larger batch_size (now 64) spreads it over more records; see: stoker explain copy-with-cast"
    )
    assert "gap to the ceiling" not in verdict(s)  # no ceiling measured: no gap to name
    assert "gap to the ceiling" not in verdict(_copy_on_top(s, "read+cast", 0.05), 0.7)


def _runs_of(ds: stoker.Dataset, **kw: object) -> LoaderStats:
    """Stats of one epoch in batches of 4, one at a time (prefetch given: no batches assembled together)."""
    with ds.loader(4, cycle_length=2, prefetch=2, threads=1, **kw) as loader:  # type: ignore[arg-type]
        list(loader)
        return loader.stats()


def test_runs_per_assembly_count_the_stretches_of_files_each_batch_is_read_from(tmp_path: Path) -> None:
    ds = build(tmp_path, [8, 8], {"wide": WIDE_RAW})
    # Blocks of 3 taken in turns, g0[0:3] g1[0:3] g0[3:6] g1[3:6] g0[6:8] g1[6:8]: every batch
    # of 4 straddles a block end, 8 runs for 4 batches.
    s = _runs_of(ds, block_length=3)
    assert (s.coalesced, s.cycle_length, s.block_length, s.runs_per_assembly) == (1, 2, 3, 2.0)
    # Three of those batches' first runs end a block, the last batch's ends g0's file.
    assert s.block_cuts_per_assembly == 0.75
    assert "threads=1 prefetch=2 cycle_length=2 block_length=3, 2.0 runs per assembly" in s.settings
    assert LoaderStats.from_dict(json.loads(json.dumps(s.to_dict()))).runs_per_assembly == 2.0
    # Blocks of 4: each batch is one block.
    assert _runs_of(ds, block_length=4).runs_per_assembly == 1.0
    # A global shuffle gathers its records: no runs to count, none said.
    g = _runs_of(ds, block_length=3, shuffle="global", seed=1)
    assert g.runs_per_assembly == 0.0 and "runs per assembly" not in g.settings
    # Files of 3 records, blocks of 8: g0..g7 in turn, each batch of 4 from two files, every
    # run but the last ending a file.
    small = _runs_of(build(tmp_path / "small", [3] * 8, {"wide": WIDE_RAW}), block_length=8)
    assert (small.runs_per_assembly, small.block_cuts_per_assembly) == (2.0, 0.0)


def test_below_the_ceiling_what_cuts_assemblies_into_many_runs_is_named(
    tmp_path: Path,
) -> None:
    ds = build(tmp_path, [8, 8], {"wide": WIDE_RAW})

    short = _copy_on_top(_runs_of(ds, block_length=3), "read", 0.02)
    said = verdict(short, 0.7)
    assert said.startswith("the copy of field 'wide' limits you (98% of worker time at 70% of the ceiling")
    assert said.endswith(
        "; each assembly of 4 records is read in 2.0 runs per field, since interleave blocks hold 3 records: "
        "block_length=16 reads most of them in one run (it changes the order of the records)"
        "; see: stoker explain copy-bound"
    )
    assert "block_length" not in verdict(short)  # no ceiling measured: no gap to name
    assert "block_length" not in verdict(short, 0.95)  # at the ceiling
    one_run = _copy_on_top(_runs_of(ds, block_length=4), "read", 0.02)
    assert "block_length" not in verdict(one_run, 0.7)  # one run a batch
    # Blocks already four assemblies long: no block_length to name.
    assert "block_length" not in verdict(dataclasses.replace(short, block_length=16), 0.7)
    # Runs cut at the ends of files of 3 records: no block_length helps; the files are named.
    files = build(tmp_path / "small", [3] * 8, {"wide": WIDE_RAW})
    small = _copy_on_top(_runs_of(files, block_length=8), "read", 0.02)
    assert verdict(small, 0.7).endswith(
        "; each assembly of 4 records is read in 2.0 runs per field, 2 records a run, most cut at the end "
        "of a file: fewer, larger files would make fewer runs; see: stoker explain copy-bound"
    )
    # Batches assembled together: the advice counts in assemblies.
    together = dataclasses.replace(short, coalesced=8, runs_per_assembly=3.5)
    assert verdict(together, 0.7).endswith(
        "; each assembly of 32 records (8 batches assembled as one) is read in 3.5 runs per field, since "
        "interleave blocks hold 3 records: block_length=128 reads most of them in one run (it changes the "
        "order of the records); see: stoker explain copy-bound"
    )


def test_a_consumer_bound_tuner_steps_down_while_the_rate_holds_and_back_when_it_drops() -> None:
    from stoker.engine.autotune import ThreadTuner

    def run(waits: dict[int, float]) -> tuple[ThreadTuner, list[str]]:
        # The consumer keeps every batch 5 ms (a training step on the host: on a CPU all that
        # time) and then waits ``waits[threads]`` for the next one.
        tuner, w, now = ThreadTuner(start=3, max_threads=6, tune_prefetch=True, fits=100), Workers(), 0.0
        for _ in range(2000):
            if tuner.done:
                break
            last, now = now, now + 0.005
            tuner.kept(0.005, 0.005, 0.0)
            asked, now = now, now + waits[tuner.threads]
            tuner.observe(w, asked, now, last, 16)
        assert tuner.done
        return tuner, w.calls

    # Any worker count keeps up: each step down holds the rate, down to one worker.
    tuner, calls = run({3: 0.0, 2: 0.0, 1: 0.0})
    assert tuner.threads == 1 and calls == ["retire", "window 6", "retire", "window 5"]
    assert "1 thread(s) keep up" in tuner.reason
    # One worker no longer keeps up (the consumer waits 10 ms a batch): the step is taken back.
    tuner, calls = run({3: 0.0, 2: 0.0, 1: 0.010})
    assert tuner.threads == 2 and calls == ["retire", "window 6", "retire", "window 5", "add", "window 6"]
    assert "so 2 kept" in tuner.reason


def _consumer_bound(
    *, start: int, cores: int, used: Callable[[int], tuple[float, float]], keep: float = 0.005
) -> tuple[ThreadTuner, list[str]]:
    """A tuner fed windows of a consumer that keeps each batch `keep` seconds, of them on a CPU and
    runnable waiting for one as `used(threads)` says, and never waits for the next."""
    tuner = ThreadTuner(start=start, max_threads=2 * start, tune_prefetch=True, fits=100, cores=cores)
    w, now = Workers(), 0.0
    for _ in range(2000):
        if tuner.done:
            break
        tuner.kept(keep, *used(tuner.threads))
        last, now = now, now + keep
        tuner.observe(w, now, now, last, 16)
    assert tuner.done
    return tuner, w.calls


def test_a_consumer_waiting_off_the_cpu_keeps_two_workers_where_one_computing_steps_down_to_one() -> None:
    from stoker.engine.autotune import ON_CPU

    # An accelerator step: the consumer's thread sleeps, on a CPU a sliver of each 5 ms.
    tuner, calls = _consumer_bound(start=3, cores=4, used=lambda t: (0.0001, 0.0))
    assert tuner.threads == 2 and calls == ["retire", "window 6"]
    assert "waits off the CPU" in tuner.reason and "2 threads kept" in tuner.reason
    tuner, calls = _consumer_bound(start=2, cores=2, used=lambda t: (0.0001, 0.0))
    assert tuner.threads == 2 and calls == [] and "on a CPU 2% of the time" in tuner.reason
    # Woken from its sleep on a busy machine, it waits 2 ms for a CPU: it still slept.
    tuner, _ = _consumer_bound(start=2, cores=2, used=lambda t: (0.0001, 0.002))
    assert tuner.threads == 2
    # Just under the share that counts as computing is still away.
    tuner, _ = _consumer_bound(start=2, cores=2, used=lambda t: (0.005 * ON_CPU * 0.9, 0.0))
    assert tuner.threads == 2
    # One core: nothing for a second worker to run on.
    tuner, calls = _consumer_bound(start=2, cores=1, used=lambda t: (0.0001, 0.0))
    assert tuner.threads == 1 and calls == ["retire", "window 5"] and "leave the consumer its CPU" in tuner.reason
    # A host step: on a CPU the whole time it keeps a batch, or most of it, or all of the time
    # other processes leave it a CPU (here 2 ms of 5).
    for used in ((0.005, 0.0), (0.005 * ON_CPU * 1.1, 0.0), (0.002, 0.003)):
        tuner, calls = _consumer_bound(start=3, cores=4, used=lambda t, used=used: used)
        assert tuner.threads == 1 and calls == ["retire", "window 6", "retire", "window 5"]
        assert "1 thread(s) keep up and leave the consumer its CPU" in tuner.reason


def test_a_step_down_judged_on_a_computing_window_goes_back_up_once_the_consumer_waits_off_the_cpu() -> None:
    # The consumer computes in the first window (one worker fewer is tried), then sleeps.
    tuner, calls = _consumer_bound(start=2, cores=2, used=lambda t: (0.005, 0.0) if t == 2 else (0.0001, 0.0))
    assert tuner.threads == 2 and calls == ["retire", "window 5", "add", "window 6"]
    assert "2 threads kept" in tuner.reason


def test_cpu_seconds_count_the_consumer_burning_cpu_between_batches(tmp_path: Path) -> None:
    """Process CPU is sampled every CPU_SAMPLE_SECONDS, not per batch; it still adds up."""
    from stoker.cli.bench import burn
    from stoker.engine.stats import CPU_SAMPLE_SECONDS

    ds = build(tmp_path, [400], {"wide": WIDE_RAW})
    with ds.loader(8, epochs=None, threads=1) as loader:
        it = iter(loader)
        for _ in range(40):
            next(it)
            burn(0.01)  # 0.4 s of the consumer's CPU in all
        s = loader.stats()
    assert s.wall_seconds >= 0.39 and 10 * CPU_SAMPLE_SECONDS < 40 * 0.01  # many samples in the span
    # At least the consumer's share of the span (the first batch's burn is before the span).
    assert 0.3 <= s.cpu_seconds <= s.wall_seconds * s.cores + 0.05, (s.cpu_seconds, s.wall_seconds)
    assert 0.3 / s.cores <= s.cpu_utilization <= 1.05


def test_worker_cpu_is_sampled_and_scaled_to_the_busy_time(tmp_path: Path) -> None:
    """Workers read their CPU clock on one batch per CPU_SAMPLE_SECONDS; the busy CPU is the busy
    time at those batches' CPU share, so a CPU-bound cast shows most of its busy time on a CPU."""
    ds = build(tmp_path, [600] * 2, {"wide": WIDE_RAW})
    with ds.loader(16, epochs=4, cast="float64", threads=1) as loader:
        n = sum(1 for _ in loader)
        s = loader.stats()
    assert n == 4 * 75 and s.busy_seconds > 0
    assert 0.2 < s.busy_cpu_seconds / s.busy_seconds <= 1.05, (s.busy_cpu_seconds, s.busy_seconds)


def _suggested_budget(message: str) -> str:
    m = re.search(r"memory_budget='([0-9]+[MG]iB)'", message)
    assert m, message
    return m.group(1)


def test_a_budget_that_holds_back_prefetch_is_the_verdict_and_its_advice_lets_every_worker_run(
    tmp_path: Path,
) -> None:
    ds = build(tmp_path, [400] * 2, {"wide": WIDE_RAW, "label": LAB_GZ})
    batch_bytes = 16 * (64 * 64 * 2 + 4)
    # Three batches: the default keeps half of what it holds beside the decoded files kept.
    with ds.loader(16, threads=2, memory_budget=3 * batch_bytes + 100) as loader:
        for _ in loader:
            pass
        s = loader.stats()
    assert (s.prefetch, s.threads, s.budget_batches, s.batch_bytes) == (1, 2, 3, batch_bytes)
    assert s.prefetch_limited
    assert "prefetch=1 (held down by memory_budget: it holds 3 batches of 0.1 MiB)" in str(s)
    v = verdict(s)
    assert v.startswith(f"memory_budget-bound: memory_budget={3 * batch_bytes + 100} holds 3 batches of 0.1 MiB, "
                        "so prefetch=1 keeps at most 1 of 2 workers busy")  # fmt: skip
    assert "at 40% of the ceiling" in verdict(s, 0.4)
    # The budget the verdict names gives every worker a batch in flight.
    with ds.loader(16, threads=2, memory_budget=_suggested_budget(v)) as loader:
        for _ in loader:
            pass
        better = loader.stats()
    assert better.prefetch >= 2 and not better.prefetch_limited
    assert "memory_budget" not in verdict(better) and "held down" not in str(better)
    # A prefetch the user chose: that is the setting named, not the budget.
    with ds.loader(16, threads=2, prefetch=1) as loader:
        for _ in loader:
            pass
        chosen = loader.stats()
    assert not chosen.prefetch_limited
    assert verdict(chosen).startswith("prefetch=1 keeps at most 1 of 2 workers busy: raise prefetch= to 2 or more")


@pytest.mark.parametrize("batch", [16, 64, 256, 1024])
@pytest.mark.parametrize("budget", ["1MiB", "5MiB", "40MiB", "64MiB", "700MiB"])
def test_the_default_prefetch_leaves_the_pool_room_to_recycle_as_many_batches(
    tmp_path: Path, batch: int, budget: str
) -> None:
    ds = build(tmp_path, [64] * 2, {"wide": WIDE_RAW})
    try:
        loader = ds.loader(batch, threads=2, memory_budget=budget)
    except stoker.StokerError as e:
        assert "holds less than one batch" in str(e)  # 1024 rows of 8 KiB exceed 1MiB and 5MiB
        return
    with loader:
        pool = loader.budget.spare(loader.prefetch) - loader._kept_decoded.limit
        if loader.budget.fits < 2:  # one batch in flight at least, whatever is left to recycle
            assert loader.prefetch == 1
        else:
            assert loader.prefetch * loader.batch_bytes <= pool
        assert loader.prefetch * loader.batch_bytes <= loader.memory_budget


def test_buffers_made_anew_are_counted_and_named_when_the_pool_cannot_recycle_them(tmp_path: Path) -> None:
    ds = build(tmp_path, [400] * 2, {"wide": WIDE_RAW, "label": LAB_GZ})
    with ds.loader(8, threads=2) as loader:
        for _ in loader:  # each batch dropped before the next: recycled
            pass
        dropped = loader.stats()
    assert dropped.batches == 100
    assert 0 < dropped.buffers_made <= 2 * (dropped.prefetch + 6)  # two fields' buffers per batch
    assert not verdict(dropped).startswith("batch buffers made anew")
    with ds.loader(8, threads=2) as loader:
        held = list(loader)  # every batch kept: none comes back to the pool
        s = loader.stats()
    assert s.buffers_made >= 2 * len(held)
    v = verdict(s)
    assert v.startswith(f"batch buffers made anew instead of recycled: {s.buffers_made} for 100 batches, ")
    assert "the pool recycles a batch once you drop it" in v and v.endswith(
        "hold fewer batches, or lower prefetch= would move it; see: stoker explain buffers-made-anew"
    )
    # Batches dropped, but a budget that leaves the pool no room: the budget is named.
    tight = dataclasses.replace(dropped, buffers_made=2 * dropped.batches, memory_budget=3 * dropped.batch_bytes)
    assert "memory_budget='128MiB', a lower prefetch=, or holding fewer batches would move it" in verdict(tight)


def test_batches_kept_from_assemblies_are_named_as_buffers_made_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small batches assembled together (stoker.engine.budget.COALESCE_BYTES, lowered here so a short
    # run holds many assemblies): one buffer per field for each, and a batch kept keeps its own.
    import stoker.engine.budget

    monkeypatch.setattr(stoker.engine.budget, "COALESCE_BYTES", 1 << 20)
    ds = build(tmp_path, [400] * 2, {"wide": WIDE_RAW, "label": LAB_GZ})
    with ds.loader(16, threads=2, epochs=8) as loader:
        for _ in loader:  # each batch dropped before the next: recycled
            pass
        dropped = loader.stats()
    k = dropped.coalesced
    assert k == 8 and dropped.batches == 400  # 8 batches of 16 x 8 KiB (and 16 labels) come nearest 1 MiB
    assert not verdict(dropped).startswith("batch buffers made anew")
    with ds.loader(16, threads=2, epochs=8) as loader:
        held = [b for i, b in enumerate(loader) if i % k == 0]  # one batch of each assembly kept
        s = loader.stats()
    assert len(held) >= 50 and s.buffers_made >= 2 * len(held)
    v = verdict(s)
    assert v.startswith(
        f"batch buffers made anew instead of recycled: {s.buffers_made} for 400 batches "
        f"(assembled {k} at a time: a batch kept keeps its assembly's buffer), "
    ), v


def test_a_short_run_is_not_held_down_and_shows_no_prefetch_deeper_than_its_data(tmp_path: Path) -> None:
    # 4 batches of 16: a budget of ten batches (prefetch 4) holds a longer run down, not this one.
    ds = build(tmp_path, [32] * 2, {"wide": WIDE_RAW, "label": LAB_GZ})
    batch_bytes = 16 * (64 * 64 * 2 + 4)
    budget = 10 * batch_bytes + 100
    assert len(ds) == 64  # the gzip labels' count settled: a pass's length is known without a race on the trailer
    with ds.loader(16, threads=2, memory_budget=budget) as loader:
        it = iter(loader)
        next(it)
        s = loader.stats()
        assert s.prefetch == 4 and not s.prefetch_limited and "held down" not in str(s)
        assert not verdict(s).startswith("memory_budget-bound")
    # Four small batches: the default prefetch (in assemblies of many batches) is shown as deep as the data.
    with ds.loader(16, threads=2) as loader:
        assert loader.prefetch > 4
        assert "prefetch=4)" in repr(loader)
        assert sum(1 for _ in loader) == 4
        s = loader.stats()
        assert s.prefetch == 4 and not s.prefetch_limited
    # Forever: no end to the data, so the prefetch shown is the loader's.
    with ds.loader(16, threads=2, epochs=None) as loader:
        assert f"prefetch={loader.prefetch})" in repr(loader)
    # A run longer than the budget allows is held down once batches flow, and not before.
    long = build(tmp_path / "long", [400] * 2, {"wide": WIDE_RAW, "label": LAB_GZ})
    with long.loader(16, threads=2, memory_budget=budget) as loader:
        assert not loader.stats().prefetch_limited
        it = iter(loader)
        next(it)
        s = loader.stats()
        assert s.prefetch == 4 and s.prefetch_limited and "prefetch=4 (held down by memory_budget" in str(s)
