"""The optional compiled kernels (`stoker._kernels`, built by setup.py where a C compiler is
found) and the copy into a batch that uses them; without them numpy gives the same values.

`cast_into` is `np.copyto(dst, src, casting="unsafe")` for the copies that fill a batch. Where
the output is large it writes with streaming (non-temporal) stores: a batch is read by its
consumer later, after others have gone through the cache, so ordinary stores would first read
every cache line of the output only to overwrite it (measured:
benchmarks/results/w1_history.md). Integer records cast to float16 take an F16C loop, bit for
bit numpy's rounding, since numpy converts one value at a time. Arrays in either spelling of the
machine's byte order ("<f4" or "=f4") take the kernels; the other order goes to numpy, which
swaps it. Integer and float32 records into ml_dtypes' bfloat16 (`cast="bfloat16"`,
`Cast("bfloat16")`) take a kernel too, integers by the CPU's own conversion where it has
AVX512_BF16; gathers into bfloat16 as well. Records stored as bfloat16 widen into float32 by a
kernel loop too, in order and gathered.

Reads from memory maps of files another process may cut short go through the kernels only,
whose reads are guarded: a SIGBUS there raises `MapFault` instead of killing the
process (`_kernels.c`). numpy's copies cannot be guarded, so records numpy would cast from a
map are first copied out by the kernels (or read with `pread` where they are not built).
"""

from __future__ import annotations

import array
import contextlib
import errno
import importlib
import itertools
import mmap
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .spec import is_bfloat16

__all__ = [
    "STREAM_MIN_BYTES",
    "MapFault",
    "address",
    "cast_into",
    "cast_mapped",
    "compiled",
    "copy_records",
    "file_size",
    "file_sizes",
    "gather_into",
    "gather_records",
    "gather_runs",
    "gathers",
    "guard_maps",
    "isa",
    "map_file",
    "maps_hold_descriptors",
    "permute",
    "set_isa",
    "slow_path_warning",
    "willneed_records",
]

_kernels: Any
try:
    _kernels = importlib.import_module("stoker._kernels")
except ImportError:  # pragma: no cover - built without a C compiler
    _kernels = None
_said_slow = False  # the missing kernels are said once per process (slow_path_warning)


class _MapFault(OSError):
    """A bus error reading a memory map (a file cut short under it); `address`: where."""

    address: int


# Raised by the kernels' guarded reads, and by copy_records without them, for the same fault.
MapFault: type[OSError] = _kernels.MapFault if _kernels is not None else _MapFault

# Outputs at least this large are streamed past the cache; smaller ones (labels, a few
# records) stay cached, where the next step may read them soon.
STREAM_MIN_BYTES = 1 << 20

# Native-order dtypes the kernel reads, and what it writes from each (besides a plain copy).
_CODES = {
    np.dtype(t): np.dtype(t).char for t in (np.int8, np.uint8, np.int16, np.uint16, np.float16, np.float32, np.float64)
}
_CASTS = {(s, o) for s in "bBhHf" for o in "fd"} | {("d", "d")}
# The sources the kernel's bfloat16 loops take (float32: rounded to nearest even, NaN kept
# quiet, bit for bit ml_dtypes' cast).
_BF16_CODES = {np.dtype(t): np.dtype(t).char for t in (np.int8, np.uint8, np.int16, np.uint16, np.float32)}
_F16_CASTS = {(s, "e") for s in "bBhH"}


def _probe_f16() -> None:
    """Integers into float16 where the kernels have that loop now (x86 with F16C, see set_isa)."""
    if _kernels is not None and _kernels.cast_into(np.empty(1, np.float16), np.zeros(1, np.int8), 0):
        _CASTS.update(_F16_CASTS)
    else:
        _CASTS.difference_update(_F16_CASTS)


_probe_f16()

# The hand-written loops set_isa allows, widest last (the C side's ISA_NONE, ISA_AVX2, ISA_ALL).
ISA_LEVELS = ("none", "avx2", "all")


def isa() -> str:
    """The hand-written loops allowed now (see `set_isa`): one of `ISA_LEVELS`."""
    return ISA_LEVELS[_kernels.set_isa(-1)] if _kernels is not None else "none"


def set_isa(level: str) -> str:
    """Which of the kernels' hand-written loops may run from now on; returns the level before.

    `"all"` (the default): the widest the CPU has (AVX512_BF16's conversion for integers into
    bfloat16). `"avx2"`: what a CPU with AVX2 and F16C but no AVX512_BF16 runs. `"none"`: no
    hand-written loop, as on a CPU without AVX2 (the generic kernels, and numpy where they have
    no loop). Every level gives the same bits; this exists so tests check each path on one
    machine and benchmarks can compare them. Process-wide: call it with no loader running.
    `STOKER_KERNELS_ISA` sets it at import.
    """
    if level not in ISA_LEVELS:
        raise ValueError(f"set_isa: level {level!r} is not one of {', '.join(ISA_LEVELS)}")
    if _kernels is None:
        return "none"
    before = ISA_LEVELS[_kernels.set_isa(ISA_LEVELS.index(level))]
    _probe_f16()
    return before


