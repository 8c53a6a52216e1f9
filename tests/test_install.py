"""Install and first contact: the version, a wheel with its kernels, the slow path said, Linux-only parts."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker.cli import main
from stoker.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_version_is_the_installed_package_metadata() -> None:
    assert stoker.__version__ == importlib.metadata.version("stoker") == _pyproject_version()
    with pytest.raises(AttributeError, match="no attribute 'not_there'"):
        stoker.not_there  # noqa: B018


def test_cli_version_prints_the_version_and_whether_kernels_are_compiled(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"stoker {_pyproject_version()} ") and "compiled kernels" in out


_NO_KERNELS = """
import sys, warnings
sys.modules["stoker._kernels"] = None  # as an install without a C compiler: the import fails
import numpy as np
import stoker
ds = stoker.Dataset(x=stoker.Field(sys.argv[1], "int16", (4,)))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):  # two loaders, several batches and casts: said once all the same
        with ds.loader(3, cast="float32", threads=1) as loader:
            got = np.concatenate([b["x"] for b in loader])
said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
assert not stoker.kernels.compiled()
print(len(said), said[0] if said else "", got.shape, got[-1].tolist())
"""


def test_missing_kernels_are_said_once_naming_the_slow_path(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    np.arange(40, dtype="<i2").tofile(path)
    run = subprocess.run([sys.executable, "-c", _NO_KERNELS, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    count, _, rest = run.stdout.partition(" ")
    assert count == "1", run.stdout
    assert "stoker._kernels" in rest and "slow path" in rest and "C compiler" in rest
    assert rest.rstrip().endswith("(10, 4) [36.0, 37.0, 38.0, 39.0]")  # the same values, by numpy


def _double(batch: dict, rng: object) -> dict:
    return {k: v * 2 for k, v in batch.items()}


@pytest.fixture
def tiny(tmp_path: Path) -> stoker.Dataset:
    np.arange(32, dtype="<f4").tofile(tmp_path / "x.bin")
    return stoker.Dataset(x=stoker.Field(str(tmp_path / "x.bin"), "float32"))


def test_process_workers_off_linux_are_a_clear_spec_error(
    tiny: stoker.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(SpecError, match=r"workers='process' needs Linux .*'darwin'; use workers='thread'"):
        tiny.loader(4, transform=_double, workers="process")


def test_process_workers_without_memfd_are_a_clear_spec_error(
    tiny: stoker.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "memfd_create")
    with pytest.raises(SpecError, match=r"needs Linux \(it shares batches through os.memfd_create\)"):
        tiny.loader(4, transform=_double, workers="process")
    # Thread workers need no such thing.
    with tiny.loader(8, transform=_double) as loader:
        assert np.concatenate([b["x"] for b in loader]).tolist() == [2.0 * i for i in range(32)]


_IN_THE_NEW_VENV = """
import sys
import numpy as np
import stoker, stoker._kernels
from stoker.cli.sample import expected_label
assert stoker.__file__.startswith(sys.prefix), stoker.__file__  # the wheel's copy, not the source tree
assert stoker.kernels.compiled()
d = stoker.write_sample(sys.argv[1], pairs=2, records=20, inrez=8)
ds = stoker.Dataset(
    image=stoker.Field(str(d / "img_*.bin"), "int8", (8, 8, 1)),
    label=stoker.Field(str(d / "out_*.bin.gz"), "float32", compression="gzip"),
)
n = 0
with ds.loader(16, cast={"image": "float32"}) as loader:
    for b in loader:
        assert (b["label"] == expected_label(b["image"].astype(np.int8))).all()
        n += len(b["label"])
# The package data `stoker explain` prints, from the wheel's copy.
from stoker.doctor import explain
assert explain("storage-bound").splitlines()[0] == "storage-bound", explain("storage-bound")
print("ok", stoker.__version__, n)
"""


@pytest.mark.slow
def test_the_wheel_installs_into_a_new_venv_and_imports_its_kernels(tmp_path: Path) -> None:
    # A copy of what a wheel is built from, so nothing compiled in the checkout is reused.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    env = {**os.environ, "STOKER_REQUIRE_KERNELS": "1"}
    build = subprocess.run(
        [*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        capture_output=True, text=True, timeout=480, env=env,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("stoker-*.whl")
    auditwheel = shutil.which("auditwheel", path=os.path.dirname(sys.executable))
    if auditwheel and sys.platform.startswith("linux"):
        # As `make wheel` does: a manylinux tag, and only system libraries left outside it.
        path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"
        fixed = subprocess.run(
            [auditwheel, "repair", "--wheel-dir", str(tmp_path / "fixed"), str(wheel)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": path},
        )  # fmt: skip
        assert fixed.returncode == 0, fixed.stderr[-3000:]
        (wheel,) = (tmp_path / "fixed").glob("stoker-*manylinux*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    # Nothing of this process's paths: the new venv sees only what is installed into it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # The wheel alone (its one dependency, numpy, at the version running this test: a wheel pip
    # already holds or finds where the machine's pip configuration points).
    install = subprocess.run(
        [*pip, "--python", str(python), "install", "--quiet", "--no-deps", "--only-binary=:all:", str(wheel),
         f"numpy=={np.__version__}"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    run = subprocess.run(
        [str(python), "-c", _IN_THE_NEW_VENV, str(tmp_path / "data")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ok", _pyproject_version(), "40"]
