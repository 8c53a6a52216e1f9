"""stoker.kernels.cast_into (the compiled copy that fills batches) against np.copyto, bit for bit.

Outputs of at least STREAM_MIN_BYTES are written with streaming stores; both sides of that
threshold, unaligned outputs and odd lengths (the vector loop's head and tail) are covered.
"""

from __future__ import annotations

import errno
import os
import platform
import sys
from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker import kernels
from tests.helpers.data import LAB_GZ, FieldPlan, build, check_batches

SOURCES = ["int8", "uint8", "int16", "uint16", "float32", "float64"]
OUTPUTS = ["int8", "uint8", "int16", "uint16", "float16", "float32", "float64"]
STREAMED = kernels.STREAM_MIN_BYTES // 4 + 37  # float32 values: just over the threshold
X86 = platform.machine().lower() in ("x86_64", "amd64")  # where the float16 loops are (F16C)

# Every test here runs with each set of hand-written loops (conftest's `isa`).
pytestmark = pytest.mark.usefixtures("isa")


def f16c() -> bool:
    """Whether integers (and computed float32) go to float16 by the F16C loop now."""
    return X86 and kernels.isa() != "none"


def test_the_compiled_kernels_are_built() -> None:
    """`make test` builds them; losing the build would silently halve W1's float32 records/s."""
    assert kernels.compiled(), "stoker._kernels was not built: run `pip install -e .`"


def _values(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return (rng.normal(size=n) * 1e3).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=n, endpoint=True).astype(dt)


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("out", OUTPUTS)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, STREAMED, kernels.STREAM_MIN_BYTES + 37])
@pytest.mark.parametrize("misalign", [0, 1, 3])
def test_cast_into_equals_copyto(src: str, out: str, n: int, misalign: int) -> None:
    rng = np.random.default_rng(n + misalign)
    x = _values(src, n, rng)
    # The output starts `misalign` elements into its buffer: not 16- or 32-byte aligned.
    got = np.full(n + misalign + 5, 7, out)[misalign : misalign + n]
    want = np.empty(n, out)
    with np.errstate(invalid="ignore", over="ignore"):
        np.copyto(want, x, casting="unsafe")
        kernels.cast_into(got, x)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert np.all(got.base[:misalign] == 7) and np.all(got.base[misalign + n :] == 7)  # nothing written outside


