"""Passes: a loader iterated again goes on with the next epochs; one live pass at a time, said loudly."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.testing import assert_resumable, assert_same_batches
from tests.helpers.indexed import collect, ids_of, write_dataset

COUNTS = [37, 0, 50, 13, 63]  # 163 records (prime: every shard count trims), one empty group
TOTAL = sum(COUNTS)
SHUFFLES: list[Any] = ["global", "files"]
# A state the previous release saved (epochs=2, batch 5, seed 7, 13 batches in) from a dataset
# written by tests.helpers.indexed.write_dataset(dir, [17, 0, 23, 9]): it must still load and resume.
OLD_STATES = {
    "global": {
        "version": 1, "epoch": 1, "position": 15, "seed": 7, "batch_size": 5, "shard": [0, 1],
        "fingerprint": "a87f328d629097b6",
        "parts": {
            "counts": "2221d8046c105e27", "fields": "b0f987ad16177c7f", "basenames": "eed50da879f5277f",
            "shuffle": "8deaf2c760a65b07", "seed": "beced1fe696351bb", "window": "e741527209ffc99f",
            "drop_remainder": "5679ca28262db37b", "interleave": "8d65341dc1ce53a9",
        },
    },
    "files": {
        "version": 1, "epoch": 1, "position": 15, "seed": 7, "batch_size": 5, "shard": [0, 1],
        "fingerprint": "6fdabc45e40120f2",
        "parts": {
            "counts": "2221d8046c105e27", "fields": "b0f987ad16177c7f", "basenames": "eed50da879f5277f",
            "shuffle": "8bd980f6e1185b11", "seed": "beced1fe696351bb", "window": "fc6e86f4b9c4431e",
            "drop_remainder": "5679ca28262db37b", "interleave": "8d65341dc1ce53a9",
        },
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    return write_dataset(tmp_path_factory.mktemp("passes"), COUNTS)


def passes_of(loader: stoker.Loader, n: int) -> list[np.ndarray]:
    """The record ids of ``n`` passes of ``loader``, one array per pass."""
    with loader:
        return [ids_of([dict(b) for b in loader]) for _ in range(n)]


def assert_distinct_permutations(runs: list[np.ndarray]) -> None:
    for ids in runs:
        np.testing.assert_array_equal(np.sort(ids), np.arange(TOTAL))  # every record exactly once
    for a, b in itertools.combinations(runs, 2):
        assert not np.array_equal(a, b)


# -- epochs across passes ----------------------------------------------------------------


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_an_epochs_1_loader_iterated_3_times_gives_the_3_epochs_of_one_epochs_3_pass(
    ds: stoker.Dataset, shuffle: str
) -> None:
    loader = ds.loader(10, epochs=1, shuffle=shuffle, seed=7, threads=2)
    per = len(loader)
    runs = passes_of(loader, 3)
    assert len(loader) == per  # len is one pass's epoch, as before
    assert_distinct_permutations(runs)
    one_pass = collect(ds.loader(10, epochs=3, shuffle=shuffle, seed=7))
    np.testing.assert_array_equal(np.concatenate(runs), ids_of(one_pass))


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_pass_k_of_an_epochs_2_loader_covers_epochs_2k_and_2k_plus_1(ds: stoker.Dataset, shuffle: str) -> None:
    runs = passes_of(ds.loader(16, epochs=2, shuffle=shuffle, seed=3), 2)
    four = ids_of(collect(ds.loader(16, epochs=4, shuffle=shuffle, seed=3)))
    np.testing.assert_array_equal(np.concatenate(runs), four)


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_reshuffle_each_iteration_false_replays_the_same_epochs(ds: stoker.Dataset, shuffle: str) -> None:
    runs = passes_of(ds.loader(10, shuffle=shuffle, seed=7, reshuffle_each_iteration=False), 3)
    first = ids_of(collect(ds.loader(10, shuffle=shuffle, seed=7)))
    for ids in runs:
        np.testing.assert_array_equal(ids, first)


def test_an_unshuffled_loader_gives_the_same_order_every_pass(ds: stoker.Dataset) -> None:
    runs = passes_of(ds.loader(10), 2)
    np.testing.assert_array_equal(runs[0], runs[1])


def test_a_pass_broken_out_of_is_followed_by_the_next_pass_not_a_replay(ds: stoker.Dataset) -> None:
    loader = ds.loader(10, epochs=1, shuffle="global", seed=7)
    with loader:
        for k, _ in enumerate(loader):
            if k == 2:
                break
        second = ids_of([dict(b) for b in loader])
    reference = ids_of(collect(ds.loader(10, epochs=2, shuffle="global", seed=7)))
    np.testing.assert_array_equal(second, reference[TOTAL:])


def test_a_loader_that_repeats_forever_goes_on_with_the_epoch_after_the_last_it_delivered(
    ds: stoker.Dataset,
) -> None:
    per = -(-TOTAL // 10)
    reference = collect(ds.loader(10, epochs=5, shuffle="global", seed=7))
    with ds.loader(10, epochs=None, shuffle="global", seed=7) as loader:
        first = [dict(b) for b in itertools.islice(loader, per + 2)]  # epoch 0 and two batches of epoch 1
        second = [dict(b) for b in itertools.islice(loader, per)]  # epoch 2
        third = [dict(b) for b in itertools.islice(loader, 0)]  # started, nothing taken: epoch 3 passed over
        fourth = [dict(b) for b in itertools.islice(loader, 1)]
    assert third == []
    assert_same_batches(reference[: per + 2], first)
    assert_same_batches(reference[2 * per : 3 * per], second)
    assert_same_batches(reference[4 * per : 4 * per + 1], fourth)


def test_reshuffle_each_iteration_must_be_a_bool(ds: stoker.Dataset) -> None:
    with pytest.raises(stoker.SpecError, match="reshuffle_each_iteration=1 must be True or False"):
        ds.loader(10, shuffle="global", seed=1, reshuffle_each_iteration=1)  # type: ignore[arg-type]


# -- resume across passes ----------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, *SHUFFLES])
@pytest.mark.parametrize("config", [{"batch_size": 16}, {"batch_size": 7, "shard": (1, 3), "drop_remainder": True}])
def test_assert_resumable_across_three_passes(ds: stoker.Dataset, shuffle: object, config: dict[str, Any]) -> None:
    assert_resumable(lambda: ds.loader(epochs=1, shuffle=shuffle, seed=5, threads=2, **config), steps=9, passes=3)


def test_assert_resumable_across_passes_that_replay(ds: stoker.Dataset) -> None:
    make = lambda: ds.loader(12, epochs=2, shuffle="global", seed=5, reshuffle_each_iteration=False)  # noqa: E731
    assert_resumable(make, steps=5, passes=2)


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_a_state_saved_mid_pass_2_resumes_in_pass_2_then_goes_on_with_pass_3(ds: stoker.Dataset, shuffle: str) -> None:
    def make(**kw: Any) -> stoker.Loader:
        return ds.loader(10, epochs=1, shuffle=shuffle, seed=7, **kw)

    reference = passes_of(make(), 3)
    with make() as loader:
        list(loader)
        it = iter(loader)
        before = ids_of([dict(next(it)) for _ in range(5)])
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 50
    resumed = make(state=state)
    rest_of_pass_2, pass_3 = passes_of(resumed, 2)
    np.testing.assert_array_equal(np.concatenate([before, rest_of_pass_2]), reference[1])
    np.testing.assert_array_equal(pass_3, reference[2])


def test_a_state_saved_between_passes_resumes_with_the_next_pass(ds: stoker.Dataset) -> None:
    with ds.loader(10, epochs=2, shuffle="global", seed=7) as loader:
        list(loader)
        state = json.loads(json.dumps(loader.state_dict()))
        expected = ids_of([dict(b) for b in loader])
    assert (state["epoch"], state["position"]) == (2, 0)
    np.testing.assert_array_equal(ids_of(collect(ds.loader(10, epochs=2, shuffle="global", seed=7, state=state))),
                                  expected)  # fmt: skip


@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_a_state_of_the_previous_release_still_loads_and_resumes(tmp_path: Path, shuffle: str) -> None:
    small = write_dataset(tmp_path, [17, 0, 23, 9])
    reference = collect(small.loader(5, epochs=2, shuffle=shuffle, seed=7))
    with small.loader(5, epochs=2, shuffle=shuffle, seed=7, state=OLD_STATES[shuffle]) as loader:
        rest = [dict(b) for b in loader]
        after = ids_of([dict(b) for b in loader])  # and the pass after it: epochs 2 and 3
    assert_same_batches(reference, reference[:13] + rest)
    four = ids_of(collect(small.loader(5, epochs=4, shuffle=shuffle, seed=7)))
    np.testing.assert_array_equal(after, four[98:])


def test_a_state_past_epochs_resumes_in_its_own_pass(ds: stoker.Dataset) -> None:
    """Epoch 5 of an epochs=2 loader is pass 2's second epoch: the rest of it, then pass 3."""
    reference = passes_of(ds.loader(10, epochs=2, shuffle="global", seed=7), 4)
    with ds.loader(10, epochs=6, shuffle="global", seed=7) as six:  # the same order in one pass
        it = iter(six)
        for _ in range(5 * len(six) + 3):
            next(it)
        state = json.loads(json.dumps(six.state_dict()))
    assert (state["epoch"], state["position"]) == (5, 30)
    runs = passes_of(ds.loader(10, epochs=2, shuffle="global", seed=7, state=state), 2)
    np.testing.assert_array_equal(runs[0], reference[2][TOTAL + 30 :])
    np.testing.assert_array_equal(runs[1], reference[3])


