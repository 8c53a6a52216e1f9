"""Where a command's fields come from: `--field` words, a `stoker.toml`, or a directory.

`stoker.toml` is a format: its keys are checked here, so a misspelt one (`header_byte`) is an
error naming the key, the file and the key it was probably meant to be, never a default quietly
used in its place. docs/reference/stoker-toml.md documents every key.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..dataset import Dataset
from ..errors import SpecError
from ..spec import Field

__all__ = [
    "CONFIG_NAME",
    "FIELD_KEYS",
    "add_dir_args",
    "add_field_args",
    "build_fields",
    "dataset_from_fields",
    "directory_layout",
    "field_specs",
    "fields_from_config",
    "parse_field",
]

CONFIG_NAME = "stoker.toml"
# The keys of a [fields.NAME] table: (the types TOML may give, what the docs call that type).
FIELD_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "files": ((str, list), "a string or a list of strings"),
    "dtype": ((str,), "a string"),
    "shape": ((list, int), "a list of integers"),
    "header_bytes": ((int,), "an integer"),
    "footer_bytes": ((int,), "an integer"),
    "compression": ((str,), "a string"),
    "byte_order": ((str,), "a string"),
}
_TOP_KEYS = ("fields",)
_COMPRESSION_WORDS = {"gzip": "gzip", "zlib": "zlib", "none": None, "raw": None, "auto": "auto"}


def parse_field(text: str) -> dict[str, Any]:
    """`NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]` (shape as `128x128x1`) -> field settings."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise SpecError(f"--field {text!r} must look like NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]")
    parts = rest.split(":")
    # The glob may itself hold ':'; dtype, shape and compression are the known tail words.
    tail: list[str] = []
    while len(parts) > 1 and len(tail) < 3 and not parts[-1].startswith("//"):  # '//': a URL's, after its scheme
        tail.insert(0, parts.pop())
    files = ":".join(parts)
    if not tail:
        raise SpecError(f"--field {text!r} names no dtype; use NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]")
    spec: dict[str, Any] = {"name": name, "files": files, "dtype": tail[0], "shape": [], "compression": "auto"}
    for word in tail[1:]:
        if word.lower() in _COMPRESSION_WORDS:
            spec["compression"] = _COMPRESSION_WORDS[word.lower()]
        elif word and all(p.isdigit() for p in word.lower().split("x")):
            spec["shape"] = [int(p) for p in word.lower().split("x")]
        else:
            raise SpecError(f"--field {text!r}: {word!r} is neither a shape like 128x128x1 nor a compression")
    return spec


def _nearest(key: str, valid: Sequence[str]) -> str:
    """`; did you mean X?` for the valid key nearest `key`, or the valid keys where none is near."""
    near = difflib.get_close_matches(key, valid, n=1)
    return f"did you mean {near[0]}?" if near else f"valid keys: {', '.join(valid)}"


