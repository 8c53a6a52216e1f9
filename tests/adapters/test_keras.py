"""stoker.keras: Keras 3 fits from a loader on the JAX and PyTorch backends (each in its own process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stoker
import stoker.keras
from stoker.errors import SpecError

_FIT = """
import sys
import numpy as np
import keras
import stoker, stoker.keras
from stoker.cli.sample import expected_label

d = stoker.write_sample(sys.argv[1], pairs=2, records=24, inrez=8)
ds = stoker.Dataset(image=stoker.Field(str(d / "img_*.bin"), "int8", (8, 8, 1)),
                    label=stoker.Field(str(d / "out_*.bin.gz"), "float32", compression="gzip"))
settings = dict(epochs=None, cast={"image": "float32"}, shuffle="global", seed=3)
with ds.loader(16, **settings) as loader, ds.loader(16, **settings) as same:
    data = stoker.keras.to_keras(loader, "image", "label")
    assert isinstance(data, keras.utils.PyDataset) and len(data) == data.num_batches == len(loader) == 3
    # Keras' order of calls: each epoch asks 0, 1, 2; it gets the loader's epochs one after the other.
    expected = iter(same)
    for epoch in range(2):
        for i in range(len(data)):
            x, y = data[i]
            want = next(expected)
            assert np.array_equal(x, want["image"]) and np.array_equal(y, want["label"])
            assert np.array_equal(y, expected_label(x))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Rescaling(1 / 128), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(stoker.keras.to_keras(loader, "image", "label"), epochs=3, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    mse = model.evaluate(stoker.keras.to_keras(same, "image", "label"), verbose=0)
    assert np.isfinite(mse)
    try:  # Keras shuffles a PyDataset's batches unless told not to: refused, never served out of order
        model.fit(stoker.keras.to_keras(loader, "image", "label"), epochs=4, verbose=0)
        print("not refused")
    except stoker.SpecError as e:
        print("refused:", e)
print("backend", keras.backend.backend(), "losses", len(losses))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", [pytest.param("jax", marks=pytest.mark.jax), pytest.param("torch", marks=pytest.mark.torch)]
)
def test_keras_fits_from_a_loader_on_the_backend(tmp_path: Path, backend: str) -> None:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    run = subprocess.run([sys.executable, "-c", _FIT, str(tmp_path / "d")], capture_output=True, text=True,
                         timeout=300, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert lines[-1] == f"backend {backend} losses 3", run.stdout
    # With 3 batches an epoch, a shuffled order is refused at its first step out of order.
    assert any(line.startswith("refused: stoker.keras serves the loader's batches in order") for line in lines), (
        run.stdout
    )
    assert any("pass fit(..., shuffle=False)" in line for line in lines)


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
