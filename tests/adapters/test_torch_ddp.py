"""StokerIterableDataset under data parallelism: 2 gloo ranks in their own processes, each with 2-3
DataLoader workers (tests/helpers/torch_ddp.py), two DataLoader epochs each. The union over ranks and
workers of the ids the DataLoaders returned is every record once (pad_last, even=False), or with
even=True exactly what each rank's own loader delivers: all but the tail of the epoch's sequence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from tests.helpers import REPO
from tests.helpers.indexed import ids_of, write_dataset
from tests.helpers.torch_ddp import BATCH, EPOCHS, SCENARIOS

pytestmark = pytest.mark.torch

COUNTS = (300, 300, 401)
TOTAL = sum(COUNTS)
WORLD = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[stoker.Dataset, list[dict[str, Any]]]:
    """What each rank's DataLoaders returned, per scenario, per epoch, per batch."""
    tmp = tmp_path_factory.mktemp("ddp")
    ds = write_dataset(tmp / "data", COUNTS)
    helper = Path(__file__).resolve().parents[1] / "helpers" / "torch_ddp.py"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(helper),
                str(rank),
                str(WORLD),
                str(tmp / "init"),
                str(tmp / "data"),
                str(tmp / f"rank{rank}.json"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-4000:]
    return ds, [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def rank_alone(ds: stoker.Dataset, rank: int, epoch: int, settings: dict[str, Any]) -> list[int]:
    """What rank `rank`'s own loader (no DataLoader workers) delivers in `epoch`."""
    with ds.loader(BATCH, shard=(rank, WORLD), epochs=epoch + 1, **settings) as loader:
        per_epoch = len(loader)
        batches = [dict(b) for b in loader][epoch * per_epoch :]
    return ids_of(batches).tolist()


@pytest.mark.parametrize("name", ["even-2", "even-3"])
def test_even_trims_only_the_ranks_tail_with_workers(
    job: tuple[stoker.Dataset, list[dict[str, Any]]], name: str
) -> None:
    ds, ranks = job
    settings = SCENARIOS[name][2]
    for epoch in range(EPOCHS):
        union = []
        for rank, got in enumerate(ranks):
            mine = [i for b in got[name][epoch] for i in b]
            assert sorted(mine) == sorted(rank_alone(ds, rank, epoch, settings)), f"rank {rank} epoch {epoch}"
            union.extend(mine)
        assert len(union) == len(set(union)) == TOTAL - TOTAL % WORLD  # 1,000: one record trimmed
        (gone,) = set(range(TOTAL)) - set(union)
        if settings.get("shuffle") == "global":  # the last position of the epoch's permuted sequence
            assert gone == int(stoker.order.index_permutation(TOTAL, settings["seed"], epoch)(np.array([TOTAL - 1]))[0])
        assert len(ranks[0][name][epoch]) == len(ranks[1][name][epoch])  # the same number of steps
    if settings.get("shuffle") == "global":
        orders = [[i for r in ranks for b in r[name][e] for i in b] for e in range(EPOCHS)]
        assert orders[0] != orders[1]  # each DataLoader epoch a new order, without set_epoch


@pytest.mark.parametrize("name", ["pad_last-3", "uneven-2"])
def test_every_record_once_over_ranks_and_workers(job: tuple[stoker.Dataset, list[dict[str, Any]]], name: str) -> None:
    _, ranks = job
    for epoch in range(EPOCHS):
        union = [i for got in ranks for b in got[name][epoch] for i in b]
        assert sorted(union) == list(range(TOTAL)), f"epoch {epoch}: {len(union)} records, {len(set(union))} distinct"
    if name.startswith("pad_last"):
        assert {len(got[name][e]) for got in ranks for e in range(EPOCHS)} == {len(ranks[0][name][0])}
