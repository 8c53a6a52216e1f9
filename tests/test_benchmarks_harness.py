"""benchmarks/harness.py: real child processes with known figures, the tables and results files they make."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from stoker.cli.sample import cached_sample

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_harness() -> ModuleType:
    """benchmarks/harness.py by its path: benchmarks/ is a folder of scripts (one is ray.py), so it must
    not go on sys.path, where it would shadow packages of the same names for the rest of the session."""
    spec = importlib.util.spec_from_file_location("stoker_benchmarks_harness", BENCHMARKS / "harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


harness = _load_harness()

# A contender's child: appends its name to a log (the order the processes really ran in), then
# prints noise and the figures it was given, or fails with a long stderr.
CHILD = """
import json, sys
name, log, records = sys.argv[1], sys.argv[2], float(sys.argv[3])
with open(log, "a") as f:
    f.write(name + "\\n")
if name == "broken":
    sys.stderr.write("x" * 3000 + "\\nthe end of the broken contender's traceback\\n")
    sys.exit(3)
if name == "silent":
    sys.exit(0)
if name == "slow":
    import time
    time.sleep(30)
print("noise first")
print(json.dumps({"records": records, "seconds": 2.0, "bytes_read": records * 10}))
"""


@pytest.fixture
def child(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    yield script, tmp_path / "ran.log"


def _runner(child: tuple[Path, Path], figures: dict[str, list[float]]) -> Any:
    """run(name) for alternate(): the next of the contender's known figures, through a real child."""
    script, log = child
    left = {name: iter(values) for name, values in figures.items()}

    def run(name: str) -> harness.Run:
        return harness.child_json(name, [str(script), name, str(log), str(next(left[name], 0.0))], timeout=60)

    return run


