"""Fuzz: random Field specs, file contents and damage never raise anything but a StokerError,
never hang, and never yield a record that is not in the files.

"Not in the files" is judged independently of stoker: a raw field's truth is its file as it is
now (numpy reading the bytes); a compressed field's truth is what was written before the
damage, because a damaged stream must fail its checks, never decode into other values.
"""

from __future__ import annotations

import gzip
import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import stoker
from tests.helpers.data import FieldPlan, field_for, make_values, write_dataset
from tests.helpers.resources import consume

DTYPES = ["int8", "uint8", "bool", "int16", "uint16", "int32", "float32", "float64", "int64"]
# kind -> compression given to the Field ("gzip-empty": a member, then an empty member)
KINDS = {"raw": None, "gzip": "gzip", "zlib": "zlib", "multi": "gzip", "gzip-empty": "gzip"}
# Groups of gzip fields only are counted by their trailers when the files prove single members.
GZIP_ONLY = ["gzip", "gzip", "multi", "gzip-empty"]
DAMAGE = ["truncate", "flip", "append", "empty", "zeros"]


@st.composite
def field_plans(draw: st.DrawFn, name: str, gzip_only: bool = False) -> FieldPlan:
    kind = draw(st.sampled_from(GZIP_ONLY if gzip_only else list(KINDS)))
    return FieldPlan(
        name,
        draw(st.sampled_from(DTYPES)),
        tuple(draw(st.lists(st.integers(1, 4), max_size=2))),
        kind=kind,
        header=draw(st.sampled_from([0, 0, 1, 7, 64])),
        footer=draw(st.sampled_from([0, 0, 3, 16])),
        byte_order=draw(st.sampled_from(["little", "big"])),
        # zero padding after the last member: 1-3 bytes shift the trailer, 4 or more zero it
        pad=draw(st.sampled_from([0, 0, 1, 3, 5])) if KINDS[kind] == "gzip" else 0,
        compression=KINDS[kind],
    )


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    names = ["fa", "fb", "fc"][: draw(st.integers(1, 3))]  # no digits: basenames pair by their numbers
    counts = draw(st.lists(st.integers(0, 30), min_size=1, max_size=4))
    damage = draw(
        st.lists(
            st.tuples(
                st.sampled_from(names),
                st.integers(0, len(counts) - 1),
                st.sampled_from(DAMAGE),
                st.floats(0, 1),  # where in the file
                st.integers(1, 255),  # flip mask / appended byte
            ),
            max_size=2,
        )
    )
    shuffle = draw(st.sampled_from([False, "files", "global"]))
    gzip_only = draw(st.booleans())
    return {
        "plans": {n: draw(field_plans(n, gzip_only)) for n in names},
        "counts": counts,
        "damage": damage,
        "damage_after_build": draw(st.booleans()),  # files changed under a built Dataset
        "batch_size": draw(st.integers(1, 12)),
        "cast": draw(st.sampled_from([None, None, "float64", "int32"])),
        "shuffle": shuffle,
        "threads": draw(st.integers(1, 3)),
        "cycle_length": draw(st.none() | st.integers(1, 3)),
        "block_length": draw(st.none() | st.integers(1, 5)),
        "drop_remainder": draw(st.booleans()),
    }


def _damage(path: Path, how: str, where: float, byte: int) -> None:
    data = bytearray(path.read_bytes())
    at = min(len(data) - 1, int(where * len(data))) if data else 0
    if how == "truncate":
        data = data[:at]
    elif how == "flip" and data:
        data[at] ^= byte
    elif how == "append":
        data += bytes([byte]) * (1 + at % 9)
    elif how == "empty":
        data = bytearray()
    elif how == "zeros" and data:
        data[at : at + 8] = bytes(len(data[at : at + 8]))
    path.write_bytes(bytes(data))


def _truth(case: dict[str, Any], paths: dict[str, list[Path]], ds: stoker.Dataset, name: str, g: int) -> np.ndarray:
    plan: FieldPlan = case["plans"][name]
    if plan.kind == "raw":
        # The file as it is now, at the geometry the Dataset saw: record i starts at
        # header + i * record_bytes (whatever the file's size says now), if it is all there.
        spec = ds.fields[name]
        data = paths[name][g].read_bytes()
        whole = max(0, len(data) - spec.header_bytes) // spec.record_bytes
        n = min(whole, ds.records_in(g))
        body = data[spec.header_bytes : spec.header_bytes + n * spec.record_bytes]
        return np.frombuffer(body, dtype=spec.dtype).reshape(n, *spec.shape)
    base = sum(case["counts"][:g])
    values = make_values(plan, case["counts"][g], base, salt=list(case["plans"]).index(name))
    if KINDS[plan.kind] == "gzip" and not any(d[:2] == (name, g) for d in case["damage"]):
        # What was written is what Python's gzip module decodes (members joined, padding skipped).
        spec = ds.fields[name]
        body = gzip.decompress(paths[name][g].read_bytes())
        assert body[spec.header_bytes : len(body) - spec.footer_bytes] == values.tobytes(), paths[name][g]
    return values


