"""A loader's saved state: what it says (`state_at`), and whether this loader can go on from it (`check`).

A state names `(epoch, position)`, position counting records of the epoch's global sequence,
and a fingerprint of what fixes that sequence (the dataset's counts, fields and file names, the
shuffle, seed, window, interleave and drop_remainder); batch_size and shard may change on
resume (elastic), since the position counts records whoever takes them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import StateError
from .plan.order import fingerprint

if TYPE_CHECKING:
    from .config import LoaderConfig
    from .dataset import Dataset

__all__ = ["STATE_VERSION", "Resume"]

STATE_VERSION = 1


def _is_int(value: object, *, least: int = 0) -> bool:
    """An integer (not a bool, which Python counts as one) of at least `least`."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= least)


def _is_shard(value: object) -> bool:
    return (
        isinstance(value, list | tuple) and len(value) == 2 and all(_is_int(v) for v in value)
        and 0 <= value[0] < value[1]
    )  # fmt: skip


def _is_digests(value: object) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


class Resume:
    """The states of a loader over `dataset` with `config`, its interleave `(cycle_length, block_length)`.

    The fingerprint is computed once, when first asked for: it settles every group's count.
    """

    def __init__(self, dataset: Dataset, config: LoaderConfig, interleave: tuple[int, int]) -> None:
        self.dataset, self.config, self.interleave = dataset, config, interleave

    @functools.cached_property
    def parts(self) -> dict[str, object]:
        """What the fingerprint covers, by part (a state names the parts it differs in)."""
        ds, config = self.dataset, self.config
        parts: dict[str, object] = {
            "counts": [ds.records_in(g) for g in range(ds.num_groups)],
            "fields": {n: [f.dtype.str, list(f.shape), f.header_bytes, f.footer_bytes] for n, f in ds.fields.items()},
            "basenames": [[os.path.basename(i.path) for i in infos.values()] for infos in ds.files],
            "shuffle": config.shuffle,
            "seed": config.seed,
            "window": config.window if config.shuffle == "files" else None,
            "drop_remainder": config.drop_remainder,
            "interleave": list(self.interleave),
            # Not batch_size, shard or even: they may change on resume (elastic).
        }
        subset = ds.subset_key()
        if subset is not None:  # which groups and records of the files a subset holds
            parts["subset"] = subset
        return parts

    @functools.cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.parts)

    @functools.cached_property
    def digests(self) -> dict[str, str]:
        return {k: fingerprint({k: v}) for k, v in self.parts.items()}

    def state_at(self, where: tuple[int, int]) -> dict[str, Any]:
        """The state of a loader standing at `(epoch, position)` (small, JSON-serializable)."""
        epoch, position = where
        config = self.config
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "seed": config.seed,
            "batch_size": config.batch_size,
            "shard": list(config.shard),
            "fingerprint": self.fingerprint,
            "parts": dict(self.digests),
        }

    def check(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """`(epoch, position)` of a state this loader can resume from, or a StateError saying why not.

        Types are exact (`True` is not a position) and ranges checked, so a crafted or
        damaged state is an error here rather than a short or empty run.
        """
        ds, config = self.dataset, self.config
        first = ds.files[0][next(iter(ds.fields))].path if ds.files else None
        if not isinstance(state, Mapping) or not _is_int(state.get("version")) or state["version"] != STATE_VERSION:
            raise StateError(
                f"not a stoker loader state (version {STATE_VERSION} expected): {state!r:.200}", path=first
            )

        # Every count and position of a state below 2**63: what int64 arrays, and the
        # frameworks that carry a state as tensors, hold.
        def small(key: str, least: int = 0) -> bool:
            return _is_int(state.get(key), least=least) and state[key] < 1 << 63

        shard: Any = state.get("shard")
        for key, ok, what in (
            ("fingerprint", isinstance(state.get("fingerprint"), str), "a string"),
            ("parts", _is_digests(state.get("parts")), "a mapping of part names to digests"),
            ("epoch", small("epoch"), "a non-negative integer below 2**63"),
            ("position", small("position"), "a non-negative integer below 2**63"),
            ("seed", state.get("seed") is None or _is_int(state["seed"]), "a non-negative integer or None"),
            ("batch_size", small("batch_size", 1), "a positive integer below 2**63"),
            ("shard", _is_shard(shard) and shard[1] < 1 << 63, "[index, count] with 0 <= index < count < 2**63"),
        ):
            if not ok:
                raise StateError(f"state has {key}={state.get(key)!r:.200}; it must be {what}", path=first)
        if state["fingerprint"] != self.fingerprint:
            saved = state["parts"]
            differ = [k for k, v in self.digests.items() if saved.get(k) != v]
            raise StateError(
                f"the saved state belongs to a different dataset or loader configuration; differs in: "
                f"{', '.join(differ) or 'unknown parts'} (dataset's first file {first!r})",
                path=first,
            )
        if state["seed"] != config.seed:  # the fingerprint holds this loader's seed, not the state's
            raise StateError(
                f"state has seed={state['seed']!r:.200}, this loader's seed is {config.seed!r} (dataset's first file "
                f"{first!r})",
                path=first,
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if not config.reshuffle_each_iteration and config.epochs is not None and epoch >= config.epochs:
            raise StateError(
                f"state has epoch={epoch}, past this loader's epochs={config.epochs} (with reshuffle_each_iteration"
                "=False every pass covers epochs 0 .. epochs-1)",
                path=first,
            )
        # A shard's last batch may leave its position up to count - 1 past the epoch's end
        # (its next position is beyond it); that and the end itself mean the epoch is done.
        total = len(ds)  # counts settled by the fingerprint already
        count = int(state["shard"][1])
        # More shards than records leave a shard nothing to read; a larger count would let a
        # state's position run past the epoch's end by as much, and end the epoch early.
        if count > max(total, config.shard[1]):
            raise StateError(
                f"state has shard={list(state['shard'])}: {count} shards of an epoch of {total} records (and this "
                f"loader's shard={list(config.shard)}); a state's shard count is at most the record count, or this "
                f"loader's own (dataset's first file {first!r})",
                path=first,
            )
        if position > total + count - 1:
            raise StateError(
                f"state has position={position}, past the end of epoch {epoch} ({total} records, "
                f"saved by shard {list(state['shard'])})",
                path=first,
            )
        return epoch, min(position, total)
