"""Shuffle modes ("global", "files"), sharding and the memory bound of global shuffle, end to end on real files."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

import stoker
from stoker.order import permute_groups
from stoker.testing import assert_same_batches
from tests.helpers.indexed import R, collect, ids_of, write_dataset

COUNTS = [37, 0, 50, 13, 63]  # 163 records, one empty group; 163 is prime so every shard count trims
TOTAL = sum(COUNTS)


def split_epochs(batches: list[dict[str, np.ndarray]], per_epoch: int, epochs: int) -> list[list[dict]]:
    assert len(batches) == per_epoch * epochs
    return [batches[e * per_epoch : (e + 1) * per_epoch] for e in range(epochs)]


def reference_interleave(counts: Sequence[int], order: Sequence[int], cycle: int, block: int) -> list[tuple[int, int]]:
    """(group, record) in tf.data's ``interleave(cycle, block, deterministic=True)`` order, record by record.

    Written from tf.data's InterleaveDatasetOp::GetNextInternal, independently of stoker.plan.batches.
    """
    inputs = iter(order)
    slots: list[tuple[int, Iterator[int]] | None] = [None] * cycle
    end_of_input = False
    num_open = cycle_index = block_index = 0
    out: list[tuple[int, int]] = []
    while not end_of_input or num_open:
        slot = slots[cycle_index]
        if slot is not None:
            g, it = slot
            rec = next(it, None)
            if rec is not None:
                out.append((g, rec))
                block_index += 1
                if block_index == block:
                    block_index, cycle_index = 0, (cycle_index + 1) % cycle
                continue
            slots[cycle_index] = None
            num_open -= 1
            block_index, cycle_index = 0, (cycle_index + 1) % cycle
        elif not end_of_input:
            g = next(inputs, None)
            if g is None:
                end_of_input = True
            else:
                slots[cycle_index] = (g, iter(range(counts[g])))
                num_open += 1
        else:
            block_index, cycle_index = 0, (cycle_index + 1) % cycle
    return out


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    return write_dataset(tmp_path_factory.mktemp("shuffle"), COUNTS)


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[stoker.Dataset, list[int]]:
    """Ten groups of uneven sizes: enough groups and blocks that orders can be told apart."""
    counts = [12, 30, 7, 0, 21, 16, 9, 25, 3, 18]
    return write_dataset(tmp_path_factory.mktemp("many"), counts), counts


# -- shuffle="global" --------------------------------------------------------------------


def test_global_each_epoch_is_a_permutation_that_differs_by_epoch_and_seed(ds: stoker.Dataset) -> None:
    loader = ds.loader(10, epochs=2, shuffle="global", seed=3)
    per = len(loader)
    assert per == -(-TOTAL // 10)
    e0, e1 = (ids_of(b) for b in split_epochs(collect(loader), per, 2))
    for ids in (e0, e1):
        np.testing.assert_array_equal(np.sort(ids), np.arange(TOTAL))  # every record exactly once
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, np.arange(TOTAL))
    sequential = ids_of(collect(ds.loader(10)))
    assert not np.array_equal(e0, sequential)
    other = ids_of(collect(ds.loader(10, shuffle="global", seed=4)))
    np.testing.assert_array_equal(np.sort(other), np.arange(TOTAL))
    assert not np.array_equal(e0, other)
    again = ids_of(collect(ds.loader(10, epochs=1, shuffle="global", seed=3)))
    np.testing.assert_array_equal(again, e0)


def test_global_same_seed_same_batches_for_any_threads_and_prefetch(ds: stoker.Dataset) -> None:
    reference = collect(ds.loader(9, epochs=2, shuffle="global", seed=11, threads=1, prefetch=1))
    for threads in (1, 2, 4):
        for prefetch in (1, 2, 3, 4):
            got = collect(ds.loader(9, epochs=2, shuffle="global", seed=11, threads=threads, prefetch=prefetch))
            assert_same_batches(reference, got, context=f"threads={threads} prefetch={prefetch}: ")


@pytest.mark.parametrize("cast", [None, "float32"])
def test_global_with_index_matches_label(ds: stoker.Dataset, cast: str | None) -> None:
    firsts = np.concatenate([[0], np.cumsum(COUNTS)])
    batches = collect(ds.loader(16, epochs=2, shuffle="global", seed=5, with_index=True, cast=cast, threads=2))
    ids = ids_of(batches)
    assert len(ids) == 2 * TOTAL
    for b in batches:
        g, i = b["__group__"], b["__index__"]
        assert g.dtype == np.int64 and i.dtype == np.int64
        np.testing.assert_array_equal(firsts[g] + i, b["label"].astype(np.int64))
        assert np.all(i < np.asarray(COUNTS)[g])


def test_global_gathers_fields_whose_files_mix_raw_and_compressed(tmp_path: Path) -> None:
    """A batch's records of one field come from raw files (read through their maps) and from
    compressed files (decoded, held in memory) in the same gather: group 2's frames and group 3's
    labels are stored the other way. Every record once, with its own label, at its place."""
    write_dataset(tmp_path, COUNTS)
    frames, labels = tmp_path / "img_0002.bin", tmp_path / "out_0003.bin.gz"
    (tmp_path / "img_0002.bin.gz").write_bytes(gzip.compress(frames.read_bytes(), compresslevel=1))
    (tmp_path / "out_0003.bin").write_bytes(gzip.decompress(labels.read_bytes()))
    frames.unlink()
    labels.unlink()
    ds = stoker.Dataset(
        image=stoker.Field(sorted(str(p) for p in tmp_path.glob("img_*")), "int8", (R, R, 1)),
        label=stoker.Field(sorted(str(p) for p in tmp_path.glob("out_*")), "float32"),
    )
    assert [g.paths["image"].endswith(".gz") for g in ds.groups] == [False, False, True, False, False]
    assert [g.paths["label"].endswith(".gz") for g in ds.groups] == [True, True, True, False, True]
    firsts = np.concatenate([[0], np.cumsum(COUNTS)])
    for cast in (None, "float32"):
        batches = collect(ds.loader(32, shuffle="global", seed=11, with_index=True, cast=cast, threads=2))
        ids = ids_of(batches)
        assert sorted(ids.tolist()) == list(range(TOTAL))
        for b in batches:
            np.testing.assert_array_equal(firsts[b["__group__"]] + b["__index__"], b["label"].astype(np.int64))
        sequential = collect(ds.loader(TOTAL, cast=cast))[0]
        np.testing.assert_array_equal(np.concatenate([b["image"] for b in batches]), sequential["image"][ids])


# -- shuffle="files" ---------------------------------------------------------------------


def group_order(batches: Sequence[dict[str, np.ndarray]]) -> list[int]:
    """Groups in the order their first record appears."""
    seen: dict[int, None] = {}
    for b in batches:
        for g in b["__group__"].tolist():
            seen.setdefault(g, None)
    return list(seen)


@pytest.mark.parametrize("window", [1, 2, 16])
def test_files_covers_each_epoch_in_file_order_within_groups(
    many: tuple[stoker.Dataset, list[int]], window: int
) -> None:
    dataset, counts = many
    total = sum(counts)
    loader = dataset.loader(7, epochs=2, shuffle="files", seed=1, window=window, block_length=2, with_index=True)
    per = len(loader)
    epochs = split_epochs(collect(loader), per, 2)
    orders = []
    for batches in epochs:
        ids = ids_of(batches)
        np.testing.assert_array_equal(np.sort(ids), np.arange(total))
        groups = np.concatenate([b["__group__"] for b in batches])
        index = np.concatenate([b["__index__"] for b in batches])
        for g, n in enumerate(counts):
            # compressed streams read front to back: each group's records in increasing order
            np.testing.assert_array_equal(index[groups == g], np.arange(n))
        orders.append(group_order(batches))
    assert sorted(orders[0]) == [g for g, n in enumerate(counts) if n]
    assert orders[0] != orders[1]  # group order differs across epochs
    other = group_order(collect(dataset.loader(7, shuffle="files", seed=2, window=window, block_length=2,
                                               with_index=True)))  # fmt: skip
    assert other != orders[0]  # ... and across seeds


@pytest.mark.parametrize(("cycle", "block"), [(1, 1), (3, 2), (2, 5), (4, 3)])
def test_files_window_1_is_interleave_over_permuted_groups(
    many: tuple[stoker.Dataset, list[int]], cycle: int, block: int
) -> None:
    dataset, counts = many
    loader = dataset.loader(5, epochs=2, shuffle="files", seed=9, window=1, cycle_length=cycle, block_length=block,
                            with_index=True)  # fmt: skip
    per = len(loader)
    for epoch, batches in enumerate(split_epochs(collect(loader), per, 2)):
        got = list(zip(np.concatenate([b["__group__"] for b in batches]).tolist(),
                       np.concatenate([b["__index__"] for b in batches]).tolist(), strict=True))  # fmt: skip
        order = permute_groups(len(counts), 9, epoch).tolist()
        assert sorted(order) == list(range(len(counts)))
        assert got == reference_interleave(counts, order, cycle, block)


def test_files_window_shuffles_blocks(many: tuple[stoker.Dataset, list[int]]) -> None:
    dataset, _ = many
    plain = ids_of(collect(dataset.loader(8, shuffle="files", seed=4, window=1, block_length=2)))
    mixed = ids_of(collect(dataset.loader(8, shuffle="files", seed=4, window=8, block_length=2)))
    np.testing.assert_array_equal(np.sort(plain), np.sort(mixed))
    assert not np.array_equal(plain, mixed)


@pytest.mark.parametrize("shuffle", ["files", "global"])
def test_order_independent_of_memory_budget_and_threads(many: tuple[stoker.Dataset, list[int]], shuffle: str) -> None:
    dataset, counts = many
    # batch: 6 * (16 + 4) = 120 bytes; 8 KiB also holds the decoded labels (4 bytes * 141) for "global"
    reference = collect(dataset.loader(6, epochs=2, shuffle=shuffle, seed=21, memory_budget="8KiB", threads=1))
    assert len(ids_of(reference)) == 2 * sum(counts)
    for budget, threads in (("512MiB", 1), ("8KiB", 4), ("1GiB", 3), (4096, 2)):
        got = collect(dataset.loader(6, epochs=2, shuffle=shuffle, seed=21, memory_budget=budget, threads=threads))
        assert_same_batches(reference, got, context=f"memory_budget={budget} threads={threads}: ")


# -- argument errors ---------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, "foo", "Global", 1, "file"])
def test_bad_shuffle_is_spec_error(ds: stoker.Dataset, shuffle: object) -> None:
    with pytest.raises(stoker.SpecError, match="shuffle"):
        ds.loader(4, shuffle=shuffle, seed=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("shuffle", ["global", "files"])
@pytest.mark.parametrize("seed", [None, -1, 1.5, True, "1"])
def test_shuffle_needs_a_seed(ds: stoker.Dataset, shuffle: str, seed: object) -> None:
    with pytest.raises(stoker.SpecError, match="seed"):
        ds.loader(4, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]


def test_global_shuffle_with_compressed_field_over_budget(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path, [1000, 1000])  # decoded labels: 2000 * 4 = 8000 bytes
    # batch of 10: 10 * (16 + 4) = 200 bytes; prefetch 2 -> 400; 4096 - 400 < 8000 < 64 KiB - 400
    with pytest.raises(stoker.SpecError) as info:
        dataset.loader(10, shuffle="global", seed=0, memory_budget="4KiB", threads=1, prefetch=2)
    message = str(info.value)
    assert "shuffle='files'" in message
    assert "label" in message and info.value.field == "label"
    assert info.value.path is not None and info.value.path.endswith("out_0000.bin.gz")
    # the same budget is fine for "files" (streams), and a bigger one for "global"
    files = ids_of(collect(dataset.loader(10, shuffle="files", seed=0, memory_budget="4KiB", threads=1, prefetch=2)))
    np.testing.assert_array_equal(np.sort(files), np.arange(2000))
    glob_ = ids_of(collect(dataset.loader(10, shuffle="global", seed=0, memory_budget="64KiB", threads=1, prefetch=2)))
    np.testing.assert_array_equal(np.sort(glob_), np.arange(2000))


# -- shards ------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, "files", "global"])
@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_shards_disjoint_and_cover(ds: stoker.Dataset, shuffle: object, count: int, drop_remainder: bool) -> None:
    b = 7
    seed = 2 if shuffle else None
    sequence = ids_of(collect(ds.loader(b, shuffle=shuffle, seed=seed)))  # the epoch's global sequence
    assert len(sequence) == TOTAL

    # even=False: disjoint, and (without drop_remainder) together exactly the epoch
    uneven = []
    for i in range(count):
        loader = ds.loader(b, shuffle=shuffle, seed=seed, shard=(i, count), even=False, drop_remainder=drop_remainder)
        batches = collect(loader)
        assert len(batches) == len(loader)
        ids = ids_of(batches)
        # shard i takes positions i, i + c, i + 2c, ... of the sequence
        mine = sequence[i::count]
        np.testing.assert_array_equal(ids, mine[: len(mine) // b * b] if drop_remainder else mine)
        uneven.append(ids)
    union = np.concatenate(uneven)
    assert len(np.unique(union)) == len(union)
    if not drop_remainder:
        np.testing.assert_array_equal(np.sort(union), np.arange(TOTAL))

    # even=True: every shard the same number of batches, each trimmed to TOTAL // count records
    per_shard = TOTAL // count
    even = []
    for i in range(count):
        loader = ds.loader(b, shuffle=shuffle, seed=seed, shard=(i, count), drop_remainder=drop_remainder)
        batches = collect(loader)
        assert len(batches) == len(loader) == (per_shard // b if drop_remainder else -(-per_shard // b))
        ids = ids_of(batches)
        assert len(ids) == (per_shard // b * b if drop_remainder else per_shard)
        even.append(ids)
    union = np.concatenate(even)
    assert len(np.unique(union)) == len(union)
    if not drop_remainder:
        trimmed = TOTAL - count * per_shard
        assert 0 < trimmed < count
        # the trimmed records are the last positions of the sequence
        assert set(np.arange(TOTAL).tolist()) - set(union.tolist()) == set(sequence[TOTAL - trimmed :].tolist())


@pytest.mark.parametrize("shard", [(1, 1), (-1, 2), (2, 2), (0, 0), (0,), (0, 1, 2), "01", (True, 2), (0, 2.0), None])
def test_bad_shard_is_spec_error(ds: stoker.Dataset, shard: object) -> None:
    with pytest.raises(stoker.SpecError, match="shard"):
        ds.loader(4, shard=shard)  # type: ignore[arg-type]


# -- memory ------------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, threading, time
    import numpy as np
    import stoker

    def resident():
        # Process-private memory: RSS minus file-backed pages (RssFile). Batch buffers are
        # anonymous shared mappings (RssShmem), numpy temporaries are RssAnon.
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.startswith("Rss"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields["RssAnon"] + fields.get("RssShmem", 0)

    directory = sys.argv[1]
    ds = stoker.Dataset(image=stoker.Field(directory + "/img_*.bin", "int8", (256, 256, 1)))
    loader = ds.loader(64, cast="float32", shuffle="global", seed=0, memory_budget="32MiB")
    baseline_private = resident()
    baseline_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = [baseline_private]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seen = np.zeros(len(ds), dtype=np.int64)
    batches = 0
    with loader:
        for batch in loader:
            image = batch["image"]
            assert image.dtype == np.float32 and image.shape[1:] == (256, 256, 1)
            ids = image.reshape(len(image), -1)[:, :4].astype(np.int8).view(np.uint32).reshape(-1)
            seen[ids] += 1
            batches += 1
            peak[0] = max(peak[0], resident())
    stop.set()
    sampler.join()
    print(json.dumps({
        "records": int(seen.sum()), "once": bool((seen == 1).all()), "batches": batches,
        "baseline_private": baseline_private, "peak_private": peak[0],
        "baseline_maxrss": baseline_maxrss,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))
    """
)


