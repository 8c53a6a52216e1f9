"""Remote files through fsspec: memory:// and real S3 APIs on 127.0.0.1.

SeaweedFS (the ``seaweed`` fixture: SigV4 enforced, ranged GETs served from the range) is the
S3 server of the reading tests. Faults are injected by a small HTTP proxy in front of moto that
cuts responses mid-body, answers 503 before passing a request on, or denies access to one
object; stoker's one retry layer must deliver every record exactly once and correct, and
permanent errors must name the URL. The same proxy in front of SeaweedFS counts the GETs in
flight, delays them, or holds them.
"""

from __future__ import annotations

import contextlib
import http.client
import pickle
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import fsspec
import numpy as np
import pytest

import stoker
from stoker.engine import decoded
from stoker.engine.ahead import looking_ahead
from stoker.io import fetch, remote
from tests.helpers.data import IMG, LAB_GZ, FieldPlan, check_batches, field_for, write_dataset
from tests.helpers.resources import consume
from tests.helpers.s3 import remote_dataset, s3_options, upload

pytestmark = pytest.mark.remote

LAB_ZZ = FieldPlan("lab", "int16", (2,), kind="zlib", header=3, footer=2)
WIDE = FieldPlan("img", "uint8", (64, 64), header=7)
BIG_GZ = FieldPlan("big", "float32", (32, 32), kind="gzip", footer=5)


def _put(seaweed: Any, bucket: str, local: Path) -> str:
    """Every file under ``local`` into ``bucket`` on SeaweedFS; returns ``s3://bucket``."""
    client = seaweed.boto3()
    for p in sorted(local.iterdir()):
        client.put_object(Bucket=bucket, Key=f"data/{p.name}", Body=p.read_bytes())
    return f"s3://{bucket}"


@contextlib.contextmanager
def _in_memory(local_ds: stoker.Dataset, tmp: Path) -> Iterator[tuple[stoker.Dataset, str]]:
    """``tmp``'s files copied under memory://, the Dataset of ``local_ds``'s fields read from
    there, and the base URL; the copies are removed after."""
    mem = fsspec.filesystem("memory")
    base = f"memory:///stoker-{tmp.name}"
    for p in tmp.iterdir():
        mem.pipe(f"{base}/data/{p.name}", p.read_bytes())
    try:
        yield remote_dataset(local_ds, base, {}), base
    finally:
        mem.rm(base, recursive=True)


def _local(tmp: Path, counts: list[int], plans: Mapping[str, FieldPlan]) -> stoker.Dataset:
    write_dataset(tmp, counts, plans)
    return stoker.Dataset({n: field_for(tmp, p) for n, p in plans.items()})


