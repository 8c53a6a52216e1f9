"""stoker.cli.contenders (the children `stoker bench` runs) and `stoker bench`: real child processes on real files."""

from __future__ import annotations

import gzip
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.cli import dataset_from_fields, main
from stoker.cli.ceiling import _Tally
from stoker.cli.contenders import (
    CEILING_LOOPS,
    _drain_until,
    batch_rows,
    burn,
    child_json,
    output_buffer,
    run_child,
)
from stoker.cli.sample import expected_label, write_sample
from stoker.engine.stats import LoaderStats
from tests.helpers import REPO
from tests.helpers.resources import vm_flags


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    main(["sample", str(tmp_path), "--pairs", "2", "--records", "64", "--inrez", "16"])
    return tmp_path


def _fields(d: Path) -> list[dict[str, object]]:
    return [
        {"name": "image", "files": str(d / "img_*.bin"), "dtype": "int8", "shape": [16, 16, 1]},
        {"name": "label", "files": str(d / "out_*.bin.gz"), "dtype": "float32", "compression": "gzip"},
    ]


def test_stoker_child_reports_the_loader_stats_of_its_run(sample: Path) -> None:
    cfg = {"fields": _fields(sample), "batch": 16, "cast": "float32", "seconds": 0.2, "evict": True}
    m = run_child("stoker", cfg)
    assert m.records > 0 and m.stats is not None
    s = LoaderStats.from_dict(m.stats)
    assert s.records == m.records and s.batch_size == 16
    assert s.field_stage_seconds["image"]["read+cast"] > 0


def test_a_busy_consumer_child_is_consumer_bound(sample: Path) -> None:
    cfg = {"fields": _fields(sample), "batch": 16, "cast": "float32", "seconds": 0.3, "busy_ms": 20}
    s = LoaderStats.from_dict(run_child("stoker", cfg).stats or {})
    assert s.consumer_fraction > 0.5


def test_inflate_ceiling_counts_the_records_it_decodes(tmp_path: Path) -> None:
    for g in range(2):
        (tmp_path / f"img_{g}.bin.gz").write_bytes(gzip.compress(np.arange(5 * 64, dtype=np.int8).tobytes()))
    cfg = {"paths": sorted(str(p) for p in tmp_path.glob("*.gz")), "header": 0, "shape": [8, 8], "src_dtype": "|i1",
           "out_dtype": "float32", "batch": 4, "loop": "inflate_cast", "threads": 1, "seconds": 0.05}  # fmt: skip
    m = run_child("ceiling", cfg)
    assert m.records > 0 and m.bytes_read == m.records * 64


@pytest.mark.parametrize("loop", CEILING_LOOPS)
def test_every_raw_ceiling_loop_copies_whole_records_of_every_file(sample: Path, loop: str) -> None:
    paths = sorted(str(p) for p in sample.glob("img_*.bin"))
    cfg = {"paths": paths, "header": 0, "shape": [16, 16, 1], "src_dtype": "|i1", "out_dtype": "float32",
           "batch": 16, "loop": loop, "threads": 2, "seconds": 1.0}  # fmt: skip
    m = run_child("ceiling", cfg)
    # Each thread reads its own files front to back, again and again (mmap_kept: mapped once).
    assert m.records > 2 * 64 and m.bytes_read == m.records * 16 * 16


@pytest.mark.parametrize("out", ["bfloat16", "float32"])
def test_the_ceiling_reads_a_bfloat16_field_and_a_loop_that_fails_says_why(tmp_path: Path, out: str) -> None:
    """A field stored as bfloat16 reaches the ceiling's child by name ('<V2' would make it raw
    bytes, and every loop failed: a ceiling of "no record"); a loop that fails raises in the child."""
    import ml_dtypes

    path = tmp_path / "e_0.bin"
    np.arange(64 * 32, dtype=np.float32).astype(ml_dtypes.bfloat16).tofile(path)
    cfg = {"paths": [str(path)], "header": 0, "shape": [32], "src_dtype": "bfloat16", "out_dtype": out,
           "batch": 16, "loop": "mmap_kept", "threads": 1, "seconds": 0.2}  # fmt: skip
    m = run_child("ceiling", cfg)
    assert m.records > 64 and m.bytes_read == m.records * 64
    # Raw void records cannot be cast: the loop's error, from inside the loop, fails the child.
    with pytest.raises(RuntimeError, match=r"child .ceiling. failed:(.|\n)*_ceiling_worker(.|\n)*ValueError"):
        run_child("ceiling", {**cfg, "src_dtype": "<V2", "out_dtype": "float32"})


def test_the_ceiling_loops_buffers_are_memory_as_stoker_s_batches_get() -> None:
    """Page aligned, huge pages advised from 2 MiB (a faster yardstick than np.empty's memory)."""
    big = output_buffer((256, 128, 128, 1), np.dtype(np.float32))
    assert big.shape == (256, 128, 128, 1) and big.dtype == np.float32 and big.ctypes.data % 4096 == 0
    assert "hg" in vm_flags(big.ctypes.data)
    assert "hg" not in vm_flags(output_buffer((1 << 20,), np.dtype(np.uint8)).ctypes.data)
    big[:] = 1.5  # plain writable memory
    assert float(big.sum()) == 1.5 * big.size


