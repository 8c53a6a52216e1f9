"""Property: however an index or its windows files are damaged, every read gives the right records or a StokerError.

Real indexes of real files (a three-member gzip field and a zlib field, seek points every
8 KiB) are copied, then damaged by hypothesis: a JSON value replaced (off by one, by a record,
huge, negative, a float, Infinity, a string, deeply nested, ...), entries reshaped, the index's
bytes flipped or cut, a windows file's bytes flipped or cut, a window swapped for another
point's or for a zip bomb, a windows file of another file put in its place. Then random
access (``ds.read``, ``ds[i]``), a shard starting inside a file, a global shuffle beyond
``memory_budget`` (every record read through seek points) and a resume inside a file must each
deliver exactly the records the files hold, or end in a StokerError that names a file.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import stoker
from stoker.engine import decoded, records
from stoker.io.index import INDEX_NAME
from tests.helpers.data import FieldPlan, field_for, reference, resign, write_dataset
from tests.helpers.resources import consume

PLANS = {
    "x": FieldPlan("img", "int32", (64,), kind="multi", header=3, footer=5),
    "y": FieldPlan("lab", "int16", (32,), kind="zlib", header=2, footer=1),
}
COUNTS = [1200, 700]
SPACING = 8 * 1024
GLOBAL = dict(shuffle="global", seed=2, memory_budget="300KiB", prefetch=2)  # neither field fits: seek points
RESUME_AFTER = 9  # batches of 100: the resume starts at record 900 of group 0, inside its files
DEEP = "__deep__"  # replaced in the JSON text by nesting deeper than any parser goes


class Pristine:
    """The undamaged files, their index, and what every read must give."""

    def __init__(self, root: Path) -> None:
        self.root = root
        write_dataset(root, COUNTS, PLANS)
        fields = self.fields(root)
        stoker.write_index(stoker.Dataset(fields, index="ignore"), spacing=SPACING)
        ds = stoker.Dataset(fields)
        assert all(len(ds._catalog.seek_points[(g, n)]) >= 3 for g in range(len(COUNTS)) for n in PLANS)
        self.ref = reference(ds)
        self.flat = {n: np.concatenate([r[n] for r in self.ref]) for n in PLANS}
        with mock.patch.object(decoded, "VERIFY_WHOLE_BYTES", 0):  # streamed: resume starts at a seek point
            loader = ds.loader(100, with_index=True, cycle_length=1)
            it = iter(loader)
            self.head = [next(it) for _ in range(RESUME_AFTER)]
            self.state = json.loads(json.dumps(loader.state_dict()))
            loader.close()
            self.rest = [(b["__group__"], b["__index__"]) for b in ds.loader(100, with_index=True, cycle_length=1)][
                RESUME_AFTER:
            ]

    @staticmethod
    def fields(root: Path) -> dict[str, stoker.Field]:
        return {n: field_for(root, p) for n, p in PLANS.items()}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    return Pristine(tmp_path_factory.mktemp("index-fuzz-pristine"))


def _nodes(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON value, containers included."""
    if path:
        yield path
    if isinstance(value, dict):
        for k in sorted(value):
            yield from _nodes(value[k], (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nodes(v, (*path, i))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        doc = doc[k]
    if value is _DELETE:
        del doc[path[-1]]
    else:
        doc[path[-1]] = value


_DELETE = object()


def _replacement(data: st.DataObject, old: Any) -> Any:
    choices: list[Any] = [
        2**64, -1, 10**12, 0, 1.5, float("inf"), float("nan"), None, "7", True, [], {}, [[[[1]]]], DEEP, _DELETE,
    ]  # fmt: skip
    if type(old) is int:
        delta = data.draw(st.sampled_from([1, -1, 2, 8, 64, 256, -256, 4096, 1 << 20]), label="delta")
        choices += [old + delta, float(old), str(old), -old]
    if isinstance(old, list) and old:
        choices += [old[:-1], [*old, old[-1]], old[::-1]]
    return data.draw(st.sampled_from(choices), label="new value")


def _damage_json(data: st.DataObject, index: Path, *, signed: bool) -> str:
    try:
        doc = json.loads(index.read_bytes())
        files = doc["files"]
        base = data.draw(st.sampled_from(sorted(files)), label="entry")
        entry = files[base]
        assert isinstance(entry, dict)
    except (ValueError, TypeError, KeyError, AssertionError):
        return "json: no entry to edit already"
    how = data.draw(st.sampled_from(["value", "value", "swap", "windows-path"]), label="json damage")
    if how == "swap" and len(entry.get("points", [])) > 1:  # a window (and its CRC) of another point
        i, j = data.draw(st.lists(st.integers(0, len(entry["points"]) - 1), min_size=2, max_size=2, unique=True))
        a, b = entry["points"][i], entry["points"][j]
        a[3:6], b[3:6] = b[3:6], a[3:6]
    elif how == "windows-path" and "windows" in entry:
        entry["windows"] = data.draw(
            st.sampled_from(["../" + entry["windows"], str(index.parent / entry["windows"]), "/dev/zero", "."])
        )
    else:
        path = data.draw(st.sampled_from(list(_nodes(entry))), label="where")
        _set(entry, path, _replacement(data, _get(entry, path)))
    if signed:
        resign(entry)
    text = json.dumps(doc)
    index.write_text(text.replace(f'"{DEEP}"', "[" * 100_000 + "]" * 100_000))
    return f"json {how}"


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _damage_bytes(data: st.DataObject, path: Path, label: str) -> str:
    blob = bytearray(path.read_bytes())
    how = data.draw(st.sampled_from(["flip", "cut", "zero"]), label=f"{label} damage")
    at = data.draw(st.integers(0, len(blob) - 1), label="offset")
    if how == "flip":
        blob[at] ^= data.draw(st.integers(1, 255), label="xor")
    elif how == "cut":
        del blob[at:]
    else:
        blob[at : at + 64] = bytes(len(blob[at : at + 64]))
    path.write_bytes(bytes(blob))
    return f"{label} {how}"


def _damage_windows(data: st.DataObject, root: Path, index: Path) -> str:
    sidecars = sorted(root.glob(".stoker-windows.*"))
    sidecar = data.draw(st.sampled_from(sidecars), label="windows file")
    how = data.draw(st.sampled_from(["bytes", "bomb", "other"]), label="windows damage")
    if how == "bytes":
        return _damage_bytes(data, sidecar, "windows")
    if how == "other":  # another file's windows under this one's name
        other = data.draw(st.sampled_from([s for s in sidecars if s != sidecar]))
        shutil.copyfile(other, sidecar)
        return "windows of another file"
    # A window that inflates to 32 MiB, appended and pointed at by one point of the index.
    bomb = zlib.compress(b"\0" * (32 << 20), 9)
    offset = sidecar.stat().st_size
    with sidecar.open("ab") as f:
        f.write(bomb)
    try:
        doc = json.loads(index.read_bytes())
        (entry,) = [e for e in doc["files"].values() if isinstance(e, dict) and e.get("windows") == sidecar.name]
        assert isinstance(entry.get("points"), list) and entry["points"]
    except (ValueError, AttributeError, TypeError, AssertionError):
        return "windows zip bomb: no entry names it already"
    k = data.draw(st.integers(0, len(entry["points"]) - 1), label="point")
    entry["points"][k][3:5] = [offset, len(bomb)]
    index.write_text(json.dumps(doc))
    return "windows zip bomb"


def _expect(kind: str, read: Callable[[], Any], verify: Callable[[Any], None]) -> None:
    """``read()`` gives what ``verify`` accepts, or a StokerError that names a file."""
    try:
        result = read()
    except stoker.StokerError as e:
        assert e.path is not None and e.path in str(e), f"{kind}: {type(e).__name__} names no file: {e}"
        event(f"{kind}: {type(e).__name__}")
        return
    verify(result)
    event(f"{kind}: right records")


def _loader_rows(loader: stoker.Loader) -> list[dict[str, np.ndarray]]:
    got, err = consume(loader, timeout=60)
    if err is not None:
        raise err
    return got


@settings(
    max_examples=50,
    deadline=20_000,  # ms per example: generous for a loaded machine, still a bound
    derandomize=True,  # the same examples in every CI run
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no explain phase: it reruns a failure ~1000 times
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_damaged_index_or_windows_give_right_records_or_a_stoker_error(
    pristine: Pristine, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    try:
        shutil.copytree(pristine.root, root, dirs_exist_ok=True, copy_function=shutil.copy2)  # mtimes kept
        index = root / INDEX_NAME
        if data.draw(st.booleans(), label="an edit that keeps the entry's check right"):
            event(f"signed {_damage_json(data, index, signed=True)}")
            _read_everything_or_fail_loudly(pristine, root, data)
            return
        for _ in range(data.draw(st.integers(1, 2), label="damages")):
            where = data.draw(st.sampled_from(["json", "index bytes", "windows", "windows"]), label="what")
            if where == "json":
                event(_damage_json(data, index, signed=False))
            elif where == "index bytes":
                event(_damage_bytes(data, index, "index"))
            else:
                event(_damage_windows(data, root, index))
        _read_everything_or_fail_loudly(pristine, root, data)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _read_everything_or_fail_loudly(pristine: Pristine, root: Path, data: st.DataObject) -> None:
    fields = pristine.fields(root)
    try:
        ds = stoker.Dataset(fields)
    except stoker.StokerError as e:
        assert e.path is not None and e.path in str(e), f"open: {type(e).__name__} names no file: {e}"
        event(f"open: {type(e).__name__}")
        return
    total = sum(COUNTS)
    flat = pristine.flat

    def right_rows(batches: list[dict[str, np.ndarray]], *, every: bool) -> None:
        seen = []
        for b in batches:
            for name in PLANS:
                want = np.stack([pristine.ref[g][name][i] for g, i in zip(b["__group__"], b["__index__"])])
                assert np.array_equal(b[name], want), f"wrong records of field {name!r}"
            seen += list(zip(b["__group__"].tolist(), b["__index__"].tolist()))
        if every:
            assert sorted(seen) == [(g, i) for g, n in enumerate(COUNTS) for i in range(n)], "records lost or repeated"

    picks = np.array(data.draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=40), label="records"))
    with mock.patch.object(records, "DEFAULT_CACHE_BYTES", 0):  # every compressed read from a seek point

        def read_many() -> dict[str, np.ndarray]:
            if len(ds) != total:
                raise AssertionError(f"the dataset opened with {len(ds)} records, not {total}, and no error")
            return ds.read(picks)

        _expect("ds.read", read_many, lambda got: [np.testing.assert_array_equal(got[n], flat[n][picks]) for n in flat])
        one = int(picks[0])
        _expect(
            "ds[i]", lambda: ds[one],
            lambda got: [np.testing.assert_array_equal(got[n], flat[n][one]) for n in flat],
        )  # fmt: skip
    _expect(
        "global shuffle", lambda: _loader_rows(ds.loader(64, with_index=True, **GLOBAL)),  # type: ignore[arg-type]
        lambda got: right_rows(got, every=True),
    )  # fmt: skip
    with mock.patch.object(decoded, "VERIFY_WHOLE_BYTES", 0):  # streamed, as large files are
        _expect(
            "shard start", lambda: _loader_rows(ds.loader(64, with_index=True, shard=(1, 3), cycle_length=1)),
            lambda got: right_rows(got, every=False),
        )  # fmt: skip

        def resumed() -> list[dict[str, np.ndarray]]:
            return _loader_rows(ds.loader(100, with_index=True, cycle_length=1, state=pristine.state))

        def same_rest(got: list[dict[str, np.ndarray]]) -> None:
            right_rows(got, every=False)
            assert len(got) == len(pristine.rest)
            for b, (g, i) in zip(got, pristine.rest, strict=True):
                assert np.array_equal(b["__group__"], g) and np.array_equal(b["__index__"], i)

        _expect("resume", resumed, same_rest)