# -- one live pass, said loudly ----------------------------------------------------------


def test_zip_of_a_loader_with_itself_raises_superseded_error(ds: stoker.Dataset) -> None:
    loader = ds.loader(10)
    with loader, pytest.raises(stoker.SupersededError, match="ended by a newer iter"):
        list(zip(loader, loader, strict=False))
    assert isinstance(stoker.SupersededError("x"), RuntimeError)


def test_a_superseded_iterator_raises_and_the_newer_one_delivers_everything(ds: stoker.Dataset) -> None:
    with ds.loader(10, shuffle="global", seed=2) as loader:
        old = iter(loader)
        next(old)
        new = iter(loader)
        with pytest.raises(stoker.SupersededError):
            next(old)
        with pytest.raises(stoker.SupersededError):  # every time: it never yields again
            next(old)
        ids = ids_of([dict(b) for b in new])
    np.testing.assert_array_equal(np.sort(ids), np.arange(TOTAL))


def test_an_ended_or_closed_iterator_stays_ended_when_a_newer_pass_starts(ds: stoker.Dataset) -> None:
    with ds.loader(10) as loader:
        ended = iter(loader)
        list(ended)
        closed = iter(loader)
        next(closed)
        closed.close()  # type: ignore[attr-defined]
        new = iter(loader)
        assert next(ended, None) is None and next(closed, None) is None
        assert len(list(new)) == len(loader)


