"""Properties of stoker.plan.order: permutations, window shuffle, shard coverage, elastic resume, fingerprints."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker.kernels
import stoker.plan.order
from stoker.errors import SpecError
from stoker.plan.order import (
    Permutation,
    diff_fingerprint_parts,
    even_length,
    fingerprint,
    index_permutation,
    permute_groups,
    resume_position,
    shard_from_rank,
    shard_length,
    shard_positions,
    validate_shard,
    window_shuffle,
)

seeds = st.integers(0, 2**64)
epochs = st.integers(0, 10_000)


# -- index_permutation -----------------------------------------------------------------


@pytest.mark.parametrize("n", [*range(0, 70), 255, 256, 257, 1023, 1024, 1025, 4096, 4097, 5000])
def test_permutation_is_a_bijection_for_small_and_boundary_n(n: int) -> None:
    out = index_permutation(n, seed=12, epoch=1)(np.arange(n, dtype=np.int64))
    assert out.dtype == np.int64
    np.testing.assert_array_equal(np.sort(out), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 5000), seed=seeds, epoch=epochs)
def test_permutation_is_a_bijection_for_any_n_seed_epoch(n: int, seed: int, epoch: int) -> None:
    perm = index_permutation(n, seed, epoch)
    assert len(perm) == n
    out = perm(np.arange(n, dtype=np.int64))
    np.testing.assert_array_equal(np.sort(out), np.arange(n))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), seed=seeds, epoch=epochs)
def test_permutation_is_deterministic_and_vectorized_equals_elementwise(n: int, seed: int, epoch: int) -> None:
    positions = np.arange(min(n, 50), dtype=np.int64)
    a = index_permutation(n, seed, epoch)(positions)
    b = index_permutation(n, seed, epoch)(positions)
    np.testing.assert_array_equal(a, b)
    one_by_one = [int(index_permutation(n, seed, epoch)(np.array([p]))[0]) for p in positions]
    assert a.tolist() == one_by_one


def test_permutation_keeps_the_input_shape() -> None:
    perm = index_permutation(100, 0, 0)
    grid = np.arange(100).reshape(4, 25)
    out = perm(grid)
    assert out.shape == (4, 25)
    np.testing.assert_array_equal(out.ravel(), perm(np.arange(100)))
    assert perm(np.array(7)).shape == ()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(10, 2000), seed=seeds, epoch=epochs)
def test_permutation_differs_across_epochs_and_seeds(n: int, seed: int, epoch: int) -> None:
    positions = np.arange(n, dtype=np.int64)
    base = index_permutation(n, seed, epoch)(positions)
    assert not np.array_equal(base, index_permutation(n, seed, epoch + 1)(positions))
    assert not np.array_equal(base, index_permutation(n, seed + 1, epoch)(positions))


def test_permutation_of_2_pow_40_stays_in_range_and_is_injective_on_a_sample() -> None:
    n = 2**40
    perm = index_permutation(n, seed=5, epoch=0)
    rng = np.random.default_rng(0)
    sample = np.unique(np.concatenate([rng.integers(0, n, 200_000), [0, 1, n - 2, n - 1]]))
    out = perm(sample)
    assert out.min() >= 0 and out.max() < n
    assert np.unique(out).size == sample.size


@pytest.mark.parametrize("n", [2**40 + 1, 2**41 - 3, 2**62])
def test_permutation_handles_n_just_past_even_powers_and_the_maximum(n: int) -> None:
    sample = np.array([0, 1, n // 2, n - 1], dtype=np.int64)
    out = index_permutation(n, seed=1, epoch=2)(sample)
    assert out.min() >= 0 and out.max() < n and np.unique(out).size == 4


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 2**62), seed=seeds, epoch=epochs, data=st.data())
def test_compiled_permutation_gives_the_numpy_networks_values_bit_for_bit(
    n: int, seed: int, epoch: int, data: st.DataObject
) -> None:
    assert stoker.kernels.compiled()  # see tests/test_kernels.py
    positions = np.array(data.draw(st.lists(st.integers(0, max(0, n - 1)), max_size=64 if n else 0)), np.int64)
    perm = index_permutation(n, seed, epoch)
    compiled = perm(positions)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stoker.plan.order, "permute", lambda *args: None)
        assert np.array_equal(compiled, perm(positions))


@pytest.fixture(params=["compiled", "numpy"])
def permutation_code(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test using it runs with the compiled permutation and with its numpy code."""
    if request.param == "numpy":
        monkeypatch.setattr(stoker.plan.order, "permute", lambda *args: None)
    return str(request.param)


