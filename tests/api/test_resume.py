"""stoker.resume on its own: the state at a position, checked back to that position; the
fingerprint computed once per loader, however many states it saves."""

from __future__ import annotations

import json

import pytest

import stoker
from stoker.config import LoaderConfig
from stoker.errors import StateError
from stoker.resume import Resume


def test_a_state_checks_back_to_the_position_it_was_saved_at(pair_ds: stoker.Dataset) -> None:
    config = LoaderConfig(batch_size=4, shuffle="files", seed=3)
    resume = Resume(pair_ds, config, (2, 8))
    state = json.loads(json.dumps(resume.state_at((2, 12))))  # JSON-serializable, as saved
    assert resume.check(state) == (2, 12)
    # batch_size and shard may change on resume; the interleave may not.
    elastic = Resume(pair_ds, LoaderConfig(batch_size=8, shuffle="files", seed=3, shard=(1, 2)), (2, 8))
    assert elastic.check(state) == (2, 12)
    with pytest.raises(StateError, match="differs in: interleave") as e:
        Resume(pair_ds, config, (3, 8)).check(state)
    assert e.value.path == pair_ds.files[0]["image"].path and e.value.path in str(e.value)


def test_the_fingerprint_is_computed_once(pair_ds: stoker.Dataset, monkeypatch: pytest.MonkeyPatch) -> None:
    resume = Resume(pair_ds, LoaderConfig(batch_size=4), (2, 8))
    calls = []
    real = stoker.Dataset.records_in
    monkeypatch.setattr(stoker.Dataset, "records_in", lambda self, g: calls.append(g) or real(self, g))
    states = [resume.state_at((0, k)) for k in range(5)]
    for state in states:
        resume.check(state)
    assert len(calls) == pair_ds.num_groups  # one count per group, for the first state only
    assert len({s["fingerprint"] for s in states}) == 1
