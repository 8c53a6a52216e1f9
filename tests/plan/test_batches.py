"""The plan's index arithmetic: tf.data's interleave order, batch boundaries, epochs, start=."""

from __future__ import annotations

import itertools
import math
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker
from stoker.plan.batches import Plan, PlanConfig, default_block_length, default_cycle_length, interleave
from tests.helpers.data import FieldPlan, build, check_batches, tf_interleave

counts_st = st.lists(st.integers(0, 12), min_size=1, max_size=7)
geometry = st.tuples(counts_st, st.integers(1, 5), st.integers(1, 5), st.integers(1, 9), st.booleans())


def _plan(counts: list[int], cycle: int, block: int, bs: int, drop: bool) -> Plan:
    return Plan(len(counts), counts.__getitem__, PlanConfig(bs, drop, cycle, block))


def _records(batch) -> list[tuple[int, int]]:
    out = []
    for r in batch.runs:
        out.extend((r.group, r.start + k * r.step) for k in range(r.count))
    return out


def _expand(pieces) -> list[tuple[int, int]]:
    return [(g, i) for g, a, b in pieces for i in range(a, b)]


def test_docstring_example() -> None:
    plan = Plan(2, [3, 2].__getitem__, PlanConfig(4, False, 2, 1))
    assert [[(r.group, r.start, r.count) for r in b.runs] for b in plan.epoch(0)] == [
        [(0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)],
        [(0, 2, 1)],
    ]


@settings(max_examples=300, deadline=None)
@given(counts_st, st.integers(1, 6), st.integers(1, 6))
def test_interleave_pieces_follow_tf_data_order(counts: list[int], cycle: int, block: int) -> None:
    assert _expand(interleave(len(counts), counts.__getitem__, cycle, block)) == tf_interleave(counts, cycle, block)


