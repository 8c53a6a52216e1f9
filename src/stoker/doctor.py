"""One line that names what limits a pipeline, and the setting that would move it.

The verdict reads a `stoker.engine.stats.LoaderStats` (from `loader.stats()` or a
`stoker bench` child) and, when known, how close the loader came to the machine's
ceiling on the same files. Checks run from the outside in: first whether the consumer is
the limit (then nothing in stoker is), then whether the machine is, then which worker
stage takes the time.
"""

from __future__ import annotations

import difflib
import re
from importlib import resources

from .engine.decoded import KEPT_DECODED_BYTES
from .engine.executor import MAX_PER_WAKE
from .engine.stats import LoaderStats
from .io.inflate import BACKEND
from .machine import cores_phrase

__all__ = [
    "AT_CEILING",
    "CONSUMER_BOUND",
    "EXPLAIN_COMMAND",
    "STEP_FED",
    "VERDICTS_FILE",
    "VERDICT_IDS",
    "explain",
    "step_verdict",
    "verdict",
]

# Every verdict ends with this command and its section, which prints what to change from the
# installed package (a pip user has no docs/ folder, and the project has no public site).
EXPLAIN_COMMAND = "stoker explain"
# The explanations, shipped as package data: a section per verdict, headed `## SECTION`.
# docs/performance/verdicts.md is a copy of it.
VERDICTS_FILE = "verdicts.md"
# The sections, one per kind of verdict.
VERDICT_IDS = (
    "no-batches",
    "consumer-bound",
    "at-ceiling",
    "buffers-made-anew",
    "memory-budget-bound",
    "prefetch-below-workers",
    "no-stage-measured",
    "decompression",
    "stream-turns",
    "cpu-starved",
    "workers-outnumber-cores",
    "per-batch-work",
    "storage-bound",
    "more-threads",
    "global-shuffle-gathers",
    "copy-with-cast",
    "copy-bound",
    "copy-decompressed",
    "cast",
    "per-batch-overhead",
    "step-fed",
    "step-starved",
)

# The consumer's own work is more than half the loop: stoker is ahead and waits on it.
CONSUMER_BOUND = 0.5
# The target: within 10% of the fastest simple loop on the same files.
AT_CEILING = 0.9
# MLPerf Storage's pass mark: the accelerator busy in its step this share of the time or more.
STEP_FED = 0.9
# Workers busy on reads but on the CPU less than this share of that time: they wait on storage.
IO_BOUND_CPU = 0.5
# Batch buffers made anew for more than this share of the buffers delivered (after at least
# CHURN_MIN_BATCHES batches): the pool has too little room to recycle them. A fresh buffer's
# first touch costs far more than its batch (see stoker.engine.autotune.ThreadTuner.observe).
CHURN_SHARE = 0.1
CHURN_MIN_BATCHES = 50
# Below CPU_SATURATED of the process's cores, workers' busy time off a CPU tells why (the
# kernel's scheduler statistics): runnable and waiting for a CPU STARVED of their busy time or
# more while other processes used OTHERS of the cores, those have them (a wait with the machine
# otherwise idle is the process's own threads outnumbering its cores); on a CPU less than GIL_CPU
# of it and blocked (not runnable) at least BLOCKED of the rest, the workers take turns at the
# GIL. The thresholds sit between what GIL-bound workers and workers starved by CPU burners
# showed (measured: benchmarks/results/w1_history.md).
STARVED = 0.2
OTHERS = 0.2  # ... and other processes used this share of the cores or more (else the wait is our own)
GIL_CPU = 0.75
CPU_SATURATED = 0.85
BLOCKED = 0.6
# Below the ceiling with the copy on top, per-batch work this share of worker time or more is
# named as the gap: below it the loader was near the ceiling anyway (measured:
# benchmarks/results/w1_history.md).
ASSEMBLE_GAP = 0.08
# Below the ceiling with the copy on top, assemblies read in this many runs or more on average
# (their records from two or more stretches of files) are named: where interleave blocks cut them
# (blocks not much longer than an assembly), with a block_length of BLOCK_ASSEMBLIES assemblies,
# at which at most one in that many straddles two blocks; where the ends of files do (files of a
# few records), the files. Each run costs its own per-field work, a sizeable share of a
# batch's (measured: benchmarks/results/w1_history.md).
RUNS_GAP = 1.5
BLOCK_ASSEMBLIES = 4


