"""The open passes of every to_tf dataset: what both bridges pull batches from and close.

Each pass of a loader that TensorFlow iterates is registered under a key, which the graph
carries: the op (`_tfbridge.c`, through `native_next`) or `tf.numpy_function` (`py_next`)
calls with the key for the next batch and with `-key` to close the pass when TensorFlow
drops its iterator.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from .op import drain
from .spec import checked

if TYPE_CHECKING:
    from ..loader import Loader

__all__ = ["native_next", "next_values", "open_pass", "py_next"]


# Open passes of every to_tf dataset: under key, the pass's next batch (None at its end); under
# -key, its close (an empty list). Keys start at 1, so no key is its own negative.
_PASSES: dict[int, Callable[[], list[np.ndarray] | None]] = {}
_KEYS = itertools.count(1)
# Per open pass with any: the positions of its values in a dtype numpy exports no buffer for
# (ml_dtypes' bfloat16, kind "V"); the op gets their bits as an integer view of the same
# memory, and its Tout type (tf.bfloat16) says what they are. tf.numpy_function takes them as
# they are.
_CARRIED: dict[int, list[int]] = {}


def open_pass(
    loader: Loader,
    names: list[str],
    dtypes: list[np.dtype],
    shapes: list[tf.TensorShape],
    seen: list[tuple[int, ...] | None],
) -> int:
    """Start a pass of `loader`; its batches are pulled under the key returned, its close under -key.

    The pass's end closes the loader's pass at once (threads and files); its entries stay until
    the close call, so a late call finds its key (a pull gets the end again, a close nothing).
    """
    key = next(_KEYS)
    it = iter(loader)
    count = itertools.count()

    def end() -> None:
        close = getattr(it, "close", None)
        if close is not None:
            close()
        drain()

    def pull() -> list[np.ndarray] | None:
        try:
            batch = next(it)
        except StopIteration:
            end()
            return None
        return checked(batch, next(count), names, dtypes, shapes, seen)

    def close() -> list[np.ndarray]:
        _PASSES.pop(key, None)
        _PASSES.pop(-key, None)
        _CARRIED.pop(key, None)
        end()
        return []

    _PASSES[key] = pull
    _PASSES[-key] = close
    carried = [i for i, dtype in enumerate(dtypes) if dtype.kind == "V"]
    if carried:
        _CARRIED[key] = carried
    return key


def py_next(key: np.ndarray) -> list[np.ndarray]:
    """The tf.numpy_function bridge (StopIteration is tf.errors.OutOfRangeError)."""
    values = next_values(int(key))
    if values is None:
        raise StopIteration
    return values


def next_values(key: int) -> list[np.ndarray] | None:
    """The next batch's arrays of pass `key` (None at its end), or a pass's close under -key."""
    fn = _PASSES.get(key)
    if fn is None:
        if key < 0:  # closed already
            return []
        raise KeyError(f"to_tf: no open pass {key}")
    return fn()


def native_next(key: int) -> list[np.ndarray] | None:
    """Called by the StokerNextBatch op (`_tfbridge.c`) with the GIL held."""
    values = next_values(key)
    carried = _CARRIED.get(key)
    if carried and values:
        for i in carried:
            values[i] = values[i].view(f"i{values[i].dtype.itemsize}")
    return values
