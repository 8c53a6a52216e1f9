"""Exactly once, as the reliability page states it, over real files: for any record count, ranks,
DataLoader-style workers within a rank, order and trim mode, the union of what every rank's
workers deliver in an epoch is every record once (`even=False`, `pad_last`), or all but the
epoch's last `len(ds) % ranks` positions (`even=True`), and every record meets its own label."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stoker
from stoker.loader import Loader, LoaderConfig
from stoker.torch import worker_shard
from tests.helpers.indexed import ids_of, write_dataset

MODES = ("even", "uneven", "pad_last")


def _epochs_ids(ds: stoker.Dataset, rank: tuple[int, int], workers: int, mode: str, **kw: object) -> list:
    """Per epoch (two), per worker of `rank`, the record ids its loader delivers (padding rows
    dropped), each loader built as `stoker.torch.StokerIterableDataset` builds a worker's."""
    out: list[list[np.ndarray]] = [[], []]
    for w in range(workers):
        loader = Loader(
            ds,
            LoaderConfig(
                shard=worker_shard(rank, w, workers),
                even_over=rank[1] if workers > 1 else None,
                even=mode == "even",
                pad_last=mode == "pad_last",
                with_index=True,
                epochs=2,
                **kw,  # type: ignore[arg-type]
            ),
        )
        with loader:
            per_epoch = len(loader)  # batches never span epochs
            batches = list(loader)
        assert len(batches) == 2 * per_epoch
        for epoch in (0, 1):
            part = batches[epoch * per_epoch : (epoch + 1) * per_epoch]
            if mode == "pad_last":
                part = [{k: v[b["__valid__"]] for k, v in b.items()} for b in part if b["__valid__"].any()]
            out[epoch].append(ids_of(part))
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=4).filter(lambda c: sum(c) > 0),
    ranks=st.integers(1, 3),
    workers=st.integers(1, 3),
    shuffle=st.sampled_from([False, "global", "files"]),
    mode=st.sampled_from(MODES),
    batch=st.integers(1, 9),
)
def test_every_epoch_is_each_record_once_over_ranks_and_workers_or_the_documented_trim(
    counts: list[int], ranks: int, workers: int, shuffle: object, mode: str, batch: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ds = write_dataset(Path(tmp), counts)
        total = len(ds)
        kw = {"batch_size": batch, "shuffle": shuffle, "seed": 5 if shuffle else None}
        per_rank = [_epochs_ids(ds, (r, ranks), workers, mode, **kw) for r in range(ranks)]
        for epoch in (0, 1):
            got = np.concatenate([ids for rank in per_rank for ids in rank[epoch]])
            assert len(np.unique(got)) == len(got), f"epoch {epoch}: a record delivered twice"
            if mode != "even":
                np.testing.assert_array_equal(np.sort(got), np.arange(total))
                continue
            assert len(got) == total - total % ranks
            # Ranks deliver equal counts, so collectives meet, and each rank what its own loader would.
            assert len({sum(map(len, rank[epoch])) for rank in per_rank}) == 1
            for r, rank in enumerate(per_rank):
                alone = _epochs_ids(ds, (r, ranks), 1, mode, **kw)[epoch][0]
                np.testing.assert_array_equal(np.sort(np.concatenate(rank[epoch])), np.sort(alone))
            # The trimmed records are the tail of the epoch's sequence (one shard's whole order).
            sequence = _epochs_ids(ds, (0, 1), 1, "uneven", **kw)[epoch][0]
            trimmed = set(range(total)) - set(got.tolist())
            assert trimmed == set(sequence[len(sequence) - total % ranks :].tolist())
