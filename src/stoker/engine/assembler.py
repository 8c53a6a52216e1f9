"""Decode and cast into the output: executes one planned batch into fresh aligned arrays.

Raw fields are read in bulk: straight into the batch with `os.preadv` when no cast is
needed, else cast from a memory map of the file by `stoker.kernels.cast_into` (one pass, no
staging buffer, streaming stores into large batches; `np.copyto` where the compiled kernel
does not apply). Compressed fields are read by one stream per
(epoch, group, field); batches take their turn on a stream by tickets handed out in plan
order, so parallel workers still read each stream front to back exactly once.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import itertools
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptDataError, ReadError, StaleIndexError, StokerError
from ..io.fetch import Fetcher
from ..io.files import Catalog, FileInfo, open_local
from ..io.index import count_disagrees
from ..io.inflate import Inflater, TruncatedStreamError
from ..io.readahead import Readahead
from ..io.reads import seek_read
from ..io.remote import is_remote, pieces
from ..io.seekpoints import SeekPoint
from ..kernels import (
    MapFault,
    address,
    cast_into,
    cast_mapped,
    copy_records,
    file_size,
    file_sizes,
    gather_records,
    gather_runs,
    gathers,
    map_address,
    map_file,
    maps_hold_descriptors,
)
from ..machine import descriptor_limits, max_map_count, set_soft_descriptor_limit
from ..plan.batches import BatchPlan, Gather, Run
from ..spec import Field
from .executor import Allocator, StopFlag, Stopped, flush_wake
from .stats import CPU_SAMPLE_SECONDS, Counters, thread_clock

__all__ = ["GROUP_KEY", "INDEX_KEY", "VALID_KEY", "Assembler", "KeptMaps", "Task", "fill_padding"]

GROUP_KEY = "__group__"
INDEX_KEY = "__index__"
VALID_KEY = "__valid__"  # pad_last: True on real rows, False on padding
# Open raw files kept across runs; a group's files close after its last run, this bounds
# what early breaks and dropped remainders leave open. At least this many, and as many as the
# descriptor limit allows (_max_open_files, at most _MAX_OPEN_FILES): a global shuffle's batch
# reads from most of the dataset's files, and with 64 open W1-big's 415 files were opened,
# mapped and unmapped again batch after batch (see raise_open_files).
_MAX_OPEN = 64
_MAX_OPEN_FILES = 1024
# Kept maps where they hold no descriptor (_max_kept_maps): at most this many, and a quarter of
# the process's memory mappings (vm.max_map_count, 65530 by default; TensorFlow, PyTorch and
# JAX imported together hold ~1,600).
_MAX_KEPT_MAPS = 16384
# Records numpy casts are copied out of their map this many bytes at a time (see _copy_mapped).
_STAGED_BYTES = 256 << 10


def _max_open_files() -> int:
    """Descriptors a loader may keep open for maps or files: a quarter of the soft descriptor
    limit, at most _MAX_OPEN_FILES."""
    return max(0, min(_MAX_OPEN_FILES, descriptor_limits()[0] // 4))


def pass_open_files() -> int:
    """Raw files a pass keeps open at most (see _MAX_OPEN): never more than half the soft
    descriptor limit (under a limit of 64, 64 open files left the process no descriptor)."""
    return max(min(_MAX_OPEN, descriptor_limits()[0] // 2), _max_open_files())


def raise_open_files(wanted: int) -> tuple[int, int] | None:
    """Raise the soft descriptor limit, within the hard one, until `_max_open_files()` covers
    `wanted` files (at most _MAX_OPEN_FILES); (old soft limit, new) where it was raised.

    A global shuffle's batch reads from most of the dataset's files, and a pass keeps at most
    `_max_open_files()` of them open: under the usual soft limit of 1024, 256 of W1-big's 415,
    so every batch opened, mapped and unmapped again the files that had been closed (measured:
    benchmarks/results/w1_big_history.md). The soft limit is there for programs that use `select()`, which
    cannot watch a descriptor numbered 1024 or more; only the files stoker opens beyond that
    get such numbers, and a quarter of the limit is still all a pass keeps.
    """
    wanted = min(wanted, _MAX_OPEN_FILES)
    soft, hard = descriptor_limits()
    new = min(hard, 4 * wanted)
    if soft // 4 >= wanted or new <= soft or not set_soft_descriptor_limit(new):
        return None
    return soft, new


def _max_kept_maps() -> int:
    """Memory maps kept for later epochs (KeptMaps).

    A map made by `mmap.mmap` (no compiled kernels) holds a descriptor: as many as
    `_max_open_files`. The kernels' `FileMap` holds none, so the descriptor limit does not
    bound it (1024 by default on most Linux systems, so 256 maps, too few for a dataset of
    many small files, whose maps would be made again on every visit); it is
    still one of the process's limited memory mappings, a quarter of which are kept at most.
    """
    if maps_hold_descriptors():
        return _max_open_files()
    return max(0, min(_MAX_KEPT_MAPS, max_map_count() // 4))


# A map kept for the next epoch, valid while the file is still this one: (st_dev, st_ino,
# st_mtime_ns, mapped size).
_Identity = tuple[int, int, int, int]
# A compressed file that decodes to at most this many bytes is decoded and verified whole
# (CRC and end of stream) before any of its records is yielded, so a flipped bit never
# reaches the caller. Labels (4 bytes a record) are far below it; larger files stream and
# are verified at their end. Not higher: a whole-decoded file is written to memory once and
# read back for the batches, where a streamed run is inflated into a cache-hot staging buffer
# and cast straight away; and the first batch of a group would wait for all of its file
# (W2's 64 MiB gzip frames: every new cycle of groups stalled for seconds while whole).
VERIFY_WHOLE_BYTES = 8 << 20
# Whole-decoded files kept across epochs by a pass, or by a loader for all its passes (within
# its memory_budget there: see Loader), at most this many bytes (KeptDecoded).
KEPT_DECODED_BYTES = 64 << 20


class _Lent:
    """A map in KeptMaps: the file it was made from, and how many holders read through it now."""

    __slots__ = ("ident", "map", "users")

    def __init__(self, ident: _Identity, mapped: Any, users: int) -> None:
        self.ident = ident
        self.map = mapped
        self.users = users


class KeptMaps:
    """Memory maps of raw files by path: one map of a file for all who read it at once, kept for
    the next epoch once the last of them has given it back.

    A map closed at the end of each epoch is made again in the next, and every page of the file
    is faulted in again, which costs a loop casting from maps a good share of its records/s
    (measured: benchmarks/results/w1_history.md; `MAP_POPULATE` gained nothing). A pass over
    several epochs keeps its maps from one to the next; a loader keeps one `KeptMaps` for all
    its passes where maps hold no descriptor (`stoker.kernels.map_file`), so a new pass per
    epoch (a PyTorch `for batch in loader` per epoch, each epoch of Keras' `fit`) finds them
    too, and no file stays open between passes; `Loader.close()` unmaps them, or their last
    holder (the loader, or a pass still running after its loader was dropped) going away does.

    A map is shared while in use, not only kept after: a global shuffle reads from every file
    up to an epoch's last batch, so the next epoch's first batches open every file while the
    last epoch still holds it, and a map of its own for each would be made and faulted in again
    once per epoch.

    A map is used only for the same file, unchanged (device, inode, mtime and size); at most
    `limit` are kept once nobody holds them (_max_kept_maps). Beyond it the map given back
    last is closed, not the oldest: epochs visit the same files, in the same order unless
    shuffled, so the least recently used map is the one needed soonest, and evicting it would
    close every map before its next visit; keeping the first `limit` finds them on every
    epoch whatever the order.
    Thread-safe: a pass's last worker may still be giving maps back while the next pass takes
    them.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = _max_kept_maps() if limit is None else limit
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, _Lent] = OrderedDict()
        self._idle = 0  # maps nobody holds
        self._closed = False

    def take(self, path: str, ident: _Identity) -> tuple[Any, bool] | None:
        """The map of `path` if it is of this file unchanged, and whether it was idle (kept
        after its holders had read through it, rather than held by one still reading); give it
        back with `put`. A stale map nobody holds is closed."""
        stale = None
        with self._lock:
            lent = self._maps.get(path)
            if lent is None:
                return None
            if lent.ident == ident:
                idle = lent.users == 0
                self._idle -= idle
                lent.users += 1
                self._maps.move_to_end(path)
                return lent.map, idle
            if lent.users == 0:  # still held: it goes when its last holder gives it back
                del self._maps[path]
                self._idle -= 1
                stale = lent.map
        if stale is not None:
            stale.close()
        return None

    def lend(self, path: str, ident: _Identity, mapped: Any) -> Any:
        """Share `mapped`, a new map of `path`, with later takers; the map to read through
        and give back with `put`: another's of the same file where one came first (`mapped`
        is then closed), else `mapped`."""
        extra = None
        with self._lock:
            lent = self._maps.get(path)
            if self._closed:
                pass  # put() closes it
            elif lent is not None and lent.ident == ident:
                self._idle -= lent.users == 0
                lent.users += 1
                mapped, extra = lent.map, mapped
            elif lent is None or lent.users == 0:
                if lent is not None:
                    self._idle -= 1
                    extra = lent.map
                self._maps[path] = _Lent(ident, mapped, 1)
                self._maps.move_to_end(path)
        if extra is not None:
            extra.close()
        return mapped

    def put(self, path: str, ident: _Identity, mapped: Any) -> None:
        """Give back a map (from `take` or `lend`, or made apart), kept once nobody holds it."""
        closing = []
        with self._lock:
            lent = self._maps.get(path)
            if lent is not None and lent.map is mapped:
                lent.users -= 1
                if lent.users == 0:
                    self._idle += 1
                    self._maps.move_to_end(path)
            elif self._closed or self.limit == 0 or (lent is not None and lent.users):
                closing.append(mapped)  # not kept; a map of this path still held stays
            else:
                if lent is not None:
                    closing.append(lent.map)
                    self._idle -= 1
                self._maps[path] = _Lent(ident, mapped, 0)
                self._maps.move_to_end(path)
                self._idle += 1
            limit = 0 if self._closed else self.limit
            if self._idle > limit:  # the latest given back go first (see the class)
                idle = (k for k, v in reversed(self._maps.items()) if v.users == 0)
                for key in list(itertools.islice(idle, self._idle - limit)):
                    closing.append(self._maps.pop(key).map)
                    self._idle -= 1
        for m in closing:
            m.close()

    def __len__(self) -> int:
        """Maps kept that nobody holds."""
        return self._idle

    def close(self) -> None:
        """Unmap every map nobody holds; the others are unmapped as they are given back, and
        later `lend` and `put` calls close what they are given. Idempotent."""
        with self._lock:
            self._closed = True
            idle = [k for k, v in self._maps.items() if v.users == 0]
            maps = [self._maps.pop(k).map for k in idle]
            self._idle = 0
        for m in maps:
            m.close()


