"""The `stoker` command's parser, assembled from one module per command, and `main`."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import StokerError

__all__ = ["Parser", "build_parser", "main"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions wrapped as argparse wraps them; epilogs (the examples) kept line for line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class Parser(argparse.ArgumentParser):
    """argparse, with no abbreviated options (`--group` is not `--groups`), and a mistake told
    with the usage of the command it was made in and the nearest valid word."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        bad = _INVALID_CHOICE.search(message)
        if bad:
            choices = [c.strip(" '") for c in bad.group(2).split(",")]  # quoted or not, by Python version
            message += _suggest(bad.group(1), choices)
        super().error(message)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        # A subcommand hands the words it does not know up to here; it is the one to say so.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self._commands().get(getattr(parsed, "command", None) or "", self)
            first = extras[0]
            hint = _suggest(first.split("=", 1)[0], list(owner._option_string_actions)) if first.startswith("-") else ""
            owner.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def _commands(self) -> dict[str, Parser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def _suggest(word: str, choices: Sequence[str]) -> str:
    """`; did you mean X?` for the choice nearest `word`, or "" where none is near."""
    near = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {near[0]}?" if near else ""


def _version() -> str:
    from .. import __version__
    from ..kernels import compiled

    kernels = "compiled kernels" if compiled() else "no compiled kernels: the numpy slow path"
    return f"stoker {__version__} ({kernels}; Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    """The parser of `stoker` and its commands, each command's arguments declared by its module."""
    # Here rather than at the top: `python -m stoker.cli.bench` (a benchmark's child process)
    # loads this package first, and must not find its own module loaded already.
    from . import bench, explain, index, inspect, sample

    parser = Parser(
        prog="stoker",
        description="Feed accelerators from fixed-length record files.",
        epilog="`stoker COMMAND --help` shows each command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (sample, inspect, index, bench, explain):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `stoker` command with `argv` (default: the process's); return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except StokerError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `stoker inspect ... | head`: the reader left; no traceback for that
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
