"""Files behind fsspec URLs (`s3://`, `gs://`, `memory://`, ...): filesystems, retries, ranged reads.

Local paths never come here: files.py, batch.py and inflate.py keep their descriptor and
memory-map paths for them and call this module only for a path that carries a protocol
(`is_remote`). Every request (listing, stat, ranged GET) is a coroutine run on the
filesystem's event loop (fsspec's I/O thread; a filesystem without async methods has its calls
run in that loop's executor), so requests overlap without a thread of stoker's per request.
A loader's pass keeps its ranged GETs in flight ahead of its workers through stoker.io.fetch.

Every read is of the object the Dataset was built on (`Version`): the probe notes its ETag, its
version id where the bucket keeps versions, its size and mtime, and each ranged GET is held to
them. On S3 a GET names the version id where there is one (the old version is read on, whole and
consistent, after the key is overwritten) and carries `If-Match: <ETag>` (a replaced object
answers 412); the reply's ETag is compared too, for a store that ignores the condition. Other
filesystems are asked for the object's info after each read, which must still match (ETag,
version, size, mtime: whatever they report). A changed object is a `stoker.CorruptDataError`
naming the field and URL before any of its bytes is handed on.

One retry layer: a request that fails on a transient error (dropped connection, timeout, 5xx,
429, short body) is made again after an exponential backoff (`RETRY`); a permanent error
(no such object, access denied) or a transient one that outlasts the retries is a
`stoker.ReadError` naming the field, the URL and the byte offset. The libraries
underneath retry too by default (botocore up to 5 attempts, and s3fs 5 around each call, twice
nested for a read): stacked under stoker's, one failing part could take hundreds of attempts and
minutes before anyone heard of it. So the filesystems stoker reads through are its own instances
with those retries off (botocore's `total_max_attempts=1` unless `storage_options` set
`retries`, s3fs's `retries=1`); the instances a user's own code gets from fsspec are left alone.

Example:
    >>> import stoker
    >>> ds = stoker.Dataset(
    ...     image=stoker.Field("s3://bucket/data/img_*.bin", "int8", (128, 128, 1)),
    ...     label=stoker.Field("s3://bucket/data/out_*.bin.gz", "float32",
    ...                        storage_options={"anon": False}),
    ... )  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import email.utils
import errno
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, TypeVar

import numpy as np

from ..errors import CorruptDataError, ReadError, SpecError, StaleIndexError

__all__ = [
    "PART_BYTES", "RETRY", "Client", "Probe", "RemoteReader", "Retry", "Version", "client", "expand", "get_range",
    "is_remote", "pieces", "probe", "read_records", "transient",
]  # fmt: skip

T = TypeVar("T")

# Bytes per ranged request at most. Object stores serve 8-16 MiB ranges at full speed per
# connection (their own guidance); smaller parts only add request overhead.
PART_BYTES = 8 << 20
# Records gathered by random access: holes up to this size between wanted records are read
# through rather than split into another request (a request costs more than 1 MiB of transfer).
_GAP_BYTES = 1 << 20
# HTTP connections a filesystem stoker makes may keep open (botocore's default is 10, which
# would hold a read-ahead of 16 GETs to 10); a loader asking for more gets its own instance.
CONNECTIONS = 32

# errno values that s3fs/gcsfs/aiohttp use for conditions worth another try.
_TRANSIENT_ERRNO = {
    errno.EIO,
    errno.EBUSY,  # s3fs: 503 SlowDown / ServiceUnavailable
    errno.EAGAIN,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    errno.ETIMEDOUT,
    getattr(errno, "EREMOTEIO", 121),  # s3fs: 500 InternalError
}
# Exception class names (anywhere in the MRO) of the HTTP stacks under fsspec that mean
# "the connection or the server failed, the request may succeed again".
_TRANSIENT_NAMES = {
    "ClientPayloadError",
    "ClientConnectionError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "IncompleteRead",
    "IncompleteReadError",
    "ResponseStreamingError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "FSTimeoutError",
    "ProtocolError",
}
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


@dataclass(frozen=True)
class Retry:
    """How often and how patiently a transient failure is tried again.

    The k-th retry waits `min(initial_s * 2**k, max_s)`; `attempts` counts the first try.
    """

    attempts: int = 6
    initial_s: float = 0.1
    max_s: float = 5.0

    def delay(self, k: int) -> float:
        return float(min(self.initial_s * 2.0**k, self.max_s))


# The policy every remote request uses; replace it (e.g. Retry(attempts=1)) to change it.
RETRY = Retry()


class _ShortRead(Exception):
    """A range came back shorter than the object's size says it must be."""