if os.environ.get("STOKER_KERNELS_ISA"):
    try:
        set_isa(os.environ["STOKER_KERNELS_ISA"])
    except ValueError as e:
        raise ValueError(
            f"STOKER_KERNELS_ISA={os.environ['STOKER_KERNELS_ISA']!r} is not one of {', '.join(ISA_LEVELS)}"
        ) from e


def compiled() -> bool:
    """True when the compiled kernels are installed (else numpy does their work)."""
    return _kernels is not None


def slow_path_warning() -> None:
    """Say once per process that the kernels are missing and numpy does their work: the same
    values, several times slower on casts, which an install without a C compiler would
    otherwise leave for the user to discover in their throughput."""
    global _said_slow
    if _said_slow:
        return
    _said_slow = True
    warnings.warn(
        "stoker's compiled kernels (stoker._kernels) are not installed, so batches are copied and cast by "
        "numpy, the slow path (same values, several times slower on casts). Reinstall stoker where a C "
        "compiler is found (e.g. apt-get install gcc python3-dev) or from a wheel.",
        RuntimeWarning,
        stacklevel=3,
    )


def file_sizes(fds: list[int]) -> list[int]:
    """`file_size` of each descriptor, in one call where the kernels are built (a global
    shuffle's batch checks every file it reads from: hundreds on W1-big, benchmarks/w1_big.py)."""
    return _kernels.file_sizes(fds) if _kernels is not None else [os.fstat(fd).st_size for fd in fds]


def file_size(fd: int) -> int:
    """The size of open file `fd` now (`os.fstat(fd).st_size`), keeping the GIL where the
    kernels are built: `os.fstat` gives it up for a one-microsecond call, and taking it back
    waits out whichever thread took it meanwhile."""
    return _kernels.file_size(fd) if _kernels is not None else os.fstat(fd).st_size


def map_file(fd: int, size: int) -> Any:
    """A read-only memory map of open file `fd`'s first `size` bytes (`size` > 0).

    Where the kernels are built this is their `FileMap`, which keeps no file descriptor: a
    loader keeps such maps between its passes without holding files open (see
    `stoker.engine.maps.KeptMaps`). Otherwise `mmap.mmap`, which keeps a duplicate of `fd` until
    it is closed. Both give the buffer protocol, `close()` and `madvise()`.
    """
    if _kernels is not None:
        _kernels.guard_maps()
        return _kernels.FileMap(fd, size)
    return mmap.mmap(fd, size, access=mmap.ACCESS_READ)


def guard_maps() -> None:
    """Make faults in the kernels' reads of memory maps raise `MapFault`: installs their SIGBUS
    handler, again if a runtime started since (Ray's, TensorFlow's) put its own over it; nothing
    without the kernels. Called before a file is mapped."""
    if _kernels is not None:
        _kernels.guard_maps()


def maps_hold_descriptors() -> bool:
    """Whether `map_file`'s maps keep a file descriptor open (only without the kernels)."""
    return _kernels is None


def address(x: np.ndarray) -> int:
    return int(x.__array_interface__["data"][0])


def map_address(mapped: Any) -> int:
    """Where memory map `mapped` (open) begins in memory; no buffer of it outlives the call,
    so it can still be closed (unmapped)."""
    view = np.frombuffer(mapped, np.uint8, count=1)
    try:
        return address(view)
    finally:
        del view


def _codes(dst: np.ndarray, src: np.ndarray) -> tuple[str, str] | None:
    """The gather kernel's (source, output) dtype codes for a copy of `src` into `dst`, or
    None where the kernel does not apply (no build, a dtype or cast it lacks, a strided or
    read-only array). ml_dtypes' bfloat16 is "E" (its type code): as the output, from the
    sources its loops take; as the source, into float32."""
    return _dtype_codes(dst, src.dtype) if src.flags.c_contiguous else None


