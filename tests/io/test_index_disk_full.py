"""Writing the index where the disk cannot hold it: a WriteError naming the file, nothing left behind.

Two ways to run out: RLIMIT_FSIZE in a child process (any user; a write past it fails with
EFBIG, through the same OSError path as a full disk) and a real full tmpfs (ENOSPC; mounting
needs root, which CI has, so the tmpfs test runs there and is skipped only where mounting is
refused).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker.cli import main
from stoker.io import indexlock

SPACING = 64 << 10  # a seek point per 64 KiB: a 512 KiB stream has 7 windows of 32 KiB


def _gzip_dataset(directory: Path, records: int = 512) -> list[str]:
    """One group: raw images and a gzip field of random (incompressible) bytes, so its seek
    points' windows take about 200 KiB; returns the `stoker index` arguments that read it."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    (directory / "img_0000.bin").write_bytes(rng.integers(0, 256, 512 * 4, dtype=np.uint8).tobytes())
    with gzip.open(directory / "lab_0000.bin.gz", "wb", compresslevel=1) as f:
        f.write(rng.integers(0, 256, records * 1024, dtype=np.uint8).tobytes())
    return [
        "--field", f"image={directory}/img_*.bin:uint8:4",
        "--field", f"label={directory}/lab_*.bin.gz:uint8:1024",
        "--spacing", str(SPACING),
    ]  # fmt: skip


def _raw_dataset(directory: Path, groups: int = 80) -> list[str]:
    """Many small raw files: an index of some 10 KiB of JSON and no windows files."""
    directory.mkdir()
    for g in range(groups):
        (directory / f"img_{g:04d}.bin").write_bytes(bytes(range(8)))
    return ["--field", f"image={directory}/img_*.bin:uint8:8"]


def _index_in_child(args: list[str], limit: int) -> subprocess.CompletedProcess[str]:
    script = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "from stoker.cli import main\n"
        f"sys.exit(main(['index', *{args!r}]))\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("make", "what"),
    [(_gzip_dataset, "seek-point windows file"), (_raw_dataset, "index file")],
)
def test_stoker_index_past_the_file_size_limit_is_a_write_error_leaving_nothing(
    tmp_path: Path, make: object, what: str
) -> None:
    data = tmp_path / "data"
    args = make(data)  # type: ignore[operator]
    before = _names(data)
    done = _index_in_child(args, 8 << 10)
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]  # after the progress line
    assert last.startswith(f"WriteError: cannot write the {what} {str(data)!r}"[:-1]), done.stderr
    assert "File too large" in last and "Traceback" not in done.stderr
    if what == "index file":
        assert f"{data / '.stoker-index.json'}" in done.stderr
    else:
        assert ".stoker-windows.lab_0000.bin.gz" in done.stderr
    assert _names(data) == before  # no index, no windows file, no temporary file
    # Without the limit the same command writes the index, and the Dataset then reads through it.
    assert main(["index", *args]) == 0
    assert ".stoker-index.json" in os.listdir(data)


def test_rebuilding_the_index_on_open_past_the_limit_is_a_write_error_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _gzip_dataset(data, records=3 << 10)  # 3 MiB: seek points at the default spacing of 1 MiB
    script = (
        "import resource, stoker\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        f"    ds = stoker.Dataset(label=stoker.Field({str(data)!r} + '/lab_*.bin.gz', 'uint8', (1024,)),\n"
        "                        index='rebuild')\n"
        "    print(len(ds))\n"
        "except stoker.WriteError as e:\n"
        "    print(type(e).__name__, isinstance(e, OSError), e.path)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith(f"WriteError True {data}/.stoker-windows.lab_0000.bin.gz"), done.stderr
    assert not any(name.startswith(".stoker") for name in _names(data))


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the RLIMIT_FSIZE tests cover the path")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True, timeout=30)


def test_a_full_disk_while_writing_the_index_is_a_write_error_naming_it(tmp_path: Path) -> None:
    """A real ENOSPC: the index directory is a 64 KiB tmpfs the windows file does not fit in."""
    args = _gzip_dataset(tmp_path / "data")
    with _tmpfs(tmp_path / "full", "64k") as full:
        ds = stoker.Dataset(
            image=stoker.Field(str(tmp_path / "data" / "img_*.bin"), "uint8", (4,)),
            label=stoker.Field(str(tmp_path / "data" / "lab_*.bin.gz"), "uint8", (1024,)),
            index="ignore",
        )
        with pytest.raises(stoker.WriteError, match="No space left on device") as e:
            stoker.write_index(ds, spacing=SPACING, index_dir=full)
        assert e.value.path is not None and e.value.path.startswith(str(full))
        assert ".stoker-windows.lab_0000.bin.gz" in str(e.value) and isinstance(e.value, OSError)
        assert _files(full) == []  # the per-data-directory folder stays, empty
        assert main(["index", *args, "--index-dir", str(full)]) == 2
        assert _files(full) == []


def _names(directory: Path) -> list[str]:
    """The directory's entries, less the index's lock files, which stay by design."""
    return sorted(n for n in os.listdir(directory) if n not in {indexlock.WRITER_LOCK, indexlock.READERS_LOCK})


def _files(top: Path) -> list[str]:
    """What a failed write left, less the writers' and readers' lock files, which stay by design."""
    locks = {indexlock.WRITER_LOCK, indexlock.READERS_LOCK}
    return [os.path.join(d, f) for d, _, names in os.walk(top) for f in names if f not in locks]
