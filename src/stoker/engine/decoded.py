"""Compressed files decoded whole and verified before any of their records is yielded, and kept
for later epochs (labels), or held for a pass (a global shuffle's compressed fields)."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

import numpy as np

from ..errors import CorruptDataError, StaleIndexError
from ..io.files import Catalog, FileInfo
from ..io.inflate import TruncatedStreamError
from ..io.unchanged import Seen, check_unchanged
from ..kernels import address
from ..plan.batches import Run
from ..spec import Field
from .inflating import Cursor, StreamReads
from .stats import Counters

__all__ = ["KEPT_DECODED_BYTES", "VERIFY_WHOLE_BYTES", "KeptDecoded", "Whole", "WholeFiles"]

# A compressed file that decodes to at most this many bytes is decoded and verified whole
# (CRC and end of stream) before any of its records is yielded, so a flipped bit never
# reaches the caller. Labels (4 bytes a record) are far below it; larger files stream and
# are verified at their end. Not higher: a whole-decoded file is written to memory once and
# read back for the batches, where a streamed run is inflated into a cache-hot staging buffer
# and cast straight away; and the first batch of a group would wait for all of its file
# (with the 64 MiB gzip frames of W2, benchmarks/compare.py's gzip images, every new cycle of
# groups would stall for seconds while whole).
VERIFY_WHOLE_BYTES = 8 << 20
# Whole-decoded files kept across epochs by a pass, or by a loader for all its passes (within
# its memory_budget there: see Loader), at most this many bytes (KeptDecoded).
KEPT_DECODED_BYTES = 64 << 20

# A compressed file decoded whole: records, how many are trustworthy, the error for the
# rest, and an error to raise at the group's end (data beyond the expected records).
Whole = tuple[np.ndarray, int, BaseException | None, BaseException | None]


class KeptDecoded:
    """Compressed files decoded whole and verified, kept by (field, path) for later epochs.

    A label file decoded whole (`VERIFY_WHOLE_BYTES`) was otherwise inflated again in every
    epoch, and per-batch worker Python costs more in the loop than alone (the copies between
    evict its caches, and workers wait on the GIL). Kept
    only for a file that decoded clean (every record, CRC and end checked), reused only while
    the file is the one decoded (device, inode, size and mtime), never written (batches get
    copies), and at most `limit` bytes of them, the least recently used dropped first.
    Thread-safe; shared by a loader's passes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], tuple[Seen | None, np.ndarray]] = OrderedDict()

    def get(self, name: str, path: str, ident: Seen | None) -> np.ndarray | None:
        """The records kept of `path` for field `name` if they were kept of this `ident` (None: any)."""
        with self._lock:
            kept = self._kept.get((name, path))
            if kept is None:
                return None
            if kept[0] != ident:  # the file changed since: decode it again
                del self._kept[(name, path)]
                self.held -= kept[1].nbytes
                return None
            self._kept.move_to_end((name, path))
            return kept[1]

    def put(self, name: str, path: str, ident: Seen | None, records: np.ndarray) -> None:
        """Keep `records`, decoded from `path` as it was at `ident`, unless they exceed the limit alone."""
        if records.nbytes > self.limit:
            return
        with self._lock:
            old = self._kept.pop((name, path), None)
            if old is not None:
                self.held -= old[1].nbytes
            self._kept[(name, path)] = (ident, records)
            self.held += records.nbytes
            while self.held > self.limit:
                self.held -= self._kept.popitem(last=False)[1][1].nbytes

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self.held = 0


