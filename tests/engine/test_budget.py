"""The memory budget as a pure function: batch bytes, parts assembled together, prefetch, and
what the kept decoded files, the remote reads and the pool get, without files or threads."""

from __future__ import annotations

import pytest

from stoker.engine import budget as budget_module
from stoker.engine.autotune import default_prefetch
from stoker.engine.budget import COALESCE_BYTES, MAX_COALESCE, size
from stoker.engine.decoded import KEPT_DECODED_BYTES
from stoker.errors import SpecError
from stoker.io.fetch import DEFAULT_PARALLEL_READS

MiB = 1 << 20
# W1 (benchmarks/w1.py): 128x128 images cast to float32 (64 KiB a record) and float32 labels.
W1_FLOAT32 = {"image": 128 * 128 * 4, "label": 4}


def _size(**kw: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = dict(
        batch_size=256, record_bytes=W1_FLOAT32, memory_budget=2048 * MiB, given=None, prefetch=None,
        threads=2, max_threads=4, coalescable=True, remote=False, num_parallel_reads=None,
    )  # fmt: skip
    args.update(kw)
    return size(**args)  # type: ignore[arg-type]


def test_a_batch_is_its_records_bytes_over_every_field() -> None:
    b = _size(coalescable=False, prefetch=3)
    assert b.batch_bytes == 256 * (128 * 128 * 4 + 4)
    assert b.parts == 1 and b.prefetch == 3


def test_small_batches_are_assembled_about_coalesce_bytes_at_a_time() -> None:
    b = _size(batch_size=64, record_bytes={"x": 4096})  # 256 KiB batches, 64-byte aligned
    assert b.parts == min(MAX_COALESCE, round(COALESCE_BYTES / b.batch_bytes)) > 1
    assert b.prefetch % b.parts == 0  # counted in assemblies
    assert b.prefetch == b.parts * default_prefetch(4, b.parts * b.batch_bytes, b.fits // b.parts)


def test_batches_that_would_start_unaligned_or_that_cannot_be_redone_go_one_at_a_time() -> None:
    assert _size(batch_size=3, record_bytes={"x": 4}).parts == 1  # 12 bytes: not a multiple of 64
    assert _size(batch_size=64, record_bytes={"x": 4096}, coalescable=False).parts == 1
    assert _size(batch_size=64, record_bytes={"x": 4096}, prefetch=4).parts == 1  # the user's prefetch


def test_a_tight_budget_assembles_fewer_together_so_every_worker_has_a_look_ahead() -> None:
    roomy = _size(batch_size=64, record_bytes={"x": 4096})
    tight = _size(batch_size=64, record_bytes={"x": 4096}, memory_budget=16 * MiB)
    assert 1 <= tight.parts < roomy.parts


def test_kept_decoded_files_get_an_eighth_of_what_prefetch_leaves_at_most_kept_decoded_bytes() -> None:
    b = _size(prefetch=2, coalescable=False)
    assert b.kept_decoded_bytes == min(KEPT_DECODED_BYTES, b.spare(2) // 8)
    small = _size(prefetch=2, coalescable=False, memory_budget=3 * b.batch_bytes)
    assert small.kept_decoded_bytes == b.batch_bytes // 8


def test_the_pool_keeps_what_is_left_after_prefetch_decoded_files_and_remote_reads() -> None:
    local = _size(prefetch=4, coalescable=False)
    assert local.fetch_bytes == 0 and local.num_parallel_reads == DEFAULT_PARALLEL_READS
    assert local.pooled(4) == local.memory_budget - 4 * local.batch_bytes - local.kept_decoded_bytes
    remote = _size(prefetch=4, coalescable=False, remote=True)
    assert remote.fetch_bytes == remote.num_parallel_reads * remote.part_bytes > 0
    assert remote.fetch_bytes <= remote.spare(4) // 2  # remote reads get half of what prefetch leaves
    assert remote.pooled(4) == local.pooled(4) - remote.fetch_bytes
    assert remote.pooled(2) - remote.pooled(4) == 2 * remote.batch_bytes  # autotune's later prefetch


def test_a_budget_below_one_batch_or_the_users_prefetch_is_an_error_naming_both() -> None:
    with pytest.raises(SpecError, match=r"memory_budget='1MiB' \(1048576 bytes\) holds less than one batch"):
        _size(memory_budget=MiB, given="1MiB")
    batch = 256 * (128 * 128 * 4 + 4)
    with pytest.raises(SpecError, match=rf"prefetch=5 batches of {batch} bytes exceed .* at most 4 fit"):
        _size(memory_budget=4 * batch, given=4 * batch, prefetch=5)


def test_the_default_budget_named_in_an_error_says_why_it_is_what_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget_module, "address_space_note", lambda: " (a note on ulimit -v)")
    with pytest.raises(SpecError, match=r"memory_budget=None .* lower batch_size \(a note on ulimit -v\)"):
        _size(memory_budget=MiB, given=None)
    with pytest.raises(SpecError, match=r"lower batch_size$"):
        _size(memory_budget=MiB, given=MiB)


def test_the_same_inputs_give_the_same_budget() -> None:
    assert _size() == _size()
