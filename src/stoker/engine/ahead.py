"""Remote bytes asked for ahead of the workers: the byte ranges planned batches will read from
files behind URLs, handed to the fetcher in plan order as far as its room reaches."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import StokerError
from ..io.fetch import Fetcher
from ..io.files import Catalog
from ..io.remote import is_remote, pieces
from ..plan.batches import BatchPlan, Run
from ..spec import Field
from .gather import by_file

__all__ = ["FetchAhead", "looking_ahead"]

# Plans the look-ahead holds at most beyond the one handed on (plans reading no remote byte ask
# the fetcher for nothing, so its room alone would not bound them).
_MAX_LOOKAHEAD = 1024


def looking_ahead(
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


class FetchAhead:
    """Asks the fetcher for the remote bytes of planned batches before a worker reads them
    (compressed streams' heads except `seek_fields`, raw runs, gathers' coalesced stretches)."""

    def __init__(self, catalog: Catalog, fetcher: Fetcher, *, seek_fields: frozenset[str] = frozenset()) -> None:
        self.catalog = catalog
        self.fields: dict[str, Field] = dict(catalog.fields)
        self.fetcher = fetcher
        self.seek_fields = seek_fields
        self._remote = [n for n in self.fields if any(is_remote(infos[n].path) for infos in catalog.files)]
        self._heads: tuple[int, set[tuple[int, str]]] = (-1, set())  # streams whose head was asked for

    def __call__(self, plans: Iterator[BatchPlan]) -> Iterator[BatchPlan]:
        """`plans`, the byte ranges they read from remote files asked of the fetcher ahead of
        the workers (stoker.io.fetch), as far as its room reaches; unchanged without remote files."""
        if not self._remote:
            return plans
        return looking_ahead(plans, self._want, self.fetcher.room)

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
            _, groups, index, spans = by_file(plan.gather)
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
                    fetcher.want_stream(
                        info.path, spec.storage_options, size=info.size, field=name, version=info.version
                    )
            elif isinstance(what, Run):
                start = spec.header_bytes + what.start * rb
                end = min(info.size, spec.header_bytes + what.stop * rb)
                if what.count:
                    fetcher.want(
                        info.path, spec.storage_options, start, end, size=info.size, field=name, version=info.version
                    )
            else:
                for a, b in pieces(what, rb, spec.header_bytes, fetcher.part_bytes):
                    if b <= info.size:
                        fetcher.want(
                            info.path, spec.storage_options, a, b, size=info.size, field=name, version=info.version
                        )
