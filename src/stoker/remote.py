"""Files behind fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...): listing, sizes, ranged reads.

Local paths never come here: files.py, batch.py and inflate.py keep their descriptor and
memory-map paths for them and call this module only for a path that carries a protocol
(:func:`is_remote`). A large read is cut into parts fetched concurrently by the
filesystem's own event loop (``cat_ranges``; stoker starts no thread for it). A part that
fails on a transient error (dropped connection, timeout, 5xx, short body) is fetched again
after an exponential backoff; a permanent error (no such object, access denied) or a
transient one that outlasts the retries is a :class:`~stoker.ReadError` naming the URL.

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
import errno
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ReadError, SpecError

__all__ = ["PART_BYTES", "RETRY", "Probe", "Retry", "expand", "is_remote", "probe", "read_into", "read_records"]

# Bytes per ranged request. Object stores serve 8-16 MiB ranges at full speed per
# connection (their own guidance); smaller parts only add request overhead.
PART_BYTES = 8 << 20
# Records gathered by random access: holes up to this size between wanted records are read
# through rather than split into another request (a request costs more than 1 MiB of transfer).
_GAP_BYTES = 1 << 20

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

    The k-th retry waits ``min(initial_s * 2**k, max_s)``; ``attempts`` counts the first try.
    """

    attempts: int = 6
    initial_s: float = 0.1
    max_s: float = 5.0

    def delay(self, k: int) -> float:
        return float(min(self.initial_s * 2.0**k, self.max_s))


# The policy every remote read uses; replace it (e.g. Retry(attempts=1)) to change it.
RETRY = Retry()


class _ShortRead(Exception):
    """A range came back shorter than the object's size says it must be."""


def is_remote(path: str) -> bool:
    """True for a URL with a protocol (``s3://...``); plain paths stay on the local fast path."""
    return "://" in path


def transient(error: BaseException, _depth: int = 0) -> bool:
    """Whether ``error`` is worth another try: dropped connections, timeouts, 5xx, short bodies."""
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


