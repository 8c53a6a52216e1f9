"""stoker.keras: what Keras 3 trains, evaluates and predicts on is each loader epoch exactly once,
on the TensorFlow, JAX and PyTorch backends (each in its own process: the backend is fixed when
Keras is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stoker
import stoker.keras
from stoker.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
BATCH = 16  # tests/helpers/keras_consumed.py's batch size
RECORDS = 87  # and its records: 6 batches an epoch, the last short (or padded)


def _batches(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + BATCH] for i in range(0, len(ids), BATCH)]


@pytest.mark.slow
@pytest.mark.keras
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("tensorflow", marks=pytest.mark.tf),
        pytest.param("jax", marks=pytest.mark.jax),
        pytest.param("torch", marks=pytest.mark.torch),
    ],
)
def test_keras_consumes_each_loader_epoch_exactly_once(tmp_path: Path, backend: str) -> None:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}  # fmt: skip
    out = tmp_path / "consumed.json"
    run = subprocess.run([sys.executable, "-m", "tests.helpers.keras_consumed", str(tmp_path / "d"), str(out)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["backend"] == backend
    everything = list(range(RECORDS))

    # Every epoch of every case holds each record once (padding left out by its sample weight).
    for case in ("fit_unbuilt", "fit_validation", "evaluate_padded", "predict"):
        for epoch, ids in enumerate(got[case]["keras"]):
            assert sorted(ids) == everything, f"{case}: Keras epoch {epoch} consumed {len(ids)} ids, not each once"
    # ... and is the loader's epoch of the same number: Keras' shape reads (batch 0 to build the
    # model on JAX and PyTorch, batches 0 and 1 for TensorFlow's signature) take nothing from it.
    for case in ("fit_unbuilt", "fit_validation", "evaluate_padded", "predict"):
        assert got[case]["keras"] == got[case]["loader"], case
    assert got["predict"]["rows"] == [RECORDS, RECORDS]
    # The loader's epochs differ (a new order each), so the equality above pins each one.
    assert got["fit_unbuilt"]["loader"][0] != got["fit_unbuilt"]["loader"][1]

    # steps_per_epoch=4 of 6 batches, 3 epochs: Keras goes on where its last epoch stopped, so its
    # 10 batches are epoch 0 whole and epoch 1's first 4. A fit called again starts that epoch
    # over, as with any PyDataset: 3 steps, then all of it (past the two batches the adapter
    # keeps, the loader restarts the epoch from its state), and then the next epoch.
    loader = got["fit_steps"]["loader"]
    assert got["fit_steps"]["keras"] == [loader[0] + loader[1][: 4 * BATCH], loader[1][: 3 * BATCH], loader[1],
                                         loader[2]]  # fmt: skip

    # By hand: a repeated index gives the same batch, index 0 the same epoch again.
    epoch = _batches(got["by_hand"]["loader"][0])
    assert got["by_hand"]["keras"] == [epoch[i] for i in (0, 0, 1, 1, 0, 1, 2, 2, 3)]

    # Keras' shuffle of the batch order is refused at its first batch out of order, never served.
    refused = got["refused"]
    assert refused is not None and "stoker.keras serves the loader's batches in order" in refused, refused
    assert "pass fit(..., shuffle=False)" in refused


def test_to_keras_refuses_fields_the_batches_do_not_hold(tmp_path: Path) -> None:
    np.arange(8, dtype="<f4").tofile(tmp_path / "x.bin")
    ds = stoker.Dataset(x=stoker.Field(str(tmp_path / "x.bin"), "float32"))
    with ds.loader(4) as loader:
        with pytest.raises(
            SpecError, match=r"to_keras y='label' is not a field of the loader's batches; they hold \['x'\]"
        ):
            stoker.keras.to_keras(loader, "x", "label")
        with pytest.raises(SpecError, match=r"sample_weight= needs y="):
            stoker.keras.to_keras(loader, "x", sample_weight="x")