@pytest.mark.parametrize("apart", [0, 16, 100, 2048, 4096 - 16])
@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_streamed_copies_at_every_page_offset_between_source_and_output(apart: int, dtype: str) -> None:
    """Streamed copies are exact whatever the source's page offset is against the output's."""
    n = kernels.STREAM_MIN_BYTES + 4099
    page = np.empty(n + 8192, np.uint8)
    start = -page.ctypes.data % 4096
    x = page[start : start + n]
    x[:] = np.random.default_rng(apart).integers(0, 256, n, dtype=np.uint8)
    out = np.empty(n + 8192, np.uint8)
    at = (-out.ctypes.data % 4096) + apart
    got = out[at : at + n].view(dtype) if dtype == "int8" else out[at : at + n // 4 * 4].view(dtype)
    src = x.view(dtype) if dtype == "int8" else x[: n // 4 * 4].view(dtype)
    kernels.cast_into(got, src)
    assert np.array_equal(got.view(np.uint8), src.view(np.uint8))


@pytest.mark.parametrize("shape", [(3, 5), (64, 128, 129)])
def test_cast_into_takes_records_of_any_shape(shape: tuple[int, ...]) -> None:
    x = _values("int8", int(np.prod(shape)), np.random.default_rng(1)).reshape(shape)
    got = np.empty(shape, np.float32)
    kernels.cast_into(got, x)
    assert np.array_equal(got, x.astype(np.float32))


@pytest.mark.parametrize(
    ("dtype", "out"),
    [
        ("int16", "int16"),
        ("int16", "float32"),
        ("uint16", "float32"),
        ("float32", "float32"),
        ("float64", "float64"),
        ("int16", "float16"),
        ("uint16", "float16"),
    ],
)
def test_a_byte_order_stated_as_the_machines_own_takes_the_kernel(dtype: str, out: str) -> None:
    """Every Field's dtype states its byte order ('<i2' for byte_order="little"), and numpy
    exports such an array's buffer as "<h", not "h": the kernel must still take it (it fell
    back to numpy's copy for every multi-byte field: int16 batches at 0.78x the records/s)."""
    field = stoker.Field("unused_*.bin", dtype=dtype, shape=(64, 64))
    native = "<" if sys.byteorder == "little" else ">"
    assert field.dtype.byteorder in (native, "=") and memoryview(np.empty(1, field.dtype)).format[0] == native
    x = _values(dtype, 256 * 64 * 64, np.random.default_rng(5)).astype(field.dtype).reshape(256, 64, 64)
    got = np.empty(x.shape, out)
    if out != "float16" or f16c():
        assert kernels._kernels.cast_into(got, x, kernels.STREAM_MIN_BYTES), "went to numpy"
    with np.errstate(over="ignore"):  # uint16 past 65519 is inf in float16
        kernels.cast_into(got, x)
        assert np.array_equal(got, x.astype(got.dtype))
    wrong = x.astype(x.dtype.newbyteorder("S"))  # the other order: numpy swaps it, not the kernel
    assert not kernels._kernels.cast_into(got, wrong, kernels.STREAM_MIN_BYTES)


@pytest.mark.parametrize("src", ["int8", "uint8", "int16", "uint16"])
@pytest.mark.parametrize("stream", [True, False])
def test_integers_to_float16_round_as_numpy_does_for_every_value(src: str, stream: bool) -> None:
    """Every value of the source dtype, at three output alignments, streamed and not: the
    kernel's float16 (F16C, nearest with ties to even) equals numpy's bit for bit, uint16 past
    65519 included (inf). The loop is x86's (F16C, on every x86-64 CPU since 2013); elsewhere
    the copy is numpy's, checked the same way."""
    took = kernels._kernels.cast_into(np.empty(1, np.float16), np.zeros(1, src), 0)
    assert took == f16c(), "the kernel does not cast to float16 here (no F16C?): numpy's copy is ~16x slower"
    info = np.iinfo(src)
    x = np.arange(info.min, info.max + 1).astype(src)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    for misalign in (0, 1, 3):
        buf = np.full(len(x) + 8, 7, np.float16)
        got = buf[misalign : misalign + len(x)]
        if f16c():
            assert kernels._kernels.cast_into(got, x, 0 if stream else 1 << 40)
        else:
            with np.errstate(over="ignore"):
                kernels.cast_into(got, x)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
        assert np.all(buf[:misalign] == 7) and np.all(buf[misalign + len(x) :] == 7)


@pytest.mark.parametrize("src", ["int8", "uint8", "int16", "uint16"])
def test_integers_to_bfloat16_round_as_ml_dtypes_does_for_every_value(src: str) -> None:
    """ml_dtypes' bfloat16 (a dtype numpy exports no buffer for): every value of the source
    dtype, at three output alignments, bit for bit ml_dtypes' cast (int16 past 256 rounds)."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    info = np.iinfo(src)
    x = np.arange(info.min, info.max + 1).astype(src)
    want = x.astype(bf16)
    for misalign in (0, 1, 3):
        buf = np.full(len(x) + 8, 7, np.uint16)
        got = buf[misalign : misalign + len(x)].view(bf16)
        assert kernels._bfloat16_into(got, x), "went to numpy"
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
        assert np.all(buf[:misalign] == 7) and np.all(buf[misalign + len(x) :] == 7)
    # What it does not take goes to numpy (ml_dtypes' casts), same values.
    for dst, s in [
        (np.empty(len(x) // 2, bf16), x[::2]),  # strided source
        (np.empty(len(x), np.float32).view(bf16)[::2], x),  # strided output
        (np.empty(8, bf16), np.arange(8, dtype=np.float64)),  # a float64 source
    ]:
        assert not kernels._bfloat16_into(dst, s)
        kernels.cast_into(dst, s)
        assert np.array_equal(dst.view(np.uint16), s.astype(bf16).view(np.uint16))


def test_computed_float32_narrows_to_float16_as_numpy_rounds() -> None:
    """The transforms' one-pass kernel narrows its float32 scratch with F16C: bit for bit numpy's
    cast for every value arithmetic can give (ties, float16's subnormals and overflow, infinities,
    signed zeros, quiet NaNs with payloads); a signalling NaN, which arithmetic never gives,
    is the one difference (F16C quiets it)."""
    rng = np.random.default_rng(9)
    bits = np.concatenate(
        [
            rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),  # any bit pattern
            np.arange(0x33000000, 0x33000000 + 2**16, dtype=np.uint32),  # float16 subnormal range
            (np.arange(2**16, dtype=np.uint32) << 13) | 0x1000,  # exact ties at every float16 step
            np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x477FF000, 0x477FEFFF, 0x7FC00001], np.uint32),
        ]
    )
    x = bits.view(np.float32)
    quiet = ~np.isnan(x) | ((bits & 0x00400000) != 0)  # drop the signalling NaNs
    x = np.ascontiguousarray(x[quiet])
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    got = np.full(len(x), 7, np.float16)
    took = kernels._kernels.computed_to_float16(x.ctypes.data, len(x), got.ctypes.data, False)
    assert took == f16c()
    if took:
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_float32_narrows_to_bfloat16_as_ml_dtypes_rounds() -> None:
    """Every kind of float32 (any bit pattern, exact ties, NaNs of both signs and any payload,
    infinities, the largest finite values) into bfloat16, bit for bit ml_dtypes' cast."""
    import ml_dtypes

    rng = np.random.default_rng(10)
    bits = np.concatenate(
        [
            rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
            (np.arange(2**16, dtype=np.uint32) << 16) | 0x8000,  # exact ties at every bfloat16 step
            np.array(
                [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800001, 0xFFC12345], np.uint32
            ),
        ]
    )
    x = bits.view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(ml_dtypes.bfloat16)
    for n in (len(x), len(x) - 3):  # a tail the 8-wide loop leaves
        got = np.full(n, 7, np.uint16)
        kernels._kernels.bfloat16("f", x.ctypes.data, n, got.ctypes.data)
        assert np.array_equal(got, want[:n].view(np.uint16))
    # cast="bfloat16" of a float32 field (its dtype says "<f4") takes the same loop.
    field = np.frombuffer(x.tobytes(), np.dtype("<f4"))
    out = np.full(len(x), 7, np.uint16).view(ml_dtypes.bfloat16)
    assert kernels._bfloat16_into(out, field), "went to numpy"
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))


