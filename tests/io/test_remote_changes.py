"""Objects replaced in the bucket after the Dataset was built, on S3 servers on 127.0.0.1 (moto and
SeaweedFS) and memory://.

Every record carries its global id (tests/helpers/indexed.py's layout: an int8 frame whose first
4 bytes hold it, a gzip float32 label equal to it). Between two batches of an epoch one group's
object of one field is replaced by one of the same size holding other ids (+ NEW): a read of it
would pair new images with old labels or the other way round, or inflate a gzip stream from
another's bytes. Each test checks what the loader
yielded record by record: image and label of the same id, that id the record's place in the
dataset, none of the new ids, none twice; and then, where the bucket keeps versions, the whole
epoch read of the old version; where it does not, a CorruptDataError naming the object's URL.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import fsspec
import numpy as np
import pytest

import stoker
from stoker.engine import decoded
from stoker.io import remote
from tests.helpers.indexed import ids_of
from tests.helpers.resources import consume
from tests.helpers.s3 import s3_options

pytestmark = pytest.mark.remote

R = 2  # frames of R x R x 1 int8: 4 bytes, the record's id
COUNTS = [300, 150, 100]
NEW = 1_000_000  # what the replacing objects add to every id (exact in float32)
REPLACED = 0  # the group whose object is replaced: read first in order, mid-object after a batch


def _gzip(data: bytes, size: int) -> bytes:
    """`data` as one gzip member of exactly `size` bytes, a header comment (FCOMMENT) padding it:
    a replacement the same size as the object it replaces, its deflate data at other offsets."""
    body = zlib.compress(data, 1, wbits=-15)
    pad = size - 10 - len(body) - 1 - 8
    assert pad >= 0
    header = b"\x1f\x8b\x08\x10" + bytes(4) + b"\x00\xff" + b"c" * pad + b"\x00"
    return header + body + struct.pack("<II", zlib.crc32(data), len(data))


def _objects(ids: np.ndarray) -> dict[str, bytes]:
    """The image (raw) and label (gzip) objects of a group holding records `ids`, their sizes
    set by the count alone."""
    labels = ids.astype("<f4").tobytes()
    return {"img": ids.astype("<u4").tobytes(), "out": _gzip(labels, len(labels) + 64)}


def _group_ids(g: int, new: bool = False) -> np.ndarray:
    start = sum(COUNTS[:g])
    return np.arange(start, start + COUNTS[g], dtype=np.int64) + (NEW if new else 0)


_KEYS = {"image": ("img", ".bin"), "label": ("out", ".bin.gz")}


@dataclass
class Store:
    """A bucket on one S3 server: its client, name and the storage_options that read it."""

    client: Any
    bucket: str
    options: dict[str, Any]

    def put(self, g: int, field: str, *, new: bool = False) -> str:
        """Group `g`'s object of `field` (its new ids where `new`): its URL."""
        stem, suffix = _KEYS[field]
        key = f"data/{stem}_{g:04d}{suffix}"
        self.client.put_object(Bucket=self.bucket, Key=key, Body=_objects(_group_ids(g, new))[stem])
        return f"s3://{self.bucket}/{key}"

    def dataset(self) -> stoker.Dataset:
        base = f"s3://{self.bucket}/data"
        return stoker.Dataset(
            image=stoker.Field(f"{base}/img_*.bin", "int8", (R, R, 1), storage_options=self.options),
            label=stoker.Field(f"{base}/out_*.bin.gz", "float32", storage_options=self.options),
        )


_buckets = itertools.count()


