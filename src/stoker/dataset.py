"""The Dataset: named fields whose files pair into groups of equal record counts."""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .engine.executor import AlignedPool
from .engine.reader import Reader, open_reader
from .engine.records import STREAM_SPLIT
from .errors import RecordIndexError, SpecError
from .io.files import Catalog, FileInfo, Group
from .io.views import CatalogView
from .plan.order import Permutation
from .spec import Field, resolve_cast

if TYPE_CHECKING:
    from .loader import Loader

__all__ = ["Dataset", "Subset", "read_one", "read_records", "select", "split"]


class Dataset:
    """Records of several fields stored in parallel files: group i is the i-th file of each.

    `Dataset()` expands the globs, pairs the files, and checks raw file sizes. Counts of
    compressed files are settled lazily (from the gzip trailer when it agrees with the other
    fields, else by decompressing when the group is first needed), so building a Dataset of
    many groups reads no compressed data.

    Args:
        fields: a mapping of name -> Field, or the fields as keyword arguments.
        pair_key: a regex whose first group (or whole match) taken from each basename must be
            equal across a group's files; default: the numbers in the basenames must agree
            where both carry numbers. `""` disables the check.
        index: the persistent index (`stoker.io.index`): "auto" uses it where it matches
            the files and raises StaleIndexError where it does not; "rebuild" rewrites stale,
            missing or malformed entries; "ignore" never reads it.
        index_dir: where the index lives: None (default) means `$STOKER_INDEX_DIR` if set,
            else beside the data; a directory keeps indexes of read-only data there.

    Example:
        >>> ds = Dataset(image=Field("data/img_*.bin", "int8", (128, 128, 1)),
        ...              label=Field("data/out_*.bin.gz", "float32"))
        >>> for batch in ds.loader(256, cast={"image": "float32"}):
        ...     images, labels = batch["image"], batch["label"]
    """

    def __init__(
        self,
        fields: Mapping[str, Field] | None = None,
        /,
        *,
        pair_key: str | None = None,
        index: str = "auto",
        index_dir: str | os.PathLike[str] | None = None,
        **named: Field,
    ) -> None:
        merged: dict[str, Field] = {}
        if fields is not None:
            if not isinstance(fields, Mapping):
                raise SpecError(f"fields={fields!r} must be a mapping of name -> stoker.Field")
            merged.update(fields)
        for name, spec in named.items():
            if name in merged:
                raise SpecError(f"field {name!r} is given twice", field=name)
            merged[name] = spec
        if not merged:
            raise SpecError("a Dataset needs at least one field, e.g. Dataset(image=Field(...))")
        for name, spec in merged.items():
            if not isinstance(name, str) or not name or name.startswith("__"):
                raise SpecError(f"field name {name!r} must be a non-empty string not starting with '__'", field=name)
            if not isinstance(spec, Field):
                raise SpecError(f"field {name!r}: {spec!r} is not a stoker.Field", field=name)
        if pair_key is not None and not isinstance(pair_key, str):
            raise SpecError(f"pair_key={pair_key!r} must be a regular expression string or None")
        self.fields: dict[str, Field] = merged
        self.pair_key = pair_key
        self._catalog = Catalog(merged, pair_key=pair_key, index=index, index_dir=index_dir)
        self._init_access()

    def _init_access(self) -> None:
        """What random access keeps, made when first needed (see `reader`)."""
        self._firsts_table: np.ndarray | None = None  # cumulative record counts (see locate)
        self._reader: Reader | None = None
        self._access_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for worker processes: each makes its own reader (open files are per process).
        state = self.__dict__.copy()
        for name in ("_reader", "_access_lock"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reader = None
        self._access_lock = threading.Lock()

    @property
    def num_groups(self) -> int:
        return self._catalog.num_groups

    @property
    def groups(self) -> tuple[Group, ...]:
        """Every group: the path of each field and the record count (settles all counts)."""
        cat = self._catalog
        return tuple(
            Group(g, {n: i.path for n, i in cat.files[g].items()}, cat.count(g)) for g in range(cat.num_groups)
        )

    @property
    def files(self) -> list[dict[str, FileInfo]]:
        """Per group, per field: path, size, compression as seen when the Dataset was built."""
        return self._catalog.files

    def records_in(self, group: int) -> int:
        """Records of one group (settles only that group's count)."""
        if not 0 <= group < self.num_groups:
            raise IndexError(f"{group=} is out of range for {self.num_groups} groups")
        return self._catalog.count(group)

    def __len__(self) -> int:
        """Total records, validated across fields (settles every group's count)."""
        return sum(self._catalog.counts())

    @property
    def record_bytes(self) -> dict[str, int]:
        return {n: f.record_bytes for n, f in self.fields.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={f.dtype.name}{list(f.shape)}" for n, f in self.fields.items())
        return f"Dataset({inner}; {self.num_groups} groups)"

    def loader(
        self,
        batch_size: int,
        *,
        epochs: int | None = 1,
        drop_remainder: bool = False,
        cycle_length: int | None = None,
        block_length: int | None = None,
        cast: Any = None,
        threads: int | None = None,
        prefetch: int | None = None,
        memory_budget: int | str | None = None,
        with_index: bool = False,
        shuffle: Literal[False, "global", "files"] | None = False,
        seed: int | None = None,
        window: int = 16,
        reshuffle_each_iteration: bool = True,
        shard: tuple[int, int] = (0, 1),
        even: bool = True,
        state: Mapping[str, Any] | None = None,
        pad_last: bool = False,
        transform: Any = None,
        workers: Literal["thread", "process"] = "thread",
        num_parallel_reads: int | None = None,
    ) -> Loader:
        """An iterable of batches: dicts of field name -> numpy array of `(n, *shape)`.

        Args:
            batch_size: records per batch; the last batch of an epoch may be shorter.
            epochs: epochs per pass (per `iter(loader)`); None repeats forever. Batches never
                span epochs. Pass k covers epochs `k*epochs .. k*epochs+epochs-1`.
            drop_remainder: drop each epoch's last short batch.
            cycle_length: files read side by side (tf.data's interleave setting); None = stoker's
                default (see `stoker.plan.default_cycle_length`).
            block_length: consecutive records taken from a file before the next (tf.data's);
                None = stoker's default (`default_block_length`).
            cast: one dtype for every field, or `{field: dtype}`; applied while assembling.
                A numpy bool/integer/float dtype, or `"bfloat16"` (ml_dtypes', which the
                TF, PyTorch and JAX adapters hand on as their own bfloat16).
            threads: worker threads; None = chosen by stoker. It never changes what is delivered.
            prefetch: batches prepared ahead; None = chosen by stoker. It never changes what is
                delivered.
            memory_budget: bytes the engine may hold (batches in flight plus recycled buffers,
                and small compressed files kept decoded), as `"2GiB"` or an int. None (the
                default): a quarter of the memory this process may use, container limits
                included, at least 512 MiB, and at most a quarter of the address space left
                under `ulimit -v` (`stoker.machine.default_memory_budget`). The
                default prefetch takes at most half of the batches it holds, so large batches
                may leave workers idle: `loader.stats()` then says `held down by
                memory_budget` and `stoker.doctor.verdict` names a budget that gives
                every worker a batch.
            with_index: add `__group__` and `__index__` arrays (int64) to audit pairing.
            shuffle: False (the interleave order), "global" (a seeded permutation of all
                records per epoch, random access) or "files" (group order permuted per epoch,
                blocks shuffled within `window` blocks; any compression). Needs `seed`.
            seed: a non-negative integer; the same seed gives the same order anywhere.
            window: "files" mode: how many consecutive blocks are shuffled together.
            reshuffle_each_iteration: True: each pass goes on with the next epochs (new
                orders); False: every pass replays epochs `0 .. epochs-1`.
            shard: `(index, count)`: this loader takes every count-th record of the epoch's
                sequence from `index` on; `batch_size` is per shard. Use
                `(rank, world_size)` of your data-parallel job.
            even: trim every shard to the same number of batches (collectives never hang);
                False covers every record exactly.
            state: a `loader.state_dict()` to resume from (same as `load_state_dict`).
            pad_last: evaluation mode: every record exactly once over all shards, every batch
                full size, the same number of batches on every shard; padding rows are
                zeros, marked False in a bool `__valid__` array (`even` is not applied).
            transform: `fn(batch, rng) -> batch` or a list of them, applied in order on the
                workers; built-ins in `stoker.transforms`. `rng` comes from (seed, epoch,
                position of the batch's first record); seed None means seed 0.
            workers: "thread" (default) or "process": transforms run in worker processes
                (`threads` of them) on batches in shared memory; for GIL-bound transforms.
            num_parallel_reads: fields at URLs (`s3://`, ...): ranged GETs kept in flight ahead
                of the workers, whatever `threads` is (tf.data's name for I/O parallelism);
                None = 16, fewer where half of what prefetch leaves of `memory_budget` cannot
                hold 16 parts. Never changes what is delivered.
        """
        from .config import LoaderConfig
        from .loader import Loader

        config = LoaderConfig(
            batch_size=batch_size, epochs=epochs, drop_remainder=drop_remainder, cycle_length=cycle_length,
            block_length=block_length, cast=cast, threads=threads, prefetch=prefetch, memory_budget=memory_budget,
            with_index=with_index, shuffle=shuffle, seed=seed, window=window,
            reshuffle_each_iteration=reshuffle_each_iteration, shard=shard, even=even, pad_last=pad_last,
            transform=transform, workers=workers, num_parallel_reads=num_parallel_reads,
        )  # fmt: skip
        return Loader(self, config, state=state)

    # -- random access and subsets (see stoker.dataset) --------------------------------
    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Record `i` (negative counts from the end) as `{field: array of shape}`.

        Example:
            >>> ds[0]["image"].shape
            (128, 128, 1)
        """
        return read_one(self, i)

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Records at `indices` as a list of `{field: array}`, all read by one `read`.

        Batched map-style access: torch's DataLoader calls it with each batch's indices (automatic
        batching or a `batch_sampler`; its default `collate_fn` stacks the list back into a
        batch), Grain's MapDataset through `_getitems`. Each record's arrays are views of one
        bulk read, so a batch costs one gather, not one read per record.

        Example:
            >>> loader = torch.utils.data.DataLoader(ds, batch_size=256, shuffle=True)  # doctest: +SKIP
        """
        batch = self.read(indices)
        n = len(next(iter(batch.values())))
        return [{k: v[j, ...] for k, v in batch.items()} for j in range(n)]

    # Grain's name for the same thing (its SupportsBatchedReadRandomAccessDataSource protocol).
    _getitems = __getitems__

    def read(self, indices: Any, *, cast: Any = None) -> dict[str, np.ndarray]:
        """Records at `indices` (any order, repeats allowed) as `{field: (k, *shape)}`.

        Gathered in bulk: sorted by file and record, raw fields from memory maps, compressed
        fields from their decoded form (cached, bounded) or from the index's seek points.

        Example:
            >>> batch = ds.read([5, 0, 5])
        """
        return read_records(self, indices, cast=cast)

    def select(self, *, groups: Any = None, records: Any = None) -> Subset:
        """A Dataset of some groups and/or records of this one; see `Dataset.select`."""
        return select(self, groups=groups, records=records)

    def split(self, fractions: Mapping[str, float], *, seed: int, by: str = "group") -> dict[str, Subset]:
        """Disjoint, complete, deterministic subsets; see `Dataset.split`.

        A part that would hold nothing (`{"train": 0.9, "val": 0.1}` over 2 groups) is a
        SpecError naming it: split by record, or give it a larger fraction.

        Example:
            >>> parts = ds.split({"train": 0.75, "val": 0.25}, seed=0)
            >>> train = parts["train"].loader(256, shuffle="global", seed=1)
        """
        return split(self, fractions, seed=seed, by=by)

    @property
    def catalog(self) -> Catalog:
        """The files as stoker.io sees them (groups, counts, seek points): what the engine reads."""
        return self._catalog

    def subset_key(self) -> str | None:
        """What distinguishes a subset in a resume fingerprint (None: the whole dataset)."""
        return None

    def reader(self) -> Reader:
        """The reader behind `read`, `ds[i]` and `__getitems__` (stoker.engine.reader), made on
        first use and kept: its open files and decoded files serve the next reads. Thread-safe."""
        reader = self._reader
        if reader is None:
            with self._access_lock:
                reader = self._reader
                if reader is None:
                    reader = self._reader = self._open_reader()
        return reader

    def _open_reader(self) -> Reader:
        # Arrays come from the caller (read_records); the pool only satisfies the assembler.
        return open_reader(self._catalog, self.output_dtypes(), allocator=AlignedPool(0), batch_size=1)

    # Used by adapters and the CLI; public enough to document, not part of the contract.
    def output_dtypes(self, cast: Any = None) -> dict[str, np.dtype]:
        return resolve_cast(self.fields, cast)


def _firsts(ds: Dataset) -> np.ndarray:
    """Cumulative record counts: group g holds global records `firsts[g] .. firsts[g + 1]`."""
    table = ds._firsts_table
    if table is None:
        counts = np.fromiter((ds.records_in(g) for g in range(ds.num_groups)), np.int64, ds.num_groups)
        table = ds._firsts_table = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
    return table


def locate(ds: Dataset, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, record within the group) of each valid global index of `ds`."""
    firsts = _firsts(ds)
    groups = np.searchsorted(firsts, indices, side="right") - 1
    return groups, indices - firsts[groups]


def to_root(ds: Dataset, groups: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, record) of `ds` as (group, record in the file) of its root dataset."""
    return ds.catalog.to_root(groups, records)


def _in_range(value: Any, n: int, what: str) -> tuple[np.ndarray, int | None]:
    """`value` (a 1-D integer sequence) as int64 indices in `[0, n)`, negatives counted from the
    end, or the first index out of range (as a Python int) with an empty array.

    Checked before any cast to int64: a uint64 of 2**64 - 1, or a Python int past 2**63, would
    wrap to a negative index and read a record that was never asked for.
    """
    idx = np.asarray(value)
    if idx.ndim != 1:
        raise SpecError(f"{what} must be a 1-D sequence of record indices, got shape {idx.shape}")
    if not idx.size:
        return np.zeros(0, np.int64), None
    if idx.dtype.kind not in "iu":
        # Python ints past int64 make numpy's array object (or float64, beside small ones).
        items = list(idx) if isinstance(value, np.ndarray) else list(value)
        integral = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in items)
        if idx.dtype.kind not in "fO" or not integral:
            raise SpecError(f"{what} must be integers, got dtype {idx.dtype}")
        bad = next((int(v) for v in items if not -n <= int(v) < n), None)
        if bad is not None:
            return np.zeros(0, np.int64), bad
        idx = np.array([int(v) for v in items], np.int64)
    # Unsigned ones compared unsigned: nothing wraps.
    out = idx >= np.uint64(n) if idx.dtype.kind == "u" else (idx < -n) | (idx >= n)
    if out.any():
        return np.zeros(0, np.int64), int(idx[np.flatnonzero(out)[0]])
    idx = idx.astype(np.int64)
    return np.where(idx < 0, idx + n, idx), None


def _indices(ds: Dataset, indices: Any, what: str) -> np.ndarray:
    n = int(_firsts(ds)[-1])
    idx, bad = _in_range(indices, n, what)
    if bad is not None:
        path = _first_path(ds)
        raise RecordIndexError(
            f"record index {bad} is out of range for {ds!r} with {n} records (first file {path!r})",
            index=bad, path=path,
        )  # fmt: skip
    return idx


def _first_path(ds: Dataset) -> str | None:
    files = ds.files
    return next(iter(files[0].values())).path if files else None


def read_records(ds: Dataset, indices: Any, *, cast: Any = None) -> dict[str, np.ndarray]:
    """`ds.read`: records at global `indices` (any order, repeats allowed) as `{field: (k, *shape)}`."""
    idx = _indices(ds, indices, "indices")
    dtypes = resolve_cast(ds.fields, cast)
    out = {n: np.empty((len(idx), *f.shape), dtypes[n]) for n, f in ds.fields.items()}
    if len(idx):
        ds.reader().read_into(*locate(ds, idx), out)
    return out


def read_one(ds: Dataset, i: Any) -> dict[str, np.ndarray]:
    """`ds[i]`: one record as `{field: array of the field's shape}`; a slice reads a batch."""
    if isinstance(i, slice):
        return read_records(ds, np.arange(*i.indices(len(ds)), dtype=np.int64))
    if isinstance(i, bool) or not isinstance(i, numbers.Integral):
        raise SpecError(f"a record index must be an integer (or a slice), got {i!r}")
    batch = read_records(ds, [int(i)])  # a list, so an index past int64 is range-checked, not cast
    return {n: a[0, ...] for n, a in batch.items()}


class Subset(Dataset):
    """Some groups of a root Dataset and, per group, all or some of its records (in file order).

    Made by `Dataset.select` and `Dataset.split`; everything a Dataset does
    (`len`, `ds[i]`, `read`, `loader` with every option, `select` again) works on it.
    Its global indices run over its own records, group by group.
    """

    _catalog: CatalogView

    def __init__(self, root: Dataset, groups: np.ndarray, records: Sequence[np.ndarray | None]) -> None:
        # Not Dataset.__init__: no globbing or counting again, the root did that.
        self.root = root
        self.fields = root.fields
        self.pair_key = root.pair_key
        self._catalog = CatalogView(root.catalog, groups, records)
        self._init_access()

    @property
    def catalog(self) -> CatalogView:
        """The root's files seen through this subset: its groups, and per group all records or some."""
        return self._catalog

    @property
    def groups(self) -> tuple[Group, ...]:
        """Every group of the subset, `index` being its group number in the root dataset."""
        view = self._catalog
        return tuple(
            Group(int(view.groups[v]), {n: i.path for n, i in view.files[v].items()}, view.count(v))
            for v in range(view.num_groups)
        )

    def subset_key(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self._catalog.groups, np.int64).tobytes())
        for selected in self._catalog.records:
            h.update(b"*" if selected is None else b"[" + np.ascontiguousarray(selected, np.int64).tobytes() + b"]")
        return h.hexdigest()[:16]

    def _open_reader(self) -> Reader:
        # Records of the root's files through the root's reader: a subset shares its open and decoded files.
        return open_reader(
            self._catalog,
            self.output_dtypes(),
            allocator=AlignedPool(0),
            batch_size=1,
            records=self.root.reader().records(),
        )

    def __repr__(self) -> str:
        return f"Subset of {self.root!r}: {self.num_groups} groups"


