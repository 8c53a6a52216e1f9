"""StokerIterableDataset in a DataLoader, on one rank: every record once in every epoch and a new order
every epoch, whatever the worker count, start method and persistence, checked on the ids of the
batches the DataLoader returned. Workers started by spawn or forkserver read the split they were given.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.utils.data

import stoker
from stoker.torch import StokerIterableDataset
from tests.helpers.indexed import ids_of, open_dataset, write_dataset

pytestmark = pytest.mark.torch

COUNTS = (300, 300, 401)  # 1,001 records: no worker count divides them
TOTAL = sum(COUNTS)
BATCH = 50


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    return write_dataset(tmp_path_factory.mktemp("ids"), COUNTS)


def epochs_through(dl: torch.utils.data.DataLoader, epochs: int) -> list[list[tuple[int, ...]]]:
    """The ids of each batch the DataLoader returned, per DataLoader epoch (no set_epoch in between)."""
    out = []
    for _ in range(epochs):
        out.append([tuple(ids_of([{k: v.numpy() for k, v in b.items()}]).tolist()) for b in dl])
    return out


def own_batches(ds: stoker.Dataset, workers: int, epoch: int, **kw: object) -> list[tuple[int, ...]]:
    """The batches of `epoch` each worker's part of the shard holds, read by plain loaders."""
    out = []
    for w in range(max(1, workers)):
        with ds.loader(BATCH, shard=(w, max(1, workers)), even=False, epochs=epoch + 1, **kw) as loader:  # type: ignore[arg-type]
            per_epoch = len(loader)
            batches = [dict(b) for b in loader][epoch * per_epoch :]
        out.extend(tuple(ids_of([b]).tolist()) for b in batches)
    return sorted(out)


CASES = [
    # (num_workers, multiprocessing_context, persistent_workers, shuffle)
    (0, None, False, "global"),
    (0, None, False, False),
    (1, "fork", True, "global"),
    (2, "fork", False, False),
    (2, "fork", True, "global"),
    (3, "fork", False, "global"),
    (3, "fork", True, False),
    (2, "spawn", True, "global"),
    (2, "spawn", False, "global"),
    (3, "forkserver", True, "global"),
    (1, "forkserver", False, "global"),
]


@pytest.mark.parametrize(("workers", "context", "persistent", "shuffle"), CASES)
def test_every_record_once_per_epoch_and_a_new_order_each_epoch(
    ds: stoker.Dataset, workers: int, context: str | None, persistent: bool, shuffle: object
) -> None:
    kw = {"shuffle": shuffle, "seed": 11}
    batches = StokerIterableDataset(ds, BATCH, threads=1, **kw)  # type: ignore[arg-type]
    dl = torch.utils.data.DataLoader(
        batches, batch_size=None, num_workers=workers, multiprocessing_context=context,
        persistent_workers=persistent,
    )  # fmt: skip
    got = epochs_through(dl, 2)
    # set_epoch pins the next one, in workers already running too; spawn/forkserver workers that
    # are not persistent start (and import torch) every epoch: two epochs are enough there.
    pinned = context in (None, "fork") or persistent
    if pinned:
        batches.set_epoch(7)
        got += epochs_through(dl, 1)
    for epoch, delivered in zip([0, 1, 7], got, strict=False):
        ids = [i for b in delivered for i in b]
        assert sorted(ids) == list(range(TOTAL)), f"epoch {epoch}: {len(ids)} records, {len(set(ids))} distinct"
        assert sorted(delivered) == own_batches(ds, workers, epoch, **kw), f"epoch {epoch} is not epoch {epoch}'s"
    if shuffle:
        orders = [tuple(i for b in delivered for i in b) for delivered in got]
        assert len(set(orders)) == len(orders)  # a new order every epoch
    del dl