def _check_rows(
    case: dict[str, Any], paths: dict[str, list[Path]], ds: stoker.Dataset, got: list[dict[str, np.ndarray]]
) -> list[tuple[int, int]]:
    """Every delivered row is the record it says it is (``_truth``); returns the (group, index) sequence."""
    truths: dict[tuple[str, int], np.ndarray] = {}
    seen: list[tuple[int, int]] = []
    for b in got:
        pairs = list(zip(b["__group__"].tolist(), b["__index__"].tolist()))
        seen.extend(pairs)
        for name in case["plans"]:
            out = b[name]
            for row, (g, i) in enumerate(pairs):
                if (name, g) not in truths:
                    truths[(name, g)] = _truth(case, paths, ds, name, g)
                truth = truths[(name, g)]
                assert i < len(truth), f"field {name!r}: record {i} of group {g} is not in the file"
                want = truth[i].astype(out.dtype)  # a cast done by numpy, as stoker's is
                assert out[row].tobytes() == want.tobytes(), f"field {name!r}: wrong record {i} of group {g}"
    return seen


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_random_specs_contents_and_damage_give_right_data_or_a_stoker_error(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    base = tmp_path_factory.getbasetemp() / "fuzz"
    base.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base))
    paths = write_dataset(tmp, case["counts"], case["plans"])
    after = case["damage_after_build"]
    for name, g, how, where, byte in [] if after else case["damage"]:
        _damage(paths[name][g], how, where, byte)
    try:
        ds = stoker.Dataset({n: field_for(tmp, p) for n, p in case["plans"].items()})
        if after:
            for name, g, how, where, byte in case["damage"]:
                _damage(paths[name][g], how, where, byte)
        loader = ds.loader(
            case["batch_size"], shuffle=case["shuffle"], seed=11, threads=case["threads"],
            cycle_length=case["cycle_length"], block_length=case["block_length"], with_index=True,
            cast=case["cast"], drop_remainder=case["drop_remainder"],
        )  # fmt: skip
    except stoker.StokerError as e:
        event(f"Dataset/loader refused: {type(e).__name__}")
        assert case["damage"], f"undamaged files refused: {e!r}"
        assert e.path is not None or isinstance(e, stoker.SpecError), f"{type(e).__name__} names no file: {e}"
        return
    got, err = consume(loader, timeout=30)
    event(
        f"pass ended by {type(err).__name__}"
        if err
        else "pass complete" + (" despite damage" if case["damage"] else "")
    )
    assert err is None or isinstance(err, stoker.StokerError), repr(err)
    assert err is None or case["damage"], f"undamaged files failed: {err!r}"
    if err is not None:
        assert err.path is not None and err.path in str(err), f"{type(err).__name__} names no file: {err}"
    seen = _check_rows(case, paths, ds, got)
    assert len(seen) == len(set(seen)), "a record was yielded twice"
    if err is None:
        every = [(g, i) for g in range(ds.num_groups) for i in range(ds.records_in(g))]
        if case["drop_remainder"]:
            assert set(seen) <= set(every) and len(seen) == len(every) - len(every) % case["batch_size"]
        else:
            assert sorted(seen) == every
        if not case["damage"]:
            assert [ds.records_in(g) for g in range(ds.num_groups)] == case["counts"]
    if all(KINDS[p.kind] == "gzip" for p in case["plans"].values()):
        event("gzip fields only" + (" (padded)" if any(p.pad for p in case["plans"].values()) else ""))


_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=True), st.text(max_size=6),
    st.sampled_from(["int8", ">u2", "<f4", "=i2", "float16", "U3", "O", "V8", "complex64", "512MiB", "-1"]),
    st.lists(st.integers(-2, 3), max_size=3), st.tuples(st.integers(0, 3), st.floats(0, 2)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(dtype=_JUNK, shape=_JUNK, header=_JUNK, order=_JUNK, compression=_JUNK)
def test_any_field_arguments_give_a_field_or_a_spec_error(
    dtype: object, shape: object, header: object, order: object, compression: object
) -> None:
    try:
        f = stoker.Field("x_*.bin", dtype, shape, header_bytes=header, byte_order=order, compression=compression)  # type: ignore[arg-type]
    except stoker.SpecError:
        return
    assert f.record_bytes > 0 and f.byte_order in ("little", "big")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_size=_JUNK, threads=_JUNK, prefetch=_JUNK, memory_budget=_JUNK, epochs=_JUNK)
