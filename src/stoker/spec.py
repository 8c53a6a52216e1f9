"""What the data is: one Field per kind of record, validated on construction."""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any, Literal

import numpy as np

from .errors import SpecError

__all__ = [
    "Compression", "Field", "is_float", "parse_bytes", "positive", "resolve_cast", "resolve_dtype", "shape_hint",
]  # fmt: skip

Compression = Literal["auto", "gzip", "zlib"] | None
_COMPRESSIONS = ("auto", "gzip", "zlib", None)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip


def positive(name: str, value: object, *, allow_none: bool = True) -> int | None:
    """`value` as an int if it is a positive integer (not a bool), None where None is allowed;
    else a SpecError naming the argument `name`: the one check of every count a user passes."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise SpecError(f"{name}={value!r} must be a positive integer" + (" or None" if allow_none else ""))
    return int(value)


def parse_bytes(value: int | str, *, name: str = "memory_budget") -> int:
    """Parse `512MiB`, `1.5GB` or a plain integer into a positive byte count."""
    if isinstance(value, bool):
        raise SpecError(f"{name}={value!r} must be a byte count like 512MiB or an integer")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        unit = (m.group(2) or "").lower()
        if unit not in _UNITS:
            raise SpecError(f"{name}={value!r}: unknown unit {m.group(2)!r} (use KiB, MiB, GiB, ...)")
        nbytes = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise SpecError(f"{name}={value!r} must be a byte count like 512MiB or an integer")
    if nbytes <= 0:
        raise SpecError(f"{name}={value!r} must be positive")
    return nbytes


def resolve_dtype(value: Any) -> np.dtype:
    """A numpy dtype from `value`; `"bfloat16"` through ml_dtypes (installed with TF and JAX)."""
    if isinstance(value, str) and value.lower() == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:  # pragma: no cover - ml_dtypes comes with jax and tensorflow
            raise SpecError("dtype 'bfloat16' needs the ml_dtypes package: pip install ml_dtypes") from e
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(value)
    except TypeError as e:
        raise SpecError(f"{value!r} is not a numpy dtype") from e


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether `dtype` is ml_dtypes' bfloat16 (TensorFlow's and JAX's numpy bfloat16 is that one).

    By its scalar type's name: numpy computes `dtype.name` in Python, far slower, and the
    casts ask on every batch (`stoker.kernels.cast_into`).
    """
    return dtype.type.__name__ == "bfloat16"


def is_float(dtype: np.dtype) -> bool:
    """A float dtype: numpy's own, or ml_dtypes' bfloat16 (whose numpy kind is 'V')."""
    return dtype.kind == "f" or is_bfloat16(dtype)


def _stated_order(value: object, dtype: np.dtype) -> str | None:
    """The byte order a dtype states itself ('>u2', '<f4', a non-native np.dtype), else None."""
    if dtype.itemsize == 1:
        return None  # one byte has no order
    if isinstance(value, str):
        mark = value[:1]
        if mark in ("<", ">", "="):
            return {"<": "little", ">": "big", "=": sys.byteorder}[mark]
        return None
    if isinstance(value, np.dtype) and value.byteorder in ("<", ">"):
        # numpy writes the native order as '=', so only a non-native order is visible here.
        return "little" if value.byteorder == "<" else "big"
    return None


def _as_dtype(value: object, byte_order: str | None) -> tuple[np.dtype, Literal["little", "big"]]:
    if isinstance(value, str) and value.lower() == "bfloat16":
        dtype = resolve_dtype(value)
    else:
        try:
            dtype = np.dtype(value)  # type: ignore[call-overload]
        except TypeError as e:
            raise SpecError(f"dtype={value!r} is not a numpy dtype") from e
    if is_bfloat16(dtype):  # ml_dtypes' (numpy kind "V"): its values, stored little-endian
        if byte_order == "big":
            raise SpecError(
                "dtype='bfloat16' is read little-endian only (ml_dtypes' bfloat16 has no byte-swapped form); "
                "read such a field as dtype='>u2' and view its batches' arrays as ml_dtypes.bfloat16"
            )
        return dtype, "little"
    if dtype.kind not in "biuf" or dtype.itemsize == 0:
        raise SpecError(f"dtype={value!r} must be a fixed-size bool, integer or float dtype")
    stated = _stated_order(value, dtype)
    if byte_order is not None and stated is not None and stated != byte_order:
        raise SpecError(
            f"dtype={value!r} says {stated}-endian but byte_order={byte_order!r}; give the order once "
            f"(dtype={dtype.name!r} with byte_order={byte_order!r}, or dtype={value!r} alone)"
        )
    order: Literal["little", "big"] = "big" if (byte_order or stated) == "big" else "little"
    return dtype.newbyteorder("<" if order == "little" else ">"), order