def test_set_isa_returns_the_level_before_and_refuses_an_unknown_one(isa: str) -> None:
    assert kernels.isa() == isa
    assert kernels.set_isa("none") == isa and kernels.isa() == "none"
    assert kernels._codes(np.empty(3, np.float16), np.empty(3, np.int8)) is None  # no F16C loop to gather with
    with pytest.raises(ValueError, match=r"'sse2' is not one of none, avx2, all"):
        kernels.set_isa("sse2")
    assert kernels.isa() == "none"
    assert kernels.set_isa(isa) == "none" and kernels.isa() == isa
    with pytest.raises(ValueError, match="level 3 is not 0, 1 or 2"):
        kernels._kernels.set_isa(3)


def test_stoker_kernels_isa_sets_the_level_at_import() -> None:
    import subprocess

    code = "from stoker import kernels; print(kernels.isa())"
    for value, want in (("avx2", "avx2"), ("none", "none"), ("", "all")):
        env = {**os.environ, "STOKER_KERNELS_ISA": value}
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert got.stdout.strip() == want
    env = {**os.environ, "STOKER_KERNELS_ISA": "avx9"}
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "STOKER_KERNELS_ISA='avx9' is not one of none, avx2, all" in bad.stderr


@pytest.mark.parametrize("n", [2**16, 2**16 - 5, 3, 0, STREAMED])
@pytest.mark.parametrize("misalign", [0, 1, 3])
def test_bfloat16_records_widen_to_float32_as_ml_dtypes_casts_every_value(n: int, misalign: int) -> None:
    """Every bfloat16 bit pattern (NaNs with their payloads and signs, infinities, subnormals)
    into float32 by the kernel: ml_dtypes' bits, nothing written outside the output."""
    import ml_dtypes

    x = np.resize(np.arange(2**16, dtype=np.uint16), n).view(ml_dtypes.bfloat16)
    buf = np.full(n + misalign + 4, 7, np.float32)
    got = buf[misalign : misalign + n]
    assert kernels._widen_bf16(got, x), "went to numpy"
    assert np.array_equal(got.view(np.uint32), x.astype(np.float32).view(np.uint32))
    assert np.all(buf[:misalign] == 7) and np.all(buf[misalign + n :] == 7)
    assert not kernels._widen_bf16(np.empty(n, np.float64), x)  # float64: numpy's cast
    assert not kernels._widen_bf16(got, x.astype(np.float32))  # not bfloat16


