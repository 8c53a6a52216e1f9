"""Small batches assembled several at a time (stoker.engine.budget.COALESCE_BYTES): the same batches,
in the same order, with the same errors at the same batches, as when each is assembled alone.

A loader given ``prefetch=`` assembles batches one at a time, so it is the reference here.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest

import stoker
import stoker.engine.pipeline as sl
from stoker.engine.executor import ALIGNMENT
from stoker.plan.batches import BatchPlan, Gather, Run, coalesce
from stoker.testing import assert_same_batches
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, build, check_batches, write_dataset
from tests.helpers.resources import consume

COUNTS = [130, 0, 47, 211, 9, 64]
WIDE = FieldPlan("wide", "int16", (8, 8))


def test_coalesce_moves_runs_down_and_merges_a_run_that_goes_on() -> None:
    a = BatchPlan(2, 5, 40, 8, (Run(0, 10, 3, 0, False), Run(1, 0, 5, 3, False)))
    b = BatchPlan(2, 6, 48, 8, (Run(1, 5, 8, 0, True), Run(3, 7, 0, 8, True)))
    c = BatchPlan(2, 7, 52, 4, (Run(2, 0, 4, 0, False),))
    one = coalesce([a, b, c])
    assert (one.epoch, one.index, one.position, one.rows, one.parts) == (2, 5, 52, 20, (a, b, c))
    # group 1 records 0..4 then 5..12 are one read; the empty final run stays as it is.
    assert one.runs == (
        Run(0, 10, 3, 0, False), Run(1, 0, 13, 3, True), Run(3, 7, 0, 16, True), Run(2, 0, 4, 16, False),
    )  # fmt: skip


def test_coalesce_keeps_runs_apart_where_records_or_rows_do_not_follow() -> None:
    a = BatchPlan(0, 0, 4, 4, (Run(0, 0, 4, 0, False, 2),))
    b = BatchPlan(0, 1, 8, 4, (Run(0, 9, 4, 0, False, 2),))  # 8 would follow (step 2), 9 does not
    assert coalesce([a, b]).runs == (Run(0, 0, 4, 0, False, 2), Run(0, 9, 4, 4, False, 2))
    c = BatchPlan(0, 1, 8, 4, (Run(0, 8, 4, 0, False, 2),))
    assert coalesce([a, c]).runs == (Run(0, 0, 8, 0, False, 2),)
    d = BatchPlan(0, 1, 8, 4, (Run(1, 8, 4, 0, False, 2),))  # the next record, of another group
    assert coalesce([a, d]).runs == (Run(0, 0, 4, 0, False, 2), Run(1, 8, 4, 4, False, 2))
    e = BatchPlan(0, 0, 4, 4, (Run(0, 0, 4, 0, True, 2),))  # the group's last: nothing follows it
    assert coalesce([e, c]).runs == (Run(0, 0, 4, 0, True, 2), Run(0, 8, 4, 4, False, 2))


def test_coalesce_makes_one_gather_of_the_batches_gathers() -> None:
    a = BatchPlan(1, 3, 30, 2, (), Gather(np.array([2, 0]), np.array([5, 9])))
    b = BatchPlan(1, 4, 32, 2, (), Gather(np.array([1, 2]), np.array([0, 4])))
    one = coalesce([a, b])
    assert (one.epoch, one.index, one.position, one.rows, one.runs, one.parts) == (1, 3, 32, 4, (), (a, b))
    assert one.gather is not None
    assert one.gather.groups.tolist() == [2, 0, 1, 2] and one.gather.index.tolist() == [5, 9, 0, 4]


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"drop_remainder": True, "epochs": 3},
        {"shard": (1, 3)},
        {"shard": (0, 2), "even": False, "epochs": 2},
        {"shuffle": "files", "seed": 7, "window": 3, "epochs": 2},
        {"shuffle": "global", "seed": 5, "epochs": 2},
        {"shuffle": "global", "seed": 5, "shard": (2, 3), "drop_remainder": True},
        {"cycle_length": 2, "block_length": 5},
    ],
)
def test_small_batches_assembled_together_are_the_batches_made_one_at_a_time(
    tmp_path: Path, threads: int, kw: dict[str, object]
) -> None:
    ds = build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ, "wide": WIDE})
    loader = ds.loader(16, threads=threads, with_index=True, **kw)  # type: ignore[arg-type]
    assert loader.stats().coalesced > 1
    ref = ds.loader(16, threads=threads, with_index=True, prefetch=4, **kw)  # type: ignore[arg-type]
    assert ref.stats().coalesced == 1
    got, want = list(loader), list(ref)
    assert_same_batches(want, got)
    assert len(got) == len(loader) * int(kw.get("epochs", 1))  # type: ignore[call-overload]
    whole = "shard" not in kw and not kw.get("drop_remainder")  # else some records are not delivered
    check_batches(ds, got, epochs=int(kw.get("epochs", 1)), complete=whole)  # type: ignore[call-overload]


def test_each_batch_of_an_assembly_is_its_own_aligned_array_and_stays_as_delivered(tmp_path: Path) -> None:
    ds = build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    with ds.loader(16, epochs=3, cast={"image": "float32"}, with_index=True) as loader:
        assert loader.stats().coalesced > 1
        held = list(loader)  # the buffers are recycled only once every batch on them is dropped
        for batch in held:
            for arr in batch.values():
                assert arr.ctypes.data % ALIGNMENT == 0 and arr.flags.c_contiguous
        check_batches(ds, held, cast={"image": "float32"}, epochs=3)
        starts = {arr.ctypes.data for batch in held for arr in batch.values()}
        assert len(starts) == sum(len(b) for b in held)  # no two batches share memory
    with ds.loader(16, epochs=3, cast={"image": "float32"}, with_index=True, prefetch=4) as ref:
        assert_same_batches(list(ref), held)


def test_batches_whose_rows_would_start_unaligned_are_made_one_at_a_time(tmp_path: Path) -> None:
    ds = build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    # 10 float32 labels are 40 bytes: the second batch of an assembly would start mid-line.
    assert ds.loader(10).stats().coalesced == 1
    assert ds.loader(16).stats().coalesced > 1


def test_the_stats_say_how_many_are_assembled_together(tmp_path: Path) -> None:
    ds = build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    with ds.loader(16) as loader:
        stats = loader.stats()
        assert f"(assembled {stats.coalesced} at a time)" in stats.settings
        assert loader.prefetch % stats.coalesced == 0
    for kw in ({"prefetch": 3}, {"pad_last": True}, {"shuffle": "global", "seed": 1, "pad_last": True}):
        with ds.loader(16, **kw) as alone:  # type: ignore[arg-type]
            assert alone.stats().coalesced == 1 and "assembled" not in alone.stats().settings


def test_a_truncated_raw_file_fails_at_the_batch_holding_its_first_missing_record(tmp_path: Path) -> None:
    write_dataset(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"))  # fmt: skip
    bad = tmp_path / "img_0003.bin"
    os.truncate(bad, 36 * 205)  # 6 of its 211 records gone: a global shuffle meets them a few batches in
    for threads, kw in ((1, {}), (2, {}), (2, {"shuffle": "global", "seed": 2})):
        loader = ds.loader(16, threads=threads, with_index=True, **kw)  # type: ignore[arg-type]
        assert loader.stats().coalesced > 1
        got, err = consume(loader)
        want, ref_err = consume(ds.loader(16, threads=threads, with_index=True, prefetch=4, **kw))  # type: ignore[arg-type]
        assert isinstance(err, stoker.CorruptDataError) and isinstance(ref_err, stoker.CorruptDataError)
        assert err.path == str(bad) and str(bad) in str(err) and err.index == ref_err.index
        assert err.index == 205 or kw  # sequential: record 205 is the first missing; global: the first drawn
        assert str(err) == str(ref_err)
        assert_same_batches(want, got)  # every batch before the failing one, and none after
        assert got, "the batches before the bad record come first"
        check_batches(ds, got, complete=False)


def test_a_label_file_cut_short_fails_where_it_does_one_batch_at_a_time(tmp_path: Path) -> None:
    # Its cut-off trailer disagrees with the images: the group's count is settled, and fails,
    # when the plan reaches it; the batches planned before come first, as they do one at a time.
    write_dataset(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    bad = tmp_path / "out_0005.bin.gz"
    whole = gzip.compress(np.arange(64, dtype="<f4").tobytes(), compresslevel=0)  # stored: a prefix survives
    bad.write_bytes(whole[: len(whole) // 2])
    ds = stoker.Dataset(image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (6, 6, 1)),
                        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32"))  # fmt: skip
    for threads in (1, 2):
        loader = ds.loader(16, threads=threads, with_index=True, cycle_length=2)
        assert loader.stats().coalesced > 1
        got, err = consume(loader)
        want, ref_err = consume(ds.loader(16, threads=threads, with_index=True, cycle_length=2, prefetch=4))
        assert isinstance(err, stoker.CorruptDataError) and err.path == str(bad) and str(bad) in str(err)
        assert type(err) is type(ref_err) and str(err) == str(ref_err)
        assert_same_batches(want, got)  # the reference's rows are checked against the files in test_loader
        assert got


def test_batches_reading_a_compressed_stream_in_turns_are_made_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Files too large to decode whole are read front to back in turns: such a batch cannot be
    # assembled again after a failure, so it goes alone; the rest are still assembled together.
    import stoker.engine.decoded

    ds = build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    monkeypatch.setattr(stoker.engine.decoded, "VERIFY_WHOLE_BYTES", 4 * 60)  # groups of 60 records or fewer: whole
    made: list[int] = []
    real = sl.coalesce

    def counting(plans: list[BatchPlan]) -> BatchPlan:
        made.extend(r.group for p in plans for r in p.runs)
        return real(plans)

    monkeypatch.setattr(sl, "coalesce", counting)
    got = list(ds.loader(16, with_index=True, cycle_length=1))
    want = list(ds.loader(16, with_index=True, cycle_length=1, prefetch=4))
    assert_same_batches(want, got)
    check_batches(ds, got)
    assert made and set(made) <= {1, 2, 4}  # the groups of 47, 9 and 0 records (64 is over 60)


def test_a_pass_resumed_from_a_batch_inside_an_assembly_goes_on_from_the_next(tmp_path: Path) -> None:
    ds = build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    with ds.loader(16, epochs=2, with_index=True) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(5)]  # the fifth is inside the first assembly
        state = loader.state_dict()
        rest = list(it)
    with ds.loader(16, epochs=2, with_index=True, state=state) as resumed:
        assert_same_batches(rest, list(resumed))
    with ds.loader(16, epochs=2, with_index=True, prefetch=4) as ref:
        assert_same_batches(list(ref), first + rest)


def test_a_pass_closed_inside_an_assembly_lets_its_buffer_go(tmp_path: Path) -> None:
    import gc
    import weakref

    ds = build(tmp_path, COUNTS, {"image": IMG, "label": LAB_GZ})
    loader = ds.loader(16, epochs=None)
    assert loader.stats().coalesced > 1
    it = iter(loader)
    first = next(it)  # the rest of its assembly waits in the pass
    held = weakref.ref(first["image"].base if first["image"].base is not None else first["image"])
    del first
    it.close()  # type: ignore[attr-defined]
    gc.collect()
    assert held() is None  # nothing of the assembly is kept by a closed pass
    loader.close()
