"""stoker.machine: cores and memory bounded by the process's cgroups, read from real files laid
out as /proc/self/cgroup and /sys/fs/cgroup are in containers (v2, v1, hybrid, with and
without a cgroup namespace)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.machine import (
    available_cores,
    cgroup_cpu_limit,
    cgroup_memory_limit,
    cores_phrase,
    default_memory_budget,
    max_map_count,
    memory_budget_for,
    physical_memory,
)


def _tree(tmp: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    """A /proc/self/cgroup holding ``proc`` and a cgroup mount holding ``files`` (path -> text)."""
    root = tmp / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    proc_file = tmp / "proc-self-cgroup"
    proc_file.write_text(proc)
    return str(proc_file), str(root)


def test_v2_in_its_own_namespace_reads_the_mounted_cgroup(tmp_path: Path) -> None:
    """docker --cpus=2.5 --memory=8g: /proc/self/cgroup says "/", the container's cgroup is mounted."""
    proc, root = _tree(
        tmp_path,
        "0::/\n",
        {"cgroup.controllers": "cpu memory", "cpu.max": "250000 100000\n", "memory.max": "8589934592\n"},
    )
    assert cgroup_cpu_limit(proc, root) == 2.5
    assert cgroup_memory_limit(proc, root) == 8 << 30


def test_v2_takes_the_tightest_limit_on_the_way_up(tmp_path: Path) -> None:
    """A Kubernetes pod's limit sits on the pod's cgroup, above the container's own."""
    proc, root = _tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "cgroup.controllers": "cpu memory",
            "kubepods/cpu.max": "max 100000",
            "kubepods/pod1/cpu.max": "400000 100000",
            "kubepods/pod1/ctr/cpu.max": "max 100000",
            "kubepods/memory.max": "max",
            "kubepods/pod1/memory.max": "1073741824",
            "kubepods/pod1/ctr/memory.max": "4294967296",
        },
    )
    assert cgroup_cpu_limit(proc, root) == 4.0
    assert cgroup_memory_limit(proc, root) == 1 << 30


def test_v2_without_limits_is_none(tmp_path: Path) -> None:
    proc, root = _tree(
        tmp_path,
        "0::/user.slice\n",
        {"cgroup.controllers": "", "user.slice/cpu.max": "max 100000", "user.slice/memory.max": "max"},
    )
    assert cgroup_cpu_limit(proc, root) is None
    assert cgroup_memory_limit(proc, root) is None


def test_v1_quota_and_memory_limit(tmp_path: Path) -> None:
    proc, root = _tree(
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
            "memory/docker/abc/memory.limit_in_bytes": "2147483648",
            "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        },
    )
    assert cgroup_cpu_limit(proc, root) == 2.0
    assert cgroup_memory_limit(proc, root) == 2 << 30


def test_v1_host_path_not_mounted_inside_reads_the_mount_itself(tmp_path: Path) -> None:
    """Without a cgroup namespace /proc/self/cgroup names the host's path, which the container's
    mount does not hold: the mount is the container's cgroup."""
    proc, root = _tree(
        tmp_path,
        "4:cpu:/docker/abc\n3:memory:/docker/abc\n",
        {
            "cpu/cpu.cfs_quota_us": "150000",
            "cpu/cpu.cfs_period_us": "100000",
            "memory/memory.limit_in_bytes": "9223372036854771712",
        },
    )
    assert cgroup_cpu_limit(proc, root) == 1.5
    assert cgroup_memory_limit(proc, root) is None


def test_hybrid_reads_v2_under_unified(tmp_path: Path) -> None:
    """v1 hierarchies mounted beside a v2 one at unified/: the tmpfs above holds no v2 files."""
    files = {
        "cpu/cpu.cfs_quota_us": "-1",
        "cpu/cpu.cfs_period_us": "100000",
        "unified/cgroup.controllers": "",
        "unified/cpu.max": "100000 100000",
    }
    proc, root = _tree(tmp_path, "1:cpu:/\n0::/\n", files)
    assert cgroup_cpu_limit(proc, root) == 1.0


@pytest.mark.parametrize("text", ["", "garbage", "1:cpu\n"])
def test_unreadable_or_odd_cgroup_files_mean_no_limit(tmp_path: Path, text: str) -> None:
    proc, root = _tree(tmp_path, text, {"cgroup.controllers": "", "cpu.max": "not numbers", "memory.max": "lots"})
    assert cgroup_cpu_limit(proc, root) is None
    assert cgroup_memory_limit(proc, root) is None
    assert cgroup_cpu_limit(str(tmp_path / "missing"), root) is None
    assert cgroup_memory_limit(str(tmp_path / "missing"), root) is None


