"""How a loader spends its memory budget: a pure function of its options, the batch's geometry
and the machine, computed once per loader (no files, no threads).

The budget holds the batches in flight (`prefetch`), the buffers the pool recycles, the
compressed files kept decoded (stoker.engine.decoded) and the remote reads in flight
(stoker.io.fetch). Small batches are assembled several at a time (`parts`, see COALESCE_BYTES).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import SpecError
from ..io.fetch import parallel_reads
from ..machine import address_space_note
from .autotune import SPARE, default_prefetch
from .decoded import KEPT_DECODED_BYTES
from .executor import ALIGNMENT

__all__ = ["COALESCE_BYTES", "COALESCE_REMOTE_BYTES", "MAX_COALESCE", "Budget", "size"]

# Small batches are assembled several at a time, as one batch of about this many bytes whose
# parts are delivered one by one (views of it; see stoker.engine.pipeline): the per-batch work
# (planning, dispatch, buffers, file bookkeeping, a copy call per run and field) is paid once
# for all of them, and a file's records for all of them are copied in one call. The batches,
# their order and their contents are what they would be one at a time. That work is still a
# noticeable share of a 16 MiB batch's time (measured: benchmarks/results/w1_history.md).
COALESCE_BYTES = 64 << 20
MAX_COALESCE = 64
# With fields at URLs an assembly's first batch waits for every GET of the assembly; 16 MiB
# keeps pace with benchmarks/remote.py's plain loop where 64 MiB (half of the default
# read-ahead) falls behind it.
COALESCE_REMOTE_BYTES = 16 << 20


@dataclass(frozen=True)
class Budget:
    """A loader's memory, in bytes and batches.

    Attributes:
        memory_budget: the bytes the engine may hold.
        batch_bytes: one batch, every field as delivered.
        fits: batches the budget holds beside the decoded files kept (at most KEPT_DECODED_BYTES,
            an eighth of the budget): the default prefetch takes half of them, so the pool can
            recycle as many batches as are in flight.
        parts: batches assembled together (1 unless batches are small).
        prefetch: batches in flight at the start (autotune may change it later).
        kept_decoded_bytes: the compressed files kept decoded across passes.
        num_parallel_reads, part_bytes: remote ranged GETs in flight and the bytes of each.
        fetch_bytes: what those GETs hold (0 without remote fields).
    """

    memory_budget: int
    batch_bytes: int
    fits: int
    parts: int
    prefetch: int
    kept_decoded_bytes: int
    num_parallel_reads: int
    part_bytes: int
    fetch_bytes: int

    def spare(self, prefetch: int) -> int:
        """What `prefetch` batches in flight leave of the budget."""
        return self.memory_budget - prefetch * self.batch_bytes

    def pooled(self, prefetch: int) -> int:
        """What the buffer pool may keep for reuse: the rest, less the kept decoded files and remote reads."""
        return self.spare(prefetch) - self.kept_decoded_bytes - self.fetch_bytes


def size(
    *, batch_size: int, record_bytes: Mapping[str, int], memory_budget: int, given: object, prefetch: int | None,
    threads: int, max_threads: int, coalescable: bool, remote: bool, num_parallel_reads: int | None,
) -> Budget:  # fmt: skip
    """The budget of a loader.

    Args:
        record_bytes: bytes of one record of each field as delivered (after cast).
        memory_budget: the budget in bytes; `given` is what the user passed (None: the
            default, stoker.machine.default_memory_budget), named in errors.
        prefetch: the user's, checked against the budget; None: stoker's default
            (stoker.engine.autotune.default_prefetch), reserved for `max_threads` workers.
        threads: the workers the first pass starts with.
        coalescable: whether batches may be assembled together: only where a failed assembly
            can be done again batch by batch (thread workers, no transforms, no padding, no
            executor of the caller's) and the prefetch is stoker's (it counts in these units).
        remote: some field is at a URL: remote reads get half of what prefetch leaves.

    Raises SpecError where one batch, or the user's prefetch, exceeds the budget.

    Example:
        >>> b = size(batch_size=4, record_bytes={"x": 16}, memory_budget=1 << 20, given=None, prefetch=2,
        ...          threads=1, max_threads=1, coalescable=False, remote=False, num_parallel_reads=None)
        >>> b.batch_bytes, b.prefetch, b.parts
        (64, 2, 1)
    """
    batch_bytes = sum(batch_size * b for b in record_bytes.values())
    if batch_bytes > memory_budget:
        raise SpecError(
            f"memory_budget={given!r} ({memory_budget} bytes) holds less than one batch "
            f"({batch_bytes} bytes for batch_size={batch_size}); raise memory_budget or lower batch_size"
            + (address_space_note() if given is None else "")
        )
    fits = max(0, memory_budget - min(KEPT_DECODED_BYTES, memory_budget // 8)) // batch_bytes
    parts = 1
    if prefetch is None:
        if coalescable:
            parts = _coalesced(batch_size, record_bytes, batch_bytes, fits, threads, remote)
        prefetch = parts * default_prefetch(max_threads, parts * batch_bytes, fits // parts)
    elif prefetch > memory_budget // batch_bytes:
        raise SpecError(
            f"prefetch={prefetch} batches of {batch_bytes} bytes exceed memory_budget={given!r} "
            f"({memory_budget} bytes); at most {memory_budget // batch_bytes} fit"
        )
    spare = memory_budget - prefetch * batch_bytes
    kept_decoded = max(0, min(KEPT_DECODED_BYTES, spare // 8))
    # Remote ranged GETs are kept in flight whatever `threads`: half of what prefetch leaves.
    reads, part_bytes = parallel_reads(num_parallel_reads, spare // 2 if remote else 1 << 62)
    return Budget(
        memory_budget, batch_bytes, fits, parts, prefetch, kept_decoded, reads, part_bytes,
        reads * part_bytes if remote else 0,
    )  # fmt: skip


def _coalesced(
    batch_size: int, record_bytes: Mapping[str, int], batch_bytes: int, fits: int, threads: int, remote: bool
) -> int:
    """Batches assembled together: about COALESCE_BYTES of them, each part starting 64-byte
    aligned as a batch of its own does (TensorFlow takes only such memory without a copy), and
    no more than leave the budget room for the default look-ahead."""
    if any(batch_size * b % ALIGNMENT for b in record_bytes.values()):
        return 1
    target = COALESCE_REMOTE_BYTES if remote else COALESCE_BYTES
    parts = max(1, min(MAX_COALESCE, round(target / batch_bytes)))
    # The budget must hold twice a look-ahead of one assembly per starting worker plus the
    # consumer's spares (batches it takes per wake-up: an assembly holds `parts` of them).
    while parts > 1 and fits // parts < 2 * (threads + -(-SPARE // parts)):
        parts -= 1
    return parts
