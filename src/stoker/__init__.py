"""stoker: keep accelerators fed from large datasets of fixed-length binary records.

Example:
    >>> import stoker
    >>> ds = stoker.Dataset(
    ...     image=stoker.Field("data/img_*.bin", dtype="int8", shape=(128, 128, 1)),
    ...     label=stoker.Field("data/out_*.bin.gz", dtype="float32", compression="gzip"),
    ... )
    >>> for batch in ds.loader(256, cast={"image": "float32"}):
    ...     train_step(batch["image"], batch["label"])
"""

import importlib
from types import ModuleType

from .cli.sample import write_sample
from .dataset import Dataset, Subset
from .errors import (
    CorruptDataError,
    ForkedPassError,
    PairingError,
    ReadError,
    RecordIndexError,
    SpecError,
    StaleIndexError,
    StateError,
    StokerError,
    SupersededError,
    TransformError,
    WriteError,
)
from .io.files import Group
from .io.index import write_index
from .loader import Loader
from .spec import Field

__all__ = [
    "CorruptDataError",
    "Dataset",
    "Field",
    "ForkedPassError",
    "Group",
    "Loader",
    "PairingError",
    "ReadError",
    "RecordIndexError",
    "SpecError",
    "StaleIndexError",
    "StateError",
    "StokerError",
    "Subset",
    "SupersededError",
    "TransformError",
    "WriteError",
    "write_index",
    "write_sample",
]

# Submodules reachable as attributes after a bare `import stoker`, imported on first use so that
# `import stoker` needs numpy alone (the adapters import their framework when they load).
_LAZY_SUBMODULES = frozenset(
    {"doctor", "jax", "keras", "kernels", "order", "ray", "testing", "tf", "torch", "transforms"}
)


def __getattr__(name: str) -> ModuleType | str:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES, "__version__"})


def _version() -> str:
    """`stoker.__version__`: the installed package's metadata (pyproject.toml's version), looked
    up on first use so that `import stoker` reads no metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stoker")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