# -- crafted states: a clear StateError, never a short or empty run ------------------------


def _state(ds: stoker.Dataset, **kw: Any) -> dict[str, Any]:
    with ds.loader(10, epochs=2, shuffle="global", seed=7) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        return {**json.loads(json.dumps(loader.state_dict())), **kw}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position": 10**9}, "position=1000000000, past the end of epoch 0 .163 records"),
        ({"position": TOTAL + 1}, "position=164, past the end of epoch 0"),
        ({"position": True}, "position=True; it must be a non-negative integer"),
        ({"position": 3.0}, "position=3.0; it must be a non-negative integer"),
        ({"epoch": False}, "epoch=False; it must be a non-negative integer"),
        ({"epoch": "1"}, "epoch='1'; it must be a non-negative integer"),
        ({"version": True}, "not a stoker loader state"),
        ({"seed": "7"}, "seed='7'; it must be a non-negative integer or None"),
        ({"batch_size": 0}, "batch_size=0; it must be a positive integer"),
        ({"shard": [3, 2]}, r"shard=\[3, 2\]; it must be \[index, count\]"),
        ({"shard": [0, True]}, r"shard=\[0, True\]"),
        ({"fingerprint": 5}, "fingerprint=5; it must be a string"),
        ({"parts": [1, 2]}, r"parts=\[1, 2\]; it must be a mapping of part names to digests"),
        ({"parts": [1, 2], "fingerprint": "0" * 16}, r"parts=\[1, 2\]"),
        # Numbers past int64 or past the dataset: refused before any of them is used.
        (
            {"shard": [0, 10**12], "position": 10**11},
            r"shard=\[0, 1000000000000\]: 1000000000000 shards of an epoch of 163",
        ),
        ({"shard": [0, 164], "position": 163 + 163}, r"shard=\[0, 164\]: 164 shards of an epoch of 163 records"),
        ({"shard": [0, 2**64]}, r"shard=\[0, 18446744073709551616\]; it must be \[index, count\] with 0 <= index"),
        ({"epoch": 2**64}, r"epoch=18446744073709551616; it must be a non-negative integer below 2\*\*63"),
        ({"position": 2**63}, r"position=9223372036854775808; it must be a non-negative integer below 2\*\*63"),
        ({"batch_size": 2**63}, r"batch_size=9223372036854775808; it must be a positive integer below 2\*\*63"),
        ({"seed": 8}, "seed=8, this loader's seed is 7"),
    ],
)
def test_a_crafted_state_is_a_state_error_naming_the_value_and_the_dataset(
    ds: stoker.Dataset, change: dict[str, Any], message: str
) -> None:
    loader = ds.loader(10, epochs=2, shuffle="global", seed=7)
    with pytest.raises(stoker.StateError, match=message) as info:
        loader.load_state_dict(_state(ds, **change))
    assert info.value.path is not None and info.value.path.endswith("img_0000.bin")


