"""Transforms on the loader's workers: built-ins, fusion, reproducible randomness, resume, errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.testing import assert_resumable, assert_same_batches
from stoker.transforms import Cast, Normalize, RandomCrop, RandomFlip, batch_rng
from tests.helpers.data import LAB_GZ, FieldPlan, build
from tests.helpers.resources import consume

FRAME = FieldPlan("img", "int8", (6, 5, 2))
COUNTS = [13, 0, 7, 21, 3]  # 44 records, one empty group


def noise(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A user transform that draws from its rng: label + U(0, 1), and the draw itself."""
    out = dict(batch)
    draw = rng.random(len(batch["label"]))
    out["label"] = batch["label"] + draw.astype(np.float32)
    out["draw"] = draw
    return out


def augment() -> list[Any]:
    return [
        Normalize(mean=-0.5, std=127.5, fields="image"),
        RandomFlip(fields="image", axis=1),
        RandomCrop((4, 3), fields="image"),
        noise,
    ]


@pytest.fixture
def frames(tmp_path: Path) -> stoker.Dataset:
    return build(tmp_path, COUNTS, {"image": FRAME, "label": LAB_GZ})


def by_hand(plain: list[dict[str, np.ndarray]], fns: list[Any], seed: int, shard: tuple[int, int] = (0, 1)):
    """Apply ``fns`` to untransformed batches the slow way, with the documented generators."""
    i, c = shard
    out, pos, epoch = [], 0, None
    for b in plain:
        e = int(b.pop("__epoch__")[0]) if "__epoch__" in b else 0
        if e != epoch:
            epoch, pos = e, 0
        first = pos * c + i
        x = dict(b)
        for k, fn in enumerate(fns):
            x = fn(x, batch_rng(seed, e, first, k))
        out.append(x)
        pos += len(b["label"])
    return out


# -- the built-ins on their own ------------------------------------------------------------
def test_normalize_mean_std_maps_int8_frames_onto_exactly_minus_one_to_one() -> None:
    x = np.arange(-128, 128, dtype=np.int8).reshape(4, 8, 8, 1)
    y = Normalize(mean=-0.5, std=127.5, fields="image")({"image": x}, batch_rng(0, 0, 0, 0))["image"]
    assert y.dtype == np.float32 and y.min() == -1.0 and y.max() == 1.0
    assert np.array_equal(y, ((x.astype(np.float32) + np.float32(0.5)) / np.float32(127.5)))


def test_normalize_per_channel_scale_offset_broadcasts_over_the_last_axis() -> None:
    x = np.arange(24, dtype=np.uint8).reshape(2, 2, 2, 3)
    scale, offset = np.array([1.0, 2.0, 4.0]), np.array([0.0, -1.0, 10.0])
    y = Normalize(scale, offset, fields="x", dtype="float64")({"x": x}, batch_rng(0, 0, 0, 0))["x"]
    assert y.dtype == np.float64 and np.array_equal(y, x * scale + offset)


def test_cast_gives_float16_and_bfloat16() -> None:
    import ml_dtypes

    x = np.arange(-128, 128, dtype=np.int8).reshape(16, 16)
    for name, want in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
        y = Cast(name, fields="x")({"x": x}, batch_rng(0, 0, 0, 0))["x"]
        assert y.dtype == np.dtype(want) and np.array_equal(y.astype(np.float32), x.astype(np.float32))
    # Past 2048 float16 rounds (to nearest, ties to even): the compiled cast rounds as numpy does.
    x16 = np.arange(-32768, 32768, dtype=np.int16).reshape(256, 256)
    y16 = Cast("float16", fields="x")({"x": x16}, batch_rng(0, 0, 0, 0))["x"]
    assert np.array_equal(y16.view(np.uint16), x16.astype(np.float16).view(np.uint16))


def test_random_flip_p_zero_keeps_and_p_one_reverses_the_axis() -> None:
    x = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4)
    rng = batch_rng(0, 0, 0, 0)
    assert np.array_equal(RandomFlip(fields="x", axis=1, p=0.0)({"x": x}, rng)["x"], x)
    assert np.array_equal(RandomFlip(fields="x", axis=1, p=1.0)({"x": x}, rng)["x"], x[:, :, ::-1])
    assert np.array_equal(RandomFlip(fields="x", axis=0, p=1.0)({"x": x}, rng)["x"], x[:, ::-1, :])