@dataclass(frozen=True)
class Version:
    """Which version of a remote object the Dataset was built on; every read of it is held to it.

    `etag` and `version_id` as the store reports them, None where it keeps none (S3's "null"
    version id, of an object written while versioning was off, names no version: None).
    """

    size: int
    mtime_ns: int
    etag: str | None = None
    version_id: str | None = None
    # The manifest this version was taken from (stoker.io.manifest), named where it no longer holds.
    manifest: str | None = dataclass_field(default=None, compare=False)

    @classmethod
    def of(cls, info: Mapping[str, Any]) -> Version:
        """The version an fsspec `info()` describes (s3fs, gcsfs, http, memory, local keys)."""
        etag = info.get("ETag") or info.get("etag")
        version = info.get("VersionId") or info.get("generation") or info.get("version_id")
        return cls(
            int(info["size"]),
            _mtime_ns(info),
            str(etag) if etag else None,
            str(version) if version and version != "null" else None,
        )

    def describe(self) -> str:
        """What names this version, for an error message."""
        if self.etag or self.version_id:
            return ", ".join(f"{k} {v}" for k, v in (("ETag", self.etag), ("version", self.version_id)) if v)
        return f"{self.size} bytes, mtime_ns {self.mtime_ns}"


class _Changed(Exception):
    """The object is no longer the version the Dataset was built on (never retried)."""

    def __init__(self, now: str) -> None:
        super().__init__(now)
        self.now = now


def _precondition_failed(error: BaseException, _depth: int = 0) -> str | None:
    """What S3 said where `error` is its answer to a read held to a version that is gone:
    412 to If-Match, NoSuchVersion to a version id; else None."""
    response = getattr(error, "response", None)  # botocore ClientError, under s3fs's OSError
    if isinstance(response, Mapping):
        code = response.get("Error", {}).get("Code")
        if code in ("PreconditionFailed", "NoSuchVersion"):
            return f"the store answers {code}"
    cause = error.__cause__ or error.__context__
    if cause is not None and cause is not error and _depth < 8:
        return _precondition_failed(cause, _depth + 1)
    return None


def is_remote(path: str) -> bool:
    """True for a URL with a protocol (`s3://...`); plain paths stay on the local fast path."""
    return "://" in path


def transient(error: BaseException, _depth: int = 0) -> bool:
    """Whether `error` is worth another try: dropped connections, timeouts, 5xx, short bodies."""
    if isinstance(error, _PERMANENT):
        return False
    if isinstance(error, (_ShortRead, ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(error).__mro__):
        return True
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNO:
        return True
    for attr in ("status", "code", "status_code"):  # aiohttp, gcsfs and friends carry the HTTP status
        status = getattr(error, attr, None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
    response = getattr(error, "response", None)  # botocore ClientError
    if isinstance(response, Mapping):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
    cause = error.__cause__ or error.__context__
    return cause is not None and cause is not error and _depth < 8 and transient(cause, _depth + 1)


def _describe(error: BaseException) -> str:
    if isinstance(error, FileNotFoundError):
        return "no such object"
    if isinstance(error, PermissionError):
        return f"access denied ({error})"
    return f"{type(error).__name__}: {error}"


class Client:
    """One filesystem's requests as coroutines on its event loop."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._async = bool(getattr(fs, "async_impl", False))
        if self._async:
            self.loop = fs.loop
        else:
            from fsspec.asyn import get_loop

            self.loop = get_loop()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`fs.<method>(*args, **kwargs)`: its coroutine, or the blocking call in the loop's executor."""
        if self._async:
            return await getattr(self.fs, "_" + method)(*args, **kwargs)
        return await asyncio.to_thread(getattr(self.fs, method), *args, **kwargs)

    async def stat(self, path: str) -> Mapping[str, Any]:
        """The object's info, asked of the store (s3fs: a HEAD, never its listings cache, which
        keeps no version id)."""
        if _is_s3(self.fs):
            return await self.fs._info(path, refresh=True)
        return await self.call("info", path)

    async def get(self, path: str, start: int, end: int, version: Version | None) -> bytes:
        """Bytes `start..end` of the object as it is at `version` (None: as it is now); a
        `_Changed` where it is no longer that version."""
        if version is None:
            return bytes(await self.call("cat_file", path, start=start, end=end))
        if _is_s3(self.fs) and (version.etag or version.version_id):
            return await self._s3_get(path, start, end, version)
        # No conditional read here: the object's info after the read must still be `version`
        # (a replacement during the read shows there, as each write moves mtime or ETag).
        data = await self.call("cat_file", path, start=start, end=end)
        now = Version.of(await self.stat(path))
        if now != version:
            raise _Changed(now.describe())
        return bytes(data)

    async def _s3_get(self, path: str, start: int, end: int, version: Version) -> bytes:
        """A ranged GET of that version (by its id where the bucket keeps versions), If-Match its ETag."""
        bucket, key, _ = self.fs.split_path(path)
        kw: dict[str, Any] = {"Range": f"bytes={start}-{end - 1}"}
        if version.etag:
            kw["IfMatch"] = version.etag
        if version.version_id:
            kw["VersionId"] = version.version_id
        try:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)
        except Exception as e:
            said = _precondition_failed(e)
            if said is not None:
                raise _Changed(said) from e
            raise
        body = resp["Body"]
        try:
            etag = resp.get("ETag")
            if version.etag and etag and etag != version.etag:  # a store that ignores If-Match
                raise _Changed(f"ETag {etag}")
            return bytes(await body.read())
        finally:
            body.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop; its result in a future any thread may wait on."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for it."""
        return self.submit(coro).result()


def _is_s3(fs: Any) -> bool:
    return callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))


