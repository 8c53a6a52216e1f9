"""fork() under a running pass: the child is told to make its own loader, the parent's pass goes on."""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from tests.helpers.indexed import collect, ids_of, write_dataset

COUNTS = [37, 0, 50, 13, 63]
TOTAL = sum(COUNTS)
CHILD_SECONDS = 120  # a child that neither answers nor exits by then is killed and the test fails


def unchanged(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return batch  # a transform for worker processes to run (module level: they unpickle it)


def in_forked_child(fn: Callable[[], Any]) -> Any:
    """`fn()` run in a fork()ed child: what it returned, or "TypeName: message" of what it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe and leaves without cleanup
        try:
            try:
                out: Any = fn()
            except BaseException as e:
                out = f"{type(e).__name__}: {e}"
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + CHILD_SECONDS
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([r], [], [], left)[0]:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the forked child answered nothing in {CHILD_SECONDS}s: it hung")
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    return write_dataset(tmp_path_factory.mktemp("fork"), COUNTS)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_next_in_a_forked_child_raises_naming_what_to_do_and_the_parents_pass_goes_on(
    ds: stoker.Dataset, workers: str
) -> None:
    process = {"workers": "process", "transform": [unchanged]} if workers == "process" else {}
    loader = ds.loader(5, shuffle="global", seed=7, threads=2, **process)  # type: ignore[arg-type]
    with loader:
        it = iter(loader)
        first = [dict(next(it)) for _ in range(3)]

        def child() -> list[Any]:
            try:
                n = sum(1 for _ in it)  # batches the parent's threads had ready before the fork are its own too
            except stoker.ForkedPassError as e:
                said = str(e)
            else:
                return [f"{n} batches, then the end"]
            fresh = ids_of(collect(ds.loader(5, shuffle="global", seed=7, threads=2)))
            return [said, sorted(fresh.tolist()) == list(range(TOTAL))]

        said, fresh_ok = in_forked_child(child)
        assert f"started in process {os.getpid()}" in said and "make a new loader with dataset.loader(...)" in said
        assert fresh_ok  # a loader made in the child reads every record
        rest = [dict(b) for b in it]
    ids = ids_of(first + rest)
    np.testing.assert_array_equal(np.sort(ids), np.arange(TOTAL))  # the parent's pass: every record once


def test_a_forked_pass_is_a_stoker_error_and_a_runtime_error() -> None:
    assert issubclass(stoker.ForkedPassError, stoker.StokerError)
    assert issubclass(stoker.ForkedPassError, RuntimeError)


def test_random_access_in_a_forked_child_reads_the_records(tmp_path: Path) -> None:
    ds = write_dataset(tmp_path, COUNTS)
    picks = np.arange(0, TOTAL, 3)
    want = ds.read(picks)["label"]  # the parent's reader and its open files exist before the fork
    got = in_forked_child(lambda: ds.read(picks)["label"].tolist())
    np.testing.assert_array_equal(np.asarray(got, dtype=np.float32), want)
    np.testing.assert_array_equal(ds.read(picks)["label"], want)  # and the parent's still works
