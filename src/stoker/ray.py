"""Ray Data adapter: a stoker Dataset as a ``ray.data.Dataset``, read by a custom Datasource.

Each read task reads one group, or one range of records of a group, with stoker's own
reader (raw fields by ranged reads, compressed fields by streaming inflate, local paths or
fsspec URLs) and yields columnar blocks. A block holds every field of the same records
(one row = one record: its image and its label), so pairs cannot come apart whatever Ray
does with blocks afterwards.

Order, shuffling, sharding:

- Tasks are listed group by group, ranges in order; Ray runs them in parallel and, unless
  ``DataContext.get_current().execution_options.preserve_order = True``, hands blocks on in
  the order they finish.
- ``seed=`` lists the tasks in a seeded permutation (a cheap group/range-level shuffle,
  like ``shuffle="files"``; pass ``seed + epoch`` for a new order per epoch). For record
  level mixing use Ray's ``iter_batches(local_shuffle_buffer_size=...)`` or
  ``random_shuffle(seed=...)`` (an all-to-all exchange of the whole dataset).
- ``streaming_split(n, equal=False)`` hands every block to exactly one of ``n`` consumers:
  every record reaches exactly one training worker per epoch (each pass over the splits is
  an epoch). ``equal=True`` evens the consumers' row counts and may hold back up to n-1 rows.

Example:
    >>> import ray, stoker, stoker.ray
    >>> ds = stoker.Dataset(image=stoker.Field("s3://bucket/img_*.bin", "int8", (128, 128, 1)),
    ...                     label=stoker.Field("s3://bucket/out_*.bin.gz", "float32"))  # doctest: +SKIP
    >>> rds = stoker.ray.read(ds, cast={"image": "float32"})  # doctest: +SKIP
    >>> for batch in rds.iter_batches(batch_size=256, batch_format="numpy"):  # doctest: +SKIP
    ...     train_step(batch["image"], batch["label"])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .batch import Assembler
from .dataset import Dataset
from .engine import AlignedPool
from .errors import SpecError
from .files import Catalog
from .order import permute_groups
from .plan import BatchPlan, Run

if TYPE_CHECKING:
    import ray.data

__all__ = ["StokerDatasource", "read"]

# Records per block: ~16 MiB of output, well under Ray's 128 MiB target block size, so a
# block moves through the object store in one piece and a task streams several blocks.
_BLOCK_BYTES = 16 << 20


def read(
    ds: Dataset,
    *,
    cast: Any = None,
    records_per_task: int | None = None,
    records_per_block: int | None = None,
    seed: int | None = None,
    with_index: bool = False,
    **read_args: Any,
) -> ray.data.Dataset:
    """A ``ray.data.Dataset`` of ``ds``: one row per record, one column per field.

    Args:
        ds: the stoker Dataset (its files: local paths on every node, or URLs).
        cast: one dtype or ``{field: dtype}``, as for ``ds.loader``.
        records_per_task: split groups into read tasks of at most this many records
            (None: one task per group). Every task of a compressed group inflates the
            stream from its start, so split compressed groups only when tasks are few.
        records_per_block: rows per output block (None: ~16 MiB of output).
        seed: list the read tasks in a seeded permutation (group/range-level shuffle).
        with_index: add int64 ``__group__`` and ``__index__`` columns.
        read_args: passed to ``ray.data.read_datasource`` (``concurrency``,
            ``ray_remote_args``, ...).
    """
    import ray.data

    source = StokerDatasource(
        ds,
        cast=cast,
        records_per_task=records_per_task,
        records_per_block=records_per_block,
        seed=seed,
        with_index=with_index,
    )
    return ray.data.read_datasource(source, **read_args)


def _positive(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{name}={value!r} must be a positive integer or None")
    return value


def _datasource_base() -> type:
    from ray.data import Datasource

    return Datasource


class StokerDatasource(_datasource_base()):  # type: ignore[misc]
    """A Ray Datasource reading a stoker Dataset by groups or record ranges of groups."""

    def __init__(
        self,
        ds: Dataset,
        *,
        cast: Any = None,
        records_per_task: int | None = None,
        records_per_block: int | None = None,
        seed: int | None = None,
        with_index: bool = False,
    ) -> None:
        super().__init__()
        per_task = _positive("records_per_task", records_per_task)
        per_block = _positive("records_per_block", records_per_block)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise SpecError(f"seed={seed!r} must be a non-negative integer or None")
        self._catalog: Catalog = ds._catalog
        self._dtypes = ds.output_dtypes(cast)
        for name, dtype in self._dtypes.items():
            if dtype.kind == "V":  # ml_dtypes' bfloat16: Ray would turn the column into Python objects
                how = "stored as" if ds.fields[name].dtype.kind == "V" else "cast to"
                raise SpecError(
                    f"ray: field {name!r} {how} {dtype.name}: Ray Data's Arrow blocks have no such type (the "
                    "column would become Python objects, one per value); cast to float16 or float32 here and "
                    "to bfloat16 where the batch is consumed",
                    field=name,
                )
        self._with_index = with_index
        counts = self._catalog.counts()  # settled here, once; the tasks carry them
        row_bytes = sum(self._dtypes[n].itemsize * math.prod(f.shape) for n, f in ds.fields.items())
        self._row_bytes = row_bytes + (16 if with_index else 0)
        self._per_block = per_block or max(1, _BLOCK_BYTES // max(1, self._row_bytes))
        self.ranges: list[tuple[int, int, int]] = []  # (group, first record, end)
        for g, n in enumerate(counts):
            step = per_task or max(1, n)
            self.ranges.extend((g, a, min(a + step, n)) for a in range(0, n, step))
        if seed is not None and self.ranges:
            self.ranges = [self.ranges[int(i)] for i in permute_groups(len(self.ranges), seed, 0)]

    def get_name(self) -> str:
        return "Stoker"

    def estimate_inmemory_data_size(self) -> int:
        return sum(b - a for _, a, b in self.ranges) * self._row_bytes

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[Any]:
        """One task per range; ``parallelism`` is not used (the ranges fix the tasks)."""
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        tasks = []
        for g, a, b in self.ranges:
            paths = tuple(info.path for info in self._catalog.files[g].values())
            meta = BlockMetadata(
                num_rows=b - a, size_bytes=(b - a) * self._row_bytes, exec_stats=None, input_files=paths
            )
            fn = functools.partial(_read_range, self._catalog, self._dtypes, g, a, b, self._per_block, self._with_index)
            tasks.append(ReadTask(fn, meta, per_task_row_limit=per_task_row_limit))
        return tasks


def _read_range(
    catalog: Catalog,
    dtypes: Mapping[str, np.dtype],
    group: int,
    start: int,
    stop: int,
    per_block: int,
    with_index: bool,
) -> Iterator[Any]:
    """Records ``start..stop`` of ``group`` as Arrow blocks of every field (runs in a Ray worker)."""
    from ray.data.block import BlockAccessor

    total = catalog.count(group)
    assembler = Assembler(catalog, dtypes, AlignedPool(0), batch_size=per_block, with_index=with_index)
    try:
        for i, a in enumerate(range(start, stop, per_block)):
            b = min(stop, a + per_block)
            # final=True on the group's last record: compressed streams are checked to end there.
            run = Run(group, a, b - a, 0, b == total)
            plan = BatchPlan(epoch=0, index=i, position=b, rows=b - a, runs=(run,))
            out, _ = assembler(assembler.prepare(plan))
            yield BlockAccessor.batch_to_block(out)
    finally:
        assembler.close()