def test_this_process_gets_at_least_one_core_and_no_more_than_its_affinity() -> None:
    affinity = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    assert available_cores() == (affinity if limit is None else max(1, min(affinity, math.ceil(limit))))
    assert 0 < physical_memory() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_a_process_pinned_to_one_core_sizes_its_loader_for_one() -> None:
    """Affinity set by taskset (or a container's cpuset) bounds the cores, the default threads
    and what stats report."""
    script = (
        "import os, stoker.machine, stoker.loader\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "print(stoker.machine.available_cores(), stoker.loader.default_threads())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["1", "1"]


def test_a_loader_on_one_core_says_one_core(tmp_path: Path) -> None:
    """The figures and the autotune's reason name the count of cores in the singular for one."""
    script = (
        "import os, sys, stoker\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "d = stoker.write_sample(sys.argv[1], pairs=2, records=64, inrez=8)\n"
        "ds = stoker.Dataset(image=stoker.Field(str(d / 'img_*.bin'), 'int8', (8, 8, 1)),\n"
        "                    label=stoker.Field(str(d / 'out_*.bin.gz'), 'float32'))\n"
        "with ds.loader(16, epochs=2) as loader:\n"
        "    n = sum(1 for _ in loader)\n"
        "    print(n, loader.stats())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.startswith("16 ")
    assert " of 1 core; " in done.stdout and "1 cores" not in done.stdout
    assert cores_phrase(1) == "1 core" and cores_phrase(2) == "2 cores" and cores_phrase(0) == "0 cores"


def test_the_mapping_limit_is_the_kernels() -> None:
    with open("/proc/sys/vm/max_map_count") as f:
        assert max_map_count() == int(f.read())


def test_the_soft_descriptor_limit_is_set_within_the_hard_one() -> None:
    """In a child: lowered, raised back, and refused above the hard limit (left as it was)."""
    script = (
        "import resource, stoker.machine as m\n"
        "soft, hard = m.descriptor_limits()\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (200, 300))\n"
        "print(m.descriptor_limits(), m.set_soft_descriptor_limit(250), m.descriptor_limits(),\n"
        "      m.set_soft_descriptor_limit(301), m.descriptor_limits())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "(200, 300) True (250, 300) False (250, 300)"


@pytest.mark.parametrize(
    ("memory", "budget"),
    [(128 << 30, 32 << 30), (16 << 30, 4 << 30), (2 << 30, 512 << 20), (1 << 30, 512 << 20), (512 << 20, 256 << 20),
     (0, 512 << 20)],
)  # fmt: skip
def test_the_default_memory_budget_is_a_quarter_of_memory_and_at_least_512mib(memory: int, budget: int) -> None:
    assert default_memory_budget(memory) == budget


def test_a_loader_takes_its_memory_budget_from_the_memory_the_process_may_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    import stoker
    import stoker.machine

    np.zeros(64, np.float32).tofile(tmp_path / "x.bin")
    ds = stoker.Dataset(x=stoker.Field(str(tmp_path / "x.bin"), "float32"))
    with ds.loader(8) as loader:
        assert loader.memory_budget == default_memory_budget() == default_memory_budget(physical_memory())
    # physical_memory() is the RAM bounded by the cgroup's limit (tested above): an 8 GiB container.
    monkeypatch.setattr(stoker.machine, "physical_memory", lambda: 8 << 30)
    with ds.loader(8) as loader, ds.loader(8, memory_budget="1GiB") as given:
        assert loader.memory_budget == 2 << 30 and given.memory_budget == 1 << 30


@pytest.mark.parametrize(
    ("memory", "room", "budget"),
    [(16 << 30, None, 4 << 30), (16 << 30, 1 << 30, 256 << 20), (16 << 30, 64 << 40, 4 << 30),
     (0, 400 << 20, 100 << 20), (16 << 30, 0, 1), (16 << 30, -(1 << 30), 1)],
)  # fmt: skip
def test_the_budget_is_at_most_a_quarter_of_the_address_space_left(memory: int, room: int | None, budget: int) -> None:
    assert memory_budget_for(memory, room) == budget


def test_address_space_room_reads_the_limits_against_proc_status(tmp_path: Path) -> None:
    """In a child: RLIMIT_AS less VmSize, RLIMIT_DATA less VmData, the smaller; None without limits."""
    status = tmp_path / "status"
    status.write_text("Name:\tx\nVmSize:\t  1024 kB\nVmData:\t   512 kB\n")
    script = (
        "import resource, stoker.machine as m\n"
        f"print(m.address_space_room({str(status)!r}), m.address_space_limit())\n"
        "resource.setrlimit(resource.RLIMIT_AS, (64 << 30, resource.RLIM_INFINITY))\n"
        f"print(m.address_space_room({str(status)!r}), m.address_space_limit())\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (1 << 20, resource.RLIM_INFINITY))\n"
        f"print(m.address_space_room({str(status)!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split("\n")[:3] == ["None None", f"{(64 << 30) - (1 << 20)} {64 << 30}", str(512 << 10)]


# A child that limits its address space (`ulimit -v`) to what it maps now, the loader's threads
# (a stack and a malloc arena each, for up to twice the cores), and EXTRA bytes, then reads
# three epochs: it prints what it delivered and the StokerError it raised, if any.
_LIMITED = """
import json, resource, sys
import numpy as np
import stoker
from stoker.cli.sample import expected_label
from stoker.machine import available_cores

directory, extra, shuffle = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ds = stoker.Dataset(image=stoker.Field(directory + "/img_*.bin", "int8", (128, 128, 1)),
                    label=stoker.Field(directory + "/out_*.bin.gz", "float32"))
total = len(ds)
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
threads = (2 * available_cores() + 2) * (72 << 20)
resource.setrlimit(resource.RLIMIT_AS, (vm + threads + extra, resource.getrlimit(resource.RLIMIT_AS)[1]))
epochs = []
out = {"error": None}
try:
    with ds.loader(256, epochs=3, cast="float32", shuffle=None if shuffle == "none" else shuffle, seed=0) as loader:
        for batch in loader:
            ids = expected_label(batch["image"]).astype(np.int64)
            assert np.array_equal(ids, batch["label"].astype(np.int64))
            if not epochs or len(epochs[-1]) == total:
                epochs.append([])
            epochs[-1].extend(ids.tolist())
except stoker.StokerError as e:
    out["error"] = f"{type(e).__name__}: {e}"
out["epochs"] = [sorted(e) == list(range(total)) for e in epochs]
out["delivered"] = sum(len(e) for e in epochs)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 files of 32 MiB of 128x128 frames (and their labels): 128 MiB to map."""
    import stoker

    return stoker.write_sample(tmp_path_factory.mktemp("frames"), pairs=4, records=2048, inrez=128)


def _limited(frames: Path, extra: int, shuffle: str) -> dict:
    import json

    done = subprocess.run([sys.executable, "-c", _LIMITED, str(frames), str(extra), shuffle], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("shuffle", ["none", "global"])
def test_under_ulimit_v_the_default_budget_reads_every_epoch_exactly_once(frames: Path, shuffle: str) -> None:
    """200 MiB beside the threads: the quarter of RAM the budget was (GiBs) and the maps kept of
    every file ran the process out of address space in the middle of epoch 0 (ENOMEM)."""
    got = _limited(frames, 200 << 20, shuffle)
    assert got["error"] is None and got["epochs"] == [True, True, True] and got["delivered"] == 3 * 4 * 2048


def test_under_a_tight_ulimit_v_the_loader_refuses_before_any_batch_naming_the_limit(frames: Path) -> None:
    got = _limited(frames, 20 << 20, "none")
    assert got["delivered"] == 0
    assert got["error"].startswith("SpecError: memory_budget=None (") and "holds less than one batch" in got["error"]
    assert "RLIMIT_AS, `ulimit -v`: " in got["error"]


_MAP = """
import json, resource, sys
import numpy as np
import stoker
from stoker.cli.sample import expected_label

ds = stoker.Dataset(image=stoker.Field(sys.argv[1] + "/img_*.bin", "int8", (128, 128, 1)))
out = {"error": None, "ids": []}
try:
    with ds.loader(64, threads=1, cycle_length=1, block_length=2048, prefetch=2, memory_budget="8MiB") as loader:
        for batch in loader:
            out["ids"] += expected_label(batch["image"]).astype(np.int64).tolist()
            if len(out["ids"]) == 64:  # the loader's thread runs: its stack and arena are mapped now
                with open("/proc/self/status") as f:
                    vm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
                resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
except stoker.StokerError as e:
    out["error"] = f"{type(e).__name__}: {e}"
    out["path"] = e.path
print(json.dumps(out))
"""


def test_a_file_the_address_space_cannot_map_is_a_read_error_naming_it_and_the_limit(frames: Path) -> None:
    """8 MiB left once the first file is mapped: the second (32 MiB) cannot be."""
    import json

    done = subprocess.run([sys.executable, "-c", _MAP, str(frames)], capture_output=True, text=True, timeout=300)
    got = json.loads(done.stdout)
    second = str(frames / "img_0001.bin")
    assert got["error"].startswith(f"ReadError: field 'image': cannot map {second!r} (33554432 bytes): ")
    assert "RLIMIT_AS, `ulimit -v`: " in got["error"] and got["path"] == second
    assert got["ids"] == list(range(len(got["ids"]))) and len(got["ids"]) <= 2048  # the first file's, in order