def test_a_warm_up_runs_before_stoker_s_timed_seconds_and_is_not_counted(sample: Path) -> None:
    cfg = {"fields": _fields(sample), "batch": 16, "cast": "float32", "seconds": 0.2, "warmup": 0.5}
    began = time.perf_counter()
    m = run_child("stoker", cfg)
    assert time.perf_counter() - began >= 0.7
    assert 0.2 <= m.seconds < 0.45  # the timed seconds only
    stats = LoaderStats.from_dict(m.stats or {})
    # The loader delivered the warm-up's batches too; the measurement counts the timed ones.
    assert 0 < m.records < stats.records and m.bytes_read == m.records * (16 * 16 + 4)


def test_stoker_s_warm_up_holds_no_batch_when_its_clock_starts(sample: Path) -> None:
    # A batch left referenced keeps its buffer (shared with the batches assembled beside it) out
    # of the pool, which then makes a fresh one inside the timed seconds.
    taken: list[weakref.ref[np.ndarray]] = []

    class Taking:
        def __init__(self, it: Iterator[dict[str, np.ndarray]]) -> None:
            self.it = it

        def __iter__(self) -> Taking:
            return self

        def __next__(self) -> dict[str, np.ndarray]:
            batch = next(self.it)
            taken.append(weakref.ref(batch["image"]))
            return batch

    with dataset_from_fields(_fields(sample)).loader(16, epochs=None, cast="float32") as loader:
        _drain_until(Taking(iter(loader)), time.perf_counter() + 0.1, 0.0)
        assert len(taken) > 1
        assert [r() for r in taken] == [None] * len(taken)


@pytest.mark.parametrize("loop", ["mmap_kept", "inflate_cast"])
def test_a_warm_up_runs_before_the_ceiling_s_timed_seconds(sample: Path, loop: str) -> None:
    if loop == "inflate_cast":
        for g in range(2):
            (sample / f"img_{g}.bin.gz").write_bytes(gzip.compress(np.arange(64 * 256, dtype=np.int8).tobytes()))
    paths = sorted(str(p) for p in sample.glob("img_*.bin.gz" if loop == "inflate_cast" else "img_*.bin"))
    cfg = {"paths": paths, "header": 0, "shape": [16, 16, 1], "src_dtype": "|i1", "out_dtype": "float32",
           "batch": 16, "loop": loop, "threads": 2, "seconds": 0.2, "warmup": 0.5}  # fmt: skip
    began = time.perf_counter()
    m = run_child("ceiling", cfg)
    assert time.perf_counter() - began >= 0.7
    assert 0.15 <= m.seconds < 0.45 and m.records > 0 and m.bytes_read == m.records * 16 * 16


def test_a_ceiling_thread_counts_from_its_first_batch_done_in_the_timed_window() -> None:
    tally = _Tally()
    now = time.perf_counter()
    assert not tally.add(16, now + 60, now + 120)  # warm-up: not counted
    assert tally.begun is None and tally.n - tally.base == 16
    assert not tally.add(16, now, now + 120)  # the first batch done in the window: the count starts after it
    assert tally.begun is not None and tally.n - tally.base == 0
    assert tally.add(16, now, now)  # one more, and the window is over
    assert tally.n - tally.base == 16 and tally.ended >= tally.begun


def test_batch_rows_counts_the_records_of_a_tuple_or_a_dict_batch() -> None:
    assert batch_rows((np.zeros((3, 2)), np.zeros(3))) == 3 and batch_rows({"a": np.zeros((5, 1))}) == 5


def test_burn_keeps_the_thread_on_the_cpu() -> None:
    cpu = time.thread_time()
    burn(0.05)
    assert time.thread_time() - cpu >= 0.05


