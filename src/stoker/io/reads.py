"""Records of a compressed file read from the seek point before them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..spec import Field
from .faults import short_stream
from .files import FileInfo
from .inflate import Inflater
from .seekpoints import SeekPoint

__all__ = ["seek_read"]


def seek_read(
    name: str, spec: Field, info: FileInfo, points: Sequence[SeekPoint], local: np.ndarray, count: int
) -> np.ndarray:
    """Records `local` (any order) of a compressed file, each run decoded from the seek point before it.

    `points`: the file's seek points sorted by decompressed offset; `count`: its records (for errors).
    """
    assert info.compression is not None
    rb = spec.record_bytes
    wanted, inverse = np.unique(local, return_inverse=True)
    got = np.empty((len(wanted), *spec.shape), spec.dtype)
    view = memoryview(got.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    starts = np.array([p[1] for p in points], dtype=np.int64)
    breaks = np.flatnonzero(np.diff(wanted) != 1) + 1
    inf: Inflater | None = None
    try:
        done = 0
        for run in np.split(wanted, breaks):
            target = spec.header_bytes + int(run[0]) * rb
            k = int(np.searchsorted(starts, target, side="right")) - 1
            if inf is None or inf.produced > target or int(starts[k]) > inf.produced:
                if inf is not None:
                    inf.close()
                inf = Inflater(
                    info.path, info.compression, field=name, start=points[k], storage_options=spec.storage_options,
                    version=info.version,
                    seen=info.seen,
                )  # fmt: skip
            want = target - inf.produced
            if inf.skip(want) != want:
                raise short_stream(name, spec, info, count, inf.produced)
            nbytes = len(run) * rb
            if inf.readinto(view[done : done + nbytes]) != nbytes:
                raise short_stream(name, spec, info, count, inf.produced)
            done += nbytes
    finally:
        if inf is not None:
            inf.close()
    return got[inverse]
