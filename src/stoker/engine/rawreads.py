"""Runs of raw (uncompressed) files into the batch: by preadv, from a memory map cast by a
compiled kernel, several runs in one kernel call, or ranged GETs of a remote file."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ReadError, StokerError
from ..io import faults
from ..io.fetch import Fetcher
from ..io.files import Catalog, FileInfo
from ..io.readahead import Readahead
from ..io.remote import is_remote
from ..kernels import MapFault, cast_into, cast_mapped, copy_records, file_size, file_sizes, gather_runs
from ..plan.batches import Run
from ..spec import Field
from .buffers import Staging, bytes_of
from .executor import StopFlag, flush_wake
from .openfiles import OpenFile, OpenFiles
from .stats import Counters

__all__ = ["RawReader"]

# Records numpy casts are copied out of their map, and cold cast runs read by preadv, this many
# bytes at a time, so each chunk is still in the cache when it is cast (see _copy_mapped, _pread_cast).
_STAGED_BYTES = 256 << 10


def truncated(name: str, info: FileInfo, spec: Field, run: Run, offset: int) -> StokerError:
    """Run `run` of a file that ends at byte `offset` (see stoker.io.faults.truncated)."""
    return faults.truncated(name, info, spec, run.group, run.start, run.count, offset)


def _read_fully(name: str, spec: Field, info: FileInfo, run: Run, fd: int, view: memoryview, offset: int) -> None:
    """`view` filled by preadv from byte `offset` of `fd`: an error naming the file if it fails or ends first."""
    flush_wake()  # see stoker.engine: about to give the GIL up, maybe wait on the disk
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise faults.read_failed(name, info, spec, offset + done, e) from e
        if got == 0:
            raise truncated(name, info, spec, run, offset + done)
        done += got


def _check_size(name: str, spec: Field, info: FileInfo, run: Run, fd: int, end: int) -> None:
    """A read racing a cut can copy the zeros the cut leaves past the new end of a page, in full
    count: the size after the read says whether every byte read up to `end` was still the file's."""
    now = file_size(fd)
    if now < end:
        raise truncated(name, info, spec, run, now)


