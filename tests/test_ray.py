"""stoker.ray.read: a Ray Data Dataset over stoker's reader, on a local 2-CPU Ray cluster."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray

import stoker
import stoker.ray
import test_remote as s3_helpers
from conftest import IMG, LAB_GZ, FieldPlan, build, check_batches

pytestmark = pytest.mark.ray

LAB_ZZ = FieldPlan("lab", "int16", (2,), kind="zlib", header=3)


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


def test_read_tasks_are_groups_or_ranges_of_one_group(tmp_path: Path) -> None:
    ds = build(tmp_path, [10, 0, 7, 25], {"image": IMG, "label": LAB_GZ})
    source = stoker.ray.StokerDatasource(ds, records_per_task=8)
    assert source.ranges == [(0, 0, 8), (0, 8, 10), (2, 0, 7), (3, 0, 8), (3, 8, 16), (3, 16, 24), (3, 24, 25)]
    tasks = source.get_read_tasks(parallelism=2)
    assert [t.metadata.num_rows for t in tasks] == [8, 2, 7, 8, 8, 8, 1]
    assert tasks[2].metadata.input_files == (ds.groups[2].paths["image"], ds.groups[2].paths["label"])
    whole = stoker.ray.StokerDatasource(ds).ranges
    assert whole == [(0, 0, 10), (2, 0, 7), (3, 0, 25)]
    shuffled = stoker.ray.StokerDatasource(ds, records_per_task=8, seed=4).ranges
    assert sorted(shuffled) == sorted(source.ranges) and shuffled != source.ranges
    assert shuffled == stoker.ray.StokerDatasource(ds, records_per_task=8, seed=4).ranges
    with pytest.raises(stoker.SpecError, match="records_per_task=0"):
        stoker.ray.StokerDatasource(ds, records_per_task=0)


def test_every_record_once_with_all_its_fields(tmp_path: Path, cluster: None) -> None:
    ds = build(tmp_path, [10, 0, 37, 25], {"image": IMG, "label": LAB_GZ, "extra": LAB_ZZ})
    rds = stoker.ray.read(ds, records_per_task=16, records_per_block=5, with_index=True, cast={"image": "float32"})
    assert rds.count() == 72
    got = _numpy(rds.iter_batches(batch_size=7, batch_format="numpy"))
    check_batches(ds, got, cast={"image": "float32"})


def test_streaming_split_delivers_every_record_exactly_once_per_epoch(tmp_path: Path, cluster: None) -> None:
    ds = build(tmp_path, [30, 11, 26, 5, 19], {"image": IMG, "label": LAB_GZ})
    splits = stoker.ray.read(ds, records_per_task=10, with_index=True, seed=1).streaming_split(2, equal=False)
    seen: list[list[list[dict[str, np.ndarray]]]] = [[], []]

    def consume(i: int) -> None:
        for _epoch in range(2):
            seen[i].append(_numpy(splits[i].iter_batches(batch_size=8, batch_format="numpy")))

    threads = [threading.Thread(target=consume, args=(i,), name=f"test-split-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    for epoch in range(2):
        both = seen[0][epoch] + seen[1][epoch]
        check_batches(ds, both)  # every (group, index) exactly once, every field right
        assert seen[0][epoch] and seen[1][epoch]  # both workers got records


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
    stored = build(tmp_path / "s", [6, 9], {"image": IMG, "emb": FieldPlan("emb", "bfloat16", (2,))})
    with pytest.raises(stoker.SpecError, match="ray: field 'emb' stored as bfloat16: Ray Data's Arrow"):
        stoker.ray.read(stored)
    # Cast to a type Arrow has, it reads (no cluster needed to build the datasource).
    assert stoker.ray.StokerDatasource(stored, cast={"emb": "float32"}).ranges == [(0, 0, 6), (1, 0, 9)]


def test_ray_workers_read_s3_urls_with_the_fields_storage_options(tmp_path: Path, cluster: None) -> None:
    server = s3_helpers.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        local = s3_helpers._local(tmp_path, [12, 30], {"image": IMG, "label": LAB_GZ, "extra": LAB_ZZ})
        ds = s3_helpers._remote_ds(
            local, tmp_path, s3_helpers._upload(endpoint, tmp_path), s3_helpers._s3_options(endpoint)
        )
        got = _numpy(stoker.ray.read(ds, records_per_task=10, with_index=True).iter_batches(batch_format="numpy"))
        check_batches(local, got)
    finally:
        server.stop()
