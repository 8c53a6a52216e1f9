"""`stoker index`: write the persistent index (record counts, gzip seek points) beside the data."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from ..errors import SpecError
from .config import add_dir_args, add_field_args, dataset_from_fields, directory_layout, field_specs
from .output import Progress, counted

__all__ = ["add_parser", "run"]

EXAMPLES = """\
examples:
  stoker index data/                   # count and seek-index every file of a `stoker sample` directory
  stoker index --config data/stoker.toml --spacing 4194304
"""


def run(args: argparse.Namespace) -> int:
    from ..io.index import write_index
    from ..io.indexlock import WRITE_WAIT
    from ..io.seekpoints import SPACING

    specs = field_specs(args)
    if specs is None:
        if not args.dir:
            raise SpecError("index needs a sample DIR, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] or --config")
        if "://" in args.dir:  # a sample in a bucket, indexed into a manifest: its layout, joined as text (not Path)
            specs, _ = directory_layout(Path(), 128 if args.inrez is None else args.inrez)
            for spec in specs:
                spec["files"] = args.dir.rstrip("/") + "/" + os.path.basename(spec["files"])
        else:
            specs, _ = directory_layout(Path(args.dir), args.inrez, say_assumed=True)
    t = time.perf_counter()
    # The index on disk is what is being rewritten: never read it (it may be stale or old).
    ds = dataset_from_fields(specs, pair_key=args.pair_key, index="ignore")
    bar = Progress(ds.num_groups * len(ds.fields), "index", "files")
    written = write_index(
        ds,
        spacing=SPACING if args.spacing is None else args.spacing,
        index_dir=args.index_dir,
        progress=lambda path: bar.step(os.path.basename(path)),
        wait=WRITE_WAIT if args.wait is None else args.wait,
    )
    nfiles = ds.num_groups * len(ds.fields)
    print(f"indexed {counted(nfiles, 'file')} of {counted(ds.num_groups, 'group')} ({counted(len(ds), 'record')}) "
          f"in {time.perf_counter() - t:.1f}s")  # fmt: skip
    for path in written:
        print(f"wrote {path}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "index",
        help="write the persistent index (record counts, gzip seek points) beside the data",
        epilog=EXAMPLES,
    )
    add_dir_args(p, "default: give --field or --config instead")
    p.add_argument(
        "--spacing",
        type=int,
        default=None,
        help="decompressed bytes between seek points inside a gzip member or zlib stream (default 1 MiB)",
    )
    p.add_argument(
        "--index-dir",
        default=None,
        help="keep the index here instead of beside the data (for read-only data; default $STOKER_INDEX_DIR); "
        "read it with Dataset(..., index_dir=) or the same variable",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long to wait for another writer of the same index to finish before failing (default 600)",
    )
    add_field_args(p)
    p.set_defaults(run=run)
    return p
