"""Field validation and byte-count parsing."""

from __future__ import annotations

import numpy as np
import pytest

import stoker
from stoker.spec import parse_bytes


def test_field_computes_record_bytes_and_native_dtype() -> None:
    f = stoker.Field("d/img_*.bin", "int8", (128, 128, 1))
    assert f.record_bytes == 128 * 128
    assert f.shape == (128, 128, 1)
    g = stoker.Field("d/x_*.bin", "float32", byte_order="big")
    assert g.dtype == np.dtype(">f4")
    assert g.native_dtype == np.dtype("=f4")
    assert g.record_bytes == 4


def test_int_shape_means_one_dimension() -> None:
    assert stoker.Field("a", "int16", 5).shape == (5,)


def test_scalar_shape_is_empty_tuple_by_default() -> None:
    f = stoker.Field(["a.bin", "b.bin"], "uint16")
    assert f.shape == () and f.record_bytes == 2 and f.files == ("a.bin", "b.bin")


@pytest.mark.parametrize("dtype", ["notadtype", "complex64", "S4", "U2", object, "V0", "datetime64[s]"])
def test_field_rejects_bad_dtype(dtype: object) -> None:
    with pytest.raises(stoker.SpecError, match="dtype"):
        stoker.Field("a.bin", dtype)


@pytest.mark.parametrize("shape", [(0,), (-1,), (2, 0), (1.5,), (True,), "12", (None,), 0, -3])
def test_field_rejects_bad_shape(shape: object) -> None:
    with pytest.raises(stoker.SpecError, match="shape"):
        stoker.Field("a.bin", "int8", shape)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", [{"header_bytes": -1}, {"footer_bytes": -2}, {"header_bytes": 1.0},
                                {"footer_bytes": True}])  # fmt: skip
def test_field_rejects_bad_header_and_footer(kw: dict) -> None:
    with pytest.raises(stoker.SpecError, match=next(iter(kw))):
        stoker.Field("a.bin", "int8", **kw)


@pytest.mark.parametrize("compression", ["bz2", "GZIP", "raw", 1, "none"])
def test_field_rejects_unknown_compression(compression: object) -> None:
    with pytest.raises(stoker.SpecError, match="compression"):
        stoker.Field("a.bin", "int8", compression=compression)  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ["native", "LITTLE", "<", ""])
def test_field_rejects_bad_byte_order(order: object) -> None:
    with pytest.raises(stoker.SpecError, match="byte_order"):
        stoker.Field("a.bin", "int8", byte_order=order)  # type: ignore[arg-type]


@pytest.mark.parametrize("files", [[], None, 3, [1, 2], ["a", None]])
def test_field_rejects_bad_files(files: object) -> None:
    with pytest.raises(stoker.SpecError, match="files"):
        stoker.Field(files, "int8")  # type: ignore[arg-type]


def test_spec_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        stoker.Field("a.bin", "nope")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4KiB", 4096), ("10", 10), (7, 7), ("2 kb", 2000),
     ("1TiB", 1 << 40), ("3B", 3)],
)  # fmt: skip
def test_parse_bytes_understands_units(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "abc", "12XB", "5i", "-1", "0", 0, -5, True, 1.5, "MiB"])
def test_parse_bytes_rejects_bad_values_naming_the_argument(text: object) -> None:
    with pytest.raises(stoker.SpecError, match="memory_budget"):
        parse_bytes(text)  # type: ignore[arg-type]
