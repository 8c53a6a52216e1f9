"""`stoker bench --step`: accelerator utilization, cores and CPU-seconds per GB under an emulated
training step, checked against fake loaders of known cost, and the command end to end."""

from __future__ import annotations

import builtins
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker.cli.ceiling
import stoker.cli.contenders
from stoker.cli import main
from stoker.cli.ceiling import drop_page_cache, run_ceiling
from stoker.cli.contenders import Measurement, _run_stoker, burn
from stoker.cli.steps import Stepped, handoff, parse_steps, smallest_step, take
from stoker.doctor import step_verdict
from stoker.errors import SpecError

RECORDS = 8  # records per fake batch
RECORD_BYTES = 1000


def _slow_loader(sleep: float = 0.0, cpu: float = 0.0) -> Iterator[np.ndarray]:
    """A loader whose every batch costs `sleep` seconds of waiting and `cpu` seconds on the CPU,
    made only when asked for (no prefetch): the step waits for all of it."""
    while True:
        if sleep:
            time.sleep(sleep)
        if cpu:
            burn(cpu)
        yield np.zeros(RECORDS)


def _take(batches: Iterator[Any], step: float, kind: str = "sleep") -> Stepped:
    return take(batches, seconds=0.3, step=step, kind=kind, rows=len, record_bytes=RECORD_BYTES)


def test_au_is_the_share_of_the_wall_time_spent_in_the_step_and_the_rest_is_the_wait() -> None:
    # Batches of 4 ms made on demand, a step of 2 ms: a sleep never ends early, so each batch
    # waited 4 ms or more and each step took 2 ms or more.
    s = _take(_slow_loader(sleep=0.004), step=0.002)
    k = s.batches
    assert k >= 2 and s.records == k * RECORDS and s.bytes_read == k * RECORDS * RECORD_BYTES
    assert s.wait_seconds >= 0.004 * k and s.step_seconds >= 0.002 * k
    assert s.utilization == s.step_seconds / s.seconds and s.wait_fraction == s.wait_seconds / s.seconds
    # Step and wait are the loop; what is left is its bookkeeping.
    assert 0.9 * s.seconds <= s.step_seconds + s.wait_seconds <= s.seconds
    # Waiting 4 ms or more a batch, the accelerator is busy no more than its steps over steps and waits.
    assert s.utilization <= s.step_seconds / (s.step_seconds + 0.004 * k) < 0.6
    assert s.records_per_s == s.records / s.seconds
    assert s.wait_per_batch == s.wait_seconds / k


def test_a_loader_ahead_of_the_step_keeps_it_busy() -> None:
    s = _take(_slow_loader(), step=0.02)
    assert s.utilization > 0.9 and s.wait_fraction < 0.1


def test_cpu_figures_count_the_loader_s_cpu_and_not_a_cpu_step_s() -> None:
    # The loader burns 1 ms of CPU per batch, the step spins 3 ms: with the step's CPU counted,
    # the figure would be 4 ms a batch or more.
    s = _take(_slow_loader(cpu=0.001), step=0.003, kind="cpu")
    k = s.batches
    assert s.step_seconds >= 0.003 * k
    assert 0.001 * k <= s.cpu_seconds < 0.0025 * k
    assert s.cores == s.cpu_seconds / s.seconds
    assert s.cpu_seconds_per_gb == pytest.approx(s.cpu_seconds / (k * RECORDS * RECORD_BYTES / 1e9))


def test_the_figures_of_a_window_are_the_arithmetic_of_its_timings() -> None:
    s = Stepped(batches=100, records=25_600, seconds=2.0, step_seconds=1.8, wait_seconds=0.15, cpu_seconds=0.5,
                bytes_read=2 * 10**9)  # fmt: skip
    assert s.utilization == pytest.approx(0.9) and s.wait_fraction == pytest.approx(0.075)
    assert s.wait_per_batch == pytest.approx(0.0015) and s.records_per_s == pytest.approx(12_800)
    assert s.cores == pytest.approx(0.25) and s.cpu_seconds_per_gb == pytest.approx(0.25)
    assert Stepped.from_dict(s.to_dict()) == s
    assert s.to_dict()["wait_ms_per_batch"] == pytest.approx(1.5)


def _au(step: float, batch: float, hand: float) -> float:
    return step / (step + max(0.0, batch - step) + hand)


@pytest.mark.parametrize(("batch", "hand"), [(0.001, 0.00001), (0.0003, 0.000044), (0.005, 0.0), (0.0, 0.0001)])
@pytest.mark.parametrize("target", [0.9, 0.99])
def test_the_smallest_step_is_where_the_model_s_au_reaches_the_target(batch: float, hand: float, target: float) -> None:
    s = smallest_step(batch, [(0.002, hand)], target)
    assert _au(s, batch, hand) == pytest.approx(target)
    assert _au(s * 0.98, batch, hand) < target


