"""Every verdict of stoker.doctor names a section of docs/performance/verdicts.md, and every section is a verdict's."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import stoker
import stoker.doctor
from stoker.doctor import VERDICT_IDS, VERDICTS_PAGE, verdict

ROOT = Path(__file__).resolve().parents[1]


def _headings() -> list[str]:
    text = (ROOT / VERDICTS_PAGE).read_text()
    return re.findall(r"^## (\S+)$", text, flags=re.MULTILINE)


def _anchors_said_in_the_code() -> set[str]:
    tree = ast.parse(inspect.getsource(stoker.doctor))
    said = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_see":
            first = node.args[0]
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), ast.dump(first)
            said.add(first.value)
    return said


def test_each_verdict_id_is_a_section_heading_of_the_verdicts_page_and_nothing_else_is() -> None:
    headings = _headings()
    assert len(headings) == len(set(headings)), headings
    assert sorted(headings) == sorted(VERDICT_IDS)


def test_every_verdict_the_code_returns_names_a_known_section_and_every_section_is_returned() -> None:
    assert _anchors_said_in_the_code() == set(VERDICT_IDS)


def test_a_verdict_ends_with_its_page_and_anchor(pair_ds: stoker.Dataset) -> None:
    with pair_ds.loader(4) as loader:
        empty = loader.stats()
    assert verdict(empty) == f"no batches delivered yet: nothing to diagnose; see {VERDICTS_PAGE}#no-batches"
    waiting = dataclasses.replace(empty, batches=10, consumer_seconds=0.9, wait_seconds=0.1)
    said = verdict(waiting)
    assert said.startswith("consumer-bound: ") and said.endswith(f"; see {VERDICTS_PAGE}#consumer-bound")
