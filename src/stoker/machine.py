"""What this process may use of the machine: cores and memory, container limits included, and
its limits on open descriptors and memory mappings; and how it opens a file for reading
without hanging on one that is not a regular file.

A container's CPU quota (`docker run --cpus`, a Kubernetes CPU limit) and memory limit are
cgroup settings: `os.sched_getaffinity` still lists every core of the host and `sysconf`
all of its RAM. A loader sized by those on a 64-core node with a 4-CPU limit would start 64
workers that the quota throttles in turn, report "CPU 6% of 64 cores" to a user who asked
why their CPUs look idle, and take a 100 GiB dataset for one that fits in the page cache of an
8 GiB container (no drop-behind: stoker.io.readahead). So both are bounded by the limits of the
process's cgroup and of every cgroup above it, cgroup v2 (`cpu.max`, `memory.max`) or v1
(`cpu.cfs_quota_us`/`cpu.cfs_period_us`, `memory.limit_in_bytes`).
"""

from __future__ import annotations

import errno
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = [
    "address_space_limit",
    "address_space_note",
    "address_space_room",
    "available_cores",
    "cores_phrase",
    "cgroup_cpu_limit",
    "cgroup_memory_limit",
    "default_memory_budget",
    "descriptor_limits",
    "max_map_count",
    "memory_budget_for",
    "open_regular",
    "physical_memory",
    "set_soft_descriptor_limit",
    "thread_address_space",
]

PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
T = TypeVar("T", int, float)

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value.
_V1_UNLIMITED = 1 << 62
# Linux's default vm.max_map_count: memory mappings a process may hold.
DEFAULT_MAX_MAP_COUNT = 65530
# memory_budget's floor where the machine has the memory for it (the fixed default it replaces).
MIN_MEMORY_BUDGET = 512 << 20
# Address space glibc reserves for each thread's malloc arena on 64-bit Linux (HEAP_MAX_SIZE).
_MALLOC_ARENA = 64 << 20


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, and no more than its cgroup's CPU
    quota, rounded up (a limit of 2.5 CPUs gives 3)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        cores = max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_limit()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def cores_phrase(n: int) -> str:
    """`"1 core"`, `"2 cores"`: how the figures and verdicts name a count of cores."""
    return f"{n} core" if n == 1 else f"{n} cores"