def fields_from_config(path: str) -> list[dict[str, Any]]:
    """The fields of a `stoker.toml`, globs made relative to its directory; a SpecError naming
    the file (and the table and key) for anything that is not the format."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise SpecError(f"cannot read config {path!r}: {e.strerror}", path=path) from e
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"config {path!r} is not valid TOML: {e}", path=path) from e
    for key in doc:
        if key not in _TOP_KEYS:
            raise SpecError(f"config {path!r}: unknown key {key!r}; {_nearest(key, _TOP_KEYS)}", path=path)
    table = doc.get("fields")
    if not isinstance(table, Mapping) or not table:
        raise SpecError(f"config {path!r} has no [fields.NAME] tables", path=path)
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for name, spec in table.items():
        if not isinstance(spec, Mapping):
            raise SpecError(f"config {path!r}: fields.{name} must be a table [fields.{name}]", path=path, field=name)
        for key, value in spec.items():
            if key not in FIELD_KEYS:
                raise SpecError(
                    f"config {path!r}: unknown key {key!r} in [fields.{name}]; {_nearest(key, list(FIELD_KEYS))}",
                    path=path,
                    field=name,
                )
            types, said = FIELD_KEYS[key]
            if isinstance(value, bool) or not isinstance(value, types):
                raise SpecError(
                    f"config {path!r}: [fields.{name}] {key} = {value!r} must be {said}", path=path, field=name
                )
        if "files" not in spec or "dtype" not in spec:
            raise SpecError(f"config {path!r}: [fields.{name}] needs files and dtype", path=path, field=name)
        files = spec["files"]
        if isinstance(files, str):
            files = files if os.path.isabs(files) else os.path.join(base, files)
        else:
            files = [p if os.path.isabs(p) else os.path.join(base, p) for p in files]
        out.append({**spec, "name": name, "files": files})
    return out


def dataset_from_fields(
    specs: Sequence[Mapping[str, Any]], *, pair_key: str | None = None, index: str = "auto"
) -> Dataset:
    """A Dataset from field settings as `parse_field` or a config file give them."""
    return Dataset(build_fields(specs), pair_key=pair_key, index=index)


def build_fields(specs: Sequence[Mapping[str, Any]]) -> dict[str, Field]:
    fields = {}
    for s in specs:
        compression = s.get("compression", "auto")
        if isinstance(compression, str) and compression.lower() in ("none", "raw"):
            compression = None
        fields[s["name"]] = Field(
            s["files"],
            s["dtype"],
            tuple(s.get("shape", ())) if not isinstance(s.get("shape"), int) else s["shape"],
            header_bytes=int(s.get("header_bytes", 0)),
            footer_bytes=int(s.get("footer_bytes", 0)),
            compression=compression,
            byte_order=s.get("byte_order"),
        )
    return fields


def add_field_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--field",
        action="append",
        metavar="NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]",
        help="a field of the dataset, repeated for each field; SHAPE as 128x128x1, COMPRESSION "
        "gzip, zlib, none or auto (default: no --field: DIR's fields)",
    )
    p.add_argument(
        "--config",
        metavar="stoker.toml",
        help="read [fields.NAME] tables from a TOML file (default: none; DIR/stoker.toml for a DIR)",
    )


def add_dir_args(p: argparse.ArgumentParser, what: str, *, inrez_help: str | None = None) -> None:
    p.add_argument("dir", nargs="?", help=f"a directory with a stoker.toml, or written by `stoker sample` ({what})")
    p.add_argument(
        "--inrez",
        type=int,
        default=None,
        help=inrez_help or "frame size of a sample DIR (default: its stoker.toml; 128 where it has none)",
    )
    p.add_argument(
        "--pair-key",
        default=None,
        metavar="REGEX",
        help="regex whose match must agree across a group's basenames "
        "(default: the numbers in the basenames; '' turns the check off)",
    )


def field_specs(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The fields `--field` or `--config` give, or None where neither is given."""
    if args.config and args.field:
        raise SpecError("give --field or --config, not both")
    if args.config:
        return fields_from_config(args.config)
    if args.field:
        return [parse_field(f) for f in args.field]
    return None


def directory_layout(
    directory: Path, inrez: int | None, *, say_assumed: bool = False
) -> tuple[list[dict[str, Any]], str]:
    """(a directory's fields, a sentence saying where they came from): its `stoker.toml` unless
    `--inrez` says otherwise, else the `stoker sample` layout, assumed (said on stderr where
    `say_assumed`). A directory that is not there is a SpecError saying so, before any glob."""
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise SpecError(f"{what}: {directory}", path=str(directory))
    config = directory / CONFIG_NAME
    if inrez is None and config.is_file():
        return fields_from_config(str(config)), f"from {config}"
    given = inrez is not None
    inrez = 128 if inrez is None else inrez
    specs: list[dict[str, Any]] = [
        {"name": "image", "files": str(directory / "img_*.bin"), "dtype": "int8", "shape": [inrez, inrez, 1]},
        {"name": "label", "files": str(directory / "out_*.bin.gz"), "dtype": "float32", "compression": "gzip"},
    ]
    shape = f"{inrez}x{inrez}x1"
    if given:
        return specs, f"the `stoker sample` layout with --inrez {inrez} (image int8 {shape}, label float32 gzip)"
    layout = (
        f"{directory} has no {CONFIG_NAME}: assumed the `stoker sample` layout (img_*.bin int8 {shape}, "
        "out_*.bin.gz float32 gzip); give another with --inrez N, --field NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION] "
        "or --config FILE"
    )
    if say_assumed:
        print(f"stoker: {layout}", file=sys.stderr)
    return specs, layout