def test_alternate_runs_every_contender_once_a_round_reversed_every_other_round(child: tuple[Path, Path]) -> None:
    figures = {"a": [1, 2, 3], "b": [1, 2, 3], "c": [1, 2, 3]}
    rounds = harness.alternate(["a", "b", "c"], 3, _runner(child, figures), show=None)
    expected = ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [name for _, name in rounds.order] == expected
    assert [r for r, _ in rounds.order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert child[1].read_text().split() == expected  # the processes ran in that order
    assert rounds.rounds == 3 and [r["records"] for r in rounds.ok("c")] == [1, 2, 3]


def test_medians_spreads_and_per_round_ratios_from_known_child_outputs(child: tuple[Path, Path]) -> None:
    figures = {"base": [100, 200, 200], "fast": [200, 300, 600], "other": [50, 400, 100]}
    rounds = harness.alternate(list(figures), 3, _runner(child, figures), show=None)
    # The child reports records over 2 seconds: records/s is half of each figure.
    assert rounds.values("fast") == [100.0, 150.0, 300.0]
    assert rounds.spread("fast") == harness.Spread(150.0, 100.0, 300.0)
    assert rounds.values("fast", "mb_per_s") == [pytest.approx(x * 10 / 1e6) for x in (100, 150, 300)]
    assert rounds.ratios("fast", "base") == [2.0, 1.5, 3.0]
    # Against the best of several baselines in each round: base, other (400 > 200), base.
    assert rounds.ratios("fast", ["base", "other"]) == [2.0, 0.75, 3.0]
    assert harness.Spread.of(rounds.ratios("fast", "base")).text() == "2.00 (1.50..3.00)"


def test_summary_and_ratio_tables_render_medians_failures_and_labels(child: tuple[Path, Path]) -> None:
    figures = {"base": [100, 200], "fast": [300, 500], "broken": [1, 1]}
    rounds = harness.alternate(list(figures), 2, _runner(child, figures), keep_going=True, show=None)
    assert rounds.runs["broken"] == [None, None]
    summary = harness.summary_table(rounds, columns={"MB/s": harness.median_of("mb_per_s", "{:.4f}")})
    assert summary.splitlines() == [
        "| contender | records/s median | min | max | MB/s |",
        "|---|---:|---:|---:|---:|",
        "| base | 75 | 50 | 100 | 0.0008 |",
        "| fast | 200 | 150 | 250 | 0.0020 |",
        "| broken | failed |  |  |  |",
    ]
    ratios = harness.ratio_table(rounds, [("fast", "base"), ("fast", "base", "fast over base"), ("broken", "base")])
    assert ratios.splitlines() == [
        "| ratio (per round, same round) | median | min | max |",
        "|---|---:|---:|---:|",
        "| fast / base | 2.75 | 2.50 | 3.00 |",
        "| fast over base | 2.75 | 2.50 | 3.00 |",
    ]  # no round where the broken contender ran: no row
    versus = harness.versus_table(rounds, [("rate", "fast", "base", "records_per_s")], ["", "old", "new", "new/old"])
    assert versus.splitlines()[2] == "| rate | 75.00 | 200.00 | 2.75 (2.50..3.00) |"


def test_results_file_has_the_command_and_machine_and_the_history_keeps_every_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    body = "| contender | records/s median |\n|---|---:|\n| a | 1 |\n"
    path = harness.write_results("demo", "Demo run", body, script="/x/benchmarks/demo.py", out=out,
                                 argv=["--rounds", "3", "--only", "a b"], frameworks=["numpy"], now=0.0)  # fmt: skip
    assert path == out / "demo.md"
    text = path.read_text()
    assert text.startswith("# Demo run\n\nCommand: `python benchmarks/demo.py --rounds 3 --only 'a b'`\n\nMachine: ")
    machine = text.split("Machine: ", 1)[1].splitlines()[0]
    assert "cores" in machine and "GiB RAM" in machine and "Python 3." in machine and "numpy 2." in machine
    assert text.endswith(body)
    harness.write_results("demo", "Second run", body.replace("| 1 |", "| 2 |"), script="demo.py", out=out,
                          argv=[], now=86400.0 * 365)  # fmt: skip
    latest = (out / "demo.md").read_text()
    assert "Second run" in latest and "Demo run" not in latest and "| a | 2 |" in latest
    history = (out / "demo_history.md").read_text()
    assert history.startswith("# History of `python benchmarks/demo.py` runs\n")
    assert history.index("## 1970-01-01 00:00 UTC: Demo run") < history.index("## 1971-01-01 00:00 UTC: Second run")
    assert history.count("| a | 1 |") == 1 and history.count("| a | 2 |") == 1 and history.count("Command: ") == 2


def test_a_failing_child_names_its_contender_and_carries_the_end_of_its_stderr(child: tuple[Path, Path]) -> None:
    script, log = child
    with pytest.raises(harness.ChildFailed) as e:
        harness.child_json("W1 broken", [str(script), "broken", str(log), "1"])
    message = str(e.value)
    assert message.startswith("benchmark child 'W1 broken' failed (exit status 3):\n")
    assert message.endswith("the end of the broken contender's traceback\n")
    assert e.value.contender == "W1 broken" and e.value.returncode == 3
    assert len(e.value.stderr_tail) == harness.STDERR_TAIL < 3000  # its end, not all of it
    # Without keep_going the first failure stops the rounds.
    with pytest.raises(harness.ChildFailed, match="'broken'"):
        harness.alternate(["ok", "broken"], 2, _runner(child, {"ok": [1, 1], "broken": [1, 1]}), show=None)
    assert log.read_text().split() == ["broken", "ok", "broken"]


def test_a_child_without_json_or_past_its_timeout_fails_with_its_name(child: tuple[Path, Path]) -> None:
    script, log = child
    with pytest.raises(harness.ChildFailed, match=r"(?s)'silent'.*no JSON object"):
        harness.child_json("silent", [str(script), "silent", str(log), "1"])
    with pytest.raises(harness.ChildFailed, match=r"(?s)'slow'.*killed after 1 s"):
        harness.child_json("slow", [str(script), "slow", str(log), "1"], timeout=1)


def test_time_batches_times_the_steady_state_only_and_runs_the_consumer_s_step() -> None:
    made: list[float] = []

    def batches() -> Iterator[dict[str, np.ndarray]]:  # batches of 4 records, 10 ms apart
        while True:
            time.sleep(0.01)
            made.append(time.perf_counter())
            yield {"x": np.zeros(4), "y": np.zeros(4)}

    steps, synced = [], []
    began = time.perf_counter()
    time_batches = harness.time_batches
    out = time_batches(batches(), 0.1, warmup=0.15, began=began, step=lambda: steps.append(1), sync=synced.append)
    assert out["records"] % 4 == 0 and 0.1 <= out["seconds"] < 0.2
    untimed = len(made) - out["records"] // 4
    # Untimed: the first batch and those asked for within the warm-up (each made 10 ms after
    # it was asked for); timed: every one after them, all made once the warm-up was over.
    assert untimed >= 2 and all(t < began + 0.15 + 0.01 + 0.005 for t in made[:untimed])
    assert out["records"] > 0 and all(t >= began + 0.15 for t in made[untimed:])
    assert len(synced) == 2  # before the clock starts and before it stops
    assert len(steps) == len(made) - 1  # after every batch but the first


def _script(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=120, check=False, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_normalize_kernel_script_writes_its_table_and_history(tmp_path: Path) -> None:
    _script("normalize_kernel.py", "--rounds", "2", "--calls", "1", "--out", str(tmp_path))
    text = (tmp_path / "normalize_kernel.md").read_text()
    assert "Command: `python benchmarks/normalize_kernel.py --rounds 2 --calls 1 --out " in text
    assert "| chain | us per call median | min | max | records |" in text
    assert "| w1 normalize+flip float16 | " in text and "| rgb normalize+flip / rgb cast | " in text
    assert (tmp_path / "normalize_kernel_history.md").read_text().count("| rgb cast | ") == 1


def test_raw_copy_script_writes_its_table_and_ratios_to_mmap(tmp_path: Path) -> None:
    data = cached_sample(tmp_path / "sample", pairs=1, records=512)
    _script("raw_copy.py", "--rounds", "2", "--seconds", "0.05", "--data", str(data), "--out", str(tmp_path))
    text = (tmp_path / "raw_copy.md").read_text()
    for row in ("| mmap | ", "| pread 64 KiB | ", "| pread 64 KiB / mmap | ", "| pread 1024 KiB / mmap | "):
        assert row in text
    assert (tmp_path / "raw_copy_history.md").exists()


def test_ray_script_writes_whole_pass_rates_and_the_consumer_floor_to_a_table_named_by_its_records(
    tmp_path: Path,
) -> None:
    """benchmarks/ray.py end to end on a small sample (a real local Ray cluster in its children): W1's
    layout with 256 records a file goes to ray-256.md, beside the local loader, with the consumer's
    floor (blocks already in the object store) and every record of each pass counted."""
    floor = "ray floor: iterate blocks already in the object store"
    _script("ray.py", "--rounds", "1", "--seconds", "0.1", "--records", "256", "--only", floor, "--out", str(tmp_path),
            env={**os.environ, "STOKER_CACHE": str(tmp_path / "cache")})  # fmt: skip
    text = (tmp_path / "ray-256.md").read_text()
    assert "# Ray Data vs the local loader, W1's layout with 256 records a file (" in text
    assert "| contender | steady records/s median | min | max | whole passes, records/s |" in text
    assert f"| {floor} / local, steady records/s | " in text and f"| {floor} / local, whole passes | " in text
    assert "2 GiB object store" in text and not (tmp_path / "ray.md").exists()
    assert (tmp_path / "ray-256_history.md").read_text().count(f"| {floor} | ") == 1


@pytest.mark.remote
def test_manifest_script_counts_each_rank_s_requests_with_and_without_the_manifest(tmp_path: Path) -> None:
    """benchmarks/manifest.py end to end, small: its own SeaweedFS, two ranks per contender."""
    _script("manifest.py", "--pairs", "12", "--ranks", "2", "--out", str(tmp_path))
    text = (tmp_path / "manifest.md").read_text()
    assert "Command: `python benchmarks/manifest.py --pairs 12 --ranks 2 --out " in text
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():  # the per-rank table's rows (the first of each name)
        cells = line.strip("| ").split(" | ")
        rows.setdefault(cells[0], cells)
    assert rows["manifest"][6] == "1"  # requests to build and count: the manifest's GET
    assert int(rows["listing"][6].replace(",", "")) >= 12 * 2 * 3  # an info and two GETs per object at least
    assert (tmp_path / "manifest_history.md").exists()
