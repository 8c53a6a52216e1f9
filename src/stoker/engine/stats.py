"""Where a loader's time goes: cheap running counters, and the snapshot `loader.stats()` returns.

Workers add the seconds of each stage of a batch (a couple of `perf_counter` calls per
run of records, never per record); the loader's `__next__` adds how long the consumer
waited for a batch and how long it kept the batch before asking for the next. That is
enough to say what limits a pipeline (see `stoker.doctor`), and cheap enough to leave on.

Stages (worker-seconds, summed over worker threads):

- `read`: raw bytes read into the batch with no cast (`preadv`, or a copy from a memory map
  kept from an earlier epoch);
- `read+cast`: raw records copied from a memory map with the cast fused into the copy
  (one pass: the page-cache or disk read and the cast cannot be told apart);
- `decompress`: gzip/zlib inflate, skips included;
- `cast`: decompressed records cast into the batch;
- `copy`: decompressed records copied into the batch (a small file is decoded whole first);
- `gather`: random-access copies of `shuffle="global"`;
- `turn`: waiting for another worker's turn on the same compressed stream;
- `assemble`: everything else in a worker's batch (buffer allocation, opening files, ...).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..machine import available_cores, cores_phrase

if TYPE_CHECKING:
    from ..plan.batches import Run

__all__ = ["CPU_SAMPLE_SECONDS", "STAGES", "Counters", "LoaderStats"]

STAGES = ("read", "read+cast", "decompress", "cast", "copy", "gather", "turn", "assemble")


# The process's CPU time is read at the first batch and then at most this often, not at every
# batch: the process-wide CPU clock is a system call that reads every thread's run time, a
# noticeable share of the GIL-held time if read per batch. Workers sample their
# own CPU clock as often (see Counters.batch_done).
CPU_SAMPLE_SECONDS = 0.02


class Counters:
    """Running totals shared by a loader's workers and its consumer; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stage: dict[tuple[str, str], float] = {}  # (stage, field) -> worker-seconds
        self.busy = 0.0  # worker-seconds inside batch assembly
        self.busy_cpu = 0.0  # CPU seconds of the workers in the batches sampled for it (below)
        self.busy_sampled = 0.0  # worker-seconds of those batches
        self.busy_runnable = 0.0  # seconds those batches' workers were runnable but off a CPU (schedstat)
        self.runnable_sampled = 0.0  # worker-seconds of the sampled batches that had schedstat
        # Assemblies read by runs (not gathers), their runs, and how many of those runs ended
        # before the assembly did at the end of an interleave block rather than of a group's
        # files: how often a batch's records come from more than one stretch of files, and why.
        self.run_assemblies = 0
        self.runs = 0
        self.block_cuts = 0
        self.batches = 0
        self.records = 0
        self.out_bytes: dict[str, int] = {}
        self.wait = 0.0  # consumer blocked in __next__: it waits on the pipeline
        self.consumer = 0.0  # between __next__ returning and the next call: the pipeline waits on it
        self._cpu_first: float | None = None
        self._cpu_last = 0.0
        self._cpu_at = 0.0  # wall time of the last process-CPU sample
        self._wall_first = 0.0
        self._wall_last = 0.0
        self._disk_first: int | None = None
        self._machine_first: tuple[int, int] | None = None  # /proc/stat (busy, total) jiffies

    def add(self, stage: str, name: str, seconds: float) -> None:
        key = (stage, name)
        with self._lock:
            self.stage[key] = self.stage.get(key, 0.0) + seconds

    def batch_done(
        self,
        seconds: float,
        cpu_seconds: float | None = None,
        runnable_seconds: float | None = None,
        *,
        runs: Sequence[Run] = (),
    ) -> None:
        """A worker assembled a batch in `seconds` from `runs` (none: a gather); `cpu_seconds`
        of its CPU where sampled.

        A worker reads its CPU clock (a system call, not a vDSO read) on one batch in every
        CPU_SAMPLE_SECONDS, not on each, since two reads per batch took a noticeable share of the
        GIL-held time. The busy CPU is the busy time at the sampled batches' CPU share. Where the kernel
        keeps scheduler statistics, the same sample gives `runnable_seconds`: time the worker
        could have run but waited for a CPU (taken by other threads or processes). The rest of
        the off-CPU time it was blocked: on a lock, the GIL, or a read.
        """
        with self._lock:
            self.busy += seconds
            if runs:
                self.run_assemblies += 1
                self.runs += len(runs)
                if len(runs) > 1:  # a run not the last that is not a group's final one ends a block
                    self.block_cuts += sum(1 for r in runs[:-1] if not r.final)
            if cpu_seconds is not None:
                self.busy_cpu += cpu_seconds
                self.busy_sampled += seconds
            if runnable_seconds is not None:
                # The scheduler's reads bracket the batch's clock reads, so on a loaded machine a
                # wait just outside the batch can land in its sample: never more than the batch.
                self.busy_runnable += min(runnable_seconds, seconds)
                self.runnable_sampled += seconds

    def delivered(
        self, batch: Mapping[str, np.ndarray], rows: int, asked: float, got: float, last: float | None
    ) -> None:
        """A batch left `__next__`: asked for at `asked`, returned at `got`; `last` = previous return."""
        with self._lock:
            if self._cpu_first is None:
                self._cpu_first, self._wall_first = time.process_time(), asked
                self._cpu_at = asked
                self._disk_first = disk_read_bytes()
                self._machine_first = machine_jiffies()
            elif got - self._cpu_at >= CPU_SAMPLE_SECONDS:
                self._cpu_last, self._cpu_at = time.process_time(), got
            self._wall_last = got
            self.batches += 1
            self.records += rows
            self.wait += got - asked
            if last is not None:
                self.consumer += asked - last
            for name, arr in batch.items():
                self.out_bytes[name] = self.out_bytes.get(name, 0) + arr.nbytes

    def snapshot(self, **config: Any) -> LoaderStats:
        with self._lock:
            stage = dict(self.stage)
            busy = self.busy
            busy_cpu = busy * self.busy_cpu / self.busy_sampled if self.busy_sampled > 0 else 0.0
            runnable = busy * self.busy_runnable / self.runnable_sampled if self.runnable_sampled > 0 else None
            wall = self._wall_last - self._wall_first if self._cpu_first is not None else 0.0
            cpu = 0.0
            if self._cpu_first is not None and self._cpu_at > self._wall_first:
                # The CPU of the sampled span, at its rate over the whole span delivered.
                cpu = (self._cpu_last - self._cpu_first) * wall / (self._cpu_at - self._wall_first)
            disk_first = self._disk_first
            machine_first = self._machine_first
            out = dict(
                batches=self.batches, records=self.records, bytes=dict(self.out_bytes),
                wait_seconds=self.wait, consumer_seconds=self.consumer,
                runs_per_assembly=self.runs / self.run_assemblies if self.run_assemblies else 0.0,
                block_cuts_per_assembly=self.block_cuts / self.run_assemblies if self.run_assemblies else 0.0,
            )  # fmt: skip
        by_field: dict[str, dict[str, float]] = {}
        for (st, name), s in stage.items():
            by_field.setdefault(name, {})[st] = s
        known = sum(stage.values())
        disk_now = disk_read_bytes() if disk_first is not None else None
        machine_now = machine_jiffies() if machine_first is not None else None
        machine_busy = None
        if machine_first is not None and machine_now is not None and machine_now[1] > machine_first[1]:
            machine_busy = (machine_now[0] - machine_first[0]) / (machine_now[1] - machine_first[1])
        return LoaderStats(
            **out,  # type: ignore[arg-type]
            field_stage_seconds=by_field,
            busy_seconds=busy,
            busy_cpu_seconds=busy_cpu,
            busy_runnable_seconds=runnable,
            assemble_seconds=max(0.0, busy - known),
            wall_seconds=wall,
            cpu_seconds=cpu,
            cores=available_cores(),
            disk_read_bytes=None if disk_now is None or disk_first is None else disk_now - disk_first,
            machine_busy=machine_busy,
            machine_cpus=os.cpu_count() or 1,
            load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
            **config,
        )