class WholeFiles:
    """Decodes compressed files whole: each verified before use (`decoded`, kept across epochs
    in `kept`), or held in memory for the pass (`resident`: a global shuffle's gathers).

    `kept`: a loader's KeptDecoded, shared by its passes; None: this one's own, cleared with it.
    """

    def __init__(
        self, catalog: Catalog, reads: StreamReads, counters: Counters, kept: KeptDecoded | None = None
    ) -> None:
        self.catalog = catalog
        self.reads = reads
        self.counters = counters
        self.kept = KeptDecoded(KEPT_DECODED_BYTES) if kept is None else kept
        self._owns_kept = kept is None
        self._lock = threading.Lock()
        self._decode_locks: dict[tuple[str, str], threading.Lock] = {}  # see decoded
        self._resident: dict[tuple[int, str], tuple[np.ndarray, int]] = {}  # with its address
        self._resident_locks: dict[tuple[int, str], threading.Lock] = {}

    def whole_able(self, spec: Field, group: int) -> bool:
        """Whether the group's file of field `spec` is decoded and verified whole (no turns)."""
        expected = self.catalog.count(group)
        return spec.header_bytes + expected * spec.record_bytes + spec.footer_bytes <= VERIFY_WHOLE_BYTES

    def decoded(self, name: str, spec: Field, info: FileInfo, group: int) -> Whole:
        """The group's file of `name` decoded whole: kept from an earlier epoch, or decoded now.

        One decode at a time per file: epochs overlap when they are short (several batches
        assembled together can be a whole epoch, see stoker.engine.budget.COALESCE_BYTES), and the
        next epoch's stream then waits for this one's decode and finds it kept.
        """
        with self._lock:
            lock = self._decode_locks.setdefault((name, info.path), threading.Lock())
        with lock:
            return self._kept_or_decoded_now(name, spec, info, group)

    def _kept_or_decoded_now(self, name: str, spec: Field, info: FileInfo, group: int) -> Whole:
        expected = self.catalog.count(group)
        ident = info.seen  # kept only as decoded from the file the Dataset saw (the open checks it)
        if ident is not None:
            records = self.kept.get(name, info.path, ident)
            if records is not None and len(records) == expected:
                # One stat per reuse: a file changed since is refused, as opening it would be.
                try:
                    st = os.stat(info.path)
                except OSError:
                    st = None  # gone: the decode below raises the ReadError naming it
                if st is not None:
                    check_unchanged(name, info.path, ident, st)
                    return records, expected, None, None
        whole = self._decode(name, spec, info, group, expected)
        records, valid, err, final_err = whole
        if ident is not None and valid == expected and err is None and final_err is None:
            self.kept.put(name, info.path, ident, records)
        return whole

    def _decode(self, name: str, spec: Field, info: FileInfo, group: int, expected: int) -> Whole:
        """(records, how many are trustworthy, error for the rest, error at the group's end)."""
        rb = spec.record_bytes
        buf = np.empty(expected * rb, np.uint8)
        cursor = Cursor()
        err: BaseException | None = None
        final_err: BaseException | None = None
        valid = expected
        t = time.perf_counter()
        try:
            inf = self.reads.open(name, spec, info, cursor)
            try:
                got = inf.readinto(memoryview(buf))  # type: ignore[arg-type]
                if got < len(buf):
                    valid = got // rb
                    err = self.reads.short(name, info, Run(group, 0, expected, 0, True), inf, valid)
                else:
                    cursor.pos = expected
                    try:
                        self.reads.finish(name, spec, info, Run(group, 0, expected, 0, True), cursor)
                    except TruncatedStreamError:
                        raise
                    except (CorruptDataError, StaleIndexError) as e:
                        if e.__cause__ is not None:  # the decoder's own error (bad CRC, bad data)
                            raise
                        final_err = e  # whole records, then more data: raised at the group's end
            except TruncatedStreamError as e:
                # A stream cut before its end marker cannot be checked: bytes that follow the cut
                # (a copy gone wrong, a partial write) decode as data no CRC ever covers. So none
                # of its records is yielded; the error still says where the stream stops.
                valid, err = 0, e
                if e.index is None:
                    e.index = max(0, (inf.produced - spec.header_bytes) // rb)
                    e.add_note(
                        f"stoker: record {e.index} of group {group} is the first one the stream does not hold; "
                        "none of the group's records is yielded, since a stream without its end cannot be verified"
                    )
        except CorruptDataError as e:
            valid, err = 0, e  # a stream that fails its checks: none of its records is trusted
        finally:
            self.counters.add("decompress", name, time.perf_counter() - t)
            cursor.close()
        return buf.view(spec.dtype).reshape(expected, *spec.shape), max(0, min(valid, expected)), err, final_err

    def resident(self, name: str, spec: Field, info: FileInfo, g: int) -> tuple[np.ndarray, int]:
        """Group `g`'s compressed file of field `name` decoded whole and held for the pass, and its address.

        Decoded from the file the Dataset saw (its open checks it), so it pairs with the other
        fields' files, each checked at every open of the pass: one changed since is refused there.
        """
        key = (g, name)
        held = self._resident.get(key)
        if held is not None:
            return held
        with self._lock:
            lock = self._resident_locks.setdefault(key, threading.Lock())
        with lock:
            held = self._resident.get(key)
            if held is None:
                n = self.catalog.count(g)
                buf = np.empty(n * spec.record_bytes, np.uint8)
                cursor = Cursor()
                self.reads.open(name, spec, info, cursor)
                try:
                    run = Run(g, 0, n, 0, True)
                    dst = buf.view(spec.dtype).reshape(n, *spec.shape) if n else buf[:0]
                    self.reads.read_span(name, spec, info, run, cursor, dst, cast=False)
                    self.reads.finish(name, spec, info, run, cursor)
                finally:
                    cursor.close()
                arr = buf.view(spec.dtype).reshape(n, *spec.shape)
                held = self._resident[key] = (arr, address(buf))
        return held

    def close(self) -> None:
        """Drop what the pass held, and the kept files where they are this one's own."""
        self._resident.clear()  # "global" shuffle's decoded fields: the pass is over
        if self._owns_kept:
            self.kept.clear()
