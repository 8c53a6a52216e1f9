"""Conformance helpers users can run on their own configurations."""

from __future__ import annotations

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


def assert_resumable(make_loader: Callable[[], Loader], steps: int | Iterable[int] = 8) -> None:
    """Check that saving after any batch and resuming in a new loader continues exactly.

    Runs ``make_loader()`` uninterrupted (it must be finite: ``epochs`` not None), then for
    each restore point k saves ``state_dict()`` after k batches, round-trips it through
    JSON, loads it into a fresh ``make_loader()`` and checks that the batches before plus
    the batches after equal the uninterrupted run, batch for batch.

    Args:
        make_loader: builds the same loader each time (threads/prefetch may differ).
        steps: how many restore points, spread evenly (int), or the exact points.

    Example:
        >>> assert_resumable(lambda: ds.loader(64, epochs=2, shuffle="global", seed=1))  # doctest: +SKIP
    """
    with make_loader() as reference_loader:
        reference = [dict(b) for b in reference_loader]
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
        with make_loader() as first:
            it = iter(first)
            before = [dict(next(it)) for _ in range(k)]
            state: Any = json.loads(json.dumps(first.state_dict()))
        with make_loader() as second:
            second.load_state_dict(state)
            after = [dict(b) for b in second]
        assert_same_batches(reference, before + after, context=f"resumed after {k} of {n} batches: ")