def _positions(value: Any, n: int, what: str, path: str | None) -> np.ndarray:
    """A slice or integer sequence of positions in `[0, n)` (negatives from the end), no repeats."""
    if isinstance(value, slice):
        return np.arange(*value.indices(n), dtype=np.int64)
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise SpecError(f"{what} must be a slice or a 1-D sequence of integers, got {value!r:.100}")
    arr, bad = _in_range(value, n, what)
    if bad is not None:
        raise RecordIndexError(f"{what}: {bad} is out of range for {n} (first file {path!r})", index=bad, path=path)
    if len(np.unique(arr)) != len(arr):
        raise SpecError(f"{what} holds repeated values; a subset holds each group or record once")
    return arr


def select(ds: Dataset, *, groups: Any = None, records: Any = None) -> Subset:
    """A subset of `ds`: `groups` (a slice or group numbers, kept in the order given), then
    `records` (a slice or global record indices of those groups, taken in ascending order).

    Groups are numbered as in `ds` (for a subset: its own groups); `records` index the
    records of the selected groups, as `len(ds.select(groups=...))` counts them. Groups
    left with no record are dropped. Repeats are an error.

    Example:
        >>> few = ds.select(groups=[0, 2], records=slice(0, 100))
    """
    if isinstance(ds, Subset):
        root, base_groups, base_records = ds.root, ds._catalog.groups, list(ds._catalog.records)
    else:
        root, base_groups, base_records = ds, np.arange(ds.num_groups, dtype=np.int64), [None] * ds.num_groups
    if groups is not None:
        chosen = _positions(groups, len(base_groups), "groups", _first_path(ds))
        base_groups = base_groups[chosen]
        base_records = [base_records[int(i)] for i in chosen]
    view = Subset(root, base_groups, base_records)
    if records is None:
        return view
    idx = np.sort(_positions(records, len(view), "records", _first_path(ds)))
    vg, local = locate(view, idx)
    new_groups: list[int] = []
    new_records: list[np.ndarray | None] = []
    bounds = np.flatnonzero(np.diff(vg)) + 1
    for part in np.split(np.arange(len(idx)), bounds) if len(idx) else []:
        v = int(vg[part[0]])
        chosen_records = local[part]
        prior = base_records[v]
        mapped = chosen_records if prior is None else prior[chosen_records]
        g = int(base_groups[v])
        whole = len(mapped) == root.records_in(g) and bool((mapped == np.arange(len(mapped))).all())
        new_groups.append(g)
        new_records.append(None if whole else mapped)  # whole groups keep streaming reads
    return Subset(root, np.array(new_groups, dtype=np.int64), new_records)