def test_only_ml_dtypes_bfloat16_is_taken_for_bfloat16() -> None:
    """The casts route by stoker.spec.is_bfloat16 (not numpy's slow dtype.name): no other
    2-byte or ml_dtypes type may reach the bfloat16 loops, and the float32 labels of W1-int8
    still cast to int8 as numpy does."""
    import ml_dtypes

    from stoker.spec import is_bfloat16

    assert is_bfloat16(np.dtype(ml_dtypes.bfloat16))
    others = [np.float16, np.uint16, np.int16, "V2", ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.float32]
    assert not any(is_bfloat16(np.dtype(t)) for t in others)
    labels = np.array([0.5, -1.7, 126.9, 300.0, -300.0, np.nan], np.float32)
    got, want = np.full(6, 9, np.int8), np.empty(6, np.int8)
    with np.errstate(invalid="ignore"):
        kernels.cast_into(got, labels)
        np.copyto(want, labels, casting="unsafe")
    assert np.array_equal(got, want)


def test_what_the_kernel_cannot_do_goes_to_numpy() -> None:
    rng = np.random.default_rng(2)
    x = _values("int16", 4096, rng).reshape(64, 64)
    for src, dst in [
        (x[::2], np.empty((32, 64), np.float32)),  # strided source
        (x, np.empty((64, 128), np.float32)[:, ::2]),  # strided output
        (x.astype(">i2"), np.empty((64, 64), np.float32)),  # not native byte order
        (x, np.empty((64, 64), np.complex64)),  # a dtype the kernel does not write
        (x.astype(np.float64), np.empty((64, 64), np.float32)),  # a cast it does not do
        (x[0], np.empty((64, 64), np.float32)),  # a shape that broadcasts
        (x, np.empty((64, 64), ">f4")),  # an output not in native byte order
        (x.astype(np.uint32), np.empty((64, 64), np.float32)),  # a source dtype it does not read
    ]:
        kernels.cast_into(dst, src)
        assert np.array_equal(dst, np.broadcast_to(src, dst.shape).astype(dst.dtype))
    read_only = np.zeros((64, 64), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernels.cast_into(read_only, x)


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("out", ["int8", "float16", "float32", "float64"])
@pytest.mark.parametrize("record", [(3,), (64, 64, 17)])
def test_gather_into_equals_fancy_indexing(src: str, out: str, record: tuple[int, ...]) -> None:
    """dst[rows] = src[index]: rows a permutation's prefix, records in any order and repeated."""
    rng = np.random.default_rng(len(src) + len(out))
    x = _values(src, 40 * int(np.prod(record)), rng).reshape(40, *record)
    rows = rng.permutation(30)[:25]
    index = rng.integers(0, 40, size=25)
    got, want = np.full((30, *record), 9, out), np.full((30, *record), 9, out)
    with np.errstate(invalid="ignore", over="ignore"):
        kernels.gather_into(got, rows, x, index)
        want[rows] = x[index]
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_gather_into_refuses_rows_or_records_out_of_range() -> None:
    x = np.zeros((4, 8), np.int8)
    dst = np.zeros((3, 8), np.float32)
    with pytest.raises(IndexError, match="out of range"):
        kernels.gather_into(dst, np.array([0, 3]), x, np.array([0, 1]))
    with pytest.raises(IndexError, match="out of range"):
        kernels.gather_into(dst, np.array([0, 1]), x, np.array([0, 4]))


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("out", ["int8", "float16", "float32", "float64"])
@pytest.mark.parametrize("record", [(3,), (1,), (64, 64, 17)])
def test_gather_records_from_several_arrays_equals_fancy_indexing(src: str, out: str, record: tuple[int, ...]) -> None:
    """Records of three arrays (a batch's files) by address into rows in any order: the output
    of the largest records is over STREAM_MIN_BYTES (streamed; 8/16-bit integers into float32 by
    the direct loop), and records of (3,) or (1,) values start rows off every alignment."""
    rng = np.random.default_rng(len(src) * 7 + len(out) + len(record))
    arrays = [_values(src, k * int(np.prod(record)), rng).reshape(k, *record) for k in (11, 1, 23)]
    which = rng.integers(0, 3, size=28)
    index = np.array([rng.integers(0, len(arrays[w])) for w in which])
    rows = rng.permutation(30)[:28]
    starts = [kernels.address(a) for a in arrays]
    addresses = np.array([starts[w] + i * arrays[w][0].nbytes for w, i in zip(which, index, strict=True)])
    got, want = np.full((30, *record), 9, out), np.full((30, *record), 9, out)
    copies = kernels.gathers(got, np.dtype(src))
    if out == src or (out in ("float32", "float64") and src != "float64"):
        assert copies  # the copies and casts the kernel has (the rest fall back to numpy)
    with np.errstate(invalid="ignore", over="ignore"):
        assert kernels.gather_records(got, rows, addresses, np.dtype(src)) == copies
        if copies:
            for r, w, i in zip(rows, which, index, strict=True):
                want[r] = arrays[w][i]
    if record == (64, 64, 17) and out != "int8":
        assert got.nbytes >= kernels.STREAM_MIN_BYTES
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("src", ["int8", "uint8", "int16", "float32", "bfloat16"])
def test_gather_records_into_and_from_bfloat16_takes_the_array_itself(src: str) -> None:
    """bfloat16 rows (a dtype numpy describes no buffer format for) are handed to the kernel
    as the array itself: values as ml_dtypes casts them, bfloat16 records widened into float32."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(5)
    records = (rng.standard_normal((9, 5)) * 100).astype(bf16 if src == "bfloat16" else src)
    out = np.float32 if src == "bfloat16" else bf16
    rows, index = np.array([3, 0, 5, 1]), np.array([8, 2, 2, 0])
    got = np.zeros((6, 5), out)
    assert kernels.gather_records(got, rows, kernels.address(records) + index * records[0].nbytes, records.dtype)
    want = np.zeros((6, 5), out)
    want[rows] = records[index].astype(out)
    assert np.array_equal(got.astype(np.float32), want.astype(np.float32))  # exact: no NaNs here


# (array, first record, count, step, first row)
STRIDED_RUNS = [(0, 2, 4, 2, 7), (1, 0, 1, 1, 0), (2, 5, 6, 1, 1), (0, 9, 0, 1, 11), (2, 0, 8, 3, 11)]
BACK_TO_BACK_RUNS = [(0, 2, 4, 1, 7), (1, 0, 1, 1, 0), (2, 5, 6, 1, 1), (0, 9, 0, 1, 11), (2, 10, 8, 1, 11)]


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("out", ["int8", "float16", "float32", "bfloat16"])
@pytest.mark.parametrize("record", [(3,), (64, 64, 17)])
@pytest.mark.parametrize("runs", [STRIDED_RUNS, BACK_TO_BACK_RUNS], ids=["strided", "back_to_back"])
def test_gather_runs_equals_the_runs_copied_one_by_one(
    src: str, out: str, record: tuple[int, ...], runs: list[tuple[int, int, int, int, int]]
) -> None:
    """Runs of three arrays (a batch's files) into rows in any order, one run empty: the same as
    copying each run's records by numpy. Where every run's records lie back to back the kernel
    takes each run whole; where one steps over records (a shard's), record by record."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if out == "bfloat16" else np.dtype(out)
    rng = np.random.default_rng(len(src) * 5 + len(out) + len(record))
    arrays = [_values(src, k * int(np.prod(record)), rng).reshape(k, *record) for k in (11, 1, 23)]
    flat: list[int] = []
    want = np.full((20, *record), 9, dt)
    for a, first, count, step, row in runs:
        rec = arrays[a][0].nbytes
        flat += (row, kernels.address(arrays[a]) + first * rec, count, step * rec)
        with np.errstate(invalid="ignore", over="ignore"):
            want[row : row + count] = arrays[a][first : first + count * step : step].astype(dt)
    got = np.full((20, *record), 9, dt)
    copies = kernels.gathers(got, np.dtype(src))
    with np.errstate(invalid="ignore", over="ignore"):
        assert kernels.gather_runs(got, flat, np.dtype(src)) == copies
    if copies:
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    else:  # nothing done: the callers fall back to numpy
        assert np.array_equal(got.view(np.uint8), np.full((20, *record), 9, dt).view(np.uint8))


def test_gather_runs_checks_rows_and_declines_what_it_cannot_copy() -> None:
    x = np.arange(16, dtype=np.int8).reshape(2, 8)
    dst = np.zeros((3, 8), np.float32)
    at = kernels.address(x)
    with pytest.raises(IndexError, match=r"rows 2\.\.3 outside the 3 rows"):
        kernels.gather_runs(dst, [0, at, 1, 8, 2, at, 2, 8], x.dtype)
    with pytest.raises(IndexError, match=r"rows -1\.\.0 outside the 3 rows"):
        kernels.gather_runs(dst, [-1, at, 2, 8], x.dtype)
    with pytest.raises(ValueError, match="not .row, address, count, stride. runs"):
        kernels.gather_runs(dst, [0, at, 1], x.dtype)
    assert not dst.any()  # nothing copied before a run was found out of range
    assert kernels.gather_runs(dst, [], x.dtype) and not dst.any()
    read_only = np.zeros((3, 8), np.float32)
    read_only.flags.writeable = False
    for target, dtype in [(dst, np.dtype(">i2")), (dst[:, ::2], x.dtype), (read_only, x.dtype)]:
        assert not kernels.gather_runs(target, [0, at, 1, 8], dtype)
    assert not dst.any()


@pytest.mark.parametrize("files", [3, 40])  # 40: past the length that gives the GIL up
def test_file_sizes_are_each_descriptors_size_now(tmp_path: Path, files: int) -> None:
    assert kernels.file_sizes([]) == []
    fds = []
    try:
        for k in range(files):
            (tmp_path / f"f{k}").write_bytes(b"x" * (k * 7))
            fds.append(os.open(tmp_path / f"f{k}", os.O_RDONLY))
        assert kernels.file_sizes(fds) == [k * 7 for k in range(files)] == [kernels.file_size(fd) for fd in fds]
        os.truncate(tmp_path / "f2", 3)
        assert kernels.file_sizes(fds)[2] == 3
        with pytest.raises(OSError):  # a descriptor past any limit
            kernels.file_sizes([*fds, 1 << 30])
    finally:
        for fd in fds:
            os.close(fd)


def test_gather_records_checks_rows_and_declines_what_it_cannot_copy() -> None:
    x = np.arange(16, dtype=np.int8).reshape(2, 8)
    dst = np.zeros((3, 8), np.float32)
    addresses = np.array([kernels.address(x), kernels.address(x) + 8])
    with pytest.raises(IndexError, match="row 3 outside the 3 rows"):
        kernels.gather_records(dst, np.array([0, 3]), addresses, x.dtype)
    with pytest.raises(IndexError, match="row -1 outside the 3 rows"):
        kernels.gather_records(dst, np.array([-1, 0]), addresses, x.dtype)
    with pytest.raises(IndexError, match="2 rows for 1 records"):
        kernels.gather_records(dst, np.array([0, 1]), addresses[:1], x.dtype)
    assert not dst.any()
    read_only = np.zeros((3, 8), np.float32)
    read_only.flags.writeable = False
    for target, dtype in [(dst, np.dtype(">i2")), (dst[:, ::2], x.dtype), (read_only, x.dtype)]:
        assert not kernels.gathers(target, dtype)
        assert not kernels.gather_records(target, np.array([0]), addresses[:1], dtype)
    assert not dst.any()


def test_batches_large_enough_to_stream_equal_the_files(tmp_path: Path) -> None:
    """A 64 x 64 x 64 int8 record cast to float32 is 1 MiB: every run of a batch is streamed."""
    img = FieldPlan("img", "int8", (64, 64, 64))
    ds = build(tmp_path, [5, 3, 4], {"image": img, "label": LAB_GZ})
    assert kernels.STREAM_MIN_BYTES <= 64 * 64 * 64 * 4
    with ds.loader(4, cast={"image": "float32"}, with_index=True, threads=2) as loader:
        check_batches(ds, list(loader), cast={"image": "float32"})
    with ds.loader(4, cast="float64", with_index=True, shuffle="global", seed=3) as loader:
        check_batches(ds, list(loader), cast={"image": "float64", "label": "float64"})
    with ds.loader(3, cast={"image": "float16"}, with_index=True) as loader:  # the float16 loop
        check_batches(ds, list(loader), cast={"image": "float16"})
    with ds.loader(3, cast={"image": "float16"}, with_index=True, shuffle="global", seed=5) as loader:  # its gather
        check_batches(ds, list(loader), cast={"image": "float16"})


def test_global_shuffle_gathers_integers_into_float16_with_the_kernel() -> None:
    """Integer records gather into float16 by the kernel, not numpy's gather then cast, which
    is far slower (benchmarks/results/w1_history.md)."""
    for src, code in (("int8", "b"), ("uint8", "B"), ("int16", "h"), ("uint16", "H")):
        want = (code, "e") if f16c() else None
        assert kernels._codes(np.empty((2, 3), np.float16), np.empty((4, 3), src)) == want


@pytest.mark.parametrize("src", ["int8", "uint8", "int16", "uint16", "float32"])
def test_global_shuffle_gathers_into_bfloat16_with_the_kernel_bit_for_bit(src: str) -> None:
    """ml_dtypes' bfloat16 rows gathered by the kernel's bfloat16 loops (in place of numpy's
    fancy index and ml_dtypes' one-value-at-a-time cast), equal to that numpy path bit for bit;
    rows not gathered stay as they were."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(len(src))
    x = _values(src, 40 * 3 * 37, rng).reshape(40, 3, 37)
    assert kernels._codes(np.empty((2, 3, 37), bf16), x) == (np.dtype(src).char, "E")
    rows, index = rng.permutation(30)[:25], rng.integers(0, 40, size=25)
    got = np.full((30, 3, 37), 7, np.uint16).view(bf16)
    want = got.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        kernels.gather_into(got, rows, x, index)
        want[rows] = x[index].astype(bf16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert kernels._codes(np.empty((2, 3), bf16), np.empty((4, 3), np.float64)) is None  # to numpy


def test_bfloat16_records_gathered_into_bfloat16_keep_every_bit() -> None:
    """Stored bfloat16 gathered as it is (the kernel copies its 16-bit patterns, NaN payloads too)."""
    import ml_dtypes

    rng = np.random.default_rng(12)
    x = rng.integers(0, 2**16, size=(40, 3, 5), dtype=np.uint16).view(ml_dtypes.bfloat16)
    rows, index = rng.permutation(30)[:25], rng.integers(0, 40, size=25)
    got = np.full((30, 3, 5), 7, np.uint16).view(ml_dtypes.bfloat16)
    want = got.view(np.uint16).copy()
    kernels.gather_into(got, rows, x, index)
    want[rows] = x.view(np.uint16)[index]
    assert got.dtype.name == "bfloat16" and np.array_equal(got.view(np.uint16), want)


@pytest.mark.parametrize("out_rows", [2000, kernels.STREAM_MIN_BYTES // (37 * 4) + 1])  # plain, streamed
def test_bfloat16_records_gathered_into_float32_widen_every_bit_pattern(out_rows: int) -> None:
    """Stored bfloat16 cast to float32 under a global shuffle: the kernel's gather widens each
    record (odd lengths: the vector loop's unaligned head and tail) as ml_dtypes casts, NaN
    payloads and signs included; rows not gathered stay as they were."""
    import ml_dtypes

    x = np.resize(np.arange(2**16, dtype=np.uint16), 1772 * 37).reshape(1772, 37).view(ml_dtypes.bfloat16)
    assert kernels._codes(np.empty((2, 37), np.float32), x) == ("E", "f")
    assert kernels._codes(np.empty((2, 37), np.float64), x) is None  # numpy's cast
    rng = np.random.default_rng(out_rows)
    rows = rng.permutation(out_rows)[: out_rows - 3]
    index = np.resize(rng.permutation(1772), len(rows))  # every record, some twice
    got = np.full((out_rows, 37), 7, np.float32)
    want = got.copy()
    kernels.gather_into(got, rows, x, index)
    want[rows] = x[index].astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_file_size_is_the_size_of_the_open_file_now(tmp_path: Path) -> None:
    path = tmp_path / "img_0000.bin"
    path.write_bytes(bytes(1000))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert kernels.file_size(fd) == 1000
        os.truncate(path, 123)  # what the size check before a copy from a map must see
        assert kernels.file_size(fd) == 123 == os.fstat(fd).st_size
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        kernels.file_size(fd)  # closed
    assert err.value.errno == errno.EBADF


def test_a_signal_holds_one_wake_up_and_post_later_sends_it_when_a_kernel_gives_the_gil_up() -> None:
    from stoker import _kernels  # type: ignore[attr-defined]

    s = _kernels.Signal()
    assert s.wait(0.01) is False  # nothing posted: times out
    s.post()
    s.post()
    assert s.wait(0) is True and s.wait(0) is False  # a wake-up, not a count
    small_src, small_dst = np.ones(1000, np.int8), np.empty(1000, np.float32)
    big_src, big_dst = np.ones(1 << 17, np.int8), np.empty(1 << 17, np.float32)
    s.post_later()
    assert s.wait(0) is False
    kernels.cast_into(small_dst, small_src)  # under 64 KiB: keeps the GIL, sends nothing
    assert s.wait(0) is False
    kernels.cast_into(big_dst, big_src)  # gives the GIL up: sends it
    assert s.wait(0) is True and np.array_equal(big_dst, big_src)
    s.post_later()
    _kernels.flush()
    assert s.wait(0) is True
    other = _kernels.Signal()
    s.post_later()
    other.post_later()  # one deferred wake-up per thread: the earlier one leaves now
    assert s.wait(0) is True and other.wait(0) is False
    _kernels.flush()
    assert other.wait(0) is True
    with pytest.raises(TypeError):
        _kernels.Signal(1)


def test_a_thread_waiting_on_a_signal_wakes_from_another_thread() -> None:
    import threading

    from stoker import _kernels  # type: ignore[attr-defined]

    s = _kernels.Signal()
    woke = []
    t = threading.Thread(target=lambda: woke.append(s.wait(5)))
    t.start()
    s.post()
    t.join(5)
    assert woke == [True]


def test_file_map_is_a_read_only_map_that_holds_no_descriptor(tmp_path: Path) -> None:
    import mmap

    from stoker.kernels import map_file, maps_hold_descriptors

    path = tmp_path / "f.bin"
    data = np.arange(3 * mmap.PAGESIZE, dtype=np.uint8) * 7
    path.write_bytes(data.tobytes())
    before = len(os.listdir("/proc/self/fd"))
    fd = os.open(path, os.O_RDONLY)
    m = map_file(fd, path.stat().st_size)
    os.close(fd)
    assert not maps_hold_descriptors() and len(os.listdir("/proc/self/fd")) == before  # the map holds none
    assert len(m) == data.nbytes and not m.closed
    view = np.frombuffer(m, np.uint8)
    np.testing.assert_array_equal(view, data)
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 1
    m.madvise(mmap.MADV_WILLNEED, mmap.PAGESIZE, mmap.PAGESIZE)
    m.madvise(mmap.MADV_DONTNEED)  # the whole map
    with pytest.raises(ValueError, match="start=-1 is outside the map"):
        m.madvise(mmap.MADV_WILLNEED, -1)
    with pytest.raises(OSError):
        m.madvise(mmap.MADV_WILLNEED, 1)  # not page aligned: the kernel refuses
    with pytest.raises(BufferError, match="exported"):
        m.close()  # view still reads from it
    del view
    m.close()
    m.close()  # idempotent
    assert m.closed
    with pytest.raises(ValueError, match="closed"):
        np.frombuffer(m, np.uint8)
    with pytest.raises(ValueError, match="closed"):
        m.madvise(mmap.MADV_WILLNEED)
    with pytest.raises(OSError):
        map_file(-1, 10)
    with pytest.raises(ValueError, match="size=0 must be positive"):
        map_file(0, 0)