def test_any_loader_arguments_give_a_loader_or_a_spec_error(
    tmp_path: Path, batch_size: object, threads: object, prefetch: object, memory_budget: object, epochs: object
) -> None:
    if not list(tmp_path.glob("x_*.bin")):
        write_dataset(tmp_path, [5, 3], {"x": FieldPlan("x", "int16", (2,))})
    ds = stoker.Dataset(x=stoker.Field(str(tmp_path / "x_*.bin"), "int16", (2,)))
    try:
        loader = ds.loader(batch_size, threads=threads, prefetch=prefetch, memory_budget=memory_budget, epochs=epochs)  # type: ignore[arg-type]
    except stoker.SpecError:
        return
    with loader:
        assert len(loader) >= 1


# -- shards and resume over the same random specs and damage ----------------------------------


@st.composite
def splits(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "shards": draw(st.integers(1, 3)),
        "even": draw(st.booleans()),
        "resumed_shard": draw(st.integers(0, 2)),  # modulo the shard count
        "cut": draw(st.floats(0, 1)),  # where in its run the interrupted loader saves its state
        "resume_batch_size": draw(st.none() | st.integers(1, 12)),  # None: the same; else elastic
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), split=splits())
def test_shards_and_resume_over_random_specs_and_damage_continue_the_uninterrupted_run(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any], split: dict[str, Any]
) -> None:
    """Two epochs. Shard ``i`` of ``c`` takes positions i, i+c, ... of each epoch of the unsharded
    sequence (cut to the shortest shard's length with even=True), so the shards' union is that
    sequence; a run saved after any batch (state through JSON) and resumed, with the same or
    another batch_size, delivers exactly the rest of it. With damage, every one of these runs
    delivers only right records and ends, if it fails, in a StokerError naming the file."""
    base = tmp_path_factory.getbasetemp() / "fuzz-split"
    base.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base))
    paths = write_dataset(tmp, case["counts"], case["plans"])
    for name, g, how, where, byte in case["damage"]:  # before any loader: every run sees the same files
        _damage(paths[name][g], how, where, byte)

    def make(batch_size: int, shard: tuple[int, int], state: dict[str, Any] | None = None) -> stoker.Loader:
        return ds.loader(
            batch_size, epochs=2, shuffle=case["shuffle"], seed=11, threads=case["threads"],
            cycle_length=case["cycle_length"], block_length=case["block_length"], with_index=True,
            cast=case["cast"], shard=shard, even=split["even"], state=state,
        )  # fmt: skip

    def run(loader: Any) -> tuple[int, list[tuple[int, int]], BaseException | None]:
        got, err = consume(loader, timeout=30)
        assert err is None or isinstance(err, stoker.StokerError), repr(err)
        assert err is None or case["damage"], f"undamaged files failed: {err!r}"
        if err is not None:
            assert err.path is not None and err.path in str(err), f"{type(err).__name__} names no file: {err}"
        return len(got), _check_rows(case, paths, ds, got), err

    c = split["shards"]
    try:
        ds = stoker.Dataset({n: field_for(tmp, p) for n, p in case["plans"].items()})
        whole = run(make(case["batch_size"], (0, 1)))[1:]
        shards = [run(make(case["batch_size"], (i, c)))[1:] for i in range(c)]
        s = split["resumed_shard"] % c
        with make(case["batch_size"], (s, c)) as probe:
            cut = round(split["cut"] * 2 * len(probe))
        first = make(case["batch_size"], (s, c))
        _, before, err_before = run(itertools.islice(first, cut))
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        _, after, err_after = run(make(split["resume_batch_size"] or case["batch_size"], (s, c), state))
    except stoker.StokerError as e:  # the Dataset, a loader or len() refused the damaged files
        event(f"refused: {type(e).__name__}")
        assert case["damage"], f"undamaged files refused: {e!r}"
        assert e.path is not None or isinstance(e, stoker.SpecError), f"{type(e).__name__} names no file: {e}"
        return
    errors = [whole[1], *(e for _, e in shards), err_before, err_after]
    event("all runs complete" if not any(errors) else "some run ended by a StokerError")
    if any(errors):
        return
    sequence, _ = whole
    per_epoch = len(sequence) // 2
    epochs = [sequence[:per_epoch], sequence[per_epoch:]]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(set(epochs[0]))
    shortest = per_epoch // c
    for i, (seen, _) in enumerate(shards):
        want = [r for e in epochs for r in (e[i::c][:shortest] if split["even"] else e[i::c])]
        assert seen == want, f"shard {i} of {c} is not positions {i}, {i}+{c}, ... of the unsharded run"
    assert before + after == shards[s][0], f"resumed after {cut} batches: not the rest of the run"
