"""Closing a loader has a deadline (stoker.engine.executor.SHUTDOWN_SECONDS): a Ctrl-C reaches the caller
within seconds even while a worker is stuck, and a FIFO put where a file was never blocks a worker.

The loaders run in a child process (tests/helpers/stuck_work.py) that this test interrupts with SIGINT,
as a terminal's Ctrl-C would; every wait here is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stoker
from stoker.engine.executor import SHUTDOWN_SECONDS
from tests.helpers import HELPERS

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(stoker.__file__).parents[1]), str(HELPERS)])}
# What a Ctrl-C may take to reach the caller: the deadline, the consumer's poll (0.5 s) and a
# loaded machine's slack.
WITHIN = SHUTDOWN_SECONDS + 3.0


def _interrupt(tmp_path: Path, how: str, workers: str, presses: int) -> tuple[float, str, str]:
    """(seconds from the first SIGINT to the child saying it caught it, its stdout, its stderr)."""
    child = subprocess.Popen(
        [sys.executable, str(HELPERS / "stuck_work.py"), "interrupt", str(tmp_path / "data"), how, workers],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "iterating"
        time.sleep(1.0)  # the workers are in the transform now
        sent = time.monotonic()
        for _ in range(presses):
            child.send_signal(signal.SIGINT)
            time.sleep(0.3)
        caught = child.stdout.readline().strip()
        took = time.monotonic() - sent
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    return took, caught + out, err


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
@pytest.mark.parametrize("how", ["sleep", "read"])
def test_ctrl_c_reaches_the_caller_within_seconds_while_a_worker_thread_is_stuck(
    tmp_path: Path, how: str, presses: int
) -> None:
    took, out, err = _interrupt(tmp_path, how, "thread", presses)
    assert out.startswith("KeyboardInterrupt"), out
    assert took < WITHIN, f"the Ctrl-C took {took:.1f} s to reach the caller"
    # The stuck workers are named and left behind (daemon threads: the interpreter exits regardless).
    assert "left running as daemon threads" in err and "stoker-worker-" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sleep", "read"])
def test_ctrl_c_reaches_the_caller_within_seconds_while_a_worker_process_is_stuck(tmp_path: Path, how: str) -> None:
    took, out, _ = _interrupt(tmp_path, how, "process", 1)
    assert out.startswith("KeyboardInterrupt"), out
    assert took < WITHIN, f"the Ctrl-C took {took:.1f} s to reach the caller"


@pytest.mark.parametrize("kind", ["raw", "gzip"])
def test_a_fifo_put_where_a_file_was_fails_its_batch_instead_of_blocking_the_worker(tmp_path: Path, kind: str) -> None:
    done = subprocess.run(
        [sys.executable, str(HELPERS / "stuck_work.py"), "fifo", str(tmp_path / "data"), kind], env=ENV,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["error"] == "ReadError", got
    assert got["path"].endswith("img_2.bin" + (".gz" if kind == "gzip" else "")), got
    assert "img_2.bin" in got["message"] and "not a regular file (a FIFO)" in got["message"], got
    assert got["delivered"] == 80  # groups 0 and 1, read before it
