"""Soak: 20 shuffled epochs, resumed from a saved state every few hundred batches.

Each epoch must deliver every record exactly once, each one equal to an independent reading
of the files, and the process must not drift: after every close no file of the dataset open or
mapped and no stoker thread alive, descriptors and threads never more than at the first resume
point, private memory (RssAnon + RssShmem) flat. Marked slow; `make test` still runs it.
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest

import stoker
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, build, reference
from tests.helpers.resources import mapped_paths, open_paths, stoker_threads

EPOCHS = 20


def _private() -> int:
    """RssAnon + RssShmem: stoker's batch buffers are shared anonymous maps, counted as RssShmem.
    (At the resume points no record file is mapped, so no page cache is in either.)"""
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", ["global", "files"])
def test_twenty_shuffled_epochs_with_resumes_lose_nothing_and_leak_nothing(tmp_path: Path, shuffle: str) -> None:
    fields = {"image": IMG, "label": LAB_GZ, "mask": FieldPlan("msk", "uint16", (3,), kind="zlib")}
    ds = build(tmp_path, [1000, 900, 0, 1100, 950, 850], fields)
    ref = reference(ds)
    starts = np.concatenate([[0], np.cumsum([ds.records_in(g) for g in range(ds.num_groups)])])
    flat = {n: np.concatenate([r[n] for r in ref]).astype(ds.fields[n].native_dtype) for n in fields}
    total = int(starts[-1])

    def make(state: dict | None) -> stoker.Loader:
        return ds.loader(8, epochs=EPOCHS, shuffle=shuffle, seed=2024, block_length=16, threads=2, with_index=True,
                         memory_budget="4MiB", state=state)  # fmt: skip

    per_epoch = len(make(None))
    seen = np.zeros((EPOCHS, total), np.int32)
    orders: list[list[np.ndarray]] = [[] for _ in range(EPOCHS)]
    rng = random.Random(7)
    checkpoints: list[tuple[int, int, int]] = []  # (fds, threads, private memory) at each resume point
    state: dict | None = None
    delivered = 0
    while delivered < EPOCHS * per_epoch:
        stop_after = delivered + rng.randint(200, 400)
        loader = make(state)
        for batch in loader:
            ids = starts[batch["__group__"]] + batch["__index__"]
            for name, values in flat.items():
                assert np.array_equal(batch[name], values[ids]), f"batch {delivered}: field {name!r} is wrong"
            epoch = delivered // per_epoch
            seen[epoch, ids] += 1
            orders[epoch].append(ids)
            delivered += 1
            if delivered == stop_after:
                break
        state = json.loads(json.dumps(loader.state_dict()))  # as a job would store it
        loader.close()
        del loader, batch
        checkpoints.append((len(os.listdir("/proc/self/fd")), threading.active_count(), _private()))
        held = open_paths(tmp_path) + mapped_paths(tmp_path)
        assert held == [], f"after close, at batch {delivered}, still open or mapped: {held}"
        assert stoker_threads() == [], f"after close, at batch {delivered}: {stoker_threads()}"
    assert delivered == EPOCHS * per_epoch and len(checkpoints) >= 25
    assert (seen == 1).all(), f"epochs with lost or repeated records: {np.flatnonzero((seen != 1).any(axis=1))}"
    assert len({np.concatenate(o).tobytes() for o in orders}) == EPOCHS  # every epoch shuffled differently
    fds = {c[0] for c in checkpoints}
    threads = {c[1] for c in checkpoints}
    # No file of the dataset is held and no stoker thread is alive after a close (checked at
    # every resume point above), and the process's descriptors and threads never grow. They may
    # shrink: other libraries loaded by earlier tests in this process close descriptors and end
    # threads in the background (full runs saw descriptors 45, 41, 37 and threads 7, 5, 4).
    assert max(fds) <= checkpoints[0][0], f"file descriptors grow: {[c[0] for c in checkpoints]}"
    assert max(threads) <= checkpoints[0][1], f"threads grow: {[c[1] for c in checkpoints]}"
    rss = [c[2] for c in checkpoints]
    mib = [r >> 20 for r in rss]
    print(f"soak {shuffle}: {delivered} batches, {len(checkpoints)} resumes, fds {fds}, threads {threads}, "
          f"RssAnon+RssShmem MiB first/settled/max/last {mib[0]}/{mib[2]}/{max(mib)}/{mib[-1]}")  # fmt: skip
    settled = rss[2]  # after the first few passes have warmed numpy's and Python's allocators
    assert max(rss[2:]) - settled < 16 << 20, f"private memory grows: {[r >> 20 for r in rss]} MiB"