_clients: dict[tuple[int, str], Client] = {}
_clients_lock = threading.Lock()


def _options_for(cls: type, options: Mapping[str, Any], connections: int) -> dict[str, Any]:
    """`options` with the library's own retries off and room for `connections` (s3fs/botocore)."""
    opts = dict(options)
    protocols = cls.protocol if isinstance(cls.protocol, tuple) else (cls.protocol,)  # type: ignore[attr-defined]
    if "s3" in protocols:
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        config["max_pool_connections"] = max(connections, int(config.get("max_pool_connections") or 0))
        opts["config_kwargs"] = config
    return opts


def client(url: str, options: Mapping[str, Any] | None, *, connections: int = CONNECTIONS) -> tuple[Client, str]:
    """stoker's own filesystem for `url` (see the module's doc) wrapped as a Client, and the path on it.

    Instances are kept per process, per protocol and options, and made again in a forked child.
    """
    try:
        import fsspec
        from fsspec.utils import tokenize
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SpecError(f"{url!r} needs fsspec: pip install fsspec s3fs (stoker's remote extra)", path=url) from e
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        cls = fsspec.get_filesystem_class(protocol)
        opts = _options_for(cls, options or {}, connections)
        key = (os.getpid(), tokenize(protocol, cls._get_kwargs_from_urls(url), opts))
        with _clients_lock:
            found = _clients.get(key)
        if found is not None:
            return found, found.fs._strip_protocol(url)
        fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **opts)
    except (ImportError, ValueError, TypeError) as e:
        raise SpecError(f"{url!r}: no fsspec filesystem for it ({e})", path=url) from e
    if isinstance(getattr(type(fs), "retries", None), int):  # s3fs: its retry loop, off (see above)
        fs.retries = 1
    with _clients_lock:
        made = _clients.setdefault(key, Client(fs))
    return made, path


def _read_error(
    url: str, what: str, e: BaseException, *, field: str | None, offset: int | None, attempts: int
) -> ReadError:
    where = f" at byte offset {offset}" if offset is not None else ""
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    prefix = f"field {field!r}: " if field is not None else ""
    return ReadError(
        f"{prefix}{what} of {url!r}{where} failed{tries}: {_describe(e)}", field=field, path=url, offset=offset
    )


def changed(
    url: str, version: Version, now: str, *, field: str | None, offset: int | None
) -> CorruptDataError | StaleIndexError:
    """The error for a read of `url` that found the object no longer at `version`: a
    StaleIndexError naming the manifest where the version came from one."""
    where = f" (reading byte offset {offset})" if offset is not None else ""
    prefix = f"field {field!r}: " if field is not None else ""
    if version.manifest is not None:
        return StaleIndexError(
            f"{prefix}{url!r} changed since its manifest {version.manifest!r} was written{where}: it was "
            f"{version.describe()}, now {now}; no byte of the new object was handed on: write the manifest again "
            "with `stoker index URL --index-dir DIR` or stoker.write_index(ds, index_dir=DIR)",
            field=field, path=url, offset=offset,
        )  # fmt: skip
    return CorruptDataError(
        f"{prefix}{url!r} changed since the Dataset was built{where}: it was {version.describe()}, now {now}; "
        "no byte of the new object was handed on (it would pair with the other fields' old records): "
        "build the Dataset again to read the new object",
        field=field, path=url, offset=offset,
    )  # fmt: skip


