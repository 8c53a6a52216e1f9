"""Turns on a compressed stream: runs read it in ticket order whatever order the workers arrive
in; a batch that fails stops the batches after it on that stream and not those before; one that
fails before its turn does not leave the rest waiting; the stream closes after its final run."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from stoker.engine.executor import StopFlag, Stopped
from stoker.engine.stats import Counters
from stoker.engine.turns import Stream, StreamTurns
from stoker.plan.batches import Run
from stoker.spec import Field

SPEC = Field("unused.gz", "uint8", (4,))
JOIN_S = 30.0  # a bound on each worker, never a timing: the turns finish in milliseconds


class _Reads:
    """Stands in for the stream reads (stoker.engine.inflating.StreamReads): records which run
    read when, and fails the runs it is told to."""

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        self.cast = {"f": False}
        self.order: list[int] = []
        self.fail = fail
        self.finished = 0

    def run(self, name: str, spec: Field, info: Any, run: Run, dst: np.ndarray, stream: Stream) -> None:
        if run.start in self.fail:
            raise OSError(f"run at record {run.start} failed")
        self.order.append(run.start)

    def finish(self, name: str, spec: Field, info: Any, run: Run, stream: Stream) -> None:
        self.finished += 1


class _Whole:
    def whole_able(self, spec: Field, group: int) -> bool:
        return False  # every stream read front to back, in turns


class _Catalog:
    def __init__(self) -> None:
        self.fields = {"f": SPEC}


def _turns(reads: _Reads) -> StreamTurns:
    return StreamTurns(_Catalog(), reads, _Whole(), counters=Counters(), stop=StopFlag())  # type: ignore[arg-type]


def _run_all(turns: StreamTurns, runs: list[Run], arrive: list[int]) -> dict[int, BaseException | None]:
    """Tickets for `runs` in plan order, then one worker per run, started in `arrive` order."""
    tickets = [turns.ticket(0, 0, "f", r.final) for r in runs]
    outcome: dict[int, BaseException | None] = {}

    def work(k: int) -> None:
        stream, ticket = tickets[k]
        try:
            turns.read(0, "f", SPEC, None, runs[k], np.empty((runs[k].count, 4), np.uint8), stream, ticket)
            outcome[k] = None
        except BaseException as e:
            outcome[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in arrive]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a worker still waits for its turn"
    return outcome


def _runs(n: int) -> list[Run]:
    return [Run(group=0, start=10 * k, count=10, row=0, final=k == n - 1) for k in range(n)]


def test_runs_read_the_stream_in_ticket_order_whatever_order_workers_arrive() -> None:
    reads = _Reads()
    turns = _turns(reads)
    outcome = _run_all(turns, _runs(5), arrive=[4, 2, 3, 0, 1])
    assert reads.order == [0, 10, 20, 30, 40]
    assert all(e is None for e in outcome.values())
    assert reads.finished == 1 and turns._streams == {}  # closed after the group's final run


def test_a_failed_run_stops_the_runs_after_it_and_not_those_before() -> None:
    reads = _Reads(fail={20})
    outcome = _run_all(_turns(reads), _runs(5), arrive=[4, 3, 2, 1, 0])
    assert reads.order == [0, 10]
    assert outcome[0] is None and outcome[1] is None
    assert isinstance(outcome[2], OSError) and "record 20" in str(outcome[2])
    assert isinstance(outcome[3], Stopped) and isinstance(outcome[4], Stopped)


def test_a_batch_that_fails_before_its_turn_leaves_no_one_waiting() -> None:
    reads = _Reads()
    turns = _turns(reads)
    runs = _runs(3)
    tickets = [turns.ticket(0, 0, "f", r.final) for r in runs]
    stream, ticket = tickets[1]
    stream.abandon(ticket)  # its batch failed on another field first
    first, t0 = tickets[0]
    turns.read(0, "f", SPEC, None, runs[0], np.empty((10, 4), np.uint8), first, t0)  # type: ignore[arg-type]
    last, t2 = tickets[2]
    with pytest.raises(Stopped):  # comes after the failed batch: never delivered
        turns.read(0, "f", SPEC, None, runs[2], np.empty((10, 4), np.uint8), last, t2)  # type: ignore[arg-type]
    assert reads.order == [0]


def test_a_stopped_pass_wakes_a_worker_waiting_for_its_turn() -> None:
    turns = _turns(_Reads())
    runs = _runs(2)
    tickets = [turns.ticket(0, 0, "f", r.final) for r in runs]
    caught: list[BaseException] = []

    def second() -> None:
        stream, ticket = tickets[1]
        try:
            turns.read(0, "f", SPEC, None, runs[1], np.empty((10, 4), np.uint8), stream, ticket)  # type: ignore[arg-type]
        except BaseException as e:
            caught.append(e)

    t = threading.Thread(target=second)
    t.start()
    turns.stop.set()  # ticket 0 never comes
    t.join(JOIN_S)
    assert not t.is_alive() and len(caught) == 1 and isinstance(caught[0], Stopped)
    turns.close()
