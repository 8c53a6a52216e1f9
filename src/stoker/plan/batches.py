"""Which records, in what order: pure index arithmetic, no I/O.

The plan turns the dataset's geometry (how many groups, how many records each) and the
loader's settings into batches of coalesced runs: `(group, first record, count, row in
the batch)`. Python work grows with runs, not records. Order is exactly that of
`tf.data.Dataset.interleave(cycle_length, block_length, deterministic=True)` over the
groups in order, so tf.data is the reference in tests.

Record counts are asked for through a callable, lazily, as the interleave opens each
group: the plan does no I/O itself, and a dataset of 10,000 groups costs nothing before
its first batch. A count that cannot be settled raises from the callable; that error
then belongs to the batch that would have held the group's first record.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from .order import index_permutation, permute_groups, shard_take, window_shuffle

__all__ = [
    "BatchPlan",
    "Plan",
    "PlanConfig",
    "Run",
    "coalesce",
    "default_block_length",
    "default_cycle_length",
    "interleave",
    "next_pass",
    "pass_end",
]

# measured: reads of 256 KiB..1 MiB reach the same copy speed as larger ones on page-cached
# files, but each run also costs a fixed share of Python and locking per field, so a run
# covers a whole batch of W1 (benchmarks/w1.py): 4 MiB per run of the widest field (measured:
# benchmarks/results/w1_history.md).
TARGET_READ_BYTES = 4 << 20
# Four groups open at once mixes groups within a batch while keeping each read large and
# few files open; a pure function of geometry (never of core count) so order is portable.
DEFAULT_CYCLE = 4


def default_block_length(max_record_bytes: int) -> int:
    """Records per interleave block: enough that a run of the widest field is ~4 MiB."""
    return max(1, math.ceil(TARGET_READ_BYTES / max(1, max_record_bytes)))


def default_cycle_length(num_groups: int) -> int:
    """Groups read side by side: `min(num_groups, 4)`."""
    return max(1, min(num_groups, DEFAULT_CYCLE))


def pass_end(first_epoch: int, epochs: int | None, *, reshuffle: bool = True) -> int | None:
    """One past the last epoch of the pass that holds `first_epoch` (None: it never ends).

    Pass k of a loader with `epochs=E` covers epochs `k*E .. k*E+E-1`, so iterating it
    again continues with new orders, as tf.data's `reshuffle_each_iteration` does; without
    `reshuffle` every pass covers epochs `0 .. E-1`.

    Example:
        >>> pass_end(0, 1), pass_end(7, 3), pass_end(1, 3, reshuffle=False)
        (1, 9, 3)
    """
    if epochs is None:
        return None
    return (first_epoch // epochs + 1) * epochs if reshuffle else epochs


def next_pass(first_epoch: int, last_epoch: int, epochs: int | None, *, reshuffle: bool = True) -> int:
    """The first epoch of the pass after one that began at `first_epoch` and reached `last_epoch`.

    Passes of a loader that repeats forever (`epochs=None`) end only when left: the next
    goes on with the epoch after the last one it delivered from.

    Example:
        >>> next_pass(3, 4, 3), next_pass(3, 4, 3, reshuffle=False), next_pass(0, 5, None)
        (6, 0, 6)
    """
    if not reshuffle:
        return 0
    end = pass_end(first_epoch, epochs)
    return last_epoch + 1 if end is None else end


@dataclass(frozen=True, slots=True)
class Run:
    """`count` records of `group` from `start` every `step`, landing at batch rows `row..`.

    `final` is True on the run that reads the group's last record in this shard's plan
    (a run of count 0 when another shard holds that record), so the engine can confirm
    the end of compressed streams and release the group's files.
    """

    group: int
    start: int
    count: int
    row: int
    final: bool
    step: int = 1

    @property
    def stop(self) -> int:
        """One past the last record read (with `step`)."""
        return self.start + (self.count - 1) * self.step + 1 if self.count else self.start


@dataclass(frozen=True, slots=True)
class Gather:
    """Records by random access: row r of the batch is record `index[r]` of `groups[r]`."""

    groups: np.ndarray
    index: np.ndarray


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One batch: `rows` records made of `runs` in row order, or of one `gather`."""

    epoch: int
    index: int  # batch number within the epoch (for this pass)
    position: int  # epoch position this shard resumes from after this batch (see order)
    rows: int
    runs: tuple[Run, ...]
    gather: Gather | None = None
    # pad_last: rows `valid..rows` are padding (the runs/gather fill only `0..valid`).
    valid: int | None = None
    # Made by `coalesce`: the batches this one holds end to end, delivered one by one.
    parts: tuple[BatchPlan, ...] | None = None