async def attempt(
    url: str,
    what: str,
    request: Callable[[], Awaitable[T]],
    *,
    field: str | None,
    offset: int | None = None,
    version: Version | None = None,
) -> T:
    """`await request()` under the retry policy (the one retry layer); a permanent or exhausted
    failure is a ReadError naming `url` (the original error is its `__cause__`), an object no
    longer at `version` a CorruptDataError naming it."""
    policy = RETRY
    for k in range(policy.attempts):
        try:
            return await request()
        except _Changed as e:
            assert version is not None
            raise changed(url, version, e.now, field=field, offset=offset) from e
        except Exception as e:
            if not transient(e) or k + 1 >= policy.attempts:
                raise _read_error(url, what, e, field=field, offset=offset, attempts=k + 1) from e
        await asyncio.sleep(policy.delay(k))
    raise AssertionError("unreachable")  # pragma: no cover


async def get_range(
    client: Client, url: str, path: str, start: int, end: int, *, size: int, field: str | None,
    version: Version | None = None,
) -> bytes:  # fmt: skip
    """Bytes `start..end` of the object (`size` bytes long) at `version` (see the module's doc):
    whole, or a ReadError, or a CorruptDataError where the object changed."""

    async def once() -> bytes:
        data = await client.get(path, start, end, version)
        if len(data) != end - start:
            raise _ShortRead(f"got {len(data)} of {end - start} bytes of a {size}-byte object")
        return data

    return await attempt(url, "read", once, field=field, offset=start, version=version)


def expand(name: str, pattern: str, options: Mapping[str, Any] | None) -> list[str]:
    """The URLs a remote pattern names: sorted glob matches, or the URL itself."""
    c, path = client(pattern, options)
    if not any(ch in path for ch in "*?["):
        return [pattern]
    found = c.run(attempt(pattern, "listing", lambda: c.call("glob", path, detail=True), field=name))
    urls = sorted(c.fs.unstrip_protocol(p) for p, info in (found or {}).items() if info.get("type") != "directory")
    if not urls:
        raise SpecError(f"field {name!r}: glob {pattern!r} matched no file", field=name, path=pattern)
    return urls


@dataclass(frozen=True)
class Probe:
    """What files.py needs to know of a remote file: size, time, first 3 and last 4 bytes, and
    the version every later read is held to (the head and tail are read of it too)."""

    size: int
    mtime_ns: int
    head: bytes
    tail: bytes
    version: Version


def _mtime_ns(info: Mapping[str, Any]) -> int:
    for key in ("LastModified", "mtime", "updated", "last_modified", "Last-Modified", "created"):
        value = info.get(key)
        if isinstance(value, str):  # http's Last-Modified (RFC 7231), gcsfs's `updated` (ISO 8601)
            value = _parse_time(value)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return int(value.timestamp() * 1e9)
        if isinstance(value, int | float):
            return int(value * 1e9)
    return 0


def _parse_time(text: str) -> datetime.datetime | None:
    try:
        return email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        pass
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def probe(name: str, urls: Sequence[str], options: Mapping[str, Any] | None) -> dict[str, Probe]:
    """Size, mtime and head/tail bytes of every URL, fetched concurrently, each request retried."""
    by_client: dict[int, tuple[Client, list[tuple[str, str]]]] = {}
    for url in urls:
        c, path = client(url, options)
        by_client.setdefault(id(c), (c, []))[1].append((url, path))
    out: dict[str, Probe] = {}
    for c, pairs in by_client.values():
        out.update(c.run(_probe(name, c, pairs)))
    return out


async def _probe(name: str, c: Client, pairs: Sequence[tuple[str, str]]) -> dict[str, Probe]:
    async def stat(url: str, path: str) -> Mapping[str, Any]:
        try:
            info = await attempt(url, "stat", lambda: c.stat(path), field=name)
        except ReadError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise SpecError(f"field {name!r}: file {url!r} does not exist", field=name, path=url) from e.__cause__
            raise
        if info.get("type") == "directory":
            raise SpecError(f"field {name!r}: {url!r} is a directory, not a record file", field=name, path=url)
        return info

    async def one(url: str, path: str) -> tuple[str, Probe]:
        version = Version.of(await stat(url, path))
        size = version.size
        # The gzip trailer (ISIZE) sits in the last 4 bytes; files.py reads it only past 18 bytes.
        head, tail = await asyncio.gather(
            get_range(c, url, path, 0, min(3, size), size=size, field=name, version=version) if size else _empty(),
            get_range(c, url, path, size - 4, size, size=size, field=name, version=version)
            if size >= 18 else _empty(),
        )  # fmt: skip
        return url, Probe(size, version.mtime_ns, head, tail, version)

    return dict(await asyncio.gather(*(one(url, path) for url, path in pairs)))