def verdict(stats: LoaderStats, ceiling_ratio: float | None = None, *, backend: str = BACKEND) -> str:
    """What limits the loader these stats come from, and what would move it.

    Args:
        stats: counters of a loader that has delivered batches.
        ceiling_ratio: the loader's records/s over the ceiling loop's on the same files
            (`stoker bench` measures it), or None when not measured.
        backend: the inflate library in use (`"isal"` or `"zlib"`).
    """
    if stats.batches == 0 or stats.seconds <= 0:
        return _see("no-batches", "no batches delivered yet: nothing to diagnose")
    if stats.consumer_fraction >= CONSUMER_BOUND:
        return _see(
            "consumer-bound",
            f"consumer-bound: the pipeline waits on you {stats.consumer_fraction:.0%} of the time "
            f"(you wait on it {stats.wait_fraction:.0%}); a faster step, not stoker, would move it",
        )
    if ceiling_ratio is not None and ceiling_ratio >= AT_CEILING:
        above = " (over 100%: noisy rounds, read the spread)" if ceiling_ratio > 1.05 else ""
        return _see(
            "at-ceiling",
            f"at {ceiling_ratio:.0%} of this machine's ceiling: the copy is the limit{above} "
            "(less data per record, or faster memory/storage, would move it)",
        )
    where = "" if ceiling_ratio is None else f" at {ceiling_ratio:.0%} of the ceiling"
    memory = _memory_verdict(stats, where)
    if memory:
        return memory
    table = stats.stage_table()
    if not table:
        return _see("no-stage-measured", f"no worker stage measured{where}")
    stage, name, _, share = table[0]
    cores, threads = stats.cores, stats.threads
    more_threads = f"raise threads= (now {threads}, {cores} cores)" if threads < cores else ""
    if stage == "decompress":
        if backend != "isal":
            return _see(
                "decompression",
                f"gzip/zlib decompression of field {name!r} limits you ({share:.0%} of worker time{where}): "
                "install isal (pip install isal, stoker's fast extra), 1.5-2x faster inflate",
            )
        return _see(
            "decompression",
            f"decompression of field {name!r} limits you ({share:.0%} of worker time{where}, isal in use): "
            + (more_threads or "store that field uncompressed, or split it into more files so more inflate at once"),
        )
    if stage == "turn":
        return _see(
            "stream-turns",
            f"workers wait for their turn on field {name!r}'s compressed streams ({share:.0%} of worker "
            f"time{where}): raise cycle_length so more files are read at once",
        )
    if stage in ("read", "read+cast", "gather"):
        cpu_share = stats.busy_cpu_seconds / stats.busy_seconds if stats.busy_seconds > 0 else 1.0
        from_disk = stats.disk_read_bytes
        cached = from_disk is not None and from_disk < stats.source_bytes // 10
        split, blocked = stats.busy_fractions, stats.blocked_share
        if cached and split is not None and stats.cpu_utilization < CPU_SATURATED:
            others = stats.others_cpus
            waited = split[1]
            if waited >= STARVED and others is not None and others >= OTHERS * cores:
                return _see(
                    "cpu-starved",
                    f"CPU-starved: workers ({stage} of field {name!r}) waited for a CPU {waited:.0%} of their busy "
                    f"time{where} while the process used {stats.cpu_utilization:.0%} of {cores_phrase(cores)}: other "
                    f"processes take the CPU ({others:.1f} CPUs' worth of it; the machine's load average is "
                    f"{stats.load_average:.1f})",
                )
            if waited >= STARVED and others is not None and threads >= cores:
                return _see(
                    "workers-outnumber-cores",
                    f"workers outnumber the cores: {threads} workers on {cores} cores waited for a CPU {waited:.0%} "
                    f"of their busy time{where}, with no other process on it: threads={max(1, cores - 1)} or "
                    f"{cores} (or None, autotuned) leaves each a core",
                )
            if cpu_share < GIL_CPU and blocked is not None and blocked >= BLOCKED:
                rate = stats.batches / stats.seconds
                together = f", assembled {stats.coalesced} at a time" if stats.coalesced > 1 else ""
                return _see(
                    "per-batch-work",
                    f"per-batch work limits you: {rate:,.0f} batches/s of {stats.batch_size} records{together}{where}; "
                    f"workers ran on a CPU only {cpu_share:.0%} of their busy time and were blocked {blocked:.0%} "
                    f"of the rest (not waiting for a CPU: the process used {stats.cpu_utilization:.0%} of "
                    f"{cores} cores): they take turns at Python's GIL for each batch's bookkeeping, so records "
                    f"per batch set the rate: raise batch_size (now {stats.batch_size})",
                )
        if cpu_share < IO_BOUND_CPU and cached and split is None:  # no scheduler statistics: a guess
            return _see(
                "cpu-starved",
                f"CPU-starved: workers ({stage} of field {name!r}) ran on a CPU only {cpu_share:.0%} of their "
                f"busy time{where} though "
                f"almost nothing came from the disk; the machine's load average is {stats.load_average:.1f} "
                f"on {cores} cores: other processes (or your own threads holding the GIL) take the CPU",
            )
        if cpu_share < IO_BOUND_CPU:
            return _see(
                "storage-bound",
                f"storage-bound: reads of field {name!r} wait on the disk (workers on the CPU only "
                f"{cpu_share:.0%} of their busy time{where}): raise threads/prefetch for more reads in flight, "
                "or keep the files in the page cache",
            )
        if more_threads:
            return _see(
                "more-threads",
                f"{stage} of field {name!r} limits you ({share:.0%} of worker time{where}): {more_threads}",
            )
        if stage == "gather":
            return _see(
                "global-shuffle-gathers",
                f"random-access gathers of field {name!r} for shuffle='global' limit you ({share:.0%} of worker "
                f"time{where}): shuffle='files' reads each file front to back",
            )
        busy = f"CPU {stats.cpu_utilization:.0%} of {cores_phrase(cores)}"
        # The ceiling makes the same copy: below it, stoker's own per-batch work is the gap.
        assemble = next((sh for st, _, _, sh in table if st == "assemble"), 0.0)
        gap = (
            f"; the gap to the ceiling is stoker's per-batch work (assemble {assemble:.0%} of worker time): "
            f"a larger batch_size (now {stats.batch_size}) spreads it over more records"
            if ceiling_ratio is not None and assemble >= ASSEMBLE_GAP
            else ""
        )
        gap += _runs_gap(stats) if ceiling_ratio is not None else ""
        if stage == "read+cast":
            return _see(
                "copy-with-cast",
                f"the copy of field {name!r} with its cast to {stats.dtypes.get(name, '?')} limits you "
                f"({share:.0%} of worker time{where}, {busy}): keep the stored dtype and cast on the "
                f"accelerator to move fewer bytes{gap}",
            )
        return _see(
            "copy-bound", f"the copy of field {name!r} limits you ({share:.0%} of worker time{where}, {busy}){gap}"
        )
    if stage == "copy":
        return _see(
            "copy-decompressed",
            f"copying decompressed records of field {name!r} limits you ({share:.0%} of worker time{where}): "
            + (more_threads or "store that field uncompressed so it is read straight into the batch"),
        )
    if stage == "cast":
        return _see(
            "cast",
            f"the cast of field {name!r} to {stats.dtypes.get(name, '?')} limits you ({share:.0%} of worker "
            f"time{where}): keep the stored dtype and cast on the accelerator",
        )
    return _see(
        "per-batch-overhead",
        f"per-batch overhead (buffers, files, bookkeeping) limits you ({share:.0%} of worker time{where}): "
        f"raise batch_size (now {stats.batch_size})",
    )


