"""`stoker sample`, and the sample datasets it writes (int8 image files beside gzip float32 label
files), with contents that make pairing checkable.

Images: int8 frames of `inrez x inrez x 1`; the first 4 bytes of each frame hold the
record's global index (little-endian uint32) and the rest a cheap pattern. Labels: one
float32 per frame, gzip-compressed, equal to the same global index (exact below 2**24),
so `label == int.from_bytes(image[:4])` checks that every image met its own label.
Beside the files, `stoker.toml` records the fields (globs relative to the directory), so
`stoker inspect DIR` and the other commands know the frame size without being told; its
first line names the settings, so a sample written again with the same ones is recognised.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpecError, WriteError
from ..io.index import INDEX_NAME
from ..io.indexlock import READERS_LOCK, WRITER_LOCK
from .config import CONFIG_NAME
from .output import Progress, counted, size

__all__ = [
    "CONFIG_NAME",
    "add_parser",
    "cached_sample",
    "directory_contents",
    "expected_label",
    "holds_sample",
    "run",
    "sample_bytes",
    "sample_config",
    "sample_files",
    "write_sample",
]

_COMPLETE = ".complete"  # cached_sample's marker, written last
# What a sample writes into its directory, besides CONFIG_NAME and the index `stoker index` adds.
_OWN = re.compile(r"(img_\d+\.bin|out_\d+\.bin\.gz)")


def expected_label(image: np.ndarray) -> np.ndarray:
    """The label that belongs with each image of a sample batch (its global index)."""
    flat = np.ascontiguousarray(image.reshape(len(image), -1)[:, :4]).astype(np.int8)
    return flat.view(np.uint32).reshape(-1).astype(np.float32)


def write_sample(
    directory: str | os.PathLike[str],
    *,
    pairs: int = 16,
    records: int = 4096,
    inrez: int = 128,
    compresslevel: int = 1,
    replace: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write `pairs` image files (`img_0000.bin`) and gzip label files (`out_0000.bin.gz`).

    A directory that already holds a sample's files (or their index) is refused: writing beside
    them would leave old files and a stale index among the new ones. `replace=True` removes
    those first, and only those (`sample_files`). `progress(pairs_done, pairs)` is
    called after each pair is written.
    """
    for name, value in (("pairs", pairs), ("records", records), ("inrez", inrez)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"{name}={value!r} must be a positive integer")
    if inrez * inrez < 4:
        raise SpecError(f"inrez={inrez} must be at least 2 so each frame can carry its 4-byte index")
    if pairs * records >= 1 << 24:
        raise SpecError(f"pairs*records={pairs * records} must stay below 2**24 so float32 labels are exact")
    out = Path(directory)
    try:
        is_file = out.exists() and not out.is_dir()
        old = sample_files(out)
    except OSError as e:  # a name too long, a directory that cannot be listed
        raise _cannot_write(out, e) from e
    if is_file:
        raise SpecError(f"{str(out)!r} is not a directory: write_sample writes a directory of files", path=str(out))
    if old and not replace:
        shown = ", ".join(p.name for p in old[:3]) + (f" and {len(old) - 3} more" if len(old) > 3 else "")
        raise SpecError(
            f"{str(out)!r} already holds a sample's files ({shown}); pass replace=True to replace them",
            path=str(out),
        )
    written: list[Path] = []
    try:
        for p in old:
            p.unlink()
        out.mkdir(parents=True, exist_ok=True)
        _write_pairs(out, pairs, records, inrez, compresslevel, written, progress)
        written.append(out / CONFIG_NAME)
        (out / CONFIG_NAME).write_text(sample_config(pairs=pairs, records=records, inrez=inrez))
    except OSError as e:
        # A half-written sample would pass for a whole one with fewer records: its files go.
        for p in written:
            with contextlib.suppress(OSError):
                p.unlink()
        raise _cannot_write(out, e, written[-1] if written else None) from e
    return out


