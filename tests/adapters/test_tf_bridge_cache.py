"""The TF bridge's cache: only a directory and a library this user alone can write are used, so
another local user cannot plant the library stoker loads (stoker.tf.op._build_bridge).

Another user's files are made with os.chown, which needs root (as `make test` runs here).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import stoker
from stoker.tf import op as tf_op

pytestmark = pytest.mark.tf

OTHER_UID = 65534  # nobody
# A library whose constructor leaves a mark where STOKER_PLANTED_MARK says: loaded = ran.
PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *mark = getenv("STOKER_PLANTED_MARK");
    FILE *f = fopen(mark ? mark : "/dev/null", "w");
    if (f) { fputs("planted code ran\n", f); fclose(f); }
}
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("planted")
    (d / "planted.c").write_text(PLANTED_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(d / "planted.so"), str(d / "planted.c")], check=True)
    return d / "planted.so"


@pytest.fixture(scope="module")
def name(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The file name the bridge is built under here (per source, TensorFlow and Python version)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STOKER_CACHE", str(tmp_path_factory.mktemp("first")))
        return tf_op._build_bridge().name


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """$STOKER_CACHE/tfbridge, not made yet; the temp directory inside tmp_path."""
    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    yield tmp_path / "cache" / "tfbridge"


def _other_users(path: Path, mode: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a file another user owns needs root")
    os.chmod(path, mode)
    os.lchown(path, OTHER_UID, OTHER_UID)


def _plant(where: Path, planted: Path, name: str, *, owner: str = "other", mode: int = 0o755) -> Path:
    lib = where / name
    if owner == "symlink":
        os.symlink(planted, lib)
    else:
        shutil.copy(planted, lib)
        os.chmod(lib, mode)
        if owner == "other":
            _other_users(lib, mode)
    return lib


def _is_ours_and_built(path: Path, planted: Path) -> bool:
    st = os.lstat(path)
    return (
        stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022
        and b"StokerNextBatch" in path.read_bytes() and path.read_bytes() != planted.read_bytes()
    )  # fmt: skip


def test_a_cache_directory_another_user_owns_is_never_used(cache: Path, planted: Path, name: str) -> None:
    cache.mkdir(parents=True)
    lib = _plant(cache, planted, name)
    _other_users(cache, 0o777)
    path = tf_op._build_bridge()
    assert path != lib and path.parent == Path(tempfile.gettempdir()) / f"stoker-tfbridge-{os.getuid()}"
    assert _is_ours_and_built(path, planted)


@pytest.mark.parametrize("owner", ["other", "group-writable", "symlink"])
def test_a_library_in_the_cache_not_only_mine_is_built_again_not_loaded(
    cache: Path, planted: Path, name: str, owner: str
) -> None:
    cache.mkdir(parents=True, mode=0o700)
    lib = _plant(cache, planted, name, owner=owner, mode=0o775 if owner == "group-writable" else 0o755)
    with pytest.warns(RuntimeWarning, match=r"is not a file only you can write to .* not loaded but built again"):
        path = tf_op._build_bridge()
    assert path == lib and _is_ours_and_built(path, planted)
    assert tf_op._build_bridge() == path  # now the cached one


def test_my_cache_directory_made_under_a_loose_umask_is_narrowed_to_0700(cache: Path, planted: Path) -> None:
    cache.mkdir(parents=True)
    os.chmod(cache, 0o777)
    path = tf_op._build_bridge()
    assert path.parent == cache and stat.S_IMODE(os.lstat(cache).st_mode) == 0o700
    assert _is_ours_and_built(path, planted)


def test_a_symlinked_cache_directory_is_not_used(cache: Path, planted: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    cache.parent.mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", cache)
    path = tf_op._build_bridge()
    assert path.parent == Path(tempfile.gettempdir()) / f"stoker-tfbridge-{os.getuid()}"
    assert _is_ours_and_built(path, planted)


_LOAD = """
import warnings, stoker.tf as stf
warnings.simplefilter("always")
print(stf.bridge())
"""


@pytest.mark.slow
def test_a_library_planted_in_the_shared_temp_directory_is_never_loaded(
    tmp_path: Path, planted: Path, name: str
) -> None:
    """The issue's case: no cache directory can be made (here: under a file), so stoker falls back
    to $TMPDIR/stoker-tfbridge-UID, which another user made first, mode 0777, with a library of
    the name stoker would load in it. It is not loaded; the bridge is built where only we write."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    shared = tmp_path / "tmp" / f"stoker-tfbridge-{os.getuid()}"
    shared.mkdir(parents=True)
    _plant(shared, planted, name)
    _other_users(shared, 0o777)
    mark = tmp_path / "mark"
    env = {
        **os.environ, "STOKER_CACHE": str(blocker / "cache"), "TMPDIR": str(tmp_path / "tmp"),
        "STOKER_PLANTED_MARK": str(mark), "PYTHONPATH": str(Path(stoker.__file__).parents[1]),
    }  # fmt: skip
    env.pop("STOKER_TF_BRIDGE", None)
    done = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not mark.exists(), "the planted library was loaded"
    assert done.stdout.strip() == "native"  # built and loaded from a private temporary directory instead
    assert "is a directory only you can write to" in done.stderr and str(shared) in done.stderr