def step_verdict(step_ms: float, utilization: float, wait_fraction: float, cores_used: float, cores: int) -> str:
    """Whether a training step of `step_ms` per batch would wait on the loader, and the cores
    the loader leaves it, from a run with that step emulated (`stoker bench --step`).

    Args:
        step_ms: the step, in milliseconds per batch.
        utilization: the share of the run's wall time spent in the step (AU).
        wait_fraction: the share of the run's wall time the step's loop waited for a batch.
        cores_used: the loader's CPU seconds over the run's wall seconds.
        cores: the cores the process may run on.

    >>> step_verdict(20, 0.987, 0.011, 0.35, 2).split("; ")[0]
    'your step of 20 ms would wait 1.1% of the time (the accelerator busy 98.7%, MLPerf Storage passes at 90%)'
    """
    free = max(0.0, cores - cores_used)
    left = f"stoker used {cores_used:.2f} of {cores_phrase(cores)}, leaving {free:.2f} free for your step's host work"
    if utilization >= STEP_FED:
        return _see(
            "step-fed",
            f"your step of {step_ms:g} ms would wait {wait_fraction:.1%} of the time (the accelerator busy "
            f"{utilization:.1%}, MLPerf Storage passes at {STEP_FED:.0%}); {left}",
        )
    return _see(
        "step-starved",
        f"your step of {step_ms:g} ms would wait {wait_fraction:.0%} of the time (the accelerator busy "
        f"{utilization:.0%}, under MLPerf Storage's {STEP_FED:.0%}): stoker did not have a batch ready "
        f"every {step_ms:g} ms here; a larger batch_size gives the step more time per batch; {left}",
    )


