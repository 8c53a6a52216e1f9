"""stoker.jax: device_put batches, device prefetch that never skews the saved state, shardings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import stoker
from stoker.cli.sample import expected_label
from stoker.jax import shard_from_jax, to_jax
from stoker.testing import assert_same_batches
from tests.helpers import REPO
from tests.helpers.data import sample_images, small_sample

pytestmark = pytest.mark.jax

ROOT = REPO
RES = 16
PAIRS, RECORDS = 2, 64


@pytest.fixture
def sample(tmp_path: Path) -> stoker.Dataset:
    return small_sample(tmp_path, pairs=PAIRS, records=RECORDS, inrez=RES)


def as_numpy(batches: list[dict[str, jax.Array]]) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(v) for k, v in b.items()} for b in batches]


@pytest.mark.parametrize("sharding", ["none", "single", "named"])
def test_to_jax_yields_the_numpy_batches_as_jax_arrays(sample: stoker.Dataset, sharding: str) -> None:
    device = jax.devices()[0]
    chosen = {
        "none": None,
        "single": SingleDeviceSharding(device),
        "named": NamedSharding(jax.make_mesh((1,), ("batch",)), PartitionSpec("batch")),
    }[sharding]
    kw = {"epochs": 2, "shuffle": "global", "seed": 3, "cast": {"image": "float32"}}
    with sample.loader(24, **kw) as loader:  # type: ignore[arg-type]
        expected = [dict(b) for b in loader]
    with sample.loader(24, **kw).to_jax(sharding=chosen) as batches:  # type: ignore[arg-type]
        got = list(batches)
    assert all(isinstance(a, jax.Array) for b in got for a in b.values())
    if chosen is not None:
        assert all(a.sharding == chosen for b in got for a in b.values())
    assert_same_batches(expected, as_numpy(got))


def test_to_jax_gives_bfloat16_arrays_bit_for_bit(sample: stoker.Dataset) -> None:
    """JAX's bfloat16 is ml_dtypes' one, the dtype cast="bfloat16" delivers."""
    import jax.numpy as jnp
    import ml_dtypes

    with sample.loader(24) as plain:
        expected = [dict(b) for b in plain]
    with sample.loader(24, cast="bfloat16").to_jax() as batches:
        got = list(batches)
    assert len(got) == len(expected)
    for b, e in zip(got, expected, strict=True):
        for name in ("image", "label"):
            assert b[name].dtype == jnp.bfloat16
            want = e[name].astype(ml_dtypes.bfloat16).view(np.uint16)
            np.testing.assert_array_equal(np.asarray(b[name]).view(np.uint16), want)


def assert_as_device_put_puts(
    got: list[dict[str, jax.Array]], numpy_batches: list[dict[str, np.ndarray]], sharding: object = None
) -> None:
    """Each array is what ``jax.device_put`` makes of the loader's numpy batch, keys in its order."""
    assert len(got) == len(numpy_batches)
    for g, e in zip(got, numpy_batches, strict=True):
        assert list(g) == list(e)
        for name, x in e.items():
            a, ref = g[name], jax.device_put(x, sharding)
            assert type(a) is type(ref) and a.aval == ref.aval, name
            assert a.sharding == ref.sharding and a.committed == ref.committed == (sharding is not None), name
            assert np.array_equal(np.asarray(a), np.asarray(ref)), name


@pytest.mark.parametrize("sharding", ["none", "single", "named"])
def test_to_jax_places_batches_by_jaxs_own_call_as_device_put_would(sample: stoker.Dataset, sharding: str) -> None:
    # stoker.jax._DirectPut: int64 fields (__group__, __index__) and the rest through device_put
    chosen = {
        "none": None,
        "single": SingleDeviceSharding(jax.devices()[0]),
        "named": NamedSharding(jax.make_mesh((1,), ("batch",)), PartitionSpec("batch")),
    }[sharding]
    kw = {"epochs": 2, "cast": {"image": "bfloat16"}, "with_index": True}
    with sample.loader(24, **kw) as loader:  # type: ignore[arg-type]
        expected = [dict(b) for b in loader]
    with sample.loader(24, **kw).to_jax(sharding=chosen) as batches:  # type: ignore[arg-type]
        got = list(batches)
        assert batches._direct is not None and batches._direct.usable  # checked on the first batch, kept
    assert got[0]["__index__"].dtype == np.int32  # narrowed, as device_put narrows it without x64
    assert got[0]["image"].dtype == jax.numpy.bfloat16
    assert_as_device_put_puts(got, expected, chosen)


