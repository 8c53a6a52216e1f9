"""Conformance helpers users can run on their own configurations."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .loader import Loader

__all__ = ["assert_resumable", "assert_same_batches"]


def assert_same_batches(expected: Iterable[Mapping[str, np.ndarray]], actual: Iterable[Mapping[str, np.ndarray]],
                        *, context: str = "") -> None:  # fmt: skip
    """Raise AssertionError at the first batch whose keys, shapes or values differ."""
    exp, act = list(expected), list(actual)
    for k, (a, b) in enumerate(zip(exp, act, strict=False)):
        if a.keys() != b.keys():
            raise AssertionError(f"{context}batch {k}: keys {sorted(a)} != {sorted(b)}")
        for name in a:
            if a[name].shape != b[name].shape or a[name].dtype != b[name].dtype or not np.array_equal(a[name], b[name]):
                raise AssertionError(
                    f"{context}batch {k}, field {name!r}: expected shape {a[name].shape} {a[name].dtype}, "
                    f"got {b[name].shape} {b[name].dtype}, or values differ"
                )
    if len(exp) != len(act):
        raise AssertionError(f"{context}{len(exp)} batches expected, got {len(act)}")


def assert_resumable(make_loader: Callable[[], Loader], steps: int | Iterable[int] = 8, *, passes: int = 1) -> None:
    """Check that saving after any batch and resuming in a new loader continues exactly.

    Runs `make_loader()` uninterrupted for `passes` passes (it must be finite: `epochs`
    not None), then for each restore point k saves `state_dict()` after k batches of
    those passes, round-trips it through JSON, loads it into a fresh `make_loader()`
    and checks that the batches before plus the batches after (the rest of the pass the
    state was saved in, then the passes that follow) equal the uninterrupted run, batch for
    batch. At the end of a pass it checks both states: after its last batch, and after
    the pass has ended (which resumes with the next pass).

    Args:
        make_loader: builds the same loader each time (threads/prefetch may differ).
        steps: how many restore points, spread evenly (int), or the exact points.
        passes: how many times the run iterates the loader (each pass continues with the
            next epochs unless `reshuffle_each_iteration=False`).

    Example:
        >>> assert_resumable(lambda: ds.loader(64, epochs=2, shuffle="global", seed=1))
    """
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"{passes=} must be a positive integer")
    with make_loader() as reference_loader:
        runs = [[dict(b) for b in reference_loader] for _ in range(passes)]
    reference = [b for run in runs for b in run]
    lengths = [len(run) for run in runs]
    pass_ends = set(itertools.accumulate(lengths))
    n = len(reference)
    if isinstance(steps, int):
        if steps < 1:
            raise ValueError(f"{steps=} must be positive")
        points = sorted({round(i * n / steps) for i in range(steps + 1)})
    else:
        points = sorted(set(steps))
    for k in points:
        if not 0 <= k <= n:
            raise ValueError(f"restore point {k} is outside 0..{n}")
        for ended in (False, True) if k in pass_ends else (False,):
            with make_loader() as first:
                before, resumed_pass = _take(first, k, lengths, ended=ended)
                state: Any = json.loads(json.dumps(first.state_dict()))
            with make_loader() as second:
                second.load_state_dict(state)
                after = [dict(b) for _ in range(resumed_pass, passes) for b in second]
            where = f"resumed after {k} of {n} batches{' (pass ended)' if ended else ''}: "
            assert_same_batches(reference, before + after, context=where)


def _take(loader: Loader, k: int, lengths: list[int], *, ended: bool) -> tuple[list[dict[str, Any]], int]:
    """The first `k` batches of `loader`'s passes, and the pass a state saved then resumes in.

    `ended`: the k-th batch is a pass's last; end that pass too (the state then resumes in the next).
    """
    before: list[dict[str, Any]] = []
    for j, length in enumerate(lengths):
        it = iter(loader)
        take = min(k - len(before), length)
        before.extend(dict(next(it)) for _ in range(take))
        if len(before) == k and not ended:
            return before, j
        if next(it, None) is not None:
            raise AssertionError(f"pass {j} gave more than the {length} batches of the uninterrupted run")
        if len(before) == k:
            return before, j + 1
    raise AssertionError(f"{k} batches asked of passes of {lengths} batches")  # k is checked by the caller
