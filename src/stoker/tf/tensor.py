"""A numpy array as an eager TensorFlow tensor, zero-copy where TensorFlow can alias it."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..engine.executor import ALIGNMENT

__all__ = ["as_tensor"]


def as_tensor(array: np.ndarray) -> tf.Tensor:
    """`array` as an eager tensor: zero-copy via DLPack when TensorFlow can alias it, else a copy.

    TensorFlow aliases DLPack memory that is 64-byte aligned and C-contiguous, and keeps
    the producer (the numpy array) alive as long as the tensor. Less aligned memory must
    not be aliased: TF 2.21 accepts it, then aborts the process in the first op that
    checks alignment (a strided slice does). Such arrays are copied into TF's own memory.
    """
    if array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0 and array.dtype.isnative:
        if array.dtype.kind == "V":  # ml_dtypes' bfloat16: DLPack has no such numpy dtype; its bits do
            bits = tf.experimental.dlpack.from_dlpack(array.view(f"i{array.dtype.itemsize}").__dlpack__())
            return tf.bitcast(bits, tf.as_dtype(array.dtype))
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(np.ascontiguousarray(array))
