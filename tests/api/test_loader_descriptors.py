"""Datasets of more files than the process may open: every order and random access stay under the
soft descriptor limit (RLIMIT_NOFILE), and a descriptor refused is a ReadError naming the file.

Each case runs in a subprocess whose limit is lowered (soft and hard, so that a global shuffle
cannot raise it), over thousands of one-record groups written by tests.helpers.indexed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO, indexed

GROUPS = 3000  # one record each: 6,000 files, images raw and labels gzip

_PASSES = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    from tests.helpers import indexed
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    ds = indexed.open_dataset(__import__("pathlib").Path(sys.argv[1]))
    out = {}
    for shuffle in (None, "files", "global"):
        with ds.loader(256, shuffle=shuffle, seed=7, epochs=2) as loader:
            out[str(shuffle)] = indexed.ids_of(list(loader)).tolist()
    out["read"] = indexed.ids_of([ds.read(np.arange(len(ds))[::-1])]).tolist()
    subset = ds.select(records=np.arange(0, len(ds), 2))
    with subset.loader(128, shuffle="global", seed=7) as loader:
        out["subset global"] = indexed.ids_of(list(loader)).tolist()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def many_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("many")
    indexed.write_dataset(directory, [1] * GROUPS)
    return directory


def _python(script: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("limit", [256, 1024])
def test_thousands_of_one_record_files_read_in_every_order_under_the_descriptor_limit(
    many_files: Path, limit: int
) -> None:
    done = _python(_PASSES, many_files, limit)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    everything = list(range(GROUPS))
    for order in ("None", "files", "global"):
        assert sorted(got[order]) == sorted(everything * 2), order  # each record once an epoch
    assert got["read"] == everything[::-1]
    assert sorted(got["subset global"]) == everything[::2]


_ONE_LEFT = textwrap.dedent(
    """
    import os, resource, sys
    import numpy as np
    import stoker
    from tests.helpers import indexed
    ds = indexed.open_dataset(__import__("pathlib").Path(sys.argv[1]))
    ds.read(np.array([0]))  # what random access imports and sets up, before the descriptors run out
    limit = 200
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    mine = []
    try:
        while True:
            mine.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    os.close(mine.pop())  # one descriptor left: a data file opens, but its map cannot be made
    try:
        ds.read(np.arange(10, 20))
    except OSError as e:
        print(type(e).__name__, isinstance(e, stoker.StokerError), e.path, "|", e)
    """
)


def test_a_descriptor_refused_to_random_access_is_a_read_error_naming_the_file(many_files: Path) -> None:
    done = _python(_ONE_LEFT, many_files)
    assert done.returncode == 0, done.stderr[-3000:]
    kind, is_stoker, path, _, message = done.stdout.split(" ", 4)
    assert (kind, is_stoker) == ("ReadError", "True"), done.stdout
    assert Path(path).parent == many_files and Path(path).name in message and "Too many open files" in message
