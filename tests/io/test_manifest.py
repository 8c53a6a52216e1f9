"""The manifest of a dataset in object storage: a Dataset built from it makes no listing, no
`info` and no header/trailer read, whatever the number of objects; reads are held to its versions.

Requests are counted where they happen: on fsspec's memory filesystem by wrapping its methods,
on S3 (moto on 127.0.0.1) by an HTTP proxy in front of the server that records every request.
Every record carries its global id (tests/helpers/indexed.py's layout): each test checks each
record's image against its own label.
"""

from __future__ import annotations

import collections
import gzip
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import fsspec
import numpy as np
import pytest

import stoker
from stoker.io.manifest import MANIFEST_NAME
from tests.helpers.indexed import ids_of
from tests.helpers.s3 import s3_options
from tests.helpers.s3server import CountingProxy

pytestmark = pytest.mark.remote

R = 2  # frames of R x R x 1 int8: 4 bytes, the record's id
PER_GROUP = 5
_stores = itertools.count()


def _objects(g: int) -> dict[str, bytes]:
    ids = np.arange(g * PER_GROUP, (g + 1) * PER_GROUP, dtype="<u4")
    return {f"img_{g:04d}.bin": ids.tobytes(), f"out_{g:04d}.bin.gz": gzip.compress(ids.astype("<f4").tobytes())}


def _fields(base: str, options: dict[str, Any] | None = None, *, shape: tuple[int, ...] = (R, R, 1)) -> dict:
    return {
        "image": stoker.Field(f"{base}/img_*.bin", "int8", shape, storage_options=options),
        "label": stoker.Field(f"{base}/out_*.bin.gz", "float32", storage_options=options),
    }


def _memory_data(pairs: int) -> str:
    fs = fsspec.filesystem("memory")
    base = f"memory://manifest-{next(_stores)}/data"
    for g in range(pairs):
        for name, data in _objects(g).items():
            fs.pipe(f"{base}/{name}", data)
    return base


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[tuple[str, str]]:
    """Every call of the memory filesystem's request methods, as (method, path)."""
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    cls = type(fsspec.filesystem("memory"))
    for method in ("glob", "find", "ls", "info", "cat_file", "_open", "pipe_file"):
        original = getattr(cls, method)

        def wrapper(self: Any, path: str, *a: Any, _o: Any = original, _m: str = method, **k: Any) -> Any:
            calls[(_m, str(path))] += 1
            return _o(self, path, *a, **k)

        monkeypatch.setattr(cls, method, wrapper)
    return calls


def _methods(calls: collections.Counter[tuple[str, str]]) -> dict[str, int]:
    out: collections.Counter[str] = collections.Counter()
    for (method, _), n in calls.items():
        out[method] += n
    return dict(out)


def _build_and_len(base: str, index_dir: str, calls: collections.Counter[tuple[str, str]]) -> tuple[int, dict]:
    calls.clear()
    ds = stoker.Dataset(_fields(base), index_dir=index_dir)
    n = len(ds)
    return n, _methods(calls)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_dataset_built_from_its_manifest_makes_the_same_few_requests_for_10_or_100_pairs(
    tmp_path: Path, counted: collections.Counter[tuple[str, str]], where: str
) -> None:
    seen = {}
    for pairs in (10, 100):
        base = _memory_data(pairs)
        index_dir = str(tmp_path / f"idx{pairs}") if where == "local" else f"memory://idx-{next(_stores)}"
        stoker.write_index(stoker.Dataset(_fields(base)), index_dir=index_dir)
        n, requests = _build_and_len(base, index_dir, counted)
        assert n == pairs * PER_GROUP
        seen[pairs] = requests
        counted.clear()
        stoker.Dataset(_fields(base))  # without the manifest: a listing, an info and reads per object
        assert _methods(counted)["info"] >= 2 * pairs
    want = {} if where == "local" else {"cat_file": 1}  # the manifest's GET, nothing else
    assert seen[10] == seen[100] == want