def _dtype_codes(dst: np.ndarray, src: np.dtype) -> tuple[str, str] | None:
    """`_codes` for contiguous records of dtype `src`."""
    if _kernels is None:
        slow_path_warning()
        return None
    if not (dst.flags.c_contiguous and dst.flags.writeable):
        return None
    if is_bfloat16(dst.dtype):
        if is_bfloat16(src):  # a copy: the kernel moves their bits as uint16
            return "H", "H"
        code = _BF16_CODES.get(src)
        return None if code is None else (code, "E")
    if is_bfloat16(src):  # widened into float32 (exact), else numpy's cast
        return ("E", "f") if dst.dtype == np.float32 else None
    s, o = _CODES.get(src), _CODES.get(dst.dtype)
    if s is None or o is None or (s != o and (s, o) not in _CASTS):
        return None
    return s, o


def cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    """`np.copyto(dst, src, casting="unsafe")`, by the compiled kernel where it applies.

    The kernel takes the arrays themselves and checks them in C (contiguity, shape, dtypes,
    a writable output), as the same checks in Python, with two `__array_interface__`
    lookups for the addresses, were a noticeable share of a worker's time.
    """
    if _kernels is None:
        slow_path_warning()
        np.copyto(dst, src, casting="unsafe")
    elif (
        not _kernels.cast_into(dst, src, STREAM_MIN_BYTES)
        and not _bfloat16_into(dst, src)
        and not _widen_bf16(dst, src)
    ):
        _kernels.flush()  # numpy may give the GIL up: send a deferred wake-up first (stoker.engine)
        np.copyto(dst, src, casting="unsafe")


def cast_mapped(dst: np.ndarray, src: np.ndarray) -> bool:
    """`cast_into` where a compiled kernel does the copy, whose reads of a map are guarded
    (a SIGBUS raises `MapFault`); False, with nothing read, where numpy would do it."""
    if _kernels is None:
        return False
    return bool(_kernels.cast_into(dst, src, STREAM_MIN_BYTES) or _bfloat16_into(dst, src) or _widen_bf16(dst, src))


def copy_records(out: np.ndarray, fd: int, mapped_at: int, offsets: np.ndarray) -> None:
    """Row `k` of `out` (uint8, `(n, record bytes)`) = the bytes at `offsets[k]` of the
    file open as `fd` and mapped at address `mapped_at`: the records numpy is to cast, copied
    out of the map by the guarded kernel, or read with `pread` where it is not built. Bytes the
    file no longer holds raise `MapFault` (`.address`: where they would be mapped)."""
    n, length = out.shape
    offsets = np.ascontiguousarray(offsets, np.int64)
    if _kernels is not None:
        if n:
            # Not streamed past the cache: numpy reads them next.
            _kernels.gather_records("B", "B", out, n, np.arange(n, dtype=np.int64), offsets + mapped_at, False)
        return
    # Records that follow one another in the file are read by one pread.
    starts = [0, *(np.flatnonzero(np.diff(offsets) != length) + 1).tolist(), n]
    for a, b in itertools.pairwise(starts):
        view = memoryview(out[a:b].reshape(-1))  # type: ignore[arg-type]  # numpy arrays are buffers
        at, done = int(offsets[a]), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], at + done)
            if got == 0:
                fault = MapFault(errno.EIO, f"file descriptor {fd} ends before byte {at + done}")
                fault.address = mapped_at + at + done  # type: ignore[attr-defined]
                raise fault
            done += got


def _elementwise(dst: np.ndarray, src: np.ndarray) -> bool:
    """Whether a loop over `dst.size` values can convert `src` into `dst` by address: the
    same shape, both C-contiguous, the output writable (what the C `cast_into` checks itself)."""
    return dst.shape == src.shape and dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.writeable


def _bfloat16_into(dst: np.ndarray, src: np.ndarray) -> bool:
    """Integer or float32 records into ml_dtypes' bfloat16 by the kernel, where it applies (numpy
    exports no buffer for that dtype, so the kernel's `cast_into` cannot take it). ml_dtypes
    casts one value at a time."""
    code = _BF16_CODES.get(src.dtype)
    if code is None or not is_bfloat16(dst.dtype) or not _elementwise(dst, src):
        return False
    if dst.size:
        _kernels.bfloat16(code, address(src), dst.size, address(dst))
    return True


def _widen_bf16(dst: np.ndarray, src: np.ndarray) -> bool:
    """bfloat16 records (`Field(dtype="bfloat16")`) into float32 by the kernel, where it applies:
    exact, each value's bits moved to the top half, as ml_dtypes' cast does one value at a time."""
    if not is_bfloat16(src.dtype) or dst.dtype != np.float32 or not _elementwise(dst, src):
        return False
    if dst.size:
        _kernels.from_bfloat16(address(src), dst.size, address(dst), dst.nbytes >= STREAM_MIN_BYTES)
    return True