def test_random_flip_and_crop_treat_every_named_field_alike() -> None:
    x = np.arange(64 * 6 * 6, dtype=np.int32).reshape(64, 6, 6)
    mask = -x
    out = RandomCrop((3, 4), fields=["x", "mask"])({"x": x, "mask": mask}, batch_rng(5, 0, 0, 0))
    assert out["x"].shape == (64, 3, 4) and np.array_equal(out["mask"], -out["x"])
    for j in range(64):  # every window is a piece of its own record
        oy, ox = divmod(int(out["x"][j, 0, 0]) - j * 36, 6)
        assert np.array_equal(out["x"][j], x[j, oy : oy + 3, ox : ox + 4])
    flipped = RandomFlip(fields=["x", "mask"])({"x": x, "mask": mask}, batch_rng(5, 0, 0, 0))
    assert np.array_equal(flipped["mask"], -flipped["x"])
    changed = [not np.array_equal(flipped["x"][j], x[j]) for j in range(64)]
    assert 0 < sum(changed) < 64


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Normalize(1.0, mean=0.0, fields="x"), "not both"),
        (lambda: Normalize(mean=0.0, std=0.0, fields="x"), "std"),
        (lambda: Normalize(fields="x", dtype="int8"), "float32 or float64"),
        (lambda: Normalize(fields=[]), "fields"),
        (lambda: RandomFlip(fields="x", p=2.0), "p=2.0"),
        (lambda: RandomCrop(0, fields="x"), "size"),
        (lambda: RandomCrop((2, 2), fields="x", axes=(0,)), "axes"),
        (lambda: Cast("complex-ish", fields="x"), "complex-ish"),
    ],
)
def test_built_in_arguments_are_checked(make: Any, match: str) -> None:
    with pytest.raises(stoker.SpecError, match=match):
        make()


# -- in the loader ---------------------------------------------------------------------------
CHAINS: dict[str, Any] = {
    # flips and crops commute with the elementwise ops: views around one copy
    "crop,normalize,flip": (
        lambda: [RandomCrop((4, 3), fields="image"), Normalize(mean=-0.5, std=127.5, fields="image"),
                 RandomFlip(fields="image", axis=1), noise],
        {"image"},
    ),
    "flip,cast16": (lambda: [RandomFlip(fields="image", axis=0), Cast("float16", fields="image")], {"image"}),
    "cast16 only": (lambda: [Cast("float16", fields="image")], {"image"}),  # one copy of the whole batch
    "bfloat16 only": (lambda: [Cast("bfloat16", fields="image")], {"image"}),
    "flip only": (lambda: [RandomFlip(fields="image", axis=1)], {"image"}),
    # these do not: op after op, chunk by chunk
    "flip then crop of that axis": (augment, set()),
    "per-channel normalize, channel flip": (
        lambda: [Normalize([1.0, 2.0], [0.5, -1.0], fields="image"), RandomFlip(fields="image", axis=2)],
        set(),
    ),
}  # fmt: skip


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("cast", [None, "float32", {"image": "uint8"}])
@pytest.mark.parametrize("shuffle", [False, "global"])
def test_fused_loader_equals_the_transforms_applied_by_hand(
    frames: stoker.Dataset, chain: str, cast: Any, shuffle: Any
) -> None:
    make, direct = CHAINS[chain]
    kw = {"cast": cast, "shuffle": shuffle, "seed": 11, "with_index": True, "epochs": 2}
    plain = []
    for epoch_batches in _epochs(frames.loader(8, **kw)):
        plain.extend(epoch_batches)
    expected = by_hand(plain, make(), 11)
    with frames.loader(8, transform=make(), threads=3, **kw) as loader:
        assert loader.stage is not None and loader.stage.direct == direct
        got = [dict(b) for b in loader]
    assert_same_batches(expected, got)


def _epochs(loader: stoker.Loader) -> list[list[dict[str, np.ndarray]]]:
    """Batches grouped per epoch, each tagged with its epoch (the loader's own record of it)."""
    out: list[list[dict[str, np.ndarray]]] = []
    with loader:
        for b in loader:
            epoch = loader.position[0]
            while len(out) <= epoch:
                out.append([])
            b = dict(b)
            b["__epoch__"] = np.array([epoch])
            out[epoch].append(b)
    return out


def test_loader_reports_what_built_in_transforms_deliver(frames: stoker.Dataset) -> None:
    loader = frames.loader(8, transform=[RandomCrop((4, 3), fields="image"), Cast("float16", fields="image")])
    assert loader.dtypes["image"] == np.float16 and loader.shapes["image"] == (4, 3, 2)
    b = next(iter(loader))
    assert b["image"].dtype == np.float16 and b["image"].shape == (8, 4, 3, 2)
    loader.close()