def test_the_smallest_step_in_both_regimes_by_hand() -> None:
    # The step shorter than the batch: AU = s / (batch + hand), so s = 0.9 x 1.01 ms.
    assert smallest_step(0.001, [(0.005, 0.00001)], 0.9) == pytest.approx(0.000909)
    # The step longer than the batch: AU = s / (s + hand), so s = 99 x hand.
    assert smallest_step(0.0003, [(0.02, 0.000044)], 0.99) == pytest.approx(0.004356)
    with pytest.raises(ValueError, match="utilization=1"):
        smallest_step(0.001, [(0.001, 0.0)], 1)
    with pytest.raises(ValueError, match="no handoff measured"):
        smallest_step(0.001, [], 0.9)


def test_the_handoff_is_interpolated_between_the_steps_measured() -> None:
    # 22.5 us at 2 ms, 35 us at 5 ms: 99% busy where s / 99 = h(s), at 2.39 ms, between them.
    hands = [(0.005, 0.000035), (0.002, 0.0000225), (0.02, 0.00008)]
    s = smallest_step(0.00073, hands, 0.99)
    assert s == pytest.approx(0.0023876, rel=1e-3)
    assert _au(s, 0.00073, 0.0000225 + (s - 0.002) * 0.0000125 / 0.003) == pytest.approx(0.99)


def test_the_handoff_is_the_loop_s_other_time_less_the_step_s_shortfall_on_the_loader() -> None:
    assert handoff(0.001, 0.005, 0.00004) == pytest.approx(0.00004)  # ahead: all of it
    assert handoff(0.003, 0.001, 0.00205) == pytest.approx(0.00005)  # 2 ms of it is the shortfall
    assert handoff(0.003, 0.001, 0.001) == 0.0


def test_steps_parse_as_positive_milliseconds() -> None:
    assert parse_steps("1,2,5,20") == [1, 2, 5, 20]
    assert parse_steps("0.5,2,2") == [0.5, 2]
    for bad in ("0", "2,-1", "a", "inf", "1,,2"):
        with pytest.raises(SpecError, match="is not a positive number of milliseconds"):
            parse_steps(bad)


def test_a_step_verdict_says_the_wait_and_the_cores_left() -> None:
    fed = step_verdict(20, 0.987, 0.011, 0.35, 2)
    assert fed.startswith("your step of 20 ms would wait 1.1% of the time (the accelerator busy 98.7%")
    assert "stoker used 0.35 of 2 cores, leaving 1.65 free" in fed
    assert fed.endswith("; see: stoker explain step-fed")
    starved = step_verdict(1, 0.74, 0.25, 1.6, 2)
    assert starved.startswith("your step of 1 ms would wait 25% of the time (the accelerator busy 74%")
    assert "leaving 0.40 free" in starved and starved.endswith("; see: stoker explain step-starved")


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    assert main(["sample", str(tmp_path / "s"), "--pairs", "2", "--records", "256", "--inrez", "16"]) == 0
    return tmp_path / "s"


def test_the_stepped_ceiling_loop_takes_its_batches_with_the_step(sample: Path) -> None:
    paths = [str(p) for p in sorted(sample.glob("img_*.bin"))]
    cfg = {"paths": paths, "header": 0, "shape": [16, 16, 1], "src_dtype": "|i1", "out_dtype": "<f4", "batch": 64,
           "loop": "stepped", "threads": 2, "seconds": 0.2, "warmup": 0.05, "step_ms": 2}  # fmt: skip
    out = run_ceiling(cfg)
    s = Stepped.from_dict(out["stepped"])
    assert s.batches >= 2 and s.records == out["records"] and s.records <= 64 * s.batches
    assert s.step_seconds >= 0.002 * s.batches and 0 < s.utilization <= 1
    assert out["bytes_read"] == s.records * 256 and out["evicted"] is None


