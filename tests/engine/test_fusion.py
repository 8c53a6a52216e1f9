"""The one-pass fused path (compiled kernel, and numpy where it is absent) against plain numpy.

Every expected value here is written out with numpy ufuncs on the whole batch, in the order
the transforms are documented to compute, and compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import stoker
import stoker.engine.fusion as fusion
from stoker.engine.fusion import Stage
from stoker.plan.batches import BatchPlan
from stoker.testing import assert_same_batches
from stoker.transforms import Cast, Normalize, RandomCrop, RandomFlip, batch_rng
from tests.helpers.data import LAB_GZ, FieldPlan, build

SEED = 5

# Every test here runs with each set of the kernel's hand-written loops (conftest's `isa`).
pytestmark = pytest.mark.usefixtures("isa")


@pytest.fixture(params=["kernel", "numpy"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the compiled kernel (built by ``make test``) and with the numpy path."""
    if request.param == "kernel":
        assert fusion._kernels is not None, "stoker._kernels was not built: run `pip install -e .`"
    else:
        monkeypatch.setattr(fusion, "_kernels", None)
    return str(request.param)


def _values(dtype: Any, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return (rng.normal(size=shape) * 50).astype(dt)
    info = np.iinfo(dt)  # 16-bit ones kept small enough that / 0.2 stays finite in float16
    lo, hi = max(int(info.min), -9000), min(int(info.max), 9000)
    return rng.integers(lo, hi, size=shape, endpoint=True).astype(dt)


def _plain(
    x: np.ndarray, first: Any, second: Any, divide: bool, flip_axis: int | None, out: Any, first_row: int = 0
) -> np.ndarray:
    """The documented computation, op by op on the whole batch, in float32."""
    y = x.astype(np.float32)
    a, b = np.asarray(first, np.float64).astype(np.float32), np.asarray(second, np.float64).astype(np.float32)
    y = (y - a) / b if divide else y * a + b
    if flip_axis is not None:  # RandomFlip is transform 1: its draw is rng.random(n) < 0.5
        flips = batch_rng(SEED, 0, first_row, 1).random(len(x)) < 0.5
        y[flips] = np.flip(y[flips], axis=flip_axis + 1)
    return y.astype(out)


def _stage(fns: list[Any], shape: tuple[int, ...], dtype: Any) -> Stage:
    record = {"image": (shape, np.dtype(dtype))}
    return Stage(fns, seed=SEED, shard=(0, 1), records=record, stored={"image": np.dtype(dtype)})


def _run(stage: Stage, x: np.ndarray) -> np.ndarray:
    plan = BatchPlan(epoch=0, index=0, position=len(x), rows=len(x), runs=())
    return stage.run({"image": x}, plan, lambda shape, dt: np.empty(shape, dt))["image"]


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "float32"])
@pytest.mark.parametrize("params", ["mean/std", "per-channel mean/std", "per-channel scale/offset"])
@pytest.mark.parametrize("flip_axis", [None, 0, 1])
@pytest.mark.parametrize("out", ["float32", "float16", "bfloat16"])
def test_fused_normalize_flip_equals_the_plain_numpy_formula(
    implementation: str, dtype: str, params: str, flip_axis: int | None, out: str
) -> None:
    shape = (5, 8, 3)
    rng = np.random.default_rng([len(dtype), len(params), flip_axis or 9, len(out)])
    x = _values(dtype, (11, *shape), rng)
    if params == "mean/std":
        first, second, divide = -0.5, 127.5, True
        norm = Normalize(mean=first, std=second, fields="image")
    elif params == "per-channel mean/std":
        first, second, divide = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], True
        norm = Normalize(mean=first, std=second, fields="image")
    else:
        first, second, divide = [1 / 255, 2.5, -3.0], [-1.0, 0.0, 0.125], False
        norm = Normalize(first, second, fields="image")
    fns: list[Any] = [norm]
    if flip_axis is not None:
        fns.append(RandomFlip(fields="image", axis=flip_axis))
    if out != "float32":
        fns.append(Cast(out, fields="image"))
    stage = _stage(fns, shape, dtype)
    assert ("image" in stage.kernels) == (implementation == "kernel")
    want = _plain(x, first, second, divide, flip_axis, ml_dtypes.bfloat16 if out == "bfloat16" else out)
    got = _run(stage, x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))  # bit for bit, NaN-free data


