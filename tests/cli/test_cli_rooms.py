"""The command in rooms: a module per command owning its arguments, none of them large, and the
entry points others use (`stoker.cli.main`, `build_parser`, `python -m stoker.cli.bench`) kept."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.cli import build_parser, main
from tests.helpers import REPO

CLI = REPO / "src" / "stoker" / "cli"


def test_no_module_of_the_command_is_over_400_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in CLI.glob("*.py")}
    assert {"main.py", "config.py", "sample.py", "inspect.py", "index.py", "bench.py"} <= set(sizes)
    assert max(sizes.values()) <= 400, sizes


@pytest.mark.parametrize("command", ["sample", "inspect", "index", "bench"])
def test_each_command_is_a_module_that_declares_its_arguments_and_runs_them(command: str) -> None:
    module = importlib.import_module(f"stoker.cli.{command}")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[attr-defined]
    assert sub.get_default("run") is module.run
    assert sub.format_help().startswith(f"usage: stoker {command} ")


def test_the_bench_child_runs_as_before(tmp_path: Path) -> None:
    """`python -m stoker.cli.bench CONTENDER JSON` (benchmarks/harness.py runs children so) prints
    its figures, and nothing on stderr (no module loaded twice)."""
    assert main(["sample", str(tmp_path), "--pairs", "1", "--records", "64", "--inrez", "8"]) == 0
    cfg = {"paths": [str(tmp_path / "img_0000.bin")], "header": 0, "shape": [8, 8, 1], "src_dtype": "|i1",
           "out_dtype": "float32", "batch": 16, "loop": "mmap_kept", "threads": 1, "seconds": 0.05}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for module in ("stoker.cli.bench", "stoker.cli.contenders"):
        proc = subprocess.run([sys.executable, "-m", module, "ceiling", json.dumps(cfg)], capture_output=True,
                              text=True, timeout=60, env=env, check=False)  # fmt: skip
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert json.loads(proc.stdout.splitlines()[-1])["records"] > 0