Shuffle = Literal[False, "global", "files"]


def coalesce(plans: Sequence[BatchPlan]) -> BatchPlan:
    """Consecutive batches of one epoch (no padding) as one batch holding them end to end
    (`parts`). Runs: each moved down by the rows before its batch, and a run that goes on
    where the one before it stopped (same group, the next record) merged into it, so a file's
    records are read in one call where they were read in several. Gathers: one gather of all
    their records, which visits each file once.
    """
    first = plans[0]
    if first.gather is not None:
        gathers = [p.gather for p in plans if p.gather is not None]
        assert len(gathers) == len(plans), "gathers and runs are never coalesced together"
        groups = np.concatenate([g.groups for g in gathers])
        index = np.concatenate([g.index for g in gathers])
        rows = sum(p.rows for p in plans)
        gather = Gather(groups, index)
        return BatchPlan(first.epoch, first.index, plans[-1].position, rows, (), gather, parts=tuple(plans))
    runs: list[Run] = []
    row = 0
    for plan in plans:
        for r in plan.runs:
            at = row + r.row
            if runs and r.count:
                last = runs[-1]
                if (
                    last.count and not last.final and last.group == r.group and last.step == r.step
                    and last.row + last.count == at and last.start + last.count * last.step == r.start
                ):  # fmt: skip
                    runs[-1] = Run(last.group, last.start, last.count + r.count, last.row, r.final, last.step)
                    continue
            runs.append(Run(r.group, r.start, r.count, at, r.final, r.step))
        row += plan.rows
    return BatchPlan(first.epoch, first.index, plans[-1].position, row, tuple(runs), parts=tuple(plans))


@dataclass(frozen=True, slots=True)
class PlanConfig:
    batch_size: int
    drop_remainder: bool
    cycle_length: int
    block_length: int
    shuffle: Shuffle = False
    seed: int | None = None
    window: int = 1  # "files" mode: blocks shuffled together
    shard: tuple[int, int] = (0, 1)
    even: bool = True
    # Evaluation mode: no trimming; every shard yields the same number of full-size batches,
    # the last ones padded (BatchPlan.valid says how many rows are real).
    pad_last: bool = False
    # `shard` is a part of a shard of this count (a DataLoader worker's of its rank's): `even`
    # trims that shard, not the part (see stoker.plan.order.shard_take). None: the shard's count.
    even_over: int | None = None