@pytest.mark.slow
def test_global_shuffle_memory_is_bounded(tmp_path: Path) -> None:
    """One epoch of global shuffle over 320 MiB with memory_budget=32MiB stays near the budget.

    ``ru_maxrss`` counts file pages mapped into the process, and the raw files are read
    through memory maps that stay open (up to 64 files) while the pass runs, so it grows
    towards the dataset's size (page cache the kernel can drop at any time, not memory the
    loader holds). The bound is therefore checked on process-private memory, RSS minus
    file-backed pages, sampled from /proc/self/status in a thread; ru_maxrss is reported.
    """
    record = 64 << 10
    per_file, files = 1024, 5  # 5120 records of 64 KiB = 320 MiB, 10x the budget
    for g in range(files):
        with open(tmp_path / f"img_{g:04d}.bin", "wb") as f:
            for start in range(0, per_file, 64):  # 4 MiB at a time: the parent stays small too
                idx = np.arange(g * per_file + start, g * per_file + start + 64, dtype="<u4")
                block = np.zeros((64, record), dtype=np.uint8)
                block[:, :4] = idx.view(np.uint8).reshape(64, 4)
                f.write(block.tobytes())
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["records"] == files * per_file and report["once"], report
    assert report["batches"] == files * per_file // 64
    budget, slack = 32 << 20, 64 << 20
    assert report["peak_private"] < report["baseline_private"] + budget + slack, report