@pytest.mark.usefixtures("permutation_code")
def test_permutation_matches_pinned_values_so_order_is_portable() -> None:
    # Pinned on one machine: a change here changes every user's epoch order.
    assert index_permutation(10, 42, 3)(np.arange(10)).tolist() == [5, 4, 9, 1, 8, 2, 7, 0, 3, 6]
    big = index_permutation(2**40, 42, 3)(np.array([0, 1, 2**40 - 1]))
    assert big.tolist() == [952934577462, 853597907516, 466994922584]
    assert permute_groups(8, 42, 3).tolist() == [7, 2, 0, 6, 5, 3, 4, 1]
    assert window_shuffle(10, 4, 42, 3).tolist() == [0, 1, 3, 2, 7, 4, 6, 5, 8, 9]


@pytest.mark.usefixtures("permutation_code")
def test_permutation_rejects_positions_out_of_range_and_bad_arguments() -> None:
    perm = index_permutation(10, 0, 0)
    with pytest.raises(SpecError, match=r"\[0, 10\)"):
        perm(np.array([3, 10]))
    with pytest.raises(SpecError, match=r"got values in \[3, 12\]"):
        perm(np.array([3, 12, 5], np.int64))
    with pytest.raises(SpecError, match=r"\[0, 10\)"):
        perm(np.array([-1]))
    with pytest.raises(SpecError, match="integers"):
        perm(np.array([1.5]))
    assert index_permutation(0, 0, 0)(np.array([], dtype=np.int64)).size == 0
    with pytest.raises(SpecError, match="n=-1"):
        index_permutation(-1, 0, 0)
    with pytest.raises(SpecError, match="seed=-3"):
        index_permutation(5, -3, 0)
    with pytest.raises(SpecError, match="epoch=True"):
        index_permutation(5, 0, True)


def test_permutation_is_a_frozen_value() -> None:
    a, b = Permutation(7, 1, 2), index_permutation(7, 1, 2)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.n = 8  # type: ignore[misc]


# -- permute_groups --------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(num_groups=st.integers(0, 500), seed=seeds, epoch=epochs)
def test_permute_groups_is_a_permutation(num_groups: int, seed: int, epoch: int) -> None:
    order = permute_groups(num_groups, seed, epoch)
    np.testing.assert_array_equal(np.sort(order), np.arange(num_groups))


def test_permute_groups_is_independent_of_the_record_permutation() -> None:
    same = sum(
        np.array_equal(permute_groups(50, seed, 0), index_permutation(50, seed, 0)(np.arange(50))) for seed in range(20)
    )
    assert same == 0


