"""The TensorSpec of to_tf's elements: inferred from a loader, and every batch checked against it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from ..errors import SpecError
from ..transforms import batch_rng

if TYPE_CHECKING:
    from ..engine.fusion import Stage
    from ..loader import Loader

__all__ = ["checked", "element_spec"]


def element_spec(loader: Loader) -> dict[str, tf.TensorSpec]:
    """The `element_spec` of `to_tf(loader)`: static batch dimension with drop_remainder.

    Built-in transforms (`stoker.transforms`) declare what they make of each field; a
    user function in `transform=` is run once on a batch of zeros of the shapes and
    dtypes it receives, and the spec is read off its output. A leading dimension equal to
    the batch size is the batch dimension (static with drop_remainder, else None).
    """
    batch = loader.batch_size if loader.drop_remainder else None
    stage = loader.stage
    if stage is None or stage.exact:
        return {
            name: tf.TensorSpec((batch, *loader.shapes[name]), tf.as_dtype(dtype))
            for name, dtype in loader.dtypes.items()
        }
    return _traced_spec(stage, loader.batch_size, batch)


def _traced_spec(stage: Stage, rows: int, batch: int | None) -> dict[str, tf.TensorSpec]:
    """Run the user functions after the built-in head on zeros; the spec of what comes out."""
    out: Mapping[str, np.ndarray] = {n: np.zeros((rows, *s), d) for n, (s, d) in stage.records.items()}
    for k in range(stage.head, len(stage.transforms)):
        fn = stage.transforms[k]
        try:
            out = fn(dict(out), batch_rng(stage.seed, 0, 0, k))
        except Exception as e:
            raise SpecError(
                f"to_tf runs transform {k} ({getattr(fn, '__name__', repr(fn))}) once on a batch of zeros to learn "
                f"the element_spec, and it raised {type(e).__name__}: {e}; pass to_tf(element_spec=...) instead"
            ) from e
        if not isinstance(out, Mapping) or not all(isinstance(v, np.ndarray) for v in out.values()):
            raise SpecError(f"transform {k} returned {type(out).__name__}, expected a dict of numpy arrays")
    spec = {}
    for name, array in out.items():
        if array.ndim and array.shape[0] == rows:
            shape: tuple[int | None, ...] = (batch, *array.shape[1:])
        elif array.ndim:  # not one row per record: its length may differ from batch to batch
            shape = (None, *array.shape[1:])
        else:
            shape = ()
        spec[name] = tf.TensorSpec(shape, tf.as_dtype(array.dtype.newbyteorder("=")))
    return spec


def checked(
    batch: Mapping[str, np.ndarray],
    index: int,
    names: list[str],
    dtypes: list[np.dtype],
    shapes: list[tf.TensorShape],
    seen: list[tuple[int, ...] | None] | None = None,
) -> list[np.ndarray]:
    """The batch's arrays in spec order, native byte order and C-contiguous; a SpecError if one does not fit.

    `seen`: per field, the last array shape found compatible with the spec; an array of that
    very shape skips `TensorShape.is_compatible_with` (Python that builds a TensorShape from
    the array's shape), which would otherwise dominate the check.
    """
    out: list[np.ndarray] = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        array = batch.get(name)
        if array is not None and array.dtype != dtype and not array.dtype.isnative:  # a transform's big-endian output
            array = array.astype(array.dtype.newbyteorder("="))
        if (
            array is None
            or array.dtype != dtype
            or ((seen is None or array.shape != seen[i]) and not shape.is_compatible_with(array.shape))
        ):
            got = "no such field" if array is None else f"{array.dtype}{list(array.shape)}"
            raise SpecError(
                f"to_tf: batch {index} field {name!r} is {got}, the element_spec says "
                f"{dtype}{shape.as_list() if shape.rank is not None else '[...]'}; pass to_tf(element_spec=...) "
                "matching what transform= returns",
                field=name,
            )
        if seen is not None:
            seen[i] = array.shape
        # Both bridges alias a 64-byte aligned, C-contiguous, native-order array and keep it
        # alive as long as the tensor (stoker's buffers are page aligned); they copy less
        # aligned memory (tests guard both).
        out.append(array if array.flags.c_contiguous else np.ascontiguousarray(array))
    return out