class KeptDecoded:
    """Compressed files decoded whole and verified, kept by (field, path) for later epochs.

    A label file decoded whole (`VERIFY_WHOLE_BYTES`) was otherwise inflated again in every
    epoch, and per-batch worker Python costs more in the loop than alone (the copies between
    evict its caches, and workers wait on the GIL). Kept
    only for a file that decoded clean (every record, CRC and end checked), reused only while
    the file is the one decoded (device, inode, mtime and size), never written (batches get
    copies), and at most `limit` bytes of them, the least recently used dropped first.
    Thread-safe; shared by a loader's passes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], tuple[_Identity, np.ndarray]] = OrderedDict()

    def get(self, name: str, path: str, ident: _Identity) -> np.ndarray | None:
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

    def put(self, name: str, path: str, ident: _Identity, records: np.ndarray) -> None:
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


def identity(path: str) -> _Identity | None:
    """(device, inode, mtime, size) of a local file, or None where it cannot be had."""
    if is_remote(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _identity_of(st, st.st_size)


def _identity_of(st: os.stat_result, size: int) -> _Identity:
    """The identity of a file by its stat and the size read of it (see KeptMaps, KeptDecoded)."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns, size)


def loader_kept_maps() -> KeptMaps | None:
    """A `KeptMaps` for a loader to share between its passes, or None where maps hold a
    descriptor (no compiled kernels): each pass then keeps its own and closes them with it."""
    return None if maps_hold_descriptors() else KeptMaps()


def _reading(name: str, info: FileInfo, group: int, start: int, stop: int) -> str:
    return f"stoker: while reading field {name!r} from {info.path!r} (group {group}, records {start}..{stop - 1})"


# Plans the look-ahead holds at most beyond the one handed on (plans reading no remote byte ask
# the fetcher for nothing, so its room alone would not bound them).
_MAX_LOOKAHEAD = 1024


def _looking_ahead(
    plans: Iterator[BatchPlan], want: Callable[[BatchPlan], None], room: Callable[[], bool]
) -> Iterator[BatchPlan]:
    """`plans`, each passed to `want` before it is handed on, as many ahead as `room()` allows
    (at least the one handed on). A planning error comes after the plans before it."""
    waiting: collections.deque[BatchPlan] = collections.deque()
    error: BaseException | None = None
    done = False
    while True:
        while not done and error is None and (not waiting or (room() and len(waiting) < _MAX_LOOKAHEAD)):
            try:
                plan = next(plans)
            except StopIteration:
                done = True
                break
            except BaseException as e:
                error = e
                break
            with contextlib.suppress(StokerError):  # asked for again by its read, which raises it there
                want(plan)
            waiting.append(plan)
        if not waiting:
            break
        yield waiting.popleft()
    if error is not None:
        raise error


def _by_file(gather: Gather) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """A gather sorted by (group, record), so each file is visited once, front to back:
    `(order, groups, index, spans)`, record `k` of the sorted ones going to row
    `order[k]`, `spans` the `[a, b)` stretches of one group each."""
    order = np.lexsort((gather.index, gather.groups))
    groups, index = gather.groups[order], gather.index[order]
    cuts = (np.flatnonzero(np.diff(groups)) + 1).tolist()
    spans = list(zip([0, *cuts], [*cuts, len(order)], strict=True)) if len(order) else []
    return order, groups, index, spans


def _cut(name: str, info: FileInfo, size: int) -> CorruptDataError:
    """The error for a raw file found `size` bytes long, shorter than when the Dataset was built."""
    return CorruptDataError(
        f"field {name!r}: {info.path!r} is {size} bytes now but was {info.size} bytes when the Dataset was built; "
        "the file was truncated after the Dataset was built",
        field=name, path=info.path, offset=size,
    )  # fmt: skip


class _RawFile:
    __slots__ = ("_address", "done", "fd", "ident", "map", "refs", "reused", "size", "warm")

    def __init__(self, fd: int, size: int, mapped: Any, ident: _Identity, *, reused: bool = False) -> None:
        self.fd = fd
        self.ident = ident  # what the map was made from (see Assembler._close_file)
        self.size = size
        self.map = mapped
        # The map was kept from an earlier epoch: every page of it was read once already.
        self.reused = reused
        self.refs = 0
        self.done = False
        self.warm = False  # the rest of the file was found in the page cache: no advice ahead
        self._address = 0

    def address(self) -> int:
        """Where the map's first byte lies in memory (the map is open)."""
        if not self._address:
            self._address = map_address(self.map)
        return self._address

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Stream:
    """One compressed file being read front to back; batches take turns by ticket.

    A file small enough to be decoded whole (`unordered`) needs no turns: it is decoded
    once, by whichever batch gets there first, and each batch copies its own rows in any
    order. `serving` then counts the runs done, and the decoded records are dropped with
    the stream once the group's final run has been issued and every issued run is done.
    """

    def __init__(self, *, unordered: bool = False) -> None:
        # `lock` alone where nobody waits (tickets, an unordered stream's count): a plain
        # lock's `with` runs in C, a Condition's in Python, on every run of every batch.
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.issued = 0  # tickets handed out (in plan order, by the dispatcher)
        self.serving = 0  # ticket whose turn it is (unordered: runs done)
        self.unordered = unordered
        self.final_issued = False  # the group's final run has a ticket: no more will come
        self.whole: _Whole | None = None
        self.inflater: Inflater | None = None
        self.pos = 0  # records consumed so far
        # The first ticket whose batch failed: batches after it are never delivered, batches
        # before it still are (a later batch can fail first, before its turn comes).
        self.failed_at: int | None = None
        self.abandoned: set[int] = set()  # tickets of failed batches, skipped when their turn comes

    def advance(self) -> None:
        """End the current turn (caller holds `cond`), skipping abandoned tickets."""
        self.serving += 1
        while self.serving in self.abandoned:
            self.abandoned.discard(self.serving)
            self.serving += 1
        self.cond.notify_all()

    def fail(self, ticket: int) -> None:
        if self.failed_at is None or ticket < self.failed_at:
            self.failed_at = ticket

    def failed_before(self, ticket: int) -> bool:
        """True when a batch planned before `ticket`'s (or its own) failed on this stream."""
        return self.failed_at is not None and self.failed_at <= ticket

    def abandon(self, ticket: int) -> None:
        """A batch failed before its turn: later batches must not wait for it forever."""
        with self.cond:
            self.fail(ticket)
            if self.unordered:
                self.serving += 1
            elif ticket == self.serving:
                self.advance()
            elif ticket > self.serving:
                self.abandoned.add(ticket)


