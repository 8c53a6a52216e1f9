"""mkdocs hooks: the command-line reference, rendered from the parser the `stoker` command runs,
and the benchmark charts taken from where benchmarks/compare.py and benchmarks/au.py write them.

docs/reference/cli.md holds the marker below; at build time it becomes each subcommand's `--help`,
so the page can never drift from the code. The chart is added to the site's files from
benchmarks/results/, so the page shows the latest run without a copy to keep in step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- stoker-cli-help -->"
REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
CHARTS = {
    "assets/compare.png": REPO / "benchmarks" / "results" / "compare.png",
    "assets/au.png": REPO / "benchmarks" / "results" / "au.png",
}


def _help(parser: argparse.ArgumentParser) -> str:
    # A fixed width, so the page reads the same whatever terminal built it.
    os.environ["COLUMNS"] = "100"
    return parser.format_help().rstrip()


def cli_reference() -> str:
    """Markdown for `stoker --help` and every subcommand's `--help`."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    from stoker.cli import build_parser

    parser = build_parser()
    parts = ["## stoker", "", "```text", _help(parser), "```"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts += ["", f"## stoker {name}", "", "```text", _help(sub), "```"]
    return "\n".join(parts) + "\n"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown


def on_files(files: Any, config: Any, **_: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, path in CHARTS.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