@settings(max_examples=300, deadline=None)
@given(geometry)
def test_every_record_exactly_once_per_epoch_in_interleave_order(geo) -> None:
    counts, cycle, block, bs, drop = geo
    batches = list(_plan(counts, cycle, block, bs, drop).epoch(0))
    seq = [rec for b in batches for rec in _records(b)]
    full = tf_interleave(counts, cycle, block)
    n = sum(counts)
    keep = (n // bs) * bs if drop else n
    assert seq == full[:keep]
    if not drop:
        assert sorted(seq) == sorted((g, i) for g, c in enumerate(counts) for i in range(c))


@settings(max_examples=300, deadline=None)
@given(geometry)
def test_batch_boundaries_and_batch_count(geo) -> None:
    counts, cycle, block, bs, drop = geo
    plan = _plan(counts, cycle, block, bs, drop)
    batches = list(plan.epoch(0))
    n = sum(counts)
    expected = n // bs if drop else math.ceil(n / bs)
    assert len(batches) == expected == plan.batches_per_epoch(n)
    for k, b in enumerate(batches):
        assert b.index == k and b.epoch == 0
        assert b.rows == (bs if k < len(batches) - 1 or drop else n - bs * (len(batches) - 1))
        assert sum(r.count for r in b.runs) == b.rows
        row = 0
        for r in b.runs:  # runs fill rows 0..rows in order, each inside one group
            assert r.row == row
            assert r.count == 0 or r.stop <= counts[r.group]
            row += r.count
        assert b.position == min(n, (k + 1) * bs)


@settings(max_examples=200, deadline=None)
@given(geometry)
def test_final_flag_marks_the_run_reading_each_groups_last_record(geo) -> None:
    counts, cycle, block, bs, _ = geo
    runs = [r for b in _plan(counts, cycle, block, bs, False).epoch(0) for r in b.runs]
    finals = [r.group for r in runs if r.final]
    assert sorted(finals) == [g for g, c in enumerate(counts) if c]
    for r in runs:
        assert r.final == (r.count > 0 and r.stop == counts[r.group])


@settings(max_examples=300, deadline=None)
@given(geometry, st.data())
def test_start_skipping_equals_slicing_the_full_sequence(geo, data) -> None:
    counts, cycle, block, bs, drop = geo
    n = sum(counts)
    start = data.draw(st.integers(0, n + 2))
    full = tf_interleave(counts, cycle, block)
    batches = list(_plan(counts, cycle, block, bs, drop).epoch(0, start))
    rest = full[start:]
    keep = (len(rest) // bs) * bs if drop else len(rest)
    assert [rec for b in batches for rec in _records(b)] == rest[:keep]
    assert all(b.rows == bs for b in batches[:-1])
    assert [b.position for b in batches] == [min(n, start + (k + 1) * bs) for k in range(len(batches))]


@settings(max_examples=100, deadline=None)
@given(geometry, st.integers(1, 3))
def test_batches_never_span_epochs(geo, epochs: int) -> None:
    counts, cycle, block, bs, drop = geo
    plan = _plan(counts, cycle, block, bs, drop)
    batches = list(plan.batches(epochs))
    per = plan.batches_per_epoch(sum(counts))
    assert len(batches) == per * epochs
    for e in range(epochs):
        mine = batches[e * per : (e + 1) * per]
        assert all(b.epoch == e for b in mine)
        assert [rec for b in mine for rec in _records(b)] == [rec for b in plan.epoch(0) for rec in _records(b)]


def test_batches_forever_when_epochs_is_none() -> None:
    plan = _plan([3, 2], 2, 1, 2, False)
    got = list(itertools.islice(plan.batches(None), 9))
    assert [b.epoch for b in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_counts_are_asked_for_lazily_as_groups_open() -> None:
    asked: list[int] = []

    def count(g: int) -> int:
        asked.append(g)
        return 5

    plan = Plan(1000, count, PlanConfig(4, False, 2, 2))
    next(iter(plan.epoch(0)))
    assert set(asked) <= {0, 1}


def test_defaults_are_pure_functions_of_geometry() -> None:
    assert default_cycle_length(1) == 1
    assert default_cycle_length(3) == 3
    assert default_cycle_length(1000) == 4
    assert default_block_length(4 << 20) == 1
    assert default_block_length(16384) == 256
    assert default_block_length(4) == 1 << 20
    assert default_block_length(3 << 20) == 2
    assert default_block_length(5 << 20) == 1


# -- against TensorFlow itself -----------------------------------------------------------------


def _tf_order(paths: list[str], cycle: int, block: int) -> list[tuple[int, int]]:
    import tensorflow as tf

    def per_group(path):
        return tf.data.FixedLengthRecordDataset(path, 8).map(lambda s: tf.io.decode_raw(s, tf.int32))

    ds = tf.data.Dataset.from_tensor_slices(paths).interleave(
        per_group,
        cycle_length=cycle,
        block_length=block,  # non-parallel interleave is deterministic
    )
    return [(int(a), int(b)) for a, b in ds.as_numpy_iterator()]


ORDER_CASES = [
    ([5, 0, 3, 9, 1], 2, 3),  # an empty group, groups shorter than a block
    ([7, 7, 7], 5, 2),  # cycle_length > number of groups
    ([1, 2, 3, 4, 5, 6], 3, 1),
    ([10, 4, 0, 0, 8], 1, 4),
    ([3, 11, 2, 6, 0], 2, 5),
    ([0, 0, 4], 2, 2),
    ([2, 9, 1, 1, 1, 7], 4, 3),
]


@pytest.mark.tf
@pytest.mark.slow
def test_stoker_order_equals_tf_data_interleave_on_real_files(tmp_path: Path) -> None:
    """Each record carries (group, index) as two int32; tf.data reads the same files."""
    for case, (counts, cycle, block) in enumerate(ORDER_CASES):
        d = tmp_path / f"c{case}"
        d.mkdir()
        paths = []
        for g, n in enumerate(counts):
            p = d / f"rec_{g:03d}.bin"
            p.write_bytes(np.stack([np.full(n, g), np.arange(n)], axis=1).astype("<i4").tobytes())
            paths.append(str(p))
        expected = _tf_order(paths, cycle, block)
        assert expected == tf_interleave(counts, cycle, block), "the test's own reference disagrees with tf"
        ds = stoker.Dataset(rec=stoker.Field(paths, "int32", (2,)))
        for bs in (1, 4, 100):
            batches = list(ds.loader(bs, cycle_length=cycle, block_length=block, with_index=True, threads=2))
            seq = [(int(g), int(i)) for b in batches for g, i in zip(b["__group__"], b["__index__"])]
            assert seq == expected, (counts, cycle, block, bs)
            values = [tuple(r) for b in batches for r in b["rec"].tolist()]
            assert values == expected


def test_loader_order_equals_reference_for_mixed_compressions(tmp_path: Path) -> None:
    plans = {"image": FieldPlan("img", "uint8", (5,)), "label": FieldPlan("out", "float32", kind="gzip"),
             "z": FieldPlan("z", "int16", (2,), kind="zlib")}  # fmt: skip
    counts = [4, 0, 9, 2, 6]
    ds = build(tmp_path, counts, plans)
    for cycle, block in [(2, 3), (7, 1), (1, 2)]:
        batches = list(ds.loader(3, cycle_length=cycle, block_length=block, with_index=True))
        assert check_batches(ds, batches) == tf_interleave(counts, cycle, block)


@settings(max_examples=400, deadline=None)
@given(
    geometry,
    st.integers(1, 3).flatmap(lambda c: st.tuples(st.integers(0, c - 1), st.just(c))),
    st.booleans(),
    st.booleans(),
    st.integers(0, 40),
)
def test_every_group_reached_gets_one_final_run_in_a_delivered_batch_after_its_other_runs(
    geo, shard: tuple[int, int], even: bool, pad_last: bool, start: int
) -> None:
    """Streams are confirmed at their end on the final run, so every group the epoch reaches
    (from ``start``) must get one, in a batch that is delivered, even where its last records
    are trimmed (drop_remainder, even shards): a gzip trailer that miscounts a group is then
    an error, never records silently missing. (An epoch that delivers no batch has none.)"""
    counts, cycle, block, bs, drop = geo
    cfg = PlanConfig(bs, drop and not pad_last, cycle, block, shard=shard, even=even, pad_last=pad_last)
    batches = list(Plan(len(counts), counts.__getitem__, cfg).epoch(0, min(start, sum(counts))))
    runs = [r for b in batches for r in b.runs]
    if not batches:
        return
    pos, reached = 0, set()
    for g, a, b in interleave(len(counts), counts.__getitem__, cycle, block):
        if pos + b - a > min(start, sum(counts)) and b == counts[g]:
            reached.add(g)
        pos += b - a
    finals = [r.group for r in runs if r.final]
    assert sorted(finals) == sorted(reached)
    for k, r in enumerate(runs):
        if r.final:
            assert not any(q.group == r.group for q in runs[k + 1 :]), "a run of the group after its final run"
            assert r.count == 0 or r.stop <= counts[r.group]
    for b in batches:
        assert sum(r.count for r in b.runs) == (b.valid if b.valid is not None else b.rows)


@pytest.mark.parametrize("cfg", [PlanConfig(5, True, 1, 4), PlanConfig(5, False, 1, 4, shard=(0, 2), even=False),
                                 PlanConfig(5, False, 1, 4, pad_last=True)])  # fmt: skip
def test_a_batch_held_back_for_trimmed_ends_is_delivered_before_a_count_that_fails(cfg: PlanConfig) -> None:
    """Where a full batch is held back (drop_remainder, shards, pad_last), a group whose count
    fails when it opens still raises after every earlier batch, as the contract wants."""

    def count(g: int) -> int:
        if g == 1:
            raise stoker.PairingError("group 1 has different record counts per field")
        return 20

    got = []
    with pytest.raises(stoker.PairingError):
        for b in Plan(2, count, cfg).epoch(0):
            got.append(b)
    assert sum(r.count for b in got for r in b.runs) == 20 // cfg.shard[1]


@pytest.mark.parametrize("mode", ["sequential", "global"])
def test_repeating_an_epoch_of_no_batch_ends_instead_of_spinning(mode: str) -> None:
    counts = [0, 0]
    seed = 3 if mode == "global" else None
    plan = Plan(
        2, counts.__getitem__, PlanConfig(4, False, 2, 2, shuffle="global" if seed is not None else False, seed=seed)
    )
    got: list[object] = []
    t = threading.Thread(target=lambda: got.extend(itertools.islice(plan.batches(None), 5)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "repeating an epoch of no batch spun without end"
    assert got == []


def test_a_shard_with_no_record_ends_an_endless_loader(tmp_path: Path) -> None:
    ds = build(tmp_path, [3], {"x": FieldPlan("x", "int16")})
    got: list[object] = []
    loader = ds.loader(2, epochs=None, shard=(3, 4))
    t = threading.Thread(target=lambda: got.extend(loader), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "an endless loader over a shard with no record never ended"
    assert got == []
    loader.close()


def test_resume_at_an_epochs_end_still_goes_on_to_the_next_epoch() -> None:
    counts = [3, 2]
    plan = Plan(2, counts.__getitem__, PlanConfig(2, False, 2, 2))
    after = list(itertools.islice(plan.batches(None, first_epoch=0, start=5), 4))
    assert [b.epoch for b in after] == [1, 1, 1, 2]
