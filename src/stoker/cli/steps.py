"""What a training step sees of a loader: its batches taken with an emulated step after each
(`take`), the accelerator utilization and host cost that come of it (`Stepped`), and the
smallest step a loader keeps busy (`smallest_step`).

Accelerator utilization (AU) is MLPerf Storage's score: the share of the wall time the
accelerator spends in its step; a storage system passes at 90% or more. The step here is a
`sleep` (the host thread idle, as while an accelerator computes) or a `cpu` spin (a step the
host itself runs). The time in the step is measured where it runs rather than taken as the
nominal step times the batches, since a sleep overshoots (by a tenth of a millisecond or more
on a busy machine) and that overshoot is the step's, not a wait on the loader.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SpecError

__all__ = ["STEP_KINDS", "Stepped", "handoff", "pause", "parse_steps", "smallest_step", "take"]

STEP_KINDS = ("sleep", "cpu")


@dataclass(frozen=True)
class Stepped:
    """One timed window of batches, each followed by the step.

    `cpu_seconds` is the process's CPU time over the window less the step's own (a `cpu`
    step's spin), so it is what loading the batches cost the host.
    """

    batches: int
    records: int
    seconds: float
    step_seconds: float
    wait_seconds: float
    cpu_seconds: float
    bytes_read: int

    @property
    def utilization(self) -> float:
        """AU: the share of the wall time spent in the step."""
        return self.step_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """The share of the wall time spent waiting for the next batch."""
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_per_batch(self) -> float:
        return self.wait_seconds / self.batches if self.batches else 0.0

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def cores(self) -> float:
        """The cores loading took: its CPU seconds over the wall seconds."""
        return self.cpu_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_seconds_per_gb(self) -> float:
        """CPU seconds spent per 10**9 bytes of records delivered."""
        return self.cpu_seconds / (self.bytes_read / 1e9) if self.bytes_read else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "batches": self.batches, "records": self.records, "seconds": self.seconds,
            "step_seconds": self.step_seconds, "wait_seconds": self.wait_seconds, "cpu_seconds": self.cpu_seconds,
            "bytes_read": self.bytes_read, "utilization": self.utilization, "wait_fraction": self.wait_fraction,
            "wait_ms_per_batch": self.wait_per_batch * 1000, "records_per_s": self.records_per_s,
            "cores": self.cores, "cpu_seconds_per_gb": self.cpu_seconds_per_gb,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Stepped:
        return cls(int(d["batches"]), int(d["records"]), float(d["seconds"]), float(d["step_seconds"]),
                   float(d["wait_seconds"]), float(d["cpu_seconds"]), int(d["bytes_read"]))  # fmt: skip


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for i in range(1000):
            x += i


def pause(step: float, kind: str) -> Callable[[], None]:
    """The step itself: `step` seconds asleep (`sleep`) or on the CPU (`cpu`)."""
    if kind not in STEP_KINDS:
        raise SpecError(f"step kind {kind!r}: must be one of {', '.join(STEP_KINDS)}")
    if kind == "sleep":
        return lambda: time.sleep(step)
    return lambda: _spin(step)


def take(
    batches: Iterator[Any], *, seconds: float, step: float, kind: str, rows: Callable[[Any], int], record_bytes: int
) -> Stepped:
    """Take batches for `seconds` of wall time, each followed by a step of `step` seconds.

    `rows(batch)` counts a batch's records, `record_bytes` their bytes. A batch is held through
    its step (it is in use there) and dropped before the next is asked for, as a training loop does.
    """
    run_step = pause(step, kind)
    n = k = 0
    waited = stepped = step_cpu = 0.0
    cpu = time.process_time()
    start = time.perf_counter()
    until = start + seconds
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        got = time.perf_counter()
        if batch is None:
            break
        waited += got - asked
        n += rows(batch)
        k += 1
        own = time.thread_time()
        run_step()
        step_cpu += time.thread_time() - own if kind == "cpu" else 0.0
        done = time.perf_counter()
        stepped += done - got
        batch = None
        if done >= until:
            break
    elapsed = time.perf_counter() - start
    used = max(0.0, time.process_time() - cpu - step_cpu)
    return Stepped(k, n, elapsed, stepped, waited, used, n * record_bytes)


def smallest_step(batch_seconds: float, handoffs: Sequence[tuple[float, float]], utilization: float) -> float:
    """The smallest step (seconds) a loader keeps busy `utilization` of the time, in the model
    `wait(step) = max(0, batch_seconds - step) + handoff(step)` per batch, AU = step / (step + wait).

    `batch_seconds` is the loader's time per batch with no step (batch size over its
    records/s): a step shorter than that outruns the loader and waits for the difference. The
    handoff is what each batch costs the loop beyond that even when the batch is ready (taking
    it, waking the consumer, the loop's bookkeeping), measured at the steps run: `handoffs` is
    (step, handoff) pairs, interpolated linearly between them and held constant beyond them,
    since it grows with the step (workers idle longer take longer to wake).
    """
    if not 0 < utilization < 1:
        raise ValueError(f"{utilization=} must be between 0 and 1")
    if not handoffs:
        raise ValueError("no handoff measured: the model needs at least one (step, handoff)")
    points = sorted(handoffs)

    def handoff_at(step: float) -> float:
        if step <= points[0][0]:
            return points[0][1]
        for (s0, h0), (s1, h1) in itertools.pairwise(points):
            if step <= s1:
                return h0 + (h1 - h0) * (step - s0) / (s1 - s0) if s1 > s0 else h1
        return points[-1][1]

    def busy(step: float) -> float:
        return step / (step + max(0.0, batch_seconds - step) + handoff_at(step))

    # AU grows with the step (the handoff grows more slowly than the step), so bisect for it.
    low, high = 0.0, max(batch_seconds, points[-1][0], 1e-6)
    while busy(high) < utilization:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if busy(mid) < utilization else (low, mid)
        if high - low <= 1e-12:
            break
    return high


def handoff(batch_seconds: float, step: float, other_per_batch: float) -> float:
    """The model's handoff from a run at `step` (seconds per batch, as the step took): the loop's
    time per batch outside the step, less the step's shortfall on the loader
    (`batch_seconds - step`, where positive)."""
    return max(0.0, other_per_batch - max(0.0, batch_seconds - step))


def parse_steps(text: str) -> list[float]:
    """`--step 1,2,5,20`: positive milliseconds, in the order given, each once."""
    steps: list[float] = []
    for item in text.split(","):
        try:
            ms = float(item)
        except ValueError:
            ms = float("nan")
        if not ms > 0 or ms == float("inf"):
            raise SpecError(f"--step {text!r}: {item!r} is not a positive number of milliseconds")
        if ms not in steps:
            steps.append(ms)
    return steps
