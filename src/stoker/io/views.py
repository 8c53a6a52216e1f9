"""A catalog seen through a subset: some of the root's groups, and per group all its records or some."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .files import Catalog, Inspected

__all__ = ["CatalogView"]


class CatalogView(Catalog):
    """Groups `groups` of `root` (numbered 0.. in the order given) and, per group, all its records
    (None) or the records `records[v]` of the file (sorted). Its files, counts and seek points are
    the root's: a count the view settles is settled in the root too.
    """

    def __init__(self, root: Catalog, groups: np.ndarray, records: Sequence[np.ndarray | None]) -> None:
        groups = np.asarray(groups, np.int64)
        super().__init__(
            root.fields, index_dir=root.index_dir,
            inspected=Inspected(
                files=[root.files[int(g)] for g in groups],
                counts=[None] * len(groups),  # asked of the root (see count)
                seek_points={
                    (v, name): root.seek_points[(int(g), name)]
                    for v, g in enumerate(groups) for name in root.fields if (int(g), name) in root.seek_points
                },
                index_pins=root.index_pins,
            ),
        )  # fmt: skip
        self.groups = groups
        self.records = list(records)
        self._root = root

    @property
    def whole(self) -> bool:
        """Whether every group is read whole (a stream from start to end), no record selected."""
        return all(r is None for r in self.records)

    def count(self, g: int) -> int:
        selected = self.records[g]
        return len(selected) if selected is not None else self._root.count(int(self.groups[g]))

    def settled(self) -> bool:
        return all(r is not None for r in self.records) or self._root.settled()

    def root(self) -> Catalog:
        return self._root

    def to_root(self, groups: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(group, record) of this view as (group, record in the file) of the root catalog."""
        root_records = records.copy()
        order = np.argsort(groups, kind="stable")
        bounds = np.flatnonzero(np.diff(groups[order])) + 1
        for part in np.split(order, bounds) if len(order) else []:
            selected = self.records[int(groups[part[0]])]
            if selected is not None:
                root_records[part] = selected[records[part]]
        return self.groups[groups], root_records
