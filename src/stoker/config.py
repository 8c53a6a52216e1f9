"""The loader's options: each declared once, with one default, one docstring and its checks.

`Dataset.loader` offers these as keyword arguments and builds a `LoaderConfig`; the Loader
and the modules it sizes and runs read `config.<option>` and copy nothing. A new option is a
field here (with its check in `__post_init__`) and a keyword of `Dataset.loader` with its line
in that docstring; tests/api/test_config.py checks the two agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .engine.executor import Executor
from .errors import SpecError
from .plan.batches import Shuffle
from .plan.order import validate_even_over, validate_shard
from .spec import parse_bytes, positive

__all__ = ["LoaderConfig"]


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{name}={value!r} must be True or False")


def _seed_ok(seed: object) -> bool:
    return not isinstance(seed, bool) and isinstance(seed, int | np.integer) and bool(seed >= 0)


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """A Loader's options, checked once when built: every count a positive integer, every flag
    a bool, the choices among those offered and consistent with each other. What depends on the
    dataset (cast, the memory budget against a batch) the Loader checks when it sizes itself.

    `None` stands for "stoker chooses"; counts are plain ints after the checks.

    Example:
        >>> LoaderConfig(batch_size=256, shuffle="files", seed=1).window
        16
    """

    batch_size: int
    """Records per batch; the last batch of an epoch may be shorter."""
    epochs: int | None = 1
    """Epochs per pass (per `iter(loader)`); None repeats forever."""
    drop_remainder: bool = False
    """Drop each epoch's last short batch."""
    cycle_length: int | None = None
    """Files read side by side (tf.data's interleave setting); None: `stoker.plan.default_cycle_length`."""
    block_length: int | None = None
    """Consecutive records taken from a file before the next; None: `stoker.plan.default_block_length`."""
    cast: Any = None
    """One dtype for every field, or `{field: dtype}`; applied while assembling."""
    threads: int | None = None
    """Worker threads (processes with workers="process"); None: measured by autotune."""
    prefetch: int | None = None
    """Batches prepared ahead; None: chosen from the memory budget (stoker.engine.budget)."""
    memory_budget: int | str | None = None
    """Bytes the engine may hold, as `"2GiB"` or an int; None: `stoker.machine.default_memory_budget`."""
    with_index: bool = False
    """Add `__group__` and `__index__` arrays (int64) to audit pairing."""
    shuffle: Shuffle | None = False
    """False (the interleave order), "global" (every record, seeded) or "files" (groups and blocks)."""
    seed: int | None = None
    """A non-negative integer: the shuffle's and the transforms' seed."""
    window: int = 16
    """"files" shuffle: blocks shuffled together. A constant, never derived from memory_budget,
    so the order never depends on the budget."""
    reshuffle_each_iteration: bool = True
    """True: each pass goes on with the next epochs; False: every pass replays epochs 0 .. epochs-1."""
    shard: tuple[int, int] = (0, 1)
    """`(index, count)`: this loader takes every count-th record of the epoch's sequence from index on."""
    even: bool = True
    """Trim every shard to the same number of batches (collectives never hang)."""
    even_over: int | None = None
    """For adapters that split a rank's shard `(i, c)` among worker processes: with
    `shard=(i + c*w, c*W)` the `even` trim is the rank's (see `stoker.plan.order.shard_take`)."""
    pad_last: bool = False
    """Evaluation mode: every record once over all shards, full batches, padding marked in `__valid__`."""
    workers: str = "thread"
    """"thread" or "process": transforms run in worker processes on batches in shared memory."""
    num_parallel_reads: int | None = None
    """Ranged GETs kept in flight for fields at URLs; None: 16, fewer where the budget is tight."""
    transform: Any = None
    """`fn(batch, rng) -> batch` or a list of them, applied in order on the workers."""
    executor: Executor | None = None
    """The engine that runs the assembly (tests and adapters); None: worker threads or processes."""

    def __post_init__(self) -> None:
        # In the order the checks have always run: with two wrong, the same error.
        put = functools.partial(object.__setattr__, self)
        put("batch_size", positive("batch_size", self.batch_size, allow_none=False))
        put("epochs", positive("epochs", self.epochs))
        _flag("drop_remainder", self.drop_remainder)
        _flag("with_index", self.with_index)
        _flag("pad_last", self.pad_last)
        if self.pad_last and self.drop_remainder:
            raise SpecError("pad_last=True pads the last batch and drop_remainder=True drops it; choose one")
        put("cycle_length", positive("cycle_length", self.cycle_length))
        put("block_length", positive("block_length", self.block_length))
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)
        put("threads", positive("threads", self.threads))
        if self.workers not in ("thread", "process"):
            raise SpecError(f"workers={self.workers!r} must be 'thread' or 'process'")
        if self.transform is None:
            if self.workers == "process":
                raise SpecError("workers='process' runs transform= functions in worker processes; none was given")
        else:
            if self.workers == "process" and self.executor is not None:
                raise SpecError("workers='process' brings its own executor; pass executor= or workers=, not both")
            if self.seed is not None and not _seed_ok(self.seed):
                raise SpecError(
                    f"seed={self.seed!r} must be a non-negative integer or None (transforms then use seed 0)"
                )
        put("prefetch", positive("prefetch", self.prefetch))
        shuffle = False if self.shuffle is None else self.shuffle
        if shuffle not in (False, "global", "files"):
            raise SpecError(f"shuffle={shuffle!r} must be False, 'global' or 'files'")
        put("shuffle", shuffle)
        if shuffle and not _seed_ok(self.seed):
            raise SpecError(
                f"shuffle={shuffle!r} needs seed= a non-negative integer (got seed={self.seed!r}); stoker never "
                "seeds from the clock, so the same seed gives the same order on any machine"
            )
        put("seed", int(self.seed) if self.seed is not None else None)
        put("window", positive("window", self.window, allow_none=False))
        _flag("reshuffle_each_iteration", self.reshuffle_each_iteration)
        put("shard", validate_shard(self.shard))
        _flag("even", self.even)
        put("even_over", validate_even_over(self.shard, self.even_over))
        put("num_parallel_reads", positive("num_parallel_reads", self.num_parallel_reads))
