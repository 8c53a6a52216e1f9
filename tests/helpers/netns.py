"""Run test servers in a loopback-only network namespace.

TensorFlow's gRPC servers (MultiWorkerMirroredStrategy workers, the tf.data service) and Ray
bind every interface with no setting to narrow it; inside a fresh network namespace whose only
interface is ``lo``, nothing they open can be reached from outside this machine's loopback.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_loopback_only(
    commands: Sequence[Sequence[str]], logs: Sequence[Path], *, timeout: float, env: Mapping[str, str] | None = None
) -> list[int]:
    """Run ``commands`` side by side in one new loopback-only namespace; each one's exit status.

    Each command's output goes to its log. On timeout the whole process group is killed and
    the statuses of the commands that did not finish are reported as -9.
    """
    rcs = [log.with_suffix(".rc") for log in logs]
    lines = ["ip link set lo up || exit 97"]
    for command, log, rc in zip(commands, logs, rcs, strict=True):
        cmd = shlex.join(command)
        lines.append(f"( {cmd} >{shlex.quote(str(log))} 2>&1; echo $? >{shlex.quote(str(rc))} ) &")
    lines.append("wait")
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", "\n".join(lines)], start_new_session=True, env=env)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:  # a server left waiting on its peer: the group goes, by its id
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    if proc.returncode == 97:
        raise RuntimeError("could not bring up lo in a new network namespace (unshare -n needs root)")
    return [int(rc.read_text()) if rc.exists() else -9 for rc in rcs]
