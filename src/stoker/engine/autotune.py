"""Threads and prefetch chosen by measuring the loader's own throughput, once per loader.

When `threads` is None the first pass starts with one worker per core and, once the first fill
of the look-ahead has been delivered (start-up costs stay out of the measurements), climbs:
after each measuring window (at least `MIN_BATCHES` batches and `MIN_SECONDS` seconds, as the
consumer sees them) it adds a worker while that raised records/s by more than `GAIN`, up to
`2 x cores` (threads that wait on a cold disk leave their core to others). A step that did not pay is
taken back and the climb stops; one that runs below the count before it by more than
`CLEAR_LOSS` is judged a third of the way into its window, so a losing trial does not cost a
whole window. A step that paid is measured once more against one worker fewer, in the window
after it (a pass speeds up as its first epoch warms the files, which made any later window look
like a gain), and kept only if it still pays. When the consumer is the limit (it kept batches
longer than it waited for them) it never climbs: it steps down instead, one worker at a time
while the records/s hold (within `GAIN`), so a consumer computing on the host keeps its core; a
step that costs more than that is taken back. A consumer that is away from the CPU while it
keeps a batch (an accelerator step: the thread that takes the batches on a CPU less than
`ON_CPU` of that time, less the time it waited for a CPU) needs no core of its own, so there the
step-down stops at `AWAY_FLOOR` workers: one worker that loses its core to another process for a
while would leave the look-ahead to drain and the step to wait. It never adds a worker while the
process already keeps `SATURATED` of every core busy (its CPU time over the window, consumer
included): a pipeline that is CPU-bound cannot gain from one more thread, and the trial only
costs a window of contention (see `SATURATED`). Workers waiting on a cold disk or a network
leave cores idle, and there the climb goes on. On a machine of `MIN_HALVING` cores or more, a
first window whose workers keep fewer than `HALVE_BELOW` of a core each busy (threads that wait
on the GIL, or on a disk) is followed by one at half the workers: kept while it runs as fast
(within `GAIN`), halved again while that holds, else the workers come back and the climb goes on
from there: on many cores the workers' per-batch Python waits on the GIL, and one per core only
adds hand-offs (see `MIN_HALVING`). `prefetch`, when None, follows `default_prefetch` (four batches more than the
workers, deeper for small batches) within `memory_budget`.

It starts at one worker per core rather than one, as windows this short are noisy enough to
stop a climb from one worker early (measured: benchmarks/results/threads_history.md).

The choice changes how many batches are prepared at once, never which batches or their
order. It is kept for the loader's later passes and shown in `loader.stats().tuning`; a pass
that ends before the climb does (a pass per epoch of a small dataset) hands the climb on to the
next pass, which goes on from the worker count it stood at.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from ..machine import available_cores, cores_phrase
from .executor import MAX_PER_WAKE

__all__ = [
    "AWAY_FLOOR",
    "CLEAR_LOSS",
    "EARLY_FRACTION",
    "GAIN",
    "HALVE_BELOW",
    "IN_FLIGHT_BYTES",
    "MAX_RESTARTS",
    "MIN_BATCHES",
    "MIN_HALVING",
    "MIN_SECONDS",
    "ON_CPU",
    "SATURATED",
    "ThreadTuner",
    "available_cores",
    "default_prefetch",
    "wanted_prefetch",
]

# Short enough to settle within the first second of a pass the size of W1's (benchmarks/w1.py), long enough that a
# window holds many batches (a loaded 2-core machine drifts between single batches).
MIN_BATCHES = 8
MIN_SECONDS = 0.15
# A worker is kept when it raised throughput by more than this (noise on a loaded machine
# is a few percent between consecutive windows).
GAIN = 1.08
# A trial of one worker more whose records/s fall below the count before it by this factor ends
# after this fraction of a window (ThreadTuner._clearly_losing).
CLEAR_LOSS = 1.25
EARLY_FRACTION = 1 / 3
# The share of every core the process must keep busy over a window for the climb to stop
# there, CPU-bound: a third worker on a saturated machine only costs a window of contention
# (measured: benchmarks/results/threads_history.md).
SATURATED = 0.9
# Halving (ThreadTuner._halve): tried after the first window from this many workers up, when
# they keep fewer than HALVE_BELOW of a core each busy: such threads wait on the GIL (the
# per-batch Python), and more of them only add hand-offs (measured on 16 cores:
# benchmarks/results/threads_history.md).
MIN_HALVING = 4
HALVE_BELOW = 0.6
# A window restarts at most this many times for fresh buffers (ThreadTuner.observe): a consumer
# that keeps every batch makes the pool allocate at every one, and the climb must still end.
MAX_RESTARTS = 3
# A consumer whose thread is on a CPU for less than this share of the time it keeps batches (less
# the time it waits for a CPU) waits off it (a sleep, a blocking device call): the step-down stops at
# AWAY_FLOOR workers (at most one per core) for it, as two workers rarely lose their cores to
# other processes at once, where one worker alone, niced below them, can leave the step waiting
# (measured: benchmarks/results/au_history.md).
ON_CPU = 0.5
AWAY_FLOOR = 2


# Batches in flight: each worker needs one to fill while the consumer holds one, and spares
# keep a worker that finished early (batches take uneven times) from waiting for the one before
# it to be delivered, and let the consumer take several batches per wake-up while every worker
# still has one to fill (stoker.engine, MAX_PER_WAKE); small batches want more depth to hide
# the per-batch hand-off. So: enough batches to hold about this many bytes, at least SPARE more
# than the workers, at most MAX_PREFETCH (measured: benchmarks/results/threads_history.md).
IN_FLIGHT_BYTES = 8 << 20
MAX_PREFETCH = 16
SPARE = MAX_PER_WAKE  # room for a whole wake-up's batches beyond one per worker


def wanted_prefetch(threads: int, batch_bytes: int) -> int:
    """Batches in flight by default where `memory_budget` does not bind (see above)."""
    deep = -(-IN_FLIGHT_BYTES // max(1, batch_bytes))
    return max(threads + SPARE, min(deep, MAX_PREFETCH))


def default_prefetch(threads: int, batch_bytes: int, fits: int) -> int:
    """Batches in flight by default; at most half of `fits`, the batches `memory_budget`
    holds beside the decoded files a loader keeps (see `Loader`): the other half lets the
    pool recycle as many batches as are in flight."""
    return max(1, min(wanted_prefetch(threads, batch_bytes), fits // 2))


class Workers(Protocol):
    def add_worker(self) -> None: ...

    def retire_worker(self) -> None: ...

    def set_window(self, window: int) -> None: ...


class ThreadTuner:
    """Hill-climbs the worker count of one pass from what `__next__` observes."""

    def __init__(
        self,
        *,
        start: int,
        max_threads: int,
        tune_prefetch: bool,
        fits: int,
        batch_bytes: int = IN_FLIGHT_BYTES,
        cores: int | None = None,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        self.batch_bytes = batch_bytes
        self.cores = cores or available_cores()
        self._cpu_clock = cpu_clock  # the process's CPU seconds, every thread's (time.process_time)
        self.threads = start
        self.max_threads = max(start, max_threads)
        self.tune_prefetch = tune_prefetch
        self.fits = fits  # batches the memory budget holds in flight
        self.done = start >= self.max_threads
        self.history: list[tuple[int, float]] = []  # (threads, records/s) per window
        self.reason = ""
        self._since: float | None = None  # when the current window began (None: in start-up)
        self._warm = 0  # batches seen before the window began (start-up; reset by _new_window)
        self._fresh = 0  # buffers the pool had made at the last batch
        self._restarts = 0  # times the current window started again after a fresh buffer
        self._new_window(None)
        self._down: float | None = None  # records/s before a step down (consumer-bound), until judged
        self._base: float | None = None  # records/s at the worker count the climb stands on
        self._trial: float | None = None  # records/s of one worker more, until measured against again
        self._halved: tuple[float, int] | None = None  # (records/s, workers) before a halving, until judged

    def new_pass(self) -> None:
        """Go on in a new pass: its start-up stays out of the window, as the first pass's did."""
        self._new_window(None)

    def _new_window(self, since: float | None, *, restart: bool = False) -> None:
        """Start counting a measuring window at `since` (None: once a look-ahead's worth of
        batches has gone by, counted afresh); `restart`: the same window again."""
        if not restart:
            self._restarts = 0
        if since is None:
            self._warm = 0
        self._since = since
        self._cpu = self._cpu_clock() if since is not None else 0.0
        self._rows = self._batches = 0
        self._wait = self._used = 0.0
        self._kept = self._kept_cpu = self._kept_queued = 0.0  # see kept()

    def _floor(self, on_cpu: float) -> int:
        """The fewest workers a consumer-bound step-down keeps: one for a consumer that computes on
        the host (it keeps a core to itself), `AWAY_FLOOR` for one that waits off the CPU."""
        if on_cpu >= ON_CPU:
            return 1
        return max(1, min(AWAY_FLOOR, self.cores, self.max_threads))

    def kept(self, seconds: float, cpu: float, queued: float) -> None:
        """The consumer kept a batch `seconds` (from one `__next__` returning to the next call),
        of them `cpu` on a CPU and `queued` runnable waiting for one (0.0 where not known); told
        for every batch, the parts of an assembly too."""
        if self._since is not None:
            self._kept += seconds
            self._kept_cpu += cpu
            self._kept_queued += queued

    def _on_cpu(self) -> float:
        """The consumer's share on a CPU of the time it kept the window's batches, less the time
        it waited for a CPU (1.0 where not known). Waiting for a CPU that other processes hold, a
        consumer that computes still computes, and one just woken from its sleep still slept."""
        wanted = self._kept - self._kept_queued
        return min(1.0, self._kept_cpu / wanted) if self._kept > 0 and wanted > 0 else 1.0

    def _finish_away(self, workers: Workers, floor: int, on_cpu: float) -> None:
        """Done for a consumer that waits off the CPU: at least `floor` workers, back up to it
        where the count stands below (a step down judged before the consumer was)."""
        if self.threads < floor:
            for _ in range(floor - self.threads):
                workers.add_worker()
            self.threads = floor
            self._resize(workers)
        self._finish(
            f"consumer-bound, on a CPU {on_cpu:.0%} of the time (it waits off the CPU, as for an accelerator "
            f"step): {self.threads} threads kept, so a worker that loses its core "
            "leaves another to fill the look-ahead"
        )

    def prefetch_for(self, threads: int) -> int:
        """The loader's default for `threads` workers (`default_prefetch`)."""
        return default_prefetch(threads, self.batch_bytes, self.fits)

    def observe(
        self, workers: Workers, asked: float, got: float, last: float | None, rows: int, fresh: int = 0
    ) -> None:
        """One batch left `__next__`; at a window's end, maybe change the worker count.

        `fresh`: how many buffers the pool has made so far. A window in which it made one
        starts again once a look-ahead's worth of batches has gone by, the batch that got the
        buffer among them (at most `MAX_RESTARTS` times): a fresh buffer's first touch costs
        tens of batches' time where the host takes free memory back, and a trial of one worker
        more grows the look-ahead by one, so a window holding it would judge the trial on it.
        """
        if self.done:
            return
        if fresh != self._fresh:
            self._fresh = fresh
            if self._since is not None and self._restarts < MAX_RESTARTS:
                self._restarts += 1
                self._new_window(None, restart=True)
                return
        if self._since is None:
            # Start-up: the first batches wait for the threads, the first pages of each file and
            # fresh buffers until the pool recycles, so a first window holding them would make
            # the workers look slower than they are and climb past the cores; the window starts
            # once the first fill of the look-ahead has been delivered.
            self._warm += 1
            if self._warm > self.prefetch_for(self.threads):
                self._new_window(got, restart=True)  # restarts so far still count
            return
        self._rows += rows
        self._batches += 1
        self._wait += got - asked
        if last is not None:
            self._used += asked - last
        elapsed = got - self._since
        if self._batches < MIN_BATCHES:
            return
        rate = self._rows / elapsed
        if elapsed < MIN_SECONDS and not self._clearly_losing(elapsed, rate):
            return
        consumer_bound = self._used > self._wait
        busy = (self._cpu_clock() - self._cpu) / elapsed  # cores the whole process kept busy
        on_cpu = self._on_cpu()
        floor = self._floor(on_cpu)
        self.history.append((self.threads, rate))
        self._new_window(got)
        if self._down is not None:  # the last window ran one worker fewer, the consumer being the limit
            before, self._down = self._down, None
            if rate * GAIN < before:  # that cost more than noise: the worker goes back
                self.threads += 1
                workers.add_worker()
                self._resize(workers)
                self._finish(
                    f"consumer-bound; {self.threads - 1} thread(s) gave {rate / before:.2f}x of {self.threads}, "
                    f"so {self.threads} kept"
                )
                return
            if not consumer_bound or self.threads <= floor:
                if floor > 1:
                    self._finish_away(workers, floor, on_cpu)
                else:
                    self._finish(f"consumer-bound: {self.threads} thread(s) keep up and leave the consumer its CPU")
                return
            # Still the consumer's limit with workers to spare: step down again, below.
        if consumer_bound:
            if self.threads > floor:
                self._step_down(workers, rate)
            elif floor > 1:
                self._finish_away(workers, floor, on_cpu)
            else:
                self._finish(f"consumer-bound at {self.threads} thread(s): more workers would take its CPU")
            return
        if self._halved is not None:  # this window ran half the workers of the one before
            before, more = self._halved
            self._halved = None
            if rate * GAIN < before:  # they were needed: back to them, and the climb goes on from there
                for _ in range(more - self.threads):
                    workers.add_worker()
                self.threads = more
                self._base = before
                self._climb(workers)
                return
            if self._halve(workers, rate, busy):
                return
            self._finish(
                f"{self.threads} threads ran {rate / before:.2f}x of {more} with half the workers "
                f"({busy:.2f} cores busy): kept"
            )
            return
        if self._base is None and self._trial is None and self._halve(workers, rate, busy):
            return  # the first window: its workers mostly waited
        if self._trial is not None:  # this window ran one worker fewer than the trial before it
            trial, self._trial = self._trial, None
            if trial <= rate * GAIN:  # measured again, the gain was drift: the worker stays out
                self._finish(f"{self.threads + 1} threads gave {trial / rate:.2f}x of {self.threads} measured after")
                return
            self.threads += 1  # confirmed: the worker comes back, and the climb goes on from there
            workers.add_worker()
            self._base = trial
        elif self._base is not None:  # this window ran one worker more than the one before
            if rate <= self._base * GAIN:
                workers.retire_worker()  # the step did not pay: take it back
                self.threads -= 1
                self._resize(workers)
                self._finish(f"{self.threads + 1} threads gave {rate / self._base:.2f}x of {self.threads}")
                return
            # It paid, against a window measured before it; a pass speeds up as its first epoch
            # maps and faults in every page, so the gain is confirmed against one worker fewer
            # measured again now.
            self._trial = rate
            self.threads -= 1
            workers.retire_worker()
            self._resize(workers)
            return
        else:
            self._base = rate
        if busy >= SATURATED * self.cores:
            self._finish(
                f"CPU-bound: {busy:.2f} of {cores_phrase(self.cores)} busy at {self.threads} thread(s), "
                "so no worker more was tried"
            )
            return
        self._climb(workers)

    def _climb(self, workers: Workers) -> None:
        """One worker more, to be measured in the next window (or the end, at the maximum)."""
        if self.threads >= self.max_threads:
            self._resize(workers)
            self._finish(f"reached the maximum of {self.max_threads} threads")
            return
        if self.tune_prefetch and self.prefetch_for(self.threads + 1) <= self.threads:
            # memory_budget holds the window at or below the workers there are: one more would
            # only wait for a batch to fill.
            self._resize(workers)
            self._finish(
                f"memory_budget leaves room for prefetch={self.prefetch_for(self.threads + 1)}, no batch for a "
                "worker more, so none was tried"
            )
            return
        self.threads += 1
        workers.add_worker()
        self._resize(workers)

    def _halve(self, workers: Workers, rate: float, busy: float) -> bool:
        """Try half the workers when they keep less than HALVE_BELOW of a core each busy.

        Threads that wait on the GIL gain nothing from more of their kind and lose to the hand-offs:
        on 16 cores, the workers of W1 (benchmarks/w1.py) spend most of their time waiting for it
        (see MIN_HALVING). Workers that wait on a cold disk look the same from here, so the next
        window decides: a halving that runs slower than noise is taken back and the climb goes on
        from the count before it.
        """
        if self.threads < MIN_HALVING or busy >= HALVE_BELOW * self.threads:
            return False
        self._halved = (rate, self.threads)
        half = self.threads // 2
        for _ in range(self.threads - half):
            workers.retire_worker()
        self.threads = half
        self._resize(workers)
        return True

    def _clearly_losing(self, elapsed: float, rate: float) -> bool:
        """A trial of one worker more that already runs well below the count before it ends early.

        A window a third as long still holds tens of batches, and a loss this large is beyond
        what noise or the trial's own start (one more thread, one more buffer) explains, so the
        rest of the window would only cost throughput. A trial that gains, or loses little, runs
        its whole window as before.
        """
        base = self._base
        if base is None or self._trial is not None or self._down is not None:  # not a trial of one more
            return False
        return elapsed >= MIN_SECONDS * EARLY_FRACTION and rate * CLEAR_LOSS < base

    def _step_down(self, workers: Workers, rate: float) -> None:
        """The consumer is the limit: try one worker fewer, which leaves it more of the CPU.

        A consumer that runs Python or numpy on the host shares the cores with the workers; when
        the pipeline already outpaces it, every worker beyond what keeps up only takes its CPU
        (a consumer that computes on every batch). Kept when the
        next window is no slower than noise, taken back otherwise.
        """
        self._down = rate
        self.threads -= 1
        workers.retire_worker()
        self._resize(workers)

    def _resize(self, workers: Workers) -> None:
        if self.tune_prefetch:
            workers.set_window(self.prefetch_for(self.threads))

    def _finish(self, reason: str) -> None:
        self.done = True
        self.reason = reason

    def summary(self) -> str:
        steps = ", ".join(f"{t}: {r:,.0f}/s" for t, r in self.history)
        return f"threads={self.threads} measured ({steps or 'not yet'}){'; ' + self.reason if self.reason else ''}"
