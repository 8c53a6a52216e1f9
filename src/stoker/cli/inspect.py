"""`stoker inspect`: how the fields' files pair into groups, their records, sizes and compression,
and whether every group's fields agree."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..dataset import Dataset
from ..errors import CorruptDataError, PairingError, ReadError, SpecError, StaleIndexError, StokerError
from .config import add_dir_args, add_field_args, build_fields, dataset_from_fields, directory_layout, field_specs
from .output import counted, size

__all__ = ["SUMMARY_OVER", "add_parser", "run"]

EXAMPLES = """\
examples:
  stoker inspect data/                 # a `stoker sample` directory (its stoker.toml says the fields)
  stoker inspect --field 'image=data/img_*.bin:int8:128x128x1' --field 'label=data/out_*.bin.gz:float32:gzip'
  stoker inspect --config data/stoker.toml --groups     # a row per group, however many
  stoker inspect data/ --values 3      # the first 3 records' values
  stoker inspect data/ --json | jq .total_records
"""

# `inspect` prints a row per group up to this many groups, a summary beyond (rows with --groups).
SUMMARY_OVER = 20
_VALUES_SHOWN = 8  # values of a record printed by --values before "..."


def _problem_word(e: StokerError) -> str:
    """What a row says of a group that cannot be read (the error is printed below the table)."""
    if isinstance(e, PairingError):
        return "MISMATCH"
    if isinstance(e, CorruptDataError):
        return "CORRUPT"
    if isinstance(e, StaleIndexError):
        return "STALE"
    return "ERROR"


def _inspect_rows(
    specs: list[dict[str, Any]], pair_key: str | None
) -> tuple[Dataset | None, list[dict[str, Any]], dict[str, Any]]:
    """(the Dataset where it builds, one row per group, the fields' layouts).

    A row: `group`, `records` (None where unknown), `files` (per field: path, bytes,
    compression, and the word marking a bad file), `problem` (the error's text). Where one
    bad file stops the whole Dataset from building, each group is looked at on its own, so
    the other groups' rows are still there.
    """
    try:
        ds: Dataset | None = dataset_from_fields(specs, pair_key=pair_key)
    except (CorruptDataError, ReadError, StaleIndexError, PairingError) as whole:
        ds = None
        error: StokerError = whole
    if ds is not None:
        rows = []
        for g, infos in enumerate(ds.files):
            files = {
                n: {"path": i.path, "bytes": i.size, "compression": i.compression or "raw", "mark": None}
                for n, i in infos.items()
            }
            row: dict[str, Any] = {"group": g, "records": None, "files": files, "status": "ok", "problem": None}
            try:
                row["records"] = ds.records_in(g)
            except StokerError as e:  # keep going: the user wants every broken group, not the first
                _fail(row, e)
            rows.append(row)
        layouts = {
            n: {"dtype": f.dtype.name, "shape": list(f.shape), "record_bytes": f.record_bytes}
            for n, f in ds.fields.items()
        }
        return ds, rows, layouts
    from ..io.files import expand_files

    fields = build_fields(specs)
    paths = {n: expand_files(n, f) for n, f in fields.items()}
    if len({len(p) for p in paths.values()}) > 1:
        raise error  # files that pair by position cannot be told apart
    by_name = {s["name"]: s for s in specs}
    rows = []
    for g in range(len(next(iter(paths.values())))):
        files = {n: {"path": paths[n][g], "bytes": _file_bytes(paths[n][g]), "compression": "?", "mark": None}
                 for n in fields}  # fmt: skip
        row = {"group": g, "records": None, "files": files, "status": "ok", "problem": None}
        for n, f in files.items():  # each file alone first, so the row marks the one that is bad
            try:
                info = dataset_from_fields([{**by_name[n], "files": [f["path"]]}]).files[0][n]
                f["bytes"], f["compression"] = info.size, info.compression or "raw"
            except StokerError as e:
                if row["problem"] is None:
                    row["status"], row["problem"] = _problem_word(e), f"{type(e).__name__}: {e}"
                f["mark"] = _problem_word(e)
        if row["problem"] is None:
            try:
                group = [{**s, "files": [paths[s["name"]][g]]} for s in specs]
                row["records"] = dataset_from_fields(group, pair_key=pair_key).records_in(0)
            except StokerError as e:
                _fail(row, e)
        rows.append(row)
    layouts = {
        n: {"dtype": f.dtype.name, "shape": list(f.shape), "record_bytes": f.record_bytes} for n, f in fields.items()
    }
    return None, rows, layouts


def _file_bytes(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _fail(row: dict[str, Any], e: StokerError) -> None:
    """Say in `row` why its group cannot be read, marking the file the error names (a count
    mismatch is the group's, not one file's)."""
    row["status"], row["problem"] = _problem_word(e), f"{type(e).__name__}: {e}"
    if not isinstance(e, PairingError):
        for f in row["files"].values():
            if e.path is not None and f["path"] == e.path:
                f["mark"] = row["status"]


def _relative_base(rows: list[dict[str, Any]]) -> str | None:
    """The directory every local file lies under (rows then show paths relative to it)."""
    paths = [f["path"] for r in rows for f in r["files"].values()]
    if not paths or any("://" in p for p in paths):
        return None
    base = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    rel = os.path.relpath(base)
    return base if rel.startswith("..") else rel


def run(args: argparse.Namespace) -> int:
    specs = field_specs(args)
    if specs is not None:
        layout = "from --config " + args.config if args.config else "from --field"
    else:
        if not args.dir:
            raise SpecError("inspect needs a sample DIR, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] or --config")
        specs, layout = directory_layout(Path(args.dir), args.inrez)
    for flag, value in (("--values", args.values), ("--offset", args.offset)):
        if value < 0:
            raise SpecError(f"stoker inspect {flag} {value}: must be 0 or more")
    if not args.json:
        print(f"layout: {layout}", flush=True)  # said before anything is read: an error below may follow from it
    ds, rows, layouts = _inspect_rows(specs, args.pair_key)
    names = list(layouts)
    base = _relative_base(rows)
    bad = [r for r in rows if r["problem"] is not None]
    total = sum(r["records"] or 0 for r in rows if r["problem"] is None)
    nbytes = sum(f["bytes"] or 0 for r in rows for f in r["files"].values())
    values = _values(ds, specs, rows, args.values, args.offset) if args.values else []
    if args.json:
        doc = {
            "layout": layout,
            "fields": layouts,
            "base": base,
            "groups": [
                {**r, "files": {n: {**f, "path": _shown(f["path"], base)} for n, f in r["files"].items()}} for r in rows
            ],
            "total_records": total,
            "total_bytes": nbytes,
            "in_sync": not bad,
            "problems": [r["problem"] for r in bad],
            "values": [{"record": i, **{n: v.tolist() for n, v in rec.items()}} for i, rec in values],
        }
        print(json.dumps(doc, indent=2))
        return 1 if bad else 0
    print(
        f"{counted(len(rows), 'group')}, fields: "
        + ", ".join(
            f"{n} ({lay['dtype']}{lay['shape']}, {size(lay['record_bytes'])}/record)" for n, lay in layouts.items()
        )
    )
    if base is not None:
        print(f"files under {base}{os.sep}")
    shown = rows if args.groups or len(rows) <= SUMMARY_OVER else bad
    if len(rows) > SUMMARY_OVER and not args.groups:
        _print_summary(rows, names)
    if shown:
        if len(shown) < len(rows):
            print(f"groups that cannot be read ({len(shown)} of {len(rows)}):")
        table = [["group", "records", *(f"{n} (size, compression)" for n in names)]]
        for r in shown:
            records = str(r["records"]) if r["problem"] is None else r["status"]
            cells = []
            for n in names:
                f = r["files"][n]
                nbytes_shown = size(f["bytes"]) if f["bytes"] is not None else "?"
                mark = f", {f['mark']}" if f["mark"] else ""
                cells.append(f"{_shown(f['path'], base)} ({nbytes_shown}, {f['compression']}{mark})")
            table.append([str(r["group"]), records, *cells])
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            right = [c.rjust(w) for c, w in zip(row[:2], widths, strict=False)]
            left = [c.ljust(w) for c, w in zip(row[2:], widths[2:], strict=False)]
            print("  ".join(right + left).rstrip())
    print(f"total: {counted(total, 'record')}, {size(nbytes)} on disk")
    for i, rec in values:
        print(f"record {i}: " + "; ".join(f"{n} {_record_text(v)}" for n, v in rec.items()))
    if bad:
        where = counted(len(bad), "group")
        print(f"sync: OUT OF SYNC or unreadable in {where}; no record of those groups would be yielded:")
        for r in bad:
            print(f"  group {r['group']}: {r['problem']}")
        return 1
    print("sync: every group's fields hold the same number of records (in sync)")
    return 0


def _shown(path: str, base: str | None) -> str:
    if base is None:
        return path
    return os.path.relpath(os.path.abspath(path), os.path.abspath(base))


def _print_summary(rows: list[dict[str, Any]], names: list[str]) -> None:
    counts = sorted(r["records"] for r in rows if r["problem"] is None)
    if counts:
        med = counts[len(counts) // 2]
        print(f"records per group: min {counts[0]}, median {med}, max {counts[-1]} (a row per group: --groups)")
    for n in names:
        files = [r["files"][n] for r in rows]
        sizes = sorted(f["bytes"] for f in files if f["bytes"] is not None)
        kinds = sorted({f["compression"] for f in files} - {"?"}) or ["?"]
        spread = f" ({size(sizes[0])} to {size(sizes[-1])} a file)" if sizes else ""
        print(f"field {n}: {counted(len(files), 'file')}, {size(sum(sizes))}{spread}, {'/'.join(kinds)}")


def _values(
    ds: Dataset | None, specs: list[dict[str, Any]], rows: list[dict[str, Any]], count: int, offset: int
) -> list[tuple[int, dict[str, np.ndarray]]]:
    """`count` records from record `offset` on, over the groups that can be read."""
    good = [r["group"] for r in rows if r["problem"] is None]
    if not good:
        return []
    if ds is not None:
        readable: Dataset = ds if len(good) == len(rows) else ds.select(groups=good)
    else:
        by_name = {s["name"]: [rows[g]["files"][s["name"]]["path"] for g in good] for s in specs}
        readable = dataset_from_fields([{**s, "files": by_name[s["name"]]} for s in specs], pair_key="")
    n = len(readable)
    if offset >= n:
        raise SpecError(f"stoker inspect --offset {offset}: the readable groups hold {counted(n, 'record')}")
    picked = np.arange(offset, min(n, offset + count))
    batch = readable.read(picked)
    return [(int(i), {k: v[j] for k, v in batch.items()}) for j, i in enumerate(picked)]


def _record_text(v: np.ndarray) -> str:
    """A record's values in a line: scalars whole, arrays by shape, first values, min and max."""
    if v.ndim == 0:
        return repr(v.item())
    flat = v.reshape(-1)
    head = ", ".join(repr(x) for x in flat[:_VALUES_SHOWN].tolist())
    more = ", ..." if flat.size > _VALUES_SHOWN else ""
    return f"{list(v.shape)} [{head}{more}] min {flat.min().item()!r} max {flat.max().item()!r}"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "inspect",
        help="groups, records, bytes, compression and whether the fields are in sync",
        description="Show how the fields' files pair into groups, their record counts, sizes "
        "and compression, and whether every group's fields agree. Exits 1 when a group is out "
        "of sync or cannot be read (its row says which file).",
        epilog=EXAMPLES,
    )
    add_dir_args(p, "default: give --field or --config instead")
    add_field_args(p)
    p.add_argument(
        "--groups",
        action="store_true",
        help=f"a row for every group (default: rows up to {SUMMARY_OVER} groups, a summary and the "
        "groups with problems beyond)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table (default: off)")
    p.add_argument(
        "--values",
        type=int,
        default=0,
        metavar="N",
        help="print the values of N records, from --offset on (default: 0, none)",
    )
    p.add_argument("--offset", type=int, default=0, metavar="I", help="the first record --values prints (default: 0)")
    p.set_defaults(run=run)
    return p