def test_bench_step_prints_au_cores_and_a_step_verdict(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", str(sample), "--step", "2", "--rounds", "1", "--seconds", "0.3", "--warmup", "0.1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "\nstoker step=2ms " in out and "\nceiling:stepped step=2ms " in out
    assert "\n     2ms stoker " in out and "\n     2ms ceiling " in out
    assert "stoker keeps a step of " in out
    said = [line for line in out.splitlines() if line.startswith("verdict: your step of 2 ms would wait ")]
    assert len(said) == 1 and "stoker used " in said[0]


def test_bench_step_json_carries_every_figure(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", str(sample), "--step", "1,2,5,20", "--json", "--rounds", "1", "--seconds", "0.3", "--warmup", "0"]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0
    figures = json.loads(captured.out)  # stdout is the JSON alone; the table went to stderr
    assert "stoker keeps a step of " in captured.err
    assert [r["step_ms"] for r in figures["steps"]] == [1, 2, 5, 20]
    for row in figures["steps"]:
        for who in ("stoker", "ceiling"):
            f = row[who]
            assert 0 < f["utilization"] <= 1 and f["utilization"] == pytest.approx(f["step_seconds"] / f["seconds"])
            assert f["cores"] == pytest.approx(f["cpu_seconds"] / f["seconds"])
            assert f["cpu_seconds_per_gb"] == pytest.approx(f["cpu_seconds"] / (f["bytes_read"] / 1e9))
            assert f["step_seconds"] >= row["step_ms"] / 1000 * f["batches"]
    small = figures["smallest_step_ms"]
    assert 0 < small["au_90"] <= small["au_99"] and small["batch_ms"] > 0
    assert len(figures["step_verdicts"]) == 4 and figures["verdict"]
    assert figures["contenders"]["stoker"]["records_per_s"][0] > 0 and figures["cold"] is None


def _refused(path: Any, *a: Any, **kw: Any) -> Any:
    if str(path) == "/proc/sys/vm/drop_caches":
        raise PermissionError(13, "Permission denied")
    return builtins.open(path, *a, **kw)


def test_cold_drops_the_page_cache_where_it_may_and_says_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 8192)
    wrote: list[str] = []

    class Proc:
        def __init__(self, path: str, mode: str) -> None:
            assert path == "/proc/sys/vm/drop_caches" and mode == "w"

        def __enter__(self) -> Proc:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def write(self, s: str) -> None:
            wrote.append(s)

    monkeypatch.setattr(stoker.cli.ceiling, "open", Proc, raising=False)
    assert drop_page_cache([str(f)]).startswith("drop_caches: /proc/sys/vm/drop_caches") and wrote == ["1"]
    monkeypatch.setattr(stoker.cli.ceiling, "open", _refused, raising=False)
    said = drop_page_cache([str(f)])
    assert said == "fadvise: posix_fadvise(DONTNEED) on each file (not /proc/sys/vm/drop_caches: Permission denied)"
    gone = str(tmp_path / "gone.bin")
    said = drop_page_cache([gone])
    assert said.startswith("could not drop the page cache: /proc/sys/vm/drop_caches: Permission denied;")
    assert gone in said


def test_bench_cold_reports_how_the_cache_was_dropped(
    sample: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # In this process, so that the cache dropped is never the whole machine's (as root it would be).
    monkeypatch.setattr(stoker.cli.ceiling, "open", _refused, raising=False)

    def here(contender: str, cfg: dict[str, Any]) -> Measurement:
        out = _run_stoker(cfg) if contender == "stoker" else run_ceiling(cfg)
        fields = {f.name for f in dataclasses.fields(Measurement)} - {"contender"}
        return Measurement(contender, **{k: v for k, v in out.items() if k in fields})

    monkeypatch.setattr(stoker.cli.contenders, "run_child", here)
    argv = ["bench", str(sample), "--cold", "--step", "2", "--json", "--rounds", "1", "--seconds", "0.2",
            "--warmup", "0"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    figures = json.loads(captured.out)
    assert figures["cold"].startswith("fadvise: posix_fadvise(DONTNEED) on each file")
    assert "cold: page cache dropped before each run by fadvise: " in captured.err


def test_bench_cold_reads_the_files_once_per_run_with_no_warm_up(
    sample: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm-up would read the cold pass before the window, and a second pass would read from
    memory: every cold contender, stepped ones included, times one pass after its first batch."""
    monkeypatch.setattr(stoker.cli.ceiling, "open", _refused, raising=False)
    runs: list[Measurement] = []

    def here(contender: str, cfg: dict[str, Any]) -> Measurement:
        out = _run_stoker(cfg) if contender == "stoker" else run_ceiling(cfg)
        fields = {f.name for f in dataclasses.fields(Measurement)} - {"contender"}
        runs.append(Measurement(contender, **{k: v for k, v in out.items() if k in fields}))
        return runs[-1]

    monkeypatch.setattr(stoker.cli.contenders, "run_child", here)
    argv = ["bench", str(sample), "--cold", "--step", "2", "--json", "--rounds", "1", "--seconds", "10",
            "--warmup", "1", "--batch-size", "32"]  # fmt: skip
    assert main(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    total = 2 * 256
    assert len(runs) == 6  # stoker, stoker stepped, three ceiling loops, the stepped ceiling
    for m in runs:
        assert 0 < m.records <= total, f"{m.contender} read {m.records} records of {total} in one cold run"
        assert m.seconds < 10, f"{m.contender} ran its whole window ({m.seconds:.1f}s), not one pass"
    assert figures["verdict"].endswith("read more or larger files, or give a smaller --batch-size")


def test_bench_refuses_a_step_that_is_not_a_positive_number_and_step_with_compare(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--step", "2,0"]) != 0
    assert "--step '2,0': '0' is not a positive number of milliseconds" in capsys.readouterr().err
    assert main(["bench", "--compare", "--step", "2"]) != 0
    assert "--step, --cold and --json measure stoker against its ceiling" in capsys.readouterr().err