_SCHEDSTAT: list[bool] = []  # [False] once /proc/thread-self/schedstat proved unreadable


def thread_clock() -> tuple[float, float | None]:
    """This thread's CPU seconds, and its seconds runnable but waiting for a CPU (None: unknown).

    The CPU from `time.thread_time()`; the wait from `/proc/thread-self/schedstat` (Linux:
    nanoseconds on a run queue, counted when the thread gets a CPU, so exact for the thread
    reading it, and cheap to read). Its on-CPU figure is not used: it lags up to a scheduler tick.
    """
    cpu = time.thread_time()
    if not _SCHEDSTAT:
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            try:
                waiting = os.read(fd, 128).split()[1]
            finally:
                os.close(fd)
            return cpu, int(waiting) / 1e9
        except (OSError, ValueError, IndexError):
            _SCHEDSTAT.append(False)
    return cpu, None


class ConsumerClock:
    """`thread_clock` for the thread that takes a loader's batches, its schedstat file kept open
    (read with pread) until `close()`: opened and closed on every batch, a Ctrl-C landing between
    the open and the close left the descriptor open. A call from another thread reopens it. One
    lock orders reads and the close, which may come from different threads: a read racing the
    close could otherwise use, and later close, a descriptor number the process had reused."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._ident = 0
        self._closed = False
        self._lock = threading.Lock()

    def read(self) -> tuple[float, float | None]:
        """This thread's CPU seconds, and its seconds runnable but waiting for a CPU (None: unknown)."""
        cpu = time.thread_time()
        with self._lock:
            if _SCHEDSTAT or self._closed:
                return cpu, None
            try:
                if self._fd is None or self._ident != threading.get_ident():
                    self._let_go()
                    self._ident = threading.get_ident()
                    self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
                return cpu, int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
            except (OSError, ValueError, IndexError):
                _SCHEDSTAT.append(False)
                self._let_go()
                return cpu, None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._let_go()

    def _let_go(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def machine_jiffies() -> tuple[int, int] | None:
    """The whole machine's (busy, total) CPU time in clock ticks, every CPU (`/proc/stat`), or None."""
    try:
        with open("/proc/stat", "rb") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


def disk_read_bytes() -> int | None:
    """Bytes this process has had read from storage (not the page cache), or None where unknown."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


@dataclass(frozen=True)
class LoaderStats:
    """A loader's counters since its first batch; `str()` gives a one-screen summary.

    Worker stage times are worker-seconds (summed over threads); `wait_seconds` is the
    time the consumer spent blocked in `__next__` and `consumer_seconds` the time it
    kept each batch before asking for the next (its training step).
    """

    batches: int
    records: int
    bytes: dict[str, int]
    wait_seconds: float
    consumer_seconds: float
    field_stage_seconds: dict[str, dict[str, float]]
    busy_seconds: float
    busy_cpu_seconds: float
    assemble_seconds: float
    wall_seconds: float
    cpu_seconds: float
    cores: int
    disk_read_bytes: int | None = None  # read from storage since the first batch (/proc/self/io)
    load_average: float = 0.0  # the machine's 1-minute load average when the stats were taken
    threads: int = 0
    prefetch: int = 0
    batch_size: int = 0
    record_bytes: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    tuning: dict[str, str] = field(default_factory=dict)
    memory_budget: int = 0  # the loader's memory_budget, in bytes (0: not known)
    batch_bytes: int = 0  # bytes of one delivered batch, every field's buffer together
    buffers_made: int = 0  # batch buffers the loader's pool has made anew (not recycled) so far
    prefetch_limited: bool = False  # stoker chose prefetch, and memory_budget held it below its default
    # Batches assembled together, as one, and delivered one by one (stoker.engine.budget.COALESCE_BYTES).
    coalesced: int = 1
    # Runs (stretches of one group's records) per assembly read by runs, and the loader's
    # interleave: each run costs its own per-field work, so blocks shorter than an assembly
    # cost time (0.0 where no assembly was read by runs, e.g. a global shuffle's gathers).
    runs_per_assembly: float = 0.0
    # Of those runs, per assembly, the ones that ended at the end of an interleave block before
    # the assembly did (the rest of the extra runs ended at the end of a group's files).
    block_cuts_per_assembly: float = 0.0
    cycle_length: int = 0
    block_length: int = 0
    # Worker-seconds of busy time runnable but off a CPU (other threads or processes had it), from
    # the kernel's scheduler statistics; None where unknown. busy - cpu - this: blocked (a lock,
    # the GIL, a read).
    busy_runnable_seconds: float | None = None
    # The whole machine's CPUs busy over the same span, as a share of all of them (/proc/stat;
    # None where unknown), and how many the machine has: what other processes took is
    # machine_busy * machine_cpus less this process's own CPU.
    machine_busy: float | None = None
    machine_cpus: int = 0

    @property
    def others_cpus(self) -> float | None:
        """CPUs' worth of time other processes used over the span (None where unknown)."""
        if self.machine_busy is None or self.wall_seconds <= 0 or self.machine_cpus <= 0:
            return None
        return max(0.0, self.machine_busy * self.machine_cpus - self.cpu_seconds / self.wall_seconds)

    @property
    def busy_fractions(self) -> tuple[float, float, float] | None:
        """The workers' busy time as shares (on a CPU, runnable and waiting for one, blocked), summing
        to 1; None where the kernel's scheduler statistics are unknown. The CPU and the wait are
        estimated from different samples, so the wait is capped at what the CPU leaves."""
        if self.busy_seconds <= 0 or self.busy_runnable_seconds is None:
            return None
        on = min(1.0, self.busy_cpu_seconds / self.busy_seconds)
        waiting = min(1.0 - on, self.busy_runnable_seconds / self.busy_seconds)
        return on, waiting, 1.0 - on - waiting

    @property
    def blocked_share(self) -> float | None:
        """Share of the workers' busy time off a CPU that they were blocked (a lock, the GIL, a read)
        rather than runnable and waiting for a CPU; None where the kernel's statistics are unknown."""
        split = self.busy_fractions
        if split is None or split[0] >= 1.0:
            return None
        return split[2] / (1.0 - split[0])

    @property
    def budget_batches(self) -> int:
        """How many whole batches `memory_budget` holds (0 where either is not known)."""
        return self.memory_budget // self.batch_bytes if self.batch_bytes > 0 else 0

    @property
    def seconds(self) -> float:
        """Time the consumer spent in the loop: waiting for batches plus using them."""
        return self.wait_seconds + self.consumer_seconds

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Worker-seconds per stage, over every field (`assemble` is the rest of a worker's batch)."""
        out = dict.fromkeys(STAGES, 0.0)
        for stages in self.field_stage_seconds.values():
            for st, s in stages.items():
                out[st] = out.get(st, 0.0) + s
        out["assemble"] = self.assemble_seconds
        return out

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def source_bytes(self) -> int:
        """Bytes of the stored records delivered (before any cast)."""
        return self.records * sum(self.record_bytes.values())

    @property
    def mb_per_s(self) -> float:
        return self.source_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """Share of the loop's time the consumer waited on the pipeline."""
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def consumer_fraction(self) -> float:
        """Share of the loop's time the pipeline waited on the consumer."""
        return self.consumer_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_utilization(self) -> float:
        """Process CPU time over wall time since the first batch, as a share of the usable cores."""
        return self.cpu_seconds / self.wall_seconds / self.cores if self.wall_seconds > 0 else 0.0

    @property
    def settings(self) -> str:
        """`threads=... prefetch=...`, what bounds them, and what autotune chose."""
        bound = ""
        if self.prefetch_limited:
            bound = (
                f" (held down by memory_budget: it holds {self.budget_batches} batches "
                f"of {self.batch_bytes / 2**20:,.1f} MiB)"
            )
        together = f" (assembled {self.coalesced} at a time)" if self.coalesced > 1 else ""
        interleave = ""
        if self.block_length:
            runs = f", {self.runs_per_assembly:.1f} runs per assembly" if self.runs_per_assembly else ""
            interleave = f" cycle_length={self.cycle_length} block_length={self.block_length}{runs}"
        return f"threads={self.threads} prefetch={self.prefetch}{together}{bound}{interleave}" + "".join(
            f" ({k}: {v})" for k, v in self.tuning.items()
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable fields (`from_dict` reverses it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoaderStats:
        return cls(**data)

    def stage_table(self) -> list[tuple[str, str, float, float]]:
        """(stage, field, worker-seconds, share of worker busy time), largest first."""
        rows = [(st, name, s) for name, stages in self.field_stage_seconds.items() for st, s in stages.items()]
        rows.append(("assemble", "*", self.assemble_seconds))
        busy = self.busy_seconds or 1.0
        return sorted(((st, n, s, s / busy) for st, n, s in rows if s > 0), key=lambda r: -r[2])

    def __str__(self) -> str:
        lines = [
            f"{self.batches} batches, {self.records} records in {self.seconds:.2f}s: "
            f"{self.records_per_s:,.0f} records/s, {self.mb_per_s:,.0f} MB/s read",
            f"consumer waited on the pipeline {self.wait_fraction:.0%} of the time; "
            f"the pipeline waited on the consumer {self.consumer_fraction:.0%}",
            f"CPU {self.cpu_utilization:.0%} of {cores_phrase(self.cores)}; {self.settings}",
            self.stage_split,
        ]
        if self.busy_split:
            lines.append(self.busy_split)
        return "\n".join(lines)

    @property
    def stage_split(self) -> str:
        """`worker time by stage: ...`, each stage's share of the workers' busy time."""
        return "worker time by stage: " + ", ".join(f"{st}[{n}] {share:.0%}" for st, n, _, share in self.stage_table())

    @property
    def busy_split(self) -> str:
        """Where the workers' busy time went: on a CPU, waiting for one, blocked ("" where unknown)."""
        split = self.busy_fractions
        if split is None:
            return ""
        on, waiting, blocked = split
        return (
            f"workers' busy time: on a CPU {on:.0%}, waiting for a CPU {waiting:.0%}, "
            f"blocked {blocked:.0%} (a lock, the GIL, a read)"
        )