def physical_memory() -> int:
    """Bytes of memory this process may use: the RAM, and no more than its cgroup's memory
    limit; 0 where unknown."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover - not on Linux
        ram = 0
    limit = cgroup_memory_limit()
    if limit is None:
        return ram
    return min(ram, limit) if ram else limit


def default_memory_budget(memory: int | None = None) -> int:
    """A loader's `memory_budget` by default: `memory_budget_for` this process's memory
    (`physical_memory()`, a container's limit included, unless `memory` is given) and the
    address space it may still map (`address_space_room()`) once the threads a loader may run
    (up to twice the cores, see stoker.engine.autotune, and the consumer's) have theirs."""
    room = address_space_room()
    if room is not None:
        room -= _threads_address_space()
    return memory_budget_for(physical_memory() if memory is None else memory, room)


def _threads_address_space() -> int:
    return (2 * available_cores() + 2) * thread_address_space()


def address_space_note() -> str:
    """Why the default budget is what it is where RLIMIT_AS bounds it (for an error that names
    the budget); "" where there is no such limit."""
    limit, room = address_space_limit(), address_space_room()
    if limit is None or room is None:
        return ""
    return (
        f"; the default memory_budget is a quarter of the address space this process may still map under "
        f"its limit (RLIMIT_AS, `ulimit -v`: {limit} bytes, {room} of them free, less "
        f"{_threads_address_space()} for the loader's threads): raise the limit, or give memory_budget= "
        "and a batch_size that fit"
    )


def thread_address_space() -> int:
    """Address space a thread takes once it runs Python and numpy: its stack (RLIMIT_STACK, 8 MiB
    where unlimited, glibc's default then) and the malloc arena glibc reserves for it (64 MiB)."""
    stack = 8 << 20
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
        if soft != resource.RLIM_INFINITY and soft > 0:
            stack = soft
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on POSIX
        pass
    return stack + _MALLOC_ARENA


def memory_budget_for(memory: int, room: int | None = None) -> int:
    """A quarter of `memory`, at least 512 MiB (half of it where that is below 1 GiB; 512 MiB
    where it is unknown, 0), and no more than a quarter of `room`, the address space left under
    the process's limits (None: unlimited).

    A fixed 512 MiB held a batch of 1024 of W1 (benchmarks/w1.py) to a prefetch of 3 on a 16-core host, where each
    worker needs a batch to fill. tf.data's autotune lets its buffers take half of the RAM;
    stoker takes a quarter, leaving the rest to the page cache that holds the files it reads
    and to the framework's own host memory. It is a bound, not an allocation: the default
    prefetch stays at a few batches more than the workers (stoker.engine.autotune.wanted_prefetch),
    so only large batches come near it.

    Under `ulimit -v` (RLIMIT_AS) every map counts, not only memory in use: the maps of the data
    files, each thread's stack and malloc arena, the framework's own. The budget is a quarter of
    what is left, so those fit beside it; a budget that then holds no batch is a SpecError when
    the loader is built, never an ENOMEM in the middle of an epoch.

    Example:
        >>> memory_budget_for(16 << 30) == 4 << 30
        True
        >>> memory_budget_for(16 << 30, room=1 << 30) == 256 << 20
        True
    """
    budget = MIN_MEMORY_BUDGET if memory <= 0 else max(min(MIN_MEMORY_BUDGET, memory // 2), memory // 4)
    # At least a byte: a budget that holds no batch is then the loader's error saying so.
    return budget if room is None else max(1, min(budget, room // 4))


def address_space_limit() -> int | None:
    """The process's soft limit on its address space (RLIMIT_AS, `ulimit -v`) in bytes; None
    where there is none."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on POSIX
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


def address_space_room(status: str = "/proc/self/status") -> int | None:
    """Bytes this process may still map: RLIMIT_AS less its address space now (VmSize), and
    RLIMIT_DATA less its private writable maps (VmData: numpy's arrays, the loader's buffers);
    the smaller of the two, or None where neither limit is set or /proc cannot be read."""
    try:
        import resource

        limits = {"VmSize": resource.RLIMIT_AS, "VmData": resource.RLIMIT_DATA}
        soft = {key: resource.getrlimit(which)[0] for key, which in limits.items()}
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on POSIX
        return None
    soft = {k: v for k, v in soft.items() if v != resource.RLIM_INFINITY and v >= 0}
    if not soft:
        return None
    used: dict[str, int] = {}
    try:
        with open(status) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in soft and value.split():
                    used[key] = int(value.split()[0]) << 10  # in kB
    except (OSError, ValueError):
        return None
    rooms = [max(0, limit - used[key]) for key, limit in soft.items() if key in used]
    return min(rooms) if rooms else None


def descriptor_limits() -> tuple[int, int]:
    """The process's (soft, hard) limits on open descriptors; an unlimited one as 65536."""
    try:
        import resource

        limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on POSIX
        return 1024, 1024
    soft, hard = (1 << 16 if x == resource.RLIM_INFINITY or x < 0 else x for x in limits)
    return soft, hard


def set_soft_descriptor_limit(soft: int) -> bool:
    """Set the soft limit on open descriptors (the hard one unchanged); False where refused."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    except (ImportError, OSError, ValueError):
        return False
    return True


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}  # fmt: skip


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file `path`; OSError for anything else.

    Opened with O_NONBLOCK, so that a FIFO (or a device) put where a file was answers at once
    instead of blocking the open until a writer comes: an open of a FIFO blocks even a Ctrl-C's
    shutdown. The flag is cleared once the file is known to be regular. Raises OSError(EINVAL)
    naming what the path is instead, as in "not a regular file (a FIFO)".
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = _KINDS.get(stat.S_IFMT(mode), "of another kind")
            raise OSError(errno.EINVAL, f"not a regular file ({what})", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def max_map_count() -> int:
    """Memory mappings this process may hold (Linux's `vm.max_map_count`; its default where unknown)."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            return int(f.read().strip() or DEFAULT_MAX_MAP_COUNT)
    except (OSError, ValueError):  # not Linux, or /proc not mounted
        return DEFAULT_MAX_MAP_COUNT


def cgroup_cpu_limit(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> float | None:
    """The CPUs this process's cgroups allow (quota / period, the smallest on the way up to the
    root), or None where none is set or the files cannot be read."""
    return _tightest(proc_cgroup, root, lambda d: _cpu_max(d / "cpu.max"), "cpu", _cfs)


def cgroup_memory_limit(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> int | None:
    """The bytes this process's cgroups allow (the smallest on the way up to the root), or None
    where none is set or the files cannot be read."""
    return _tightest(
        proc_cgroup, root, lambda d: _bytes(d / "memory.max"), "memory", lambda d: _bytes(d / "memory.limit_in_bytes")
    )


def _tightest(
    proc_cgroup: str, root: str, v2: Callable[[Path], T | None], controller: str, v1: Callable[[Path], T | None]
) -> T | None:
    """The smallest limit `v2` reads in a directory of the v2 hierarchy, or `v1` in one of
    v1's hierarchy holding `controller`, over the process's cgroup and those above it."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    found = [x for x in map(v2, _dirs(lines, root, None)) if x is not None]
    found += [x for x in map(v1, _dirs(lines, root, controller)) if x is not None]
    return min(found) if found else None


def _dirs(lines: list[str], root: str, controller: str | None) -> list[Path]:
    """The directories of the cgroup named in `lines` (/proc/self/cgroup's) and of those above
    it: of the v2 hierarchy (`controller` None) or of v1's hierarchy holding `controller`.

    In a container with its own cgroup namespace, /proc/self/cgroup says "/" and the
    container's cgroup is what is mounted; without one it names the host's path, which may not
    be mounted inside: then the mount's own directory is the container's cgroup.
    """
    out: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controller is None:
            if parts[0] != "0" or controllers:
                continue
            # Mounted alone, or beside v1's hierarchies (hybrid); v2 has cgroup.controllers.
            mounts = [m for m in (Path(root), Path(root) / "unified") if (m / "cgroup.controllers").is_file()]
        else:
            if controller not in controllers.split(","):
                continue
            mounts = [m for m in (Path(root) / controllers, Path(root) / controller) if m.is_dir()]
        for mount in mounts:
            d = mount / path.lstrip("/")
            if not d.is_dir():
                d = mount
            while True:
                out.append(d)
                if d == mount:
                    break
                d = d.parent
            break
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpu_max(path: Path) -> float | None:
    """cgroup v2's `cpu.max`: "QUOTA PERIOD" or "max PERIOD"."""
    text = _read(path)
    if not text:
        return None
    fields = text.split()
    try:
        if fields[0] == "max":
            return None
        period = int(fields[1]) if len(fields) > 1 else 100_000
        return int(fields[0]) / period if period > 0 else None
    except ValueError:
        return None


def _cfs(d: Path) -> float | None:
    """cgroup v1's CFS quota in CPUs (a quota of -1: none)."""
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _bytes(path: Path) -> int | None:
    """A memory limit in bytes ("max", or v1's near-2**63 value: none)."""
    text = _read(path)
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _V1_UNLIMITED else None
