"""workers="process": same batches as threads, errors from user code, nothing left behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.engine.workers import WorkerError
from stoker.testing import assert_same_batches
from stoker.transforms import Normalize, RandomCrop, RandomFlip
from tests.helpers.data import LAB_GZ, FieldPlan, build
from tests.helpers.resources import consume

FRAME = FieldPlan("img", "int8", (6, 5, 2))
COUNTS = [13, 0, 7, 21, 3]


def gil_bound(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per-record Python: a checksum of each frame, plus a draw."""
    sums = np.array([sum(int(v) for v in rec.ravel()[:8]) for rec in batch["image"]], np.float64)
    return {**batch, "sum": sums, "draw": rng.random(len(sums))}


def fail_at_group_3(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    if 3 in batch["__group__"]:
        raise ValueError("bad record in group 3")
    return batch


class Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("no pickling")


def raise_unpicklable(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    raise Unpicklable("cannot travel")


def exit_at_group_3(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    if 3 in batch["__group__"]:
        os._exit(3)
    return batch


def keep_label(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return batch


def augment() -> list[Any]:
    return [
        Normalize(mean=-0.5, std=127.5, fields="image"),
        RandomFlip(fields="image", axis=1),
        RandomCrop((4, 3), fields="image"),
        gil_bound,
    ]


@pytest.fixture
def frames(tmp_path: Path) -> stoker.Dataset:
    return build(tmp_path, COUNTS, {"image": FRAME, "label": LAB_GZ})


def memfds() -> int:
    """Shared batch regions this process holds open (descriptors, and mappings via /proc/self/maps)."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:stoker-batch")
        except OSError:
            continue
    with open("/proc/self/maps") as f:
        maps = sum("/memfd:stoker-batch" in line for line in f)
    return fds + maps


def shm_mapped() -> list[str]:
    """POSIX shared memory segments (``/dev/shm``) this process maps: process workers add none
    (multiprocessing's own heap, which other code in the process may have used, maps some there)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "/dev/shm/" in line]


@pytest.mark.parametrize("shuffle", [False, "global"])
def test_process_workers_deliver_the_same_batches_as_threads(frames: stoker.Dataset, shuffle: Any) -> None:
    kw = {"epochs": 2, "shuffle": shuffle, "seed": 5, "with_index": True, "transform": augment()}
    with frames.loader(6, threads=3, **kw) as loader:
        threads = [dict(b) for b in loader]
    with frames.loader(6, threads=2, workers="process", **kw) as loader:
        processes = [dict(b) for b in loader]
    assert_same_batches(threads, processes)
    for b in processes:
        for arr in b.values():
            assert type(arr) is np.ndarray and arr.flags.writeable


def test_process_workers_resume_exactly(frames: stoker.Dataset) -> None:
    kw = {"epochs": 2, "shuffle": "global", "seed": 2, "transform": augment(), "workers": "process", "threads": 2}
    with frames.loader(5, **kw) as loader:
        whole = [dict(b) for b in loader]
    with frames.loader(5, **kw) as loader:
        it = iter(loader)
        before = [dict(next(it)) for _ in range(7)]
        state = loader.state_dict()
    with frames.loader(5, state=state, **kw) as loader:
        after = [dict(b) for b in loader]
    assert_same_batches(whole, before + after)


def test_an_input_returned_unchanged_is_not_copied_back(frames: stoker.Dataset) -> None:
    with frames.loader(8, transform=[keep_label], workers="process", threads=1) as loader:
        b = next(iter(loader))
        with open("/proc/self/maps") as f:
            assert sum("/memfd:stoker-batch" in line for line in f) >= 2  # the batch lives in shared memory
    assert b["image"].shape == (8, 6, 5, 2)


def test_user_error_in_a_process_reaches_the_consumer_with_its_traceback(frames: stoker.Dataset) -> None:
    loader = frames.loader(8, transform=[Normalize(mean=0, std=1, fields="image"), fail_at_group_3],
                           workers="process", threads=2, with_index=True)  # fmt: skip
    got, err = consume(loader, timeout=60)
    assert len(got) == 2
    assert isinstance(err, ValueError) and "bad record in group 3" in str(err)
    notes = "\n".join(err.__notes__)
    assert "transform 1 (fail_at_group_3) on batch 2 of epoch 0" in notes
    assert "raised in transform worker process" in notes
    assert f"group 3 ({frames.files[3]['image'].path}) records 0..3" in notes
    assert 'in fail_at_group_3\n    raise ValueError("bad record in group 3")' in str(err.__cause__)
    loader.close()


def test_an_exception_that_cannot_be_pickled_comes_back_as_worker_error(frames: stoker.Dataset) -> None:
    loader = frames.loader(8, transform=[raise_unpicklable], workers="process", threads=1)
    with loader, pytest.raises(WorkerError, match="Unpicklable: cannot travel") as e:
        next(iter(loader))
    assert "raise_unpicklable" in str(e.value.__cause__)
    assert frames.files[0]["image"].path in "\n".join(e.value.__notes__)


def test_a_worker_that_dies_is_an_error_naming_its_exit_code_and_batch(frames: stoker.Dataset) -> None:
    loader = frames.loader(8, transform=[exit_at_group_3], workers="process", threads=1, with_index=True)
    got, err = consume(loader, timeout=60)
    assert len(got) == 2
    assert isinstance(err, WorkerError)
    assert "exited with code 3 while transforming batch 2 of epoch 0" in str(err)
    assert frames.files[3]["image"].path in "\n".join(err.__notes__)
    loader.close()
    assert not multiprocessing.active_children()


def test_transforms_that_cannot_be_pickled_are_refused_up_front(frames: stoker.Dataset) -> None:
    with pytest.raises(stoker.SpecError, match="cannot be pickled.*module level"):
        frames.loader(8, transform=[lambda b, rng: b], workers="process")


@pytest.mark.parametrize("ending", ["close", "break", "gc", "error", "exhaust"])
def test_processes_and_shared_memory_are_released_however_the_pass_ends(frames: stoker.Dataset, ending: str) -> None:
    gc.collect()
    before_fds, before_shm = memfds(), set(shm_mapped())
    fns = [*augment(), fail_at_group_3] if ending == "error" else augment()
    loader = frames.loader(4, transform=fns, workers="process", threads=2, with_index=True, epochs=None)
    it = iter(loader)
    batches = [next(it) for _ in range(2)]
    assert len(multiprocessing.active_children()) == 2
    assert memfds() > before_fds and set(shm_mapped()) <= before_shm  # batches travel in memfd regions
    if ending == "close":
        loader.close()
    elif ending == "break":
        for b in it:
            del b
            break
        it.close()
    elif ending == "gc":
        del it, loader
    elif ending == "error":
        with pytest.raises(ValueError, match="group 3"):
            while True:
                next(it)
    elif ending == "exhaust":
        loader.close()
        with frames.loader(4, transform=augment(), workers="process", threads=2) as finite:
            assert len(list(finite)) == 11
    del batches
    gc.collect()
    assert not multiprocessing.active_children()
    assert memfds() <= before_fds  # (an earlier test's batch may be collected meanwhile)
    assert set(shm_mapped()) <= before_shm


def test_workers_hold_no_dataset_file_only_shared_batches(frames: stoker.Dataset, tmp_path: Path) -> None:
    with frames.loader(8, transform=augment(), workers="process", threads=2, shuffle="global", seed=1) as loader:
        it = iter(loader)
        next(it)
        next(it)
        assert len(multiprocessing.active_children()) == 2
        for child in multiprocessing.active_children():
            links = []
            for fd in os.listdir(f"/proc/{child.pid}/fd"):
                try:
                    links.append(os.readlink(f"/proc/{child.pid}/fd/{fd}"))
                except OSError:
                    continue
            with open(f"/proc/{child.pid}/maps") as f:
                maps = f.read()
            assert not [p for p in links if p.startswith(str(tmp_path))]
            assert str(tmp_path) not in maps  # no dataset file mapped: nothing to duplicate per worker