@pytest.mark.parametrize("shape", [(3, 5, 3), (4, 7, 4), (2, 16, 3), (6, 9, 2)])
@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
def test_units_of_several_values_flipped_along_w_equal_the_plain_formula(shape: tuple[int, ...], dtype: str) -> None:
    """Rows of units of I > 1 values (RGB, RGBA) flipped along W run in the unit kernel: rows a
    multiple of 8 values long and not (the scalar tail), per-channel and one-value parameters."""
    rng = np.random.default_rng([len(shape), shape[1], len(dtype)])
    x = _values(dtype, (13, *shape), rng)
    channels = shape[-1]
    for first, second in (([0.4 * c + 1 for c in range(channels)], [0.2 + c for c in range(channels)]), (-0.5, 3.0)):
        fns: list[Any] = [Normalize(mean=first, std=second, fields="image"), RandomFlip(fields="image", axis=1)]
        stage = _stage(fns, shape, dtype)
        assert "image" in stage.kernels
        want = _plain(x, first, second, True, 1, np.float32)
        got = _run(stage, x)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("out", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("divide", [False, True])
def test_the_row_kernel_keeps_nans_infinities_and_tiny_values_as_numpy_does(out: str, divide: bool) -> None:
    """float32 records of rows a multiple of 8 long with one scalar op and a flip along them run
    in the hand-written row kernel, which narrows to 16 bits in registers: NaNs of both signs
    and any payload, infinities, subnormals and values that overflow 16 bits come out as
    numpy's (float16) and ml_dtypes' (bfloat16) casts of the float32 result."""
    rng = np.random.default_rng(31)
    bits = rng.integers(0, 2**32, size=(9, 4, 16, 1), dtype=np.uint64).astype(np.uint32)
    special = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001, 0x80000010,
                        0x477FF000, 0x7F7FFFFF, 0x3F800000, 0, 0x80000000, 0x00400000, 0x38800000, 0x33800000,
                        0x4B000001], np.uint32)  # fmt: skip
    bits[0, :, :, 0] = special
    x = bits.view(np.float32)
    first, second = (0.5, 3.0) if divide else (1.5, -0.25)
    norm = Normalize(mean=first, std=second, fields="image") if divide else Normalize(first, second, fields="image")
    fns: list[Any] = [norm, RandomFlip(fields="image", axis=1)]
    if out != "float32":
        fns.append(Cast(out, fields="image"))
    stage = _stage(fns, (4, 16, 1), "float32")
    assert "image" in stage.kernels
    with np.errstate(invalid="ignore", over="ignore"):
        want = _plain(x, first, second, divide, 1, ml_dtypes.bfloat16 if out == "bfloat16" else out)
        got = _run(stage, x)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("out", ["float16", "bfloat16"])