@pytest.mark.parametrize("how", ["committed", "short batch committed", "raises", "absent"])
def test_to_jax_falls_back_to_device_put_where_jaxs_call_differs(
    sample: stoker.Dataset, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # A JAX whose internal call places arrays otherwise (for every array, or only for the pass's
    # shorter last batch, which comes after the first batch was checked), takes other arguments,
    # or is gone.
    real = stoker.jax._batched_device_put

    def committed(aval: Any, sharding: object, xs: list[Any], devices: list[object], flag: bool) -> object:
        return real(aval, sharding, xs, devices, True if how == "committed" or aval.shape[0] < 24 else flag)

    def raises(*args: object) -> object:
        raise TypeError("batched_device_put(): incompatible function arguments")

    fake = {"committed": committed, "short batch committed": committed, "raises": raises, "absent": None}[how]
    monkeypatch.setattr(stoker.jax, "_batched_device_put", fake)
    with sample.loader(24, epochs=2) as loader:  # 128 records: 5 batches of 24 and one of 8 a pass
        expected = [dict(b) for b in loader]
    with sample.loader(24, epochs=2).to_jax() as batches:
        got = list(batches)
        assert batches._direct is None if how == "absent" else not batches._direct.usable  # type: ignore[union-attr]
    assert_as_device_put_puts(got, expected)


def test_to_jax_puts_on_the_default_device_jax_is_told(sample: stoker.Dataset, tmp_path: Path) -> None:
    # jax.default_device(...) moves device_put's placement; stoker's call follows it.
    script = textwrap.dedent(f"""
        import jax, numpy as np, stoker
        ds = stoker.Dataset(image=stoker.Field({str(tmp_path / "img_*.bin")!r}, "int8", ({RES}, {RES}, 1)),
                            label=stoker.Field({str(tmp_path / "out_*.bin.gz")!r}, "float32"))
        second = jax.devices()[1]
        with ds.loader(16) as plain:
            expected = [dict(b) for b in plain]
        with jax.default_device(second), ds.loader(16).to_jax() as batches:
            got = list(batches)
            assert batches._direct.usable
        assert len(got) == len(expected) > 1
        for e, g in zip(expected, got):
            for name in e:
                assert g[name].devices() == {{second}} and not g[name].committed, name
                assert np.array_equal(np.asarray(g[name]), e[name]), name
        print("ok")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_held_jax_arrays_never_change_while_the_loader_goes_on(sample: stoker.Dataset) -> None:
    # JAX's CPU backend may alias stoker's buffers: held arrays must keep them from reuse.
    loader = sample.loader(8, epochs=4, shuffle="global", seed=1, memory_budget=8 * 300 * 4, prefetch=2, threads=2)
    held, snapshots = [], []
    with loader.to_jax(prefetch_to_device=3) as batches:
        for b in batches:
            if len(held) < 12:
                held.append(b)
                snapshots.append({k: np.array(v, copy=True) for k, v in b.items()})
    images = sample_images(sample)
    for b, s in zip(held, snapshots, strict=True):
        got = {k: np.asarray(v) for k, v in b.items()}
        assert all(np.array_equal(got[k], s[k]) for k in got)
        assert np.array_equal(got["image"], images[got["label"].astype(np.int64)])
        assert np.array_equal(expected_label(got["image"]), got["label"])


def test_loader_to_jax_takes_its_arguments_by_position_too(sample: stoker.Dataset) -> None:
    with sample.loader(16).to_jax(None, 1) as batches:
        assert batches.prefetch_to_device == 1
        it = iter(batches)
        next(it)
        assert batches.loader.position == (0, 16 * 2)  # one taken, one on the device


def test_prefetch_runs_ahead_but_the_state_counts_what_the_user_took(sample: stoker.Dataset) -> None:
    with sample.loader(16).to_jax(prefetch_to_device=3) as batches:
        it = iter(batches)
        next(it)
        assert batches.loader.position == (0, 16 * 4)  # one taken, three on the device
        assert batches.state_dict()["position"] == 16


@pytest.mark.parametrize("k", [0, 1, 4, 9])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_to_jax_resumes_exactly_with_prefetch_in_flight(sample: stoker.Dataset, k: int, prefetch: int) -> None:
    def make() -> stoker.Loader:
        return sample.loader(24, epochs=2, shuffle="global", seed=5)

    with make().to_jax(prefetch_to_device=prefetch) as whole:
        reference = as_numpy(list(whole))
    with make().to_jax(prefetch_to_device=prefetch) as first:
        it = iter(first)
        before = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
    with make().to_jax(prefetch_to_device=prefetch) as second:
        second.load_state_dict(state)
        after = list(second)
    assert_same_batches(reference, as_numpy(before + after))


def test_to_jax_rejects_bad_settings(sample: stoker.Dataset) -> None:
    with sample.loader(8) as loader:
        with pytest.raises(stoker.SpecError, match="prefetch_to_device"):
            to_jax(loader, prefetch_to_device=-1)
        with pytest.raises(stoker.SpecError, match="unknown field"):
            to_jax(loader, sharding={"pixels": SingleDeviceSharding(jax.devices()[0])})
        with pytest.raises(stoker.SpecError, match=r"not a jax\.sharding\.Sharding"):
            to_jax(loader, sharding="batch")


def test_shard_from_jax_is_this_process() -> None:
    assert shard_from_jax() == (jax.process_index(), jax.process_count()) == (0, 1)


def test_named_sharding_splits_the_batch_over_devices(sample: stoker.Dataset, tmp_path: Path) -> None:
    # Two CPU devices need XLA_FLAGS before JAX starts: a fresh interpreter.
    script = textwrap.dedent(f"""
        import jax, numpy as np, stoker
        from jax.sharding import NamedSharding, PartitionSpec
        assert jax.device_count() == 2
        ds = stoker.Dataset(image=stoker.Field({str(tmp_path / "img_*.bin")!r}, "int8", ({RES}, {RES}, 1)),
                            label=stoker.Field({str(tmp_path / "out_*.bin.gz")!r}, "float32"))
        mesh = jax.make_mesh((2,), ("batch",))
        data = NamedSharding(mesh, PartitionSpec("batch"))
        with ds.loader(16, drop_remainder=True) as plain:
            expected = [dict(b) for b in plain]
        whole = NamedSharding(mesh, PartitionSpec())  # the labels replicated on both devices
        with ds.loader(16, drop_remainder=True).to_jax(sharding={{"image": data, "label": whole}}) as batches:
            got = list(batches)
            assert batches._direct.usable  # placed by JAX's C++ call, as device_put places them
        assert len(got) == len(expected)
        for e, g in zip(expected, got):
            assert g["image"].sharding == data and g["label"].sharding == whole
            assert [s.data.shape[0] for s in g["image"].addressable_shards] == [8, 8]
            assert [s.data.shape[0] for s in g["label"].addressable_shards] == [16, 16]
            for name, s in (("image", data), ("label", whole)):
                ref = jax.device_put(e[name], s)
                assert g[name].aval == ref.aval and g[name].committed and ref.committed
                assert np.array_equal(np.asarray(g[name]), e[name])
        # 129 records: a last batch of 1 that the batch axis cannot split over 2 devices. Its new
        # shape is checked against device_put, which raises; so does to_jax, at that batch.
        stoker.write_sample({str(tmp_path / "odd")!r}, pairs=3, records=43, inrez={RES})
        odd = stoker.Dataset(image=stoker.Field({str(tmp_path / "odd" / "img_*.bin")!r}, "int8", ({RES}, {RES}, 1)),
                             label=stoker.Field({str(tmp_path / "odd" / "out_*.bin.gz")!r}, "float32"))
        with odd.loader(16).to_jax(sharding=data, prefetch_to_device=0) as batches:
            it = iter(batches)
            assert [next(it)["image"].shape[0] for _ in range(8)] == [16] * 8
            try:
                next(it)
            except ValueError as e:
                assert "does not evenly divide the dimension size 1" in str(e), e
            else:
                raise AssertionError("a batch of 1 was split over 2 devices")
        print("ok")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_jax_train_example_trains_a_few_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import jax_train
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert jax_train.main(["--data", str(tmp_path / "data"), "--steps", "30"]) == 0
    assert "position 64" in capsys.readouterr().out  # 30 steps of 32 over 4 batches an epoch