class RawReader:
    """Reads runs of raw files into batch arrays; files held through the pass's `OpenFiles`.

    `cast`: per field, whether its output dtype differs from its stored one.
    """

    def __init__(
        self, catalog: Catalog, cast: Mapping[str, bool], files: OpenFiles, *, fetcher: Fetcher,
        readahead: Readahead, counters: Counters, stop: StopFlag, staging: Staging,
    ) -> None:  # fmt: skip
        self.catalog = catalog
        self.cast = dict(cast)
        self.files = files
        self.fetcher = fetcher
        self.readahead = readahead
        self.counters = counters
        self.stop = stop
        self.staging = staging

    def read(
        self, epoch: int, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray,
        put: Callable[..., Any] | None = None,
    ) -> None:  # fmt: skip
        """Run `run` of field `name`'s file `info` into `dst` (`put`: transformed as read)."""
        rb = spec.record_bytes
        offset = spec.header_bytes + run.start * rb
        if is_remote(info.path):
            flush_wake()  # see stoker.engine: about to wait on the network
            self._read_remote(name, spec, info, run, dst, offset)
            return
        if run.count == 0:
            self.files.empty_run(epoch, info, run.final)
            return
        f = self.files.acquire(epoch, name, info)
        t = time.perf_counter()
        try:
            # Uncast runs: preadv on a file's first visit in the pass, where it beats a streamed
            # copy from a map made for that visit and a failing disk gives an error rather than
            # a SIGBUS; from a map kept from an earlier epoch, whose pages are mapped already,
            # the streamed copy is the faster (measured: benchmarks/results/w1_history.md).
            if not self.cast[name] and run.step == 1 and put is None and not f.reused:
                self._pread(name, spec, info, run, f, dst, offset)
            elif put is None and self._cold_cast(name, run, f, offset, spec.record_bytes):
                self._pread_cast(name, spec, info, run, f, dst, offset)
            else:
                # A file cut short before this check fails here; one cut during the copy faults
                # in a guarded kernel (MapFault), and numpy never reads the map (see _copy_mapped).
                span = run.stop - run.start
                if f.map is None or f.size < offset + span * rb or file_size(f.fd) < offset + span * rb:
                    raise truncated(name, info, spec, run, min(f.size, file_size(f.fd)))
                try:
                    self._copy_mapped(spec, run, f, offset, dst, put)
                except MapFault as e:
                    raise self.map_fault(name, info, spec, run, f, e) from e
                # A cut that leaves part of a page reads as zeros there, without a fault: the size
                # after the copy says whether every byte copied was still the file's.
                now = file_size(f.fd)
                if now < offset + span * rb:
                    raise truncated(name, info, spec, run, now)
            nread = (run.stop - run.start) * rb
            f.warm = self.readahead.after_read(f.fd, f.map, f.size, offset, nread, ahead=not f.warm) or f.warm
        finally:
            self.counters.add("read+cast" if self.cast[name] or put else "read", name, time.perf_counter() - t)
            self.files.release(epoch, info, f, run.final)

    def read_runs(self, epoch: int, runs: list[Run], name: str, spec: Field, dst: np.ndarray) -> None:
        """Runs `runs` (none empty) of local raw field `name` into `dst`: the files held,
        their sizes read and let go in one call or lock round each, the records copied (cast)
        by one `gather_runs`. A first visit of an uncast run reads with preadv, as `read` does."""
        limit = self.files.hold_limit
        if len(runs) > limit:  # a batch over more small files than a hold may keep open
            for k in range(0, len(runs), limit):
                self.read_runs(epoch, runs[k : k + limit], name, spec, dst)
            return
        rb = spec.record_bytes
        infos = [self.catalog.files[run.group][name] for run in runs]
        held = self.files.hold(epoch, name, infos)
        t = time.perf_counter()
        try:
            sizes = file_sizes([f.fd for f in held])
            offsets = [spec.header_bytes + run.start * rb for run in runs]
            spans = [(run.stop - run.start) * rb for run in runs]
            mapped: list[int] = []  # (row, address, count, stride) of each run read through its map
            copied: list[int] = []  # which runs those are
            for k, (run, info, f, now, offset, nread) in enumerate(
                zip(runs, infos, held, sizes, offsets, spans, strict=True)
            ):
                if not self.cast[name] and run.step == 1 and not f.reused:
                    self._pread(name, spec, info, run, f, dst[run.row : run.row + run.count], offset)
                    continue
                if self._cold_cast(name, run, f, offset, rb):
                    self._pread_cast(name, spec, info, run, f, dst[run.row : run.row + run.count], offset)
                    continue
                if f.map is None or f.size < offset + nread or now < offset + nread:
                    raise truncated(name, info, spec, run, min(f.size, now))
                mapped += (run.row, f.address() + offset, run.count, run.step * rb)
                copied.append(k)
            try:
                gather_runs(dst, mapped, spec.dtype)
            except MapFault as e:
                k = self.faulted(held, e)
                raise self.map_fault(name, infos[k], spec, runs[k], held[k], e) from e
            if copied:  # a cut inside a page reads as zeros, no fault: the sizes after say (see read)
                for k, now in zip(copied, file_sizes([held[k].fd for k in copied]), strict=True):
                    if now < offsets[k] + spans[k]:
                        raise truncated(name, infos[k], spec, runs[k], now)
            for f, offset, nread in zip(held, offsets, spans, strict=True):
                f.warm = self.readahead.after_read(f.fd, f.map, f.size, offset, nread, ahead=not f.warm) or f.warm
        finally:
            self.counters.add("read+cast" if self.cast[name] else "read", name, time.perf_counter() - t)
            with self.files.lock:  # every run in one lock round
                for run, info, f in zip(runs, infos, held, strict=True):
                    self.files.released(epoch, info, f, run.final)
            self.files.end_hold(len(infos))

    @staticmethod
    def faulted(held: Sequence[OpenFile], e: OSError) -> int:
        """Which of `held` a MapFault `e` read from: the map holding its address, else the
        first file now shorter than it was (their sizes read again), else the first."""
        at = getattr(e, "address", 0)
        for k, f in enumerate(held):
            if f.map is not None and 0 <= at - f.address() < f.size:
                return k
        sizes = file_sizes([f.fd for f in held])
        return next((k for k, (f, now) in enumerate(zip(held, sizes, strict=True)) if now < f.size), 0)

    @staticmethod
    def map_fault(name: str, info: FileInfo, spec: Field, run: Run, f: OpenFile, e: OSError) -> StokerError:
        """The error for a bus error reading `f`'s map during run `run` (see stoker.io.faults.map_fault)."""
        e.__traceback__ = None  # its frames hold views of the map, which could then not be closed
        return faults.map_fault(
            name, info, spec, run.group, run.start, run.count, e,
            now=file_size(f.fd), mapped=f.size, offset=getattr(e, "address", 0) - f.address(),
        )  # fmt: skip

    def _copy_mapped(
        self, spec: Field, run: Run, f: OpenFile, offset: int, dst: np.ndarray, put: Callable[..., Any] | None
    ) -> None:
        """Run `run` from `f`'s map at byte `offset` into `dst`, cast or transformed
        (`put`), by a compiled kernel: a SIGBUS in its reads (the file cut short meanwhile)
        raises MapFault. Where only numpy could do it, whose reads of a map cannot be guarded,
        the records are first copied out of the map (stoker.kernels.copy_records)."""
        rb = spec.record_bytes
        span = run.stop - run.start
        src = np.frombuffer(f.map, dtype=spec.dtype, count=span * (rb // spec.dtype.itemsize),
                            offset=offset).reshape(span, *spec.shape)[:: run.step]  # fmt: skip
        try:
            if put is not None:
                flush_wake()  # a transform's own code runs here
                if put(src, dst, run.row, mapped=True):
                    return
            elif (run.step == 1 and cast_mapped(dst, src)) or gather_runs(
                dst, (0, f.address() + offset, run.count, run.step * rb), spec.dtype
            ):
                return
        finally:
            del src
        offsets = offset + np.arange(run.count, dtype=np.int64) * (run.step * rb)
        if put is None and dst.dtype == spec.dtype and dst.flags.c_contiguous:  # a copy: straight into dst
            copy_records(dst.reshape(run.count, -1).view(np.uint8), f.fd, f.address(), offsets)
            return
        # In chunks that stay in the cache between their copy and numpy's pass over them.
        per = max(1, _STAGED_BYTES // rb)
        staged = self.staging(min(run.count, per) * rb)
        for a in range(0, run.count, per):
            n = min(per, run.count - a)
            rows = np.frombuffer(staged, np.uint8, count=n * rb).reshape(n, rb)
            copy_records(rows, f.fd, f.address(), offsets[a : a + n])
            records = rows.view(spec.dtype).reshape(n, *spec.shape)
            if put is not None:
                put(records, dst[a : a + n], run.row + a)
            else:
                cast_into(dst[a : a + n], records)
            del rows, records

    def _cold_cast(self, name: str, run: Run, f: OpenFile, offset: int, rb: int) -> bool:
        """Whether a cast run is read by preadv and then cast, not cast from the file's map:
        its last page is out of the page cache. Faulted through a map, a cold run waits for the
        kernel's read-around one small window at a time; preadv asks the disk for it whole."""
        if not self.cast[name] or run.step != 1 or f.reused or f.warm:
            return False
        return self.readahead.missing(f.fd, offset + run.count * rb - 1)

    def _pread_cast(
        self, name: str, spec: Field, info: FileInfo, run: Run, f: OpenFile, dst: np.ndarray, offset: int
    ) -> None:
        """Run `run` (every record) read by preadv into staging, a chunk at a time, each cast into `dst`."""
        rb = spec.record_bytes
        per = max(1, _STAGED_BYTES // rb)
        staged = self.staging(min(run.count, per) * rb)
        if run.count > per:  # the whole run asked of the disk at once, not a chunk per wait
            os.posix_fadvise(f.fd, offset, run.count * rb, os.POSIX_FADV_WILLNEED)
        for a in range(0, run.count, per):
            n = min(per, run.count - a)
            view = staged[: n * rb]
            _read_fully(name, spec, info, run, f.fd, view, offset + a * rb)
            records = np.frombuffer(view, spec.dtype).reshape(n, *spec.shape)
            cast_into(dst[a : a + n], records)
            del records
        _check_size(name, spec, info, run, f.fd, offset + run.count * rb)

    def _pread(
        self, name: str, spec: Field, info: FileInfo, run: Run, f: OpenFile, dst: np.ndarray, offset: int
    ) -> None:
        """Run `run` (every record, uncast) copied into `dst` by preadv from `offset`."""
        _read_fully(name, spec, info, run, f.fd, bytes_of(dst), offset)
        _check_size(name, spec, info, run, f.fd, offset + run.count * spec.record_bytes)

    def _read_remote(self, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray, offset: int) -> None:
        """A run of a remote raw file: its parts (asked for ahead, or now) into the batch or staging."""
        rb = spec.record_bytes
        span = run.stop - run.start
        direct = not self.cast[name] and run.step == 1
        view = bytes_of(dst) if direct else self.staging(span * rb)
        t = time.perf_counter()
        try:
            got = self.fetcher.read_into(
                info.path, spec.storage_options, offset, view, size=info.size, field=name, check=self.stop.check,
                version=info.version,
            )  # fmt: skip
        except ReadError as e:
            e.index = (e.offset - spec.header_bytes) // rb if e.offset is not None else run.start
            e.add_note(f"record {e.index} of group {run.group}")
            raise
        finally:
            self.counters.add("read", name, time.perf_counter() - t)
        if got < span * rb:
            raise truncated(name, info, spec, run, offset + got)
        if not direct:
            src = np.frombuffer(view, dtype=spec.dtype).reshape(span, *spec.shape)
            np.copyto(dst, src[:: run.step], casting="unsafe")
            del src

    def remote_records(self, name: str, spec: Field, info: FileInfo, local: np.ndarray) -> np.ndarray:
        """Records `local` (sorted) of a remote raw file, for a gather."""
        raw = self.fetcher.read_records(
            info.path,
            spec.storage_options,
            spec.header_bytes,
            spec.record_bytes,
            local,
            size=info.size,
            field=name,
            check=self.stop.check,
            version=info.version,
        )
        return raw.view(spec.dtype).reshape(len(local), *spec.shape)