def test_a_narrowed_output_is_the_same_in_scratch_chunks_of_any_size(monkeypatch: pytest.MonkeyPatch, out: str) -> None:
    """Normalize + Cast to 16 bits runs through a float32 scratch, SCRATCH_BYTES at a time: with
    chunks of 2 records (11 records: 6 chunks, the last one short) the batch is the same."""
    shape = (5, 8, 3)
    monkeypatch.setattr(fusion, "SCRATCH_BYTES", 2 * 5 * 8 * 3 * 4)
    x = _values("int8", (11, *shape), np.random.default_rng(4))
    fns = [
        Normalize(mean=-0.5, std=127.5, fields="image"),
        RandomFlip(fields="image", axis=1),
        Cast(out, fields="image"),
    ]
    stage = _stage(fns, shape, "int8")
    assert "image" in stage.kernels
    want = _plain(x, -0.5, 127.5, True, 1, ml_dtypes.bfloat16 if out == "bfloat16" else out)
    assert np.array_equal(_run(stage, x).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("flip_axis", [None, 1])
def test_fused_crop_normalize_flip_takes_each_records_window(implementation: str, flip_axis: int | None) -> None:
    shape = (7, 9, 1)
    x = _values("int8", (13, *shape), np.random.default_rng(3))
    fns: list[Any] = [RandomCrop((4, 5), fields="image"), Normalize(mean=-0.5, std=127.5, fields="image")]
    if flip_axis is not None:
        fns.append(RandomFlip(fields="image", axis=flip_axis))
    got = _run(_stage(fns, shape, "int8"), x)
    offsets = RandomCrop((4, 5), fields="image").draw(batch_rng(SEED, 0, 0, 0), len(x), shape)
    want = np.stack([x[j, h : h + 4, w : w + 5] for j, (h, w) in enumerate(offsets.tolist())])
    want = (want.astype(np.float32) + np.float32(0.5)) / np.float32(127.5)
    if flip_axis is not None:
        flips = batch_rng(SEED, 0, 0, 2).random(len(x)) < 0.5
        want[flips] = want[flips][:, :, ::-1]
    assert np.array_equal(got, want)


def test_the_kernel_declines_what_it_cannot_do_in_one_pass() -> None:
    if fusion._kernels is None:
        pytest.fail("stoker._kernels was not built: run `pip install -e .`")
    per_channel = Normalize(mean=[1.0, 2.0], std=[3.0, 4.0], fields="image")
    declined = {
        "flip of the channel axis under per-channel parameters": [per_channel, RandomFlip(fields="image", axis=2)],
        "no Normalize": [RandomFlip(fields="image"), Cast("float32", fields="image")],
        "a Cast before Normalize": [Cast("float64", fields="image"), Normalize(2.0, fields="image")],
        "flips of two axes": [per_channel, RandomFlip(fields="image", axis=0), RandomFlip(fields="image", axis=1)],
    }
    for why, fns in declined.items():
        assert "image" not in _stage(fns, (4, 6, 2), "int8").kernels, why
    assert "image" not in _stage([Normalize(2.0, fields="image")], (4, 6, 2), "int32").kernels, "int32 records"
    assert "image" not in _stage([Normalize(2.0, fields="image")], (4, 6, 2), ">i2").kernels, "big-endian records"


FRAME = FieldPlan("img", "int8", (6, 8, 1))
FRAME_GZ = FieldPlan("img", "uint8", (6, 8, 1), kind="gzip")


def _augment() -> list[Any]:
    return [Normalize(mean=-0.5, std=127.5, fields="image"), RandomFlip(fields="image", axis=1)]


@pytest.mark.parametrize("shuffle", [False, "global"])
@pytest.mark.parametrize("frame", [FRAME, FRAME_GZ], ids=["raw", "gzip"])
def test_loader_with_the_kernel_equals_the_plain_formula(
    tmp_path: Path, implementation: str, shuffle: Any, frame: FieldPlan
) -> None:
    ds = build(tmp_path, [13, 0, 21, 7], {"image": frame, "label": LAB_GZ})  # 41 records: the last batch pads
    kw: dict[str, Any] = {"shuffle": shuffle, "seed": SEED, "pad_last": True}
    with ds.loader(8, **kw) as plain_loader:
        plain = [dict(b) for b in plain_loader]
    want = []
    for i, b in enumerate(plain):
        image = _plain(b["image"], -0.5, 127.5, True, 1, np.float32, first_row=8 * i)  # padding rows too
        want.append({**b, "image": image})
    with ds.loader(8, transform=_augment(), threads=3, **kw) as loader:
        got = [dict(b) for b in loader]
    assert_same_batches(want, got)


def test_assembly_runs_the_kernel_on_local_raw_records(tmp_path: Path) -> None:
    if fusion._kernels is None:
        pytest.fail("stoker._kernels was not built: run `pip install -e .`")
    ds = build(tmp_path, [13, 0, 21], {"image": FRAME, "label": LAB_GZ})
    with ds.loader(8, seed=SEED, transform=_augment(), threads=1) as loader:
        it = iter(loader)
        first = next(it)
        assembler = it._assembler  # type: ignore[attr-defined]
        assert assembler._fused_fields(loader._plan.batches(1).__next__()) == {"image": ((6, 8, 1), np.float32)}
    with ds.loader(8) as plain_loader:
        x = next(iter(plain_loader))["image"]
    assert np.array_equal(first["image"], _plain(x, -0.5, 127.5, True, 1, np.float32))


@pytest.mark.parametrize(
    ("stored", "out"),
    [("int8", "bfloat16"), ("int8", "float16"), ("uint16", "float32"), ("int16", "uint8"), ("float32", "bfloat16")],
)
@pytest.mark.parametrize("shuffle", [False, "global"])
def test_a_lone_cast_is_done_as_records_are_read_with_the_same_bits(
    tmp_path: Path, stored: str, out: str, shuffle: Any
) -> None:
    """transform=[Cast(...)] alone on a field: the assembly casts as it reads (as cast= does)
    instead of reading then casting; what comes out is Cast applied to the plain batch."""
    from stoker.spec import resolve_dtype

    frame = FieldPlan("img", stored, (6, 8, 1))
    ds = build(tmp_path, [13, 0, 21, 7], {"image": frame, "label": LAB_GZ})
    kw: dict[str, Any] = {"shuffle": shuffle, "seed": SEED}
    with ds.loader(8, **kw) as plain_loader:
        plain = [dict(b) for b in plain_loader]
    with ds.loader(8, transform=[Cast(out, fields="image")], threads=2, **kw) as loader:
        it = iter(loader)
        got = [dict(b) for b in it]
        if not shuffle:  # gathers are not fused (the assembler reads them itself)
            fused = it._assembler._fused_fields(loader._plan.batches(1).__next__())  # type: ignore[attr-defined]
            assert fused == {"image": ((6, 8, 1), resolve_dtype(out))}
    assert len(got) == len(plain)
    for g, p in zip(got, plain, strict=True):
        want = np.empty(p["image"].shape, resolve_dtype(out))
        with np.errstate(invalid="ignore", over="ignore"):
            want[...] = p["image"].astype(want.dtype)
        assert g["image"].dtype == want.dtype
        assert np.array_equal(g["image"].view(f"u{want.itemsize}"), want.view(f"u{want.itemsize}"))
        assert np.array_equal(g["label"], p["label"])


def test_a_cast_after_a_rounding_loader_cast_is_not_fused_past_it(tmp_path: Path) -> None:
    """int64 records the loader casts to float64 round past 2**53 (numpy calls that cast safe):
    a Cast("float32") after it must round what the loader delivered, not the stored integers
    (2**60 + 2**36 + 1 is float32's 2**60 that way, and 2**60 + 2**37 straight from the int)."""
    values = np.array([2**60 + 2**36 + 1, 3, -(2**60 + 2**36 + 1), 2**62 + 2**38 + 5], np.int64)
    (tmp_path / "v_0.bin").write_bytes(values.tobytes())
    ds = stoker.Dataset(v=stoker.Field(str(tmp_path / "v_*.bin"), "int64"))
    with ds.loader(4, cast="float64", transform=[Cast("float32", fields="v")]) as loader:
        (got,) = [b["v"] for b in loader]
    want = values.astype(np.float64).astype(np.float32)
    assert want[0] != values[:1].astype(np.float32)[0]  # the double rounding this checks
    assert np.array_equal(got, want)


def test_process_workers_deliver_what_the_fused_threads_do(tmp_path: Path) -> None:
    ds = build(tmp_path, [13, 21], {"image": FRAME, "label": LAB_GZ})
    with ds.loader(8, seed=SEED, transform=_augment(), threads=2) as loader:
        want = [dict(b) for b in loader]
    with ds.loader(8, seed=SEED, transform=_augment(), workers="process", threads=2) as loader:
        got = [dict(b) for b in loader]
    assert_same_batches(want, got)


@pytest.mark.parametrize("shape", [(32, 64, 3), (64, 128, 1), (50, 100, 1)])
def test_a_batch_large_enough_to_stream_is_bit_identical(implementation: str, shape: tuple[int, ...]) -> None:
    """1 MiB and more of output is written with streaming stores (stoker.kernels): same bits.
    (64, 128, 1) and (50, 100, 1) flip along W in short rows, which are packed into blocks."""
    from stoker.kernels import STREAM_MIN_BYTES

    x = _values("uint8", (STREAM_MIN_BYTES // (4 * int(np.prod(shape))) + 3, *shape), np.random.default_rng(4))
    mean, std = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]) if shape[-1] == 3 else (-0.5, 127.5)
    stage = _stage([Normalize(mean=mean, std=std, fields="image"), RandomFlip(fields="image", axis=1)], shape, "uint8")
    got = _run(stage, x)
    assert got.nbytes >= STREAM_MIN_BYTES
    want = _plain(x, mean, std, True, 1, np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
