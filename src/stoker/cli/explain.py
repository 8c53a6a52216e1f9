"""`stoker explain`: what a verdict of `stoker bench` or `stoker.doctor` means and what to change."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]

EXAMPLES = """\
examples:
  stoker explain storage-bound         # the last words of a verdict: its explanation
  stoker explain                       # the sections there are
"""


def run(args: argparse.Namespace) -> int:
    from ..doctor import explain

    print(explain(args.section))
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from ..doctor import VERDICT_IDS

    p: argparse.ArgumentParser = sub.add_parser(
        "explain",
        help="explain a verdict (`...; see: stoker explain SECTION`) and what would move it",
        description="Print the explanation of one kind of verdict, as the verdicts page of the docs has it.",
        epilog=EXAMPLES,
    )
    p.add_argument(
        "section",
        nargs="?",
        choices=VERDICT_IDS,
        metavar="SECTION",
        help="the last word of a verdict, e.g. storage-bound (default: list the sections)",
    )
    p.set_defaults(run=run)
    return p
