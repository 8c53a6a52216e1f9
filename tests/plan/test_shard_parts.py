"""Parts of a shard (a rank's DataLoader workers): `even` trims the rank, never more with parts.

Shard `(i + c*w, c*W)` is part `w` of `W` of rank shard `(i, c)`. With `even_over=c` the parts of a
rank together take exactly what the rank takes alone, part `w` of every rank the same number, and
what an epoch loses to the trim is its last positions, fewer than `c` of them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.errors import SpecError
from stoker.plan.batches import BatchPlan, Plan, PlanConfig
from stoker.plan.order import index_permutation, shard_positions, shard_take, validate_even_over

ranks_st = st.integers(1, 5)
workers_st = st.integers(1, 4)
counts_st = st.lists(st.integers(0, 30), min_size=1, max_size=5)


def part(rank: int, ranks: int, worker: int, workers: int) -> tuple[int, int]:
    return rank + ranks * worker, ranks * workers


@settings(max_examples=400, deadline=None)
@given(ranks_st, workers_st, st.integers(0, 200), st.data())
def test_parts_of_a_rank_take_exactly_the_ranks_positions(ranks: int, workers: int, total: int, data) -> None:
    start = data.draw(st.integers(0, total))
    taken: list[np.ndarray] = []
    for rank in range(ranks):
        alone = shard_positions(total, (rank, ranks), start, even=True)
        parts = [
            shard_positions(total, part(rank, ranks, w, workers), start, even=True, even_over=ranks)
            for w in range(workers)
        ]
        mine = np.concatenate(parts)
        assert sorted(mine.tolist()) == alone.tolist()  # the rank's, each once: disjoint, complete
        taken.append(mine)
    everything = np.sort(np.concatenate(taken))
    kept = (total - start) // ranks * ranks
    assert everything.tolist() == list(range(start, start + kept))  # the trim is the epoch's tail
    assert total - start - kept < ranks


@settings(max_examples=400, deadline=None)
@given(ranks_st, workers_st, st.integers(0, 200), st.data())
def test_part_w_of_every_rank_takes_the_same_number(ranks: int, workers: int, total: int, data) -> None:
    start = data.draw(st.integers(0, total))
    for w in range(workers):
        lengths = {
            shard_take(total, part(r, ranks, w, workers), start, even=True, even_over=ranks) for r in range(ranks)
        }
        assert len(lengths) == 1


@settings(max_examples=300, deadline=None)
@given(ranks_st, workers_st, st.integers(0, 200))
def test_without_even_every_position_is_taken_once(ranks: int, workers: int, total: int) -> None:
    everything = [
        p
        for r in range(ranks)
        for w in range(workers)
        for p in shard_positions(total, part(r, ranks, w, workers), even=False, even_over=ranks).tolist()
    ]
    assert sorted(everything) == list(range(total))


@settings(max_examples=300, deadline=None)
@given(ranks_st, workers_st, st.integers(0, 200), st.data())
def test_a_part_resumes_from_its_lockstep_position(ranks: int, workers: int, total: int, data) -> None:
    rank, w = data.draw(st.integers(0, ranks - 1)), data.draw(st.integers(0, workers - 1))
    shard = part(rank, ranks, w, workers)
    whole = shard_positions(total, shard, even=True, even_over=ranks)
    k = data.draw(st.integers(0, len(whole)))
    resumed = shard_positions(total, shard, shard[1] * k, even=True, even_over=ranks)  # saved after k records
    assert whole[:k].tolist() + resumed.tolist() == whole.tolist()


def test_even_over_must_divide_the_shard_count() -> None:
    assert validate_even_over((5, 6), None) is None
    assert validate_even_over((5, 6), 3) == 3
    with pytest.raises(SpecError, match="must divide the shard count"):
        validate_even_over((5, 6), 4)
    with pytest.raises(SpecError, match="positive integer"):
        validate_even_over((5, 6), 0)


# -- the plan's batches ------------------------------------------------------------------
def records_of(counts: list[int], batches: list[BatchPlan]) -> list[int]:
    """Global record ids the batches hold (real rows only), in order."""
    firsts = np.concatenate([[0], np.cumsum(counts)])
    out: list[int] = []
    for b in batches:
        if b.gather is not None:
            ids = (firsts[b.gather.groups] + b.gather.index).tolist()
        else:
            ids = [int(firsts[r.group]) + r.start + k * r.step for r in b.runs for k in range(r.count)]
        out.extend(ids[: b.valid] if b.valid is not None else ids)
    return out


def plan_of(counts: list[int], shard: tuple[int, int], *, shuffle: object, even: bool = True, **kw: object) -> Plan:
    cfg = PlanConfig(
        batch_size=kw.pop("batch_size", 4), drop_remainder=False, cycle_length=2, block_length=3,
        shuffle=shuffle, seed=0 if shuffle else None, shard=shard, even=even, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return Plan(len(counts), counts.__getitem__, cfg)


@settings(max_examples=200, deadline=None)
@given(counts_st, ranks_st, workers_st, st.sampled_from([False, "global", "files"]), st.integers(0, 3))
def test_plan_parts_deliver_what_their_rank_would(counts, ranks, workers, shuffle, epoch) -> None:
    for rank in range(ranks):
        alone = records_of(counts, list(plan_of(counts, (rank, ranks), shuffle=shuffle).epoch(epoch)))
        parts = [
            records_of(counts, list(plan_of(counts, part(rank, ranks, w, workers), shuffle=shuffle,
                                            even_over=ranks).epoch(epoch)))
            for w in range(workers)
        ]  # fmt: skip
        assert sorted(r for p in parts for r in p) == sorted(alone)
        assert [len(p) for p in parts] == [len(range(w, len(alone), workers)) for w in range(workers)]
    if shuffle == "global":  # what the trim leaves out: the tail of the epoch's permuted sequence
        total = sum(counts)
        kept = total // ranks * ranks
        gone = index_permutation(total, 0, epoch)(np.arange(kept, total, dtype=np.int64))
        every = {
            r
            for rank in range(ranks)
            for w in range(workers)
            for r in records_of(counts, list(plan_of(counts, part(rank, ranks, w, workers), shuffle=shuffle,
                                                     even_over=ranks).epoch(epoch)))
        }  # fmt: skip
        assert every == set(range(total)) - set(gone.tolist())


@settings(max_examples=200, deadline=None)
@given(counts_st, ranks_st, workers_st, st.sampled_from([False, "global"]), st.integers(1, 5))
def test_pad_last_parts_hold_every_record_once_in_equal_batch_counts(counts, ranks, workers, shuffle, size) -> None:
    seen: list[int] = []
    lengths = set()
    for rank in range(ranks):
        for w in range(workers):
            plan = plan_of(counts, part(rank, ranks, w, workers), shuffle=shuffle, even_over=ranks, pad_last=True,
                           batch_size=size)  # fmt: skip
            batches = list(plan.epoch(0))
            assert all(b.rows == size and b.valid is not None for b in batches)
            lengths.add(len(batches))
            seen.extend(records_of(counts, batches))
    assert sorted(seen) == list(range(sum(counts)))
    assert len(lengths) == 1