def interleave(
    num_groups: int,
    count: Callable[[int], int],
    cycle_length: int,
    block_length: int,
    order: Sequence[int] | np.ndarray | None = None,
) -> Iterator[tuple[int, int, int]]:
    """Pieces `(group, start, stop)` in tf.data's deterministic interleave order.

    A literal transcription of tf.data's InterleaveDataset iterator at block granularity:
    a slot whose group ran out is noticed only when the cycle comes back to it (then it
    is emptied and the cycle moves on); an empty slot with groups left is filled and read
    from on the same visit; a block cut short by the end of its group moves the cycle on.
    `order` gives the groups in the order they are opened (default: 0, 1, 2, ...).
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
            g = next_group if order is None else int(order[next_group])
            slots[cycle_index] = [g, 0, count(g)]
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
        """This shard's batches of one epoch, from epoch position `start` on.

        Shard `i` of `c` takes positions `start + i, start + i + c, ...` of the epoch's
        sequence, so a state saved after k records resumes at `start + c * k` with any
        shard count (see `stoker.order`).
        """
        if self.config.shuffle == "global":
            yield from self._global(epoch, start)
        else:
            yield from self._sequential(epoch, start)

    def _limit(self, start: int) -> int | None:
        """Records this shard yields in an epoch (None: until the sequence ends)."""
        cfg = self.config
        if not cfg.even or cfg.pad_last or (cfg.even_over or cfg.shard[1]) == 1:
            return None
        return shard_take(self.total(), cfg.shard, start, even=True, even_over=cfg.even_over)

    def pieces(self, epoch: int) -> Iterator[tuple[int, int, int]]:
        """The epoch's sequence as contiguous pieces `(group, start, stop)`."""
        cfg = self.config
        order = None
        if cfg.shuffle == "files":
            assert cfg.seed is not None
            order = permute_groups(self.num_groups, cfg.seed, epoch)
        pieces = interleave(self.num_groups, self.count, cfg.cycle_length, cfg.block_length, order)
        if cfg.shuffle != "files" or cfg.window <= 1:
            yield from pieces
            return
        assert cfg.seed is not None
        # Shuffle which group's block comes next within each window, but keep each group's
        # blocks in file order, so compressed streams are still read front to back.
        w = 0
        while True:
            window = [p for _, p in zip(range(cfg.window), pieces, strict=False)]
            if not window:
                return
            perm = window_shuffle(len(window), len(window), cfg.seed, epoch * 1_000_003 + w)
            labels = [window[int(k)][0] for k in perm]
            queues: dict[int, list[tuple[int, int, int]]] = {}
            for p in window:
                queues.setdefault(p[0], []).append(p)
            for g in labels:
                yield queues[g].pop(0)
            w += 1

    def _sequential(self, epoch: int, start: int) -> Iterator[BatchPlan]:
        cfg = self.config
        size = cfg.batch_size
        i, c = cfg.shard
        limit = self._limit(start)
        runs: list[Run] = []
        rows = 0
        index = 0
        taken = 0  # records this shard took since `start`
        pos = 0  # epoch position of the piece's first record
        # Where the ends of groups can be trimmed from the epoch (drop_remainder, shards,
        # pad_last), a full batch is held back until the next one is full, so those ends
        # can still ride on the last batch delivered: every stream is confirmed at its end
        # (see _with_ends). A count that fails (a group opening) releases the held batch
        # first: it is delivered before the error, as without the hold.
        hold = cfg.drop_remainder or c > 1 or cfg.pad_last
        held: BatchPlan | None = None
        trimmed: list[int] = []  # groups whose last piece the shard limit cut off
        pieces = self.pieces(epoch)
        while True:
            try:
                g, a, b = next(pieces)
            except StopIteration:
                break
            except BaseException:
                if held is not None:
                    yield held
                raise
            n = b - a
            end = self.count(g)
            if pos + n <= start or (limit is not None and taken >= limit):
                if pos + n > start and b == end:
                    trimmed.append(g)
                pos += n
                continue
            lo = max(pos, start)
            first = lo + ((start + i - lo) % c)  # first position >= lo taken by this shard
            local = a + (first - pos)
            count = 0 if first >= pos + n else (pos + n - 1 - first) // c + 1
            if limit is not None:
                count = min(count, limit - taken)
            pos += n
            finished = False
            while count > 0:
                take = min(count, size - rows)
                finished = b == end and take == count
                runs.append(Run(g, local, take, rows, finished, c))
                rows += take
                taken += take
                count -= take
                local += take * c
                if rows == size:
                    valid = size if cfg.pad_last else None  # pad_last: every batch says which rows are real
                    full = BatchPlan(epoch, index, start + c * taken, rows, tuple(runs), None, valid)
                    if held is not None:
                        yield held
                    if hold:
                        held = full
                    else:
                        yield full
                    index += 1
                    runs, rows = [], 0
            if b == end and not finished:
                # The group's last record went to another shard (or was trimmed): tell the
                # engine anyway, with an empty run, so it confirms the stream and lets go.
                runs.append(Run(g, b, 0, rows, True, c))
        tail = tuple(runs)
        rest: list[BatchPlan] = []
        if cfg.pad_last:
            rest = list(self._padded(epoch, index, start + c * taken, start, rows, tail))
        elif rows and not cfg.drop_remainder:
            rest = [BatchPlan(epoch, index, start + c * taken, rows, tail)]
        carried = bool(rest) and rest[0].runs == tail
        ends = trimmed + ([] if carried else [r.group for r in tail if r.final])
        last = [held] if held is not None else []
        yield from self._with_ends([*last, *rest], ends)

    def _with_ends(self, batches: list[BatchPlan], groups: list[int]) -> list[BatchPlan]:
        """`batches` with empty final runs for `groups` added to the last one.

        Those groups' last records are not delivered in this epoch (a dropped remainder,
        the even-shard trim); the empty runs make the engine read on to each stream's end
        and check it there, so a gzip trailer that miscounts a group (it can only be trusted
        until its stream is read to the end) is an error, never records silently missing.
        An epoch that delivers no batch at all has nothing to carry them.
        """
        if not groups or not batches:
            return batches
        last = batches[-1]
        c = self.config.shard[1]
        ends = tuple(Run(g, self.count(g), 0, last.rows, True, c) for g in groups)
        return [*batches[:-1], replace(last, runs=last.runs + ends)]

    def padded_batches(self, total: int, start: int = 0) -> int:
        """pad_last: batches every shard yields from `start`: enough for the longest shard."""
        longest = max(0, -(-(total - start) // self.config.shard[1]))
        return -(-longest // self.config.batch_size)

    def _padded(
        self,
        epoch: int,
        index: int,
        position: int,
        start: int,
        rows: int,
        runs: tuple[Run, ...],
        gather: Gather | None = None,
    ) -> Iterator[BatchPlan]:
        """The last real rows padded to a full batch, then all-padding batches up to the common count.

        Only the last batch of an epoch can be short on any shard (shard lengths differ by at
        most one record), so after it every shard has consumed the epoch: its position is the
        epoch's end, which keeps lockstep resume exact.
        """
        total = self.total()
        end = self.padded_batches(total, start)
        size = self.config.batch_size
        if rows or (runs and index < end):  # runs alone: end-of-group markers, carried if a batch is due
            yield BatchPlan(epoch, index, total if index + 1 >= end else position, size, runs, gather, rows)
            index += 1
        while index < end:
            yield BatchPlan(epoch, index, total, size, (), None, 0)
            index += 1

    def total(self) -> int:
        return sum(self.count(g) for g in range(self.num_groups))

    def _global(self, epoch: int, start: int) -> Iterator[BatchPlan]:
        cfg = self.config
        assert cfg.seed is not None
        size = cfg.batch_size
        i, c = cfg.shard
        counts = np.fromiter((self.count(g) for g in range(self.num_groups)), dtype=np.int64, count=self.num_groups)
        firsts = np.concatenate([[0], np.cumsum(counts)])
        total = int(firsts[-1])
        perm = index_permutation(total, cfg.seed, epoch)
        limit = self._limit(start)
        available = max(0, -(-(total - start - i) // c)) if total > start + i else 0
        n = available if limit is None else min(available, limit)
        if cfg.drop_remainder:
            n -= n % size
        for index, k in enumerate(range(0, n, size)):
            take = min(size, n - k)
            positions = start + i + c * np.arange(k, k + take, dtype=np.int64)
            ids = perm(positions)
            groups = np.searchsorted(firsts, ids, side="right") - 1
            local = ids - firsts[groups]
            if cfg.pad_last and take < size:
                yield from self._padded(epoch, index, start + c * (k + take), start, take, (), Gather(groups, local))
                return
            valid = take if cfg.pad_last else None
            yield BatchPlan(epoch, index, start + c * (k + take), take, (), Gather(groups, local), valid)
        if cfg.pad_last:
            yield from self._padded(epoch, -(-n // size), start + c * n, start, 0, ())

    def batches(self, epochs: int | None, *, first_epoch: int = 0, start: int = 0) -> Iterator[BatchPlan]:
        """Batches of epochs `first_epoch, first_epoch + 1, ...` (forever if `epochs` is None).

        A whole epoch with no batch ends the run even when `epochs` is None, as tf.data's
        `repeat()` does: repeating nothing would spin forever without yielding.
        """
        epoch = first_epoch
        while epochs is None or epoch < epochs:
            some = False
            for plan in self.epoch(epoch, start):
                some = True
                yield plan
            if not some and start == 0:
                return
            start = 0
            epoch += 1

    def batches_per_epoch(self, total_records: int) -> int:
        size = self.config.batch_size
        return total_records // size if self.config.drop_remainder else -(-total_records // size)