def test_an_epoch_past_epochs_without_reshuffling_is_a_state_error(ds: stoker.Dataset) -> None:
    state = _state(ds, epoch=2)  # pass 1 of a reshuffling loader: no such epoch when every pass replays
    loader = ds.loader(10, epochs=2, shuffle="global", seed=7, reshuffle_each_iteration=False)
    with pytest.raises(stoker.StateError, match="epoch=2, past this loader's epochs=2"):
        loader.load_state_dict(state)
    loader.load_state_dict(_state(ds, epoch=1))  # within epochs: fine


def test_a_shards_last_position_past_the_epoch_end_is_a_valid_state(ds: stoker.Dataset) -> None:
    """Shard 0 of 3 without trimming ends epoch 0 at position 165 of 163: the epoch is done."""
    with ds.loader(10, epochs=2, shard=(0, 3), even=False, shuffle="global", seed=7) as loader:
        it = iter(loader)
        batches = [dict(next(it)) for _ in range(len(loader))]
        state = json.loads(json.dumps(loader.state_dict()))
        rest = [dict(b) for b in it]
    assert (state["epoch"], state["position"]) == (0, TOTAL + 2)
    assert batches and rest
    resumed = collect(ds.loader(10, epochs=2, shard=(0, 3), even=False, shuffle="global", seed=7, state=state))
    assert_same_batches(rest, resumed)
    with pytest.raises(stoker.StateError, match="past the end"):
        ds.loader(10, epochs=2, shuffle="global", seed=7).load_state_dict({**state, "shard": [0, 1]})


def test_a_state_claiming_more_shards_than_records_skips_nothing(ds: stoker.Dataset) -> None:
    """10**12 shards would put the position anywhere up to 10**12 - 1 past the end: the rest of the
    epoch skipped. Refused, and the same loader goes on to deliver every record of epoch 0 once."""
    loader = ds.loader(10, epochs=2, shuffle="global", seed=7)
    with pytest.raises(stoker.StateError, match="shard=") as info:
        loader.load_state_dict(_state(ds, shard=[0, 10**12], position=10**11))
    assert info.value.path is not None and info.value.path.endswith("img_0000.bin")
    ids = ids_of(collect(loader))
    assert sorted(ids[:TOTAL].tolist()) == list(range(TOTAL)) == sorted(ids[TOTAL:].tolist())


