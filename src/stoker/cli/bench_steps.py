"""`stoker bench --step`: its arguments, the contenders it adds (stoker and the stepped ceiling
loop under each step), and its part of the report: per step, AU, records/s, cores and
CPU-seconds per GB, the smallest step stoker keeps busy, and the doctor's verdict.
The arithmetic is `stoker.cli.steps`.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..machine import available_cores
from .contenders import Measurement, summarize
from .steps import STEP_KINDS, Stepped, handoff, smallest_step

__all__ = ["add_step_args", "add_stepped", "report_steps", "stepped_name"]


def stepped_name(contender: str, ms: float) -> str:
    """A contender's name under a step: `stoker step=2ms`."""
    return f"{contender} step={ms:g}ms"


def add_stepped(contenders: dict[str, dict[str, Any]], base: str, name: str, steps: list[float], kind: str) -> None:
    """Add `name` under each step to `contenders`, configured as `base` with the step."""
    loop = {"loop": "stepped"} if name.startswith("ceiling") else {}
    for ms in steps:
        contenders[stepped_name(name, ms)] = {**contenders[base], **loop, "step_ms": ms, "step_kind": kind}


def add_step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step",
        metavar="MS",
        default=None,
        help="after each batch, a training step of MS milliseconds (or a comma list: 1,2,5,20), for stoker and "
        "the ceiling loop alike: reports accelerator utilization, cores used and CPU-seconds per GB (default: none)",
    )
    p.add_argument(
        "--step-kind",
        choices=STEP_KINDS,
        default="sleep",
        help="sleep: the host thread idle, as while an accelerator computes; cpu: a step the host runs "
        "(default: sleep)",
    )


def _median(ms: list[Measurement]) -> Stepped | None:
    """The round at the median AU, standing for a stepped contender."""
    done = sorted((Stepped.from_dict(m.stepped) for m in ms if m.stepped), key=lambda s: s.utilization)
    return done[len(done) // 2] if done else None


def report_steps(
    results: dict[str, list[Measurement]], steps: list[float], batch_size: int, kind: str, figures: dict[str, Any]
) -> None:
    """Per step: AU, records/s, cores and CPU-s/GB of stoker and of the stepped ceiling loop,
    then the smallest step stoker keeps 90% and 99% busy (see stoker.cli.steps.smallest_step)."""
    from ..doctor import step_verdict

    cores = available_cores()
    print(f"under a step of N ms per batch ({kind}), median round: AU = time in the step / wall time")
    print(f"{'step':>8} {'':<8} {'AU':>6} {'waits':>6} {'records/s':>10} {'cores':>6} {'CPU-s/GB':>9}")
    rows: list[dict[str, Any]] = []
    for ms in steps:
        row: dict[str, Any] = {"step_ms": ms}
        for who, name in (("stoker", stepped_name("stoker", ms)), ("ceiling", stepped_name("ceiling:stepped", ms))):
            s = _median(results.get(name, []))
            if s is None:
                continue
            row[who] = s.to_dict()
            row[who]["utilization_rounds"] = [
                Stepped.from_dict(m.stepped).utilization for m in results[name] if m.stepped
            ]
            print(f"{ms:>6g}ms {who:<8} {s.utilization:>6.1%} {s.wait_fraction:>6.1%} {s.records_per_s:>10,.0f} "
                  f"{s.cores:>6.2f} {s.cpu_seconds_per_gb:>9.2f}")  # fmt: skip
        rows.append(row)
    figures["step_kind"] = kind
    figures["steps"] = rows
    # The model's numbers: stoker's time per batch with no step, and the handoff measured at
    # each step (the loop's time per batch outside the step, less the step's shortfall).
    rate = summarize([m.records_per_s for m in results["stoker"]])[0]
    measured = [(r["step_ms"], m) for r in rows if "stoker" in r and (m := Stepped.from_dict(r["stoker"])).batches]
    if rate <= 0 or not measured:
        return
    batch_s = batch_size / rate
    hands = []
    for _, m in measured:
        step = m.step_seconds / m.batches  # as the step took, per batch
        hands.append((step, handoff(batch_s, step, (m.seconds - m.step_seconds) / m.batches)))
    au90, au99 = smallest_step(batch_s, hands, 0.90), smallest_step(batch_s, hands, 0.99)
    figures["smallest_step_ms"] = {
        "au_90": au90 * 1000, "au_99": au99 * 1000, "batch_ms": batch_s * 1000,
        "handoff_ms": {f"{ms:g}": h * 1000 for (ms, _), (_, h) in zip(measured, hands, strict=True)},
    }  # fmt: skip
    shown = ", ".join(f"{h * 1000:.3f} ms at {s * 1000:.2f} ms" for s, h in hands)
    print(f"stoker keeps a step of {au90 * 1000:.2f} ms or more 90% busy, {au99 * 1000:.2f} ms or more 99% busy "
          f"(its batch of {batch_size} takes {batch_s * 1000:.2f} ms with no step; the loop's other time per "
          f"batch, at each step: {shown})")  # fmt: skip
    figures["step_verdicts"] = [
        step_verdict(r["step_ms"], fig["utilization"], fig["wait_fraction"], fig["cores"], cores)
        for r in rows if (fig := r.get("stoker"))
    ]  # fmt: skip
