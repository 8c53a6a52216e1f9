"""Field settings from `--field` words or a TOML config, and the Dataset they describe."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from ..dataset import Dataset
from ..errors import SpecError
from ..spec import Field

__all__ = ["build_fields", "dataset_from_fields", "fields_from_config", "parse_field"]

_COMPRESSION_WORDS = {"gzip": "gzip", "zlib": "zlib", "none": None, "raw": None, "auto": "auto"}


def parse_field(text: str) -> dict[str, Any]:
    """`NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]` (shape as `128x128x1`) -> field settings."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise SpecError(f"--field {text!r} must look like NAME=GLOB:DTYPE[:SHAPE][:COMPRESSION]")
    parts = rest.split(":")
    # The glob may itself hold ':'; dtype, shape and compression are the known tail words.
    tail: list[str] = []
    while len(parts) > 1 and len(tail) < 3:
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


def fields_from_config(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise SpecError(f"cannot read config {path!r}: {e.strerror}", path=path) from e
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"config {path!r} is not valid TOML: {e}", path=path) from e
    table = doc.get("fields")
    if not isinstance(table, Mapping) or not table:
        raise SpecError(f"config {path!r} has no [fields.NAME] tables", path=path)
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for name, spec in table.items():
        if not isinstance(spec, Mapping) or "files" not in spec or "dtype" not in spec:
            raise SpecError(f"config {path!r}: [fields.{name}] needs files and dtype", path=path, field=name)
        files = spec["files"]
        if isinstance(files, str):
            files = files if os.path.isabs(files) else os.path.join(base, files)
        elif isinstance(files, list):
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
            tuple(s.get("shape", ())),
            header_bytes=int(s.get("header_bytes", 0)),
            footer_bytes=int(s.get("footer_bytes", 0)),
            compression=compression,
            byte_order=s.get("byte_order"),
        )
    return fields