def test_a_loaders_own_state_loads_with_more_shards_than_records(ds: stoker.Dataset) -> None:
    """World size above the record count (a tiny eval set on many ranks) is a valid state."""
    with ds.loader(10, epochs=2, shard=(5, 200), even=False) as loader:
        it = iter(loader)
        first = dict(next(it))
        state = json.loads(json.dumps(loader.state_dict()))
        rest = [dict(b) for b in it]
    assert len(first["image"]) == 1 and len(rest) == 1
    assert_same_batches(rest, collect(ds.loader(10, epochs=2, shard=(5, 200), even=False, state=state)))


def test_assert_resumable_refuses_bad_passes(ds: stoker.Dataset) -> None:
    for passes in (0, True, 1.5):
        with pytest.raises(ValueError, match="passes="):
            assert_resumable(lambda: ds.loader(10), passes=passes)  # type: ignore[arg-type]


# -- through the adapters ----------------------------------------------------------------


@pytest.mark.tf
def test_to_tf_iterated_twice_gives_two_epochs(ds: stoker.Dataset) -> None:
    tfds = ds.loader(10, epochs=1, shuffle="global", seed=7).to_tf()
    runs = [ids_of([{k: v.numpy() for k, v in b.items()} for b in tfds]) for _ in range(2)]
    assert_distinct_permutations(runs)
    np.testing.assert_array_equal(np.concatenate(runs), ids_of(collect(ds.loader(10, epochs=2, shuffle="global",
                                                                                 seed=7))))  # fmt: skip


@pytest.mark.tf
def test_keras_fit_sees_a_new_permutation_each_epoch(ds: stoker.Dataset) -> None:
    import tensorflow as tf

    seen: list[np.ndarray] = []

    def record(labels: tf.Tensor) -> tf.Tensor:
        seen.append(labels.numpy().astype(np.int64))
        return labels

    def pair(b: dict[str, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
        labels = tf.py_function(record, [b["label"]], tf.float32)
        labels.set_shape([None])
        return tf.reshape(tf.cast(b["image"], tf.float32), [-1, 16]), labels

    loader = ds.loader(16, epochs=1, shuffle="global", seed=7)
    model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(loader.to_tf().map(pair), epochs=2, shuffle=False, verbose=0)
    got = np.concatenate(seen)
    assert len(got) == 2 * TOTAL
    assert_distinct_permutations([got[:TOTAL], got[TOTAL:]])
    np.testing.assert_array_equal(got, ids_of(collect(ds.loader(16, epochs=2, shuffle="global", seed=7))))


@pytest.mark.torch
def test_to_torch_passes_go_on_and_a_state_between_them_resumes_with_the_next(ds: stoker.Dataset) -> None:
    def make(**kw: Any) -> stoker.Loader:
        return ds.loader(10, epochs=1, shuffle="files", seed=7, **kw)

    batches = make().to_torch()
    runs = []
    for _ in range(2):
        runs.append(np.concatenate([b["label"].numpy().astype(np.int64) for b in batches]))
    state = json.loads(json.dumps(batches.state_dict()))
    batches.close()
    assert (state["epoch"], state["position"]) == (2, 0)
    assert_distinct_permutations(runs)
    reference = ids_of(collect(ds.loader(10, epochs=3, shuffle="files", seed=7)))
    np.testing.assert_array_equal(np.concatenate(runs), reference[: 2 * TOTAL])
    resumed = make().to_torch()
    resumed.load_state_dict(state)
    third = np.concatenate([b["label"].numpy().astype(np.int64) for b in resumed])
    resumed.close()
    np.testing.assert_array_equal(third, reference[2 * TOTAL :])


@pytest.mark.jax
def test_to_jax_passes_go_on(ds: stoker.Dataset) -> None:
    batches = ds.loader(10, epochs=1, shuffle="global", seed=7).to_jax()
    with batches:
        runs = [np.concatenate([np.asarray(b["label"]).astype(np.int64) for b in batches]) for _ in range(2)]
        state = batches.state_dict()
    assert (state["epoch"], state["position"]) == (2, 0)
    np.testing.assert_array_equal(np.concatenate(runs), ids_of(collect(ds.loader(10, epochs=2, shuffle="global",
                                                                                 seed=7))))  # fmt: skip
