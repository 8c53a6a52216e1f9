"""Files in memory behind ``gated://`` URLs, every read of which is recorded and may be held.

An fsspec async filesystem (its reads run on fsspec's event loop, as s3fs's do), so stoker reads
it through the same fetcher as S3. ``GATE`` records each ranged read (file, range, when it began
and how it ended) and holds the reads that begin while ``hold_from`` says so, until ``release()``:
tests see which requests are outstanding together, and which were cancelled.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fsspec.asyn import AsyncFileSystem
from fsspec.registry import register_implementation

__all__ = ["GATE", "Gate", "GatedFileSystem", "Request", "put"]


@dataclass
class Request:
    """One read: bytes `start..end` of `path`; `state` "held", "running", "done" or "cancelled"."""

    seq: int
    path: str
    start: int
    end: int
    state: str = "running"

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


class Gate:
    """What the reads of ``gated://`` do: recorded in `requests`; held from the `hold_from`-th on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.hold_from: int | None = None  # reads numbered this or later wait for release()
        self._released = 0  # reads numbered below this go on

    def reset(self) -> None:
        with self.lock:
            self.requests = []
            self.hold_from = None
            self._released = 0

    def hold(self, start: int | None = None) -> None:
        """Hold every read numbered `start` or later (None: every read from now on)."""
        with self.lock:
            self.hold_from = len(self.requests) if start is None else start

    def release(self) -> None:
        """Let every read go on, and those after."""
        with self.lock:
            self.hold_from = None
            self._released = 1 << 62

    def _held(self, req: Request) -> bool:
        with self.lock:
            return self.hold_from is not None and req.seq >= self.hold_from and req.seq >= self._released

    def outstanding(self) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.state in ("held", "running")]

    def count(self, name_part: str) -> int:
        """Reads made so far of files whose name holds `name_part`."""
        with self.lock:
            return sum(1 for r in self.requests if name_part in r.name)

    async def read(self, path: str, start: int, end: int, data: bytes) -> bytes:
        with self.lock:
            req = Request(len(self.requests), path, start, end)
            self.requests.append(req)
        try:
            while self._held(req):
                req.state = "held"
                await asyncio.sleep(0.002)
            req.state = "running"
            return data[start:end]
        except asyncio.CancelledError:
            req.state = "cancelled"
            raise
        finally:
            if req.state != "cancelled":
                req.state = "done"


GATE = Gate()


class GatedFileSystem(AsyncFileSystem):  # type: ignore[misc]
    """``gated://`` files (bytes in `files`), their reads through `GATE`."""

    protocol = "gated"
    files: ClassVar[dict[str, bytes]] = {}  # path (no protocol) -> content

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, asynchronous=False, **kwargs)

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        if path not in self.files:
            raise FileNotFoundError(path)
        return {"name": path, "size": len(self.files[path]), "type": "file", "mtime": 1.0}

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        if path not in self.files:
            raise FileNotFoundError(path)
        data = self.files[path]
        a = 0 if start is None else start
        b = len(data) if end is None else end
        return await GATE.read(path, a, b, data)


register_implementation("gated", GatedFileSystem, clobber=True)


def put(local: Path, base: str) -> dict[str, str]:
    """Every file of `local` under ``gated://base/``: local name -> URL."""
    out = {}
    for p in sorted(local.iterdir()):
        GatedFileSystem.files[f"{base}/{p.name}"] = p.read_bytes()
        out[p.name] = f"gated://{base}/{p.name}"
    return out
