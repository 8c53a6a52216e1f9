"""A tf.data service (a dispatcher and 2 workers on 127.0.0.1) reading stoker.tf.native_dataset.

Run by tests/adapters/test_tf.py inside a loopback-only network namespace (its gRPC servers bind every
interface): ``python tf_service.py SAMPLE_DIR OUT.json``. For each case it writes the labels the
service delivered and the labels their images stand for, for the test to compare.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

import stoker
from stoker.cli.sample import expected_label
from stoker.tf import native_dataset

# (case name, processing mode, epochs, native_dataset keywords)
CASES = [
    (f"{mode}-{name}", mode, epochs, kwargs)
    for mode in ("distributed_epoch", "FILE_OR_DATA")
    for name, epochs, kwargs in [
        ("plain", 1, {}),
        ("files", 1, {"shuffle": "files", "seed": 4}),
        ("files-2-epochs", 2, {"shuffle": "files", "seed": 4, "block_length": 8}),
    ]
]


def _ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def main() -> None:
    directory, out = Path(sys.argv[1]), Path(sys.argv[2])
    inrez = int(sys.argv[3])
    ds = stoker.Dataset(
        image=stoker.Field(str(directory / "img_*.bin"), "int8", (inrez, inrez, 1)),
        label=stoker.Field(str(directory / "out_*.bin.gz"), "float32"),
    )
    data = tf.data.experimental.service
    addresses = [f"127.0.0.1:{p}" for p in _ports(2)]  # static sharding needs the workers' list
    dispatcher = data.DispatchServer(data.DispatcherConfig(port=0, worker_addresses=addresses))
    target = dispatcher.target.split("://")[1]
    workers = [
        data.WorkerServer(data.WorkerConfig(dispatcher_address=target, port=int(a.split(":")[1]), worker_address=a))
        for a in addresses
    ]
    results = {}
    try:
        for name, mode, epochs, kwargs in CASES:
            processing = mode if mode == "distributed_epoch" else getattr(data.ShardingPolicy, mode)
            native = native_dataset(ds, 16, epochs=epochs, **kwargs)
            distributed = native.apply(data.distribute(processing_mode=processing, service=dispatcher.target))
            batches = list(distributed.as_numpy_iterator())
            labels = np.concatenate([b["label"] for b in batches])
            images = np.concatenate([b["image"] for b in batches])
            results[name] = {
                "epochs": epochs,
                "labels": labels.astype(int).tolist(),
                "expected": expected_label(images).astype(int).tolist(),
            }
    finally:
        for w in workers:
            w.stop()
        dispatcher.stop()
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
