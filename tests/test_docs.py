"""Every example a user reads runs: the README's and docs/'s Python fences, and the docstrings' ``>>>``.

The contract both README.md and docs/**/*.md are written to: the ```python fences of one page run
in order in one namespace, which starts with a no-op ``train_step`` and nothing else, in a fresh
directory holding ``data/``, the sample ``stoker sample data --pairs 4 --records 256`` writes.
``<!-- requires: NAME -->`` before a fence marks the page with NAME's marker (and skips the rest
of the page where NAME is not installed: `make test` installs all of them); ``<!-- skip: next -->``
leaves the next fence out (one that needs a GPU, a cluster or a bucket, and says so). Docstring
examples run the same way, in their module's namespace plus ``ds``, a Dataset of that sample.
"""

from __future__ import annotations

import doctest
import gc
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Region
from sybil.document import PythonDocStringDocument
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer
from sybil.parsers.rest import DocTestParser

import stoker
from stoker.cli import main as stoker_main

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# What the README's Quickstart tells a user to run first; the harness runs exactly this.
SAMPLE_ARGS = ("sample", "data", "--pairs", "4", "--records", "256")

# requires: NAME -> (the module it needs, the pytest marker of the page)
REQUIRES: dict[str, tuple[str, pytest.MarkDecorator]] = {
    "tensorflow": ("tensorflow", pytest.mark.tf),
    "torch": ("torch", pytest.mark.torch),
    "jax": ("jax", pytest.mark.jax),
    "ray": ("ray", pytest.mark.ray),
    "keras": ("keras", pytest.mark.keras),
    "remote": ("fsspec", pytest.mark.remote),
}
REQUIRES_RE = re.compile(r"<!--\s*requires:\s*(\S+)\s*-->")
# Docstrings of a framework's module need that framework, like a page's `requires`.
MODULE_MARKS = {"tf": "tensorflow", "torch": "torch", "jax": "jax", "ray": "ray", "keras": "keras", "remote": "remote"}


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _docstring_modules() -> list[Path]:
    return sorted(p for p in (SRC / "stoker").rglob("*.py") if ">>>" in p.read_text(encoding="utf-8"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class RequiresParser:
    """``<!-- requires: NAME -->``: the rest of the page needs NAME; skip it where NAME is missing."""

    lexer = DirectiveInHTMLCommentLexer("requires")

    def __call__(self, document: Document) -> Iterator[Region]:
        for region in self.lexer(document):
            yield Region(region.start, region.end, region.lexemes["arguments"].strip(), self.evaluate)

    @staticmethod
    def evaluate(example: Example) -> None:
        name = example.parsed
        if name not in REQUIRES:
            raise ValueError(f"{example.path}:{example.line}: requires: {name!r} is none of {sorted(REQUIRES)}")
        module = REQUIRES[name][0]
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{example.path}:{example.line}: needs {module}, not installed")


PAGE_PARSERS = (PythonCodeBlockParser(), SkipParser(), RequiresParser())
DOCTEST_PARSER = DocTestParser(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)


def _page_params() -> Iterable[Any]:
    for path in _documents():
        names = REQUIRES_RE.findall(path.read_text(encoding="utf-8"))
        marks = [REQUIRES[n][1] for n in dict.fromkeys(names) if n in REQUIRES]
        yield pytest.param(path, marks=marks, id=str(path.relative_to(ROOT)))


def _module_params() -> Iterable[Any]:
    for path in _docstring_modules():
        parts = path.relative_to(SRC / "stoker").with_suffix("").parts
        marks = [REQUIRES[MODULE_MARKS[p]][1] for p in parts if p in MODULE_MARKS]
        yield pytest.param(path, marks=marks, id=_module_name(path))


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding data/, written once by the CLI command the Quickstart shows."""
    where = tmp_path_factory.mktemp("docs-sample")
    previous = Path.cwd()
    try:
        os.chdir(where)
        assert stoker_main(list(SAMPLE_ARGS)) == 0
    finally:
        os.chdir(previous)
    return where


@pytest.fixture
def in_sample(sample_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cwd with its own copy of data/ (an example may write an index there), cleaned after."""
    shutil.copytree(sample_dir / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    gc.collect()  # loaders a page left unclosed: their threads stop when they are collected


def _run(document: Document) -> int:
    """Evaluate the document's examples in order; returns how many were evaluated."""
    evaluated = 0
    for example in document:
        example.evaluate()
        evaluated += 1
    return evaluated


@pytest.mark.parametrize("path", list(_page_params()))
def test_page_examples_run(path: Path, in_sample: Path) -> None:
    document = Document.parse(str(path), *PAGE_PARSERS)
    document.namespace.clear()
    document.namespace["train_step"] = lambda *a, **k: None
    _run(document)
    document.namespace.clear()


@pytest.mark.parametrize("path", list(_module_params()))
def test_docstring_examples_run(path: Path, in_sample: Path) -> None:
    document = PythonDocStringDocument.parse(str(path), DOCTEST_PARSER)
    document.pop_evaluator(document.import_document)  # the module as the package has it, not a second copy
    document.namespace.update(vars(importlib.import_module(_module_name(path))))
    document.namespace["train_step"] = lambda *a, **k: None
    document.namespace["stoker"] = stoker
    document.namespace["ds"] = stoker.Dataset(
        image=stoker.Field("data/img_*.bin", "int8", (128, 128, 1)),
        label=stoker.Field("data/out_*.bin.gz", "float32", compression="gzip"),
    )
    assert _run(document) > 0, f"{path}: no docstring example was found"
    document.namespace.clear()


def test_readme_python_fences_are_all_found() -> None:
    """Every ```python fence of the README is an example the harness runs: none is silently left out."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    fences = len(re.findall(r"^```python$", text, re.MULTILINE))
    found = len(list(Document.parse(str(ROOT / "README.md"), PythonCodeBlockParser())))
    assert fences >= 8
    assert found == fences


def test_quickstart_sample_command_is_the_one_the_harness_runs() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    sh, python = re.findall(r"^```(\w+)\n(.*?)^```$", quickstart, re.MULTILINE | re.DOTALL)[:2]
    assert sh[0] == "sh" and python[0] == "python"
    assert shlex.split(sh[1]) == ["stoker", *SAMPLE_ARGS]
    assert "train_step(" in python[1] and "data/" in python[1]


NARRATIVE = {
    "a date": re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),
    "a clock time": re.compile(r"\b(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?\b"),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b"),
    "'this VM'": re.compile(r"this VM", re.IGNORECASE),
}


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in _documents()])
def test_docs_hold_no_measurement_narrative(path: Path) -> None:
    """Figures come from benchmarks/results/ with their command; dates, times and hashes stay there."""
    text = path.read_text(encoding="utf-8")
    found = [
        f"{what}: {m.group(0)!r} at line {text.count(chr(10), 0, m.start()) + 1}"
        for what, pattern in NARRATIVE.items()
        for m in pattern.finditer(text)
    ]
    assert not found, f"{path.relative_to(ROOT)} holds " + "; ".join(found)


def test_readme_links_resolve() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    local = [t for t in targets if t and "://" not in t]
    assert local, "the README links to no local file"
    missing = sorted({t for t in local if not (ROOT / t).exists()})
    assert not missing, f"README.md links to missing files: {missing}"


def test_generated_pages_are_what_the_code_makes_now() -> None:
    """docs/reference/cli.md (the commands' --help) and docs/performance/verdicts.md (the
    package's explanations) read unbuilt as built: `python docs/hooks.py` rewrites them."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    pages = hooks.generated_pages()
    assert set(pages) == {ROOT / "docs" / "reference" / "cli.md", ROOT / "docs" / "performance" / "verdicts.md"}
    assert "## stoker explain\n" in pages[ROOT / "docs" / "reference" / "cli.md"]
    assert hooks.stale_pages() == [], "stale: run `python docs/hooks.py`"
