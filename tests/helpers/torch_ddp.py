"""One rank of a gloo data-parallel job on this machine, run by tests/adapters/test_torch_ddp.py.

Usage: python torch_ddp.py RANK WORLD INIT_FILE DATA OUT

For each scenario the rank iterates a DataLoader with workers over `StokerIterableDataset` for two
DataLoader epochs (no set_epoch), with an all_reduce per step where every rank must take the same
number of steps (as DDP's gradient sync does), and writes to OUT (JSON) the record ids of each batch
it received per epoch, padding rows left out. Records of `tests/helpers/indexed.py` carry their id in
their first 4 image bytes, and their label equals it.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data

import stoker
from stoker.torch import StokerIterableDataset

BATCH = 50
EPOCHS = 2
# name -> (num_workers, persistent_workers, loader settings); even=False lets ranks differ in steps.
SCENARIOS: dict[str, tuple[int, bool, dict[str, Any]]] = {
    "even-2": (2, True, {"shuffle": "global", "seed": 5}),
    "even-3": (3, False, {"shuffle": False}),
    "pad_last-3": (3, True, {"shuffle": "global", "seed": 5, "pad_last": True}),
    "uneven-2": (2, False, {"shuffle": "global", "seed": 5, "even": False}),
}


def ids(batch: dict[str, torch.Tensor]) -> list[int]:
    image = batch["image"].numpy().reshape(len(batch["image"]), -1)
    found = np.ascontiguousarray(image[:, :4]).view("<u4")[:, 0].astype(np.int64)
    assert np.array_equal(batch["label"].numpy(), found.astype(np.float32)), "an image met another record's label"
    valid = batch["__valid__"].numpy() if "__valid__" in batch else np.ones(len(found), bool)
    return found[valid].tolist()


def main() -> None:
    rank, world, init, data, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    ds = stoker.Dataset(
        image=stoker.Field(f"{data}/img_*.bin", "int8", (4, 4, 1)),
        label=stoker.Field(f"{data}/out_*.bin.gz", "float32"),
    )
    result: dict[str, list[list[list[int]]]] = {}
    try:
        for name, (workers, persistent, settings) in SCENARIOS.items():
            batches = StokerIterableDataset(ds, BATCH, shard=(rank, world), threads=1, **settings)
            dl = torch.utils.data.DataLoader(
                batches, batch_size=None, num_workers=workers, persistent_workers=persistent
            )
            lockstep = settings.get("even", True) or settings.get("pad_last", False)
            epochs = []
            for _ in range(EPOCHS):
                got = []
                for batch in dl:
                    got.append(ids(batch))
                    if lockstep:
                        dist.all_reduce(torch.ones(1))  # a step every rank takes, or the job hangs
                epochs.append(got)
            result[name] = epochs
            del dl
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
