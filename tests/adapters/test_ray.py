"""stoker.ray.read: a Ray Data Dataset over stoker's reader, on a local 2-CPU Ray cluster and on
a two-node cluster of its own (head and worker ``ray start``) in a loopback-only namespace."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray import cloudpickle
from ray.data.block import BlockAccessor

import stoker
import stoker.ray
from stoker.plan.order import permute_groups
from tests.helpers import HELPERS
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, build, check_batches
from tests.helpers.indexed import ids_of, write_dataset
from tests.helpers.s3 import remote_dataset, s3_options, upload

pytestmark = pytest.mark.ray

LAB_ZZ = FieldPlan("lab", "int16", (2,), kind="zlib", header=3)
# Decompresses to ~10 MiB, over stoker.engine.decoded.VERIFY_WHOLE_BYTES: streamed, never decoded whole.
BIG_GZ = FieldPlan("big", "int16", (2048,), kind="gzip")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()


def _numpy(batches: Iterator[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(v) for k, v in b.items()} for b in batches]


def _pieces(source: stoker.ray.StokerDatasource, parallelism: int) -> list[list[tuple[int, int, int]]]:
    """Each task's pieces as (root group, start, stop)."""
    return [[(source.units[p.unit].group, p.start, p.stop) for p in t] for t in source.tasks(parallelism)]


def test_tasks_follow_the_requested_parallelism_in_whole_batches(tmp_path: Path) -> None:
    ds = build(tmp_path, [40, 0, 24, 64], {"image": IMG, "extra": FieldPlan("x", "int16", (2,))})
    source = stoker.ray.StokerDatasource(ds, batch_size=8)
    # 128 records for 4 tasks: 32 each, raw groups cut wherever a task is full.
    assert _pieces(source, 4) == [
        [(0, 0, 32)], [(0, 32, 40), (2, 0, 24)], [(3, 0, 32)], [(3, 32, 64)],
    ]  # fmt: skip
    # Tasks round up to whole batches (ceil(128 / 5) = 26 -> 32), so 4, not 5.
    assert len(source.get_read_tasks(5)) == 4
    # Many tasks: one batch each; every task holds a whole number of batches.
    tasks = source.get_read_tasks(1000)
    assert len(tasks) == 16 and all(t.metadata.num_rows == 8 for t in tasks)
    assert [t.metadata.num_rows for t in source.get_read_tasks(1)] == [128]
    assert tasks[1].metadata.input_files == (ds.groups[0].paths["image"], ds.groups[0].paths["extra"])
    # records_per_task fixes the tasks whatever Ray asks for.
    fixed = stoker.ray.StokerDatasource(ds, batch_size=8, records_per_task=48)
    assert [t.metadata.num_rows for t in fixed.get_read_tasks(2)] == [48, 48, 32]
    shuffled = stoker.ray.StokerDatasource(ds, batch_size=8, seed=4)
    groups = [shuffled.units[u].group for u in shuffled.order(0)]
    assert groups != [0, 2, 3] and sorted(groups) == [0, 2, 3]
    again = stoker.ray.StokerDatasource(ds, batch_size=8, seed=4)
    assert [again.units[u].group for u in again.order(0)] == groups
    assert [[p.unit for p in t] for t in shuffled.tasks(1, epoch=0)] == [shuffled.order(0)]
    with pytest.raises(stoker.SpecError, match="records_per_task=0"):
        stoker.ray.StokerDatasource(ds, records_per_task=0)
    with pytest.raises(stoker.SpecError, match="records_per_block=12 must be a whole multiple of batch_size=8"):
        stoker.ray.StokerDatasource(ds, batch_size=8, records_per_block=12)
    with pytest.raises(stoker.SpecError, match="epoch=-1 must be a non-negative integer"):
        stoker.ray.StokerDatasource(ds, epoch=-1)
    with pytest.raises(stoker.SpecError, match="reshuffle_each_iteration=1 must be True or False"):
        stoker.ray.StokerDatasource(ds, reshuffle_each_iteration=1)  # type: ignore[arg-type]


