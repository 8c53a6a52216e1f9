"""A cast field read from a cold disk: a run whose pages are out of the page cache is read by
preadv and cast from a staging buffer (stoker.engine.rawreads), not faulted in through the
file's map a read-around window at a time; a cached run keeps the cast from the map."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import stoker
import stoker.engine.rawreads
from stoker.io.readahead import Readahead

GROUPS, RECORDS, SIDE = 3, 600, 32  # 600 frames of 1 KiB a file: several runs each
CAST = {"image": "float32", "label": "float64"}  # both cast: every data read is a cast run


def write(directory: Path) -> tuple[stoker.Dataset, np.ndarray]:
    """Int8 frames whose every byte is a function of (group, record), with float32 labels = the global index."""
    directory.mkdir()
    frames = np.empty((GROUPS, RECORDS, SIDE * SIDE), np.int8)
    for g in range(GROUPS):
        base = (np.arange(RECORDS)[:, None] * 13 + np.arange(SIDE * SIDE)[None, :] * 7 + g * 101) % 255 - 127
        frames[g] = base.astype(np.int8)
        (directory / f"img_{g}.bin").write_bytes(frames[g].tobytes())
        labels = np.arange(g * RECORDS, (g + 1) * RECORDS, dtype="<f4")
        (directory / f"lab_{g}.bin").write_bytes(labels.tobytes())
    ds = stoker.Dataset(
        image=stoker.Field(str(directory / "img_*.bin"), "int8", (SIDE, SIDE, 1)),
        label=stoker.Field(str(directory / "lab_*.bin"), "float32"),
    )
    return ds, frames


def evict(directory: Path) -> None:
    """Drop every file's pages from the page cache (clean pages after an fsync). Not probed here:
    a probe that misses starts the kernel's readahead, caching what it asked about."""
    for p in directory.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.fixture
def preads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Sizes of the preadv calls the engine makes for data (the cache probe binds its own)."""
    sizes: list[int] = []
    real = os.preadv

    def counted(fd: int, buffers: list, offset: int, *flags: int) -> int:
        sizes.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(stoker.engine.rawreads.os, "preadv", counted)
    yield sizes


def check(batches: list[dict[str, np.ndarray]], frames: np.ndarray) -> None:
    """Every record once, each cast image equal to its stored frame, beside its own label."""
    seen = []
    for b in batches:
        g, r = b["__group__"], b["__index__"]
        assert b["image"].dtype == np.float32
        want = frames[g, r].astype(np.float32).reshape(len(r), SIDE, SIDE, 1)
        np.testing.assert_array_equal(b["image"], want)
        np.testing.assert_array_equal(b["label"], (g * RECORDS + r).astype(np.float64))
        seen.append(g * RECORDS + r)
    assert sorted(np.concatenate(seen).tolist()) == list(range(GROUPS * RECORDS))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_cold_cast_field_is_read_by_preadv_and_cast_whole(tmp_path: Path, preads: list[int], threads: int) -> None:
    ds, frames = write(tmp_path / "data")
    evict(tmp_path / "data")
    with ds.loader(64, cast=CAST, with_index=True, threads=threads, block_length=128) as loader:
        batches = [dict(b) for b in loader]
    check(batches, frames)
    # A file's first run is cold; the readahead it starts may have cached the rest by its next run.
    image_runs = [n for n in preads if n >= 64 * SIDE * SIDE]
    assert len(image_runs) >= GROUPS, f"cold image runs were faulted in through their maps: preadv calls {preads}"


def test_a_cached_cast_field_keeps_the_cast_from_the_map(tmp_path: Path, preads: list[int]) -> None:
    ds, frames = write(tmp_path / "data")
    for p in (tmp_path / "data").iterdir():  # every page in the cache
        p.read_bytes()
    with ds.loader(64, cast=CAST, with_index=True, block_length=128) as loader:
        batches = [dict(b) for b in loader]
    check(batches, frames)
    assert preads == [], f"cached cast runs were read by preadv: {len(preads)} calls"


def test_a_file_cut_while_its_cold_run_is_read_is_a_corrupt_data_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds, frames = write(tmp_path / "data")
    evict(tmp_path / "data")
    victim = str(tmp_path / "data" / "img_1.bin")
    real = Readahead.missing

    def cut_after_probe(self: Readahead, fd: int, offset: int) -> bool:
        cold = real(self, fd, offset)
        if cold and os.readlink(f"/proc/self/fd/{fd}") == victim:
            os.truncate(victim, 5 * SIDE * SIDE + 17)  # inside record 5
        return cold

    monkeypatch.setattr(Readahead, "missing", cut_after_probe)
    delivered: list[dict[str, np.ndarray]] = []
    loader = ds.loader(64, cast=CAST, with_index=True, threads=1, block_length=128)
    with pytest.raises(stoker.CorruptDataError) as caught, loader:
        for b in loader:
            delivered.append(dict(b))
    assert caught.value.path == victim and "img_1.bin" in str(caught.value)
    for b in delivered:  # nothing wrong before the error
        g, r = b["__group__"], b["__index__"]
        np.testing.assert_array_equal(b["image"], frames[g, r].astype(np.float32).reshape(len(r), SIDE, SIDE, 1))
        assert not (g == 1).any(), "a record of the cut file was delivered"
