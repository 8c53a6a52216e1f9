"""A raw file cut short while stoker copies from its memory map: a CorruptDataError naming the
file, never a SIGBUS that kills the process (stoker/_kernels.c's guard, stoker.kernels).

Passes run in a child process (tests/helpers/cut_under_map.py), so a SIGBUS is seen as the child dying.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from stoker import kernels
from tests.helpers import HELPERS

SRC = Path(stoker.__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


def _child(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HELPERS / "cut_under_map.py"), *args], env=ENV, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _died(done: subprocess.CompletedProcess[str]) -> str:
    return f"the child ended with {done.returncode} (-7: SIGBUS); stderr: {done.stderr[-3000:]}"


SCENARIOS = [
    "one run, cast",  # the compiled cast from the map (cast_into)
    "many runs, cast",  # a batch's runs of many files in one gather_runs
    "strided run, cast",  # a shard's every other record: gather_runs with a stride
    "one run, numpy's cast",  # int32 into float64: copied out of the map by the kernel, numpy casts the copy
    "one run, fused transform",  # Normalize computed as the records are read (the normalize kernel)
    "one run, fused Cast, numpy's cast",  # a lone Cast as the records are read, int32 by numpy
    "kept map, copy",  # the second epoch's plain copy from the map kept from the first
    "kept map, numpy's copy",  # int32, which the cast kernels do not read: copied as bytes
    "global shuffle, cast",  # gather_records over the files' maps
    "global shuffle, numpy's cast",
    "ds.read, cast",  # random access (stoker.access)
    "ds.read, numpy's cast",
    # Without the compiled kernels numpy never reads a map: records are read with pread.
    "one run, cast, no kernels",
    "many runs, cast, no kernels",
    "strided run, cast, no kernels",
    "kept map, copy, no kernels",
    "global shuffle, cast, no kernels",
    "ds.read, numpy's cast, no kernels",
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_file_cut_between_its_size_check_and_the_copy_is_a_corrupt_data_error_naming_it(
    tmp_path: Path, scenario: str
) -> None:
    done = _child("scenario", scenario, str(tmp_path / "data"))
    assert done.returncode == 0, _died(done)
    got: dict[str, Any] = json.loads(done.stdout)
    assert got["victim"] in got["paths"], "the size check was never wrapped: the scenario cut nothing"
    assert got["error"] == "CorruptDataError", got
    assert got["path"] == got["victim"] and os.path.basename(got["victim"]) in got["message"], got
    assert got["fault"], f"the copy never faulted (its check caught the cut first): {got}"
    assert got["bad"] == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kernels", "nokernels"])
@pytest.mark.parametrize("order", ["sequential", "global"])
def test_files_truncated_at_random_moments_of_a_pass_never_crash_it(tmp_path: Path, order: str, kind: str) -> None:
    """40 passes, each over fresh files a thread cuts to random sizes at a random moment: every
    pass ends whole, with every record right, or in a CorruptDataError naming a cut file (a cut
    inside a page reads as zeros there without a fault, which only the size after a read shows)."""
    done = _child("runs", order, kind, "40", str(tmp_path), timeout=300)
    assert done.returncode == 0, _died(done)
    got = json.loads(done.stdout)
    assert got["runs"] == 40 and got["whole"] + got["corrupt"] == 40
    assert got["bad"] == []


def _cut_map(tmp_path: Path, nbytes: int = 1 << 16) -> tuple[Any, int]:
    """A FileMap of ``nbytes`` of int8 records whose file is then truncated to 0 bytes."""
    path = tmp_path / "cut.bin"
    np.arange(nbytes, dtype=np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = kernels.map_file(fd, nbytes)
    finally:
        os.close(fd)
    os.truncate(path, 0)
    return mapped, kernels.map_address(mapped)


def _kernel_reads(kind: str, mapped: Any, at: int, n: int) -> None:
    src = np.frombuffer(mapped, np.uint8)
    if kind == "cast int8 to float32":
        kernels.cast_mapped(np.empty(n, np.float32), src.view(np.int8))
    elif kind == "copy":
        kernels.cast_mapped(np.empty(n, np.uint8), src)
    elif kind == "cast int16 to float16":
        kernels.cast_mapped(np.empty(n // 2, np.float16), src.view(np.int16))
    elif kind == "cast float32 to bfloat16":
        import ml_dtypes

        kernels.cast_mapped(np.empty(n // 4, ml_dtypes.bfloat16), src.view(np.float32))
    elif kind == "widen bfloat16 to float32":
        import ml_dtypes

        kernels.cast_mapped(np.empty(n // 2, np.float32), src.view(ml_dtypes.bfloat16))
    elif kind == "gather_records":
        kernels.gather_records(np.empty((4, 64), np.float32), np.arange(4), at + np.arange(4) * 64, np.dtype(np.int8))
    elif kind == "gather_runs":
        kernels.gather_runs(np.empty((8, 64), np.float32), [0, at, 4, 128, 4, at + 4096, 4, 64], np.dtype(np.int8))
    elif kind == "copy_records":
        kernels.copy_records(np.empty((2, 64), np.uint8), -1, at, np.array([0, 4096]))


KERNEL_READS = [
    "cast int8 to float32", "copy", "cast int16 to float16", "cast float32 to bfloat16", "widen bfloat16 to float32",
    "gather_records", "gather_runs", "copy_records",
]  # fmt: skip


@pytest.mark.parametrize("kind", KERNEL_READS)
def test_a_kernel_reading_a_map_past_its_files_end_raises_map_fault_where(tmp_path: Path, kind: str) -> None:
    assert kernels.compiled(), "stoker._kernels was not built: run `pip install -e .`"
    mapped, at = _cut_map(tmp_path)
    for _ in range(2):  # the guard is set again after a fault
        try:
            _kernel_reads(kind, mapped, at, 1 << 16)
        except kernels.MapFault as e:
            fault = (e.address, e.errno, str(e))  # type: ignore[attr-defined]
            e.__traceback__ = None  # its frames hold views of the map, which then could not be closed
        else:
            pytest.fail(f"{kind}: no MapFault")
        assert at <= fault[0] < at + (1 << 16) and fault[1] == 5 and "bus error" in fault[2], fault
    # Memory that is there is read as before, in the same thread.
    got = np.empty(4, np.float32)
    assert kernels.cast_mapped(got, np.array([1, -2, 3, -4], np.int8)) and got.tolist() == [1, -2, 3, -4]
    mapped.close()


_OUTSIDE = """
import mmap, os, signal, sys
import numpy as np
from stoker import kernels
path = sys.argv[1]
np.zeros(1 << 16, np.uint8).tofile(path)
kernels.guard_maps()  # as stoker does before it maps a file
if sys.argv[2] == "fault":
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 1 << 16, access=mmap.ACCESS_READ)
    os.truncate(path, 0)
    print(int(np.frombuffer(m, np.uint8).sum()))  # numpy's read of the map: no guard
