"""Driver of test_ray's two-node test, run inside the cluster's network namespace.

    python ray_two_nodes.py DATASET.pickle OUT.npz

Reads the pickled stoker Dataset through ``stoker.ray.read`` on the cluster at
127.0.0.1:6379, two passes, and saves every batch's arrays, the pass and the node whose
read task made the rows (a map fused into the read task tags them), plus the cluster's live
nodes, for the test to check.
"""

from __future__ import annotations

import pickle
import sys

import numpy as np
import ray

import stoker.ray


def _tag_node(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    node = ray.get_runtime_context().get_node_id()
    return {**batch, "node": np.full(len(batch["__group__"]), node)}


def main(dataset_path: str, out_path: str) -> int:
    ray.init(address="127.0.0.1:6379", log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    with open(dataset_path, "rb") as f:
        ds = pickle.load(f)
    rds = stoker.ray.read(ds, batch_size=4, with_index=True, override_num_blocks=8)
    tagged = rds.map_batches(_tag_node, batch_format="numpy", batch_size=None)
    out: dict[str, list[np.ndarray]] = {}
    for epoch in range(2):
        for batch in tagged.iter_batches(batch_size=4, batch_format="numpy"):
            for key, value in {**batch, "epoch": np.full(len(batch["node"]), epoch)}.items():
                arr = np.asarray(value)
                out.setdefault(key, []).append(arr.astype(str) if arr.dtype == object else arr)  # node ids
    nodes = np.array([n["NodeID"] for n in ray.nodes() if n["Alive"]])
    np.savez(out_path, nodes=nodes, **{k: np.concatenate(v) for k, v in out.items()})
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
