"""write_sample: the seed's layout, contents that make pairing checkable."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker.cli import main
from stoker.cli.sample import expected_label


def test_writes_images_and_gzip_labels_in_the_seed_layout(tmp_path: Path) -> None:
    out = stoker.write_sample(tmp_path / "d", pairs=3, records=20, inrez=8)
    assert out == tmp_path / "d"
    assert sorted(p.name for p in out.iterdir()) == [
        "img_0000.bin", "img_0001.bin", "img_0002.bin", "out_0000.bin.gz", "out_0001.bin.gz", "out_0002.bin.gz",
            "stoker.toml",
    ]  # fmt: skip
    for g in range(3):
        img = np.fromfile(out / f"img_{g:04d}.bin", dtype=np.int8).reshape(20, 64)
        idx = np.ascontiguousarray(img[:, :4]).view("<u4").reshape(-1)
        assert idx.tolist() == list(range(20 * g, 20 * g + 20))
        labels = np.frombuffer(gzip.decompress((out / f"out_{g:04d}.bin.gz").read_bytes()), "<f4")
        assert labels.tolist() == list(range(20 * g, 20 * g + 20))
        assert np.array_equal(expected_label(img.reshape(20, 8, 8, 1)), labels)


def test_expected_label_reads_the_index_from_the_first_four_bytes() -> None:
    img = np.zeros((2, 3, 3, 1), np.int8)
    img.reshape(2, -1)[:, :4] = np.array([7, 70000], "<u4").view(np.int8).reshape(2, 4)
    assert expected_label(img).tolist() == [7.0, 70000.0]
    assert expected_label(img.astype(np.float32)).tolist() == [7.0, 70000.0]  # after cast="float32"


def test_inrez_97_sample_pairs_through_the_loader(tmp_path: Path) -> None:
    stoker.write_sample(tmp_path, pairs=2, records=9, inrez=97)
    ds = stoker.Dataset(
        image=stoker.Field(str(tmp_path / "img_*.bin"), "int8", (97, 97, 1)),
        label=stoker.Field(str(tmp_path / "out_*.bin.gz"), "float32", compression="gzip"),
    )
    seen = []
    for b in ds.loader(4, cast={"image": "float32"}):
        assert np.array_equal(b["label"], expected_label(b["image"]))
        seen += b["label"].astype(int).tolist()
    assert sorted(seen) == list(range(18))


@pytest.mark.parametrize("kw", [{"pairs": 0}, {"records": -1}, {"inrez": 1}, {"pairs": True}, {"records": 2.0},
                                {"pairs": 4096, "records": 4096}])  # fmt: skip
def test_bad_arguments_raise_spec_error(tmp_path: Path, kw: dict) -> None:
    with pytest.raises(stoker.SpecError):
        stoker.write_sample(tmp_path, **{"pairs": 1, "records": 1, "inrez": 4, **kw})


@pytest.mark.parametrize("where", ["under a file", "a name too long"])
def test_stoker_sample_into_an_unmakeable_directory_prints_type_and_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    (tmp_path / "file").write_bytes(b"x")
    out = tmp_path / "file" / "sample" if where == "under a file" else tmp_path / ("d" * 300)
    assert main(["sample", str(out), "--pairs", "2", "--records", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"WriteError: cannot write a sample into {str(out)!r}: ") and "Traceback" not in err
    with pytest.raises(stoker.WriteError) as e:
        stoker.write_sample(out, pairs=2, records=8, inrez=8)
    assert isinstance(e.value, OSError) and e.value.path == str(out)


def test_a_sample_the_disk_cannot_hold_is_a_write_error_and_leaves_no_files(tmp_path: Path) -> None:
    """RLIMIT_FSIZE in the child: its writes past 64 KiB fail as a full disk's would (EFBIG, not
    ENOSPC; the same OSError path), and it does so as any user, where a full tmpfs needs root."""
    out = tmp_path / "sample"
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "from stoker.cli import main\n"
        f"sys.exit(main(['sample', {str(out)!r}, '--pairs', '2', '--records', '32', '--inrez', '64']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"WriteError: cannot write a sample into {str(out)!r}: File too large"), done.stderr
    assert "img_0000.bin" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in out.iterdir()) == []  # the half-written image is gone
