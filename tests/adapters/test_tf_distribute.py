"""stoker.tf under tf.distribute: exactly once per epoch on every path a multi-worker job takes.

The multi-worker tests run a MultiWorkerMirroredStrategy cluster of 2 worker processes on
127.0.0.1 (tests/helpers/tf_multiworker.py) once for the module and check what each worker saw.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf  # make test installs TF; a missing TF fails loudly, never skips

import stoker
import stoker.tf as stf
from tests.helpers import HELPERS, REPO
from tests.helpers.data import small_sample
from tests.helpers.netns import run_loopback_only

pytestmark = pytest.mark.tf

RECORDS = 200  # 4 groups of 50
WORKER_TIMEOUT = 240  # seconds: both workers start TensorFlow on a shared 2-core machine


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> stoker.Dataset:
    return small_sample(tmp_path_factory.mktemp("sample"), pairs=4, records=50, inrez=8)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def cluster(sample: stoker.Dataset, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of 2 MultiWorkerMirroredStrategy workers saw (tf_multiworker.py "all"), run in a
    loopback-only network namespace: their gRPC servers bind every interface."""
    out = tmp_path_factory.mktemp("cluster")
    data = Path(sample.files[0]["image"].path).parent
    ports = ",".join(map(str, _free_ports(2)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TF_CONFIG", None)
    commands, logs = [], []
    for task in range(2):
        commands.append([sys.executable, str(HELPERS / "tf_multiworker.py"), "all", str(task), ports, str(data)])
        commands[-1].append(str(out / f"w{task}.json"))
        logs.append(out / f"log{task}.txt")
    rcs = run_loopback_only(commands, logs, timeout=WORKER_TIMEOUT, env=env)
    results = []
    for task, rc in enumerate(rcs):
        assert rc == 0, f"worker {task} exited {rc}:\n{logs[task].read_text()[-3000:]}"
        results.append(json.loads((out / f"w{task}.json").read_text()))
    return results


def _epochs(labels: list[int], epochs: int) -> list[list[int]]:
    """The gathered labels cut into epochs, each checked to hold every record once."""
    assert len(labels) == epochs * RECORDS
    cut = [labels[e * RECORDS : (e + 1) * RECORDS] for e in range(epochs)]
    for e, part in enumerate(cut):
        assert sorted(part) == list(range(RECORDS)), f"epoch {e} is not every record once"
    return cut


# -- a MultiWorkerMirroredStrategy of 2 worker processes -------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", ["experimental_distribute_dataset", "keras_path", "distributed_dataset"])
def test_every_record_once_per_epoch_across_two_workers_and_a_new_order_in_the_second(
    cluster: list[dict[str, Any]], path: str
) -> None:
    """A sharded loader's to_tf() (as is, and mapped to (x, y) as Keras' fit distributes it) and
    distributed_dataset, 2 epochs in one pass: every step's labels of both replicas, gathered."""
    assert cluster[0][path] == cluster[1][path]  # both workers took part in the same steps
    first, second = _epochs(cluster[0][path], 2)
    assert first != second


@pytest.mark.slow
def test_distributed_dataset_iterated_again_is_the_next_epoch_with_every_record_once_in_a_new_order(
    cluster: list[dict[str, Any]],
) -> None:
    passes = cluster[0]["passes"]
    assert passes == cluster[1]["passes"]
    for labels in passes:
        _epochs(labels, 1)
    assert passes[0] != passes[1]  # the second pass is the next epoch, in its own order


@pytest.mark.slow
def test_an_unsharded_loader_in_one_order_on_every_worker_is_still_once_per_epoch(
    cluster: list[dict[str, Any]],
) -> None:
    """tf.distribute's DATA auto-shard keeps each worker's part of each batch: exactly once where
    every worker's loader gives the same batches (no shuffle), at the cost of every worker reading all."""
    assert cluster[0]["unsharded"] == cluster[1]["unsharded"]
    _epochs(cluster[0]["unsharded"], 2)


@pytest.mark.slow
def test_what_would_lose_records_across_workers_is_a_spec_error_on_every_worker(
    cluster: list[dict[str, Any]],
) -> None:
    for task, worker in enumerate(cluster):
        seeds, shards, differ, batch, scoped = worker["errors"]
        assert seeds.startswith("SpecError: to_tf: an unsharded loader with shuffle='global'")
        assert f"(seed={task})" in seeds and "TF_CONFIG: 2 workers" in seeds and "shard=(task_index" in seeds
        assert shards.startswith("SpecError: to_tf: the loader is shard 0 of 4, but this process is one of 2 workers")
        assert differ.startswith("SpecError: distributed_dataset: the workers' loaders differ in seed")
        assert f"seed={task}" in differ
        assert "global_batch_size=21 must be a positive multiple of the strategy's 2 replicas" in batch
        assert "unsharded loader" in scoped and "(the MultiWorkerMirroredStrategy in scope)" in scoped


# -- in this process -------------------------------------------------------------------


def _policy(dataset: tf.data.Dataset) -> tf.data.experimental.AutoShardPolicy:
    return dataset.options().experimental_distribute.auto_shard_policy


def test_a_sharded_loaders_dataset_turns_auto_shard_off_and_an_unsharded_ones_shards_by_data(
    sample: stoker.Dataset,
) -> None:
    policy = tf.data.experimental.AutoShardPolicy
    sharded = sample.loader(10, shard=(1, 2)).to_tf()
    assert _policy(sharded) == policy.OFF
    assert _policy(sharded.map(lambda b: (b["image"], b["label"])).prefetch(1)) == policy.OFF  # kept downstream
    assert _policy(sample.loader(10).to_tf()) == policy.DATA


def _tf_config(monkeypatch: pytest.MonkeyPatch, cluster: dict[str, list[str]], task: str = "worker") -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": task, "index": 0}}))


WORKERS = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}


def test_a_multi_worker_tf_config_refuses_an_unsharded_shuffle_and_shards_that_are_not_the_workers(
    sample: stoker.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tf_config(monkeypatch, {"chief": ["127.0.0.1:3"], **WORKERS})  # a chief counts as a worker
    with pytest.raises(stoker.SpecError, match=r"unsharded loader with shuffle='files' \(seed=4\).*3 workers"):
        sample.loader(10, shuffle="files", seed=4).to_tf()
    with pytest.raises(stoker.SpecError, match="shard 1 of 2, but this process is one of 3 workers"):
        sample.loader(10, shard=(1, 2)).to_tf()
    assert _policy(sample.loader(10, shard=(2, 3), shuffle="global", seed=1).to_tf()).name == "OFF"
    assert _policy(sample.loader(10).to_tf()).name == "DATA"  # one order on every worker: exactly once


@pytest.mark.parametrize(
    ("cluster", "task"),
    [
        ({"worker": ["127.0.0.1:1"]}, "worker"),  # one worker
        ({**WORKERS, "ps": ["127.0.0.1:4"]}, "worker"),  # parameter servers: datasets go through the coordinator
        (WORKERS, "evaluator"),  # a side task reads on its own
    ],
)
def test_a_tf_config_without_several_mirrored_workers_leaves_to_tf_alone(
    sample: stoker.Dataset, monkeypatch: pytest.MonkeyPatch, cluster: dict[str, list[str]], task: str
) -> None:
    _tf_config(monkeypatch, cluster, task)
    tfds = sample.loader(10, shuffle="global", seed=1).to_tf()
    assert sum(int(b["label"].shape[0]) for b in tfds) == 200


def test_distributed_dataset_on_one_worker_delivers_every_record_once_per_pass_in_the_loaders_order(
    sample: stoker.Dataset,
) -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    dist = stf.distributed_dataset(
        strategy, sample, 16, shuffle="global", seed=2, cast={"image": "float32"}, map_func=lambda b: b["label"]
    )

    @tf.function
    def step(labels: Any) -> tf.Tensor:
        return strategy.gather(strategy.run(tf.identity, args=(labels,)), axis=0)

    passes = []
    for _ in range(2):
        labels = np.concatenate([step(b).numpy() for b in dist]).astype(int)
        assert sorted(labels.tolist()) == list(range(200))
        passes.append(labels)
    loader = sample.loader(16, shuffle="global", seed=2)
    for labels in passes:  # the loader's order, pass by pass: one worker, one shard
        np.testing.assert_array_equal(labels, np.concatenate([b["label"] for b in loader]))
    assert (passes[0] != passes[1]).any()


@pytest.mark.parametrize(
    ("batch", "kwargs", "message"),
    [
        (0, {}, "global_batch_size=0 must be a positive multiple of the strategy's 1 replicas"),
        (True, {}, "global_batch_size=True must be a positive integer"),
        (16, {"shard": (0, 2)}, r"shards by input pipeline itself; drop shard=\(0, 2\)"),
        (16, {"shuffle": "global"}, "needs seed="),
    ],
)
def test_distributed_dataset_refuses_what_it_cannot_spread_evenly(
    sample: stoker.Dataset, batch: object, kwargs: dict[str, Any], message: str
) -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with pytest.raises(stoker.SpecError, match=message):
        stf.distributed_dataset(strategy, sample, batch, **kwargs)  # type: ignore[arg-type]


def test_keras_fit_over_distributed_dataset_trains_on_every_record_once_per_epoch(sample: stoker.Dataset) -> None:
    """Keras' fit on one worker: map_func gives it (x, y); each fit epoch is a pass of the loader,
    which goes on with the next epoch's order."""
    import keras

    seen: list[list[int]] = []

    def record(labels: tf.Tensor) -> tf.Tensor:
        seen[-1].extend(int(x) for x in labels.numpy())
        return labels

    class Recording(keras.Model):  # type: ignore[misc]
        def train_step(self, data: Any) -> Any:
            tf.py_function(record, [data[1]], tf.float32)
            return super().train_step(data)

    class Epochs(keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            seen.append([])

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        inputs = keras.Input((8, 8, 1))
        model = Recording(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(inputs)))
        model.compile(optimizer="sgd", loss="mse")
    data = stf.distributed_dataset(
        strategy, sample, 20, shuffle="global", seed=7, map_func=lambda b: (tf.cast(b["image"], tf.float32), b["label"])
    )
    model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=[Epochs()])
    assert len(seen) == 2
    for labels in seen:
        assert sorted(labels) == list(range(RECORDS))
    assert seen[0] != seen[1]  # each fit epoch a pass of the loader, the next epoch's order