def gather_into(dst: np.ndarray, rows: np.ndarray, src: np.ndarray, index: np.ndarray) -> None:
    """`dst[rows] = src[index]` (cast as `np.copyto` casts), one pass per record where the
    compiled kernel applies; numpy's fancy indexing otherwise (a copy of the records, then a
    second pass to scatter and cast them)."""
    codes = _codes(dst, src) if len(rows) == len(index) and dst.shape[1:] == src.shape[1:] else None
    if codes is None:
        dst[rows] = src[index]
    elif len(index):
        rows = np.ascontiguousarray(rows, np.int64)
        index = np.asarray(index, np.int64)
        if rows.min() < 0 or rows.max() >= len(dst) or index.min() < 0 or index.max() >= len(src):
            raise IndexError(f"gather: rows or records out of range ({len(dst)} rows, {len(src)} records)")
        gather_records(dst, rows, address(src) + index * src[0].nbytes, src.dtype)


def willneed_records(fds: np.ndarray | int, offsets: np.ndarray, length: int) -> None:
    """`POSIX_FADV_WILLNEED` on records of `length` bytes, record `k` at `offsets[k]` of
    file `fds[k]` (or of the one file `fds`), ascending within each file; records that
    follow one another share a call. The GIL is given up for the system calls where the kernels
    are built. Advice only: failures are ignored."""
    offsets = np.ascontiguousarray(offsets, np.int64)
    fds = np.full(len(offsets), int(fds), np.int64) if np.ndim(fds) == 0 else np.ascontiguousarray(fds, np.int64)
    if len(fds) != len(offsets):
        raise ValueError(f"willneed_records: {len(fds)} descriptors for {len(offsets)} records")
    if _kernels is not None:
        _kernels.willneed_records(fds, offsets, length)
        return
    for fd, off in zip(fds.tolist(), offsets.tolist(), strict=True):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)


def gathers(dst: np.ndarray, dtype: np.dtype) -> bool:
    """Whether `gather_records` copies records of `dtype` into `dst`."""
    return _dtype_codes(dst, dtype) is not None


def gather_records(dst: np.ndarray, rows: np.ndarray, addresses: np.ndarray, dtype: np.dtype) -> bool:
    """`dst[rows[k]]` = the record at memory address `addresses[k]` (`dst.shape[1:]`
    values of `dtype`, contiguous), cast as `np.copyto` casts: one pass per record, records
    from any number of files or arrays in one call. False, with nothing done, where the
    compiled kernel does not apply (see `_codes`).

    The addresses are not checked: the caller holds the memory of every record and has
    checked that each lies inside it. `rows` are checked against `dst`.
    """
    codes = _dtype_codes(dst, dtype)
    if codes is None:
        return False
    if len(rows) != len(addresses):
        raise IndexError(f"gather: {len(rows)} rows for {len(addresses)} records")
    if len(rows):  # rows are checked against dst in the kernel
        _kernels.gather_records(
            *codes, dst, len(dst), np.ascontiguousarray(rows, np.int64), np.ascontiguousarray(addresses, np.int64),
            dst.nbytes >= STREAM_MIN_BYTES,
        )  # fmt: skip
    return True


def gather_runs(dst: np.ndarray, runs: Sequence[int], dtype: np.dtype) -> bool:
    """`gather_records` of whole runs: `runs` holds four ints per run, `(row, address,
    count, stride)`: `count` records of `dtype` (`dst.shape[1:]` values each,
    contiguous), the first at memory `address` and each `stride` bytes after the one before,
    into rows `row..row + count - 1` of `dst`. One call for a batch's runs, however many;
    False, with nothing done, where the compiled kernel does not apply. Where every run's records
    lie back to back (`stride` a record's bytes) each run goes to the copy loop whole, as
    `cast_into` takes it; otherwise record by record.

    The addresses are not checked (see `gather_records`); the rows are, against `dst`.
    """
    codes = _dtype_codes(dst, dtype)
    if codes is None:
        return False
    if len(runs) % 4:
        raise ValueError(f"gather_runs: {len(runs)} ints are not (row, address, count, stride) runs")
    if runs:
        _kernels.gather_runs(*codes, dst, len(dst), array.array("q", runs), dst.nbytes >= STREAM_MIN_BYTES)
    return True


def permute(keys: np.ndarray, half: int, n: int, positions: np.ndarray) -> tuple[np.ndarray, int] | None:
    """`stoker.order.Permutation` at int64 `positions` by the compiled loop: (where
    each goes, the index of the first position outside `[0, n)` or -1), or None where the
    kernels are not built (the caller's numpy code gives the same values)."""
    if _kernels is None:
        return None
    positions = positions if positions.flags.c_contiguous else positions.copy()  # keeps a 0-d shape
    out = np.empty(positions.shape, np.int64)
    bad = _kernels.permute(np.ascontiguousarray(keys, np.uint64), half, n, positions, out)
    return out, bad