def test_bench_prints_stages_cpu_threads_and_a_verdict(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--field", f"image={sample}/img_*.bin:int8:16x16x1",
                 "--field", f"label={sample}/out_*.bin.gz:float32", "--rounds", "1", "--seconds", "0.3",
                 "--warmup", "0.1"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "% of ceiling" in out and "MB/s" in out
    assert "worker time by stage: " in out and "read+cast[image]" in out
    assert "CPU " in out and "threads=" in out and "prefetch=" in out
    assert "verdict: " in out


def test_bench_runs_stoker_with_the_threads_prefetch_and_memory_budget_given(
    sample: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 16 rows of 16x16 float32 + a float32 label: 16,448 bytes a batch; 3 batches' worth.
    code = main(["bench", "--field", f"image={sample}/img_*.bin:int8:16x16x1",
                 "--field", f"label={sample}/out_*.bin.gz:float32", "--rounds", "1", "--seconds", "0.3",
                 "--warmup", "0.1", "--batch-size", "16", "--threads", "2", "--memory-budget", "50000"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "threads=2 prefetch=1 (held down by memory_budget: it holds 3 batches of 0.0 MiB)" in out
    assert "verdict: memory_budget-bound: memory_budget=50000 holds 3 batches" in out
    code = main(["bench", "--field", f"image={sample}/img_*.bin:int8:16x16x1", "--rounds", "1",
                 "--seconds", "0.3", "--warmup", "0", "--batch-size", "16", "--threads", "2", "--prefetch", "3",
                 "--no-ceiling"])  # fmt: skip
    assert code == 0 and "threads=2 prefetch=3 " in capsys.readouterr().out


def test_bench_on_a_compressed_widest_field_measures_the_inflate_ceiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for g in range(2):
        (tmp_path / f"img_{g}.bin.gz").write_bytes(gzip.compress(np.zeros(40 * 64, np.int8).tobytes()))
    code = main(["bench", "--field", f"image={tmp_path}/img_*.bin.gz:int8:8x8", "--rounds", "1", "--seconds", "0.2",
                 "--warmup", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "ceiling:inflate_cast" in out and "verdict: " in out


def _compare() -> Any:
    """benchmarks/compare.py, imported with benchmarks/ on sys.path only while it loads (it imports
    its sibling harness): left there, benchmarks/ray.py would shadow ray for later tests."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import compare
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return compare


@pytest.mark.torch
def test_compare_peers_read_whole_batches_that_keep_images_with_their_labels(tmp_path: Path) -> None:
    import torch.utils.data

    compare = _compare()
    write_sample(tmp_path, pairs=3, records=100, inrez=compare.RES)
    for shuffle in (False, True):
        src = compare.BatchSource(tmp_path, "float32", shuffle=shuffle)
        image, label = src.read(np.arange(90, 210))  # spans groups 0, 1 and 2
        assert image.dtype == np.float32 and image.shape == (120, compare.RES, compare.RES, 1)
        assert np.array_equal(expected_label(image.astype(np.int8)), label)
        assert sorted(label.tolist()) == (sorted(src.order[90:210].tolist()) if shuffle else list(range(90, 210)))
    dl = torch.utils.data.DataLoader(src, batch_size=16, collate_fn=compare._identity)
    images, labels = next(iter(dl))
    assert images.shape[0] == 16 and np.array_equal(expected_label(images.numpy().astype(np.int8)), labels.numpy())
    assert len(compare.GrainBatches(src)) == 1
    batch = compare.GrainBatches(src)[0]
    assert np.array_equal(expected_label(batch["image"].astype(np.int8)), batch["label"])


def test_compare_report_and_chart_show_ratios_reasons_and_the_ceiling(tmp_path: Path) -> None:
    compare = _compare()
    results = {
        "W1": {"rates": {"ceiling": [100.0, 200.0], "stoker numpy": [90.0, 150.0], "grain": [50.0, None]},
               "verdict": "consumer-bound: ..."},
        "W2": {"rates": {"ceiling": [10.0, 10.0], "stoker numpy": [9.0, 9.5]}},
    }  # fmt: skip
    meta = {"date": "d", "machine": "m", "cores": 2, "rounds": 2, "seconds": 1.0}
    text = compare.report(results, meta)
    assert "| W1 | stoker numpy | 120 | 90 | 150 | 0.82 [0.75..0.90] |" in text
    assert "| W1 | grain | 50 | 50 | 50 | 0.50 [0.50..0.50] | 1.80 [1.80..1.80] |" in text
    assert "W2 | grain | not run: needs random access" in text and "- W1: consumer-bound" in text
    compare.chart(results, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_compare_runs_benchmarks_compare_and_passes_its_exit_status(capfd: pytest.CaptureFixture[str]) -> None:
    # An unknown workload is refused by compare.py before any data is generated.
    assert main(["bench", "--compare", "--workloads", "W9", "--rounds", "1"]) == 2
    assert "unknown workload(s) ['W9']" in capfd.readouterr().err


def test_child_json_returns_the_last_line_s_object_and_names_a_failing_child(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys\n"
        "if sys.argv[1] == 'fail':\n"
        "    sys.exit('no such contender: ' + os.environ.get('WHICH', '?'))\n"
        "print('noise first')\n"
        "print(json.dumps({'records': 10, 'seconds': 2.0, 'which': os.environ.get('WHICH')}))\n"
    )
    out = child_json("ok", [str(script), "ok"], env={"WHICH": "given"})
    assert out == {"records": 10, "seconds": 2.0, "which": "given"}
    with pytest.raises(RuntimeError) as e:
        child_json("W1 grain", [str(script), "fail"], env={"WHICH": "grain"})
    assert str(e.value).startswith("benchmark child 'W1 grain' failed:\n")
    assert "no such contender: grain" in str(e.value)