def _sizes(fractions: Sequence[float], total: int) -> list[int]:
    """Largest-remainder rounding: sizes summing to `total`, ties to the earlier name."""
    exact = [f * total for f in fractions]
    sizes = [math.floor(x) for x in exact]
    for k in sorted(range(len(exact)), key=lambda k: (-(exact[k] - sizes[k]), k))[: total - sum(sizes)]:
        sizes[k] += 1
    return sizes


def split(ds: Dataset, fractions: Mapping[str, float], *, seed: int, by: str = "group") -> dict[str, Subset]:
    """Disjoint subsets covering `ds`, sized by `fractions` (summing to 1), deterministic in `seed`.

    `by="group"` deals whole groups (files), so any compression streams; `by="record"`
    deals records. Units are permuted by a keyed permutation of `seed` (its own stream,
    independent of loader shuffles), cut in the order of `fractions` with sizes rounded by
    largest remainder, and each part keeps the dataset's order. The same seed and dataset
    give the same parts on any machine. A part that would be empty (2 groups cannot give a 10%
    part by group) is a SpecError, never a silent empty subset.

    Example:
        >>> parts = ds.split({"train": 0.9, "val": 0.1}, seed=0, by="record")
        >>> len(parts["train"]) + len(parts["val"]) == len(ds)
        True
    """
    if not isinstance(fractions, Mapping) or not fractions:
        raise SpecError(f"fractions={fractions!r} must be a non-empty mapping of name -> fraction")
    for name, f in fractions.items():
        if not isinstance(name, str) or isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 <= f <= 1:
            raise SpecError(f"fractions[{name!r}]={f!r} must be a number in [0, 1] under a string name")
    if abs(sum(float(f) for f in fractions.values()) - 1) > 1e-9:
        total = sum(fractions.values())
        raise SpecError(f"fractions {dict(fractions)} sum to {total}, not 1: the parts must cover the data")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise SpecError(f"seed={seed!r} must be a non-negative integer")
    if by not in ("group", "record"):
        raise SpecError(f"by={by!r} must be 'group' or 'record'")
    total = ds.num_groups if by == "group" else len(ds)
    sizes = _sizes([float(f) for f in fractions.values()], total)
    empty = [name for name, size in zip(fractions, sizes, strict=True) if size == 0]
    if empty:
        unit = "groups" if by == "group" else "records"
        instead = "split by='record', give them larger fractions" if by == "group" else "give them larger fractions"
        raise SpecError(
            f"split {dict(fractions)} of {total} {unit} (by={by!r}) leaves {', '.join(map(repr, empty))} empty "
            f"(sizes {dict(zip(fractions, sizes, strict=True))}); {instead}, or leave them out"
        )
    perm = Permutation(total, int(seed), 0, STREAM_SPLIT)(np.arange(total, dtype=np.int64))
    out: dict[str, Subset] = {}
    start = 0
    for name, size in zip(fractions, sizes, strict=True):
        part = np.sort(perm[start : start + size])
        start += size
        out[name] = select(ds, groups=part) if by == "group" else select(ds, records=part)
    return out
