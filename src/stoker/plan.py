"""Which records, in what order: pure index arithmetic, no I/O.

The plan turns the dataset's geometry (how many groups, how many records each) and the
loader's settings into batches of coalesced runs: ``(group, first record, count, row in
the batch)``. Python work grows with runs, not records. Order is exactly that of
``tf.data.Dataset.interleave(cycle_length, block_length, deterministic=True)`` over the
groups in order, so tf.data is the reference in tests.

Record counts are asked for through a callable, lazily, as the interleave opens each
group: the plan does no I/O itself, and a dataset of 10,000 groups costs nothing before
its first batch. A count that cannot be settled raises from the callable; that error
then belongs to the batch that would have held the group's first record.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = [
    "BatchPlan",
    "Plan",
    "PlanConfig",
    "Run",
    "default_block_length",
    "default_cycle_length",
    "interleave",
]

# measured: reads of 256 KiB..1 MiB reach the same speed as larger ones on page-cached
# files; below ~64 KiB per-call overhead shows. 1 MiB per run of the widest field.
TARGET_READ_BYTES = 1 << 20
# Four groups open at once mixes groups within a batch while keeping each read large and
# few files open; a pure function of geometry (never of core count) so order is portable.
DEFAULT_CYCLE = 4


def default_block_length(max_record_bytes: int) -> int:
    """Records per interleave block: enough that a run of the widest field is ~1 MiB."""
    return max(1, math.ceil(TARGET_READ_BYTES / max(1, max_record_bytes)))


def default_cycle_length(num_groups: int) -> int:
    """Groups read side by side: ``min(num_groups, 4)``."""
    return max(1, min(num_groups, DEFAULT_CYCLE))


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive records of ``group`` from ``start``, landing at batch row ``row``.

    ``final`` is True when the run ends at the group's last record, so the engine can
    confirm the end of compressed streams and release the group's files.
    """

    group: int
    start: int
    count: int
    row: int
    final: bool


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One batch: ``rows`` records made of ``runs``, in row order."""

    epoch: int
    index: int  # batch number within the epoch
    position: int  # records of the epoch delivered before this batch
    rows: int
    runs: tuple[Run, ...]


@dataclass(frozen=True, slots=True)
class PlanConfig:
    batch_size: int
    drop_remainder: bool
    cycle_length: int
    block_length: int


def interleave(
    num_groups: int, count: Callable[[int], int], cycle_length: int, block_length: int
) -> Iterator[tuple[int, int, int]]:
    """Pieces ``(group, start, stop)`` in tf.data's deterministic interleave order.

    A literal transcription of tf.data's InterleaveDataset iterator at block granularity:
    a slot whose group ran out is noticed only when the cycle comes back to it (then it
    is emptied and the cycle moves on); an empty slot with groups left is filled and read
    from on the same visit; a block cut short by the end of its group moves the cycle on.
    """
    slots: list[list[int] | None] = [None] * cycle_length
    next_group = 0
    num_open = 0
    cycle_index = 0
    block_index = 0
    while next_group < num_groups or num_open:
        slot = slots[cycle_index]
        if slot is not None:
            g, pos, n = slot
            if pos < n:
                take = min(block_length - block_index, n - pos)
                yield g, pos, pos + take
                slot[1] = pos + take
                block_index += take
                if block_index < block_length:
                    continue
            else:
                slots[cycle_index] = None
                num_open -= 1
        elif next_group < num_groups:
            slots[cycle_index] = [next_group, 0, count(next_group)]
            next_group += 1
            num_open += 1
            continue
        block_index = 0
        cycle_index = (cycle_index + 1) % cycle_length


class Plan:
    """Batches of runs for every epoch, from geometry and settings alone.

    Example:
        >>> plan = Plan(2, [3, 2].__getitem__, PlanConfig(4, False, 2, 1))
        >>> [[(r.group, r.start, r.count) for r in b.runs] for b in plan.epoch(0)]
        [[(0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)], [(0, 2, 1)]]
    """

    def __init__(self, num_groups: int, count: Callable[[int], int], config: PlanConfig) -> None:
        self.num_groups = num_groups
        self.count = count
        self.config = config

    def epoch(self, epoch: int, start: int = 0) -> Iterator[BatchPlan]:
        """Batches of one epoch, beginning after the first ``start`` records of it."""
        cfg = self.config
        size = cfg.batch_size
        runs: list[Run] = []
        rows = 0
        position = start
        index = start // size
        skip = start
        for g, a, b in interleave(self.num_groups, self.count, cfg.cycle_length, cfg.block_length):
            if skip:
                if b - a <= skip:
                    skip -= b - a
                    continue
                a += skip
                skip = 0
            end = self.count(g)
            while a < b:
                take = min(b - a, size - rows)
                runs.append(Run(g, a, take, rows, a + take == end))
                rows += take
                a += take
                if rows == size:
                    yield BatchPlan(epoch, index, position, rows, tuple(runs))
                    index += 1
                    position += rows
                    runs, rows = [], 0
        if rows and not cfg.drop_remainder:
            yield BatchPlan(epoch, index, position, rows, tuple(runs))

    def batches(self, epochs: int | None, *, first_epoch: int = 0, start: int = 0) -> Iterator[BatchPlan]:
        """Batches of epochs ``first_epoch, first_epoch + 1, ...`` (forever if ``epochs`` is None)."""
        epoch = first_epoch
        while epochs is None or epoch < epochs:
            yield from self.epoch(epoch, start)
            start = 0
            epoch += 1

    def batches_per_epoch(self, total_records: int) -> int:
        size = self.config.batch_size
        return total_records // size if self.config.drop_remainder else -(-total_records // size)
