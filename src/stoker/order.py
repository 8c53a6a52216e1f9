"""The public path of `stoker.plan.order` (`stoker.order.shard_from_rank` and the rest of its names)."""

from .plan.order import (
    MAX_RECORDS,
    Permutation,
    diff_fingerprint_parts,
    even_length,
    fingerprint,
    index_permutation,
    permute_groups,
    resume_position,
    shard_from_rank,
    shard_length,
    shard_positions,
    validate_shard,
    window_shuffle,
)

__all__ = [
    "MAX_RECORDS",
    "Permutation",
    "validate_shard",
    "diff_fingerprint_parts",
    "even_length",
    "fingerprint",
    "index_permutation",
    "permute_groups",
    "resume_position",
    "shard_from_rank",
    "shard_length",
    "shard_positions",
    "window_shuffle",
]
