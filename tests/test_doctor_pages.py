"""Every verdict of stoker.doctor ends with the command that explains it, and that command has an
explanation for every verdict the code can give, shipped inside the package."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import tomllib
from importlib import resources
from pathlib import Path

import pytest

import stoker
import stoker.doctor
from stoker.doctor import EXPLAIN_COMMAND, VERDICT_IDS, VERDICTS_FILE, explain, verdict

ROOT = Path(__file__).resolve().parents[1]


def _shipped() -> str:
    return resources.files("stoker").joinpath(VERDICTS_FILE).read_text(encoding="utf-8")


def _headings() -> list[str]:
    return re.findall(r"^## (\S+)$", _shipped(), flags=re.MULTILINE)


def _anchors_said_in_the_code() -> set[str]:
    tree = ast.parse(inspect.getsource(stoker.doctor))
    said = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_see":
            first = node.args[0]
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), ast.dump(first)
            said.add(first.value)
    return said


def test_each_verdict_id_is_a_section_of_the_shipped_explanations_and_nothing_else_is() -> None:
    headings = _headings()
    assert len(headings) == len(set(headings)), headings
    assert sorted(headings) == sorted(VERDICT_IDS)


def test_every_verdict_the_code_returns_names_a_known_section_and_every_section_is_returned() -> None:
    assert _anchors_said_in_the_code() == set(VERDICT_IDS)


@pytest.mark.parametrize("section", VERDICT_IDS)
def test_every_section_has_an_explanation_with_its_example_and_no_markdown_links(section: str) -> None:
    said = explain(section)
    lines = said.splitlines()
    assert lines[0] == section and lines[1] == ""
    assert lines[2].startswith("    ") and len(lines[2].strip()) > 20, "the example verdict, indented"
    assert len(said) > 200, said
    assert "](" not in said and "```" not in said and "## " not in said, said


def test_a_link_to_another_section_is_the_command_that_prints_it() -> None:
    assert f"As in\ncopy-with-cast ({EXPLAIN_COMMAND} copy-with-cast): keep the stored dtype" in explain("cast")


def test_no_section_lists_them_all() -> None:
    listed = explain().splitlines()
    assert listed[0] == "stoker explain SECTION prints one of:"
    assert [line.strip() for line in listed[1:]] == list(VERDICT_IDS)


def test_an_unknown_section_names_the_nearest() -> None:
    nearest = r"section='storage-bond' is no verdict's section; did you mean storage-bound\?"
    with pytest.raises(ValueError, match=nearest):
        explain("storage-bond")
    with pytest.raises(ValueError, match=r"section='xyz' is no verdict's section \(stoker explain lists them\)"):
        explain("xyz")


def test_a_verdict_ends_with_the_command_that_explains_it(pair_ds: stoker.Dataset) -> None:
    with pair_ds.loader(4) as loader:
        empty = loader.stats()
    assert verdict(empty) == "no batches delivered yet: nothing to diagnose; see: stoker explain no-batches"
    waiting = dataclasses.replace(empty, batches=10, consumer_seconds=0.9, wait_seconds=0.1)
    said = verdict(waiting)
    assert said.startswith("consumer-bound: ") and said.endswith("; see: stoker explain consumer-bound")


def test_the_wheel_carries_the_explanations() -> None:
    """The package data the wheel build takes (pyproject.toml) names the file, and the package
    this test imports finds it where an installed package would, beside its modules."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["stoker"]
    assert VERDICTS_FILE in package_data
    shipped = resources.files("stoker").joinpath(VERDICTS_FILE)
    assert shipped.is_file() and Path(str(shipped)).parent == Path(stoker.__file__).parent