@dataclass(frozen=True, init=False)
class Field:
    """One kind of fixed-length record, stored in one file per group.

    Args:
        files: a glob pattern, a list of patterns, or a list of paths. A glob's matches are
            sorted by code point; an explicit list keeps its order. A name that is an existing
            file is that file, whatever characters it holds (see stoker.io.files.expand_files).
        dtype: the stored element type (`"int8"`, `"float32"`, ...; `"bfloat16"` is
            ml_dtypes' type, stored little-endian).
        shape: the shape of one record; `()` for a scalar per record.
        header_bytes: skipped at the start of every file (of the decompressed stream for
            compressed files), as tf.data.FixedLengthRecordDataset does.
        footer_bytes: skipped at the end of every file, likewise.
        compression: `"auto"` (by suffix and magic bytes), `None`, `"gzip"`, `"zlib"`.
        byte_order: `"little"` or `"big"`: how multi-byte elements are stored. None
            (default): the order the dtype states (`">u2"` is big-endian), else little.
            A byte_order that contradicts the dtype's stated order is a SpecError.
        storage_options: keyword arguments for the fsspec filesystem of URL files
            (`s3://...`; e.g. `{"endpoint_url": ..., "anon": True}`); see stoker.io.remote.

    Example:
        >>> Field("data/img_*.bin", "int8", (128, 128, 1)).record_bytes
        16384
    """

    files: str | Sequence[str]
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    header_bytes: int = 0
    footer_bytes: int = 0
    compression: Compression = "auto"
    byte_order: Literal["little", "big"] = "little"
    # A dict is unhashable, so it takes part in == but not in hash(); not in repr (may hold keys).
    storage_options: Mapping[str, Any] = _field(default_factory=dict, hash=False, repr=False)

    def __init__(
        self,
        files: str | Sequence[str],
        dtype: object,
        shape: Sequence[int] | int = (),
        *,
        header_bytes: int = 0,
        footer_bytes: int = 0,
        compression: Compression = "auto",
        byte_order: Literal["little", "big"] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(files, str):
            patterns: str | tuple[str, ...] = files
        elif isinstance(files, Sequence) and files and all(isinstance(f, str) for f in files):
            patterns = tuple(files)
        else:
            raise SpecError(f"files={files!r} must be a glob pattern or a non-empty list of paths")
        if byte_order not in ("little", "big", None):
            raise SpecError(f"byte_order={byte_order!r} must be 'little', 'big' or None (the dtype's own order)")
        given: object = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
        if not isinstance(given, Sequence) or isinstance(given, str):
            raise SpecError(f"shape={shape!r} must be a tuple of positive integers")
        try:
            dims = tuple(int(d) for d in given)
        except (TypeError, ValueError) as e:
            raise SpecError(f"shape={shape!r} must be a tuple of positive integers") from e
        if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in given) or dims != tuple(given):
            raise SpecError(f"shape={shape!r} must be a tuple of positive integers")
        for name, value in (("header_bytes", header_bytes), ("footer_bytes", footer_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{name}={value!r} must be a non-negative integer")
        if compression not in _COMPRESSIONS:
            raise SpecError(f"compression={compression!r} must be one of 'auto', None, 'gzip', 'zlib'")
        if storage_options is not None and (
            not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options)
        ):
            raise SpecError(f"storage_options={storage_options!r} must be a mapping of str -> value")
        stored, order = _as_dtype(dtype, byte_order)
        object.__setattr__(self, "files", patterns)
        object.__setattr__(self, "dtype", stored)
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "header_bytes", header_bytes)
        object.__setattr__(self, "footer_bytes", footer_bytes)
        object.__setattr__(self, "compression", compression)
        object.__setattr__(self, "byte_order", order)
        object.__setattr__(self, "storage_options", dict(storage_options or {}))

    @functools.cached_property
    def record_bytes(self) -> int:
        """Bytes of one record: itemsize * prod(shape) (computed once: read on every run of every batch)."""
        return self.dtype.itemsize * math.prod(self.shape)

    @property
    def native_dtype(self) -> np.dtype:
        """The dtype batches hold when no cast is asked for: stored type, native byte order."""
        return self.dtype.newbyteorder("=")