def test_reshuffle_each_iteration_false_replays_the_pinned_epoch(ds: stoker.Dataset) -> None:
    batches = StokerIterableDataset(ds, BATCH, shuffle="global", seed=3, threads=1, reshuffle_each_iteration=False)
    dl = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2, persistent_workers=True)
    got = epochs_through(dl, 2)
    assert got[0] == got[1] and sorted(got[0]) == own_batches(ds, 2, 0, shuffle="global", seed=3)
    batches.set_epoch(2)
    assert sorted(epochs_through(dl, 1)[0]) == own_batches(ds, 2, 2, shuffle="global", seed=3)
    del dl


def test_stateful_dataloader_goes_on_after_a_resumed_epoch(ds: stoker.Dataset) -> None:
    """A loaded state takes precedence over the epoch count; the DataLoader epoch after it is the next one."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> object:
        batches = StokerIterableDataset(ds, BATCH, shuffle="global", seed=7, threads=1)
        return sdl.StatefulDataLoader(batches, batch_size=None, num_workers=2, persistent_workers=True)

    whole = make()
    reference = epochs_through(whole, 2)  # type: ignore[arg-type]
    assert [sorted(e) for e in reference] == [own_batches(ds, 2, e, shuffle="global", seed=7) for e in (0, 1)]
    first = make()
    it = iter(first)  # type: ignore[call-overload]
    before = [tuple(ids_of([{k: v.numpy() for k, v in next(it).items()}]).tolist()) for _ in range(5)]
    state = first.state_dict()  # type: ignore[attr-defined]
    del it, first
    second = make()
    second.load_state_dict(state)  # type: ignore[attr-defined]
    after = epochs_through(second, 2)  # type: ignore[arg-type]
    assert before + after[0] == reference[0]
    assert after[1] == reference[1]
    del whole, second


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_state_saved_at_an_epochs_end_resumes_with_the_next_epoch(
    ds: stoker.Dataset, workers: int, persistent: bool
) -> None:
    """StatefulDataLoader saves such a state after each DataLoader epoch: the restarted job's next
    DataLoader epoch is the next epoch, not an empty one or a replay."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> object:
        batches = StokerIterableDataset(ds, BATCH, shuffle="global", seed=7, threads=1)
        return sdl.StatefulDataLoader(batches, batch_size=None, num_workers=workers, persistent_workers=persistent)

    first = make()
    epochs_through(first, 1)  # type: ignore[arg-type]
    state = first.state_dict()  # type: ignore[attr-defined]
    del first
    second = make()
    second.load_state_dict(state)  # type: ignore[attr-defined]
    after = epochs_through(second, 2)  # type: ignore[arg-type]
    assert [sorted(e) for e in after] == [own_batches(ds, workers, e, shuffle="global", seed=7) for e in (1, 2)]
    del second


# -- spawn and forkserver workers get the dataset they were given ------------------------
@pytest.fixture(scope="module")
def stale(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    """A dataset opened with index="ignore" over an index gone stale (a label file touched since)."""
    directory = tmp_path_factory.mktemp("stale")
    ds = write_dataset(directory, COUNTS)
    stoker.write_index(ds)
    path = ds.files[1]["label"].path
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(stoker.StaleIndexError):
        open_dataset(directory)
    return stoker.Dataset(ds.fields, index="ignore")


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_read_the_split_they_were_given(stale: stoker.Dataset, context: str) -> None:
    parts = stale.split({"train": 0.75, "val": 0.25}, seed=0, by="record")
    train = parts["train"]
    expected = sorted(ids_of([train.read(np.arange(len(train)))]).tolist())
    assert len(expected) == 751 and not set(expected) & set(ids_of([parts["val"].read(np.arange(250))]).tolist())
    batches = StokerIterableDataset(train, BATCH, shuffle="global", seed=2, threads=1)
    dl = torch.utils.data.DataLoader(
        batches, batch_size=None, num_workers=2, multiprocessing_context=context, persistent_workers=True
    )
    for delivered in epochs_through(dl, 2):
        assert sorted(i for b in delivered for i in b) == expected
    del dl
