"""The error hierarchy: one base, each class also a builtin, attributes kept across pickling."""

from __future__ import annotations

import inspect
import pickle

import pytest

import stoker
from stoker.errors import CorruptDataError, SpecError, StokerError

# Every class the module defines, so a class added later is held to the same rules.
CLASSES = [
    cls
    for _, cls in inspect.getmembers(stoker.errors, inspect.isclass)
    if issubclass(cls, StokerError) and cls is not StokerError and cls.__module__ == "stoker.errors"
]
BUILTIN = {cls: next(b for b in cls.__mro__ if b.__module__ == "builtins" and b is not object) for cls in CLASSES}


def test_the_module_defines_the_documented_classes() -> None:
    names = {cls.__name__ for cls in CLASSES}
    assert {"SpecError", "PairingError", "CorruptDataError", "ReadError", "StateError", "WriteError"} <= names


@pytest.mark.parametrize(("cls", "builtin"), list(BUILTIN.items()), ids=lambda v: v.__name__)
def test_every_error_derives_from_stoker_error_and_a_fitting_builtin(cls: type, builtin: type) -> None:
    assert builtin is not Exception, f"{cls.__name__} is no builtin but Exception"
    err = cls("boom", path="a.bin")
    assert isinstance(err, StokerError)
    assert isinstance(err, builtin)
    with pytest.raises(builtin):
        raise err


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_is_exported_from_the_package(cls: type) -> None:
    assert getattr(stoker, cls.__name__) is cls
    assert cls.__name__ in stoker.__all__


def test_the_reliability_page_lists_every_error() -> None:
    from tests.helpers import REPO

    page = (REPO / "docs" / "reliability.md").read_text()
    missing = [cls.__name__ for cls in CLASSES if f"| `{cls.__name__}` |" not in page]
    assert not missing, f"docs/reliability.md's error table lacks {missing}"


def test_unknown_attributes_are_none() -> None:
    err = SpecError("x")
    assert (err.path, err.field, err.index, err.offset) == (None, None, None, None)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_errors_survive_pickling_with_their_attributes(cls: type) -> None:
    err = cls("file 'x.bin' is bad", field="image", path="/d/x.bin", index=7, offset=4096)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    assert (back.field, back.path, back.index, back.offset) == ("image", "/d/x.bin", 7, 4096)


def test_a_real_raised_error_survives_pickling(tmp_path) -> None:
    (tmp_path / "a.bin").write_bytes(b"\0" * 5)
    with pytest.raises(CorruptDataError) as info:
        stoker.Dataset(x=stoker.Field([str(tmp_path / "a.bin")], "int32"))
    back = pickle.loads(pickle.dumps(info.value))
    assert back.path == info.value.path == str(tmp_path / "a.bin")
    assert str(back) == str(info.value)