elif sys.argv[2] == "python handler":
    os.kill(os.getpid(), signal.SIGBUS)  # sent to the process: the handler set before stoker's runs
    print("still here")
"""


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_sigbus_outside_the_guard_still_ends_the_process_as_before(tmp_path: Path, faulthandler: bool) -> None:
    pre = ["-X", "faulthandler"] if faulthandler else []
    done = subprocess.run(
        [sys.executable, *pre, "-c", _OUTSIDE, str(tmp_path / "f.bin"), "fault"], env=ENV, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == -signal.SIGBUS, done
    assert ("Fatal Python error: Bus error" in done.stderr) is faulthandler  # faulthandler's own report, chained


def test_a_sigbus_handler_set_before_the_guard_still_gets_signals_sent_to_the_process(tmp_path: Path) -> None:
    script = "import signal\nsignal.signal(signal.SIGBUS, lambda *a: print('python handler'))\n" + _OUTSIDE
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "f.bin"), "python handler"], env=ENV, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done
    assert done.stdout.split() == ["python", "handler", "still", "here"]


# A handler set over the guard's after stoker installed it: faulthandler.enable(), or the one
# Ray's C++ runtime installs when ray.init() starts it. The next file mapped puts the guard back in
# front; a fault outside any kernel still reaches the later handler, then ends the process.
_SET_LATER = """
import faulthandler, json, os, sys
import numpy as np
from stoker import kernels
path, later = sys.argv[1], sys.argv[2]
kernels.guard_maps()
if later == "faulthandler":
    faulthandler.enable()
else:
    import ray
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
np.zeros(1 << 16, np.uint8).tofile(path)
fd = os.open(path, os.O_RDONLY)
mapped = kernels.map_file(fd, 1 << 16)
os.close(fd)
os.truncate(path, 0)
try:
    kernels.cast_mapped(np.empty(1 << 16, np.float32), np.frombuffer(mapped, np.int8))
except kernels.MapFault as e:
    print(json.dumps({"address": e.address, "base": kernels.map_address(mapped)}), flush=True)
print(int(np.frombuffer(mapped, np.uint8).sum()), flush=True)  # numpy's read: no guard
"""


@pytest.mark.parametrize("later", ["faulthandler", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_handler_set_after_the_guard_does_not_take_kernel_faults_from_it(tmp_path: Path, later: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SET_LATER, str(tmp_path / "f.bin"), later], env=ENV, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert lines, f"the kernel's fault was not caught: {_died(done)}"
    fault = json.loads(lines[0])
    assert fault["base"] <= fault["address"] < fault["base"] + (1 << 16), fault  # the guard's own report
    # The unguarded read after it: the later handler reports it, then the process dies of it.
    assert len(lines) == 1 and done.returncode == -signal.SIGBUS, _died(done)
    if later == "faulthandler":  # one report: the unguarded read's, none for the kernel's fault
        assert done.stderr.count("Fatal Python error: Bus error") == 1, done.stderr[-3000:]
    else:  # Ray's report names the faulting function: numpy's, never the kernel's
        assert "SIGBUS received" in done.stderr and "k_i8_f32" not in done.stderr, done.stderr[-3000:]