# A compressed file decoded whole: records, how many are trustworthy, the error for the
# rest, and an error to raise at the group's end (data beyond the expected records).
_Whole = tuple[np.ndarray, int, BaseException | None, BaseException | None]


@dataclass
class Task:
    """A planned batch plus its turn on every compressed stream it reads."""

    plan: BatchPlan
    tickets: dict[tuple[int, str], tuple[_Stream, int]] = field(default_factory=dict)
    # Fields whose transforms ran during assembly (see Assembler.fused), with their draws.
    fused: frozenset[str] = frozenset()
    draws: Any = None
    # Gathers whose records this task asks of the disk before its own (see Readahead.before_gather).
    ahead: tuple[BatchPlan, ...] = ()

    def __repr__(self) -> str:
        return f"batch {self.plan.index} of epoch {self.plan.epoch} ({self.plan.rows} records)"


def _bytes_of(dst: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as bytes, to read into; also for dtypes numpy exports no
    buffer for (ml_dtypes' bfloat16). Never a copy: a strided array is refused, as
    `memoryview(dst).cast("B")` refused it."""
    if not dst.flags.c_contiguous:
        raise TypeError("a read goes straight into a C-contiguous array, never into a copy")
    return memoryview(dst.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def fill_padding(out: dict[str, np.ndarray], valid: int) -> None:
    """pad_last: zero the padding rows `valid..` of every array, mark them in `__valid__`.

    `__group__` / `__index__` of padding rows are -1, so they never name a real record.
    """
    for name, arr in out.items():
        if name == VALID_KEY:
            arr[:valid] = True
            arr[valid:] = False
        elif name in (GROUP_KEY, INDEX_KEY):
            arr[valid:] = -1
        else:
            arr[valid:] = 0


class Assembler:
    """Turns planned batches into dicts of arrays; owns the files and streams it opens."""

    def __init__(
        self,
        catalog: Catalog,
        out_dtypes: Mapping[str, np.dtype],
        allocator: Allocator,
        *,
        batch_size: int,
        with_index: bool = False,
        fetcher: Fetcher | None = None,
    ) -> None:
        self.catalog = catalog
        self.fields: dict[str, Field] = dict(catalog.fields)
        self.out_dtypes = dict(out_dtypes)
        self.allocator = allocator
        self.batch_size = batch_size
        self.with_index = with_index
        self._cast = {n: self.out_dtypes[n] != f.dtype for n, f in self.fields.items()}
        self._compressed = {n for n in self.fields if any(infos[n].compression is not None for infos in catalog.files)}
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[int, str], _RawFile] = OrderedDict()
        self._max_open = pass_open_files()
        # Memory maps of finished files kept for the next epoch (see _close_file): this pass's
        # own, closed with it, unless the loader shares its own (see share_kept).
        self.kept_maps = KeptMaps()
        self._owns_kept_maps = True
        # Whole-decoded compressed files kept for the next epoch: this pass's own unless the
        # loader shares its own, which its later passes find too (see KeptDecoded).
        self.kept_decoded = KeptDecoded(KEPT_DECODED_BYTES)
        self._owns_kept_decoded = True
        # Runs planned but not yet done, per (epoch, raw file): a file closes only when its
        # final run is done and no earlier run is still to come (workers finish out of order;
        # a file closed early would be opened again, and fail if it was deleted meanwhile).
        self._raw = [n for n in self.fields if any(infos[n].compression is None for infos in catalog.files)]
        # Fields of local raw files alone, in every group (read together, see _read_together).
        self._local_raw = frozenset(n for n in self._raw if not any(
            infos[n].compression is not None or is_remote(infos[n].path) for infos in catalog.files
        ))  # fmt: skip
        self._pending: dict[tuple[int, str], int] = {}
        self._streams: dict[tuple[int, int, str], _Stream] = {}
        self._local = threading.local()
        self._epoch = -1
        # "global" shuffle: compressed fields decoded once into memory, per group, except
        # `seek_fields` (set by the loader when they do not fit its memory budget): read
        # record by record from the persistent index's seek points.
        self.seek_fields: frozenset[str] = frozenset()
        self._resident: dict[tuple[int, str], tuple[np.ndarray, int]] = {}  # with its address
        self._resident_locks: dict[tuple[int, str], threading.Lock] = {}
        self.stop = StopFlag()  # the loader shares its executor's (see stoker.engine.StopFlag)
        self._closed = False
        self.counters = Counters()  # the loader swaps in its own; see stoker.stats
        self.readahead = Readahead(drop_behind=False)  # the loader sets drop_behind for big datasets
        # The loader's transform stage (stoker.transforms.Stage), if any: fields it can run
        # record by record are transformed as they are read from the file's memory map, so
        # their stored records never land in a buffer of their own.
        self.fused: Any = None
        self._fusable: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._redoable: dict[int, bool] = {}  # per group, see redoable()
        self._decode_locks: dict[tuple[str, str], threading.Lock] = {}  # see _kept_or_decoded
        # Ranged GETs of the fields' remote files, in flight ahead of the workers (stoker.fetch).
        self.fetcher = fetcher if fetcher is not None else Fetcher()
        self._remote = [n for n in self.fields if any(is_remote(infos[n].path) for infos in catalog.files)]
        self._heads: tuple[int, set[tuple[int, str]]] = (-1, set())  # streams whose head was asked for

    def share_kept(self, maps: KeptMaps | None, decoded: KeptDecoded) -> None:
        """Keep maps (unless None) and decoded files in the loader's, which outlive this pass,
        instead of this pass's own."""
        if maps is not None:
            self.kept_maps, self._owns_kept_maps = maps, False
        self.kept_decoded, self._owns_kept_decoded = decoded, False

    # -- dispatch (runs under the executor's lock, in plan order) ----------------------
    def fetching_ahead(self, plans: Iterator[BatchPlan]) -> Iterator[BatchPlan]:
        """`plans`, the byte ranges they read from remote files asked of the fetcher ahead of
        the workers (stoker.fetch), as far as its room reaches; unchanged without remote files."""
        if not self._remote:
            return plans
        return _looking_ahead(plans, self._want, self.fetcher.room)

    def _want(self, plan: BatchPlan) -> None:
        """Ask for the remote bytes `plan` reads, as its batch will read them: a raw run's
        records, a gather's coalesced stretches, a compressed stream's head where it opens."""
        fetcher = self.fetcher
        epoch, heads = self._heads
        if plan.epoch != epoch:  # a stream opens once per (epoch, group, field); a gather's once per pass
            self._heads = epoch, heads = plan.epoch, (heads if plan.gather is not None else set())
        # In the order the batch reads them: a gather field by field, runs run by run.
        wants: list[tuple[str, int, Run | np.ndarray]]
        if plan.gather is not None:
            _, groups, index, spans = _by_file(plan.gather)
            wants = [(name, int(groups[a]), index[a:b]) for name in self._remote for a, b in spans]
        else:
            wants = [(name, run.group, run) for run in plan.runs for name in self._remote]
        for name, group, what in wants:
            spec = self.fields[name]
            rb = spec.record_bytes
            info = self.catalog.files[group][name]
            if not is_remote(info.path):
                continue
            if info.compression is not None:
                if (group, name) not in heads and name not in self.seek_fields:
                    heads.add((group, name))
                    fetcher.want_stream(info.path, spec.storage_options, size=info.size, field=name)
            elif isinstance(what, Run):
                start = spec.header_bytes + what.start * rb
                end = min(info.size, spec.header_bytes + what.stop * rb)
                if what.count:
                    fetcher.want(info.path, spec.storage_options, start, end, size=info.size, field=name)
            else:
                for a, b in pieces(what, rb, spec.header_bytes, fetcher.part_bytes):
                    if b <= info.size:
                        fetcher.want(info.path, spec.storage_options, a, b, size=info.size, field=name)

    def _check_stop(self) -> None:
        """Raise Stopped once the pass is closing (checked by waits on remote bytes)."""
        if self.stop.is_set():
            raise Stopped

    def prepare(self, plan: BatchPlan) -> Task:
        task = Task(plan)
        if plan.epoch != self._epoch:
            self._epoch = plan.epoch
            self._retire_streams(plan.epoch)
        for i, run in enumerate(plan.runs):
            infos = self.catalog.files[run.group]
            if self._raw:
                with self._lock:
                    for name in self._raw:
                        if infos[name].compression is None:
                            key_ = (plan.epoch, infos[name].path)
                            self._pending[key_] = self._pending.get(key_, 0) + 1
            for name in self._compressed:
                if infos[name].compression is None:
                    continue
                key = (plan.epoch, run.group, name)
                with self._lock:
                    stream = self._streams.get(key)
                    if stream is None:
                        stream = self._streams[key] = _Stream(unordered=self._whole_able(name, run.group))
                with stream.lock:
                    task.tickets[(i, name)] = (stream, stream.issued)
                    stream.issued += 1
                    stream.final_issued = stream.final_issued or run.final
        return task

    # -- work (runs in worker threads) --------------------------------------------------
    def __call__(self, task: Task) -> tuple[dict[str, np.ndarray], BatchPlan]:
        plan = task.plan
        began = time.perf_counter()
        # This thread's CPU clock, on one batch in every CPU_SAMPLE_SECONDS (Counters.batch_done).
        local = self._local
        began_clock = thread_clock() if began >= getattr(local, "cpu_due", 0.0) else None
        out: dict[str, np.ndarray] = {}
        fused = self._fused_fields(plan)
        if fused:
            task.fused, task.draws = frozenset(fused), self.fused.draws(plan)
        for ahead in task.ahead:
            self._advise(ahead)
        for name, spec in self.fields.items():
            shape, dtype = fused.get(name, (spec.shape, self.out_dtypes[name]))
            out[name] = self.allocator.array((plan.rows, *shape), dtype)
        if self.with_index:
            out[GROUP_KEY] = self.allocator.array((plan.rows,), np.dtype(np.int64))
            out[INDEX_KEY] = self.allocator.array((plan.rows,), np.dtype(np.int64))
        if plan.valid is not None:
            out[VALID_KEY] = self.allocator.array((plan.rows,), np.dtype(bool))
            fill_padding(out, plan.valid)
        if plan.gather is not None:
            self._gather(plan, out)
        taken: set[tuple[int, str]] = set()  # stream turns this batch has had
        try:
            together = self._read_together(task, out)
            for i, run in enumerate(plan.runs):
                self._read_run(task, i, run, out, taken, together)
        except Stopped:
            raise
        except BaseException:
            # Give up this batch's remaining stream turns, or later batches wait forever.
            for key, (stream, ticket) in task.tickets.items():
                if key not in taken:
                    stream.abandon(ticket)
            raise
        ended = time.perf_counter()
        runs = plan.runs if plan.gather is None else ()
        if began_clock is None:
            self.counters.batch_done(ended - began, runs=runs)
        else:
            cpu, runnable = thread_clock()
            self.counters.batch_done(
                ended - began,
                cpu - began_clock[0],
                None if runnable is None or began_clock[1] is None else runnable - began_clock[1],
                runs=runs,
            )
            local.cpu_due = ended + CPU_SAMPLE_SECONDS
        return out, plan

    def _fused_fields(self, plan: BatchPlan) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Fields transformed while read: local raw files only, not for gathers or padding."""
        if self.fused is None or plan.gather is not None or plan.valid is not None:
            return {}
        if self._fusable is None:
            local = {n for n in self.fields if not any(
                infos[n].compression is not None or is_remote(infos[n].path) for infos in self.catalog.files
            )}  # fmt: skip
            self._fusable = {n: rec for n, rec in self.fused.record_fields(self.fields).items() if n in local}
        return self._fusable

    def _read_run(
        self, task: Task, i: int, run: Run, out: dict[str, np.ndarray], taken: set[tuple[int, str]],
        together: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        """Run `i` of the task's batch, every field but those `together` (read already,
        but for an empty run)."""
        plan = task.plan
        infos = self.catalog.files[run.group]
        for name, spec in self.fields.items():
            if name in together and run.count:
                continue
            dst = out[name][run.row : run.row + run.count]
            info = infos[name]
            try:
                if info.compression is None:
                    put = functools.partial(self.fused.put, name, draws=task.draws) if name in task.fused else None
                    self._read_raw(plan.epoch, name, spec, info, run, dst, put)
                else:
                    stream, ticket = task.tickets[(i, name)]
                    try:
                        self._read_stream(plan.epoch, name, spec, info, run, dst, stream, ticket)
                    finally:
                        taken.add((i, name))
            except (StokerError, Stopped):
                raise
            except BaseException as e:  # not one of ours: still say which file the worker was on
                e.add_note(_reading(name, info, run.group, run.start, run.stop))
                raise
        if self.with_index:
            out[GROUP_KEY][run.row : run.row + run.count] = run.group
            out[INDEX_KEY][run.row : run.row + run.count] = np.arange(run.start, run.stop, run.step)

    def _read_together(self, task: Task, out: dict[str, np.ndarray]) -> frozenset[str]:
        """Read the fields whose runs of this batch all come from local raw files, each field in
        one kernel call over its records' addresses; the fields so read.

        A batch of many short runs (small files, or records of each file's tail) paid each run's
        file acquisition, size check, copy call and release as a call of its own, per field,
        a large share of a worker's time on small groups. For a batch of one run
        (W1's) the per-run path below is already one call per field.
        """
        plan = task.plan
        runs = [run for run in plan.runs if run.count]  # an empty run only says a file is done
        if len(runs) < 2:
            return frozenset()
        names = [n for n in self._local_raw if n not in task.fused and gathers(out[n], self.fields[n].dtype)]
        for name in names:
            self._read_raws(plan.epoch, runs, name, self.fields[name], out[name])
        return frozenset(names)

    def _read_raws(self, epoch: int, runs: list[Run], name: str, spec: Field, dst: np.ndarray) -> None:
        """Runs `runs` (none empty) of local raw field `name` into `dst`: the files held,
        their sizes read and let go in one call or lock round each, the records copied (cast)
        by one `gather_runs`. A first visit of an uncast run reads with preadv, as
        `_read_raw` does."""
        rb = spec.record_bytes
        infos = [self.catalog.files[run.group][name] for run in runs]
        held = self._hold(epoch, name, infos)
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
                if not self._cast[name] and run.step == 1 and not f.reused:
                    self._pread(name, spec, info, run, f, dst[run.row : run.row + run.count], offset)
                    continue
                if f.map is None or f.size < offset + nread or now < offset + nread:
                    raise self._truncated(name, info, spec, run, min(f.size, now))
                mapped += (run.row, f.address() + offset, run.count, run.step * rb)
                copied.append(k)
            try:
                gather_runs(dst, mapped, spec.dtype)
            except MapFault as e:
                k = self._faulted(held, e)
                raise self._map_fault(name, infos[k], spec, runs[k], held[k], e) from e
            if copied:  # a cut inside a page reads as zeros, no fault: the sizes after say (see _read_raw)
                for k, now in zip(copied, file_sizes([held[k].fd for k in copied]), strict=True):
                    if now < offsets[k] + spans[k]:
                        raise self._truncated(name, infos[k], spec, runs[k], now)
            for f, offset, nread in zip(held, offsets, spans, strict=True):
                f.warm = self.readahead.after_read(f.fd, f.map, f.size, offset, nread, ahead=not f.warm) or f.warm
        finally:
            self.counters.add("read+cast" if self._cast[name] else "read", name, time.perf_counter() - t)
            with self._lock:  # every run in one lock round
                for run, info, f in zip(runs, infos, held, strict=True):
                    self._released(epoch, info, f, run.final)

    @staticmethod
    def _faulted(held: Sequence[_RawFile], e: OSError) -> int:
        """Which of `held` a MapFault `e` read from: the map holding its address, else the
        first file now shorter than it was (their sizes read again), else the first."""
        at = getattr(e, "address", 0)
        for k, f in enumerate(held):
            if f.map is not None and 0 <= at - f.address() < f.size:
                return k
        sizes = file_sizes([f.fd for f in held])
        return next((k for k, (f, now) in enumerate(zip(held, sizes, strict=True)) if now < f.size), 0)

    def _gather(self, plan: BatchPlan, out: dict[str, np.ndarray]) -> None:
        assert plan.gather is not None
        flush_wake()  # see stoker.engine: gathers may wait on files, streams and numpy
        order, groups, index, spans = _by_file(plan.gather)
        for name, spec in self.fields.items():
            t = time.perf_counter()
            self._gather_field(plan.epoch, name, spec, out[name], order, groups, index, spans)
            self.counters.add("gather", name, time.perf_counter() - t)
        if self.with_index:
            out[GROUP_KEY][: len(groups)] = plan.gather.groups
            out[INDEX_KEY][: len(index)] = plan.gather.index

    def _advise(self, plan: BatchPlan) -> None:
        """Ask the disk for the records of `plan`'s gather in local raw files (see
        Readahead.before_gather): a task does it for a batch a few ahead of its own."""
        if plan.gather is None or not self.readahead.gathers_ahead:
            return
        _, groups, index, spans = _by_file(plan.gather)
        group_of = groups[[a for a, _ in spans]].tolist() if spans else []
        lengths = [b - a for a, b in spans]
        for name, spec in self.fields.items():
            t = time.perf_counter()
            _, raw, picked = self._raw_of(name, group_of)
            held = self._hold(plan.epoch, name, picked)
            try:
                fd = iter([f.fd for f in held])
                fds = np.repeat(np.array([next(fd) if r else -1 for r in raw], np.int64), lengths)
                mine = fds >= 0
                offsets = index * spec.record_bytes + spec.header_bytes
                self.readahead.before_gather(fds[mine], offsets[mine], spec.record_bytes)
            finally:
                self._let_go(plan.epoch, picked, held)
            # The gathers' time: asking the disk for random records is part of reading them.
            self.counters.add("gather", name, time.perf_counter() - t)

    def _gather_field(
        self, epoch: int, name: str, spec: Field, dst: np.ndarray, order: np.ndarray, groups: np.ndarray,
        index: np.ndarray, spans: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        """`dst[order[k]]` = record `index[k]` of group `groups[k]`, sorted by group then
        record, `spans` the runs of one group.

        Records of local raw files and of compressed files held in memory are copied by one
        kernel call over their addresses: per group there is only the file to hold and its size
        to check (one call per group was a large share of a worker's time), and the files are
        held, their sizes read and let go in one call or lock round each (W1-big's batches read
        from ~190 of its 415 files). Remote files and seek points are read group by group.
        """
        rb = spec.record_bytes
        direct = gathers(dst, spec.dtype)  # the kernel copies this field's records
        group_of = groups[[a for a, _ in spans]].tolist() if spans else []
        lasts = index[[b - 1 for _, b in spans]].tolist() if spans else []  # sorted: each span's last record
        infos, raw, picked = self._raw_of(name, group_of)
        held = self._hold(epoch, name, picked)
        bases = [-1] * len(spans)  # per span: where its group's records begin in memory, -1: copied already
        kept: list[np.ndarray] = []  # arrays some addresses point into, held until the copy is done
        try:
            files, sizes = iter(held), iter(file_sizes([f.fd for f in held]))
            for k, (a, b) in enumerate(spans):
                g, info = group_of[k], infos[k]
                if raw[k]:
                    f, now = next(files), next(sizes)
                    n = lasts[k] + 1
                    if f.map is None or min(f.size, now) < spec.header_bytes + n * rb:
                        raise self._gather_truncated(name, info, spec, g, index[a:b], min(f.size, now))
                    if direct:
                        bases[k] = f.address() + spec.header_bytes
                        continue
                    # numpy casts these: the records are copied out of the map first (see _copy_mapped).
                    rows = np.empty((b - a, rb), np.uint8)
                    try:
                        copy_records(rows, f.fd, f.address(), index[a:b] * rb + spec.header_bytes)
                    except MapFault as e:
                        now = file_sizes([f.fd])[0]
                        raise self._gather_truncated(name, info, spec, g, index[a:b], min(f.size, now)) from e
                    try:
                        dst[order[a:b]] = rows.view(spec.dtype).reshape(b - a, *spec.shape)
                    except BaseException as e:
                        e.add_note(_reading(name, info, g, int(index[a]), n))
                        raise
                    finally:
                        del rows
                elif info.compression is None:  # a remote file
                    dst[order[a:b]] = self._remote_records(name, spec, info, index[a:b])
                elif name in self.seek_fields:
                    points = self.catalog.seek_points.get((g, name), (SeekPoint(0, 0),))
                    dst[order[a:b]] = seek_read(name, spec, info, points, index[a:b], self.catalog.count(g))
                else:
                    records, at = self._resident_array(name, spec, info, g)
                    if direct and records.flags.c_contiguous:
                        kept.append(records)
                        bases[k] = at
                    else:
                        dst[order[a:b]] = records[index[a:b]]
            if direct and max(bases, default=-1) >= 0:
                starts = np.repeat(np.asarray(bases, np.int64), [b - a for a, b in spans])
                pick = starts >= 0
                try:
                    if pick.all():
                        gather_records(dst, order, index * rb + starts, spec.dtype)
                    else:
                        gather_records(dst, order[pick], index[pick] * rb + starts[pick], spec.dtype)
                except MapFault as e:
                    raise self._gather_fault(name, spec, e, spans, group_of, infos, raw, held, index) from e
            if held:  # a cut inside a page reads as zeros, no fault: the sizes after say (see _read_raw)
                raw_spans = [k for k, r in enumerate(raw) if r]  # held[j] is raw_spans[j]'s file
                for k, now in zip(raw_spans, file_sizes([f.fd for f in held]), strict=True):
                    if now < spec.header_bytes + (lasts[k] + 1) * rb:
                        a, b = spans[k]
                        raise self._gather_truncated(name, infos[k], spec, group_of[k], index[a:b], now)
        finally:
            self._let_go(epoch, picked, held)
            kept.clear()

    def _raw_of(self, name: str, groups: list[int]) -> tuple[list[FileInfo], list[bool], list[FileInfo]]:
        """Field `name`'s file of each group, whether each is a local raw file (read through
        its map), and those files alone (what a gather holds)."""
        infos = [self.catalog.files[g][name] for g in groups]
        raw = [info.compression is None and not is_remote(info.path) for info in infos]
        return infos, raw, [info for info, r in zip(infos, raw, strict=True) if r]

    def _gather_fault(
        self, name: str, spec: Field, e: OSError, spans: list[tuple[int, int]], group_of: list[int],
        infos: list[FileInfo], raw: list[bool], held: list[_RawFile], index: np.ndarray,
    ) -> StokerError:  # fmt: skip
        """The error for a MapFault in a gather's kernel call: the file it read from, cut short."""
        k = self._faulted(held, e)
        f = held[k]
        j = [i for i, r in enumerate(raw) if r][k]  # held[k] is the k-th raw span's file
        a, b = spans[j]
        now = file_sizes([f.fd])[0]
        if now < f.size:
            return self._gather_truncated(name, infos[j], spec, group_of[j], index[a:b], now)
        run = Run(group_of[j], int(index[a]), b - a, 0, False)
        return self._map_fault(name, infos[j], spec, run, f, e)

    def _gather_truncated(
        self, name: str, info: FileInfo, spec: Field, g: int, local: np.ndarray, size: int
    ) -> CorruptDataError:
        """The error for a gather of records `local` (ascending) from a file now `size` bytes
        long: it names the first record asked for that the file no longer holds."""
        whole = max(0, size - spec.header_bytes) // spec.record_bytes
        first = int(local[min(len(local) - 1, int(np.searchsorted(local, whole)))])
        return self._truncated(name, info, spec, Run(g, first, len(local), 0, False), size)

    def _resident_array(self, name: str, spec: Field, info: FileInfo, g: int) -> tuple[np.ndarray, int]:
        """Group `g`'s compressed file of field `name` decoded whole, and its address."""
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
                stream = _Stream()
                self._open_stream(name, spec, info, stream)
                try:
                    run = Run(g, 0, n, 0, True)
                    stream_dst = buf.view(spec.dtype).reshape(n, *spec.shape) if n else buf[:0]
                    self._read_span(name, spec, info, run, stream, stream_dst, cast=False)
                    self._finish_stream(name, spec, info, run, stream)
                finally:
                    assert stream.inflater is not None
                    stream.inflater.close()
                arr = buf.view(spec.dtype).reshape(n, *spec.shape)
                held = self._resident[key] = (arr, address(buf))
        return held

    def _held_again(self, epoch: int, path: str) -> _RawFile | None:
        """The pass's open file of `path`, held once more (caller holds `_lock`), or None."""
        f = self._files.get((epoch, path))
        if f is not None:
            self._files.move_to_end((epoch, path))
            f.refs += 1
        return f

    def _acquire(self, epoch: int, name: str, info: FileInfo) -> _RawFile:
        key = (epoch, info.path)
        with self._lock:
            f = self._held_again(epoch, info.path)
        if f is not None:
            return f
        fd = open_local(name, info.path)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ReadError(
                    f"field {name!r}: {info.path!r} is no longer a regular file (replaced since the Dataset was built)",
                    field=name, path=info.path,
                )  # fmt: skip
            # The geometry is the one the Dataset saw: a file grown since is read only up to its
            # old size; one cut short fails at the first record it no longer holds (in _read_raw).
            size = min(st.st_size, info.size)
            ident = _identity_of(st, size)
            # The same file, unchanged, read in an earlier epoch or held by one still reading
            # it: its pages are mapped already. Not with drop-behind: its maps are its own.
            shared = not self.readahead.drop_behind
            lent = self.kept_maps.take(info.path, ident) if shared else None
            mapped, reused = lent if lent is not None else (None, False)
            # Mapped for cast copies, strided runs and gathers, and plain runs once the map is
            # kept from an earlier epoch; plain runs of a new map use preadv.
            try:
                if mapped is None and size:
                    mapped = map_file(fd, size)
                    self.readahead.on_map(mapped)
                    if shared:
                        mapped = self.kept_maps.lend(info.path, ident, mapped)
            except OSError as e:
                raise ReadError(
                    f"field {name!r}: cannot map {info.path!r}: {e.strerror}", field=name, path=info.path
                ) from e
            except ValueError as e:  # mmap.mmap (no kernels built): the file was cut since its fstat
                raise _cut(name, info, os.fstat(fd).st_size) from e
        except BaseException:
            os.close(fd)
            raise
        f = _RawFile(fd, size, mapped, ident, reused=reused)
        f.refs = 1
        with self._lock:
            other = self._files.get(key)
            if other is not None:  # another worker opened it meanwhile; use theirs
                other.refs += 1
                f.refs = 0
                self._close_file(info.path, f)
                return other
            self._files[key] = f
            self._evict()
        return f

    def _hold(self, epoch: int, name: str, infos: list[FileInfo]) -> list[_RawFile]:
        """`_acquire` of each raw file of `infos`: those open already in one lock round (a
        global shuffle's batch reads from hundreds on W1-big), the others opened one by one. On
        an error, what was held is let go. Give them back with `_let_go`."""
        held: list[_RawFile | None] = [None] * len(infos)
        with self._lock:
            for k, info in enumerate(infos):
                held[k] = self._held_again(epoch, info.path)
        try:
            for k, f in enumerate(held):
                if f is None:
                    held[k] = self._acquire(epoch, name, infos[k])
        except BaseException:
            self._let_go(epoch, infos, held)
            raise
        return held  # type: ignore[return-value]  # every one acquired

    def _let_go(self, epoch: int, infos: list[FileInfo], held: Sequence[_RawFile | None]) -> None:
        """`_release` (not counted as a run) of files held by `_hold`, in one lock round."""
        with self._lock:
            for info, f in zip(infos, held, strict=True):
                if f is not None:
                    self._released(epoch, info, f, False, counted=False)

    def _evict(self) -> None:
        excess = len(self._files) - self._max_open
        for key in list(self._files):
            if excess <= 0:
                break
            f = self._files[key]
            if f.refs == 0:
                del self._files[key]
                self._close_file(key[1], f)
                excess -= 1

    def _run_done(self, epoch: int, path: str) -> None:
        """One planned run of `path` is done (caller holds `_lock`)."""
        key = (epoch, path)
        left = self._pending.get(key, 0) - 1
        if left > 0:
            self._pending[key] = left
        else:
            self._pending.pop(key, None)

    def _release(self, epoch: int, info: FileInfo, f: _RawFile, final: bool, *, counted: bool = True) -> None:
        with self._lock:  # one lock round per run: this is on the hot path
            self._released(epoch, info, f, final, counted=counted)

    def _released(self, epoch: int, info: FileInfo, f: _RawFile, final: bool, *, counted: bool = True) -> None:
        """A hold of `f` is over (caller holds `_lock`): `final`, its file's last run;
        `counted`, one of its planned runs (`_let_go` gives back holds that were neither)."""
        f.refs -= 1
        f.done = f.done or final
        if counted:
            self._run_done(epoch, info.path)
        self._close_if_done(epoch, info, f)

    def _close_if_done(self, epoch: int, info: FileInfo, f: _RawFile) -> None:
        """Close `f` once its final run is done, nobody holds it and no run of it is still to
        come (caller holds `_lock`)."""
        if f.done and f.refs == 0 and (epoch, info.path) not in self._pending:
            if self._files.get((epoch, info.path)) is f:
                del self._files[(epoch, info.path)]
            self._close_file(info.path, f)

    def _close_file(self, path: str, f: _RawFile) -> None:
        """Close a raw file, giving its memory map back to be kept for the next epoch where that
        pays (see KeptMaps; caller holds `_lock`, or the pass is closing).

        Kept only while the dataset fits the page cache: with drop-behind its pages are evicted
        for good, and a map would only hold the address space.
        """
        mapped, f.map = f.map, None
        if mapped is not None:
            if self.readahead.drop_behind:
                mapped.close()
            else:
                self.kept_maps.put(path, f.ident, mapped)
        f.close()

    def _release_if_done(self, epoch: int, info: FileInfo, f: _RawFile) -> None:
        with self._lock:
            self._close_if_done(epoch, info, f)

    def _read_raw(
        self, epoch: int, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray, put: Any = None
    ) -> None:
        rb = spec.record_bytes
        offset = spec.header_bytes + run.start * rb
        if is_remote(info.path):
            flush_wake()  # see stoker.engine: about to wait on the network
            self._read_remote_raw(name, spec, info, run, dst, offset)
            return
        if run.count == 0:
            with self._lock:
                self._run_done(epoch, info.path)
                f0 = self._files.get((epoch, info.path))
                if f0 is not None and run.final:
                    f0.done = True
            if f0 is not None:
                self._release_if_done(epoch, info, f0)
            return
        f = self._acquire(epoch, name, info)
        t = time.perf_counter()
        try:
            # Uncast runs: preadv on a file's first visit in the pass, where it beats a streamed
            # copy from a map made for that visit and a failing disk gives an error rather than
            # a SIGBUS; from a map kept from an earlier epoch, whose pages are mapped already,
            # the streamed copy is the faster (measured: benchmarks/results/w1_history.md).
            if not self._cast[name] and run.step == 1 and put is None and not f.reused:
                self._pread(name, spec, info, run, f, dst, offset)
            else:
                # A file cut short before this check fails here; one cut during the copy faults
                # in a guarded kernel (MapFault), and numpy never reads the map (see _copy_mapped).
                span = run.stop - run.start
                if f.map is None or f.size < offset + span * rb or file_size(f.fd) < offset + span * rb:
                    raise self._truncated(name, info, spec, run, min(f.size, file_size(f.fd)))
                try:
                    self._copy_mapped(spec, run, f, offset, dst, put)
                except MapFault as e:
                    raise self._map_fault(name, info, spec, run, f, e) from e
                # A cut that leaves part of a page reads as zeros there, without a fault: the size
                # after the copy says whether every byte copied was still the file's.
                now = file_size(f.fd)
                if now < offset + span * rb:
                    raise self._truncated(name, info, spec, run, now)
            nread = (run.stop - run.start) * rb
            f.warm = self.readahead.after_read(f.fd, f.map, f.size, offset, nread, ahead=not f.warm) or f.warm
        finally:
            self.counters.add("read+cast" if self._cast[name] or put else "read", name, time.perf_counter() - t)
            self._release(epoch, info, f, run.final)

    def _copy_mapped(self, spec: Field, run: Run, f: _RawFile, offset: int, dst: np.ndarray, put: Any) -> None:
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
        staged = self._staging(min(run.count, per) * rb)
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

    def _map_fault(self, name: str, info: FileInfo, spec: Field, run: Run, f: _RawFile, e: OSError) -> StokerError:
        """The error for a bus error reading `f`'s map during run `run`: the file cut short
        (a CorruptDataError, as the size check gives) or, still whole, a failed read."""
        e.__traceback__ = None  # its frames hold views of the map, which could then not be closed
        now = file_size(f.fd)
        if now < f.size:
            return self._truncated(name, info, spec, run, now)
        offset = getattr(e, "address", 0) - f.address()
        offset = offset if 0 <= offset < f.size else spec.header_bytes + run.start * spec.record_bytes
        return self._read_error(name, info, spec, run, offset, OSError(e.errno, "bus error reading its memory map"))

    def _pread(
        self, name: str, spec: Field, info: FileInfo, run: Run, f: _RawFile, dst: np.ndarray, offset: int
    ) -> None:
        """Run `run` (every record, uncast) copied into `dst` by preadv from `offset`."""
        flush_wake()  # see stoker.engine: about to give the GIL up, maybe wait on the disk
        view = _bytes_of(dst)
        nbytes, done = run.count * spec.record_bytes, 0
        while done < nbytes:
            try:
                got = os.preadv(f.fd, [view[done:]], offset + done)
            except OSError as e:
                raise self._read_error(name, info, spec, run, offset + done, e) from e
            if got == 0:
                raise self._truncated(name, info, spec, run, offset + done)
            done += got
        # A read racing a cut can copy the zeros the cut leaves past the new end of a page, in full
        # count: the size after the read says whether every byte read was still the file's.
        now = file_size(f.fd)
        if now < offset + nbytes:
            raise self._truncated(name, info, spec, run, now)

    def _read_remote_raw(self, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray, offset: int) -> None:
        """A run of a remote raw file: its parts (asked for ahead, or now) into the batch or staging."""
        rb = spec.record_bytes
        span = run.stop - run.start
        direct = not self._cast[name] and run.step == 1
        view = _bytes_of(dst) if direct else self._staging(span * rb)
        t = time.perf_counter()
        try:
            got = self.fetcher.read_into(
                info.path, spec.storage_options, offset, view, size=info.size, field=name, check=self._check_stop
            )
        except ReadError as e:
            e.index = (e.offset - spec.header_bytes) // rb if e.offset is not None else run.start
            e.add_note(f"record {e.index} of group {run.group}")
            raise
        finally:
            self.counters.add("read", name, time.perf_counter() - t)
        if got < span * rb:
            raise self._truncated(name, info, spec, run, offset + got)
        if not direct:
            src = np.frombuffer(view, dtype=spec.dtype).reshape(span, *spec.shape)
            np.copyto(dst, src[:: run.step], casting="unsafe")
            del src

    def _remote_records(self, name: str, spec: Field, info: FileInfo, local: np.ndarray) -> np.ndarray:
        """Records `local` (sorted) of a remote raw file, for a gather."""
        raw = self.fetcher.read_records(
            info.path,
            spec.storage_options,
            spec.header_bytes,
            spec.record_bytes,
            local,
            size=info.size,
            field=name,
            check=self._check_stop,
        )
        return raw.view(spec.dtype).reshape(len(local), *spec.shape)

    def _read_error(self, name: str, info: FileInfo, spec: Field, run: Run, offset: int, e: OSError) -> ReadError:
        index = (offset - spec.header_bytes) // spec.record_bytes
        return ReadError(
            f"field {name!r}: read of {info.path!r} failed at record {index} (byte offset {offset}): {e.strerror}",
            field=name, path=info.path, index=index, offset=offset,
        )  # fmt: skip

    def _truncated(self, name: str, info: FileInfo, spec: Field, run: Run, offset: int) -> CorruptDataError:
        index = max(run.start, (offset - spec.header_bytes) // spec.record_bytes)
        return CorruptDataError(
            f"field {name!r}: {info.path!r} ends at byte {offset}, inside record {index} of group "
            f"{run.group} (records {run.start}..{run.start + run.count - 1} were asked for); "
            "the file was truncated after the Dataset was built",
            field=name, path=info.path, index=index, offset=offset,
        )  # fmt: skip

    def _staging(self, nbytes: int) -> memoryview:
        buf: bytearray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = bytearray(max(nbytes, 1 << 16))
            self._local.buf = buf
        return memoryview(buf)[:nbytes]

    def _read_stream(
        self,
        epoch: int,
        name: str,
        spec: Field,
        info: FileInfo,
        run: Run,
        dst: np.ndarray,
        stream: _Stream,
        ticket: int,
    ) -> None:
        flush_wake()  # see stoker.engine: streams wait for turns, read files and inflate
        if stream.unordered:
            self._read_whole(epoch, name, spec, info, run, dst, stream)
            return
        t = time.perf_counter()
        with stream.cond:
            while stream.serving != ticket:
                if self.stop.is_set():
                    raise Stopped
                stream.cond.wait(0.1)
        self.counters.add("turn", name, time.perf_counter() - t)
        try:
            if stream.failed_before(ticket):
                # An earlier batch failed on this stream and is raised first; this batch comes
                # after it, so it is never delivered: just stop.
                raise Stopped
            try:
                self._stream_run(name, spec, info, run, dst, stream, epoch)
            except BaseException:
                stream.fail(ticket)
                raise
            if run.final:
                self._finish_stream(name, spec, info, run, stream)
        finally:
            with stream.cond:
                stream.advance()
            if run.final or stream.failed_before(ticket):
                self._drop_stream(epoch, run.group, name, stream, ticket)

    def _retire_streams(self, epoch: int) -> None:
        """Close streams of earlier epochs that no batch still waits on (trimmed tails)."""
        with self._lock:
            old = [(k, s) for k, s in self._streams.items() if k[0] < epoch and s.serving >= s.issued]
            for k, _ in old:
                del self._streams[k]
        for _, stream in old:
            if stream.inflater is not None:
                stream.inflater.close()

    def _drop_stream(self, epoch: int, group: int, name: str, stream: _Stream, ticket: int) -> None:
        # Only the thread that takes the stream out of the table closes it: the dispatcher
        # may be retiring the same stream at an epoch boundary.
        with self._lock:
            mine = self._streams.get((epoch, group, name)) is stream and (
                stream.serving >= stream.issued or stream.failed_before(ticket)
            )
            if mine:
                del self._streams[(epoch, group, name)]
        if mine and stream.inflater is not None:
            stream.inflater.close()

    def _open_stream(
        self, name: str, spec: Field, info: FileInfo, stream: _Stream, seek: tuple[int, SeekPoint] | None = None
    ) -> Inflater:
        """Open the stream at its start, or at `seek = (record, seek point at or before it)`."""
        if stream.inflater is not None:
            stream.inflater.close()
        assert info.compression is not None
        source = None
        if is_remote(info.path):  # its parts asked for ahead (stoker.fetch)
            source = self.fetcher.stream(
                info.path, spec.storage_options, seek[1].compressed if seek else 0, size=info.size, field=name,
                check=self._check_stop,
            )  # fmt: skip
        inf = Inflater(
            info.path,
            info.compression,
            field=name,
            start=seek[1] if seek else (0, 0),
            storage_options=spec.storage_options,
            source=source,
        )
        stream.inflater, stream.pos = inf, 0
        if seek is not None:
            target = spec.header_bytes + seek[0] * spec.record_bytes
            if inf.skip(target - seek[1].decompressed) != target - seek[1].decompressed:
                raise CorruptDataError(
                    f"field {name!r}: {info.path!r} ends at decompressed offset {inf.produced}, before record "
                    f"{seek[0]} (offset {target}) that its persistent index places after a seek point",
                    field=name, path=info.path, index=seek[0], offset=inf.produced,
                )  # fmt: skip
            stream.pos = seek[0]
            return inf
        if spec.header_bytes and inf.skip(spec.header_bytes) != spec.header_bytes:
            raise CorruptDataError(
                f"field {name!r}: {info.path!r} decompresses to {inf.produced} bytes, fewer than "
                f"header_bytes={spec.header_bytes}",
                field=name, path=info.path, offset=inf.produced,
            )  # fmt: skip
        return inf

    def redoable(self, plan: BatchPlan) -> bool:
        """Whether `plan` can be assembled again, or its runs split between batches: it reads
        no compressed stream in turns (only raw files and files decoded whole, whose records
        any batch copies in any order)."""
        return all(self._redoable_group(run.group) for run in plan.runs)

    def _redoable_group(self, group: int) -> bool:
        known = self._redoable.get(group)
        if known is None:
            infos = self.catalog.files[group]
            known = self._redoable[group] = all(
                infos[n].compression is None or self._whole_able(n, group) for n in self._compressed
            )
        return known

    def _whole_able(self, name: str, group: int) -> bool:
        """Whether the group's file of `name` is decoded and verified whole (no turns)."""
        spec = self.fields[name]
        expected = self.catalog.count(group)
        return spec.header_bytes + expected * spec.record_bytes + spec.footer_bytes <= VERIFY_WHOLE_BYTES

    def _stream_run(
        self, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray, stream: _Stream, epoch: int
    ) -> None:
        if stream.inflater is None or stream.pos > run.start:
            self._open_stream(name, spec, info, stream, self._seek_point(run.group, name, spec, run.start))
        elif (
            run.start - stream.pos > 1
            and (seek := self._seek_point(run.group, name, spec, run.start))
            and seek[1].decompressed > stream.inflater.produced  # a point lies ahead: jump, not inflate
        ):
            self._open_stream(name, spec, info, stream, seek)
        if run.count:
            self._read_span(name, spec, info, run, stream, dst, cast=self._cast[name] or run.step != 1)

    def _seek_point(self, group: int, name: str, spec: Field, record: int) -> tuple[int, SeekPoint] | None:
        """The persistent index's last seek point at or before `record` (resume mid-file), if any."""
        points = self.catalog.seek_points.get((group, name))
        if not points or not record:
            return None
        target = spec.header_bytes + record * spec.record_bytes
        k = bisect.bisect_right(points, target, key=lambda p: p.decompressed) - 1  # sorted by decompressed
        return (record, points[k]) if k >= 0 and points[k].decompressed > spec.header_bytes else None

    def _read_whole(
        self, epoch: int, name: str, spec: Field, info: FileInfo, run: Run, dst: np.ndarray, stream: _Stream
    ) -> None:
        """Serve a run from the file decoded and verified whole, in any order of batches."""
        try:
            whole = stream.whole  # set once, never reset: no lock needed to see it set
            if whole is None:
                with stream.lock:  # the first run to get here decodes; the others wait for it
                    if stream.whole is None:
                        stream.whole = self._kept_or_decoded(name, spec, info, run.group)
                    whole = stream.whole
            arr, valid, err, final_err = whole
            if run.count:
                if run.stop > valid:
                    assert err is not None
                    raise err
                t = time.perf_counter()
                cast_into(dst, arr[run.start : run.stop : run.step])
                self.counters.add("cast" if self._cast[name] else "copy", name, time.perf_counter() - t)
            if run.final and final_err is not None:
                raise final_err
        finally:
            with stream.lock:
                stream.serving += 1
                last = stream.final_issued and stream.serving >= stream.issued
            if last:
                with self._lock:
                    if self._streams.get((epoch, run.group, name)) is stream:
                        del self._streams[(epoch, run.group, name)]

    def _kept_or_decoded(self, name: str, spec: Field, info: FileInfo, group: int) -> _Whole:
        """The group's file of `name` decoded whole: kept from an earlier epoch, or decoded now.

        One decode at a time per file: epochs overlap when they are short (several batches
        assembled together can be a whole epoch, see stoker.loader.COALESCE_BYTES), and the
        next epoch's stream then waits for this one's decode and finds it kept.
        """
        with self._lock:
            lock = self._decode_locks.setdefault((name, info.path), threading.Lock())
        with lock:
            return self._kept_or_decoded_now(name, spec, info, group)

    def _kept_or_decoded_now(self, name: str, spec: Field, info: FileInfo, group: int) -> _Whole:
        expected = self.catalog.count(group)
        ident = identity(info.path)  # before decoding: a file changed meanwhile is not kept as this one
        if ident is not None:
            records = self.kept_decoded.get(name, info.path, ident)
            if records is not None and len(records) == expected:
                return records, expected, None, None
        whole = self._decode_whole(name, spec, info, group, expected)
        records, valid, err, final_err = whole
        if ident is not None and valid == expected and err is None and final_err is None:
            self.kept_decoded.put(name, info.path, ident, records)
        return whole

    def _decode_whole(self, name: str, spec: Field, info: FileInfo, group: int, expected: int) -> _Whole:
        """(records, how many are trustworthy, error for the rest, error at the group's end)."""
        rb = spec.record_bytes
        buf = np.empty(expected * rb, np.uint8)
        stream = _Stream()
        err: BaseException | None = None
        final_err: BaseException | None = None
        valid = expected
        t = time.perf_counter()
        try:
            inf = self._open_stream(name, spec, info, stream)
            try:
                got = inf.readinto(memoryview(buf))  # type: ignore[arg-type]
                if got < len(buf):
                    valid = got // rb
                    err = self._stream_short(name, spec, info, Run(group, 0, expected, 0, True), inf, valid)
                else:
                    stream.pos = expected
                    try:
                        self._finish_stream(name, spec, info, Run(group, 0, expected, 0, True), stream)
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
            if stream.inflater is not None:
                stream.inflater.close()
        return buf.view(spec.dtype).reshape(expected, *spec.shape), max(0, min(valid, expected)), err, final_err

    def _read_span(
        self, name: str, spec: Field, info: FileInfo, run: Run, stream: _Stream, dst: np.ndarray, *, cast: bool
    ) -> None:
        """Read records `run.start .. run.stop` of the stream, keeping every `run.step`-th."""
        rb = spec.record_bytes
        inf = stream.inflater
        assert inf is not None
        t = time.perf_counter()
        if stream.pos < run.start:
            want = (run.start - stream.pos) * rb
            got = inf.skip(want)
            stream.pos += got // rb
            if got != want:
                raise self._stream_short(name, spec, info, run, inf, stream.pos)
        span = run.stop - run.start
        nbytes = span * rb
        if cast:
            staging = self._staging(nbytes)
            got = inf.readinto(staging)
        else:
            got = inf.readinto(_bytes_of(dst))
        self.counters.add("decompress", name, time.perf_counter() - t)
        if got != nbytes:
            stream.pos += got // rb
            raise self._stream_short(name, spec, info, run, inf, stream.pos)
        if cast:
            t = time.perf_counter()
            src = np.frombuffer(staging, dtype=spec.dtype).reshape(span, *spec.shape)
            cast_into(dst, src[:: run.step])
            del src
            self.counters.add("cast", name, time.perf_counter() - t)
        stream.pos += span

    def _stream_short(self, name: str, spec: Field, info: FileInfo, run: Run, inf: Inflater, pos: int) -> StokerError:
        expected = self.catalog.count(run.group)
        lie = count_disagrees(
            self.catalog.index_file(run.group, name), info, name, run.group, expected,
            f"ends after {pos} whole records (decompressed offset {inf.produced})", record=pos, offset=inf.produced,
        )  # fmt: skip
        if lie is not None:
            return lie
        return CorruptDataError(
            f"field {name!r}: {info.compression} stream {info.path!r} ends after {pos} whole records "
            f"(decompressed offset {inf.produced}), but group {run.group} has {expected} records "
            f"(record {pos} is missing)",
            field=name, path=info.path, index=pos, offset=inf.produced,
        )  # fmt: skip

    def _finish_stream(self, name: str, spec: Field, info: FileInfo, run: Run, stream: _Stream) -> None:
        if stream.inflater is None:
            self._open_stream(name, spec, info, stream)
        inf = stream.inflater
        assert inf is not None
        expected = self.catalog.count(run.group)
        if stream.pos < expected:  # records held by other shards: pass over them to check the end
            want = (expected - stream.pos) * spec.record_bytes
            got = inf.skip(want)
            stream.pos += got // spec.record_bytes
            if got != want:
                raise self._stream_short(name, spec, info, run, inf, stream.pos)
        end = spec.header_bytes + stream.pos * spec.record_bytes
        if spec.footer_bytes and inf.skip(spec.footer_bytes) != spec.footer_bytes:
            raise CorruptDataError(
                f"field {name!r}: {info.path!r} ends at decompressed offset {inf.produced}, inside "
                f"footer_bytes={spec.footer_bytes} that follow record {stream.pos - 1}",
                field=name, path=info.path, index=stream.pos, offset=inf.produced,
            )  # fmt: skip
        if not inf.at_end():
            lie = count_disagrees(
                self.catalog.index_file(run.group, name), info, name, run.group, expected,
                f"holds more than {stream.pos} records (data continues at decompressed offset "
                f"{end + spec.footer_bytes})", record=stream.pos, offset=end + spec.footer_bytes,
            )  # fmt: skip
            if lie is not None:
                raise lie
            raise CorruptDataError(
                f"field {name!r}: {info.path!r} holds more than the {stream.pos} records of group {run.group} "
                f"(data continues at decompressed offset {end + spec.footer_bytes}); its gzip trailer "
                "disagrees with its contents or the other fields' files are short",
                field=name, path=info.path, index=stream.pos, offset=end + spec.footer_bytes,
            )  # fmt: skip

    def close(self) -> None:
        """Release every file and stream; idempotent."""
        self.stop.set()
        with self._lock:
            self._closed = True
            files = list(self._files.items())
            self._files.clear()
            streams = list(self._streams.values())
            self._streams.clear()
        for (_, path), f in files:
            self._close_file(path, f)  # a map still held by another pass stays for it
        if self._owns_kept_maps:
            self.kept_maps.close()
        if self._owns_kept_decoded:
            self.kept_decoded.clear()
        for s in streams:
            if s.inflater is not None:
                s.inflater.close()
                s.inflater = None
        self._resident.clear()  # "global" shuffle's decoded fields: the pass is over
        self.fetcher.close()
