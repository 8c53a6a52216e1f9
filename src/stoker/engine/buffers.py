"""Byte views of batch arrays to read into, and each worker thread's reused staging buffer."""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["Staging", "bytes_of"]


def bytes_of(dst: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as bytes, to read into; also for dtypes numpy exports no
    buffer for (ml_dtypes' bfloat16). Never a copy: a strided array is refused, as
    `memoryview(dst).cast("B")` refused it."""
    if not dst.flags.c_contiguous:
        raise TypeError("a read goes straight into a C-contiguous array, never into a copy")
    return memoryview(dst.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class Staging:
    """One buffer per worker thread, grown as needed, for records read before they are cast."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, nbytes: int) -> memoryview:
        """`nbytes` of this thread's buffer (valid until its next call on this thread)."""
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = bytearray(max(nbytes, 1 << 16))
            self._local.buf = buf
        return memoryview(buf)[:nbytes]
