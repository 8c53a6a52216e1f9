"""Batch transforms: user functions and built-in vectorized ones, run by the loader's workers.

`ds.loader(..., transform=fn)` (or a list, applied in order) calls
`fn(batch, rng) -> batch` on every batch, on the worker that assembled it, in parallel
with reading; batches are still delivered in plan order. `rng` is a fresh
`np.random.Generator` seeded from `(seed, epoch, first, k)` (`batch_rng`): the loader's
seed (0 when `seed=None`), the epoch, the position of the batch's first record in the
epoch's global sequence (the number `state_dict` counts in) and `k`, the transform's place
in the list. So augmentation does not depend on thread count or worker kind, differs
between shards and batches, and a resumed run draws exactly what an uninterrupted one would.

Built-in transforms (`Normalize`, `Cast`, `RandomFlip`, `RandomCrop`) are plain
callables with the same signature. Those at the head of the list are fused into batch
assembly by the engine (`stoker.engine.fusion`), each record read once where the compiled
kernel takes the chain; every way gives the result of calling the transforms one after the
other on the unfused batch, bit for bit.

Example (int8 frames to float32 in [-1, 1], flipped left-right half the time):
    >>> from stoker.transforms import Normalize, RandomFlip
    >>> loader = ds.loader(256, seed=7, transform=[
    ...     Normalize(mean=-0.5, std=127.5, fields="image"),  # -128 -> -1.0, 127 -> 1.0
    ...     RandomFlip(fields="image", axis=1),  # axis of the record (H, W, C): W
    ... ])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import SpecError
from .kernels import cast_into
from .spec import resolve_dtype

__all__ = [
    "DEFAULT_SEED",
    "Cast",
    "Normalize",
    "RandomCrop",
    "RandomFlip",
    "Transform",
    "batch_rng",
    "resolve_dtype",
]

Batch = dict[str, np.ndarray]

# The transforms' seed when the loader has none (shuffle=False, seed=None): augmentation
# is then the same on every run, never seeded from the clock. Pass seed= to vary it.
DEFAULT_SEED = 0


def batch_rng(seed: int, epoch: int, first: int, k: int) -> np.random.Generator:
    """The generator transform `k` gets for the batch whose first record is at `first`."""
    return np.random.default_rng([seed, epoch, first, k])


def _fields(value: str | Sequence[str]) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise SpecError(f"fields={value!r} must name one field or a non-empty list of fields")
    return names


class Transform:
    """Base of the built-in transforms: per-batch random draws, then bulk work per field.

    `draw` picks the batch's random parameters once (shared by every field the transform
    touches, so an image and its mask get the same flip); `apply` does the work on rows
    `rows` of one field, writing into `out` when given. Calling the transform does both
    on a whole batch, exactly as the fused path does chunk by chunk.
    """

    fields: tuple[str, ...]

    def draw(self, rng: np.random.Generator, n: int, record_shape: tuple[int, ...]) -> Any:
        return None

    def record(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
        """The record shape and dtype this transform makes of `name`'s (`SpecError` if it cannot)."""
        return shape, dtype

    def apply(self, x: np.ndarray, params: Any, rows: slice, out: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, batch: Mapping[str, np.ndarray], rng: np.random.Generator) -> Batch:
        missing = [n for n in self.fields if n not in batch]
        if missing:
            raise SpecError(f"{self!r} names field(s) {missing} not in the batch (keys {list(batch)})")
        first = batch[self.fields[0]]
        params = self.draw(rng, len(first), first.shape[1:])
        out = dict(batch)
        for name in self.fields:
            x = batch[name]
            out[name] = self.apply(x, params, slice(0, len(x)), None)
        return out


