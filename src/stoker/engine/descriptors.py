"""How many files and memory maps a loader may keep: a share of the process's descriptor and
mapping limits, which a global shuffle may raise."""

from __future__ import annotations

from ..kernels import maps_hold_descriptors
from ..machine import descriptor_limits, max_map_count, set_soft_descriptor_limit

__all__ = ["keep_open", "max_kept_maps", "max_open_files", "pass_open_files", "raise_open_files"]

# Open raw files kept across runs; a group's files close after its last run, this bounds
# what early breaks and dropped remainders leave open. At least this many, and as many as the
# descriptor limit allows (max_open_files, at most _MAX_OPEN_FILES): a global shuffle's batch
# reads from most of the dataset's files, and with 64 open the 415 files of W1-big (a dataset
# larger than RAM, benchmarks/w1_big.py) are opened, mapped and unmapped again batch after batch
# (see raise_open_files).
_MAX_OPEN = 64
_MAX_OPEN_FILES = 1024
# Kept maps where they hold no descriptor (max_kept_maps): at most this many, and a quarter of
# the process's memory mappings (vm.max_map_count, 65530 by default; TensorFlow, PyTorch and
# JAX imported together hold ~1,600).
_MAX_KEPT_MAPS = 16384


def max_open_files() -> int:
    """Descriptors a loader may keep open for maps or files: a quarter of the soft descriptor
    limit, at most _MAX_OPEN_FILES."""
    return max(0, min(_MAX_OPEN_FILES, descriptor_limits()[0] // 4))


def pass_open_files() -> int:
    """Raw files a pass keeps open at most (see _MAX_OPEN): never more than half the soft
    descriptor limit (under a limit of 64, 64 open files left the process no descriptor)."""
    return max(min(_MAX_OPEN, descriptor_limits()[0] // 2), max_open_files())


def raise_open_files(wanted: int) -> tuple[int, int] | None:
    """Raise the soft descriptor limit, within the hard one, until `max_open_files()` covers
    `wanted` files (at most _MAX_OPEN_FILES); (old soft limit, new) where it was raised.

    A global shuffle's batch reads from most of the dataset's files, and a pass keeps at most
    `max_open_files()` of them open: under the usual soft limit of 1024, 256 of W1-big's 415 (benchmarks/w1_big.py),
    so every batch opened, mapped and unmapped again the files that had been closed (measured:
    benchmarks/results/w1_big_history.md). The soft limit is there for programs that use `select()`, which
    cannot watch a descriptor numbered 1024 or more; only the files stoker opens beyond that
    get such numbers, and a quarter of the limit is still all a pass keeps.
    """
    wanted = min(wanted, _MAX_OPEN_FILES)
    soft, hard = descriptor_limits()
    new = min(hard, 4 * wanted)
    if soft // 4 >= wanted or new <= soft or not set_soft_descriptor_limit(new):
        return None
    return soft, new


def max_kept_maps() -> int:
    """Memory maps kept for later epochs (KeptMaps).

    A map made by `mmap.mmap` (no compiled kernels) holds a descriptor: as many as
    `max_open_files`. The kernels' `FileMap` holds none, so the descriptor limit does not
    bound it (1024 by default on most Linux systems, so 256 maps, too few for a dataset of
    many small files, whose maps would be made again on every visit); it is
    still one of the process's limited memory mappings, a quarter of which are kept at most.
    """
    if maps_hold_descriptors():
        return max_open_files()
    return max(0, min(_MAX_KEPT_MAPS, max_map_count() // 4))


def keep_open(wanted: int) -> str:
    """Raise the soft descriptor limit so a pass keeps `wanted` raw files open at once (a global
    shuffle reads from most of them in every batch); what was done, or why not, in a few words
    for stats' `tuning` ("" where nothing needed doing)."""
    raised, kept = raise_open_files(wanted), pass_open_files()
    if raised is not None:
        return f"descriptor soft limit raised from {raised[0]} to {raised[1]} to keep {wanted} open"
    if kept < wanted:
        return (
            f"{kept} of {wanted} open at once, the others reopened as batches need them "
            "(at most a quarter of the descriptor limit, and 1024)"
        )
    return ""
