"""Train a tiny JAX model on stoker batches placed on the device ahead of each step.

A linear model over the flattened 16x16 images of ``stoker.write_sample`` learns to
predict each image's label with ``jax.grad`` and plain SGD. ``to_jax`` keeps two batches
in flight on the device while a step runs; its ``state_dict`` counts only the batches
the loop has taken, so a checkpoint resumes exactly.

    python examples/jax_train.py [--data DIR] [--steps 50]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

import stoker

RES = 16


def sample_dataset(directory: Path) -> stoker.Dataset:
    if not (directory / ".complete").exists():
        stoker.write_sample(directory, pairs=2, records=64, inrez=RES)
        (directory / ".complete").write_text("ok\n")
    return stoker.Dataset(
        image=stoker.Field(str(directory / "img_*.bin"), "int8", (RES, RES, 1)),
        label=stoker.Field(str(directory / "out_*.bin.gz"), "float32"),
    )


def loss_fn(params: dict[str, jax.Array], image: jax.Array, target: jax.Array) -> jax.Array:
    x = image.reshape(image.shape[0], -1).astype(jnp.float32) / 128.0
    return jnp.mean((x @ params["w"] + params["b"] - target) ** 2)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="sample directory (written if missing); default: a temporary one")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args(argv)

    @jax.jit
    def step(
        params: dict[str, jax.Array], image: jax.Array, label: jax.Array
    ) -> tuple[dict[str, jax.Array], jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, image, label / scale)
        return jax.tree.map(lambda p, g: p - args.lr * g, params, grads), loss

    with tempfile.TemporaryDirectory() as tmp:
        ds = sample_dataset(Path(args.data) if args.data else Path(tmp))
        scale = float(len(ds))  # labels are record indices: predict them in [0, 1)
        params = {"w": jnp.zeros(RES * RES), "b": jnp.zeros(())}
        losses: list[float] = []
        loader = ds.loader(args.batch_size, epochs=None, shuffle="global", seed=0, drop_remainder=True)
        with loader.to_jax(prefetch_to_device=2) as batches:
            # zip asks range first: no batch is taken (and counted in the state) past the last step.
            for n, batch in zip(range(args.steps), batches, strict=False):
                params, loss = step(params, batch["image"], batch["label"])
                losses.append(float(loss))
                if n % 10 == 0:
                    print(f"step {n:4d}  loss {losses[-1]:.5f}")
            state = batches.state_dict()
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(
        f"loss {first:.5f} -> {last:.5f} over {len(losses)} steps; resume state at epoch {state['epoch']} "
        f"position {state['position']}"
    )
    if not last < first:
        print("loss did not go down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