# -- window_shuffle --------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(num_items=st.integers(0, 3000), window=st.integers(1, 300), seed=seeds, epoch=epochs)
def test_window_shuffle_is_a_permutation_that_moves_items_less_than_a_window(
    num_items: int, window: int, seed: int, epoch: int
) -> None:
    order = window_shuffle(num_items, window, seed, epoch)
    np.testing.assert_array_equal(np.sort(order), np.arange(num_items))
    k = np.arange(num_items)
    assert np.all(np.abs(order - k) < window)
    np.testing.assert_array_equal(order // window, k // window)  # stays in its own window
    np.testing.assert_array_equal(order, window_shuffle(num_items, window, seed, epoch))


def test_window_shuffle_of_window_one_keeps_order_and_large_windows_shuffle() -> None:
    np.testing.assert_array_equal(window_shuffle(20, 1, 3, 0), np.arange(20))
    assert not np.array_equal(window_shuffle(100, 100, 3, 0), np.arange(100))
    assert not np.array_equal(window_shuffle(100, 100, 3, 0), window_shuffle(100, 100, 3, 1))


def test_window_shuffle_rejects_bad_window() -> None:
    for window in (0, -2, True, 1.5):
        with pytest.raises(SpecError, match="window="):
            window_shuffle(10, window, 0, 0)  # type: ignore[arg-type]


# -- sharding --------------------------------------------------------------------------

shard_counts = st.integers(1, 17)


@settings(max_examples=100, deadline=None)
@given(total=st.integers(0, 500), count=shard_counts, start=st.integers(0, 600))
def test_shards_of_an_epoch_are_disjoint_and_cover_the_rest_exactly(total: int, count: int, start: int) -> None:
    parts = [shard_positions(total, (i, count), start) for i in range(count)]
    for i, part in enumerate(parts):
        assert part.size == shard_length(total, i, count, start)
        assert np.all((part - start) % count == i)
    merged = np.sort(np.concatenate(parts))
    np.testing.assert_array_equal(merged, np.arange(start, total))


@settings(max_examples=100, deadline=None)
@given(total=st.integers(0, 500), count=shard_counts, start=st.integers(0, 600))
def test_even_length_is_the_least_shard_length_and_even_shards_are_equal(total: int, count: int, start: int) -> None:
    lengths = [shard_length(total, i, count, start) for i in range(count)]
    assert even_length(total, count, start) == min(lengths)
    assert max(lengths) - min(lengths) <= 1
    even = [shard_positions(total, (i, count), start, even=True) for i in range(count)]
    assert {part.size for part in even} == {even_length(total, count, start)}
    assert np.unique(np.concatenate(even)).size == count * even_length(total, count, start)


@pytest.mark.parametrize(
    ("shard", "detail"),
    [
        ((2, 2), ""),
        ((-1, 2), ""),
        ((0, 0), "count must be at least 1"),
        ((1, 0), "count must be at least 1"),
        ((0.0, 2), "0.0 is not an integer"),
        ((0, "2"), "'2' is not an integer"),
        ((True, 2), "True is not an integer"),
        ((0, True), "True is not an integer"),
        ((0, 1, 2), ""),
        (3, ""),
        (None, ""),
    ],
)
def test_validate_shard_names_the_constraint_and_the_value(shard: object, detail: str) -> None:
    with pytest.raises(SpecError) as info:
        validate_shard(shard)
    message = str(info.value)
    assert message.startswith(f"shard={shard!r} must be (index, count) with 0 <= index < count")
    assert detail in message
    assert isinstance(info.value, ValueError)


def test_validate_shard_accepts_lists_and_numpy_ints() -> None:
    assert validate_shard([1, 4]) == (1, 4)
    got = validate_shard((np.int64(0), np.int32(2)))
    assert got == (0, 2) and all(type(v) is int for v in got)


def test_shard_from_rank_is_rank_of_world_size_and_explains_bad_ranks() -> None:
    assert shard_from_rank(0, 1) == (0, 1)
    assert shard_from_rank(7, 8) == (7, 8)
    with pytest.raises(SpecError) as info:
        shard_from_rank(8, 8)
    assert "shard=(8, 8)" in str(info.value)
    assert any("rank=8, world_size=8" in note for note in info.value.__notes__)


# -- elastic resume --------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(0, 400),
    c=shard_counts,
    c2=shard_counts,
    start=st.integers(0, 100),
    data=st.data(),
)
def test_resume_with_any_new_shard_count_reads_every_position_exactly_once(
    total: int, c: int, c2: int, start: int, data: st.DataObject
) -> None:
    start = min(start, total)
    k = data.draw(st.integers(0, even_length(total, c, start)), label="k")
    first = [shard_positions(total, (i, c), start)[:k] for i in range(c)]
    resumed = {resume_position(k, count=c, index=i, start=start) for i in range(c)}
    assert len(resumed) == 1  # the same for every shard of the lockstep job
    position = resumed.pop()
    consumed = np.concatenate(first) if first else np.zeros(0, np.int64)
    assert np.all(consumed < position)
    second = [shard_positions(total, (j, c2), position) for j in range(c2)]
    everything = np.concatenate([consumed, *second])
    np.testing.assert_array_equal(np.sort(everything), np.arange(start, total))


def test_resume_position_is_start_plus_count_times_consumed() -> None:
    assert resume_position(0, count=3, index=2, start=0) == 0
    assert resume_position(5, count=4, index=0, start=10) == 30
    with pytest.raises(SpecError, match="shard="):
        resume_position(5, count=4, index=4, start=0)
    with pytest.raises(SpecError, match="consumed_by_this_shard=-1"):
        resume_position(-1, count=4, index=0, start=0)


# -- fingerprints ----------------------------------------------------------------------


def test_fingerprint_is_stable_short_hex_and_ignores_key_order_and_container_kind() -> None:
    fp = fingerprint({"a": 1, "b": [1, 2]})
    assert fp == "8baa73198470c7bb"  # pinned: saved states must keep matching
    assert fingerprint({"b": (1, 2), "a": np.int64(1)}) == fp
    assert fingerprint({"a": 1, "b": [2, 1]}) != fp
    assert fingerprint({"a": {"y": 1.5, "x": None}}) == fingerprint({"a": {"x": None, "y": np.float64(1.5)}})


def test_fingerprint_rejects_values_without_canonical_json() -> None:
    with pytest.raises(SpecError, match=r"parts\['f'\] is a object"):
        fingerprint({"f": object()})
    with pytest.raises(SpecError, match="keys must be strings"):
        fingerprint({"m": {1: 2}})


def test_diff_fingerprint_parts_names_exactly_the_keys_that_differ() -> None:
    saved = {"seed": 1, "shard": [0, 2], "files": ["a", "b"], "gone": 3}
    current = {"seed": 2, "shard": (0, 2), "files": ["a", "b"], "new": 4}
    assert diff_fingerprint_parts(saved, current) == ["gone", "new", "seed"]
    assert diff_fingerprint_parts(current, current) == []
