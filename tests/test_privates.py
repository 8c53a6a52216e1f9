"""No module of stoker reaches into another module's private names (`other._name`): where one
needs something of another, that one offers it as a public hook (`Loader.state_at`,
`Loader.use_allocator`, `Loader.stage`, `Dataset.catalog`). The engine's modules are one room
and may share their internals; the allow-list names third-party privates stoker has to use."""

from __future__ import annotations

import ast
from pathlib import Path

import stoker

ROOT = Path(stoker.__file__).parent

# (module, attribute): privates of other libraries, each with its reason.
ALLOWED = {
    ("ray.py", "_replace"): "namedtuple's public copy-with-changes, underscored to avoid field names",
    ("tf/iterator.py", "_variant_tensor"): "tf.data's handle to a dataset graph; no public accessor",
    ("io/remote.py", "_info"): "s3fs: the HEAD of one object, without listing its directory",
    ("io/remote.py", "_call_s3"): "s3fs: a ranged GET with the object's ETag as a precondition",
    ("io/remote.py", "_strip_protocol"): "fsspec: the bucket path of a URL, as the filesystem spells it",
    ("cli/main.py", "_SubParsersAction"): "argparse: the type of add_subparsers()'s action, not exported",
    ("cli/main.py", "_option_string_actions"): "argparse: a parser's options by spelling, for a did-you-mean hint",
}


def _defined_privates(tree: ast.Module) -> set[str]:
    """Private names a module defines: its functions, classes, module names and self attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _reaches() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        if module.startswith("engine/"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        own = _defined_privates(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or (module, node.attr) in ALLOWED:
                continue
            found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_engine_reaches_into_another_modules_privates() -> None:
    assert _reaches() == []


def test_the_allow_list_names_only_privates_still_used() -> None:
    used = set()
    for module, attr in ALLOWED:
        if f".{attr}" in (ROOT / module).read_text():
            used.add((module, attr))
    assert used == set(ALLOWED)