def filesystem(url: str, options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` (instances are cached by fsspec) and the path on it."""
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SpecError(f"{url!r} needs fsspec: pip install 'stoker[remote]'", path=url) from e
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(options or {}))
    except (ImportError, ValueError) as e:
        raise SpecError(f"{url!r}: no fsspec filesystem for it ({e})", path=url) from e
    return fs, path


def _call(url: str, what: str, fn: Callable[[], Any], *, field: str | None, offset: int | None = None) -> Any:
    """``fn()`` with the retry policy; a permanent or exhausted failure is a ReadError naming ``url``."""
    policy = RETRY
    for attempt in range(policy.attempts):
        try:
            return fn()
        except Exception as e:
            if not transient(e) or attempt + 1 >= policy.attempts:
                raise _read_error(url, what, e, field=field, offset=offset, attempts=attempt + 1) from e
            time.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")  # pragma: no cover


def _read_error(
    url: str, what: str, e: BaseException, *, field: str | None, offset: int | None, attempts: int
) -> ReadError:
    where = f" at byte offset {offset}" if offset is not None else ""
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    prefix = f"field {field!r}: " if field is not None else ""
    return ReadError(
        f"{prefix}{what} of {url!r}{where} failed{tries}: {_describe(e)}", field=field, path=url, offset=offset
    )


def expand(name: str, pattern: str, options: Mapping[str, Any] | None) -> list[str]:
    """The URLs a remote pattern names: sorted glob matches, or the URL itself."""
    fs, path = filesystem(pattern, options)
    if not any(c in path for c in "*?["):
        return [pattern]
    found = _call(pattern, "listing", lambda: fs.glob(path, detail=True), field=name)
    urls = sorted(fs.unstrip_protocol(p) for p, info in (found or {}).items() if info.get("type") != "directory")
    if not urls:
        raise SpecError(f"field {name!r}: glob {pattern!r} matched no file", field=name, path=pattern)
    return urls


@dataclass(frozen=True)
class Probe:
    """What files.py needs to know of a remote file: size, time, first 3 and last 4 bytes."""

    size: int
    mtime_ns: int
    head: bytes
    tail: bytes


def _mtime_ns(info: Mapping[str, Any]) -> int:
    for key in ("LastModified", "mtime", "updated", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return int(value.timestamp() * 1e9)
        if isinstance(value, int | float):
            return int(value * 1e9)
    return 0


def _each(fs: Any, paths: Sequence[str], method: str) -> list[Any]:
    """``fs.<method>(path)`` for every path: concurrently on an async filesystem's loop, else in turn.

    Each result is the value or the exception raised.
    """
    if getattr(fs, "async_impl", False):
        from fsspec.asyn import sync

        async def gather() -> list[Any]:
            fn = getattr(fs, "_" + method)
            return await asyncio.gather(*(fn(p) for p in paths), return_exceptions=True)

        return list(sync(fs.loop, gather))
    out: list[Any] = []
    for p in paths:
        try:
            out.append(getattr(fs, method)(p))
        except Exception as e:
            out.append(e)
    return out


def probe(name: str, urls: Sequence[str], options: Mapping[str, Any] | None) -> dict[str, Probe]:
    """Size, mtime and head/tail bytes of every URL, fetched concurrently, retried per file."""
    by_fs: dict[int, tuple[Any, list[str]]] = {}
    for url in urls:
        fs, _ = filesystem(url, options)
        by_fs.setdefault(id(fs), (fs, []))[1].append(url)
    out: dict[str, Probe] = {}
    for fs, same in by_fs.values():
        out.update(_probe(name, fs, same, options))
    return out


def _probe(name: str, fs: Any, urls: Sequence[str], options: Mapping[str, Any] | None) -> dict[str, Probe]:
    paths = [filesystem(u, options)[1] for u in urls]
    infos: list[Any] = [None] * len(urls)
    pending = list(range(len(urls)))
    for attempt in range(RETRY.attempts):
        got = _each(fs, [paths[i] for i in pending], "info")
        retry = []
        for i, r in zip(pending, got, strict=True):
            if isinstance(r, BaseException):
                if isinstance(r, FileNotFoundError):
                    raise SpecError(f"field {name!r}: file {urls[i]!r} does not exist", field=name, path=urls[i]) from r
                if not transient(r) or attempt + 1 >= RETRY.attempts:
                    raise _read_error(urls[i], "stat", r, field=name, offset=None, attempts=attempt + 1) from r
                retry.append(i)
            else:
                infos[i] = r
        if not retry:
            break
        pending = retry
        time.sleep(RETRY.delay(attempt))
    for url, info in zip(urls, infos, strict=True):
        if info.get("type") == "directory":
            raise SpecError(f"field {name!r}: {url!r} is a directory, not a record file", field=name, path=url)
    sizes = [int(info["size"]) for info in infos]
    heads = _ranges(fs, urls, paths, [0] * len(urls), [min(3, s) for s in sizes], sizes, field=name)
    # The gzip trailer (ISIZE) sits in the last 4 bytes; files.py reads it only past 18 bytes.
    tails = _ranges(fs, urls, paths, [max(0, s - 4) for s in sizes], sizes, sizes, field=name)
    return {
        url: Probe(size, _mtime_ns(info), head, tail if size >= 18 else b"")
        for url, info, size, head, tail in zip(urls, infos, sizes, heads, tails, strict=True)
    }


def _ranges(
    fs: Any,
    urls: Sequence[str],
    paths: Sequence[str],
    starts: Sequence[int],
    ends: Sequence[int],
    sizes: Sequence[int],
    *,
    field: str | None,
) -> list[bytes]:
    """Bytes ``starts[i]..ends[i]`` of every file, concurrently; short or failed parts retried."""
    out: list[bytes] = [b""] * len(urls)
    pending = [i for i in range(len(urls)) if ends[i] > starts[i]]
    for attempt in range(RETRY.attempts):
        if not pending:
            break
        got = fs.cat_ranges(
            [paths[i] for i in pending], [starts[i] for i in pending], [ends[i] for i in pending], on_error="return"
        )
        retry = []
        for i, r in zip(pending, got, strict=True):
            error: BaseException | None = r if isinstance(r, BaseException) else None
            if error is None and len(r) != ends[i] - starts[i]:
                error = _ShortRead(
                    f"got {len(r)} of {ends[i] - starts[i]} bytes of a {sizes[i]}-byte object"
                )  # fmt: skip
            if error is None:
                out[i] = bytes(r)
                continue
            if not transient(error) or attempt + 1 >= RETRY.attempts:
                raise _read_error(
                    urls[i], "read", error, field=field, offset=starts[i], attempts=attempt + 1
                ) from error
            retry.append(i)
        pending = retry
        if pending:
            time.sleep(RETRY.delay(attempt))
    return out


def read_into(
    url: str,
    options: Mapping[str, Any] | None,
    offset: int,
    dst: memoryview,
    *,
    size: int,
    field: str | None = None,
) -> int:
    """Fill ``dst`` with the bytes of ``url`` from ``offset``; parts of PART_BYTES go in parallel.

    Returns the bytes read: short only where the object (of ``size`` bytes) ends first.
    """
    fs, path = filesystem(url, options)
    n = max(0, min(len(dst), size - offset))
    starts = list(range(offset, offset + n, PART_BYTES))
    ends = [min(s + PART_BYTES, offset + n) for s in starts]
    parts = _ranges(fs, [url] * len(starts), [path] * len(starts), starts, ends, [size] * len(starts), field=field)
    for s, data in zip(starts, parts, strict=True):
        dst[s - offset : s - offset + len(data)] = data
    return n


def read_records(
    url: str,
    options: Mapping[str, Any] | None,
    base: int,
    record_bytes: int,
    index: np.ndarray,
    *,
    size: int,
    field: str | None = None,
) -> np.ndarray:
    """Records ``index`` (sorted, distinct) of the file, as ``(len(index), record_bytes)`` uint8.

    Neighbouring records are read by one request (holes under _GAP_BYTES are read through).
    """
    out = np.empty((len(index), record_bytes), np.uint8)
    if not len(index):
        return out
    fs, path = filesystem(url, options)
    gap = max(1, _GAP_BYTES // record_bytes)
    cuts = np.flatnonzero(np.diff(index) > gap) + 1
    spans = [(int(c[0]), int(c[-1]) + 1) for c in np.split(index, cuts)]
    # Long spans are cut further so each request stays near PART_BYTES.
    per = max(1, PART_BYTES // record_bytes)
    pieces = [(a, min(a + per, b)) for a, b in spans for a in range(a, b, per)]
    starts = [base + a * record_bytes for a, _ in pieces]
    ends = [base + b * record_bytes for _, b in pieces]
    if ends[-1] > size:
        # Not a transient failure: the object is shorter than the records asked for.
        raise ReadError(
            f"field {field!r}: {url!r} is {size} bytes, too short for record {int(index[-1])} "
            f"(ends at byte offset {ends[-1]})",
            field=field, path=url, index=int(index[-1]), offset=size,
        )  # fmt: skip
    parts = _ranges(fs, [url] * len(pieces), [path] * len(pieces), starts, ends, [size] * len(pieces), field=field)
    for (a, b), data in zip(pieces, parts, strict=True):
        lo, hi = np.searchsorted(index, [a, b])
        block = np.frombuffer(data, np.uint8).reshape(b - a, record_bytes)
        out[lo:hi] = block[index[lo:hi] - a]
    return out


class RemoteReader:
    """Sequential reads of one remote file for the inflater: PART_BYTES-sized requests, retried."""

    def __init__(self, url: str, options: Mapping[str, Any] | None, *, field: str | None = None) -> None:
        self.url = url
        self.field = field
        self._fs, self._path = filesystem(url, options)
        info = _call(url, "stat", lambda: self._fs.info(self._path), field=field)
        self.size = int(info["size"])
        self._block = b""
        self._block_start = 0

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (empty at the end), served from one cached part."""
        if not self._block_start <= offset < self._block_start + len(self._block):
            end = min(self.size, offset + max(n, PART_BYTES))
            if offset >= end:
                return b""
            self._block = _ranges(self._fs, [self.url], [self._path], [offset], [end], [self.size], field=self.field)[0]
            self._block_start = offset
        at = offset - self._block_start
        return self._block[at : at + n]

    def close(self) -> None:
        self._block = b""