def test_compressed_groups_are_cut_only_where_seek_points_allow(tmp_path: Path) -> None:
    counts = [2304, 2304]  # 9 MiB of BIG_GZ per group
    plain = build(tmp_path, counts, {"image": IMG, "big": BIG_GZ, "label": LAB_GZ})
    # No index: a range of a large compressed file would inflate it from its start: groups stay whole.
    assert _pieces(stoker.ray.StokerDatasource(plain, batch_size=64), 8) == [[(0, 0, 2304)], [(1, 0, 2304)]]
    stoker.write_index(plain, spacing=2 << 20)  # seek points every ~2 MiB of output
    indexed = stoker.Dataset(plain.fields)
    points = [p for p in indexed._catalog.seek_points[(0, "big")] if p.decompressed > 0]
    source = stoker.ray.StokerDatasource(indexed, batch_size=64)
    grain = source.units[0].grain
    assert grain == -(-2304 // (len(points) + 1) // 64) * 64 == 512  # cut evenly, in whole batches
    for parallelism in (4, 8, 100):
        pieces = [p for t in _pieces(source, parallelism) for p in t]
        assert all(a % grain == 0 for _, a, _ in pieces)
        for g in (0, 1):  # at most one piece per seek point, plus the first
            assert 2 <= sum(pg == g for pg, _, _ in pieces) <= len(points) + 1
    # The small gzip labels (decoded whole by each task that reads some of them) cut anywhere.
    small = build(tmp_path / "small", [2304], {"image": IMG, "label": LAB_GZ})
    assert stoker.ray.StokerDatasource(small, batch_size=64).units[0].grain == 1


def test_every_record_once_with_all_its_fields_and_seek_point_ranges(tmp_path: Path, cluster: None) -> None:
    ds = build(tmp_path, [10, 0, 37, 25], {"image": IMG, "label": LAB_GZ, "extra": LAB_ZZ})
    rds = stoker.ray.read(ds, batch_size=4, records_per_block=8, with_index=True, cast={"image": "float32"})
    assert rds.count() == 72
    got = _numpy(rds.iter_batches(batch_size=7, batch_format="numpy"))
    check_batches(ds, got, cast={"image": "float32"})
    # Compressed groups read in ranges from the persistent index's seek points.
    big = build(tmp_path / "big", [2304, 2100], {"image": IMG, "big": BIG_GZ})
    stoker.write_index(big, spacing=2 << 20)
    big = stoker.Dataset(big.fields)
    rds = stoker.ray.read(big, batch_size=64, with_index=True, override_num_blocks=6)
    got = _numpy(rds.iter_batches(batch_size=64, batch_format="numpy"))
    check_batches(big, got)
    pieces = _pieces(stoker.ray.StokerDatasource(big, batch_size=64), 6)
    assert any(a > 0 for t in pieces for _, a, _ in t)  # some task started inside a compressed file


def test_a_read_task_carries_its_own_groups_only(tmp_path: Path) -> None:
    """What Ray ships per task does not grow with the number of groups."""
    sizes = {}
    for n in (10, 500):
        ds = build(tmp_path / str(n), [2] * n, {"image": IMG, "label": LAB_GZ})
        tasks = stoker.ray.StokerDatasource(ds, batch_size=2).get_read_tasks(n)
        assert len(tasks) == n
        blob = cloudpickle.dumps(tasks[0])
        assert b"img_0001" not in blob and b"out_0001" not in blob  # no other group's file
        sizes[n] = len(blob)
        whole = len(cloudpickle.dumps(ds._catalog))
    assert sizes[500] <= sizes[10] + 16, sizes
    assert whole > 50 * sizes[500], (whole, sizes)
    # Fewer tasks than groups: a task carries its own groups' files, 50 of the 500 here.
    tasks = stoker.ray.StokerDatasource(ds, batch_size=2).get_read_tasks(10)
    assert [len(t.metadata.input_files) for t in tasks] == [100] * 10
    assert len(cloudpickle.dumps(tasks[0])) < whole / 5


def test_blocks_are_whole_multiples_of_the_batch_size(tmp_path: Path, cluster: None) -> None:
    ds = build(tmp_path, [100, 36, 64], {"image": IMG, "label": LAB_GZ})
    ctx = ray.data.DataContext.get_current()
    before = ctx.target_max_block_size
    # Blocks follow Ray's target size: the fewest whole batches over it, handed on one by one.
    ctx.target_max_block_size = 3 * 8 * (36 + 4)
    try:
        rds = stoker.ray.read(ds, batch_size=8, override_num_blocks=2).materialize()
    finally:
        ctx.target_max_block_size = before
    rows = _block_rows(rds)
    assert sum(rows) == 200 and len(rows) >= 6
    assert all(r % 8 == 0 for r in rows), rows  # not one batch spans two blocks


def test_without_a_requested_parallelism_tasks_follow_the_size_and_the_cpus(tmp_path: Path, cluster: None) -> None:
    ds = build(tmp_path, [100, 36, 64], {"image": IMG, "label": FieldPlan("y", "float32")})
    source = stoker.ray.StokerDatasource(ds, batch_size=8)
    assert source.default_tasks() == 4  # 8 KiB of data: 2 tasks per CPU of the 2-CPU cluster
    # Not Ray's 200 (DataContext.read_op_min_num_blocks), and no block split behind our back.
    rds = stoker.ray.read(ds, batch_size=8).materialize()
    assert rds.num_blocks() == 4 and all(n % 8 == 0 for n in _block_rows(rds)[:-1])
    ctx = ray.data.DataContext.get_current()
    before = ctx.target_max_block_size
    ctx.target_max_block_size = 1000  # 200 rows of 40 bytes: one task per 1000 bytes of output
    try:
        assert source.default_tasks() == 8
    finally:
        ctx.target_max_block_size = before


def _block_rows(rds: ray.data.Dataset) -> list[int]:
    return [BlockAccessor.for_block(ray.get(ref)).num_rows() for ref in rds.get_internal_block_refs()]


def test_stored_dtype_travels_and_the_consumer_casts(tmp_path: Path, cluster: None) -> None:
    ds = build(tmp_path, [10, 7], {"image": IMG, "label": LAB_GZ})
    rds = stoker.ray.read(ds, batch_size=4, with_index=True)
    plain = _numpy(rds.iter_batches(batch_size=4, batch_format="numpy"))
    assert all(b["image"].dtype == np.int8 for b in plain)  # no cast asked: the stored dtype
    cast = list(stoker.ray.iter_batches(rds, batch_size=4, cast={"image": "float32", "label": "bfloat16"}))
    check_batches(ds, cast, cast={"image": "float32", "label": "bfloat16"})
    assert all(b["image"].flags.writeable for b in cast)
    with pytest.raises(stoker.SpecError, match=r"cast names unknown field\(s\) \['imgae'\]"):
        stoker.ray.cast_batch(plain[0], {"imgae": "float32"})
    whole = stoker.ray.cast_batch(plain[0], "float16")  # one dtype: every field, not the index columns
    assert whole["image"].dtype == whole["label"].dtype == np.float16 and whole["__index__"].dtype == np.int64


def test_a_subset_reads_its_own_records(tmp_path: Path, cluster: None) -> None:
    ds = build(tmp_path, [10, 0, 37, 25], {"image": IMG, "label": LAB_GZ})
    sub = ds.select(groups=[3, 0], records=np.arange(0, 35, 3))
    got = _numpy(stoker.ray.read(sub, batch_size=2, with_index=True).iter_batches(batch_format="numpy"))
    seen = sorted((int(g), int(i)) for b in got for g, i in zip(b["__group__"], b["__index__"]))
    expected = sorted(
        (int(sub._catalog.groups[v]), int(r))
        for v in range(sub.num_groups)
        for r in (sub._catalog.records[v] if sub._catalog.records[v] is not None else range(sub.records_in(v)))
    )
    assert seen == expected and len(seen) == len(sub)
    check_batches(ds, got, complete=False)  # every field of every row is its own record's


@pytest.fixture
def preserve_order(cluster: None) -> Iterator[None]:
    """Ray hands blocks on in the order of the read tasks, so an epoch's order is observable."""
    options = ray.data.DataContext.get_current().execution_options
    options.preserve_order = True
    try:
        yield
    finally:
        options.preserve_order = False


def _ids(batches: Iterator[dict[str, Any]]) -> list[int]:
    """The records' global ids (tests/helpers/indexed.py), after checking each image met its own label."""
    return [int(i) for b in _numpy(batches) for i in ids_of([b])]


def _epochs(rds: ray.data.Dataset, n: int) -> list[list[int]]:
    return [_ids(rds.iter_batches(batch_size=8, batch_format="numpy")) for _ in range(n)]


def _group_order(counts: list[int], seed: int, epoch: int) -> list[int]:
    """The ids of epoch `epoch` with the groups in the permutation of `(seed, epoch)`."""
    starts = np.cumsum([0, *counts])
    return [i for g in permute_groups(len(counts), seed, epoch) for i in range(starts[g], starts[g + 1])]


def test_each_iteration_reads_the_next_epoch_in_its_own_order(tmp_path: Path, preserve_order: None) -> None:
    counts = [7, 5, 9, 3, 6, 4]
    ds = write_dataset(tmp_path, counts)
    everything = list(range(len(ds)))
    epochs = _epochs(stoker.ray.read(ds, seed=3, records_per_task=4), 3)
    assert all(sorted(ids) == everything for ids in epochs)  # each epoch: every record once
    assert len({tuple(ids) for ids in epochs}) == 3  # ... in its own order, as a loader's passes
    assert epochs == [_group_order(counts, 3, epoch) for epoch in range(3)]
    assert _epochs(stoker.ray.read(ds, seed=3, records_per_task=4), 3) == epochs  # the same for the seed
    # A run resumed at epoch 1 starts with epoch 1's order; reshuffle_each_iteration=False replays one.
    assert _epochs(stoker.ray.read(ds, seed=3, records_per_task=4, epoch=1), 2) == epochs[1:]
    fixed = stoker.ray.read(ds, seed=3, records_per_task=4, epoch=2, reshuffle_each_iteration=False)
    assert _epochs(fixed, 2) == [epochs[2], epochs[2]]
    # Asking Ray how many rows there are plans the read without executing it: no epoch spent.
    rds = stoker.ray.read(ds, seed=3, records_per_task=4)
    assert rds.count() == len(ds)
    assert _epochs(rds, 1) == epochs[:1]


def test_streaming_split_delivers_a_new_order_each_epoch_exactly_once(tmp_path: Path, preserve_order: None) -> None:
    counts = [30, 11, 26, 5, 19]
    ds = write_dataset(tmp_path, counts)
    everything = list(range(len(ds)))
    orders = [_group_order(counts, 2, epoch) for epoch in range(3)]
    assert len({tuple(ids) for ids in orders}) == 3
    rds = stoker.ray.read(ds, records_per_task=10, seed=2)
    rds.take(1)  # an execution in the driver: the split coordinator's copy still starts at epoch 0
    splits = rds.streaming_split(2, equal=False)
    seen: list[list[list[int]]] = [[], []]

    def consume(i: int) -> None:
        for _epoch in range(3):
            seen[i].append(_ids(splits[i].iter_batches(batch_size=8, batch_format="numpy")))

    threads = [threading.Thread(target=consume, args=(i,), name=f"test-split-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    for epoch in range(3):
        assert sorted(seen[0][epoch] + seen[1][epoch]) == everything  # every record once over both workers
        assert seen[0][epoch] and seen[1][epoch]  # both workers got records
        for worker in range(2):  # each worker's blocks come in epoch `epoch`'s order
            place = {r: i for i, r in enumerate(orders[epoch])}
            got = [place[r] for r in seen[worker][epoch]]
            assert got == sorted(got), f"worker {worker}'s epoch {epoch} is not in that epoch's order"


def test_a_corrupt_file_fails_the_read_naming_it(tmp_path: Path, cluster: None) -> None:
    ds = build(tmp_path, [6, 9], {"image": IMG, "label": LAB_GZ})
    bad = ds.groups[1].paths["label"]
    data = bytearray(Path(bad).read_bytes())
    data[12] ^= 0xFF  # inside the deflate stream
    Path(bad).write_bytes(bytes(data))
    with pytest.raises(stoker.CorruptDataError, match=bad) as e:
        stoker.ray.read(ds).take_all()
    assert e.value.path == bad and e.value.field == "label"


def test_a_bfloat16_cast_is_refused_naming_the_field_rather_than_made_python_objects(tmp_path: Path) -> None:
    """Arrow has no bfloat16: Ray Data would hand the column back as an object array."""
    ds = build(tmp_path, [6, 9], {"image": IMG, "label": LAB_GZ})
    with pytest.raises(stoker.SpecError, match="ray: field 'label' cast to bfloat16: Ray Data's Arrow") as e:
        stoker.ray.read(ds, cast={"label": "bfloat16"})
    assert e.value.field == "label"
    assert "stoker.ray.iter_batches(..., cast=...)" in str(e.value)
    stored = build(tmp_path / "s", [6, 9], {"image": IMG, "emb": FieldPlan("emb", "bfloat16", (2,))})
    with pytest.raises(stoker.SpecError, match="ray: field 'emb' stored as bfloat16: Ray Data's Arrow"):
        stoker.ray.read(stored)
    # Cast to a type Arrow has, it reads (no cluster needed to build the datasource).
    assert [u.group for u in stoker.ray.StokerDatasource(stored, cast={"emb": "float32"}).units] == [0, 1]


def test_an_older_ray_is_refused_at_import_naming_the_floor() -> None:
    need = ".".join(map(str, stoker.ray.MIN_RAY))
    with pytest.raises(ImportError, match=rf"stoker.ray needs ray\[data\]>={need}, found ray 2.9.3"):
        stoker.ray.check_ray_version("2.9.3")
    stoker.ray.check_ray_version(ray.__version__)
    stoker.ray.check_ray_version(f"{need}.0rc1")
    code = "import ray; ray.__version__ = '2.40.0'; import stoker.ray"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert f"ImportError: stoker.ray needs ray[data]>={need}, found ray 2.40.0" in proc.stderr


def test_ray_workers_read_s3_urls_with_the_fields_storage_options(tmp_path: Path, cluster: None, moto_url: str) -> None:
    local = build(tmp_path, [12, 30], {"image": IMG, "label": LAB_GZ, "extra": LAB_ZZ})
    ds = remote_dataset(local, upload(moto_url, tmp_path), s3_options(moto_url))
    got = _numpy(stoker.ray.read(ds, records_per_task=10, with_index=True).iter_batches(batch_format="numpy"))
    check_batches(local, got)


# -- a two-node cluster of its own ---------------------------------------------------------

# Run as PID 1 of a new PID, mount and network namespace: loopback only (Ray would otherwise
# rewrite 127.0.0.1 to the host's address), and a /proc of its own, so the `ray stop` on
# SIGTERM sees and stops this cluster's processes alone (it stops every Ray process it sees).
_NAMESPACE_SCRIPT = """
set -e
[ "$(ls /proc | grep -c '^[0-9]')" -lt 10 ] || { echo "not in a PID namespace of our own" >&2; exit 3; }
ip link set lo up
trap '"$RAY" stop --force >/dev/null 2>&1; exit 0' TERM
common="--node-ip-address=127.0.0.1 --num-cpus=1 --object-store-memory=200000000 --disable-usage-stats"
"$RAY" start --head --port=6379 --include-dashboard=false --temp-dir="$DIR/head" $common > "$DIR/head.log" 2>&1
"$RAY" start --address=127.0.0.1:6379 --temp-dir="$DIR/worker" $common > "$DIR/worker.log" 2>&1
touch "$DIR/ready"
while true; do sleep 1 & wait $!; done
"""


class TwoNodes:
    """A head and a worker node, each ``ray start --num-cpus=1`` with its own temp dir, in a
    loopback-only network namespace; ``run`` runs a command in that network."""

    def __init__(self, directory: str, proc: subprocess.Popen[bytes], init_pid: int, env: dict[str, str]) -> None:
        self.directory, self.proc, self.init_pid, self.env = directory, proc, init_pid, env

    def run(self, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", "-t", str(self.init_pid), "-n", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip


def _namespaces_available() -> str | None:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "needs util-linux's unshare and nsenter"
    probe = subprocess.run(
        ["unshare", "--net", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30, check=False
    )
    return (
        None if probe.returncode == 0 else f"cannot make namespaces here (root needed): {probe.stderr.decode()[-200:]}"
    )


def _stop(proc: subprocess.Popen[bytes], init_pid: int) -> None:
    """SIGTERM the namespace's first process (it runs `ray stop` inside), then kill by PID
    whatever is left: unshare's --kill-child takes the namespace down with it."""
    if proc.poll() is None:
        try:
            os.kill(init_pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(30)


@pytest.fixture
def two_nodes() -> Iterator[TwoNodes]:
    reason = _namespaces_available()
    if reason is not None:
        pytest.skip(reason)
    directory = tempfile.mkdtemp(prefix="stoker-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {
        **os.environ,
        "DIR": directory,
        "RAY": str(Path(sys.executable).with_name("ray")),
        # The nodes' workers import this stoker, as the driver does.
        "PYTHONPATH": os.pathsep.join([str(Path(stoker.__file__).parents[1]), str(HELPERS)]),
        "RAY_AUTH_MODE": "disabled",  # nothing outside the namespace can reach it
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    proc = subprocess.Popen(
        ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", _NAMESPACE_SCRIPT],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    init_pid = 0
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(directory, "ready")):
            if proc.poll() is not None or time.monotonic() > deadline:
                logs = [Path(directory, n) for n in ("head.log", "worker.log")]
                tails = "\n".join(p.read_text()[-1500:] for p in logs if p.exists())
                out = proc.stdout.read().decode() if proc.poll() is not None and proc.stdout else ""
                pytest.fail(f"the two-node cluster did not start (exit {proc.poll()}): {out}\n{tails}")
            time.sleep(0.2)
        init_pid = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
        yield TwoNodes(directory, proc, init_pid, env)
    finally:
        if init_pid:
            _stop(proc, init_pid)
        else:
            proc.kill()
            proc.wait(30)
        if proc.stdout:
            proc.stdout.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_two_nodes_read_every_record_exactly_once_with_its_label(tmp_path: Path, two_nodes: TwoNodes) -> None:
    ds = build(tmp_path, [40, 0, 33, 27, 52, 8, 16], {"image": IMG, "label": LAB_GZ, "extra": LAB_ZZ})
    dataset = tmp_path / "ds.pickle"
    dataset.write_bytes(pickle.dumps(ds))
    out = tmp_path / "seen.npz"
    driver = HELPERS / "ray_two_nodes.py"
    proc = two_nodes.run([sys.executable, str(driver), str(dataset), str(out)], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    seen = dict(np.load(out))
    assert len(seen["nodes"]) == 2  # a head and a worker, both alive
    for epoch in range(2):
        rows = seen["epoch"] == epoch
        batch = {k: v[rows] for k, v in seen.items() if k in ("__group__", "__index__", *ds.fields)}
        check_batches(ds, [batch])  # every record once, image, label and extra its own
    assert set(seen["node"].tolist()) == set(seen["nodes"].tolist())  # read tasks ran on both nodes
