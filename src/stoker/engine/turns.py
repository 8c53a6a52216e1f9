"""Turns on compressed streams: one stream per (epoch, group, field), read front to back exactly
once, batches taking their turn on it by tickets handed out in plan order."""

from __future__ import annotations

import threading
import time

import numpy as np

from ..io.files import Catalog, FileInfo
from ..kernels import cast_into
from ..plan.batches import Run
from ..spec import Field
from .decoded import Whole, WholeFiles
from .executor import StopFlag, Stopped, flush_wake
from .inflating import Cursor, StreamReads
from .stats import Counters

__all__ = ["Stream", "StreamTurns"]


class Stream(Cursor):
    """One compressed file being read front to back; batches take turns by ticket.

    A file small enough to be decoded whole (`unordered`) needs no turns: it is decoded
    once, by whichever batch gets there first, and each batch copies its own rows in any
    order. `serving` then counts the runs done, and the decoded records are dropped with
    the stream once the group's final run has been issued and every issued run is done.
    """

    __slots__ = ("abandoned", "cond", "failed_at", "final_issued", "issued", "lock", "serving", "unordered", "whole")

    def __init__(self, *, unordered: bool = False) -> None:
        super().__init__()
        # `lock` alone where nobody waits (tickets, an unordered stream's count): a plain
        # lock's `with` runs in C, a Condition's in Python, on every run of every batch.
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.issued = 0  # tickets handed out (in plan order, by the dispatcher)
        self.serving = 0  # ticket whose turn it is (unordered: runs done)
        self.unordered = unordered
        self.final_issued = False  # the group's final run has a ticket: no more will come
        self.whole: Whole | None = None
        # The first ticket whose batch failed: batches after it are never delivered, batches
        # before it still are (a later batch can fail first, before its turn comes).
        self.failed_at: int | None = None
        self.abandoned: set[int] = set()  # tickets of failed batches, skipped when their turn comes

    def advance(self) -> None:
        """End the current turn (caller holds `cond`), skipping abandoned tickets."""
        self.serving += 1
        while self.serving in self.abandoned:
            self.abandoned.discard(self.serving)
            self.serving += 1
        self.cond.notify_all()

    def fail(self, ticket: int) -> None:
        if self.failed_at is None or ticket < self.failed_at:
            self.failed_at = ticket

    def failed_before(self, ticket: int) -> bool:
        """True when a batch planned before `ticket`'s (or its own) failed on this stream."""
        return self.failed_at is not None and self.failed_at <= ticket

    def abandon(self, ticket: int) -> None:
        """A batch failed before its turn: later batches must not wait for it forever."""
        with self.cond:
            self.fail(ticket)
            if self.unordered:
                self.serving += 1
            elif ticket == self.serving:
                self.advance()
            elif ticket > self.serving:
                self.abandoned.add(ticket)


class StreamTurns:
    """The pass's compressed streams: tickets handed out by the dispatcher, runs read by workers
    in ticket order (or, for a file decoded whole, in any order), streams closed after their
    group's final run."""

    def __init__(
        self, catalog: Catalog, reads: StreamReads, whole: WholeFiles, *, counters: Counters, stop: StopFlag
    ) -> None:
        self.catalog = catalog
        self.fields = dict(catalog.fields)
        self.reads = reads
        self.whole = whole
        self.counters = counters
        self.stop = stop
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, int, str], Stream] = {}
        self._epoch = -1

    def begin(self, epoch: int) -> None:
        """A batch of `epoch` is being dispatched: streams of earlier ones nobody waits on close."""
        if epoch != self._epoch:
            self._epoch = epoch
            self._retire(epoch)

    def ticket(self, epoch: int, group: int, name: str, final: bool) -> tuple[Stream, int]:
        """The next turn on field `name`'s stream of `group` in `epoch` (by the dispatcher, in plan order)."""
        key = (epoch, group, name)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = Stream(unordered=self.whole.whole_able(self.fields[name], group))
        with stream.lock:
            ticket = stream.issued
            stream.issued += 1
            stream.final_issued = stream.final_issued or final
        return stream, ticket

    def read(
        self, epoch: int, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray, stream: Stream,
        ticket: int,
    ) -> None:  # fmt: skip
        """Run `run` of the stream into `dst`, once its ticket's turn has come."""
        flush_wake()  # see stoker.engine: streams wait for turns, read files and inflate
        if stream.unordered:
            self._read_whole(epoch, name, spec, info, run, dst, stream)
            return
        t = time.perf_counter()
        with stream.cond:
            while stream.serving != ticket:
                self.stop.check()
                stream.cond.wait(0.1)
        self.counters.add("turn", name, time.perf_counter() - t)
        try:
            if stream.failed_before(ticket):
                # An earlier batch failed on this stream and is raised first; this batch comes
                # after it, so it is never delivered: just stop.
                raise Stopped
            try:
                self.reads.run(name, spec, info, run, dst, stream)
            except BaseException:
                stream.fail(ticket)
                raise
            if run.final:
                self.reads.finish(name, spec, info, run, stream)
        finally:
            with stream.cond:
                stream.advance()
            if run.final or stream.failed_before(ticket):
                self._drop(epoch, run.group, name, stream, ticket)

    def _retire(self, epoch: int) -> None:
        """Close streams of earlier epochs that no batch still waits on (trimmed tails)."""
        with self._lock:
            old = [(k, s) for k, s in self._streams.items() if k[0] < epoch and s.serving >= s.issued]
            for k, _ in old:
                del self._streams[k]
        for _, stream in old:
            stream.close()

    def _drop(self, epoch: int, group: int, name: str, stream: Stream, ticket: int) -> None:
        # Only the thread that takes the stream out of the table closes it: the dispatcher
        # may be retiring the same stream at an epoch boundary.
        with self._lock:
            mine = self._streams.get((epoch, group, name)) is stream and (
                stream.serving >= stream.issued or stream.failed_before(ticket)
            )
            if mine:
                del self._streams[(epoch, group, name)]
        if mine:
            stream.close()

    def _read_whole(
        self, epoch: int, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray, stream: Stream
    ) -> None:
        """Serve a run from the file decoded and verified whole, in any order of batches."""
        try:
            whole = stream.whole  # set once, never reset: no lock needed to see it set
            if whole is None:
                with stream.lock:  # the first run to get here decodes; the others wait for it
                    if stream.whole is None:
                        stream.whole = self.whole.decoded(name, spec, info, run.group)
                    whole = stream.whole
            arr, valid, err, final_err = whole
            if run.count:
                if run.stop > valid:
                    assert err is not None
                    raise err
                t = time.perf_counter()
                cast_into(dst, arr[run.start : run.stop : run.step])
                self.counters.add("cast" if self.reads.cast[name] else "copy", name, time.perf_counter() - t)
            if run.final and final_err is not None:
                raise final_err
        finally:
            with stream.lock:
                stream.serving += 1
                last = stream.final_issued and stream.serving >= stream.issued
            if last:
                with self._lock:
                    if self._streams.get((epoch, run.group, name)) is stream:
                        del self._streams[(epoch, run.group, name)]

    def close(self) -> None:
        """Close every stream; idempotent."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for s in streams:
            s.close()
            s.inflater = None
