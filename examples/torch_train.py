"""Train a tiny PyTorch model on stoker batches: int8 images shipped as-is, cast on the device.

A linear layer over the flattened 16x16 images of ``stoker.write_sample`` learns to
predict each image's label. The loader keeps images int8 (4x fewer bytes to move than
float32) and ``cast_on_device`` turns them into float32 after the transfer: the
recommended setup for the seed's data.

    python examples/torch_train.py [--data DIR] [--steps 50] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="sample directory (written if missing); default: a temporary one")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ds = sample_dataset(Path(args.data) if args.data else Path(tmp))
        torch.manual_seed(0)
        device = torch.device(args.device)
        model = torch.nn.Linear(RES * RES, 1).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.005)
        scale = float(len(ds))  # labels are record indices: predict them in [0, 1)
        losses: list[float] = []
        loader = ds.loader(args.batch_size, epochs=None, shuffle="global", seed=0, drop_remainder=True)
        pin = device.type == "cuda"
        with loader.to_torch(device=device, pin_memory=pin, cast_on_device={"image": torch.float32}) as batches:
            # zip asks range first: no batch is taken (and counted in the state) past the last step.
            for step, batch in zip(range(args.steps), batches, strict=False):
                x = batch["image"].reshape(len(batch["image"]), -1) / 128.0
                loss = torch.nn.functional.mse_loss(model(x).squeeze(1), batch["label"] / scale)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if step % 10 == 0:
                    print(f"step {step:4d}  loss {losses[-1]:.5f}")
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
