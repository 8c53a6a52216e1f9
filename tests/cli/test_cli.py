"""The stoker command: sample, inspect (dir, --field, --config), bench; errors as `Type: message`."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest

from stoker.cli import main, parse_field


@pytest.fixture
def sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    d = tmp_path / "d"
    assert main(["sample", str(d), "--pairs", "2", "--records", "50", "--inrez", "8"]) == 0
    assert "wrote 2 pairs x 50 records" in capsys.readouterr().out
    return d


def test_sample_writes_the_files(sample: Path) -> None:
    assert sorted(p.name for p in sample.iterdir()) == ["img_0000.bin", "img_0001.bin", "out_0000.bin.gz",
                                                         "out_0001.bin.gz", "stoker.toml"]  # fmt: skip
    assert (sample / "img_0001.bin").stat().st_size == 50 * 64


def test_a_sample_dir_tells_the_commands_its_frame_size(sample: Path, capsys) -> None:
    capsys.readouterr()
    assert main(["inspect", str(sample)]) == 0  # no --inrez: the sample's stoker.toml says 8x8x1
    out = capsys.readouterr().out
    assert "image (int8[8, 8, 1], 64 B/record)" in out and "total: 100 records" in out and "in sync" in out
    assert main(["index", str(sample)]) == 0
    assert "indexed 4 files of 2 groups (100 records)" in capsys.readouterr().out
    assert main(["inspect", str(sample), "--inrez", "16"]) == 1  # --inrez still overrides; 16x16 does not fit
    out = capsys.readouterr().out
    assert "layout: the `stoker sample` layout with --inrez 16" in out
    assert "img_0000.bin (3.1 KiB, ?, CORRUPT)" in out and "256-byte records" in out


def test_inspect_a_sample_dir_reports_groups_records_and_sync(sample: Path, capsys) -> None:
    assert main(["inspect", str(sample), "--inrez", "8"]) == 0
    out = capsys.readouterr().out
    assert "2 groups" in out and "total: 100 records" in out and "in sync" in out
    assert "img_0000.bin" in out and "out_0001.bin.gz" in out and "gzip" in out


def test_inspect_with_fields_and_with_config_print_the_same(sample: Path, capsys) -> None:
    argv = ["inspect", "--field", f"image={sample}/img_*.bin:int8:8x8x1", "--field",
            f"label={sample}/out_*.bin.gz:float32:gzip"]  # fmt: skip
    assert main(argv) == 0
    by_fields = capsys.readouterr().out
    cfg = sample / "stoker.toml"
    cfg.write_text(
        '[fields.image]\nfiles = "img_*.bin"\ndtype = "int8"\nshape = [8, 8, 1]\n\n'
        '[fields.label]\nfiles = "out_*.bin.gz"\ndtype = "float32"\ncompression = "gzip"\n'
    )
    assert main(["inspect", "--config", str(cfg)]) == 0
    by_config = capsys.readouterr().out
    # The same table; only the layout line says where the fields came from.
    assert by_fields.startswith("layout: from --field\n")
    assert by_config.startswith(f"layout: from --config {cfg}\n")
    assert by_config.split("\n", 1)[1] == by_fields.split("\n", 1)[1]
    assert "total: 100 records" in by_fields


def test_inspect_reports_out_of_sync_groups_with_exit_code_1(sample: Path, capsys) -> None:
    (sample / "out_0001.bin.gz").write_bytes(gzip.compress(np.arange(49, dtype="<f4").tobytes()))
    assert main(["inspect", str(sample), "--inrez", "8"]) == 1
    out = capsys.readouterr().out
    assert "OUT OF SYNC" in out and "out_0001.bin.gz" in out and "49" in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x=a/*.bin:int8", {"files": "a/*.bin", "dtype": "int8", "shape": [], "compression": "auto"}),
        ("x=a/*.bin:int8:128x128x1", {"files": "a/*.bin", "dtype": "int8", "shape": [128, 128, 1]}),
        ("y=b.gz:float32:gzip", {"files": "b.gz", "dtype": "float32", "compression": "gzip"}),
        ("y=b:float32:4:none", {"files": "b", "shape": [4], "compression": None}),
        ("z=C:/data/*.bin:uint8:3:zlib", {"files": "C:/data/*.bin", "dtype": "uint8", "compression": "zlib"}),
        ("e=emb_*.bin:bfloat16:8x8", {"files": "emb_*.bin", "dtype": "bfloat16", "shape": [8, 8]}),
    ],
)
def test_parse_field(text: str, expected: dict) -> None:
    spec = parse_field(text)
    assert spec["name"] == text.split("=")[0]
    for k, v in expected.items():
        assert spec[k] == v


def _mistake(argv: list[str], capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err
    return err


def test_missing_files_print_spec_error_naming_the_glob(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()  # a directory with no files of the layout (none at all: test_cli_habits.py)
    err = _mistake(["inspect", str(tmp_path / "empty"), "--inrez", "8"], capsys)
    assert err.startswith("SpecError: ") and str(tmp_path / "empty" / "img_*.bin") in err


def test_a_corrupt_raw_file_is_marked_in_its_row_and_the_other_groups_still_show(sample: Path, capsys) -> None:
    with open(sample / "img_0001.bin", "ab") as f:
        f.write(b"xyz")
    assert main(["inspect", str(sample), "--inrez", "8"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\s+0\s+50\s+img_0000\.bin \(3\.1 KiB, raw\)\s+out_0000\.bin\.gz \(\d+ B, gzip\)$", out, re.M), (
        out
    )
    assert re.search(r"^\s+1\s+CORRUPT\s+img_0001\.bin \(3\.1 KiB, \?, CORRUPT\)\s+out_0001", out, re.M), out
    assert "total: 50 records" in out
    assert "group 1: CorruptDataError: field 'image'" in out and "img_0001.bin" in out and "offset 3200" in out


def test_a_raw_count_mismatch_is_a_mismatch_row_naming_both_files(tmp_path: Path, capsys) -> None:
    (tmp_path / "a_0.bin").write_bytes(bytes(8))
    (tmp_path / "b_0.bin").write_bytes(bytes(12))
    assert main(["inspect", "--field", f"a={tmp_path}/a_*.bin:int32", "--field", f"b={tmp_path}/b_*.bin:int32"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\s+0\s+MISMATCH\s+a_0\.bin \(8 B, raw\)\s+b_0\.bin \(12 B, raw\)$", out, re.M), out
    assert "group 0: PairingError: " in out and "2 records in" in out and "3 records in" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["inspect", "--field", "x"], "NAME=GLOB:DTYPE"),
        (["inspect", "--field", "x=a.bin:notadtype"], "notadtype"),
        (["inspect", "--field", "x=a.bin:int8:banana"], "banana"),
        (["inspect", "--config", "/nonexistent/stoker.toml"], "/nonexistent/stoker.toml"),
        (["inspect"], "inspect needs"),
    ],
)
def test_user_mistakes_print_type_and_message_without_traceback(argv, needle: str, capsys) -> None:
    err = _mistake(argv, capsys)
    assert err.startswith("SpecError: ") and needle in err


def test_bad_config_contents_name_the_config(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[fields.x\n")
    assert str(bad) in _mistake(["inspect", "--config", str(bad)], capsys)
    empty = tmp_path / "empty.toml"
    empty.write_text("[other]\n")
    assert str(empty) in _mistake(["inspect", "--config", str(empty)], capsys)
    nofiles = tmp_path / "nofiles.toml"
    nofiles.write_text('[fields.x]\ndtype = "int8"\n')
    assert "fields.x" in _mistake(["inspect", "--config", str(nofiles)], capsys)


def test_bench_on_a_tiny_dataset_prints_records_per_second_and_the_ceiling_ratio(sample: Path, capsys) -> None:
    argv = ["bench", "--field", f"image={sample}/img_*.bin:int8:8x8x1", "--field",
            f"label={sample}/out_*.bin.gz:float32:gzip",
            "--rounds", "1", "--seconds", "0.3", "--warmup", "0.2", "--batch-size", "16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "records/s" in out
    assert "stoker / ceiling: median" in out
    assert "ceiling:mmap_stream" in out and "ceiling:mmap_kept" in out
    assert "1 alternated round of 0.3s, each after 0.2s of warm-up" in out
    first = re.search(r"first batch after ([\d,]+) ms \(rounds ([\d,]+)\.\.([\d,]+)\): start-up", out)
    assert first is not None, out
    assert 0 <= int(first[1].replace(",", "")) < 60_000  # measured, in milliseconds