def _cannot_write(out: Path, e: OSError, writing: Path | None = None) -> WriteError:
    """The directory `out` cannot hold a sample: what the system said, and of which file."""
    name = e.filename or writing
    which = f" ({name})" if name and str(name) != str(out) else ""
    return WriteError(f"cannot write a sample into {str(out)!r}: {e.strerror or e}{which}", path=str(out))


def _write_pairs(
    out: Path,
    pairs: int,
    records: int,
    inrez: int,
    compresslevel: int,
    written: list[Path],
    progress: Callable[[int, int], None] | None,
) -> None:
    """The image and label files of a sample, each added to `written` before it is opened."""
    frame = inrez * inrez
    rng = np.random.default_rng(0)
    pattern = rng.integers(-128, 128, size=frame, dtype=np.int8)
    chunk = max(1, min(records, (64 << 20) // frame))
    base = 0
    for g in range(pairs):
        img_path = out / f"img_{g:04d}.bin"
        written.append(img_path)
        with open(img_path, "wb") as f:
            for start in range(0, records, chunk):
                n = min(chunk, records - start)
                block = np.empty((n, frame), dtype=np.int8)
                block[:] = pattern
                block[:, 4:] += np.arange(n, dtype=np.int8)[:, None]
                idx = np.arange(base + start, base + start + n, dtype=np.uint32)
                block[:, :4] = idx.view(np.int8).reshape(n, 4)
                f.write(block.tobytes())
        labels = np.arange(base, base + records, dtype="<f4")
        written.append(out / f"out_{g:04d}.bin.gz")
        with gzip.open(out / f"out_{g:04d}.bin.gz", "wb", compresslevel=compresslevel) as f:
            f.write(labels.tobytes())
        base += records
        if progress is not None:
            progress(g + 1, pairs)


def directory_contents(directory: str | os.PathLike[str]) -> list[Path]:
    """What a directory a sample is about to be written into holds, sorted (none where it does
    not exist yet); a SpecError where it is a file, a WriteError where it cannot be looked into
    (a name too long, a directory that cannot be listed)."""
    out = Path(directory)
    try:
        if out.exists() and not out.is_dir():
            raise SpecError(f"stoker sample: {str(out)!r} is not a directory", path=str(out))
        return sorted(out.iterdir()) if out.is_dir() else []
    except OSError as e:
        raise _cannot_write(out, e) from e


def sample_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The files of `directory` that a sample wrote (images, labels, its config) or that index
    them (the index of `stoker index`), sorted; none where it does not exist."""
    out = Path(directory)
    if not out.is_dir():
        return []
    own = {CONFIG_NAME, INDEX_NAME, WRITER_LOCK, READERS_LOCK, _COMPLETE}
    return sorted(p for p in out.iterdir() if (p.name in own or _OWN.fullmatch(p.name)) and not p.is_dir())


def sample_config(*, pairs: int, records: int, inrez: int) -> str:
    """The `--config` file of a sample directory: its two fields, globs relative to it."""
    return (
        f"# Written by `stoker sample --pairs {pairs} --records {records} --inrez {inrez}`: the fields of this "
        "dataset (globs relative to this file).\n"
        "[fields.image]\n"
        'files = "img_*.bin"\n'
        'dtype = "int8"\n'
        f"shape = [{inrez}, {inrez}, 1]\n"
        "\n"
        "[fields.label]\n"
        'files = "out_*.bin.gz"\n'
        'dtype = "float32"\n'
        'compression = "gzip"\n'
    )


def sample_bytes(*, pairs: int, records: int, inrez: int) -> int:
    """The bytes of a sample's image files (its labels add a few percent, compressed)."""
    return pairs * records * inrez * inrez


def holds_sample(directory: str | os.PathLike[str], *, pairs: int, records: int, inrez: int) -> bool:
    """Whether `directory` holds a whole sample written with these settings: its `stoker.toml`
    saying so (written last, so a half-written sample has none) and every file at its size."""
    out = Path(directory)
    try:
        if (out / CONFIG_NAME).read_text() != sample_config(pairs=pairs, records=records, inrez=inrez):
            return False
        own = {p.name for p in out.iterdir() if _OWN.fullmatch(p.name)}
        if own != {f"{kind}_{g:04d}.{ext}" for g in range(pairs) for kind, ext in (("img", "bin"), ("out", "bin.gz"))}:
            return False
        for g in range(pairs):
            if (out / f"img_{g:04d}.bin").stat().st_size != records * inrez * inrez:
                return False
            with open(out / f"out_{g:04d}.bin.gz", "rb") as f:  # gzip's trailer: the inflated size mod 2**32
                f.seek(-4, os.SEEK_END)
                if int.from_bytes(f.read(4), "little") != (records * 4) % (1 << 32):
                    return False
    except (OSError, UnicodeDecodeError):
        return False
    return True


def cached_sample(
    directory: str | os.PathLike[str],
    *,
    pairs: int = 16,
    records: int = 4096,
    inrez: int = 128,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """`write_sample` once: reuse `directory` when it holds this sample whole already; else say
    how big it is and where it goes before writing it."""
    out = Path(directory)
    if not holds_sample(out, pairs=pairs, records=records, inrez=inrez):
        nbytes = sample_bytes(pairs=pairs, records=records, inrez=inrez)
        what = f"{counted(pairs, 'pair')} x {counted(records, 'record')} of {inrez}x{inrez}x1 int8 frames"
        print(f"writing a {size(nbytes)} sample ({what} and gzip labels) into {out}; later runs reuse it",
              file=sys.stderr)  # fmt: skip
        # A half-written or different one goes (its own files only).
        write_sample(out, pairs=pairs, records=records, inrez=inrez, replace=True, progress=progress)
    return out


EXAMPLES = """\
examples:
  stoker sample data/                  # 16 pairs x 4096 records of 128x128 int8 frames (1 GiB) into data/
  stoker sample data/ --pairs 2 --records 100 --inrez 32
  stoker sample data/ --force          # replace an earlier sample there (its files and index only)
"""


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    settings = {"pairs": args.pairs, "records": args.records, "inrez": args.inrez}
    present = directory_contents(out)
    if present and not args.force and holds_sample(out, **settings):
        print(f"{out} already holds this sample ({counted(args.pairs, 'pair')} x {counted(args.records, 'record')}, "
              f"{args.inrez}x{args.inrez}x1): nothing written")  # fmt: skip
        return 0
    if present and not args.force:
        shown = ", ".join(p.name for p in present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
        raise SpecError(
            f"stoker sample: {args.dir!r} is not empty ({shown}); writing there would mix a new sample with "
            "what is there. Give an empty or new directory, or --force to replace a sample's own files "
            "(img_*.bin, out_*.bin.gz, stoker.toml, its index) and leave everything else",
            path=args.dir,
        )
    t = time.perf_counter()
    bar = Progress(args.pairs, "sample", "pairs")
    write_sample(out, **settings, replace=args.force, progress=lambda done, total: bar.step())
    print(f"wrote {counted(args.pairs, 'pair')} x {counted(args.records, 'record')} "
          f"({size(sample_bytes(**settings))} of images) to {out} in {time.perf_counter() - t:.1f}s")  # fmt: skip
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "sample",
        help="write a sample dataset: int8 image files beside gzip float32 label files",
        description="Write a sample dataset: img_NNNN.bin (int8 frames, the record's index in "
        "its first 4 bytes) and out_NNNN.bin.gz (its float32 label), with a stoker.toml "
        "saying so. Run again with the same settings over a sample it wrote, it writes nothing.",
        epilog=EXAMPLES,
    )
    p.add_argument("dir", help="the directory to write (new or empty, or a former sample's with --force)")
    p.add_argument("--pairs", type=int, default=16, help="image/label file pairs (default: 16)")
    p.add_argument("--records", type=int, default=4096, help="records per file (default: 4096)")
    p.add_argument("--inrez", type=int, default=128, help="frames are INREZ x INREZ x 1 int8 (default: 128)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a directory that is not empty, replacing only a sample's own files "
        "(img_*.bin, out_*.bin.gz, stoker.toml) and its index (default: refuse)",
    )
    p.set_defaults(run=run)
    return p
