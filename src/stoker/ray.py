"""Ray Data adapter: a stoker Dataset as a `ray.data.Dataset`, read by a custom Datasource.

Each read task carries only its own groups: their file infos, settled counts and seek points
(`stoker.io.files.Catalog.part`), never the whole catalog, so what Ray ships per task does
not grow with the dataset. A task reads a range of the dataset's records with stoker's own
reader (raw fields by ranged reads, compressed fields by streaming inflate from the start or
from an index seek point, local paths or fsspec URLs) and yields columnar blocks. A block holds
every field of the same records (one row = one record: its image and its label), so pairs
cannot come apart whatever Ray does with blocks afterwards.

Tasks and blocks:

- The records are cut into about `parallelism` tasks (Ray's requested read parallelism:
  `override_num_blocks=`, or what Ray derives from the cluster), or into tasks of
  `records_per_task` records. Small groups share a task; large groups are cut into record
  ranges where cutting is free: raw files anywhere, compressed files at the persistent
  index's seek points (`stoker.io.index`; without an index a compressed group is read
  whole by one task, since a range of it would inflate the stream from its start).
- Tasks and blocks are whole multiples of `batch_size` records (the hint), so Ray's
  `iter_batches(batch_size=batch_size)` slices batches out of blocks without copying; only
  the last block, and a task that had to take a group it could not cut, end short.
- Fields ship in their stored dtype unless `cast=` asks for the cast in the read task: an
  int8 image cast to float32 there is 4x the bytes through Ray's object store. Cast where the
  batch is consumed instead with `iter_batches` / `cast_batch`.

Order, shuffling, sharding:

- Tasks are listed in dataset order; Ray runs them in parallel and, unless
  `DataContext.get_current().execution_options.preserve_order = True`, hands blocks on in
  the order they finish.
- `seed=` lists the groups (and their ranges) in a seeded permutation of `(seed, epoch)`
  before they are cut into tasks (a cheap group-level shuffle, like `shuffle="files"`). Each
  execution of the Dataset is the next epoch, as each `iter(loader)` is a loader's next pass:
  the k-th `iter_batches` over it, or the k-th epoch of a `streaming_split` (Ray Train's
  `get_dataset_shard`), reads epoch `epoch + k` in its own order;
  `reshuffle_each_iteration=False` reads epoch `epoch` every time. For record level mixing use
  Ray's `iter_batches(local_shuffle_buffer_size=...)` or `random_shuffle(seed=...)`.
- `streaming_split(n, equal=False)` hands every block to exactly one of `n` consumers:
  every record reaches exactly one training worker per epoch.

Example:
    >>> import ray, stoker, stoker.ray
    >>> ds = stoker.Dataset(image=stoker.Field("s3://bucket/img_*.bin", "int8", (128, 128, 1)),
    ...                     label=stoker.Field("s3://bucket/out_*.bin.gz", "float32"))  # doctest: +SKIP
    >>> rds = stoker.ray.read(ds, batch_size=256)  # doctest: +SKIP
    >>> for batch in stoker.ray.iter_batches(rds, batch_size=256, cast={"image": "float32"}):  # doctest: +SKIP
    ...     train_step(batch["image"], batch["label"])
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .dataset import Dataset, Subset
from .engine.assembler import GROUP_KEY, INDEX_KEY
from .engine.decoded import KEPT_DECODED_BYTES, VERIFY_WHOLE_BYTES, KeptDecoded
from .engine.executor import AlignedPool
from .engine.maps import KeptMaps, loader_kept_maps
from .engine.reader import open_reader
from .errors import SpecError
from .io.files import Catalog
from .kernels import cast_into
from .plan.batches import BatchPlan, Run
from .plan.order import permute_groups
from .spec import positive, resolve_dtype

if TYPE_CHECKING:
    import ray.data

__all__ = ["MIN_RAY", "StokerDatasource", "cast_batch", "iter_batches", "read"]

# The oldest Ray this module works with: read tasks are built with ReadTask's per_task_row_limit
# (Ray's limit pushdown; 2.49's ReadTask takes no such argument) and BlockMetadata without a
# schema. Tested on 2.50.0 and on the version the dev environment installs; pyproject's [ray]
# extra asks for it too.
MIN_RAY = (2, 50)
# Ray's own default target block size, for a DataContext that sets none (see _default_block).
_BLOCK_BYTES = 128 << 20
# Block memory a Ray worker process keeps for its next blocks: Ray copies each block into its
# object store and drops it, so a read task's next block finds memory already touched instead
# of fresh pages to fault in and zero (two of Ray's default blocks).
_POOL_BYTES = 2 * _BLOCK_BYTES
# Per worker process (a read task is a function call there; nothing owns the tasks that come after it).
_pool: AlignedPool | None = None
# A small compressed file read in ranges by several tasks is decoded whole by each of them: at
# most this many bytes of such decoding per file (see StokerDatasource._grain).
_REDECODE_BYTES = 64 << 20


def _worker_pool() -> AlignedPool:
    global _pool
    if _pool is None:
        _pool = AlignedPool(_POOL_BYTES)
    return _pool


# Per worker process (as `_pool`), as a loader keeps them for all its passes: maps of the raw files read (no
# descriptor held), so the next task on a file copies from its map with stoker's kernels instead
# of reading it again with preadv, and small compressed files decoded whole (labels), so the
# next pass does not inflate them again.
_kept: tuple[KeptMaps | None, KeptDecoded] | None = None


def _worker_kept() -> tuple[KeptMaps | None, KeptDecoded]:
    global _kept
    if _kept is None:
        _kept = (loader_kept_maps(), KeptDecoded(KEPT_DECODED_BYTES))
    return _kept


def check_ray_version(version: str) -> None:
    """ImportError unless Ray `version` is at least `MIN_RAY` (a clear one, before any
    missing attribute of an older Ray's Datasource API would surface mid-read)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) < MIN_RAY:
        need = ".".join(map(str, MIN_RAY))
        raise ImportError(
            f"stoker.ray needs ray[data]>={need}, found ray {version}: pip install 'ray[data]>={need}' "
            "(stoker's ray extra)"
        )


def _import_ray_data() -> type:
    import ray
    import ray.data

    check_ray_version(ray.__version__)
    return ray.data.Datasource


def read(
    ds: Dataset,
    *,
    batch_size: int | None = None,
    cast: Any = None,
    records_per_task: int | None = None,
    records_per_block: int | None = None,
    seed: int | None = None,
    epoch: int = 0,
    reshuffle_each_iteration: bool = True,
    with_index: bool = False,
    **read_args: Any,
) -> ray.data.Dataset:
    """A `ray.data.Dataset` of `ds`: one row per record, one column per field.

    Args:
        ds: the stoker Dataset or Subset (its files: local paths on every node, or URLs).
        batch_size: the batch size the consumer asks `iter_batches` for: tasks and blocks
            are cut at whole multiples of it, so batches are slices of blocks (no copy).
        cast: one dtype or `{field: dtype}`, applied in the read task (None: the stored
            dtypes travel, the fewest bytes; cast at the consumer with `iter_batches`).
        records_per_task: records per read task (None: as many tasks as Ray's requested
            parallelism, `override_num_blocks=`, by default
            `StokerDatasource.default_tasks`).
        records_per_block: rows per output block (None: the fewest whole batches over Ray's
            `DataContext.target_max_block_size`; Ray joins smaller blocks of a task into
            one of several chunks, which its batcher then copies whole).
        seed: list the groups in a permutation of `(seed, epoch)` before they are cut into
            tasks, a new one for each execution of the Dataset.
        epoch: the epoch the Dataset's first execution reads (a run resumed at its epoch).
        reshuffle_each_iteration: each execution (each iteration, each epoch of a
            `streaming_split`) reads the next epoch; False: every execution reads `epoch`.
        with_index: add int64 `__group__` and `__index__` columns (the root dataset's group
            and record in the file).
        read_args: passed to `ray.data.read_datasource` (`override_num_blocks`,
            `concurrency`, `ray_remote_args`, ...).
    """
    import ray.data

    source = StokerDatasource(
        ds,
        batch_size=batch_size,
        cast=cast,
        records_per_task=records_per_task,
        records_per_block=records_per_block,
        seed=seed,
        epoch=epoch,
        reshuffle_each_iteration=reshuffle_each_iteration,
        with_index=with_index,
    )
    if "override_num_blocks" not in read_args and "parallelism" not in read_args:
        read_args["override_num_blocks"] = source.default_tasks()
    return ray.data.read_datasource(source, **read_args)


def cast_batch(batch: Mapping[str, np.ndarray], cast: Any) -> dict[str, np.ndarray]:
    """`batch` with its fields converted as `cast` says (one dtype for every field, or
    `{field: dtype}`, `"bfloat16"` included) by stoker's compiled casts into new arrays;
    other arrays (`__group__`, `__index__`) as they are.

    Example:
        >>> cast_batch({"image": np.arange(4, dtype=np.int8)}, {"image": "float32"})["image"]
        array([0., 1., 2., 3.], dtype=float32)
    """
    names = [k for k in batch if not k.startswith("__")]
    if isinstance(cast, Mapping):
        unknown = [k for k in cast if k not in names]
        if unknown:
            raise SpecError(f"cast names unknown field(s) {unknown}; the batch has {names}", field=str(unknown[0]))
        wanted = {n: resolve_dtype(d) for n, d in cast.items()}
    else:
        dtype = resolve_dtype(cast)
        wanted = dict.fromkeys(names, dtype)
    out = dict(batch)
    for name, dtype in wanted.items():
        src = np.ascontiguousarray(batch[name])
        if src.dtype != dtype:
            dst = np.empty(src.shape, dtype)
            cast_into(dst, src)
            out[name] = dst
    return out


def iter_batches(source: Any, *, batch_size: int = 256, cast: Any = None, **iter_args: Any) -> Iterator[dict[str, Any]]:
    """`source.iter_batches(batch_size=..., batch_format="numpy")` with fields cast on the
    consumer (see `cast_batch`); `source`: a `ray.data.Dataset` or a Ray Train
    worker's `DataIterator` (`ray.train.get_dataset_shard(name)`).

    Pass `read(..., batch_size=)` the same batch size, so batches are slices of blocks.
    """
    for batch in source.iter_batches(batch_size=batch_size, batch_format="numpy", **iter_args):
        yield batch if cast is None else cast_batch(batch, cast)


class _Unit(NamedTuple):
    """A group as the tasks see it: its records, and where a task boundary may cut it."""

    group: int  # in the root dataset
    records: int
    selection: np.ndarray | None  # a record subset's records of the group (sorted); None: 0..records
    grain: int  # tasks may start inside the group at multiples of this many records only


class Piece(NamedTuple):
    """Records `start..stop` of unit `unit` (positions in its selection, for a record subset)."""

    unit: int
    start: int
    stop: int


def plan_tasks(records: Sequence[int], grains: Sequence[int], per_task: int) -> list[list[Piece]]:
    """Units of `records[u]` records (groups, in the order given) cut into tasks of about
    `per_task` records: pure index arithmetic.

    A task takes units in order until it holds `per_task` records, cutting the unit that
    fills it at the next multiple of the unit's grain at or after that point (raw groups:
    a grain of 1, cut exactly). So every task but the last holds `per_task` records where
    grains allow, and at most one grain more where they do not.

    Example:
        >>> [[tuple(p) for p in t] for t in plan_tasks([5, 3, 9], [5, 1, 3], 4)]
        [[(0, 0, 5)], [(1, 0, 3), (2, 0, 3)], [(2, 3, 9)]]
    """
    tasks: list[list[Piece]] = []
    task: list[Piece] = []
    rows = 0
    for u, n in enumerate(records):
        a = 0
        while a < n:
            wanted = a + per_task - rows
            b = min(n, -(-wanted // grains[u]) * grains[u])
            task.append(Piece(u, a, b))
            rows += b - a
            a = b
            if rows >= per_task:
                tasks.append(task)
                task, rows = [], 0
    if task:
        tasks.append(task)
    return tasks


class StokerDatasource(_import_ray_data()):  # type: ignore[misc]
    """A Ray Datasource reading a stoker Dataset in tasks of record ranges (see `read`).

    Ray asks it for read tasks when it plans or sizes a read (which order it lists does not
    matter there) and once at the start of each execution, the one call that passes a
    `data_context`: that call reads the next epoch. A copy in another process (Ray Train's
    split coordinator) counts its executions from `epoch` again.
    """

    def __init__(
        self,
        ds: Dataset,
        *,
        batch_size: int | None = None,
        cast: Any = None,
        records_per_task: int | None = None,
        records_per_block: int | None = None,
        seed: int | None = None,
        epoch: int = 0,
        reshuffle_each_iteration: bool = True,
        with_index: bool = False,
    ) -> None:
        super().__init__()
        align = positive("batch_size", batch_size) or 1
        per_task = positive("records_per_task", records_per_task)
        per_block = positive("records_per_block", records_per_block)
        for name, value in (("records_per_task", per_task), ("records_per_block", per_block)):
            if value is not None and value % align:
                raise SpecError(
                    f"{name}={value} must be a whole multiple of batch_size={align}: blocks are cut in whole batches"
                )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise SpecError(f"seed={seed!r} must be a non-negative integer or None")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise SpecError(f"epoch={epoch!r} must be a non-negative integer")
        if not isinstance(reshuffle_each_iteration, bool):
            raise SpecError(f"reshuffle_each_iteration={reshuffle_each_iteration!r} must be True or False")
        self.seed, self.epoch, self.reshuffle_each_iteration = seed, epoch, reshuffle_each_iteration
        self._executions = 0  # executions started by this copy
        self._lock = threading.Lock()
        self._dtypes = ds.output_dtypes(cast)
        for name, dtype in self._dtypes.items():
            if dtype.kind == "V":  # ml_dtypes' bfloat16: Ray would turn the column into Python objects
                how = "stored as" if ds.fields[name].dtype.kind == "V" else "cast to"
                raise SpecError(
                    f"ray: field {name!r} {how} {dtype.name}: Ray Data's Arrow blocks have no such type (the "
                    "column would become Python objects, one per value); cast to float16 or float32 here, or "
                    "to bfloat16 where the batch is consumed (stoker.ray.iter_batches(..., cast=...))",
                    field=name,
                )
        self._root: Catalog = ds.catalog.root()
        self._with_index = with_index
        self._align = align
        self._per_task = per_task
        self._columns = {n: (f.shape, self._dtypes[n]) for n, f in ds.fields.items()}
        if with_index:
            self._columns.update({GROUP_KEY: ((), np.dtype(np.int64)), INDEX_KEY: ((), np.dtype(np.int64))})
        self._row_bytes = sum(dtype.itemsize * math.prod(shape) for shape, dtype in self._columns.values())
        self._block_row_bytes: int | None = None
        self._per_block = per_block
        self.units = self._units(ds)  # counts settled here, once; the tasks carry them (dataset order)
        self._records = sum(u.records for u in self.units)

    def _units(self, ds: Dataset) -> list[_Unit]:
        if isinstance(ds, Subset):
            view = ds.catalog
            pairs = [(int(g), view.records[v]) for v, g in enumerate(view.groups)]
        else:
            pairs = [(g, None) for g in range(self._root.num_groups)]
        units = []
        for g, selection in pairs:
            n = self._root.count(g) if selection is None else len(selection)
            if n:
                units.append(_Unit(g, n, selection, 1 if selection is not None else self._grain(g)))
        return units

    def _grain(self, g: int) -> int:
        """Where group `g` may be cut between tasks, in records (evenly, in whole batches).

        Raw files: anywhere (a grain of 1). A compressed file decoded whole by any reader of
        it (at most stoker.engine.decoded.VERIFY_WHOLE_BYTES) is decoded by each task that reads a range
        of it: as many cuts as keep that decoding within _REDECODE_BYTES (or 8 times the file).
        A larger one is read from the persistent index's seek points: as many cuts as it has
        points, and none without an index (a range would inflate the stream from its start).
        """
        n = self._root.count(g)
        cuts = n
        for name, info in self._root.files[g].items():
            if info.compression is None:
                continue
            spec = self._root.fields[name]
            size = spec.header_bytes + n * spec.record_bytes + spec.footer_bytes
            if size <= VERIFY_WHOLE_BYTES:
                cuts = min(cuts, max(8, _REDECODE_BYTES // max(1, size)) - 1)
            else:
                points = self._root.seek_points.get((g, name), ())
                cuts = min(cuts, sum(p.decompressed > spec.header_bytes for p in points))
        if cuts >= n:
            return 1
        return -(-math.ceil(n / (cuts + 1)) // self._align) * self._align

    def _default_block(self, data_context: Any) -> int:
        """Rows per block: the fewest whole batches over Ray's target block size.

        Ray's read operator gathers a task's blocks until they pass its target size and hands
        them on as one block of several chunks; its batcher then copies such a block whole into
        one chunk before it slices batches out of it. A block just over the target (by less
        than half of it, or Ray slices it) is handed on alone, in one chunk, and sliced into
        batches without a copy. Sizes as Ray counts them: its Arrow blocks' bytes per row.
        """
        if data_context is None:  # read_datasource plans with the current context
            from ray.data import DataContext

            data_context = DataContext.get_current()
        target = data_context.target_max_block_size or _BLOCK_BYTES
        batch_bytes = self._align * self._arrow_row_bytes()
        return (target // batch_bytes + 1) * self._align

    def _arrow_row_bytes(self) -> int:
        """Bytes per row of this dataset's blocks as Ray sizes them (Arrow adds offsets to tensor
        columns), from two small blocks of zeros."""
        if self._block_row_bytes is None:
            from ray.data.block import BlockAccessor

            def size(rows: int) -> int:
                batch = {n: np.zeros((rows, *shape), dtype) for n, (shape, dtype) in self._columns.items()}
                return int(BlockAccessor.for_block(BlockAccessor.batch_to_block(batch)).size_bytes())

            self._block_row_bytes = max(1, (size(128) - size(64)) // 64)
        return self._block_row_bytes

    def get_name(self) -> str:
        return "Stoker"

    def default_tasks(self) -> int:
        """Read tasks when none are asked for: Ray's own estimate without its floor of
        `DataContext.read_op_min_num_blocks` (200), which would cut W1's 16 files (benchmarks/w1.py, 1 GiB) into
        200 tasks of 5 MiB, each paying Ray's per-task costs (measured: see
        benchmarks/results/ray.md). One task per target-size block of output, and at least two
        per CPU of the cluster (or of this machine, before `ray.init`)."""
        import ray
        from ray.data import DataContext

        target = DataContext.get_current().target_max_block_size or _BLOCK_BYTES
        cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else (os.cpu_count() or 1)
        return max(math.ceil(self.estimate_inmemory_data_size() / target), 2 * cpus, 1)

    def estimate_inmemory_data_size(self) -> int:
        return self._records * self._row_bytes

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_executions"] = 0  # a copy counts its own executions (see the class docstring)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s order of `units` (indices): seeded by `(seed, epoch)`, else dataset order."""
        if self.seed is None or not self.units:
            return list(range(len(self.units)))
        return [int(i) for i in permute_groups(len(self.units), self.seed, epoch)]

    def tasks(self, parallelism: int, epoch: int | None = None) -> list[list[Piece]]:
        """The pieces each read task of epoch `epoch` (None: `self.epoch`) reads, for Ray's
        requested `parallelism` (or records_per_task); `Piece.unit` indexes `units`."""
        per_task = self._per_task
        if per_task is None:
            per_task = math.ceil(self._records / max(1, parallelism))
            per_task = max(self._align, -(-per_task // self._align) * self._align)
        order = self.order(self.epoch if epoch is None else epoch)
        units = [self.units[u] for u in order]
        tasks = plan_tasks([u.records for u in units], [u.grain for u in units], per_task)
        return [[p._replace(unit=order[p.unit]) for p in t] for t in tasks]

    def _execution_epoch(self) -> int:
        """The epoch an execution starting now reads; counts it."""
        with self._lock:
            k, self._executions = self._executions, self._executions + 1
        return self.epoch + k if self.reshuffle_each_iteration else self.epoch

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[Any]:
        """About `parallelism` tasks, each carrying only its own groups (see `read`); with a
        `data_context` (an execution starting) those of the next epoch."""
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        per_block = self._per_block or self._default_block(data_context)
        epoch = self._execution_epoch() if data_context is not None else None
        out = []
        for pieces in self.tasks(parallelism, epoch):
            units = list(dict.fromkeys(p.unit for p in pieces))  # the task's units, in order
            local = {u: i for i, u in enumerate(units)}
            groups = [self.units[u].group for u in units]
            catalog = self._root.part(groups)
            parts = []
            for p in pieces:
                selection = self.units[p.unit].selection
                parts.append(
                    _Part(local[p.unit], p.start, p.stop, None if selection is None else selection[p.start : p.stop])
                )
            rows = sum(p.stop - p.start for p in pieces)
            meta = BlockMetadata(
                num_rows=rows,
                size_bytes=rows * self._row_bytes,
                exec_stats=None,
                input_files=tuple(i.path for infos in catalog.files for i in infos.values()),
            )
            read_fn = _ReadTask(
                catalog, self._dtypes, tuple(parts), np.array(groups, np.int64), per_block, self._with_index
            )
            out.append(ReadTask(read_fn, meta, per_task_row_limit=per_task_row_limit))
        return out


class _Part(NamedTuple):
    """What a task reads of one of its groups: records `start..stop`, or `records` (a record subset's)."""

    group: int  # in the task's catalog
    start: int
    stop: int
    records: np.ndarray | None


class _ReadTask:
    """One read task's work (runs in a Ray worker): its parts as Arrow blocks of every field."""

    __name__ = "stoker_read"  # Ray's warnings name a read function by its __name__

    def __init__(
        self,
        catalog: Catalog,
        dtypes: Mapping[str, np.dtype],
        parts: tuple[_Part, ...],
        groups: np.ndarray,
        per_block: int,
        with_index: bool,
    ) -> None:
        self.catalog = catalog
        self.dtypes = dict(dtypes)
        self.parts = parts
        self.groups = groups
        self.per_block = per_block
        self.with_index = with_index

    def _blocks(self) -> Iterator[list[_Part]]:
        """The parts cut into blocks of `per_block` rows (the last one shorter)."""
        block: list[_Part] = []
        rows = 0
        for part in self.parts:
            a = part.start
            while a < part.stop:
                b = min(part.stop, a + self.per_block - rows)
                sub = None if part.records is None else part.records[a - part.start : b - part.start]
                block.append(_Part(part.group, a, b, sub))
                rows += b - a
                a = b
                if rows == self.per_block:
                    yield block
                    block, rows = [], 0
        if block:
            yield block

    def __call__(self) -> Iterator[Any]:
        from ray.data.block import BlockAccessor

        pool = _worker_pool()  # a block's arrays are reused only once Ray has dropped every view of them
        maps, decoded = _worker_kept()
        with open_reader(
            self.catalog, self.dtypes, allocator=pool, batch_size=self.per_block, kept_maps=maps, kept_decoded=decoded
        ) as reader:
            for i, block in enumerate(self._blocks()):
                rows = sum(p.stop - p.start for p in block)
                if all(p.records is None for p in block):
                    runs, row = [], 0
                    for p in block:
                        final = p.stop == self.catalog.count(p.group)  # streams are checked to end there
                        runs.append(Run(p.group, p.start, p.stop - p.start, row, final))
                        row += p.stop - p.start
                    plan = BatchPlan(epoch=0, index=i, position=0, rows=rows, runs=tuple(runs))
                    out, _ = reader(reader.prepare(plan))
                else:  # a record subset: its records by random access
                    out = {n: pool.array((rows, *f.shape), self.dtypes[n]) for n, f in self.catalog.fields.items()}
                    reader.read_into(*_gather(block), out)
                if self.with_index:
                    local, records = _gather(block)
                    out[GROUP_KEY], out[INDEX_KEY] = self.groups[local], records
                yield BlockAccessor.batch_to_block(out)


def _gather(block: Sequence[_Part]) -> tuple[np.ndarray, np.ndarray]:
    """(group in the task's catalog, record in the file) of every row of `block`."""
    groups = np.concatenate([np.full(p.stop - p.start, p.group, np.int64) for p in block])
    records = np.concatenate(
        [np.arange(p.start, p.stop, dtype=np.int64) if p.records is None else p.records for p in block]
    )
    return groups, records
