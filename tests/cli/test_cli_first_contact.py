"""The CLI as a new user meets it: help that states defaults, no silent overwrite, progress, an inspect
that says what it assumed and keeps going. Each test is one trap of issue 48, showing the right behaviour."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from stoker.cli import build_parser, main
from stoker.cli.output import Progress
from stoker.io.index import INDEX_NAME

SMALL = ["--pairs", "2", "--records", "50", "--inrez", "8"]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["sample", "inspect", "index", "bench"])
def test_every_option_states_its_default_and_each_command_has_examples(command: str) -> None:
    p = _subparsers()[command]
    options = [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert options
    for a in options:
        assert a.help and "default" in a.help, f"stoker {command} {a.option_strings[0]}: {a.help!r}"
    text = p.format_help()
    assert "examples:" in text and f"stoker {command} " in text.split("examples:", 1)[1]


def test_help_prints_the_examples_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["sample", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "  stoker sample data/ --force " in out  # the epilog's own lines, not re-wrapped
    assert re.search(r"--pairs PAIRS\s+image/label file pairs \(default: 16\)", out)
    assert all(len(line) <= 100 for line in out.split("examples:")[0].splitlines())  # the description is wrapped


def test_sample_refuses_a_directory_that_is_not_empty_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("mine\n")
    assert main(["sample", str(d), *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("SpecError: stoker sample: ") and "is not empty (notes.txt)" in err and "--force" in err
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    # A former sample there: refused too, nothing touched.
    e = tmp_path / "e"
    assert main(["sample", str(e), *SMALL]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in e.iterdir()}
    assert main(["sample", str(e), "--pairs", "3", "--records", "10", "--inrez", "4"]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in e.iterdir()} == before
    # A path that is a file is no directory to write.
    assert main(["sample", str(d / "notes.txt"), *SMALL]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_sample_force_replaces_its_own_files_and_index_and_leaves_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "d"
    assert main(["sample", str(d), "--pairs", "3", "--records", "50", "--inrez", "8"]) == 0
    assert main(["index", str(d)]) == 0
    (d / "notes.txt").write_text("mine\n")
    (d / "img_0000.bin.orig").write_bytes(b"not a name a sample writes")
    capsys.readouterr()
    # Fewer, smaller pairs: nothing of the old sample may stay among the new one.
    assert main(["sample", str(d), "--pairs", "2", "--records", "10", "--inrez", "4", "--force"]) == 0
    assert sorted(p.name for p in d.iterdir()) == [
        "img_0000.bin", "img_0000.bin.orig", "img_0001.bin", "notes.txt", "out_0000.bin.gz", "out_0001.bin.gz",
        "stoker.toml",
    ]  # fmt: skip
    assert (d / "notes.txt").read_text() == "mine\n"
    capsys.readouterr()
    # What used to fail: the next inspect reads the new sample, no stale index, no MISMATCH rows.
    assert main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "2 groups" in out and "total: 20 records" in out and "in sync" in out and "MISMATCH" not in out
    assert INDEX_NAME not in os.listdir(d)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_sample_and_index_draw_a_bar_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert main(["sample", str(tmp_path / "d"), "--pairs", "4", "--records", "10", "--inrez", "4"]) == 0
    text = term.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "\rsample [##############################] 4/4 pairs" in text and "\rsample [#######" in text
    term.seek(0)
    term.truncate()
    assert main(["index", str(tmp_path / "d")]) == 0
    text = term.getvalue()
    assert text.count("\r") == 8 and "\rindex [##############################] 8/8 files out_0003.bin.gz" in text


def test_sample_and_index_print_quiet_lines_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["sample", str(tmp_path / "d"), "--pairs", "4", "--records", "10", "--inrez", "4"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"sample: 4/4 pairs \(100%\) after \d+\.\ds", lines[0]
    )  # fast: the end only
    monkeypatch.setattr(Progress, "LINE_SECONDS", 0.0)  # a slow run: a line per step, no bar
    assert main(["index", str(tmp_path / "d")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" after ")[0] for line in lines] == [
        f"index: {k}/8 files ({k / 8:.0%})" for k in range(1, 9)
    ] and not any("\r" in line or "#" in line for line in lines)


def test_inspect_says_which_layout_it_assumed_and_how_to_give_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "d"
    assert main(["sample", str(d), "--pairs", "1", "--records", "3", "--inrez", "80"]) == 0
    (d / "stoker.toml").unlink()
    capsys.readouterr()
    assert main(["inspect", str(d)]) == 1  # 80x80 frames read as 128x128: 19200 bytes, not whole 16384s
    out = capsys.readouterr().out
    assert out.startswith(
        f"layout: {d} has no stoker.toml: assumed the `stoker sample` layout (img_*.bin int8 128x128x1, "
        "out_*.bin.gz float32 gzip); give another with --inrez N, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] "
        "or --config FILE\n"
    )
    assert "img_0000.bin (18.8 KiB, ?, CORRUPT)" in out and "not a whole number of 16384-byte records" in out
    assert main(["inspect", str(d), "--inrez", "80"]) == 0
    assert "total: 3 records" in capsys.readouterr().out
    # index and bench read a DIR the same way, and say so on stderr.
    assert main(["index", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stoker: {d} has no stoker.toml: assumed the `stoker sample` layout")
    assert "CorruptDataError: " in err


def _many(tmp_path: Path, groups: int) -> Path:
    d = tmp_path / "many"
    assert main(["sample", str(d), "--pairs", str(groups), "--records", "5", "--inrez", "4"]) == 0
    return d


def test_inspect_summarizes_many_groups_and_shows_rows_on_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _many(tmp_path, 30)
    (d / "img_0004.bin").write_bytes(bytes(4 * 16))  # 4 records beside 5 labels
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["inspect", "many"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 15, out  # not a row per group
    assert "30 groups" in lines[1] and "files under many/" in out
    assert "records per group: min 5, median 5, max 5 (a row per group: --groups)" in out
    assert "field image: 30 files, 2.3 KiB (64 B to 80 B a file), raw" in out
    assert "groups that cannot be read (1 of 30):" in out
    assert re.search(r"^\s+4\s+MISMATCH\s+img_0004\.bin \(64 B, raw\)\s+out_0004\.bin\.gz \(\d+ B, gzip\)$", out, re.M)
    assert "total: 145 records, " in out
    assert main(["inspect", "many", "--groups"]) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"^\s+\d+\s", line)]
    assert len(rows) == 30 and all(str(tmp_path) not in r for r in rows)  # relative paths


def test_inspect_uses_one_size_unit_style_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", str(tmp_path / "d"), "--pairs", "2", "--records", "300", "--inrez", "64"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    sizes = re.findall(r"\d[\d.]* (?:B|KiB|MiB|GiB)\b", out)
    assert "4.0 KiB/record" in out and "img_0000.bin (1.2 MiB, raw)" in out and "total: 600 records, 2.3 MiB" in out
    assert len(sizes) >= 6 and not re.search(r"\(\d{4,}, ", out)  # no bare byte counts beside the units


def test_inspect_json_is_one_document_with_every_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _many(tmp_path, 25)
    (d / "out_0003.bin.gz").write_bytes(b"\x1f\x8b not gzip")
    capsys.readouterr()
    assert main(["inspect", str(d), "--json", "--values", "2"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == f"from {d / 'stoker.toml'}"
    assert doc["fields"]["image"] == {"dtype": "int8", "shape": [4, 4, 1], "record_bytes": 16}
    assert len(doc["groups"]) == 25 and doc["total_records"] == 24 * 5 and doc["in_sync"] is False
    bad = doc["groups"][3]
    assert bad["status"] == "CORRUPT" and bad["records"] is None and "out_0003.bin.gz" in bad["problem"]
    assert bad["files"]["label"] == {"path": "out_0003.bin.gz", "bytes": 11, "compression": "gzip", "mark": "CORRUPT"}
    assert doc["groups"][0]["files"]["image"] == {"path": "img_0000.bin", "bytes": 80, "compression": "raw",
                                                  "mark": None}  # fmt: skip
    assert [v["record"] for v in doc["values"]] == [0, 1] and doc["values"][1]["label"] == 1.0
    assert doc["values"][1]["image"][0][0] == [1]  # the record's index in its first bytes


def test_inspect_marks_a_corrupt_gzip_file_in_its_row_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "d"
    assert main(["sample", str(d), *SMALL]) == 0
    # A valid gzip stream whose body is cut short: found only when the group is counted.
    data = gzip.decompress((d / "out_0000.bin.gz").read_bytes())
    (d / "out_0000.bin.gz").write_bytes(gzip.compress(data)[:-12])
    capsys.readouterr()
    assert main(["inspect", str(d)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\s+0\s+CORRUPT\s+img_0000\.bin \(3\.1 KiB, raw\)\s+out_0000\.bin\.gz \(\d+ B, gzip, CORRUPT\)$",
                     out, re.M), out  # fmt: skip
    assert re.search(r"^\s+1\s+50\s+img_0001\.bin", out, re.M)
    assert "total: 50 records" in out
    assert re.search(
        r"^  group 0: \w+Error: gzip stream of field 'label' in '.*out_0000\.bin\.gz' is corrupt", out, re.M
    )


def test_inspect_shows_a_few_records_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "d"
    assert main(["sample", str(d), *SMALL]) == 0
    capsys.readouterr()
    assert main(["inspect", str(d), "--values", "2", "--offset", "49"]) == 0
    out = capsys.readouterr().out
    image49 = np.fromfile(d / "img_0000.bin", np.int8).reshape(50, 64)[49]
    shown = ", ".join(str(v) for v in image49[:8])
    assert f"record 49: image [8, 8, 1] [{shown}, ...] min {image49.min()} max {image49.max()}; label 49.0" in out
    assert "record 50: image [8, 8, 1] [50, 0, 0, 0, " in out and "; label 50.0" in out
    assert main(["inspect", str(d), "--values", "1", "--offset", "100"]) == 2
    assert "SpecError: stoker inspect --offset 100: the readable groups hold 100 records" in capsys.readouterr().err
    assert main(["inspect", str(d), "--values", "-1"]) == 2


def test_version_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.fullmatch(r"stoker \S+ \(compiled kernels; Python 3\.\d+\.\d+\)\n",
                                              capsys.readouterr().out)  # fmt: skip
