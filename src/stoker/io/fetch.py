"""Ranged GETs of files behind URLs, kept in flight ahead of the workers that copy them.

A loader's pass looks ahead along its plan (pure arithmetic: which records of which file come
next) and asks here, in plan order, for the byte ranges its next batches will read from remote
files: each raw run, each gather's coalesced stretches, the head of each compressed stream. At
most `depth` requests (the loader's `num_parallel_reads`) are in flight at once, whatever the
number of worker threads, and the look-ahead stops asking while the bytes asked for and not yet
copied reach `ahead_bytes` (a share of the loader's `memory_budget`). A worker takes the
bytes of its range when it reaches it, waiting if they have not arrived; a range nobody asked
for ahead (a batch assembled again after an error, a stream that jumped) is fetched then,
before anything queued ahead. A compressed stream keeps its next parts asked for while it inflates.

Requests go through stoker.io.remote (one retry layer): a part arrives whole, or its error, which
names the field, URL and byte offset, is raised in the worker that takes it. Every part is read
of the object's version the Dataset was built on (`remote.Version`): one changed mid-pass, its
first part read since is a CorruptDataError, and none of its new bytes reaches a batch or a
stream's inflater. Every range is
taken by the read it was asked for, or by an identical one (the same bytes of the same file),
so what a batch holds never depends on timing.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import ReadError, SpecError
from . import remote

__all__ = [
    "DEFAULT_PARALLEL_READS", "MIN_PART_BYTES", "STREAM_AHEAD", "Fetcher", "RemoteStream", "parallel_reads",
]  # fmt: skip

# GETs in flight by default: an object store's throughput comes from concurrent requests, each
# paying the round trip; 16 of up to 8 MiB cover ~50 ms of latency at a few GB/s (measured:
# benchmarks/results/remote.md).
DEFAULT_PARALLEL_READS = 16
# The smallest part a tight memory budget may cut requests into (a request costs more than this).
MIN_PART_BYTES = 256 << 10
# Parts a compressed stream keeps asked for beyond the one it inflates: it is read front to
# back, so its next bytes are known; a few parts hide a round trip behind the inflate.
STREAM_AHEAD = 3
# How often a worker waiting for a part looks at its stop check.
_WAIT_SECONDS = 0.1

_QUEUED, _SENT, _ARRIVED = 0, 1, 2


class _Part:
    """One ranged GET: bytes `start..end` of `url`."""

    __slots__ = ("ahead", "arrived", "client", "data", "dropped", "end", "error", "field", "future", "generation",
                 "path", "size", "start", "state", "url", "version")  # fmt: skip

    def __init__(self, client: remote.Client, url: str, path: str, start: int, end: int, size: int,
                 field: str | None, *, ahead: bool, version: remote.Version | None,
                 generation: int = 0) -> None:  # fmt: skip
        self.client, self.url, self.path, self.field = client, url, path, field
        self.generation = generation  # the pass it was asked ahead for (see Fetcher.next_generation)
        self.future: Any = None  # the request, once sent (cancelled by close())
        self.version = version
        self.start, self.end, self.size = start, end, size
        self.ahead = ahead  # counted in the fetcher's ahead bytes until let go
        self.state = _QUEUED
        self.dropped = False  # nobody will take it (the reader stopped, the fetcher closed)
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.arrived = threading.Event()


class Fetcher:
    """The ranged GETs of one pass: at most `depth` in flight, ahead of the workers.

    Args:
        depth: requests in flight at most (the loader's `num_parallel_reads`).
        ahead_bytes: bytes asked for ahead and not yet copied, at most (the look-ahead stops
            there; a range a worker waits for is fetched whatever this says).
        part_bytes: bytes per request at most.
    """

    def __init__(
        self, depth: int = DEFAULT_PARALLEL_READS, *, ahead_bytes: int | None = None, part_bytes: int | None = None
    ) -> None:
        self.depth = depth
        self.part_bytes = part_bytes or remote.PART_BYTES
        self.ahead_bytes = ahead_bytes if ahead_bytes is not None else depth * self.part_bytes
        self._lock = threading.Lock()
        self._queue: collections.deque[_Part] = collections.deque()  # asked ahead, plan order
        self._urgent: collections.deque[_Part] = collections.deque()  # a worker waits: sent first
        self._in_flight = 0
        self._flying: set[_Part] = set()  # sent, not landed: close() cancels them
        self._ahead = 0  # bytes of parts asked ahead and not yet let go
        # Ranges asked ahead, by (url, start, end), oldest first; a stream's head by (url, start, -1).
        self._wanted: dict[tuple[str, int, int], collections.deque[list[_Part]]] = {}
        self._closed = False
        self.generation = 0  # parts asked ahead from now on are for this pass (see next_generation)
        self.sent = 0  # requests made (for stats and tests)
        self.most_in_flight = 0  # the most requests in flight at once (for tests)

    # -- asking ahead (the pass's look-ahead, in plan order) --------------------------------
    def room(self) -> bool:
        """Whether the look-ahead may ask for more."""
        return self._ahead < self.ahead_bytes

    def want(self, url: str, options: Mapping[str, Any] | None, start: int, end: int, *, size: int,
             field: str | None, version: remote.Version | None = None) -> None:  # fmt: skip
        """Bytes `start..end` of `url` (at `version`) will be read (`read_into`/`read_records`): fetch them ahead."""
        if end > start:
            self._ask(url, options, start, end, size, field, version, key=(url, start, end))

    def want_stream(self, url: str, options: Mapping[str, Any] | None, *, size: int, field: str | None,
                    version: remote.Version | None = None) -> None:  # fmt: skip
        """A stream of `url` will be opened at its start (`stream`): fetch its first parts ahead."""
        end = min(size, (1 + STREAM_AHEAD) * self.part_bytes)
        if end > 0:
            self._ask(url, options, 0, end, size, field, version, key=(url, 0, -1))

    def _ask(self, url: str, options: Mapping[str, Any] | None, start: int, end: int, size: int, field: str | None,
             version: remote.Version | None, *, key: tuple[str, int, int]) -> None:  # fmt: skip
        c, path = remote.client(url, options, connections=max(remote.CONNECTIONS, self.depth))
        parts = [
            _Part(c, url, path, a, min(a + self.part_bytes, end), size, field, ahead=True, version=version,
                  generation=self.generation)
            for a in range(start, end, self.part_bytes)
        ]  # fmt: skip
        with self._lock:
            if self._closed:
                return
            self._wanted.setdefault(key, collections.deque()).append(parts)
            self._queue.extend(parts)
            self._ahead += end - start
            send = self._next_sends()
        self._send(send)

    # -- taking (workers) -------------------------------------------------------------------
    def read_into(self, url: str, options: Mapping[str, Any] | None, offset: int, dst: memoryview, *, size: int,
                  field: str | None, check: Callable[[], None],
                  version: remote.Version | None = None) -> int:  # fmt: skip
        """Fill `dst` with the bytes of `url` (at `version`) from `offset`: the parts asked ahead
        for this range, or fetched now. Returns the bytes read: short only where the object (of
        `size` bytes) ends first. `check` is called while waiting (it raises to stop the wait)."""
        n = max(0, min(len(dst), size - offset))
        if n:
            parts = self._take(url, options, offset, offset + n, size, field, version)
            try:
                for part in parts:
                    dst[part.start - offset : part.end - offset] = self._wait(part, check)
            finally:
                self._let_go(parts)
        return n

    def read_records(self, url: str, options: Mapping[str, Any] | None, base: int, record_bytes: int,
                     index: np.ndarray, *, size: int, field: str | None, check: Callable[[], None],
                     version: remote.Version | None = None) -> np.ndarray:  # fmt: skip
        """Records `index` (sorted, distinct) of the file (at `version`) as `(len(index), record_bytes)`
        uint8, from the ranges of `stoker.io.remote.pieces` (asked ahead, or fetched now)."""
        ranges = remote.pieces(index, record_bytes, base, self.part_bytes)
        if ranges and ranges[-1][1] > size:
            raise remote.too_short(url, size, index, ranges[-1][1], field=field)
        taken = [self._take(url, options, a, b, size, field, version) for a, b in ranges]
        try:
            datas = [b"".join(self._wait(p, check) for p in parts) for parts in taken]
        finally:
            for parts in taken:
                self._let_go(parts)
        return remote.place(ranges, datas, index, record_bytes, base)

    def stream(self, url: str, options: Mapping[str, Any] | None, offset: int, *, size: int, field: str | None,
               check: Callable[[], None], version: remote.Version | None = None) -> RemoteStream:  # fmt: skip
        """A sequential reader of `url` (at `version`) from `offset` for the inflater (its head
        taken if asked ahead)."""
        with self._lock:
            head = self._pop_wanted((url, offset, -1))
        c, path = remote.client(url, options, connections=max(remote.CONNECTIONS, self.depth))
        return RemoteStream(self, c, url, path, offset, size=size, field=field, check=check, head=head or [],
                            version=version)  # fmt: skip

    def _take(self, url: str, options: Mapping[str, Any] | None, start: int, end: int, size: int,
              field: str | None, version: remote.Version | None) -> list[_Part]:  # fmt: skip
        """The parts asked ahead for exactly `start..end` (oldest first), or new ones; either way
        sent before anything queued ahead."""
        with self._lock:
            parts = self._pop_wanted((url, start, end))
        if parts is None:
            c, path = remote.client(url, options, connections=max(remote.CONNECTIONS, self.depth))
            parts = [
                _Part(c, url, path, a, min(a + self.part_bytes, end), size, field, ahead=False, version=version)
                for a in range(start, end, self.part_bytes)
            ]
        self.hurry(parts)
        return parts

    def _pop_wanted(self, key: tuple[str, int, int]) -> list[_Part] | None:
        """The oldest parts asked ahead under `key` (caller holds the lock)."""
        found = self._wanted.get(key)
        if not found:
            return None
        parts = found.popleft()
        if not found:
            del self._wanted[key]
        return parts

    def hurry(self, parts: list[_Part]) -> None:
        """Send `parts` (those not sent yet) before anything asked ahead."""
        with self._lock:
            self._urgent.extend(p for p in parts if p.state == _QUEUED)
            send = self._next_sends()
        self._send(send)

    def _wait(self, part: _Part, check: Callable[[], None]) -> bytes:
        """`part`'s bytes once arrived; its error raised; `check()` between waits."""
        while not part.arrived.wait(_WAIT_SECONDS):
            check()
        if part.error is not None:
            raise part.error
        assert part.data is not None
        return part.data

    def _let_go(self, parts: list[_Part]) -> None:
        """The reader is done with `parts` (copied, or never to be): forget their bytes and
        give their room back (a part still in flight gives it back when it lands)."""
        with self._lock:
            for part in parts:
                part.dropped = True
                if part.state != _SENT:
                    self._forget(part)

    def _forget(self, part: _Part) -> None:
        """Give `part`'s room back (caller holds the lock; the part is not in flight)."""
        if part.ahead:
            part.ahead = False
            self._ahead -= part.end - part.start
        part.data = None
        if part.state == _QUEUED:  # never sent: a waiter must not wait for it
            part.state = _ARRIVED
            part.error = part.error or _closed_error(part)
            part.arrived.set()

    # -- sending (any thread; arrivals on the event loop's) ----------------------------------
    def _next_sends(self) -> list[_Part]:
        """Parts to send now, the most urgent first (caller holds the lock)."""
        send: list[_Part] = []
        while self._in_flight < self.depth and not self._closed:
            source = self._urgent if self._urgent else self._queue
            if not source:
                break
            part = source.popleft()
            if part.state != _QUEUED or part.dropped:
                continue
            part.state = _SENT
            self._in_flight += 1
            self._flying.add(part)
            send.append(part)
        self.sent += len(send)
        self.most_in_flight = max(self.most_in_flight, self._in_flight)
        return send

    def _send(self, parts: list[_Part]) -> None:
        for part in parts:
            coro = remote.get_range(part.client, part.url, part.path, part.start, part.end, size=part.size,
                                    field=part.field, version=part.version)  # fmt: skip
            future = part.client.submit(coro)
            with self._lock:
                part.future = future
                cancel = self._closed
            if cancel:  # closed while it was being sent: nobody will read it
                future.cancel()
            future.add_done_callback(functools.partial(self._arrived, part))

    def _arrived(self, part: _Part, future: Any) -> None:
        with self._lock:
            self._in_flight -= 1
            self._flying.discard(part)
            if future.cancelled():
                part.error = _closed_error(part)
            elif future.exception() is not None:
                part.error = future.exception()
            else:
                part.data = future.result()
            part.state = _ARRIVED
            if part.dropped:
                self._forget(part)
            send = self._next_sends()
        part.arrived.set()
        self._send(send)

    # -- passes (a loader's next pass asked for while this one ends) ------------------------
    def next_generation(self) -> int:
        """Parts asked ahead from now on are for the next pass; its number."""
        with self._lock:
            self.generation += 1
            return self.generation

    def drop_older(self, generation: int) -> None:
        """Let go of every part asked ahead for a pass before `generation` and not taken (the
        pass that asked for them ended, a pass after it goes on with this fetcher)."""
        with self._lock:
            for key in list(self._wanted):
                kept = collections.deque(parts for parts in self._wanted[key] if parts[0].generation >= generation)
                for parts in self._wanted[key]:
                    if parts[0].generation < generation:
                        for part in parts:
                            part.dropped = True
                            if part.state != _SENT:
                                self._forget(part)
                if kept:
                    self._wanted[key] = kept
                else:
                    del self._wanted[key]

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet landed."""
        return self._in_flight

    @property
    def ahead(self) -> int:
        """Bytes asked ahead and not yet let go (held, on their way, or queued)."""
        return self._ahead

    def close(self) -> None:
        """Drop everything asked for and cancel the requests in flight (their bytes, should they
        land first, are dropped unread). Idempotent."""
        with self._lock:
            self._closed = True
            wanted = [p for q in self._wanted.values() for parts in q for p in parts]
            self._wanted.clear()
            for part in (*wanted, *self._queue, *self._urgent, *self._flying):
                part.dropped = True
                if part.state != _SENT:
                    self._forget(part)
            sent = [part.future for part in self._flying if part.future is not None]
            self._queue.clear()
            self._urgent.clear()
        for future in sent:  # outside the lock: a cancelled future runs _arrived at once
            future.cancel()

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _closed_error(part: _Part) -> ReadError:
    return ReadError(
        f"field {part.field!r}: read of {part.url!r} at byte offset {part.start} was dropped: the loader closed",
        field=part.field, path=part.url, offset=part.start,
    )  # fmt: skip


class RemoteStream:
    """Sequential reads of one remote file for the inflater, its next parts asked for ahead."""

    def __init__(self, fetcher: Fetcher, client: remote.Client, url: str, path: str, offset: int, *, size: int,
                 field: str | None, check: Callable[[], None], head: list[_Part],
                 version: remote.Version | None = None) -> None:  # fmt: skip
        self._fetcher, self._client = fetcher, client
        self.url, self._path, self.size, self.field = url, path, size, field
        self.version = version
        self._check = check
        self._parts: collections.deque[_Part] = collections.deque(head)
        self._next = head[-1].end if head else offset  # where the next part asked for starts

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset` (empty at the end)."""
        if offset >= self.size:
            return b""
        parts = self._parts
        while parts and parts[0].end <= offset:  # read past: let go
            self._fetcher._let_go([parts.popleft()])
        if not parts or parts[0].start > offset:  # a jump: start again at `offset`
            self._fetcher._let_go(list(parts))
            parts.clear()
            self._next = offset
        self._ask_ahead()
        head = parts[0]
        if head.state == _QUEUED:
            self._fetcher.hurry([head])
        data = self._fetcher._wait(head, self._check)
        at = offset - head.start
        return data[at : at + n]

    def _ask_ahead(self) -> None:
        """The part at hand (always) and up to STREAM_AHEAD more while the fetcher has room."""
        f = self._fetcher
        fresh: list[_Part] = []
        while self._next < self.size and (not self._parts or (len(self._parts) <= STREAM_AHEAD and f.room())):
            end = min(self.size, self._next + f.part_bytes)
            part = _Part(self._client, self.url, self._path, self._next, end, self.size, self.field,
                         ahead=bool(self._parts), version=self.version)  # fmt: skip
            self._parts.append(part)
            fresh.append(part)
            self._next = end
        if not fresh:
            return
        with f._lock:
            if f._closed:
                for part in fresh:
                    f._forget(part)
                return
            for part in fresh:
                if part.ahead:
                    f._ahead += part.end - part.start
                    f._queue.append(part)
                else:
                    f._urgent.append(part)
            send = f._next_sends()
        f._send(send)

    def close(self) -> None:
        self._fetcher._let_go(list(self._parts))
        self._parts.clear()


def parallel_reads(num_parallel_reads: int | None, room: int) -> tuple[int, int]:
    """(requests in flight, bytes per request) for a loader whose read-ahead may hold `room`
    bytes: PART_BYTES per request where that fits, smaller parts (down to MIN_PART_BYTES) where
    not; `None` is DEFAULT_PARALLEL_READS, or as many as fit.

    Raises SpecError where `num_parallel_reads` requests of MIN_PART_BYTES do not fit.
    """
    if num_parallel_reads is None:
        reads = max(1, min(DEFAULT_PARALLEL_READS, room // MIN_PART_BYTES))
    else:
        reads = num_parallel_reads
        if reads * MIN_PART_BYTES > room:
            raise SpecError(
                f"num_parallel_reads={reads} ranged reads of at least {MIN_PART_BYTES} bytes need "
                f"{reads * MIN_PART_BYTES} bytes, more than the {room} bytes memory_budget leaves them beside "
                "prefetch; lower num_parallel_reads or prefetch, or raise memory_budget"
            )
    return reads, min(remote.PART_BYTES, max(MIN_PART_BYTES, room // reads))
