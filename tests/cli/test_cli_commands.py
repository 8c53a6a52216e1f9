"""The stoker command: user mistakes print `Type: message`, no traceback; fields; bench (inspect: test_cli.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from stoker.cli import main, parse_field


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["inspect", "--field", "x=/nonexistent/*.bin:int8"], "/nonexistent/*.bin"),
        (["inspect", "--field", "x"], "NAME=GLOB:DTYPE"),
        (["inspect", "--field", "x=a.bin:notadtype"], "notadtype"),
        (["inspect", "--config", "/nonexistent/stoker.toml"], "/nonexistent/stoker.toml"),
    ],
)
def test_user_mistakes_print_type_and_message_without_traceback(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Error: " in err and needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "value", "need"),
    [("--rounds", "0", "at least 1"), ("--seconds", "0", "more than 0"), ("--seconds", "-1", "more than 0"),
     ("--warmup", "-0.5", "0 or more"), ("--batch-size", "0", "at least 1")],
)  # fmt: skip
def test_bench_refuses_numbers_it_cannot_measure_with_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, need: str
) -> None:
    main(["sample", str(tmp_path), "--pairs", "1", "--records", "8", "--inrez", "8"])
    capsys.readouterr()
    started = time.perf_counter()
    code = main(["bench", "--field", f"image={tmp_path}/img_*.bin:int8:8x8", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"SpecError: stoker bench {flag} {float(value):g}: must be {need}")
    assert time.perf_counter() - started < 1.0  # refused before any round ran (each runs 4 s)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--memory-budget", "lots"], "SpecError: memory_budget='lots' must be a byte count like 512MiB"),
     (["--memory-budget", "1KiB"], "SpecError: memory_budget='1KiB' (1024 bytes) holds less than one batch"),
     (["--prefetch", "0"], "SpecError: prefetch=0 must be a positive integer"),
     (["--threads", "-2"], "SpecError: threads=-2 must be a positive integer"),
     (["--prefetch", "900", "--memory-budget", "1MiB"], "SpecError: prefetch=900 batches of 65536 bytes exceed"),
     (["--block-length", "0"], "SpecError: block_length=0 must be a positive integer or None"),
     (["--cycle-length", "-1"], "SpecError: cycle_length=-1 must be a positive integer or None")],
)  # fmt: skip
def test_bench_refuses_loader_settings_the_loader_refuses_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    main(["sample", str(tmp_path), "--pairs", "1", "--records", "8", "--inrez", "8"])
    capsys.readouterr()
    started = time.perf_counter()
    code = main(["bench", "--field", f"image={tmp_path}/img_*.bin:int8:8x8", *args])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith(message)
    assert time.perf_counter() - started < 1.0  # refused before any round ran


def test_bench_compare_refuses_loader_settings_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code = main(["bench", "--compare", "--memory-budget", "1GiB", "--threads", "2", "--block-length", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith(
        "SpecError: stoker bench --compare runs every contender in its own best configuration; "
        "--threads, --memory-budget, --block-length set stoker's loader for a run without --compare"
    )
    assert time.perf_counter() - started < 1.0  # nothing started


def test_bench_refuses_a_cast_to_no_dtype_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["sample", str(tmp_path), "--pairs", "1", "--records", "8", "--inrez", "8"])
    capsys.readouterr()
    code = main(["bench", "--field", f"image={tmp_path}/img_*.bin:int8:8x8", "--cast", "notadtype"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("SpecError: cast for field 'image': 'notadtype' is not a numpy dtype")


def test_parse_field_reads_shape_and_compression_in_any_order() -> None:
    spec = parse_field("image=data/img_*.bin:int8:128x128x1:none")
    assert spec == {"name": "image", "files": "data/img_*.bin", "dtype": "int8", "shape": [128, 128, 1],
                    "compression": None}  # fmt: skip
    assert parse_field("label=out_*.gz:float32:gzip")["compression"] == "gzip"


def _bench_a_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str], *options: str) -> tuple[int, str]:
    """`stoker bench` on a 2 x 64-record sample's fields, one short round, with ``options``: (code, stdout)."""
    main(["sample", str(tmp_path), "--pairs", "2", "--records", "64", "--inrez", "16"])
    capsys.readouterr()
    fields = [
        "--field",
        f"image={tmp_path}/img_*.bin:int8:16x16x1",
        "--field",
        f"label={tmp_path}/out_*.bin.gz:float32",
    ]
    code = main(["bench", *fields, *options, "--rounds", "1", "--seconds", "0.3", "--warmup", "0"])
    return code, capsys.readouterr().out


