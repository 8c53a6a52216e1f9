"""`stoker bench` as a command: a run too short to judge, Ctrl-C, and `--compare` outside a checkout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import stoker.cli.contenders
from stoker.cli import main
from stoker.cli.contenders import Measurement
from tests.helpers import REPO


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    assert main(["sample", str(tmp_path / "s"), "--pairs", "2", "--records", "64", "--inrez", "16"]) == 0
    return tmp_path / "s"


def test_a_window_mostly_start_up_is_too_short_to_judge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A window a few batches long (of 16 MiB each) cannot hold a steady state: the verdict says
    so instead of blaming what start-up costs."""
    d = tmp_path / "big"
    assert main(["sample", str(d), "--pairs", "2", "--records", "1024", "--inrez", "64"]) == 0
    code = main(["bench", str(d), "--rounds", "1", "--seconds", "0.001", "--warmup", "0", "--batch-size", "1024"])
    out = capsys.readouterr().out
    assert code == 0
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: "))
    assert verdict.startswith("verdict: too short to judge: the timed window held ")
    assert verdict.endswith("give more --seconds or --warmup")


def test_ctrl_c_prints_the_rounds_finished_and_exits_130(
    sample: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = stoker.cli.contenders.run_child
    calls = []

    def interrupted_at_the_fifth_run(contender: str, cfg: dict[str, object]) -> Measurement:
        calls.append(contender)
        if len(calls) == 5:  # rounds of 2 runs (stoker, one ceiling loop): the third round's first
            raise KeyboardInterrupt
        return real(contender, cfg)

    monkeypatch.setattr(stoker.cli.contenders, "run_child", interrupted_at_the_fifth_run)
    # A compressed widest field: one ceiling loop (inflate_cast), so two runs a round.
    field = f"x={sample}/out_*.bin.gz:float32:gzip"
    code = main(["bench", "--field", field, "--rounds", "5", "--seconds", "0.05", "--warmup", "0"])
    out = capsys.readouterr().out
    assert code == 130
    assert "\ninterrupted: 2 rounds of 5 finished\n" in out
    table = out.split("interrupted: ", 1)[1]
    assert "\nstoker " in table and "\nceiling:inflate_cast " in table and "verdict: " in table


def test_ctrl_c_on_the_command_line_exits_130_saying_so(sample: Path) -> None:
    """A real SIGINT to the command's process group (as a terminal's Ctrl-C), its children included."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    argv = [sys.executable, "-m", "stoker", "bench", str(sample), "--rounds", "200", "--seconds", "0.05",
            "--warmup", "0", "--no-ceiling"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("Dataset(")  # measuring has begun
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted: " in out and " of 200 finished" in out and "Traceback" not in err


def test_compare_outside_a_checkout_says_it_needs_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # An unknown workload: were a compare.py found, it would refuse it at once rather than run.
    assert main(["bench", "--compare", "--workloads", "W9"]) == 2
    assert capsys.readouterr().err == (
        "SpecError: --compare needs a checkout of stoker's repository (benchmarks/compare.py); run it from there\n"
    )
    assert main(["bench", "--compare", "--benchmarks", str(tmp_path / "elsewhere")]) == 2
    assert f"{tmp_path / 'elsewhere' / 'compare.py'} is not there" in capsys.readouterr().err


def test_compare_runs_the_script_of_the_benchmarks_folder_given(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "compare.py").write_text("import sys\nprint('compare', *sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)  # not a checkout: the folder comes from --benchmarks
    assert main(["bench", "--compare", "--benchmarks", str(tmp_path), "--workloads", "W1", "--seconds", "1"]) == 0
    assert "compare --rounds 5 --seconds 1.0 --warmup 1.0 --workloads W1" in capfd.readouterr().out
    os.mkdir(tmp_path / "benchmarks")
    (tmp_path / "benchmarks" / "compare.py").write_text("print('from the current directory')\n")
    assert main(["bench", "--compare"]) == 0
    assert "from the current directory" in capfd.readouterr().out