def _moto(url: str) -> tuple[Any, dict[str, Any]]:
    client = boto3.client(
        "s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    return client, s3_options(url)


@pytest.fixture(params=["moto", "seaweed"])
def server(request: pytest.FixtureRequest) -> tuple[Any, dict[str, Any]]:
    """(a boto3 client, storage_options) of moto or of the session's SeaweedFS."""
    if request.param == "moto":
        return _moto(request.getfixturevalue("moto_url"))
    seaweed = request.getfixturevalue("seaweed")
    return seaweed.boto3(), seaweed.options()


def _store(server: tuple[Any, dict[str, Any]], *, versioned: bool) -> Store:
    client, options = server
    bucket = f"stoker-changes-{next(_buckets)}"
    client.create_bucket(Bucket=bucket)
    if versioned:
        client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    store = Store(client, bucket, options)
    for g in range(len(COUNTS)):
        for field in _KEYS:
            store.put(g, field)
    return store


@pytest.fixture
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 64 bytes, 2 GETs in flight: most of the epoch is read after the first batch, each
    label stream in several parts (group 0's in 20); labels inflated as streams, not decoded whole."""
    monkeypatch.setattr(remote, "PART_BYTES", 64)
    monkeypatch.setattr(decoded, "VERIFY_WHOLE_BYTES", 64)
    # A gather's records a GET each: read through the holes, every batch would read whole files.
    monkeypatch.setattr(remote, "_GAP_BYTES", 1)


def _epoch_replacing(
    ds: stoker.Dataset, replace: Any, *, after: int = 1, **kw: Any
) -> tuple[list[dict[str, np.ndarray]], Any]:
    """An epoch of `ds` with `replace()` called after its first `after` batches: (batches, error or None)."""
    # prefetch given: batches one at a time, not assembled together (an epoch of small batches is one assembly)
    with ds.loader(8, with_index=True, num_parallel_reads=2, threads=2, prefetch=2, **kw) as loader:
        it = iter(loader)
        first, err = consume(itertools.islice(it, after), timeout=60)
        assert err is None and len(first) == after
        replace()
        rest, err = consume(it, timeout=60)
    return [*first, *rest], err


def _check_pairs(batches: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The ids yielded, after checking each record: image and label agree, and the id is the
    record's place in the dataset (none of the new objects' ids)."""
    ids = ids_of(batches)  # asserts every image met its own label
    starts = np.cumsum([0, *COUNTS])
    where = np.concatenate([starts[b["__group__"]] + b["__index__"] for b in batches] or [ids])
    np.testing.assert_array_equal(ids, where)
    return ids


@pytest.mark.parametrize("versioned", [False, True], ids=["unversioned", "versioned"])
@pytest.mark.parametrize("shuffle", [None, "global"])
@pytest.mark.parametrize("field", ["image", "label"])
def test_an_object_replaced_mid_epoch_is_never_read_with_the_old_ones(
    server: tuple[Any, dict[str, Any]], small_reads: None, field: str, shuffle: str | None, versioned: bool
) -> None:
    """Sequential order: the object is replaced while it is being read (the label's gzip stream
    inflated part after part). A global shuffle decodes each compressed file whole where the pass
    first touches it and holds it for the pass, so the label is replaced before the pass starts."""
    store = _store(server, versioned=versioned)
    ds = store.dataset()
    url = f"s3://{store.bucket}/data/{_KEYS[field][0]}_{REPLACED:04d}{_KEYS[field][1]}"
    order = {"shuffle": shuffle, "seed": 3} if shuffle else {"cycle_length": 1}
    after = 0 if shuffle and field == "label" else 1
    batches, err = _epoch_replacing(ds, lambda: store.put(REPLACED, field, new=True), after=after, **order)
    ids = _check_pairs(batches)
    assert len(set(ids.tolist())) == len(ids)
    if versioned:  # the version the Dataset was built on is read on, whole
        assert err is None
        assert sorted(ids.tolist()) == list(range(sum(COUNTS)))
    else:
        assert isinstance(err, stoker.CorruptDataError), err
        assert err.path == url and err.field == field
        assert f"{url!r} changed since the Dataset was built" in str(err)
        assert len(ids) < sum(COUNTS)


@pytest.mark.parametrize("versioned", [False, True], ids=["unversioned", "versioned"])
def test_random_access_after_a_replacement_reads_the_old_version_or_names_the_url(
    moto_url: str, small_reads: None, versioned: bool
) -> None:
    store = _store(_moto(moto_url), versioned=versioned)
    ds = store.dataset()
    picks = [5, 350, 299, 120, 500]  # groups 0, 1, 0, 0, 2
    for field in _KEYS:
        url = store.put(REPLACED, field, new=True)
        if versioned:
            got = ds.read(picks)
            np.testing.assert_array_equal(got["label"], np.array(picks, np.float32))
            np.testing.assert_array_equal(ids_of([got]), picks)
        else:
            with pytest.raises(stoker.CorruptDataError, match="changed since the Dataset was built") as e:
                ds.read(picks)
            assert e.value.path == url and e.value.field == field
            store.put(REPLACED, field)  # back to the old ids (a new object all the same)


@contextlib.contextmanager
def _in_memory(name: str) -> Iterator[tuple[fsspec.AbstractFileSystem, str]]:
    mem = fsspec.filesystem("memory")
    base = f"memory:///stoker-changes-{name}"
    for g in range(len(COUNTS)):
        objects = _objects(_group_ids(g))
        mem.pipe(f"{base}/img_{g:04d}.bin", objects["img"])
        mem.pipe(f"{base}/out_{g:04d}.bin.gz", objects["out"])
    try:
        yield mem, base
    finally:
        mem.rm(base, recursive=True)


@pytest.mark.parametrize("field", ["image", "label"])
def test_a_filesystem_without_etags_is_held_to_size_and_mtime(small_reads: None, field: str) -> None:
    """memory:// keeps no ETag or version: a replacement of the same size is told by its time."""
    with _in_memory(field) as (mem, base):
        ds = stoker.Dataset(
            image=stoker.Field(f"{base}/img_*.bin", "int8", (R, R, 1)),
            label=stoker.Field(f"{base}/out_*.bin.gz", "float32"),
        )
        stem, suffix = _KEYS[field]
        url = f"{base}/{stem}_{REPLACED:04d}{suffix}"
        new = _objects(_group_ids(REPLACED, new=True))[stem]
        assert len(new) == mem.info(url)["size"]
        batches, err = _epoch_replacing(ds, lambda: mem.pipe(url, new), cycle_length=1)
        ids = _check_pairs(batches)
        assert len(set(ids.tolist())) == len(ids)
        assert isinstance(err, stoker.CorruptDataError), err
        assert err.path == url and f"{url!r} changed since the Dataset was built" in str(err)
        assert len(ids) < sum(COUNTS)


def test_a_version_deleted_for_good_is_an_error_naming_the_url_and_a_deleted_key_is_read_on(
    moto_url: str, small_reads: None
) -> None:
    """Versioning on: deleting the key leaves the version the Dataset read (a delete marker on
    top); deleting that version itself (a lifecycle rule, DeleteObject with its id) cannot be read on."""
    store = _store(_moto(moto_url), versioned=True)
    ds = store.dataset()
    url = f"s3://{store.bucket}/data/img_0000.bin"
    key = "data/img_0000.bin"
    store.client.delete_object(Bucket=store.bucket, Key=key)
    np.testing.assert_array_equal(ids_of([ds.read([3, 299])]), [3, 299])
    version = store.client.list_object_versions(Bucket=store.bucket, Prefix=key)["Versions"]
    store.client.delete_object(Bucket=store.bucket, Key=key, VersionId=version[0]["VersionId"])
    with pytest.raises(stoker.CorruptDataError, match="changed since the Dataset was built") as e:
        ds.read([3, 299])
    assert e.value.path == url and e.value.field == "image" and url in str(e.value)
