"""mkdocs hooks: the pages generated from the code, kept in the repository so that they read the
same unbuilt (on a forge) as built, and the benchmark charts.

Two pages are generated: docs/reference/cli.md ends with each command's `--help`, from the parser
the `stoker` command runs, and docs/performance/verdicts.md is a copy of src/stoker/verdicts.md,
the explanations `stoker explain` prints from the installed package. `python docs/hooks.py`
rewrites both; the docs build (and tests/test_docs.py) fails while either is stale, so neither can
drift from the code. The help is generated under the Python `make` uses (argparse's layout moves
between Python versions).

The charts are linked where benchmarks/compare.py and benchmarks/au.py write them
(../benchmarks/results/NAME.png from docs/), and the site serves them from there, so the pages
show the latest run on a forge and on the site alike, with no copy to keep in step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SRC = REPO / "src"
CLI_PAGE = DOCS / "reference" / "cli.md"
VERDICTS_PAGE = DOCS / "performance" / "verdicts.md"
VERDICTS_SOURCE = SRC / "stoker" / "verdicts.md"
# Everything after this line of docs/reference/cli.md is generated.
CLI_MARKER = "<!-- Generated below by `python docs/hooks.py` from stoker.cli.build_parser(): edit the parser. -->"
# The charts, as the pages link them from docs/: ../benchmarks/results/NAME.png.
CHARTS = ("compare.png", "au.png")
# Where the site serves them (a built page's relative link is rewritten to it).
CHARTS_SERVED = "assets/{}"

log = logging.getLogger("mkdocs.hooks.stoker")


def _help(parser: argparse.ArgumentParser) -> str:
    # A fixed width, so the page reads the same whatever terminal made it.
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return parser.format_help().rstrip()
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


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


def generated_pages() -> dict[Path, str]:
    """Each generated page and the text it should hold now."""
    cli = CLI_PAGE.read_text(encoding="utf-8")
    if CLI_MARKER not in cli:
        raise ValueError(f"{CLI_PAGE}: the line {CLI_MARKER!r} is missing: the generated help goes after it")
    head = cli.split(CLI_MARKER, 1)[0]
    return {
        CLI_PAGE: f"{head}{CLI_MARKER}\n\n{cli_reference()}",
        VERDICTS_PAGE: VERDICTS_SOURCE.read_text(encoding="utf-8"),
    }


def stale_pages() -> list[Path]:
    """The generated pages whose text in the repository is not what the code makes now."""
    return [path for path, text in generated_pages().items() if path.read_text(encoding="utf-8") != text]


def on_pre_build(config: Any, **_: Any) -> None:
    for path in stale_pages():
        # A warning fails the strict build.
        log.warning("%s is stale: `python docs/hooks.py` rewrites it", path.relative_to(REPO))


def on_files(files: Any, config: Any, **_: Any) -> Any:
    from mkdocs.structure.files import File, InclusionLevel

    for name in CHARTS:
        # Known by the path a page at the docs root links it by, so the link resolves built and
        # unbuilt; included explicitly, as mkdocs leaves out paths with a part starting with a dot.
        chart = File.generated(
            config,
            f"../benchmarks/results/{name}",
            abs_src_path=str(REPO / "benchmarks" / "results" / name),
            inclusion=InclusionLevel.INCLUDED,
        )
        chart.dest_uri = CHARTS_SERVED.format(name)
        files.append(chart)
    return files


if __name__ == "__main__":
    for path, text in generated_pages().items():
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
