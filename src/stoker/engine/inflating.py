"""Records of one compressed file read front to back: opened at its start or a seek point,
skipped ahead, read (cast) into the batch, and checked at its end."""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping

import numpy as np

from ..errors import StokerError
from ..io import faults
from ..io.fetch import Fetcher
from ..io.files import Catalog, FileInfo
from ..io.index import count_disagrees
from ..io.inflate import Inflater
from ..io.remote import is_remote
from ..io.seekpoints import SeekPoint
from ..kernels import cast_into
from ..plan.batches import Run
from ..spec import Field
from .buffers import Staging, bytes_of
from .executor import StopFlag
from .stats import Counters

__all__ = ["Cursor", "StreamReads"]


class Cursor:
    """Where a compressed file is being read: its decoder, and the records consumed so far."""

    __slots__ = ("inflater", "pos")

    def __init__(self) -> None:
        self.inflater: Inflater | None = None
        self.pos = 0

    def close(self) -> None:
        if self.inflater is not None:
            self.inflater.close()


class StreamReads:
    """Reads records of compressed files through a `Cursor` (remote ones through the fetcher).

    `cast`: per field, whether its output dtype differs from its stored one.
    """

    def __init__(
        self, catalog: Catalog, cast: Mapping[str, bool], *, fetcher: Fetcher, counters: Counters, stop: StopFlag,
        staging: Staging,
    ) -> None:  # fmt: skip
        self.catalog = catalog
        self.cast = dict(cast)
        self.fetcher = fetcher
        self.counters = counters
        self.stop = stop
        self.staging = staging

    def open(
        self, name: str, spec: Field, info: FileInfo, cursor: Cursor, seek: tuple[int, SeekPoint] | None = None
    ) -> Inflater:
        """Open the stream at its start, or at `seek = (record, seek point at or before it)`."""
        if cursor.inflater is not None:
            cursor.inflater.close()
        assert info.compression is not None
        source = None
        if is_remote(info.path):  # its parts asked for ahead (stoker.io.fetch)
            source = self.fetcher.stream(
                info.path, spec.storage_options, seek[1].compressed if seek else 0, size=info.size, field=name,
                check=self.stop.check, version=info.version,
            )  # fmt: skip
        inf = Inflater(
            info.path,
            info.compression,
            field=name,
            start=seek[1] if seek else (0, 0),
            storage_options=spec.storage_options,
            source=source,
            seen=info.seen,
        )
        cursor.inflater, cursor.pos = inf, 0
        if seek is not None:
            target = spec.header_bytes + seek[0] * spec.record_bytes
            if inf.skip(target - seek[1].decompressed) != target - seek[1].decompressed:
                raise faults.seek_beyond_end(name, info, seek[0], target, inf.produced)
            cursor.pos = seek[0]
            return inf
        if spec.header_bytes and inf.skip(spec.header_bytes) != spec.header_bytes:
            raise faults.header_short(name, spec, info, inf.produced)
        return inf

    def run(self, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray, cursor: Cursor) -> None:
        """Run `run` into `dst` from where `cursor` stands: reopened, or jumping to a seek point
        where one is nearer."""
        if cursor.inflater is None or cursor.pos > run.start:
            self.open(name, spec, info, cursor, self.seek_point(run.group, name, spec, run.start))
        elif (
            run.start - cursor.pos > 1
            and (seek := self.seek_point(run.group, name, spec, run.start))
            and seek[1].decompressed > cursor.inflater.produced  # a point lies ahead: jump, not inflate
        ):
            self.open(name, spec, info, cursor, seek)
        if run.count:
            self.read_span(name, spec, info, run, cursor, dst, cast=self.cast[name] or run.step != 1)

    def seek_point(self, group: int, name: str, spec: Field, record: int) -> tuple[int, SeekPoint] | None:
        """The persistent index's last seek point at or before `record` (resume mid-file), if any."""
        points = self.catalog.seek_points.get((group, name))
        if not points or not record:
            return None
        target = spec.header_bytes + record * spec.record_bytes
        k = bisect.bisect_right(points, target, key=lambda p: p.decompressed) - 1  # sorted by decompressed
        return (record, points[k]) if k >= 0 and points[k].decompressed > spec.header_bytes else None

    def read_span(
        self, name: str, spec: Field, info: FileInfo, run: Run, cursor: Cursor, dst: np.ndarray, *, cast: bool
    ) -> None:
        """Read records `run.start .. run.stop` of the stream, keeping every `run.step`-th."""
        rb = spec.record_bytes
        inf = cursor.inflater
        assert inf is not None
        t = time.perf_counter()
        if cursor.pos < run.start:
            want = (run.start - cursor.pos) * rb
            got = inf.skip(want)
            cursor.pos += got // rb
            if got != want:
                raise self.short(name, info, run, inf, cursor.pos)
        span = run.stop - run.start
        nbytes = span * rb
        if cast:
            staging = self.staging(nbytes)
            got = inf.readinto(staging)
        else:
            got = inf.readinto(bytes_of(dst))
        self.counters.add("decompress", name, time.perf_counter() - t)
        if got != nbytes:
            cursor.pos += got // rb
            raise self.short(name, info, run, inf, cursor.pos)
        if cast:
            t = time.perf_counter()
            src = np.frombuffer(staging, dtype=spec.dtype).reshape(span, *spec.shape)
            cast_into(dst, src[:: run.step])
            del src
            self.counters.add("cast", name, time.perf_counter() - t)
        cursor.pos += span

    def short(self, name: str, info: FileInfo, run: Run, inf: Inflater, pos: int) -> StokerError:
        """The error for a stream that ends after `pos` whole records: the persistent index's
        count proven wrong, where it disagrees, else the stream cut short."""
        expected = self.catalog.count(run.group)
        lie = count_disagrees(
            self.catalog.index_file(run.group, name), info, name, run.group, expected,
            f"ends after {pos} whole records (decompressed offset {inf.produced})", record=pos, offset=inf.produced,
        )  # fmt: skip
        if lie is not None:
            return lie
        return faults.stream_short(name, info, run.group, expected, pos, inf.produced)

    def finish(self, name: str, spec: Field, info: FileInfo, run: Run, cursor: Cursor) -> None:
        """Pass over the group's remaining records and its footer, and check the stream ends there."""
        if cursor.inflater is None:
            self.open(name, spec, info, cursor)
        inf = cursor.inflater
        assert inf is not None
        expected = self.catalog.count(run.group)
        if cursor.pos < expected:  # records held by other shards: pass over them to check the end
            want = (expected - cursor.pos) * spec.record_bytes
            got = inf.skip(want)
            cursor.pos += got // spec.record_bytes
            if got != want:
                raise self.short(name, info, run, inf, cursor.pos)
        end = spec.header_bytes + cursor.pos * spec.record_bytes
        if spec.footer_bytes and inf.skip(spec.footer_bytes) != spec.footer_bytes:
            raise faults.footer_short(name, spec, info, cursor.pos, inf.produced)
        if not inf.at_end():
            lie = count_disagrees(
                self.catalog.index_file(run.group, name), info, name, run.group, expected,
                f"holds more than {cursor.pos} records (data continues at decompressed offset "
                f"{end + spec.footer_bytes})", record=cursor.pos, offset=end + spec.footer_bytes,
            )  # fmt: skip
            if lie is not None:
                raise lie
            raise faults.runs_on(name, info, run.group, cursor.pos, end + spec.footer_bytes)
