"""Run Keras 3 fit/evaluate/predict on stoker.keras datasets of records that carry their own id,
and write as JSON what each step consumed, next to the loader's own epochs.

Usage: KERAS_BACKEND=jax python -m tests.helpers.keras_consumed DIR OUT.json

The model's train/test/predict steps record the ids of the batch they were handed (rows whose
sample weight is 0, padding, left out), so what Keras trained on is checked, not what the
adapter was asked for. Each entry of the JSON: "keras" (per fit epoch, or per call, the ids
consumed) and "loader" (the epochs a twin loader with the same settings yields, in order).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np

import stoker
import stoker.keras
from stoker.cli.sample import expected_label
from tests.helpers.indexed import write_dataset

COUNTS = (50, 37)  # 87 records: 6 batches of 16, the last short (or padded)
BATCH = 16
events: list[tuple[str, list[int]]] = []


def consumed(data: Any) -> list[int]:
    data = data if isinstance(data, tuple | list) else (data,)
    ids = expected_label(keras.ops.convert_to_numpy(data[0])).astype(np.int64)
    if len(data) > 1 and data[1] is not None:  # the label is the id: the image met its own label
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(data[1]).reshape(-1), ids)
    if len(data) > 2 and data[2] is not None:
        ids = ids[keras.ops.convert_to_numpy(data[2]).reshape(-1) > 0]
    return ids.tolist()


class Recording(keras.Sequential):
    """Records each step's ids; `*args` is `(data,)`, or `(state, data)` on JAX."""

    def train_step(self, *args: Any) -> Any:
        events.append(("train", consumed(args[-1])))
        return super().train_step(*args)

    def test_step(self, *args: Any) -> Any:
        events.append(("test", consumed(args[-1])))
        return super().test_step(*args)

    def predict_step(self, *args: Any) -> Any:
        events.append(("predict", consumed(args[-1])))
        return super().predict_step(*args)


class EpochMarks(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        events.append(("epoch", []))


def model(built: bool) -> Recording:
    layers = [keras.layers.Flatten(), keras.layers.Dense(1)]
    m = Recording(([keras.Input((4, 4, 1))] if built else []) + layers)
    m.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    return m


def per_epoch(kind: str) -> list[list[int]]:
    """The ids of `kind` steps, one list per fit epoch (after each EpochMarks mark)."""
    out: list[list[int]] = []
    for k, ids in events:
        if k == "epoch":
            out.append([])
        elif k == kind:
            out[-1].extend(ids)
    return out


def taken(kind: str) -> list[int]:
    return [i for k, ids in events if k == kind for i in ids]


def loader_epochs(ds: stoker.Dataset, epochs: int, **settings: Any) -> list[list[int]]:
    with ds.loader(BATCH, cast={"image": "float32"}, **settings) as twin:
        out = []
        for _ in range(epochs):
            batches = list(twin)
            ids = [expected_label(b["image"]).astype(np.int64)[b.get("__valid__", slice(None))] for b in batches]
            out.append(np.concatenate(ids).tolist())
        return out


def main(directory: Path, out: Path) -> None:
    ds = write_dataset(directory, COUNTS)
    train = dict(shuffle="global", seed=5)
    padded = dict(shuffle="global", seed=9, pad_last=True)
    result: dict[str, Any] = {}

    def loader(**settings: Any) -> stoker.Loader:
        return ds.loader(BATCH, cast={"image": "float32"}, **settings)

    # An unbuilt model (Keras reads batch 0 to build it), with validation from a second adapter.
    keras.utils.set_random_seed(0)
    m = model(built=False)
    with loader(**train) as t, loader(**padded) as v:
        val = stoker.keras.to_keras(v, "image", "label", sample_weight="__valid__")
        m.fit(stoker.keras.to_keras(t, "image", "label"), epochs=3, shuffle=False, verbose=0,
              validation_data=val, callbacks=[EpochMarks()])  # fmt: skip
    result["fit_unbuilt"] = {"keras": per_epoch("train"), "loader": loader_epochs(ds, 3, **train)}
    result["fit_validation"] = {"keras": per_epoch("test"), "loader": loader_epochs(ds, 3, **padded)}

    # A built model, steps_per_epoch under an epoch's batches; then fit cut short and fit again.
    events.clear()
    m = model(built=True)
    calls = []
    with loader(**train) as t:
        data = stoker.keras.to_keras(t, "image", "label")
        m.fit(data, epochs=3, steps_per_epoch=4, shuffle=False, verbose=0, callbacks=[EpochMarks()])
        calls.append(taken("train"))
        for steps in (3, None, None):
            events.clear()
            m.fit(data, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
            calls.append(taken("train"))
    result["fit_steps"] = {"keras": calls, "loader": loader_epochs(ds, 4, **train)}

    # evaluate on a fresh (unbuilt) model over a padded loader, twice; predict twice.
    events.clear()
    m = model(built=False)
    evaluated, predicted, outputs = [], [], []
    with loader(**padded) as p, loader(**train) as q:
        data = stoker.keras.to_keras(p, "image", "label", sample_weight="__valid__")
        for _ in range(2):
            events.clear()
            m.evaluate(data, verbose=0)
            evaluated.append(taken("test"))
        data = stoker.keras.to_keras(q, "image")
        for _ in range(2):
            events.clear()
            outputs.append(len(m.predict(data, verbose=0)))
            predicted.append(taken("predict"))
    result["evaluate_padded"] = {"keras": evaluated, "loader": loader_epochs(ds, 2, **padded)}
    result["predict"] = {"keras": predicted, "loader": loader_epochs(ds, 2, **train), "rows": outputs}

    # Indexed by hand: a repeated index is the same batch, and a pass started over the same epoch.
    with loader(**train) as t:
        data = stoker.keras.to_keras(t, "image", "label")
        try:
            result["by_hand"] = {"keras": [consumed(data[i]) for i in (0, 0, 1, 1, 0, 1, 2, 2, 3)]}
        except stoker.SpecError as e:
            result["by_hand"] = {"keras": str(e)}
    result["by_hand"]["loader"] = loader_epochs(ds, 1, **train)

    # Keras' own shuffle of the batch order: refused at the first batch out of order.
    with loader(**train) as t:
        try:
            model(built=True).fit(stoker.keras.to_keras(t, "image", "label"), epochs=2, verbose=0)
            result["refused"] = None
        except Exception as e:  # TensorFlow wraps it in an InvalidArgumentError carrying its message
            result["refused"] = str(e)
    result["backend"] = keras.backend.backend()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