def shape_hint(fields: Mapping[str, Field], counts: Mapping[str, int | None]) -> str:
    """Where one field's record count is a whole multiple of another's, the shapes that would make
    them agree (a `(64, 64, 1)` field over 128x128 frames counts 4x its partner's records);
    "" where no count is a multiple of another."""
    known = {n: c for n, c in counts.items() if c}
    if len(known) < 2:
        return ""
    fewest = min(known.values())
    hints = []
    for name, count in known.items():
        ratio, rest = divmod(count, fewest)
        if rest or ratio < 2:
            continue
        partner = next(n for n, c in known.items() if c == fewest)
        f = fields[name]
        larger = _scaled(f.shape, ratio)
        hint = (
            f"field {name!r} counts {ratio}x the records of field {partner!r}: if its records are {ratio}x larger, "
            f"shape={larger} ({f.record_bytes * ratio} bytes a record) fits"
        )
        smaller = _scaled_down(fields[partner].shape, ratio)
        if smaller is not None:
            hint += f", or shape={smaller} for field {partner!r} if its records are {ratio}x smaller"
        hints.append(hint)
    return "; ".join(hints)


def _scaled(shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """`shape` holding `k` times the values: both leading sides scaled where `k` is a square
    (frames), else the first."""
    if not shape:
        return (k,)
    side = math.isqrt(k)
    if len(shape) >= 2 and side * side == k:
        return (shape[0] * side, shape[1] * side, *shape[2:])
    return (shape[0] * k, *shape[1:])


def _scaled_down(shape: tuple[int, ...], k: int) -> tuple[int, ...] | None:
    """`shape` holding `k` times fewer values, as `_scaled` would undo; None where none does."""
    side = math.isqrt(k)
    if len(shape) >= 2 and side * side == k and shape[0] % side == 0 and shape[1] % side == 0:
        return (shape[0] // side, shape[1] // side, *shape[2:])
    if shape and shape[0] % k == 0:
        return (shape[0] // k, *shape[1:]) if shape[0] > k or len(shape) > 1 else ()
    return None


def resolve_cast(fields: Mapping[str, Field], cast: Any) -> dict[str, np.dtype]:
    """The dtype each field is delivered in, from `cast` (None, one dtype, or a map)."""
    out = {n: f.native_dtype for n, f in fields.items()}
    if cast is None:
        return out
    items: Sequence[tuple[str, Any]]
    if isinstance(cast, Mapping):
        unknown = [k for k in cast if k not in fields]
        if unknown:
            raise SpecError(f"cast names unknown field(s) {unknown}; fields are {list(fields)}", field=str(unknown[0]))
        items = list(cast.items())
    else:
        items = [(n, cast) for n in fields]
    for name, value in items:
        try:
            dtype = resolve_dtype(value)
        except SpecError as e:
            raise SpecError(f"cast for field {name!r}: {e}", field=name) from e
        if dtype.kind not in "biuf" and not is_float(dtype):
            raise SpecError(
                f"cast for field {name!r}: {dtype} must be a bool, integer or float dtype (or 'bfloat16')", field=name
            )
        out[name] = dtype.newbyteorder("=")
    return out
