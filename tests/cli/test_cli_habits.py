"""The command's habits: no abbreviated options, a mistake told with its own command's usage and the
nearest valid word, a missing directory said as such, counts in the singular for one, a sample not
rewritten when it is there already, `python -m stoker`, and `stoker bench` on a directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.cli import build_parser, main
from tests.helpers import REPO


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    assert main(["sample", str(tmp_path / "s"), "--pairs", "2", "--records", "64", "--inrez", "16"]) == 0
    return tmp_path / "s"


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_every_parser_refuses_abbreviated_options() -> None:
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[attr-defined]
    assert sorted(subs) == ["bench", "explain", "index", "inspect", "sample"]
    assert not parser.allow_abbrev and not any(p.allow_abbrev for p in subs.values())


def test_an_abbreviated_option_is_an_error_with_the_commands_usage_and_the_option_it_may_mean(
    sample: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(["inspect", str(sample), "--group"], capsys)
    assert err.startswith("usage: stoker inspect ")
    assert err.rstrip().endswith("stoker inspect: error: unrecognized arguments: --group; did you mean --groups?")


def test_a_typo_in_an_option_gets_its_commands_usage_and_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["bench", "--seconds", "1", "--warmpu=0"], capsys)
    assert err.startswith("usage: stoker bench ")
    assert "stoker bench: error: unrecognized arguments: --warmpu=0; did you mean --warmup?" in err


def test_a_typo_in_a_command_suggests_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["inspct", "data"], capsys)
    assert "invalid choice: 'inspct'" in err and err.rstrip().endswith("did you mean inspect?")


@pytest.mark.parametrize("command", ["inspect", "index", "bench"])
def test_a_missing_directory_is_said_to_be_missing(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert main([command, str(missing)]) == 2
    assert capsys.readouterr().err == f"SpecError: no such directory: {missing}\n"


@pytest.mark.parametrize("module", ["stoker", "stoker.cli"])
def test_python_dash_m_runs_the_command(module: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                          timeout=60, env=env, check=False)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("stoker "), proc.stderr


def test_counts_of_one_are_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "one"
    assert main(["sample", str(d), "--pairs", "1", "--records", "1", "--inrez", "4"]) == 0
    assert "wrote 1 pair x 1 record (16 B of images)" in capsys.readouterr().out
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "\n1 group, fields: " in out and "total: 1 record, " in out
    assert main(["index", str(d)]) == 0
    assert "indexed 2 files of 1 group (1 record) in " in capsys.readouterr().out
    code = main(["bench", str(d), "--rounds", "1", "--seconds", "0.05", "--warmup", "0", "--no-ceiling"])
    assert code == 0 and "; 1 alternated round of 0.05s, each after 0s of warm-up" in capsys.readouterr().out


def test_sample_again_with_the_same_settings_writes_nothing_and_says_so(
    sample: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in sample.iterdir()}
    assert main(["sample", str(sample), "--pairs", "2", "--records", "64", "--inrez", "16"]) == 0
    assert (
        capsys.readouterr().out
        == f"{sample} already holds this sample (2 pairs x 64 records, 16x16x1): nothing written\n"
    )
    assert {p.name: p.stat().st_mtime_ns for p in sample.iterdir()} == before
    # Another sample there still needs --force, and a damaged one is not taken for the same.
    assert main(["sample", str(sample), "--pairs", "2", "--records", "65", "--inrez", "16"]) == 2
    assert "is not empty" in capsys.readouterr().err
    with open(sample / "img_0001.bin", "r+b") as f:
        f.truncate(100)
    assert main(["sample", str(sample), "--pairs", "2", "--records", "64", "--inrez", "16"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_bench_takes_a_directory(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", str(sample), "--rounds", "1", "--seconds", "0.1", "--warmup", "0", "--batch-size", "16"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("Dataset(image=int8[16, 16, 1], label=float32[]; 2 groups): 128 records;")
    assert "ceiling:mmap_kept" in out and "verdict: " in out


def test_bench_alone_writes_its_sample_into_the_users_cache_once_saying_where_and_how_big(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STOKER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--pairs", "2", "--records", "64", "--inrez", "16", "--rounds", "1", "--seconds", "0.05",
            "--warmup", "0", "--no-ceiling"]  # fmt: skip
    assert main(argv) == 0
    where = tmp_path / "xdg" / "stoker" / "sample-2x64x16"
    err = capsys.readouterr().err
    assert err.startswith(f"writing a 32.0 KiB sample (2 pairs x 64 records of 16x16x1 int8 frames and gzip labels) "
                          f"into {where}; later runs reuse it\n")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["xdg"]  # nothing in the current directory
    made = {p.name: p.stat().st_mtime_ns for p in where.iterdir()}
    assert main(argv) == 0
    assert "writing" not in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in where.iterdir()} == made


def test_bench_without_xdg_uses_dot_cache_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.cli.bench import cache_dir

    monkeypatch.delenv("STOKER_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "stoker"
