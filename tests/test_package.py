"""The package's surface: what a bare ``import stoker`` gives and what it costs."""

from __future__ import annotations

import subprocess
import sys

import pytest

import stoker


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


def test_import_stoker_loads_no_framework() -> None:
    out = _run(
        "import sys, stoker; "
        "print(sorted(m for m in ('tensorflow', 'torch', 'jax', 'ray', 'keras') if m in sys.modules))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["doctor", "testing", "order", "transforms", "kernels"])
def test_numpy_only_submodules_are_attributes_after_import_stoker(name: str) -> None:
    out = _run(f"import sys, stoker; m = stoker.{name}; print(m.__name__, 'tensorflow' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"stoker.{name}", "False"]


def test_doctor_verdict_and_assert_resumable_reachable_from_import_stoker() -> None:
    out = _run("import stoker; print(callable(stoker.doctor.verdict), callable(stoker.testing.assert_resumable))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.torch
def test_torch_adapter_is_an_attribute_after_import_stoker() -> None:
    out = _run("import stoker; print(stoker.torch.__name__, callable(stoker.torch.shard_from_distributed))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["stoker.torch", "True"]


def test_unknown_attribute_names_the_module() -> None:
    with pytest.raises(AttributeError, match="module 'stoker' has no attribute 'nope'"):
        stoker.nope  # noqa: B018


def test_dir_lists_the_lazy_submodules_and_the_public_names() -> None:
    names = dir(stoker)
    assert {"tf", "torch", "jax", "ray", "doctor", "testing"} <= set(names)
    assert set(stoker.__all__) <= set(names)
