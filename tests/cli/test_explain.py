"""`stoker explain`: the command a verdict ends with prints its explanation, run as a user runs it."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import stoker
from stoker.doctor import VERDICT_IDS, verdict

STOKER = Path(sys.executable).parent / "stoker"  # the console script pip installed beside this Python


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd, env=dict(os.environ))


def test_the_command_a_verdict_ends_with_prints_its_explanation(pair_ds: stoker.Dataset, tmp_path: Path) -> None:
    with pair_ds.loader(4) as loader:
        stats = loader.stats()
    said = verdict(dataclasses.replace(stats, batches=10, consumer_seconds=0.9, wait_seconds=0.1))
    command = shlex.split(said.rsplit("; see: ", 1)[1])
    assert command == ["stoker", "explain", "consumer-bound"]
    # From a directory with no docs/ in it, as after a pip install.
    proc = _run([str(STOKER), *command[1:]], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "consumer-bound"
    assert lines[2].startswith("    consumer-bound: the pipeline waits on you")
    assert "Nothing in stoker is the limit." in proc.stdout


def test_explain_alone_lists_the_sections(tmp_path: Path) -> None:
    proc = _run([sys.executable, "-m", "stoker", "explain"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [line.strip() for line in proc.stdout.splitlines()[1:]] == list(VERDICT_IDS)


def test_a_wrong_section_is_a_usage_error_naming_the_nearest(tmp_path: Path) -> None:
    proc = _run([str(STOKER), "explain", "storage-bond"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: stoker explain [-h] [SECTION]")
    assert "invalid choice: 'storage-bond'" in proc.stderr
    assert proc.stderr.rstrip().endswith("did you mean storage-bound?")
