"""Saving and resuming loaders: exact continuation, small states, elastic resume, mismatched states."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stoker
from stoker.testing import assert_resumable, assert_same_batches
from tests.helpers.indexed import collect, ids_of, open_dataset, write_dataset

COUNTS = [17, 0, 23, 9]  # 49 records, one empty group
MODES: list[Any] = [False, "files", "global"]


def seed_for(shuffle: object) -> int | None:
    return 7 if shuffle else None


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("resume")
    write_dataset(directory, COUNTS)
    return directory


@pytest.fixture(scope="module")
def ds(ds_dir: Path) -> stoker.Dataset:
    return open_dataset(ds_dir)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    """163 records (prime: every shard count trims) in five groups."""
    return write_dataset(tmp_path_factory.mktemp("big"), [37, 0, 50, 13, 63])


# -- exact continuation ------------------------------------------------------------------

CONFIGS = [
    {"batch_size": 5, "threads": 1},
    {"batch_size": 8, "threads": 2, "cycle_length": 2, "block_length": 3},
    {"batch_size": 13, "threads": 4, "cycle_length": 3, "block_length": 1, "drop_remainder": True},
    {"batch_size": 4, "threads": 2, "shard": (1, 2), "even": False, "window": 3, "block_length": 2},
    {"batch_size": 3, "threads": 3, "shard": (0, 3), "prefetch": 4, "cycle_length": 1},
    {"batch_size": 49, "threads": 2},
    {"batch_size": 64, "threads": 1},
]


@pytest.mark.parametrize("shuffle", MODES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_assert_resumable_at_every_batch(ds: stoker.Dataset, shuffle: object, config: dict[str, Any]) -> None:
    def make() -> stoker.Loader:
        return ds.loader(epochs=2, shuffle=shuffle, seed=seed_for(shuffle), **config)

    with make() as probe:
        n = 2 * len(probe)
    assert n > 0
    assert_resumable(make, steps=range(n + 1))


@pytest.mark.parametrize("shuffle", MODES)
def test_state_dict_is_json_and_small_for_many_groups(tmp_path: Path, shuffle: object) -> None:
    dataset = write_dataset(tmp_path, [3] * 200)  # 200 groups, 600 records
    with dataset.loader(7, epochs=2, shuffle=shuffle, seed=seed_for(shuffle)) as loader:
        it = iter(loader)
        for _ in range(len(loader) + 3):
            next(it)
        state = loader.state_dict()
    text = json.dumps(state)
    assert json.loads(text) == state
    assert len(text) < 2000, len(text)  # O(1): no per-group or per-record data
    assert {"version", "epoch", "position", "seed", "batch_size", "shard", "fingerprint", "parts"} <= set(state)
    assert state["epoch"] == 1 and state["position"] == 3 * 7
    assert state["seed"] == seed_for(shuffle) and state["batch_size"] == 7 and state["shard"] == [0, 1]


@pytest.mark.parametrize("shuffle", MODES)
@pytest.mark.parametrize("shard", [(0, 1), (1, 3)])
def test_resume_after_last_batch_of_epoch_continues_with_next_epoch(
    ds: stoker.Dataset, shuffle: object, shard: tuple[int, int]
) -> None:
    def make(**kw: Any) -> stoker.Loader:
        return ds.loader(6, epochs=3, shuffle=shuffle, seed=seed_for(shuffle), shard=shard, **kw)

    reference = collect(make())
    loader = make()
    per = len(loader)
    assert len(reference) == 3 * per
    with loader:
        it = iter(loader)
        first = [dict(next(it)) for _ in range(per)]
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 0
    rest = collect(make(state=state))
    assert_same_batches(reference, first + rest)
    # resumed after the very last batch: nothing left of that pass
    with make() as loader:
        it = iter(loader)
        assert len([dict(next(it)) for _ in range(3 * per)]) == 3 * per
        state = loader.state_dict()
    assert collect(make(state=state)) == []
    # resumed once the pass has ended: the next pass (epochs 3..5), as the same loader goes on
    with make() as loader:
        assert len([dict(b) for b in loader]) == 3 * per
        state = json.loads(json.dumps(loader.state_dict()))
        second = [dict(b) for b in loader]
    assert (state["epoch"], state["position"]) == (3, 0)
    assert_same_batches(second, collect(make(state=state)))


@pytest.mark.parametrize("shuffle", MODES)
@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_prefetched_batches_in_flight_do_not_count(ds: stoker.Dataset, shuffle: object, k: int) -> None:
    def make(**kw: Any) -> stoker.Loader:
        return ds.loader(4, epochs=2, shuffle=shuffle, seed=seed_for(shuffle), **kw)

    reference = collect(make(threads=1, prefetch=1))
    with make(threads=4, prefetch=4) as loader:
        it = iter(loader)
        before = [dict(next(it)) for _ in range(k)]
        time.sleep(0.05)  # let the workers fill the prefetch window
        state = json.loads(json.dumps(loader.state_dict()))
    after = collect(make(threads=2, prefetch=3, state=state))
    assert_same_batches(reference, before + after)


# -- elastic resume ----------------------------------------------------------------------
#
# Reasoning (stoker.order): an epoch is one sequence of positions 0..total-1 (what a single
# unsharded loader delivers, in order). Shard i of c takes positions start + i + c*m. When c
# shards run in lockstep for k batches of b records each, exactly positions [0, c*k*b) are
# consumed, so every shard's state holds the same position P = c*k*b. A new job with c'
# shards resumed from P takes positions P + j + c'*m: with even=False that is exactly
# [P, total), so before + after covers the epoch exactly once. With even=True each new shard
# stops after (total - P) // c' records, so the only records missing are the last
# (total - P) % c' positions of the sequence, and nothing repeats.


def lockstep(make: Callable[[int], stoker.Loader], count: int, k: int) -> tuple[list[np.ndarray], list[dict]]:
    """Run ``count`` shards for k batches each; their ids and their states."""
    ids, states = [], []
    for i in range(count):
        with make(i) as loader:
            it = iter(loader)
            batches = [dict(next(it)) for _ in range(k)]
            states.append(json.loads(json.dumps(loader.state_dict())))
        ids.append(ids_of(batches))
    return ids, states


ELASTIC = [(2, 5, 3, 3, 4), (3, 4, 2, 2, 9), (4, 3, 5, 1, 7), (1, 10, 4, 5, 2), (5, 2, 1, 3, 16), (2, 7, 0, 4, 3)]


@pytest.mark.parametrize("shuffle", MODES)
@pytest.mark.parametrize(("c", "b", "k", "c2", "b2"), ELASTIC)
@pytest.mark.parametrize("even", [True, False])
def test_elastic_resume(
    big: stoker.Dataset, shuffle: object, c: int, b: int, k: int, c2: int, b2: int, even: bool
) -> None:
    total = len(big)
    seed = seed_for(shuffle)
    sequence = ids_of(collect(big.loader(11, shuffle=shuffle, seed=seed)))
    assert len(sequence) == total

    ids, states = lockstep(lambda i: big.loader(b, shuffle=shuffle, seed=seed, shard=(i, c), even=even), c, k)
    position = c * k * b
    assert {s["position"] for s in states} == {position}  # lockstep: one resume point for all shards
    assert {s["epoch"] for s in states} == {0}
    before = np.concatenate(ids)
    assert len(before) == position
    np.testing.assert_array_equal(np.sort(before), np.sort(sequence[:position]))

    after = []
    for j in range(c2):
        loader = big.loader(b2, shuffle=shuffle, seed=seed, shard=(j, c2), even=even, state=states[0])
        after.append(ids_of(collect(loader)))
    consumed = np.concatenate([before, *after])
    assert len(np.unique(consumed)) == len(consumed)  # nothing read twice
    if even:
        assert len({len(a) for a in after}) == 1  # every new shard the same number of records
        trimmed = (total - position) % c2
        missing = set(range(total)) - set(consumed.tolist())
        assert missing == set(sequence[total - trimmed :].tolist())
    else:
        np.testing.assert_array_equal(np.sort(consumed), np.arange(total))


@pytest.mark.parametrize("shuffle", MODES)
def test_elastic_resume_from_even_job_into_uneven_job_covers_exactly(big: stoker.Dataset, shuffle: object) -> None:
    """The first job trims shards evenly (collectives never hang); the last, shorter job takes everything left.

    ``even`` only decides where a shard stops, never which record a position names, so a state
    saved by an even=True job must resume in an even=False job.
    """
    total, seed = len(big), seed_for(shuffle)
    ids, states = lockstep(lambda i: big.loader(5, shuffle=shuffle, seed=seed, shard=(i, 3), even=True), 3, 4)
    after = []
    for j in range(2):
        loader = big.loader(8, shuffle=shuffle, seed=seed, shard=(j, 2), even=False, state=states[0])
        after.append(ids_of(collect(loader)))
    consumed = np.concatenate([*ids, *after])
    np.testing.assert_array_equal(np.sort(consumed), np.arange(total))


# -- mismatched and garbage states -------------------------------------------------------


def saved_state(dataset: stoker.Dataset, steps: int = 2, **kw: Any) -> dict[str, Any]:
    with dataset.loader(4, epochs=2, **kw) as loader:
        it = iter(loader)
        for _ in range(steps):
            next(it)
        return json.loads(json.dumps(loader.state_dict()))


def test_state_from_other_dataset_names_counts(ds: stoker.Dataset, tmp_path: Path) -> None:
    other = write_dataset(tmp_path, [17, 0, 23, 10])
    state = saved_state(other, shuffle="global", seed=7)
    loader = ds.loader(4, epochs=2, shuffle="global", seed=7)
    with pytest.raises(stoker.StateError, match="counts"):
        loader.load_state_dict(state)
    with pytest.raises(stoker.StateError, match="counts"):
        ds.loader(4, epochs=2, shuffle="global", seed=7, state=state)


def test_state_with_other_seed_names_seed(ds: stoker.Dataset) -> None:
    state = saved_state(ds, shuffle="files", seed=1)
    with pytest.raises(stoker.StateError, match="seed") as info:
        ds.loader(4, epochs=2, shuffle="files", seed=2).load_state_dict(state)
    assert "counts" not in str(info.value) and "shuffle" not in str(info.value)


@pytest.mark.parametrize(("saved", "now"), [("files", "global"), ("global", "files"), (False, "global")])
def test_state_with_other_shuffle_names_shuffle(ds: stoker.Dataset, saved: object, now: object) -> None:
    state = saved_state(ds, shuffle=saved, seed=3)
    with pytest.raises(stoker.StateError, match="shuffle"):
        ds.loader(4, epochs=2, shuffle=now, seed=3).load_state_dict(state)


def test_state_with_other_interleave_names_it(ds: stoker.Dataset) -> None:
    state = saved_state(ds, cycle_length=2, block_length=3)
    with pytest.raises(stoker.StateError, match="interleave"):
        ds.loader(4, epochs=2, cycle_length=3, block_length=3).load_state_dict(state)


def _valid(ds: stoker.Dataset) -> dict[str, Any]:
    return saved_state(ds, shuffle="global", seed=7)


@pytest.mark.parametrize(
    "garble",
    [
        lambda s: None,
        lambda s: "state",
        lambda s: 42,
        lambda s: [s],
        lambda s: {},
        lambda s: {"version": 1},
        lambda s: {**s, "version": 2},
        lambda s: {**s, "version": "1"},
        lambda s: {**s, "fingerprint": "0" * 16},
        lambda s: {k: v for k, v in s.items() if k != "fingerprint"},
        lambda s: {**s, "epoch": -1},
        lambda s: {**s, "epoch": "0"},
        lambda s: {**s, "position": -3},
        lambda s: {**s, "position": 1.5},
        lambda s: {**s, "position": None},
    ],
)
def test_garbage_state_is_state_error(ds: stoker.Dataset, garble: Callable[[dict], Any]) -> None:
    loader = ds.loader(4, epochs=2, shuffle="global", seed=7)
    with pytest.raises(stoker.StateError):
        loader.load_state_dict(garble(_valid(ds)))
    assert isinstance(stoker.StateError("x"), ValueError)


@pytest.mark.parametrize("shuffle", MODES)
def test_moved_dataset_still_resumes(ds_dir: Path, tmp_path: Path, shuffle: object) -> None:
    seed = seed_for(shuffle)
    original = open_dataset(ds_dir)
    reference = collect(original.loader(5, epochs=2, shuffle=shuffle, seed=seed))
    with original.loader(5, epochs=2, shuffle=shuffle, seed=seed) as loader:
        it = iter(loader)
        before = [dict(next(it)) for _ in range(6)]
        state = json.loads(json.dumps(loader.state_dict()))
    moved_dir = tmp_path / "elsewhere" / "copy"
    shutil.copytree(ds_dir, moved_dir)
    moved = open_dataset(moved_dir)
    assert moved.files[0]["image"].path != original.files[0]["image"].path
    after = collect(moved.loader(5, epochs=2, shuffle=shuffle, seed=seed, state=state))
    assert_same_batches(reference, before + after)


# -- property: random geometries -----------------------------------------------------------


@st.composite
def geometries(draw: st.DrawFn) -> dict[str, Any]:
    shuffle = draw(st.sampled_from(MODES))
    return {
        "counts": draw(st.lists(st.integers(0, 40), min_size=1, max_size=5)),
        "batch_size": draw(st.integers(1, 17)),
        "shards": draw(st.integers(1, 3)),
        "shuffle": shuffle,
        "seed": draw(st.integers(0, 2**32)) if shuffle else None,
        "cycle_length": draw(st.none() | st.integers(1, 4)),
        "block_length": draw(st.none() | st.integers(1, 6)),
        "window": draw(st.integers(1, 5)),
        "threads": draw(st.integers(1, 3)),
        "resume": draw(st.floats(0, 1)),
        "resume_shard": draw(st.integers(0, 2)),
    }


@settings(max_examples=40, deadline=None)
@given(g=geometries())
def test_property_cover_pairing_and_resume(tmp_path_factory: pytest.TempPathFactory, g: dict[str, Any]) -> None:
    base = tmp_path_factory.getbasetemp() / "property"
    base.mkdir(exist_ok=True)
    dataset = write_dataset(Path(tempfile.mkdtemp(dir=base)), g["counts"])
    total, c = sum(g["counts"]), g["shards"]

    def make(i: int) -> stoker.Loader:
        return dataset.loader(
            g["batch_size"], epochs=2, shuffle=g["shuffle"], seed=g["seed"], cycle_length=g["cycle_length"],
            block_length=g["block_length"], window=g["window"], threads=g["threads"], shard=(i, c), even=False,
        )  # fmt: skip

    epochs: list[list[np.ndarray]] = [[], []]
    for i in range(c):
        loader = make(i)
        per = len(loader)
        batches = collect(loader)
        assert len(batches) == 2 * per
        for e in range(2):
            epochs[e].append(ids_of(batches[e * per : (e + 1) * per]))  # pairs aligned
    for shard_ids in epochs:
        union = np.concatenate(shard_ids)
        np.testing.assert_array_equal(np.sort(union), np.arange(total))  # nothing lost or repeated

    i = g["resume_shard"] % c
    with make(i) as probe:
        n = 2 * len(probe)
    assert_resumable(lambda: make(i), steps=[round(g["resume"] * n)])


# -- epoch boundaries under deep prefetch --------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, "files"])
def test_many_epoch_boundaries_with_deep_prefetch(tmp_path: Path, shuffle: object) -> None:
    """Tiny epochs, deep prefetch: the dispatcher prepares the next epoch (retiring the last
    epoch's streams) while workers still finish that epoch's streams. Every pass must deliver
    every epoch whole; repeated because a race between the two shows only now and then."""
    dataset = write_dataset(tmp_path, [1] * 8)
    for trial in range(50):
        loader = dataset.loader(4, epochs=20, threads=4, prefetch=8, cycle_length=8, block_length=1,
                                shuffle=shuffle, seed=trial if shuffle else None)  # fmt: skip
        ids = ids_of(collect(loader))
        np.testing.assert_array_equal(np.sort(ids.reshape(20, 8), axis=1), np.tile(np.arange(8), (20, 1)))