def _see(anchor: str, said: str) -> str:
    """`said` followed by the command that explains it and what to change."""
    return f"{said}; see: {EXPLAIN_COMMAND} {anchor}"


_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def explain(section: str | None = None) -> str:
    """The explanation of one kind of verdict, as `stoker explain SECTION` prints it; with no
    section, the list of sections.

    Args:
        section: the last word of a verdict (`"storage-bound"`), one of `VERDICT_IDS`.

    Raises:
        ValueError: `section` is none of them (the message names the nearest).

    >>> print(explain("no-batches").splitlines()[0])
    no-batches
    """
    if section is None:
        return "\n".join([f"{EXPLAIN_COMMAND} SECTION prints one of:", *(f"  {s}" for s in VERDICT_IDS)])
    sections = _sections()
    if section not in sections:
        near = difflib.get_close_matches(section, list(sections), n=1)
        hint = f"; did you mean {near[0]}?" if near else f" ({EXPLAIN_COMMAND} lists them)"
        raise ValueError(f"{section=} is no verdict's section{hint}")
    return f"{section}\n\n{_plain(sections[section])}"


def _sections() -> dict[str, str]:
    """`## SECTION` -> its markdown, from the package's verdicts.md."""
    text = resources.files("stoker").joinpath(VERDICTS_FILE).read_text(encoding="utf-8")
    parts = re.split(r"^## (\S+)\n", text, flags=re.MULTILINE)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def _plain(body: str) -> str:
    """A section's markdown as a terminal shows it: the example verdict indented, links as their
    text (a link to another section as the command that prints it)."""

    def link(m: re.Match[str]) -> str:
        text, target = m.groups()
        return f"{text} ({EXPLAIN_COMMAND} {target[1:]})" if target.startswith("#") else text

    lines, fenced = [], False
    for line in body.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        lines.append(f"    {line}" if fenced else _LINK.sub(link, line))
    return "\n".join(lines)


def _runs_gap(stats: LoaderStats) -> str:
    """`; ...` naming what cuts assemblies into many runs (see RUNS_GAP), or "".

    Interleave blocks shorter than an assembly: a longer `block_length`. Files shorter than
    one: nothing stoker can set (a run never spans two files), so the files are named.
    """
    runs, block, cuts = stats.runs_per_assembly, stats.block_length, stats.block_cuts_per_assembly
    unit = stats.batch_size * max(1, stats.coalesced)
    if runs < RUNS_GAP or unit <= 0:
        return ""
    said = (
        f"; each assembly of {unit} records"
        + (f" ({stats.coalesced} batches assembled as one)" if stats.coalesced > 1 else "")
        + f" is read in {runs:.1f} runs per field"
    )
    if cuts >= RUNS_GAP - 1 and 0 < block < BLOCK_ASSEMBLIES * unit:
        return (
            f"{said}, since interleave blocks hold {block} records: block_length={BLOCK_ASSEMBLIES * unit} "
            "reads most of them in one run (it changes the order of the records)"
        )
    if runs - 1 - cuts >= RUNS_GAP - 1:
        return (
            f"{said}, {unit / runs:,.0f} records a run, most cut at the end of a file: "
            "fewer, larger files would make fewer runs"
        )
    return ""