class Normalize(Transform):
    """`x * scale + offset`, or `(x - mean) / std`, computed and delivered in `dtype`.

    `mean` and `std` (or `scale` and `offset`) may be per channel: arrays that
    broadcast against the record's trailing axes. Each form is computed as written (two
    ufunc passes over a cache-sized chunk), so `mean=-0.5, std=127.5` maps int8 -128 and
    127 to exactly -1.0 and 1.0, where `scale=1/127.5` rounds 127 to 1.0000001.

    Example: int8 frames to float32 in [-1, 1]:
        >>> Normalize(mean=-0.5, std=127.5, fields="image")
        Normalize(mean=[-0.5], std=[127.5], fields=['image'])
    """

    def __init__(
        self,
        scale: Any = None,
        offset: Any = None,
        *,
        mean: Any = None,
        std: Any = None,
        fields: str | Sequence[str],
        dtype: Any = "float32",
    ) -> None:
        self.fields = _fields(fields)
        self.dtype = resolve_dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise SpecError(f"Normalize dtype={dtype!r} must be float32 or float64; add Cast(...) for 16-bit floats")
        self.divide = mean is not None or std is not None
        if self.divide and (scale is not None or offset is not None):
            raise SpecError("Normalize takes scale/offset or mean/std, not both")
        if self.divide:
            std_ = np.asarray(1.0 if std is None else std, np.float64)
            if np.any(std_ == 0) or not np.all(np.isfinite(std_)):
                raise SpecError(f"Normalize std={std!r} must be finite and non-zero")
            first, second = (0.0 if mean is None else mean), std_.tolist()
        else:
            first, second = (1.0 if scale is None else scale), (0.0 if offset is None else offset)
        self.first = np.asarray(first, np.float64).astype(self.dtype)
        self.second = np.asarray(second, np.float64).astype(self.dtype)

    def record(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
        try:
            wide = np.broadcast_shapes(shape, self.first.shape, self.second.shape)
        except ValueError as e:
            raise SpecError(
                f"Normalize on field {name!r}: parameters of shape {self.first.shape}/{self.second.shape} do not "
                f"broadcast against its records of shape {shape}",
                field=name,
            ) from e
        if wide != shape:
            raise SpecError(f"Normalize on field {name!r}: parameters would widen records of shape {shape}", field=name)
        return shape, self.dtype

    def apply(self, x: np.ndarray, params: Any, rows: slice, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            out = np.empty(x.shape, self.dtype)
        # measured: a casting copy then in-place ops on the cache-hot result beats ufuncs that
        # cast their input on the fly (numpy buffers it); the numbers are the same either way.
        dst = out if out.dtype == self.dtype else np.empty(x.shape, self.dtype)
        np.copyto(dst, x, casting="unsafe")
        self.inplace(dst)
        if dst is not out:
            np.copyto(out, dst, casting="unsafe")
        return out

    def inplace(self, x: np.ndarray) -> None:
        """Normalize `x` (of `dtype`) where it lies."""
        if self.divide:
            np.subtract(x, self.first, out=x)
            np.divide(x, self.second, out=x)
        else:
            np.multiply(x, self.first, out=x)
            np.add(x, self.second, out=x)

    def constant_along(self, axes: Sequence[int], ndim: int) -> bool:
        """Whether the parameters are the same at every position along record `axes`."""
        for p in (self.first, self.second):
            for a in axes:
                i = a - (ndim - p.ndim)
                if i >= 0 and p.shape[i] != 1:
                    return False
        return True

    def __repr__(self) -> str:
        a, b = ("mean", "std") if self.divide else ("scale", "offset")
        first, second = np.ravel(self.first).tolist(), np.ravel(self.second).tolist()
        return f"Normalize({a}={first}, {b}={second}, fields={list(self.fields)})"


class Cast(Transform):
    """Convert fields to `dtype` (`"float16"`, `"bfloat16"`, any numpy dtype)."""

    def __init__(self, dtype: Any, *, fields: str | Sequence[str]) -> None:
        self.fields = _fields(fields)
        self.dtype = resolve_dtype(dtype)

    def record(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
        return shape, self.dtype

    def apply(self, x: np.ndarray, params: Any, rows: slice, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            out = np.empty(x.shape, self.dtype)
        cast_into(out, x)  # the compiled cast where it applies (numpy converts float16 one value at a time)
        return out

    def __repr__(self) -> str:
        return f"Cast({self.dtype.name!r}, fields={list(self.fields)})"


def _same_runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """Maximal runs `(start, stop, value)` of equal values in a boolean vector."""
    if not len(mask):
        return []
    cuts = np.flatnonzero(mask[1:] != mask[:-1]) + 1
    starts = [0, *cuts.tolist()]
    stops = [*cuts.tolist(), len(mask)]
    return [(a, b, bool(mask[a])) for a, b in zip(starts, stops, strict=True)]


class RandomFlip(Transform):
    """Reverse each record along `axis` (of the record, e.g. 1 = W of (H, W, C)) with probability `p`."""

    def __init__(self, *, fields: str | Sequence[str], axis: int = 1, p: float = 0.5) -> None:
        self.fields = _fields(fields)
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
            raise SpecError(f"RandomFlip axis={axis!r} must be a non-negative axis of the record")
        if not 0.0 <= p <= 1.0:
            raise SpecError(f"RandomFlip p={p!r} must be within [0, 1]")
        self.axis = axis
        self.p = float(p)
        self.reverse = (slice(None),) * (axis + 1) + (slice(None, None, -1),)  # of rows of records

    def record(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
        if self.axis >= len(shape):
            raise SpecError(f"RandomFlip axis={self.axis} on field {name!r}: records have shape {shape}", field=name)
        return shape, dtype

    def draw(self, rng: np.random.Generator, n: int, record_shape: tuple[int, ...]) -> np.ndarray:
        return rng.random(n) < self.p

    def apply(self, x: np.ndarray, params: Any, rows: slice, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            out = np.empty(x.shape, x.dtype)
        for a, b, flip in _same_runs(params[rows]):
            src = x[a:b]
            np.copyto(out[a:b], src[self.reverse] if flip else src, casting="unsafe")
        return out

    def __repr__(self) -> str:
        return f"RandomFlip(fields={list(self.fields)}, axis={self.axis}, p={self.p})"


class RandomCrop(Transform):
    """A window of `size` at a random place of each record, along `axes` (default the first ones)."""

    def __init__(
        self, size: int | Sequence[int], *, fields: str | Sequence[str], axes: Sequence[int] | None = None
    ) -> None:
        self.fields = _fields(fields)
        self.size = (int(size),) if isinstance(size, int | np.integer) else tuple(int(s) for s in size)
        if not self.size or min(self.size) < 1:
            raise SpecError(f"RandomCrop size={size!r} must be positive")
        self.axes = tuple(range(len(self.size))) if axes is None else tuple(int(a) for a in axes)
        if len(self.axes) != len(self.size) or len(set(self.axes)) != len(self.axes) or min(self.axes) < 0:
            raise SpecError(f"RandomCrop axes={axes!r} must be distinct record axes, one per size {self.size}")

    def record(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[tuple[int, ...], np.dtype]:
        if max(self.axes) >= len(shape) or any(shape[a] < s for a, s in zip(self.axes, self.size, strict=True)):
            raise SpecError(
                f"RandomCrop size={self.size} on axes {self.axes} do not fit field {name!r}: records {shape}",
                field=name,
            )
        out = list(shape)
        for a, s in zip(self.axes, self.size, strict=True):
            out[a] = s
        return tuple(out), dtype

    def draw(self, rng: np.random.Generator, n: int, record_shape: tuple[int, ...]) -> np.ndarray:
        highs = [record_shape[a] - s + 1 for a, s in zip(self.axes, self.size, strict=True)]
        return np.stack([rng.integers(0, h, size=n) for h in highs], axis=1) if n else np.empty((0, len(highs)), int)

    def window(self, offsets: Sequence[int], ndim: int, *, batch: bool = False) -> tuple[slice, ...]:
        """Slices of a record (of `ndim` axes; of rows of records when `batch`) for one draw."""
        window = [slice(None)] * (ndim + batch)
        for a, s, o in zip(self.axes, self.size, offsets, strict=True):
            window[a + batch] = slice(int(o), int(o) + s)
        return tuple(window)

    def apply(self, x: np.ndarray, params: Any, rows: slice, out: np.ndarray | None) -> np.ndarray:
        shape, _ = self.record("?", x.shape[1:], x.dtype)
        if out is None:
            out = np.empty((len(x), *shape), x.dtype)
        for j, offsets in enumerate(params[rows].tolist()):
            np.copyto(out[j], x[j][self.window(offsets, x.ndim - 1)], casting="unsafe")
        return out

    def __repr__(self) -> str:
        return f"RandomCrop({self.size}, fields={list(self.fields)}, axes={self.axes})"