def test_bench_prints_throughput_and_ceiling_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _bench_a_sample(tmp_path, capsys)
    assert code == 0
    assert "records/s" in out and "ceiling:mmap_stream" in out and "stoker / ceiling: median" in out
    # The interleave stoker read with (the default: ~4 MiB of 256-byte images a block); an epoch
    # of 128 records is one batch of 256, from the two files: two runs.
    assert "cycle_length=2 block_length=16384, 2.0 runs per assembly" in out
    # The median round's line gives that round's timed rate, the one the table shows (one round).
    table = next(x for x in out.splitlines() if x.startswith("stoker "))
    line = next(x for x in out.splitlines() if x.startswith("stoker (median round)"))
    assert line.split(": ", 1)[1].split(" records/s")[0] == table.split()[1]


def test_bench_reads_with_the_interleave_it_is_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--cycle-length/--block-length: the loader's, so the verdict's block_length advice can be tried."""
    code, out = _bench_a_sample(tmp_path, capsys, "--cycle-length", "2", "--block-length", "24", "--batch-size", "16")
    assert code == 0
    # Blocks of 24 records from 2 files of 64: each file in blocks of 24, 24 and 16, taken in
    # turns: an epoch is 6 runs, and its 8 batches of 16 are assembled as one.
    line = next(x for x in out.splitlines() if x.startswith("stoker (median round)"))
    assert "(assembled 64 at a time) cycle_length=2 block_length=24, 6.0 runs per assembly" in line


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bench_casts_per_field_as_the_loader_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str
) -> None:
    """--cast NAME=DTYPE[,NAME=DTYPE]: the loader's cast map; the ceiling casts its field the same way."""
    code, out = _bench_a_sample(tmp_path, capsys, "--cast", f"image={dtype}")
    assert code == 0
    assert f"batch 256, cast image={dtype};" in out
    assert f"with its cast to {dtype} limits you" in out or "verdict: " in out
    assert "stoker / ceiling: median" in out
    assert "verdict: " in out


@pytest.mark.parametrize(
    ("cast", "message"),
    [
        ("imag=float32", "SpecError: cast names unknown field(s) ['imag']; fields are ['image', 'label']"),
        ("image=float32,x", "SpecError: --cast 'image=float32,x': 'x' is not NAME=DTYPE"),
        ("image=", "SpecError: --cast 'image=': 'image=' is not NAME=DTYPE"),
        ("label=complex64", "SpecError: cast for field 'label': complex64 must be a bool, integer or float dtype"),
    ],
)
def test_bench_refuses_a_bad_per_field_cast_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cast: str, message: str
) -> None:
    main(["sample", str(tmp_path), "--pairs", "1", "--records", "8", "--inrez", "8"])
    capsys.readouterr()
    started = time.perf_counter()
    fields = ["--field", f"image={tmp_path}/img_*.bin:int8:8x8", "--field", f"label={tmp_path}/out_*.bin.gz:float32"]
    code = main(["bench", *fields, "--cast", cast])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith(message)
    assert time.perf_counter() - started < 1.0


def test_bench_says_the_ceiling_was_not_measured_when_its_loops_timed_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A timed window shorter than one ceiling batch counts no record: a line saying so, not a
    division by zero (which a first import of ml_dtypes inside the window once caused)."""
    main(["sample", str(tmp_path), "--pairs", "2", "--records", "64", "--inrez", "16"])
    capsys.readouterr()
    fields = ["--field", f"image={tmp_path}/img_*.bin:int8:16x16", "--field", f"label={tmp_path}/out_*.bin.gz:float32"]
    code = main(["bench", *fields, "--rounds", "1", "--seconds", "0.000001", "--warmup", "0", "--batch-size", "4096"])
    out = capsys.readouterr().out
    assert code == 0
    assert "stoker / ceiling: not measured (the ceiling loops made no record in their timed window)" in out
    assert "verdict: " in out


def test_bench_on_a_bfloat16_field_measures_its_ceiling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ceiling's child gets the field's dtype by name: as '<V2' every loop failed and the
    ceiling read "not measured"."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    for g in range(2):
        rng.normal(size=(512, 16, 16)).astype(ml_dtypes.bfloat16).tofile(tmp_path / f"e_{g}.bin")
    field = f"e={tmp_path}/e_*.bin:bfloat16:16x16"
    code = main(["bench", "--field", field, "--rounds", "1", "--seconds", "0.3", "--warmup", "0.1"])
    out = capsys.readouterr().out
    assert code == 0 and "stoker / ceiling: median" in out and "batch 256, cast float32;" in out


def test_bench_cast_none_keeps_the_stored_dtypes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _bench_a_sample(tmp_path, capsys, "--cast", "none")
    assert code == 0
    assert "batch 256, cast none;" in out
    assert "with its cast" not in out  # the copy is named without a cast
