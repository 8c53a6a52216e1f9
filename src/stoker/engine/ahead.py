"""Remote bytes asked for ahead of the workers: the byte ranges planned batches will read from
files behind URLs, handed to the fetcher in plan order as far as its room reaches, and, once a
pass has asked for all of its own, the first ones of the loader's next pass (`NextPass`)."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator

import numpy as np

from ..errors import StokerError
from ..io.fetch import Fetcher
from ..io.files import Catalog
from ..io.remote import is_remote, pieces
from ..plan.batches import BatchPlan, Run
from ..spec import Field
from .gather import by_file

__all__ = ["FetchAhead", "NextPass", "looking_ahead"]

# Plans the look-ahead holds at most beyond the one handed on (plans reading no remote byte ask
# the fetcher for nothing, so its room alone would not bound them).
_MAX_LOOKAHEAD = 1024


def looking_ahead(
    plans: Iterator[BatchPlan], want: Callable[[BatchPlan], None], room: Callable[[], bool], *,
    asked: collections.deque[BatchPlan] | None = None, then: Callable[[], None] | None = None,
) -> Iterator[BatchPlan]:  # fmt: skip
    """`plans`, each passed to `want` before it is handed on, as many ahead as `room()` allows
    (at least the one handed on), after `asked` (plans wanted already). A planning error comes
    after the plans before it. `then` is called once every plan has been wanted."""
    waiting: collections.deque[BatchPlan] = asked if asked is not None else collections.deque()
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
        if done and then is not None:
            then()
            then = None
        if not waiting:
            break
        yield waiting.popleft()
    if error is not None:
        raise error


class _Heads:
    """The compressed streams whose head a plan stream has asked for: once per (epoch, group,
    field); a gather's once per pass."""

    __slots__ = ("epoch", "seen")

    def __init__(self) -> None:
        self.epoch = -1
        self.seen: set[tuple[int, str]] = set()


class NextPass:
    """The loader's next pass (`key`: where it starts and ends; `plans`: its plans, as the pass
    will hand them to its workers), its first plans' remote bytes asked of `fetcher` while this
    pass delivers its last batches, as far as the fetcher's room reaches.

    `open()` (this pass has asked for all of its own bytes) lets `ask()` begin; `ask()` is
    called again as batches are delivered (room comes back as they are copied). A pass that
    starts with the same key goes on from `asked` and `plans` with this fetcher; the plans are
    a pure function of the key, so it delivers what a fresh pass would.
    """

    def __init__(self, key: Hashable, plans: Iterator[BatchPlan], fetcher: Fetcher) -> None:
        self.key, self.plans, self.fetcher = key, plans, fetcher
        self.asked: collections.deque[BatchPlan] = collections.deque()  # wanted already, in order
        self.heads = _Heads()
        self.generation = -1  # the fetcher's, once open
        self.failed = False  # planning raised: the next pass plans again and meets the error itself
        self._want: Callable[[BatchPlan, _Heads], None] | None = None
        self._done = False
        self._lock = threading.Lock()

    def open(self, want: Callable[[BatchPlan, _Heads], None]) -> None:
        """This pass has asked for all of its bytes: the next pass's may follow (`want` asks for a plan's)."""
        with self._lock:
            if self._want is None:
                self.generation = self.fetcher.next_generation()
                self._want = want
        self.ask()

    def ask(self) -> None:
        """Ask for the next plans' bytes while the fetcher has room; another thread asking already: nothing."""
        if self._want is None or self._done or not self._lock.acquire(blocking=False):
            return
        try:
            while not self._done and self.fetcher.room() and len(self.asked) < _MAX_LOOKAHEAD:
                try:
                    plan = next(self.plans)
                except StopIteration:
                    self._done = True
                    break
                except Exception:  # its own pass plans again and raises it there
                    self._done = self.failed = True
                    break
                except BaseException:  # a Ctrl-C: the pass it lands in ends, and this one with it
                    self._done = self.failed = True
                    raise
                with contextlib.suppress(StokerError):  # asked for again by its read, which raises it there
                    self._want(plan, self.heads)
                self.asked.append(plan)
        finally:
            self._lock.release()

    @property
    def started(self) -> bool:
        """Whether any of its plans was asked for."""
        return bool(self.asked) or self._done


class FetchAhead:
    """Asks the fetcher for the remote bytes of planned batches before a worker reads them
    (compressed streams' heads except `seek_fields`, raw runs, gathers' coalesced stretches)."""

    def __init__(self, catalog: Catalog, fetcher: Fetcher, *, seek_fields: frozenset[str] = frozenset()) -> None:
        self.catalog = catalog
        self.fields: dict[str, Field] = dict(catalog.fields)
        self.fetcher = fetcher
        self.seek_fields = seek_fields
        self._remote = [n for n in self.fields if any(is_remote(infos[n].path) for infos in catalog.files)]

    @property
    def remote(self) -> bool:
        """Whether any field has a remote file (else there is nothing to ask for)."""
        return bool(self._remote)

    def __call__(
        self, plans: Iterator[BatchPlan], *, goes_on: NextPass | None = None, then: NextPass | None = None
    ) -> Iterator[BatchPlan]:
        """`plans`, the byte ranges they read from remote files asked of the fetcher ahead of
        the workers (stoker.io.fetch), as far as its room reaches; unchanged without remote files.

        `goes_on`: the NextPass this pass is (its first plans asked for already, `plans` the rest).
        `then`: the loader's next pass, opened once every plan of this one has been asked for.
        """
        if not self._remote:
            return plans
        heads = goes_on.heads if goes_on is not None else _Heads()
        return looking_ahead(
            plans, lambda plan: self.want(plan, heads), self.fetcher.room,
            asked=goes_on.asked if goes_on is not None else None,
            then=(lambda: then.open(self.want)) if then is not None else None,
        )  # fmt: skip

    def want(self, plan: BatchPlan, heads: _Heads) -> None:
        """Ask for the remote bytes `plan` reads, as its batch will read them: a raw run's
        records, a gather's coalesced stretches, a compressed stream's head where it opens
        (`heads`: those its plan stream has asked for)."""
        fetcher = self.fetcher
        if plan.epoch != heads.epoch:  # a stream opens once per (epoch, group, field); a gather's once per pass
            heads.epoch = plan.epoch
            if plan.gather is None:
                heads.seen = set()
        seen = heads.seen
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
                if (group, name) not in seen and name not in self.seek_fields:
                    seen.add((group, name))
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
