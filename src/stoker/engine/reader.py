"""The one way records of a catalog are read: `open_reader` over a whole catalog or a view of
some of its groups and records (stoker.io.views.CatalogView).

A loader's pass, a Dataset's random access (`ds.read`, `ds[i]`) and a Ray read task all open
their reader here, so each reads through the same assembler and parts: planned batches (runs
and gathers) by `reader(reader.prepare(plan))`, records by index by `reader.read_into`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..io.files import Catalog
from ..io.views import CatalogView
from ..plan.batches import BatchPlan
from .assembler import GROUP_KEY, INDEX_KEY, Assembler, Task, build_parts
from .executor import Allocator
from .records import RecordReader

__all__ = ["Reader", "open_reader"]


class Reader(Assembler):
    """An assembler that also reads records by index (`read_into`), through a RecordReader of the
    root catalog: the one it is given (shared, kept open by its owner) or its own, made when
    first needed and closed with it. A context manager; `close()` is idempotent."""

    def __init__(
        self, catalog: Catalog, out_dtypes: Mapping[str, np.dtype], allocator: Allocator, *,
        batch_size: int, with_index: bool = False, fused: Any = None, records: RecordReader | None = None,
        **part_args: Any,
    ) -> None:  # fmt: skip
        super().__init__(
            catalog, out_dtypes, allocator, build_parts(catalog, out_dtypes, **part_args), batch_size=batch_size,
            with_index=with_index, fused=fused,
        )  # fmt: skip
        self._records = records
        self._own_records: RecordReader | None = None
        self._records_lock = threading.Lock()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def records(self) -> RecordReader:
        """The random-access reader of the root catalog (see the class docstring)."""
        if self._records is not None:
            return self._records
        with self._records_lock:
            if self._own_records is None:
                self._own_records = RecordReader(self.catalog.root())
            return self._own_records

    def read_into(self, groups: np.ndarray, records: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Records `records` of groups `groups` (of this reader's catalog, any order) into `out`."""
        self.records().read_into(*self.catalog.to_root(groups, records), out)

    def close(self) -> None:
        super().close()
        with self._records_lock:
            own, self._own_records = self._own_records, None
        if own is not None:
            own.close()


class _GroupsReader(Reader):
    """Whole groups of a view: the streaming assembler, with `__group__` named in the root."""

    catalog: CatalogView

    def __call__(self, task: Task) -> tuple[dict[str, np.ndarray], BatchPlan]:
        out, plan = super().__call__(task)
        if self.with_index:
            real = plan.rows if plan.valid is None else plan.valid
            out[GROUP_KEY][:real] = self.catalog.groups[out[GROUP_KEY][:real]]
        return out, plan


class _RecordsReader(Reader):
    """Some records of a view's groups: every planned batch read by random access (no stream turns)."""

    def prepare(self, plan: BatchPlan) -> Task:
        return Task(plan)

    def fetching_ahead(self, plans: Iterator[BatchPlan], **_: Any) -> Iterator[BatchPlan]:
        return plans  # its batches are read by random access (RecordReader), not through the fetcher

    def __call__(self, task: Task) -> tuple[dict[str, np.ndarray], BatchPlan]:
        plan = task.plan
        out = {n: self.allocator.array((plan.rows, *f.shape), self.out_dtypes[n]) for n, f in self.fields.items()}
        self.add_index_arrays(plan, out)
        if plan.gather is not None:
            groups, local = plan.gather.groups, plan.gather.index
        else:
            runs = [r for r in plan.runs if r.count]
            groups = np.concatenate([np.full(r.count, r.group, np.int64) for r in runs] or [np.zeros(0, np.int64)])
            local = np.concatenate(
                [np.arange(r.start, r.stop, r.step, dtype=np.int64) for r in runs] or [np.zeros(0, np.int64)]
            )
        root_groups, root_records = self.catalog.to_root(groups, local)
        self.records().read_into(root_groups, root_records, out)
        if self.with_index:
            out[GROUP_KEY][: len(groups)] = root_groups
            out[INDEX_KEY][: len(groups)] = root_records
        return out, plan


def open_reader(
    view: Catalog, out_dtypes: Mapping[str, np.dtype], *, allocator: Allocator, batch_size: int,
    with_index: bool = False, fused: Any = None, records: RecordReader | None = None, **part_args: Any,
) -> Reader:  # fmt: skip
    """A reader of `view` (a Catalog, or a CatalogView of some groups and records of one).

    Args:
        out_dtypes: what each field is assembled as (the cast, or a fused transform's input).
        allocator: where batches are assembled (`read_into` fills the caller's arrays).
        batch_size, with_index, fused: the assembler's (stoker.engine.assembler.Assembler).
        records: a RecordReader of the root catalog to share (None: the reader's own, if needed).
        part_args: for stoker.engine.assembler.build_parts (fetcher, counters, readahead, stop,
            seek_fields, kept_maps, kept_decoded).
    """
    kind = Reader
    if isinstance(view, CatalogView):
        kind = _GroupsReader if view.whole else _RecordsReader
    return kind(
        view, out_dtypes, allocator, batch_size=batch_size, with_index=with_index, fused=fused, records=records,
        **part_args,
    )  # fmt: skip