@pytest.mark.parametrize("shuffle", [False, "global"])
def test_random_augmentation_is_the_same_on_any_thread_count(frames: stoker.Dataset, shuffle: Any) -> None:
    def run(threads: int, prefetch: int) -> list[dict[str, np.ndarray]]:
        with frames.loader(4, epochs=2, shuffle=shuffle, seed=3, transform=augment(), threads=threads,
                           prefetch=prefetch) as loader:  # fmt: skip
            return [dict(b) for b in loader]

    one = run(1, 1)
    assert_same_batches(one, run(4, 8))
    assert_same_batches(one, run(2, 3))
    draws = np.concatenate([b["draw"] for b in one])
    assert len(np.unique(draws)) == len(draws)  # every batch and epoch draws afresh


@pytest.mark.parametrize("shuffle", [False, "files", "global"])
def test_resumed_run_draws_exactly_what_an_uninterrupted_one_does(frames: stoker.Dataset, shuffle: Any) -> None:
    assert_resumable(
        lambda: frames.loader(5, epochs=2, shuffle=shuffle, seed=9, transform=augment(), threads=2), steps=5
    )


def test_elastic_resume_keeps_each_records_draw_keyed_to_its_position(frames: stoker.Dataset) -> None:
    def position_draw(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {**batch, "draw": np.full(len(batch["label"]), rng.random())}

    # batch_size 1: each batch's rng is keyed by its one record's position, so any batch size
    # or shard count that resumes at the same position gives each record the same draw.
    def labels_and_draws(loader: stoker.Loader) -> dict[float, float]:
        with loader:
            return {float(b["label"][0]): float(b["draw"][0]) for b in loader}

    whole = labels_and_draws(frames.loader(1, shuffle="global", seed=4, transform=position_draw))
    shards = {}
    for i in range(2):
        shards.update(
            labels_and_draws(
                frames.loader(1, shuffle="global", seed=4, transform=position_draw, shard=(i, 2), even=False)
            )
        )
    assert shards == whole


def test_shards_draw_different_augmentation(frames: stoker.Dataset) -> None:
    def draws(i: int) -> np.ndarray:
        with frames.loader(4, transform=[noise], seed=1, shard=(i, 2)) as loader:
            return np.concatenate([b["draw"] for b in loader])

    a, b = draws(0), draws(1)
    assert len(a) == len(b) and not np.intersect1d(a, b).size


def test_seed_none_means_seed_zero_every_run(frames: stoker.Dataset) -> None:
    def run(seed: int | None) -> list[dict[str, np.ndarray]]:
        with frames.loader(8, transform=augment(), seed=seed) as loader:
            return [dict(b) for b in loader]

    assert_same_batches(run(0), run(None))
    assert_same_batches(run(None), run(None))
    with pytest.raises(AssertionError):
        assert_same_batches(run(0), run(1))


def test_each_transform_of_a_list_gets_its_own_stream(frames: stoker.Dataset) -> None:
    def first_draw(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {**batch, f"d{len(batch)}": np.array([rng.random()])}

    with frames.loader(8, transform=[first_draw, first_draw], seed=2) as loader:
        b = next(iter(loader))
    assert b["d2"][0] != b["d3"][0]
    assert b["d2"][0] == batch_rng(2, 0, 0, 0).random() and b["d3"][0] == batch_rng(2, 0, 0, 1).random()


# -- errors ----------------------------------------------------------------------------------
def fail_at_group_3(batch: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    if 3 in batch["__group__"]:
        raise ValueError("bad record in group 3")
    return batch


def test_user_error_reaches_the_consumer_with_batch_and_records(frames: stoker.Dataset) -> None:
    fns = [Normalize(mean=0, std=1, fields="image"), fail_at_group_3]
    loader = frames.loader(8, transform=fns, threads=3, with_index=True)
    got, err = consume(loader)
    assert len(got) == 2  # every batch before the failing one is delivered
    assert isinstance(err, ValueError) and "bad record in group 3" in str(err)
    notes = "\n".join(err.__notes__)
    assert "transform 1 (fail_at_group_3) on batch 2 of epoch 0" in notes
    assert "first record at position 16" in notes
    img = frames.files[3]["image"].path
    assert f"group 3 ({img}) records 0..3" in notes and "group 2" in notes
    assert any(f.name == "fail_at_group_3" for f in _frames(err))  # the traceback reaches the user's code


def _frames(err: BaseException) -> list[Any]:
    import traceback

    return list(traceback.extract_tb(err.__traceback__))


def test_a_transform_that_returns_no_dict_is_an_error_naming_it(frames: stoker.Dataset) -> None:
    loader = frames.loader(8, transform=lambda b, rng: b["image"])
    with pytest.raises(stoker.TransformError, match="a numpy array of shape") as e:
        next(iter(loader))
    assert isinstance(e.value, TypeError)
    assert "transform 0 (test_a_transform_that_returns_no_dict_is_an_error_naming_it.<locals>.<lambda>)" in str(e.value)
    assert frames.files[0]["image"].path in "\n".join(e.value.__notes__)
    loader.close()


# A batch holding a record of group 3 (the 3rd batch of 8, first record at position 16) comes back wrong.
def none_at_group_3(batch: dict[str, np.ndarray], rng: np.random.Generator) -> Any:
    return None if 3 in batch["__group__"] else batch


def list_at_group_3(batch: dict[str, np.ndarray], rng: np.random.Generator) -> Any:
    return [batch] if 3 in batch["__group__"] else batch


def list_value_at_group_3(batch: dict[str, np.ndarray], rng: np.random.Generator) -> Any:
    return {**batch, "label": batch["label"].tolist()} if 3 in batch["__group__"] else batch


@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize(
    ("fn", "returned"),
    [
        (none_at_group_3, "returned None"),
        (list_at_group_3, "returned a list of 1 items"),
        (list_value_at_group_3, r"returned a dict whose values are not all numpy arrays \(\{'label': 'list'\}\)"),
    ],
)
def test_a_transform_returning_no_batch_is_a_transform_error_after_every_good_batch(
    frames: stoker.Dataset, workers: str, fn: Any, returned: str
) -> None:
    """None, a list, a dict of lists: a TransformError naming the transform, what it returned and
    the batch, raised to the consumer; the batches before it are delivered whole, none after."""
    loader = frames.loader(8, transform=[Normalize(mean=0, std=1, fields="image"), fn], with_index=True,
                           workers=workers, threads=2)  # fmt: skip
    got, err = consume(loader)
    loader.close()
    assert isinstance(err, stoker.TransformError) and isinstance(err, TypeError), repr(err)
    message = str(err)
    assert f"transform 1 ({fn.__name__}) " in message
    assert re.search(returned, message), message
    assert "on batch 2 of epoch 0 (first record at position 16 of the epoch's sequence)" in message
    assert frames.files[3]["image"].path in "\n".join(err.__notes__)
    assert len(got) == 2  # the two batches before it, whole, and nothing from it on
    with frames.loader(8, with_index=True) as plain:
        want = [b for _, b in zip(range(2), plain, strict=False)]
    for b, w in zip(got, want, strict=True):
        assert all(isinstance(v, np.ndarray) and len(v) == 8 for v in b.values())
        assert np.array_equal(b["__group__"], w["__group__"]) and np.array_equal(b["__index__"], w["__index__"])
        assert np.array_equal(b["image"], w["image"].astype(np.float32)) and np.array_equal(b["label"], w["label"])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"transform": [RandomFlip(fields="mask")]}, "names field 'mask'"),
        ({"transform": [RandomCrop((9, 9), fields="image")]}, "do not fit field 'image'"),
        ({"transform": [RandomFlip(fields="image", axis=3)]}, "axis=3 on field 'image'"),
        ({"transform": [Normalize([1, 2, 3], fields="image")]}, "field 'image'"),
        ({"transform": ["not a function"]}, "not callable"),
        ({"transform": []}, "empty list"),
        ({"transform": [noise], "seed": -1}, "seed=-1"),
        ({"transform": [noise], "workers": "fork"}, "workers='fork'"),
        ({"workers": "process"}, "none was given"),
    ],
)
def test_loader_checks_transform_arguments(frames: stoker.Dataset, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(stoker.SpecError, match=match):
        frames.loader(8, **kw)


@pytest.mark.parametrize("shuffle", [False, "global"])
def test_pad_last_batches_draw_reproducibly_and_resume(frames: stoker.Dataset, shuffle: Any) -> None:
    def make(shard: tuple[int, int] = (1, 3)) -> stoker.Loader:
        return frames.loader(6, epochs=2, pad_last=True, shard=shard, shuffle=shuffle, seed=8, transform=augment())

    assert_resumable(make, steps=4)
    with make() as a, frames.loader(6, epochs=2, pad_last=True, shard=(1, 3), shuffle=shuffle, seed=8,
                                    transform=augment(), threads=1) as b:  # fmt: skip
        assert_same_batches(list(a), list(b))
    for batch in make():
        assert batch["image"].shape == (6, 4, 3, 2) and "__valid__" in batch


def test_subset_loaders_take_transforms(frames: stoker.Dataset) -> None:
    sub = frames.select(groups=[3, 4])
    with sub.loader(8, transform=[Normalize(mean=-0.5, std=127.5, fields="image")], seed=1) as loader:
        got = [dict(b) for b in loader]
    with sub.loader(8) as loader:
        plain = [dict(b) for b in loader]
    assert_same_batches(by_hand(plain, [Normalize(mean=-0.5, std=127.5, fields="image")], 1), got)
