"""A dataset whose every record carries its global index: int8 frames whose first 4 bytes hold it
(uint32 LE), and gzip float32 labels equal to it; ``ids_of`` reads the order a loader delivered."""

from __future__ import annotations

import gzip
import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import stoker
from stoker.cli.sample import expected_label

R = 4  # frames of R x R x 1 int8: 16 bytes, the first 4 hold the global record index


def write_dataset(directory: Path, counts: Sequence[int], *, r: int = R) -> stoker.Dataset:
    """Group g: ``img_g.bin`` (int8 frames, bytes 0..3 = uint32 LE global index), ``out_g.bin.gz`` (float32 index)."""
    directory.mkdir(parents=True, exist_ok=True)
    base = 0
    for g, n in enumerate(counts):
        idx = np.arange(base, base + n, dtype="<u4")
        img = np.empty((n, r * r), dtype=np.uint8)
        img[:, 4:] = (idx[:, None] * 7 + np.arange(r * r - 4)) % 251
        img[:, :4] = idx.view(np.uint8).reshape(n, 4)
        (directory / f"img_{g:04d}.bin").write_bytes(img.tobytes())
        with gzip.open(directory / f"out_{g:04d}.bin.gz", "wb", compresslevel=1) as f:
            f.write(idx.astype("<f4").tobytes())
        base += n
    return open_dataset(directory, r=r)


def open_dataset(directory: Path, *, r: int = R) -> stoker.Dataset:
    return stoker.Dataset(
        image=stoker.Field(str(directory / "img_*.bin"), "int8", (r, r, 1)),
        label=stoker.Field(str(directory / "out_*.bin.gz"), "float32"),
    )


def collect(loader: stoker.Loader, limit: int | None = None) -> list[dict[str, np.ndarray]]:
    with loader:
        return [dict(b) for b in itertools.islice(loader, limit)]


def ids_of(batches: Sequence[dict[str, np.ndarray]]) -> np.ndarray:
    """Global record indices, in delivery order, after checking every image met its own label."""
    out = []
    for b in batches:
        want = expected_label(b["image"])
        np.testing.assert_array_equal(b["label"], want)
        out.append(want.astype(np.int64))
    return np.concatenate(out) if out else np.zeros(0, np.int64)
