"""One worker of a MultiWorkerMirroredStrategy cluster on 127.0.0.1, run by tests/adapters/test_tf_distribute.py.

Usage: python tf_multiworker.py SCENARIO TASK PORTS DATA OUT

Each worker writes to OUT (JSON) what its replica saw, in the order it saw it; the test
merges the workers' records and checks every label once per epoch. Labels of
``stoker.write_sample`` are the records' global indexes.

Keras' ``fit`` itself does not run under MultiWorkerMirroredStrategy with Keras 3 at
TensorFlow 2.21, with any dataset: its symbolic build reduces a tuple of PerReplica values
and fails ("Attempt to convert a value (PerReplica...)"; keras-team/keras#20585). The
"keras_path" records what fit does with its dataset instead.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main() -> None:
    scenario, task, ports, data, out = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4], sys.argv[5]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": task}}
    )
    import tensorflow as tf

    import stoker

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ds = stoker.Dataset(
        image=stoker.Field(f"{data}/img_*.bin", "int8", (8, 8, 1)),
        label=stoker.Field(f"{data}/out_*.bin.gz", "float32"),
    )
    result: dict[str, Any] = {}
    try:
        SCENARIOS[scenario](tf, stoker, strategy, ds, task, result)
    except stoker.StokerError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        json.dump(result, f)


def loops(tf: Any, stoker: Any, strategy: Any, ds: Any, task: int, result: dict[str, Any]) -> None:
    """Custom training loops: every step's labels of every replica, as each worker gathers them."""

    @tf.function
    def step(batch: Any) -> Any:
        labels = strategy.run(lambda b: b["label"] if isinstance(b, dict) else b[1], args=(batch,))
        return strategy.gather(labels, axis=0)

    def run(dist: Any) -> list[int]:
        return [int(x) for batch in dist for x in step(batch).numpy()]

    def xy(batch: dict[str, Any]) -> tuple[Any, Any]:
        return tf.cast(batch["image"], tf.float32), batch["label"]

    # The path: each worker's own shard through experimental_distribute_dataset.
    sharded = ds.loader(20, shard=(task, 2), shuffle="global", seed=7, epochs=2)
    result["experimental_distribute_dataset"] = run(strategy.experimental_distribute_dataset(sharded.to_tf()))
    # What Keras' fit does with the dataset it is given (its TFEpochIterator), after a map to (x, y).
    result["keras_path"] = run(strategy.experimental_distribute_dataset(sharded.to_tf().map(xy)))
    dist = stoker.tf.distributed_dataset(strategy, ds, 20, shuffle="global", seed=7, epochs=2)
    result["distributed_dataset"] = run(dist)
    # Iterated again: a pass per iteration, the next epoch, each record once in each.
    once = stoker.tf.distributed_dataset(strategy, ds, 20, shuffle="files", seed=3, window=4, map_func=xy)
    result["passes"] = [run(once), run(once)]


def refused(tf: Any, stoker: Any, strategy: Any, ds: Any, task: int, result: dict[str, Any]) -> None:
    """What must not run silently: an unsharded loader shuffled with a seed per worker, shards that
    are not the workers, distributed_dataset with a seed per worker or a batch the replicas
    cannot share; and what still runs: an unsharded loader in one order on every worker."""
    errors = []
    for make in (
        lambda: ds.loader(20, shuffle="global", seed=task).to_tf(),
        lambda: ds.loader(20, shard=(0, 4)).to_tf(),
        lambda: stoker.tf.distributed_dataset(strategy, ds, 20, shuffle="global", seed=task),
        lambda: stoker.tf.distributed_dataset(strategy, ds, 21),
    ):
        try:
            make()
            errors.append("")
        except stoker.StokerError as e:
            errors.append(f"{type(e).__name__}: {e}")
    # The strategy in scope tells as TF_CONFIG does (a cluster resolver of another kind, say).
    config = os.environ.pop("TF_CONFIG")
    try:
        with strategy.scope():
            ds.loader(20, shuffle="global", seed=task).to_tf()
        errors.append("")
    except stoker.StokerError as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        os.environ["TF_CONFIG"] = config
    result["errors"] = errors
    # An unsharded loader in one order on every worker: each keeps its part of each batch.
    unsharded = ds.loader(20, epochs=2)

    @tf.function
    def step(batch: dict[str, Any]) -> Any:
        return strategy.gather(strategy.run(lambda b: b["label"], args=(batch,)), axis=0)

    dist = strategy.experimental_distribute_dataset(unsharded.to_tf())
    result["unsharded"] = [int(x) for batch in dist for x in step(batch).numpy()]


def both(tf: Any, stoker: Any, strategy: Any, ds: Any, task: int, result: dict[str, Any]) -> None:
    """All of the above in one cluster: TensorFlow and the cluster take most of a run to start."""
    loops(tf, stoker, strategy, ds, task, result)
    refused(tf, stoker, strategy, ds, task, result)


SCENARIOS = {"loops": loops, "refused": refused, "all": both}

if __name__ == "__main__":
    main()