async def _empty() -> bytes:
    return b""


def pieces(index: np.ndarray, record_bytes: int, base: int, part_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges that read records `index` (sorted, distinct) of a file whose records start
    at `base`: neighbours read by one request (holes under _GAP_BYTES read through), each range
    at most `part_bytes` long (or one record)."""
    if not len(index):
        return []
    gap = max(1, _GAP_BYTES // record_bytes)
    cuts = np.flatnonzero(np.diff(index) > gap) + 1
    spans = [(int(c[0]), int(c[-1]) + 1) for c in np.split(index, cuts)]
    per = max(1, part_bytes // record_bytes)
    rb = record_bytes
    return [(base + a * rb, base + min(a + per, b) * rb) for a, b in spans for a in range(a, b, per)]


def too_short(url: str, size: int, index: np.ndarray, end: int, *, field: str | None) -> ReadError:
    """The error for records asked beyond the object's end (not transient: it is shorter)."""
    return ReadError(
        f"field {field!r}: {url!r} is {size} bytes, too short for record {int(index[-1])} "
        f"(ends at byte offset {end})",
        field=field, path=url, index=int(index[-1]), offset=size,
    )  # fmt: skip


def place(ranges: Sequence[tuple[int, int]], parts: Sequence[bytes], index: np.ndarray, record_bytes: int,
          base: int) -> np.ndarray:  # fmt: skip
    """Records `index` as `(len(index), record_bytes)` uint8, cut from the `parts` read for `ranges`."""
    out = np.empty((len(index), record_bytes), np.uint8)
    for (start, end), data in zip(ranges, parts, strict=True):
        a, b = (start - base) // record_bytes, (end - base) // record_bytes
        lo, hi = np.searchsorted(index, [a, b])
        block = np.frombuffer(data, np.uint8).reshape(b - a, record_bytes)
        out[lo:hi] = block[index[lo:hi] - a]
    return out


def read_records(
    url: str,
    options: Mapping[str, Any] | None,
    base: int,
    record_bytes: int,
    index: np.ndarray,
    *,
    size: int,
    field: str | None = None,
    version: Version | None = None,
) -> np.ndarray:
    """Records `index` (sorted, distinct) of the file at `version`, as `(len(index), record_bytes)`
    uint8, by concurrent ranged reads (see `pieces`); random access, outside any loader."""
    if not len(index):
        return np.empty((0, record_bytes), np.uint8)
    ranges = pieces(index, record_bytes, base, PART_BYTES)
    if ranges[-1][1] > size:
        raise too_short(url, size, index, ranges[-1][1], field=field)
    c, path = client(url, options)

    async def all_parts() -> list[bytes]:
        return list(await asyncio.gather(
            *(get_range(c, url, path, a, b, size=size, field=field, version=version) for a, b in ranges)
        ))  # fmt: skip

    return place(ranges, c.run(all_parts()), index, record_bytes, base)


class RemoteReader:
    """Sequential reads of one remote file for the inflater, a part at a time (no loader's
    read-ahead: random access and index building; a loader's streams use stoker.io.fetch)."""

    def __init__(
        self, url: str, options: Mapping[str, Any] | None, *, size: int | None = None, field: str | None = None,
        version: Version | None = None,
    ) -> None:  # fmt: skip
        self.url = url
        self.field = field
        self.version = version
        self._client, self._path = client(url, options)
        if size is None:
            size = version.size if version is not None else None
        if size is None:
            info = self._client.run(attempt(url, "stat", lambda: self._client.stat(self._path), field=field))
            size = int(info["size"])
        self.size = size
        self._block = b""
        self._block_start = 0

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset` (empty at the end), served from one cached part."""
        if not self._block_start <= offset < self._block_start + len(self._block):
            end = min(self.size, offset + max(n, PART_BYTES))
            if offset >= end:
                return b""
            self._block = self._client.run(
                get_range(self._client, self.url, self._path, offset, end, size=self.size, field=self.field,
                          version=self.version)
            )  # fmt: skip
            self._block_start = offset
        at = offset - self._block_start
        return self._block[at : at + n]

    def close(self) -> None:
        self._block = b""
