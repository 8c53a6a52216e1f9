"""The native bridge: the StokerNextBatch op, compiled from `_tfbridge.c` at first use, cached, loaded.

The op pulls a pass's next batch (`stoker.tf.passes.native_next`) and wraps each array's
memory as a tensor, zero-copy. It is built once per source, TensorFlow and Python version
with the C compiler, into a cache directory only this user can write to (anyone who can
write there can make this process load their code), and loaded once per process. Where it
cannot be built, `native_op` says why and to_tf falls back to `tf.numpy_function`.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tensorflow as tf

from ..errors import SpecError

__all__ = ["BRIDGE_ENV", "drain", "native_op"]

BRIDGE_ENV = "STOKER_TF_BRIDGE"
_bridge_lock = threading.Lock()
_bridge: list[Any] = []  # [op or None, why not native] once decided
_loaded: list[Any] = []  # the op, once its library is loaded (a process registers it once)
_drains: list[Any] = []  # the library's stoker_tfbridge_drain, once loaded


def native_op() -> tuple[Any, str]:
    """The op, or None and why not (the choice `STOKER_TF_BRIDGE` asks for, made once per process)."""
    with _bridge_lock:
        if not _bridge:
            choice = os.environ.get(BRIDGE_ENV, "auto")
            if choice not in ("auto", "native", "numpy_function"):
                raise SpecError(f"{BRIDGE_ENV}={choice!r}: expected auto, native or numpy_function")
            if choice == "numpy_function":
                _bridge.extend([None, f"{BRIDGE_ENV}=numpy_function"])
            else:
                try:
                    _bridge.extend([_load_bridge(), ""])
                except (OSError, subprocess.SubprocessError, tf.errors.OpError) as e:
                    if choice == "native":
                        raise
                    warnings.warn(
                        f"stoker.tf: the native tf.data bridge could not be built ({e}); "
                        "to_tf falls back to tf.numpy_function (same batches, more CPU per batch)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    _bridge.extend([None, str(e)])
        return _bridge[0], _bridge[1]


def _load_bridge() -> Any:
    if not _loaded:
        path = _build_bridge()
        op = getattr(tf.load_op_library(str(path)), "stoker_next_batch", None)
        if op is None:  # the op was registered already, from another copy of the library
            raise OSError(f"{path} registered no StokerNextBatch op: another copy of it is loaded in this process")
        # PyDLL: called with the GIL held, as the function needs (the same loaded library).
        _drains.append(ctypes.PyDLL(str(path)).stoker_tfbridge_drain)
        _loaded.append(op)
    return _loaded[0]


def drain() -> None:
    """Release the arrays of tensors TensorFlow dropped on its own threads since the op's last
    call (`_tfbridge.c` defers them to a thread that holds the GIL): at a pass's end, so its
    last batches' buffers go back to the loader without waiting for another pass."""
    for drain in _drains:
        drain()


def _bridge_dir() -> Path:
    """Where the bridge is cached: `$STOKER_CACHE/tfbridge`, else the user's cache directory
    (see `_private_dir` for when it is used)."""
    base = os.environ.get("STOKER_CACHE")
    if base:
        return Path(base) / "tfbridge"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoker" / "tfbridge"


def _only_mine(st: os.stat_result, kind: Callable[[int], bool]) -> bool:
    """Whether `st` (of lstat: a symlink is not followed) is of `kind`, owned by this user,
    and writable by no group or other user: what may hold or be a library this process loads."""
    return kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_dir(path: Path) -> Path | None:
    """`path` when it is a directory only this user can write to, made (mode 0700) if missing;
    else None. A directory of this user's that others may write to (made under a looser umask)
    is first narrowed to 0700. Another user's directory, or a symlink, is never used: anyone
    who can write where the bridge is cached can make this process load their code."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(path, 0o700)
            st = os.lstat(path)
    except OSError:
        return None
    return path if _only_mine(st, stat.S_ISDIR) else None


def _build_bridge() -> Path:
    """Compile `_tfbridge.c` into a shared library once per source, TensorFlow and Python version."""
    source = Path(__file__).with_name("_tfbridge.c")
    tf_dir = Path(tf.sysconfig.get_lib())
    framework = tf_dir / "libtensorflow_framework.so.2"
    include = Path(sysconfig.get_paths()["include"])
    tf_include = tf.sysconfig.get_include()
    needs = {
        source: "the bridge's source",
        framework: "TensorFlow's framework library",
        include / "Python.h": "the Python headers",
        Path(tf_include) / "tensorflow" / "c" / "kernels.h": "TensorFlow's C API headers",
    }
    for need, what in needs.items():
        if not need.exists():
            raise FileNotFoundError(f"{what} not found: {need}")
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    command = [
        *compiler, "-O2", "-shared", "-fPIC", "-I", tf_include, "-I", str(include),
        str(source), "-L", str(tf_dir), "-l:" + framework.name, "-Wl,-rpath," + str(tf_dir),
    ]  # fmt: skip
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join([tf.__version__, sys.version, *command]).encode())
    name = f"_tfbridge-{digest.hexdigest()[:16]}.so"
    # The cache directory, else (read-only home, or one others may write to) the temp dir's
    # stoker-tfbridge-UID, else, where another user made that one, a fresh private directory.
    fallback = Path(tempfile.gettempdir()) / f"stoker-tfbridge-{os.getuid()}"
    cache = _private_dir(_bridge_dir()) or _private_dir(fallback)
    if cache is None:
        warnings.warn(
            f"stoker.tf: neither {_bridge_dir()} nor {fallback} is a directory only you can write to "
            "(yours, no group or other write, not a symlink); the native bridge is built in a private "
            "temporary directory and not cached",
            RuntimeWarning,
            stacklevel=3,
        )
        cache = Path(tempfile.mkdtemp(prefix="stoker-tfbridge-"))
        atexit.register(shutil.rmtree, cache, ignore_errors=True)  # the loaded library stays mapped
    out = cache / name
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        pass
    else:
        if _only_mine(st, stat.S_ISREG):
            return out
        warnings.warn(
            f"stoker.tf: {out} is not a file only you can write to (owner uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)}); it is not loaded but built again",
            RuntimeWarning,
            stacklevel=3,
        )
        out.unlink()  # the directory is this user's alone
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run([*command, "-o", str(tmp)], capture_output=True, text=True, check=False, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, which may let a group write it
        os.replace(tmp, out)  # atomic: a concurrent build of the same file is harmless
    finally:
        tmp.unlink(missing_ok=True)
    return out
