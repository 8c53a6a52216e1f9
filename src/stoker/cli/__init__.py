"""The `stoker` command: a thin layer over the public API (sample, inspect, index, bench, explain).

`main` and the parser are in `stoker.cli.main`; each command's arguments and run in its own
module (`sample`, `inspect`, `index`, `bench`, `explain`); where fields come from in `config`.
"""

from __future__ import annotations

from .config import dataset_from_fields, parse_field
from .main import build_parser, main

__all__ = ["build_parser", "dataset_from_fields", "main", "parse_field"]
