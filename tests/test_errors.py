"""The error hierarchy: one base, each class also a builtin, attributes kept across pickling."""

from __future__ import annotations

import pickle

import pytest

import stoker
from stoker.errors import CorruptDataError, PairingError, ReadError, SpecError, StateError, StokerError

BUILTIN = {
    SpecError: ValueError,
    PairingError: ValueError,
    CorruptDataError: ValueError,
    StateError: ValueError,
    ReadError: OSError,
}


@pytest.mark.parametrize(("cls", "builtin"), list(BUILTIN.items()))
def test_every_error_derives_from_stoker_error_and_its_builtin(cls: type, builtin: type) -> None:
    err = cls("boom", path="a.bin")
    assert isinstance(err, StokerError)
    assert isinstance(err, builtin)
    with pytest.raises(builtin):
        raise err


def test_errors_are_exported_from_the_package() -> None:
    for name in ("StokerError", "SpecError", "PairingError", "CorruptDataError", "ReadError", "StateError"):
        assert getattr(stoker, name) is getattr(stoker.errors, name)


def test_unknown_attributes_are_none() -> None:
    err = SpecError("x")
    assert (err.path, err.field, err.index, err.offset) == (None, None, None, None)


@pytest.mark.parametrize("cls", list(BUILTIN))
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
