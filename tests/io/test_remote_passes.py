"""A loader's passes over remote files: the first batch's requests go out together, a pass that
follows another has its first bytes asked for while the one before delivers its last batches,
and leaving (close, break) leaves no request in flight.

The files are served by ``gated://`` (tests/helpers/gated.py), an fsspec filesystem that records
every ranged read and holds those the test says until it releases them; the records carry their
own index (tests/helpers/indexed.py), so what the consumer got is checked id by id, each with
its own label, against the same loader over the local files.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.engine import pipeline
from stoker.io.fetch import Fetcher
from tests.helpers import indexed
from tests.helpers.gated import GATE, GatedFileSystem, put

pytestmark = pytest.mark.remote

COUNTS = [40, 24, 33]  # records per group
BATCH = 8


@pytest.fixture
def data(tmp_path: Path) -> Iterator[tuple[stoker.Dataset, stoker.Dataset]]:
    """(the dataset over gated:// URLs, the same over the local files); reads recorded from
    the first batch on (the Dataset's own probes cleared)."""
    local_dir = tmp_path / "local"
    local = indexed.write_dataset(local_dir, COUNTS)
    urls = put(local_dir, f"stoker-{tmp_path.name}")
    ds = stoker.Dataset(
        image=stoker.Field(sorted(u for n, u in urls.items() if n.startswith("img")), "int8", (indexed.R,) * 2 + (1,)),
        label=stoker.Field(sorted(u for n, u in urls.items() if n.startswith("out")), "float32"),
    )
    assert len(ds) == sum(COUNTS)
    GATE.reset()
    try:
        yield ds, local
    finally:
        GATE.release()
        for key in [k for k in GatedFileSystem.files if k.startswith(f"stoker-{tmp_path.name}/")]:
            del GatedFileSystem.files[key]


@pytest.fixture
def fetchers(monkeypatch: pytest.MonkeyPatch) -> list[Fetcher]:
    """Every Fetcher the loaders' passes make."""
    made: list[Fetcher] = []

    class Recorded(Fetcher):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(pipeline, "Fetcher", Recorded)
    return made


def _until(what: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether `what()` holds within `seconds` (looked at every 5 ms)."""
    until = time.monotonic() + seconds
    while not what():
        if time.monotonic() > until:
            return False
        time.sleep(0.005)
    return True


def _ids(batches: list[dict[str, np.ndarray]]) -> np.ndarray:
    return indexed.ids_of(batches)  # checks every image met its own label


def _group_of(ids: np.ndarray) -> set[int]:
    return set(np.searchsorted(np.cumsum(COUNTS), ids, side="right").tolist())


def _passes(loader: stoker.Loader, n: int) -> list[np.ndarray]:
    return [_ids([dict(b) for b in loader]) for _ in range(n)]


def test_the_first_batch_asks_for_everything_it_reads_at_once(data: tuple[stoker.Dataset, stoker.Dataset]) -> None:
    ds, local = data
    with local.loader(BATCH) as ref:
        want = _ids([next(iter(ref))])
    GATE.hold()  # nothing completes until every read the first batch needs is outstanding
    got: list[dict[str, np.ndarray]] = []
    with ds.loader(BATCH, threads=2) as loader:
        consumer = threading.Thread(target=lambda: got.append(dict(next(iter(loader)))), daemon=True)
        consumer.start()
        needed = {f"{kind}_{g:04d}" for g in _group_of(want) for kind in ("img", "out")}
        assert _until(lambda: needed <= {r.name.split(".")[0] for r in GATE.outstanding()}), GATE.requests
        assert all(r.state == "held" for r in GATE.requests)  # one round: none had to complete first
        GATE.release()
        consumer.join(10)
    assert not consumer.is_alive()
    np.testing.assert_array_equal(_ids(got), want)


@pytest.mark.parametrize("shuffle", [False, "files"])
def test_a_pass_that_follows_another_asks_for_its_first_bytes_before_the_last_batch_of_the_one_before(
    data: tuple[stoker.Dataset, stoker.Dataset], shuffle: Any
) -> None:
    ds, local = data
    groups = len(COUNTS)
    with local.loader(BATCH, shuffle=shuffle, seed=3) as ref:
        want = _passes(ref, 3)
    with ds.loader(BATCH, shuffle=shuffle, seed=3, threads=2) as loader:
        got = [_ids([dict(b) for b in loader])]
        batches = len(loader)
        it = iter(loader)
        second = [dict(b) for b in itertools.islice(it, batches - 1)]
        # Each pass opens each label file once; the third pass's first batch reads one more.
        assert _until(lambda: GATE.count("out_") > 2 * groups), [r.name for r in GATE.requests]
        second += [dict(b) for b in it]
        got += [_ids(second), _ids([dict(b) for b in loader])]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(np.sort(g), np.arange(sum(COUNTS)))


@pytest.mark.parametrize("leave", ["close", "break"])
def test_leaving_a_loader_cancels_the_next_passs_requests_and_lets_their_bytes_go(
    data: tuple[stoker.Dataset, stoker.Dataset], fetchers: list[Fetcher], leave: str
) -> None:
    ds, local = data
    with local.loader(BATCH) as ref:
        want = _passes(ref, 3)
    loader = ds.loader(BATCH, threads=2)
    first = _ids([dict(b) for b in loader])
    GATE.hold(2 * len(GATE.requests))  # the second pass reads what the first did; the third's wait
    it = iter(loader)
    second = [dict(b) for b in itertools.islice(it, len(loader) - 1)]
    assert _until(lambda: any(r.state == "held" for r in GATE.requests)), "the next pass asked for nothing"
    if leave == "close":
        second += [dict(b) for b in it]
        loader.close()
    else:
        del it  # broken out of before its last batch: dropped
    assert _until(lambda: not GATE.outstanding()), GATE.outstanding()
    assert all(r.state == "cancelled" for r in GATE.requests if r.seq >= GATE.hold_from)  # type: ignore[operator]
    assert all(f.in_flight == 0 and f.ahead == 0 for f in fetchers)
    np.testing.assert_array_equal(first, want[0])
    if leave == "close":
        np.testing.assert_array_equal(_ids(second), want[1])
        return
    GATE.release()
    np.testing.assert_array_equal(_ids(second), want[1][: len(_ids(second))])
    third = _ids([dict(b) for b in loader])  # starts afresh, past the epoch it left
    np.testing.assert_array_equal(third, want[2])
    loader.close()


def _second_pass_reading_on(loader: stoker.Loader, labels_per_pass: int) -> np.ndarray:
    """A loader's second pass, whose last batch is taken only once the third pass's first label
    reads went out (its ids, each checked against its label)."""
    at_start = GATE.count("out_")
    it = iter(loader)
    batches = len(loader) * (loader.epochs or 1)
    got = [dict(b) for b in itertools.islice(it, batches - 1)]
    assert _until(lambda: GATE.count("out_") > at_start + labels_per_pass), [r.name for r in GATE.requests]
    got += [dict(b) for b in it]
    return _ids(got)


@pytest.mark.parametrize("shuffle", [False, "files", "global"])
@pytest.mark.parametrize("epochs", [1, 2])
def test_passes_read_on_into_the_next_and_deliver_every_record_of_each_epoch_once(
    data: tuple[stoker.Dataset, stoker.Dataset], shuffle: Any, epochs: int
) -> None:
    ds, local = data
    kw: dict[str, Any] = {"shuffle": shuffle, "seed": 11, "epochs": epochs}
    with local.loader(BATCH, **kw) as ref:
        want = _passes(ref, 5)
    before = GATE.count("out_")
    with ds.loader(BATCH, threads=2, **kw) as once:  # a loader iterated once reads no further
        _passes(once, 1)
    labels_per_pass = GATE.count("out_") - before
    with ds.loader(BATCH, threads=2, **kw) as loader:
        got = [*_passes(loader, 1), _second_pass_reading_on(loader, labels_per_pass), *_passes(loader, 1)]
        it = iter(loader)  # the fourth pass, left part way: its state resumed by a new loader
        part = [dict(b) for b in itertools.islice(it, 5)]
        state = loader.state_dict()
        del it
    with ds.loader(BATCH, threads=2, state=state, **kw) as resumed:
        rest = [dict(b) for b in resumed]
        got += [_ids(part + rest), _second_pass_reading_on(resumed, labels_per_pass)]
    per_epoch = sum(COUNTS)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
        for e in range(epochs):
            np.testing.assert_array_equal(np.sort(g[e * per_epoch : (e + 1) * per_epoch]), np.arange(per_epoch))
