"""A small file generator and an independent reader, shared by the tests.

Nothing here uses stoker to write or read records: the generator writes bytes with numpy,
gzip and zlib, and the reader decodes them with ``np.frombuffer`` / ``gzip.decompress``,
so a test that compares stoker's batches with ``read_records`` checks stoker against an
independent reading of the same files.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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


# The pair most tests read: raw int8 images and gzip float32 labels.
IMG = FieldPlan("img", "int8", (6, 6, 1))
LAB_GZ = FieldPlan("out", "float32", (), kind="gzip")


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


def sample_images(ds: stoker.Dataset) -> np.ndarray:
    """Every image record of a `small_sample`, read straight from its files, indexed by global record index."""
    shape = ds.fields["image"].shape
    return np.concatenate([np.fromfile(infos["image"].path, np.int8) for infos in ds.files]).reshape(-1, *shape)


def small_sample(directory: Path, *, pairs: int, records: int, inrez: int = 16) -> stoker.Dataset:
    """``stoker.write_sample`` into ``directory`` and the Dataset over it (int8 images, gzip labels)."""
    stoker.write_sample(directory, pairs=pairs, records=records, inrez=inrez)
    return stoker.Dataset(
        image=stoker.Field(str(directory / "img_*.bin"), "int8", (inrez, inrez, 1)),
        label=stoker.Field(str(directory / "out_*.bin.gz"), "float32"),
    )