def test_the_first_batch_reads_only_the_objects_of_its_records(
    tmp_path: Path, counted: collections.Counter[tuple[str, str]]
) -> None:
    """The loader's first batch: ranged reads of data objects alone (its fetcher also asks ahead
    for the batches after it); a gather of records: the objects holding them, nothing else."""
    base = _memory_data(100)
    stoker.write_index(stoker.Dataset(_fields(base)), index_dir=str(tmp_path))
    counted.clear()
    ds = stoker.Dataset(_fields(base), index_dir=str(tmp_path))
    assert not counted  # built from the local manifest alone

    def key(path: str) -> str:
        return path.removeprefix("memory://").lstrip("/")

    picks = [7, 203, 451, 12]  # a gather first: a closed loader's GETs may still be in flight after it
    got = ds.read(picks)
    np.testing.assert_array_equal(ids_of([got]), picks)
    wanted = {key(f"{base}/{name}") for g in {i // PER_GROUP for i in picks} for name in _objects(g)}
    assert {key(p) for _, p in counted} == wanted
    counted.clear()
    with ds.loader(8, shuffle="global", seed=5) as loader:
        ids = ids_of([next(iter(loader))])  # each image met its own label
    assert len(ids) == 8
    data = {key(f"{base}/{name}") for g in range(100) for name in _objects(g)}
    assert {m for m, _ in counted} <= {"cat_file", "info"}  # ranged reads, each checked against its version
    assert {key(p) for _, p in counted} <= data


@pytest.mark.parametrize("shards", [1, 3])
def test_every_record_once_with_its_own_label_through_the_manifest(tmp_path: Path, shards: int) -> None:
    base = _memory_data(24)  # 120 records: every shard the same number, none trimmed
    written = stoker.write_index(stoker.Dataset(_fields(base)), index_dir=str(tmp_path))
    assert written == [str(tmp_path / MANIFEST_NAME)]
    ds = stoker.Dataset(_fields(base), index_dir=str(tmp_path))
    got = []
    for rank in range(shards):
        with ds.loader(7, shuffle="global", seed=11, shard=(rank, shards)) as loader:
            got.append(ids_of(list(loader)))
    ids = np.concatenate(got)
    assert sorted(ids.tolist()) == list(range(24 * PER_GROUP))
    np.testing.assert_array_equal(ds.read([3, 77, 114])["label"], [3, 77, 114])


def test_an_object_replaced_after_the_manifest_is_a_stale_index_error_naming_it(tmp_path: Path) -> None:
    base = _memory_data(4)
    stoker.write_index(stoker.Dataset(_fields(base)), index_dir=str(tmp_path))
    url = f"{base}/out_0002.bin.gz"
    fsspec.filesystem("memory").pipe(url, gzip.compress(np.arange(5, dtype="<f4").tobytes(), mtime=1))
    ds = stoker.Dataset(_fields(base), index_dir=str(tmp_path))  # built from the manifest: nothing read yet
    with pytest.raises(stoker.StaleIndexError) as e, ds.loader(4, cycle_length=1) as loader:
        list(loader)
    named = e.value.path  # the URL as globbing it gave (memory:///...)
    assert named.endswith(url.removeprefix("memory://")) and e.value.field == "label"
    assert repr(named) in str(e.value) and str(tmp_path / MANIFEST_NAME) in str(e.value)


def test_a_manifest_written_for_other_fields_is_refused_naming_it(tmp_path: Path) -> None:
    base = _memory_data(3)
    stoker.write_index(stoker.Dataset(_fields(base)), index_dir=str(tmp_path))
    path = str(tmp_path / MANIFEST_NAME)
    with pytest.raises(stoker.StaleIndexError, match="field 'image'") as e:
        stoker.Dataset(_fields(base, shape=(R, R, 2)), index_dir=str(tmp_path))
    assert e.value.path == path and repr(path) in str(e.value)
    other = _memory_data(3)
    with pytest.raises(stoker.StaleIndexError, match="field 'image'") as e:
        stoker.Dataset(_fields(other), index_dir=str(tmp_path))
    assert e.value.path == path
    with pytest.raises(stoker.StaleIndexError, match="fields") as e:
        stoker.Dataset({"label": _fields(base)["label"]}, index_dir=str(tmp_path))
    assert e.value.path == path


def test_a_manifest_changed_after_it_was_written_is_refused(tmp_path: Path) -> None:
    base = _memory_data(3)
    stoker.write_index(stoker.Dataset(_fields(base)), index_dir=str(tmp_path))
    path = tmp_path / MANIFEST_NAME
    head, body = gzip.decompress(path.read_bytes()).split(b"\n", 1)
    doc = json.loads(body)
    doc["groups"][1]["image"]["records"] += 1
    path.write_bytes(gzip.compress(head + b"\n" + json.dumps(doc).encode()))
    with pytest.raises(stoker.StaleIndexError, match="build id") as e:
        stoker.Dataset(_fields(base), index_dir=str(tmp_path))
    assert e.value.path == str(path)
    path.write_bytes(b"not a manifest")
    with pytest.raises(stoker.StaleIndexError, match="cannot be read") as e:
        stoker.Dataset(_fields(base), index_dir=str(tmp_path))
    assert e.value.path == str(path)


def test_write_index_of_urls_needs_an_index_dir() -> None:
    base = _memory_data(2)
    with pytest.raises(stoker.SpecError, match="index_dir"):
        stoker.write_index(stoker.Dataset(_fields(base)))


# -- S3 on 127.0.0.1: moto behind a proxy that counts every HTTP request --------------------------


@pytest.fixture
def proxy(moto_url: str) -> Iterator[CountingProxy]:
    host, port = moto_url.removeprefix("http://").rsplit(":", 1)
    p = CountingProxy((host, int(port)))
    try:
        yield p
    finally:
        p.close()


def _bucket(moto_url: str, pairs: int) -> tuple[Any, str]:
    client = boto3.client(
        "s3", endpoint_url=moto_url, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    )  # fmt: skip
    bucket = f"stoker-manifest-{next(_stores)}"
    client.create_bucket(Bucket=bucket)
    for g in range(pairs):
        for name, data in _objects(g).items():
            client.put_object(Bucket=bucket, Key=f"data/{name}", Body=data)
    return client, bucket


def test_on_s3_build_and_len_are_one_get_and_the_first_batch_its_own_ranged_gets(
    moto_url: str, proxy: CountingProxy
) -> None:
    options = s3_options(proxy.endpoint)
    seen: dict[int, set[tuple[str, str]]] = {}
    for pairs in (10, 100):
        _, bucket = _bucket(moto_url, pairs)
        base = f"s3://{bucket}/data"
        stoker.write_index(stoker.Dataset(_fields(base, options)), index_dir=f"s3://{bucket}/index")
        proxy.take()
        ds = stoker.Dataset(_fields(base, options), index_dir=f"s3://{bucket}/index")
        assert len(ds) == pairs * PER_GROUP
        mine = f"/{bucket}/"  # requests of this bucket: a GET of an earlier one may still be in flight

        def take() -> list[tuple[str, str]]:
            return [(m, p) for m, p in proxy.take() if p.startswith(mine)]  # noqa: B023

        built = take()  # one GET of the manifest (another only where the first failed and was retried)
        assert set(built) == {("GET", f"/{bucket}/index/{MANIFEST_NAME}")} and len(built) <= 2, built
        picks = [7, 31, 12]  # a gather first: the objects holding its records, one GET each
        np.testing.assert_array_equal(ids_of([ds.read(picks)]), picks)
        keys = {f"/{bucket}/data/{name}" for g in {i // PER_GROUP for i in picks} for name in _objects(g)}
        gathered = take()
        assert {path.split("?")[0] for _, path in gathered} == keys
        assert {m for m, _ in gathered} == {"GET"}
        with ds.loader(8, shuffle="global", seed=2) as loader:
            assert len(ids_of([next(iter(loader))])) == 8  # each image met its own label
        first = take()  # ranged GETs of data objects only (the fetcher also asks ahead)
        data = {f"/{bucket}/data/{name}" for g in range(pairs) for name in _objects(g)}
        assert first and all(method == "GET" and path.split("?")[0] in data for method, path in first), first
        seen[pairs] = set(built)
    assert len(seen[10]) == len(seen[100]) == 1


@pytest.mark.parametrize("versioned", [False, True], ids=["unversioned", "versioned"])
def test_on_s3_an_object_replaced_since_the_manifest_is_named(moto_url: str, tmp_path: Path, versioned: bool) -> None:
    client, bucket = _bucket(moto_url, 3)
    if versioned:
        client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        for g in range(3):  # objects with version ids
            for name, data in _objects(g).items():
                client.put_object(Bucket=bucket, Key=f"data/{name}", Body=data)
    options = s3_options(moto_url)
    base = f"s3://{bucket}/data"
    stoker.write_index(stoker.Dataset(_fields(base, options)), index_dir=str(tmp_path))
    client.put_object(Bucket=bucket, Key="data/img_0001.bin", Body=np.arange(100, 105, dtype="<u4").tobytes())
    ds = stoker.Dataset(_fields(base, options), index_dir=str(tmp_path))
    if versioned:  # the manifest's version is read on, whole
        with ds.loader(4, cycle_length=1) as loader:
            assert sorted(ids_of(list(loader)).tolist()) == list(range(15))
        return
    url = f"{base}/img_0001.bin"
    with pytest.raises(stoker.StaleIndexError) as e:
        ds.read([6])
    assert e.value.path == url and repr(url) in str(e.value) and "manifest" in str(e.value)


def test_a_large_compressed_object_is_read_from_the_seek_point_before_its_records(
    tmp_path: Path, counted: collections.Counter[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local index_dir holds block seek points (windows beside the manifest): a record deep in
    a gzip object is decoded from the point before it, its bytes before that point never read."""
    from stoker.engine import records
    from stoker.io import remote

    monkeypatch.setattr(remote, "PART_BYTES", 4096)  # reads in parts: where decoding starts shows in the offsets
    monkeypatch.setattr(records, "DEFAULT_CACHE_BYTES", 1024)  # random access decodes no file whole
    fs = fsspec.filesystem("memory")
    base = f"memory://manifest-{next(_stores)}/data"
    n = 50_000
    ids = np.arange(n, dtype="<u4")
    fs.pipe(f"{base}/img_0000.bin", ids.tobytes())
    rng = np.random.default_rng(0)  # labels that compress poorly: the object spans many parts
    noise = rng.integers(0, 1 << 20, n).astype("<f4")
    fs.pipe(f"{base}/out_0000.bin.gz", gzip.compress(np.where(ids % 2 == 0, ids, noise).astype("<f4").tobytes()))
    stoker.write_index(stoker.Dataset(_fields(base)), index_dir=str(tmp_path), spacing=16384)
    assert list(tmp_path.glob(".stoker-windows.out_0000.bin.gz.*"))
    ds = stoker.Dataset(_fields(base), index_dir=str(tmp_path))
    starts: list[int] = []
    cls = type(fs)
    cat = cls.cat_file

    def cat_file(self: Any, path: str, start: int | None = None, end: int | None = None, **k: Any) -> Any:
        if path.endswith("out_0000.bin.gz"):
            starts.append(start or 0)
        return cat(self, path, start=start, end=end, **k)

    monkeypatch.setattr(cls, "cat_file", cat_file)
    got = ds.read([n - 2])
    np.testing.assert_array_equal(got["label"], [n - 2])
    np.testing.assert_array_equal(ids_of([got]), [n - 2])
    assert starts and min(starts) > fs.info(f"{base}/out_0000.bin.gz")["size"] // 2, starts