# -- the fault-injecting proxy -----------------------------------------------------------------
class Faults:
    """What the proxy does to object GETs; counts what it did."""

    def __init__(self) -> None:
        self.cut_first = False  # the first response to each distinct (object, range) is cut mid-body
        self.busy_first = 0  # ... or this many first responses are 503 SlowDown
        self.deny: str | None = None  # object keys containing this get 403 AccessDenied
        self.delay_s = 0.0  # object GETs wait this long before going on
        self.hold: threading.Event | None = None  # object GETs wait until this is set (at most 30 s)
        self.seen: dict[tuple[str, str], int] = {}
        self.cuts = 0
        self.busy = 0
        self.in_flight = 0  # object GETs passed on and not yet answered
        self.most_in_flight = 0
        self.lock = threading.Lock()

    def started(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def ended(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def decide(self, method: str, path: str, range_: str) -> str:
        key_part = path.split("?", 1)[0].strip("/")
        if method != "GET" or "/" not in key_part:  # only object reads (not listings, not HEAD)
            return "pass"
        if self.deny is not None and self.deny in key_part:
            return "deny"
        with self.lock:
            tries = self.seen.get((path, range_), 0)
            self.seen[(path, range_)] = tries + 1
            if tries < self.busy_first:
                self.busy += 1
                return "busy"
            if tries == 0 and self.cut_first:
                self.cuts += 1
                return "cut"
        return "pass"


def _error_xml(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'.encode()
    )


def _handler(upstream: tuple[str, int], faults: Faults) -> type[BaseHTTPRequestHandler]:
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            action = faults.decide(self.command, self.path, self.headers.get("Range", ""))
            if action == "deny":
                return self._reply(403, _error_xml("AccessDenied", "Access Denied"))
            if action == "busy":
                return self._reply(503, _error_xml("SlowDown", "Please reduce your request rate."))
            counted = action == "pass" and self.command == "GET" and "/" in self.path.split("?", 1)[0].strip("/")
            if counted:
                faults.started()
            try:
                if counted and faults.hold is not None:
                    faults.hold.wait(30)
                if counted and faults.delay_s:
                    time.sleep(faults.delay_s)
                conn = http.client.HTTPConnection(*upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    status, resp_headers = resp.status, resp.getheaders()
                finally:
                    conn.close()
            finally:
                if counted:
                    faults.ended()
            self.send_response(status)
            for k, v in resp_headers:
                if k.lower() not in (
                    "connection",
                    "transfer-encoding",
                    "keep-alive",
                    "content-length",
                    "date",
                    "server",
                ):
                    self.send_header(k, v)
            if self.command == "HEAD":
                self.send_header("Content-Length", dict((k.lower(), v) for k, v in resp_headers)["content-length"])
                self.end_headers()
                return None
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if action == "cut" and len(data) >= 2:
                # Half the promised body, then the connection drops.
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return None
            self.wfile.write(data)
            return None

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = forward

    return Proxy


def _proxy(upstream: str) -> Iterator[tuple[str, Faults]]:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream``; set its Faults' attributes to inject faults."""
    faults = Faults()
    host, port = upstream.removeprefix("http://").split(":")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler((host, int(port)), faults))
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, name="test-s3-proxy", daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", faults
    finally:
        if faults.hold is not None:
            faults.hold.set()
        server.shutdown()
        server.server_close()
        t.join()


@pytest.fixture
def proxy(moto_url: str) -> Iterator[tuple[str, Faults]]:
    """The fault-injecting proxy in front of moto."""
    yield from _proxy(moto_url)


@pytest.fixture
def seaweed_proxy(seaweed: Any) -> Iterator[tuple[str, Faults]]:
    """The same proxy in front of SeaweedFS (it passes requests signed for its own address on)."""
    yield from _proxy(seaweed.endpoint)


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    """Ranged reads of 4 KiB, so the small test files take many parallel parts."""
    monkeypatch.setattr(remote, "PART_BYTES", 4096)
    return 4096


def _batches(ds: stoker.Dataset, **kw: Any) -> list[dict[str, np.ndarray]]:
    with ds.loader(kw.pop("batch_size", 16), with_index=True, **kw) as loader:
        return list(loader)


# -- memory:// (any fsspec filesystem) -----------------------------------------------------------
def test_memory_filesystem_raw_gzip_zlib_with_header_and_footer_equal_local(tmp_path: Path, small_parts: int) -> None:
    plans = {"image": WIDE, "label": LAB_GZ, "extra": LAB_ZZ}
    local = _local(tmp_path, [9, 0, 31, 4], plans)
    with _in_memory(local, tmp_path) as (ds, base):
        assert ds.groups[0].paths["image"] == f"{base}/data/img_0000.bin"
        assert [g.records for g in ds.groups] == [9, 0, 31, 4]
        for kw in (
            {},
            {"cast": "float32", "threads": 3},
            {"shuffle": "global", "seed": 3},
            {"shuffle": "files", "seed": 5},
        ):
            check_batches(local, _batches(ds, **kw), cast={n: "float32" for n in plans} if "cast" in kw else None)


def test_global_shuffle_gathers_a_field_of_local_and_remote_files(tmp_path: Path) -> None:
    """One field, its files on local disk but group 1's at a URL: a global shuffle's gathers
    take that group's records by ranged reads and the local groups' from their maps."""
    plans = {"image": WIDE, "label": LAB_GZ}
    local = _local(tmp_path, [9, 12, 31, 4], plans)
    mem = fsspec.filesystem("memory")
    url = f"memory:///stoker-{tmp_path.name}/img_0001.bin"
    mem.pipe(url, (tmp_path / "img_0001.bin").read_bytes())
    try:
        image = local.fields["image"]
        paths = [g.paths["image"] if g.index != 1 else url for g in local.groups]
        ds = stoker.Dataset(
            image=stoker.Field(paths, image.dtype, image.shape, header_bytes=image.header_bytes),
            label=local.fields["label"],
        )
        for cast in (None, {"image": "float32"}):
            batches = _batches(ds, shuffle="global", seed=4, cast=cast, batch_size=8)
            seen = check_batches(local, batches, cast=cast)
            assert {g for g, _ in seen[:8]} > {1}  # a batch of the remote group and local ones
    finally:
        mem.rm(url)


def test_random_access_and_record_subsets_read_urls(tmp_path: Path) -> None:
    plans = {"image": WIDE, "label": LAB_GZ, "big": BIG_GZ}
    local = _local(tmp_path, [9, 31, 4], plans)
    with _in_memory(local, tmp_path) as (ds, _):
        picks = [40, 3, 3, 17, 0, 39, 9]  # unsorted, repeated, across groups
        got, want = ds.read(picks), local.read(picks)
        for name in plans:
            assert np.array_equal(got[name], want[name]), name
        assert np.array_equal(ds[12]["image"], local[12]["image"])
        sub = ds.select(records=[1, 5, 20, 33, 36])
        check_batches(local, _batches(sub), complete=False)
        assert sorted(g * 100 + i for b in _batches(sub) for g, i in zip(b["__group__"], b["__index__"])) == [
            1, 5, 111, 124, 127,
        ]  # fmt: skip


def test_remote_raw_file_of_wrong_size_is_an_error_naming_the_url(tmp_path: Path) -> None:
    mem = fsspec.filesystem("memory")
    url = f"memory:///stoker-{tmp_path.name}/img_0000.bin"
    mem.pipe(url, bytes(10))
    try:
        with pytest.raises(stoker.CorruptDataError, match=f"{url}.*not a whole number of 4-byte records") as e:
            stoker.Dataset(x=stoker.Field(url, "int32"))
        assert e.value.path == url and e.value.offset == 8
    finally:
        mem.rm(url)


def test_unknown_protocol_is_a_spec_error_naming_the_url() -> None:
    with pytest.raises(stoker.SpecError, match="nosuchfs://b/x.bin"):
        stoker.Dataset(x=stoker.Field("nosuchfs://b/x.bin", "int8"))


def test_a_dataset_of_urls_pickles_with_its_settled_counts(tmp_path: Path) -> None:
    local = _local(tmp_path, [5, 6], {"image": IMG, "label": LAB_GZ})
    with _in_memory(local, tmp_path) as (ds, _):
        len(ds)
        again = pickle.loads(pickle.dumps(ds))
        assert [g.records for g in again.groups] == [5, 6]
        check_batches(local, _batches(again))


# -- S3 (SeaweedFS) --------------------------------------------------------------------------------
def test_s3_every_record_once_and_correct_in_every_mode(
    tmp_path: Path, seaweed: Any, s3_bucket: str, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = {"image": WIDE, "label": LAB_GZ, "big": BIG_GZ}
    local = _local(tmp_path, [13, 40, 0, 7], plans)
    ds = remote_dataset(local, _put(seaweed, s3_bucket, tmp_path), seaweed.options())
    assert ds.groups[1].paths["label"].startswith("s3://") and ds.groups[1].records == 40
    check_batches(local, _batches(ds, threads=4))
    check_batches(local, _batches(ds, cast={"image": "float32"}, epochs=2), cast={"image": "float32"}, epochs=2)
    check_batches(local, _batches(ds, shuffle="global", seed=1))
    check_batches(local, _batches(ds, shuffle="files", seed=2, shard=(1, 2), even=False), complete=False)
    with monkeypatch.context() as m:  # "big" inflated as a stream read in turns, part after part
        m.setattr(decoded, "VERIFY_WHOLE_BYTES", 1024)
        check_batches(local, _batches(ds, threads=3, num_parallel_reads=3))
    check_batches(local, _batches(ds, num_parallel_reads=1, threads=1, block_length=5))


def test_s3_requests_must_be_signed_with_the_right_secret(tmp_path: Path, seaweed: Any, s3_bucket: str) -> None:
    local = _local(tmp_path, [3], {"image": IMG})
    base = _put(seaweed, s3_bucket, tmp_path)
    wrong = {**seaweed.options(), "secret": "not-the-secret"}
    with pytest.raises(stoker.ReadError, match=f"'image': stat of '{base}/data/img_0000.bin' failed: ") as e:
        stoker.Dataset(image=stoker.Field(f"{base}/data/img_0000.bin", "int8", (6, 6, 1), storage_options=wrong))
    assert e.value.path == f"{base}/data/img_0000.bin"
    del local


def test_s3_connections_cut_mid_body_lose_and_duplicate_nothing(
    tmp_path: Path, proxy: tuple[str, Faults], small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, faults = proxy
    plans = {"image": WIDE, "label": LAB_GZ, "extra": LAB_ZZ, "big": BIG_GZ}
    local = _local(tmp_path, [23, 5, 30], plans)
    base = upload(endpoint, tmp_path)  # uploads pass through untouched
    faults.cut_first = True
    ds = remote_dataset(local, base, s3_options(endpoint))
    # "big" (~29 KiB of gzip a file, 4 KiB parts) is inflated as a stream, part after part.
    with monkeypatch.context() as m:
        m.setattr(decoded, "VERIFY_WHOLE_BYTES", 1024)
        seq = check_batches(local, _batches(ds, threads=3))
    assert len(seq) == len(set(seq)) == 58
    check_batches(local, _batches(ds, shuffle="global", seed=7))
    assert faults.cuts > 20  # every part, head, tail and gather was cut once and fetched again


def test_s3_busy_answers_are_retried(tmp_path: Path, proxy: tuple[str, Faults]) -> None:
    endpoint, faults = proxy
    local = _local(tmp_path, [6, 9], {"image": IMG, "label": LAB_GZ})
    base = upload(endpoint, tmp_path)
    faults.busy_first = 2
    ds = remote_dataset(local, base, s3_options(endpoint))
    check_batches(local, _batches(ds))
    assert faults.busy >= 12


def test_cut_connections_without_retries_are_a_read_error_naming_url_and_offset(
    tmp_path: Path, proxy: tuple[str, Faults], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, faults = proxy
    local = _local(tmp_path, [6, 9], {"image": IMG})
    base = upload(endpoint, tmp_path)
    ds = remote_dataset(local, base, s3_options(endpoint))
    faults.cut_first = True
    monkeypatch.setattr(remote, "RETRY", remote.Retry(attempts=1))
    got, err = consume(ds.loader(4, threads=1, with_index=True, block_length=2))
    assert isinstance(err, stoker.ReadError)
    url = f"{base}/data/img_0000.bin"
    assert err.path == url and err.field == "image" and err.offset == 0 and err.index == 0
    assert f"{url!r} at byte offset 0 failed" in str(err)
    assert got == []  # the first batch holds the first failed read: nothing before it, nothing wrong


def test_exhausted_retries_say_how_many_attempts(
    tmp_path: Path, proxy: tuple[str, Faults], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, faults = proxy
    local = _local(tmp_path, [6], {"label": LAB_GZ})
    base = upload(endpoint, tmp_path)
    ds = remote_dataset(local, base, s3_options(endpoint))
    faults.busy_first = 3
    faults.seen.clear()
    monkeypatch.setattr(remote, "RETRY", remote.Retry(attempts=2, initial_s=0.01))
    with pytest.raises(stoker.ReadError, match=r"out_0000.bin.gz' at byte offset 0 failed after 2 attempts: ") as e:
        _batches(ds)
    assert e.value.path == f"{base}/data/out_0000.bin.gz" and e.value.field == "label"


def test_access_denied_is_a_read_error_naming_the_url(tmp_path: Path, proxy: tuple[str, Faults]) -> None:
    endpoint, faults = proxy
    local = _local(tmp_path, [6, 9], {"image": IMG, "label": LAB_GZ})
    base = upload(endpoint, tmp_path)
    faults.deny = "out_0001"
    with pytest.raises(stoker.ReadError, match=r"'label'.*out_0001.bin.gz.*access denied") as e:
        remote_dataset(local, base, s3_options(endpoint))
    assert e.value.path == f"{base}/data/out_0001.bin.gz"


def test_object_deleted_after_the_dataset_was_built_is_a_read_error_naming_it(tmp_path: Path, moto_url: str) -> None:
    local = _local(tmp_path, [6, 9], {"image": IMG, "label": LAB_GZ})
    base = upload(moto_url, tmp_path)
    ds = remote_dataset(local, base, s3_options(moto_url))
    boto3.client(
        "s3",
        endpoint_url=moto_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).delete_object(Bucket=base.removeprefix("s3://"), Key="data/img_0001.bin")
    got, err = consume(ds.loader(6, with_index=True, cycle_length=1))
    assert isinstance(err, stoker.ReadError) and "no such object" in str(err)
    assert err.path == f"{base}/data/img_0001.bin" and err.field == "image" and err.index == 0
    check_batches(local, got, complete=False)  # group 0 came whole and right before the error
    assert len(got) == 1


def test_s3_glob_matching_nothing_and_missing_object_are_spec_errors(tmp_path: Path, moto_url: str) -> None:
    local = _local(tmp_path, [3], {"image": IMG})
    base = upload(moto_url, tmp_path)
    opts = s3_options(moto_url)
    with pytest.raises(stoker.SpecError, match=f"glob '{base}/data/nope_\\*.bin' matched no file"):
        stoker.Dataset(x=stoker.Field(f"{base}/data/nope_*.bin", "int8", storage_options=opts))
    with pytest.raises(stoker.SpecError, match=f"file '{base}/data/img_9.bin' does not exist") as e:
        stoker.Dataset(x=stoker.Field([f"{base}/data/img_9.bin"], "int8", storage_options=opts))
    assert e.value.path == f"{base}/data/img_9.bin"
    del local


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (OSError(5, "I/O error"), True),
        (OSError(16, "SlowDown"), True),
        (FileNotFoundError(2, "no such key"), False),
        (PermissionError(13, "denied"), False),
        (ValueError("bad range"), False),
    ],
)
def test_transient_errors_are_told_from_permanent_ones(error: BaseException, expected: bool) -> None:
    assert remote.transient(error) is expected


def test_remote_and_local_paths() -> None:
    assert remote.is_remote("s3://b/k") and remote.is_remote("gs://b/k") and remote.is_remote("memory://x")
    assert not remote.is_remote("/data/img_0.bin") and not remote.is_remote("data/img_*.bin")


@pytest.mark.parametrize("bad", [["anon"], {1: True}, "anon=true"])
def test_storage_options_must_be_a_mapping_of_names(bad: object) -> None:
    with pytest.raises(stoker.SpecError, match="storage_options=.* must be a mapping of str -> value"):
        stoker.Field("s3://bucket/img_*.bin", "int8", storage_options=bad)  # type: ignore[arg-type]


def test_storage_options_stay_out_of_repr_and_hash() -> None:
    a = stoker.Field("s3://b/x.bin", "int8", storage_options={"secret": "hunter2"})
    assert "hunter2" not in repr(a)
    assert hash(a) == hash(stoker.Field("s3://b/x.bin", "int8", storage_options={"secret": "other"}))
    assert a != stoker.Field("s3://b/x.bin", "int8", storage_options={"secret": "other"})


# -- I/O concurrency apart from the workers (stoker.io.fetch) -------------------------------------------
def test_one_worker_keeps_num_parallel_reads_gets_in_flight_and_no_more(
    tmp_path: Path, seaweed: Any, s3_bucket: str, seaweed_proxy: tuple[str, Faults], small_parts: int
) -> None:
    """threads=1: the GETs in flight are num_parallel_reads, not the workers' count; the proxy
    holds each GET 30 ms so they overlap where the loader lets them."""
    endpoint, faults = seaweed_proxy
    plans = {"image": WIDE, "label": LAB_GZ}
    local = _local(tmp_path, [40, 31, 25], plans)  # ~4 KiB a record: a part (4 KiB) per record
    ds = remote_dataset(local, _put(seaweed, s3_bucket, tmp_path), seaweed.options(endpoint))
    faults.delay_s = 0.03
    for reads in (5, 1):
        faults.most_in_flight = 0
        check_batches(local, _batches(ds, threads=1, num_parallel_reads=reads))
        assert faults.most_in_flight == reads, reads


def test_a_compressed_stream_keeps_its_next_parts_in_flight(
    tmp_path: Path, seaweed: Any, s3_bucket: str, seaweed_proxy: tuple[str, Faults], small_parts: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    endpoint, faults = seaweed_proxy
    local = _local(tmp_path, [30], {"big": BIG_GZ})  # ~29 KiB of gzip: 8 parts of 4 KiB
    ds = remote_dataset(local, _put(seaweed, s3_bucket, tmp_path), seaweed.options(endpoint))
    monkeypatch.setattr(decoded, "VERIFY_WHOLE_BYTES", 1024)  # inflated in turns, not decoded whole
    faults.delay_s = 0.03
    check_batches(local, _batches(ds, threads=1, batch_size=4))
    assert faults.most_in_flight == 1 + fetch.STREAM_AHEAD


def test_close_does_not_wait_for_gets_in_flight(
    tmp_path: Path, seaweed: Any, s3_bucket: str, seaweed_proxy: tuple[str, Faults]
) -> None:
    endpoint, faults = seaweed_proxy
    local = _local(tmp_path, [20, 20], {"image": WIDE, "label": LAB_GZ})
    ds = remote_dataset(local, _put(seaweed, s3_bucket, tmp_path), seaweed.options(endpoint))
    faults.hold = threading.Event()  # every object GET from now on waits until released
    loader = ds.loader(8, threads=2)
    consumer = threading.Thread(target=lambda: list(loader), name="test-consumer", daemon=True)
    consumer.start()
    for _ in range(300):  # until the GETs have reached the proxy (at most 3 s)
        if faults.in_flight:
            break
        time.sleep(0.01)
    assert faults.in_flight > 0
    closing = threading.Thread(target=loader.close, name="test-close", daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive() and faults.in_flight > 0  # closed while the GETs are still held
    faults.hold.set()
    consumer.join(10)
    assert not consumer.is_alive()


def test_num_parallel_reads_must_be_a_positive_integer_and_fit_the_memory_budget(tmp_path: Path) -> None:
    local = _local(tmp_path, [9], {"image": WIDE})
    with _in_memory(local, tmp_path) as (ds, _):
        for bad in (0, -1, 2.0, True, "16"):
            with pytest.raises(stoker.SpecError, match=r"num_parallel_reads=.* must be a positive integer"):
                ds.loader(4, num_parallel_reads=bad)
        with pytest.raises(stoker.SpecError, match=r"num_parallel_reads=64 ranged reads .* memory_budget"):
            ds.loader(4, num_parallel_reads=64, memory_budget="8MiB")
        with ds.loader(4, memory_budget="8MiB", with_index=True) as small:  # the default shrinks to what fits
            assert 1 <= small.num_parallel_reads < fetch.DEFAULT_PARALLEL_READS
            assert small.num_parallel_reads * small.budget.part_bytes <= (8 << 20) // 2
            check_batches(local, list(small))
        with ds.loader(4) as default:
            assert default.num_parallel_reads == fetch.DEFAULT_PARALLEL_READS
        with _local_only(tmp_path).loader(4, num_parallel_reads=1000, memory_budget="8MiB") as unused:
            assert unused.num_parallel_reads == 1000  # no URL: nothing is fetched, no room is taken


def _local_only(tmp: Path) -> stoker.Dataset:
    return stoker.Dataset(image=field_for(tmp, WIDE))


def test_one_retry_layer_makes_exactly_the_policys_attempts(
    tmp_path: Path, proxy: tuple[str, Faults], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET that keeps failing with 503 reaches the server RETRY.attempts times, no more:
    s3fs's and botocore's own retries (5 each, nested) are off on stoker's filesystems."""
    endpoint, faults = proxy
    local = _local(tmp_path, [6], {"image": IMG})
    base = upload(endpoint, tmp_path)
    ds = remote_dataset(local, base, s3_options(endpoint))
    faults.seen.clear()
    faults.busy_first = 100
    monkeypatch.setattr(remote, "RETRY", remote.Retry(attempts=3, initial_s=0.01))
    got, err = consume(ds.loader(6, threads=1))
    assert isinstance(err, stoker.ReadError) and "failed after 3 attempts" in str(err) and got == []
    assert err.path == f"{base}/data/img_0000.bin" and err.field == "image" and err.offset == 0
    assert list(faults.seen.values()) == [3]  # one range, asked three times


def test_the_look_ahead_hands_plans_on_in_order_and_a_planning_error_after_them() -> None:
    asked: list[int] = []
    room = {"left": 3}

    def plans() -> Iterator[int]:
        yield from range(5)
        raise stoker.SpecError("planning failed at the sixth")

    def want(plan: int) -> None:
        asked.append(plan)
        room["left"] -= 1

    got: list[int] = []
    ahead = looking_ahead(plans(), want, lambda: room["left"] > 0)  # type: ignore[arg-type]
    with pytest.raises(stoker.SpecError, match="sixth"):
        for plan in ahead:
            got.append(plan)
            assert len(asked) - len(got) <= 3  # no further ahead than the room allows
            room["left"] += 1  # the batch's bytes were copied: room again
    assert got == asked == [0, 1, 2, 3, 4]


def test_fetcher_bounds_requests_and_bytes_ahead_and_gives_all_room_back(tmp_path: Path) -> None:
    mem = fsspec.filesystem("memory")
    url = f"memory:///stoker-{tmp_path.name}/blob.bin"
    blob = np.random.default_rng(1).integers(0, 256, 300_000, np.uint8).tobytes()
    mem.pipe(url, blob)
    try:
        with fetch.Fetcher(3, ahead_bytes=40_000, part_bytes=7_000) as f:
            ranges = [(a, min(a + 10_000, len(blob))) for a in range(0, len(blob), 10_000)]
            asked = 0
            for a, b in ranges:
                while asked < len(ranges) and f.room():  # the look-ahead: as far as the room reaches
                    f.want(url, {}, *ranges[asked], size=len(blob), field="x")
                    asked += 1
                    assert f._ahead <= 40_000 + 10_000
                out = bytearray(b - a)
                n = f.read_into(url, {}, a, memoryview(out), size=len(blob), field="x", check=lambda: None)
                assert n == b - a and bytes(out) == blob[a:b]
            unasked = bytearray(5)  # a range nobody asked for ahead: fetched now
            f.read_into(url, {}, 17, memoryview(unasked), size=len(blob), field="x", check=lambda: None)
            assert bytes(unasked) == blob[17:22]
            assert f.most_in_flight <= 3 and f._ahead == 0
            got = f.read_records(url, {}, 100, 50, np.array([0, 3, 4, 4000]), size=len(blob), field="x",
                                 check=lambda: None)  # fmt: skip
            assert [bytes(r) for r in got] == [blob[100 + 50 * i : 150 + 50 * i] for i in (0, 3, 4, 4000)]
            with pytest.raises(stoker.ReadError, match=r"'x': .*blob.bin' is 300000 bytes, too short for record 6000"):
                f.read_records(url, {}, 100, 50, np.array([6000]), size=len(blob), field="x", check=lambda: None)
            f.want(url, {}, 0, 20_000, size=len(blob), field="x")  # asked, never taken: close gives it back
        for _ in range(500):  # what was in flight at close() gives its room back as it lands (at most 5 s)
            if f._ahead == 0:
                break
            time.sleep(0.01)
        assert f._ahead == 0 and f._in_flight == 0
    finally:
        mem.rm(url)