def _memory_verdict(stats: LoaderStats, where: str) -> str | None:
    """Batches in flight or buffer recycling held back by `memory_budget` (or `prefetch=`)."""
    fits, bb, threads, prefetch = stats.budget_batches, stats.batch_bytes, stats.threads, stats.prefetch
    if fits == 0:
        return None
    held = (
        f"memory_budget={_exact(stats.memory_budget)} holds {fits} batch{'es' if fits != 1 else ''} "
        f"of {bb / 2**20:,.1f} MiB"
    )
    fields = max(1, len(stats.record_bytes))
    # Counted in what the engine hands out: one buffer per field for each assembly of
    # `coalesced` batches (stoker.engine.budget.COALESCE_BYTES), where prefetch is a multiple of it.
    k = max(1, stats.coalesced)
    assemblies = -(-stats.batches // k)
    # Beyond the first fill: a buffer for each assembly in flight, a wake-up's worth the consumer
    # takes at once, and the one it holds (stoker.engine.executor.MAX_PER_WAKE), per field.
    anew = stats.buffers_made - (prefetch // k + MAX_PER_WAKE + 2) * fields
    if assemblies >= CHURN_MIN_BATCHES and anew > CHURN_SHARE * assemblies * fields:
        # The pool keeps what the consumer drops, within what prefetch leaves of the budget.
        need = (2 * prefetch + 2 * k) * bb + KEPT_DECODED_BYTES
        move = (
            "hold fewer batches, or lower prefetch="
            if stats.memory_budget >= need  # room enough: the batches never came back
            else f"memory_budget={_size(need)!r}, a lower prefetch=, or holding fewer batches"
        )
        together = f" (assembled {k} at a time: a batch kept keeps its assembly's buffer)" if k > 1 else ""
        return _see(
            "buffers-made-anew",
            f"batch buffers made anew instead of recycled: {stats.buffers_made} for {stats.batches} batches"
            f"{together}{where}, "
            f"each paying a first touch of its pages; the pool recycles a batch once you drop it, within what "
            f"{held} leaves beside prefetch={prefetch} in flight: {move} would move it",
        )
    if prefetch >= threads:
        return None
    if stats.prefetch_limited:
        # The default prefetch takes half of what the budget holds beside the decoded files a
        # loader keeps (see stoker.loader): this reaches `threads` batches.
        need = 2 * threads * bb + KEPT_DECODED_BYTES
        return _see(
            "memory-budget-bound",
            f"memory_budget-bound: {held}, so prefetch={prefetch} keeps at most {prefetch} of {threads} "
            f"workers busy{where}: memory_budget={_size(need)!r} (or a smaller batch_size) lets every worker run",
        )
    return _see(
        "prefetch-below-workers",
        f"prefetch={prefetch} keeps at most {prefetch} of {threads} workers busy{where}: raise prefetch= to "
        f"{threads} or more ({held})",
    )


def _size(nbytes: int) -> str:
    """`nbytes` rounded up to 64 MiB steps (GiB where whole), as memory_budget= accepts it."""
    mib = -(-nbytes // 2**26) * 64  # a round figure: 64 MiB steps
    return f"{mib // 1024}GiB" if mib % 1024 == 0 else f"{mib}MiB"


def _exact(nbytes: int) -> str:
    """`nbytes` as memory_budget= was likely given: GiB or MiB where whole, else bytes."""
    return f"{nbytes >> 30}GiB" if nbytes % 2**30 == 0 else f"{nbytes >> 20}MiB" if nbytes % 2**20 == 0 else f"{nbytes}"
