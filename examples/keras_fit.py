"""Train a small Keras model on stoker's sample dataset through ``loader.to_tf()``.

    python examples/keras_fit.py [DIRECTORY] [--steps 4] [--epochs 2]

Writes the sample dataset into DIRECTORY (default: a temporary directory) unless it is
already there, then fits a tiny conv net that learns the label from the image. Each Keras
epoch iterates the tf.data dataset again, which starts a fresh pass of the loader. Run as a
script, it gives TensorFlow one inter-op thread first, as the README recommends for a
``tf.function`` consumer on a host with few cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import stoker


def _dataset(directory: Path, inrez: int) -> stoker.Dataset:
    if not any(directory.glob("img_*.bin")):
        stoker.write_sample(directory, pairs=2, records=64, inrez=inrez)
    return stoker.Dataset(
        image=stoker.Field(str(directory / "img_*.bin"), "int8", (inrez, inrez, 1)),
        label=stoker.Field(str(directory / "out_*.bin.gz"), "float32", compression="gzip"),
    )


def train(directory: Path, *, steps: int, epochs: int, batch_size: int = 16, inrez: int = 16) -> list[float]:
    """Fit for ``epochs`` x ``steps`` batches; returns the loss of each epoch."""
    import keras
    import tensorflow as tf

    import stoker.tf  # noqa: F401  (the adapter; loader.to_tf() imports it too)

    ds = _dataset(directory, inrez)
    with ds.loader(batch_size, cast={"image": "float32"}, drop_remainder=True) as loader:
        batches = loader.to_tf().map(lambda b: (b["image"] / 128.0, b["label"] / 128.0))
        keras.utils.set_random_seed(0)  # explicit: the same weights on every run
        model = keras.Sequential(
            [
                keras.Input((inrez, inrez, 1)),
                keras.layers.Conv2D(4, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer="adam", loss="mse")
        history = model.fit(
            batches.prefetch(tf.data.AUTOTUNE), epochs=epochs, steps_per_epoch=steps, shuffle=False, verbose=0
        )
    return [float(x) for x in history.history["loss"]]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", nargs="?", help="sample dataset directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=4, help="batches per epoch")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args(argv)
    if args.directory:
        losses = train(Path(args.directory), steps=args.steps, epochs=args.epochs)
    else:
        with tempfile.TemporaryDirectory(prefix="stoker-keras-") as tmp:
            losses = train(Path(tmp), steps=args.steps, epochs=args.epochs)
    for epoch, loss in enumerate(losses, 1):
        print(f"epoch {epoch}: loss {loss:.4f}")
    return 0


if __name__ == "__main__":
    import tensorflow as tf

    # Before TensorFlow's first op: one inter-op thread keeps the graph's ops (next() included)
    # on one thread instead of hopping between spinning pool threads, which on a host with few
    # cores take CPU from the loader's workers (README, "From tf.data").
    tf.config.threading.set_inter_op_parallelism_threads(1)
    sys.exit(main())
