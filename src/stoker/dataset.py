"""The Dataset: named fields whose files pair into groups of equal record counts."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import SpecError
from .files import Catalog, FileInfo, Group
from .spec import Field, is_float, resolve_dtype

if TYPE_CHECKING:
    from .access import Subset
    from .batch import Assembler
    from .engine import Allocator
    from .fetch import Fetcher
    from .loader import Loader

__all__ = ["Dataset"]


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
        index: the persistent index (`stoker.index`): "auto" uses it where it matches
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
                included, at least 512 MiB (`stoker.machine.default_memory_budget`). The
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
        from .loader import Loader

        return Loader(
            self,
            batch_size,
            epochs=epochs,
            drop_remainder=drop_remainder,
            cycle_length=cycle_length,
            block_length=block_length,
            cast=cast,
            threads=threads,
            prefetch=prefetch,
            memory_budget=memory_budget,
            with_index=with_index,
            shuffle=shuffle,
            seed=seed,
            window=window,
            reshuffle_each_iteration=reshuffle_each_iteration,
            shard=shard,
            even=even,
            state=state,
            pad_last=pad_last,
            transform=transform,
            workers=workers,
            num_parallel_reads=num_parallel_reads,
        )

    # -- random access and subsets (see stoker.access) --------------------------------
    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Record `i` (negative counts from the end) as `{field: array of shape}`.

        Example:
            >>> ds[0]["image"].shape
            (128, 128, 1)
        """
        from .access import read_one

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
        from .access import read_records

        return read_records(self, indices, cast=cast)

    def select(self, *, groups: Any = None, records: Any = None) -> Subset:
        """A Dataset of some groups and/or records of this one; see `stoker.access.select`."""
        from .access import select

        return select(self, groups=groups, records=records)

    def split(self, fractions: Mapping[str, float], *, seed: int, by: str = "group") -> dict[str, Subset]:
        """Disjoint, complete, deterministic subsets; see `stoker.access.split`.

        A part that would hold nothing (`{"train": 0.9, "val": 0.1}` over 2 groups) is a
        SpecError naming it: split by record, or give it a larger fraction.

        Example:
            >>> parts = ds.split({"train": 0.75, "val": 0.25}, seed=0)
            >>> train = parts["train"].loader(256, shuffle="global", seed=1)
        """
        from .access import split

        return split(self, fractions, seed=seed, by=by)

    def _subset_key(self) -> str | None:
        """What distinguishes a subset in a resume fingerprint (None: the whole dataset)."""
        return None

    def _assembler(
        self, out_dtypes: Mapping[str, np.dtype], allocator: Allocator, *, batch_size: int, with_index: bool,
        fetcher: Fetcher | None = None,
    ) -> Assembler:  # fmt: skip
        from .batch import Assembler

        return Assembler(
            self._catalog, out_dtypes, allocator, batch_size=batch_size, with_index=with_index, fetcher=fetcher
        )

    # Used by adapters and the CLI; public enough to document, not part of the contract.
    def output_dtypes(self, cast: Any = None) -> dict[str, np.dtype]:
        return resolve_cast(self.fields, cast)


def resolve_cast(fields: Mapping[str, Field], cast: Any) -> dict[str, np.dtype]:
    """The dtype each field is delivered in, from `cast` (None, one dtype, or a map)."""
    out = {n: f.native_dtype for n, f in fields.items()}
    if cast is None:
        return out
    items: Sequence[tuple[str, Any]]
    if isinstance(cast, Mapping):
        unknown = [k for k in cast if k not in fields]
        if unknown:
            raise SpecError(f"cast names unknown field(s) {unknown}; fields are {list(fields)}", field=str(unknown[0]))
        items = list(cast.items())
    else:
        items = [(n, cast) for n in fields]
    for name, value in items:
        try:
            dtype = resolve_dtype(value)
        except SpecError as e:
            raise SpecError(f"cast for field {name!r}: {e}", field=name) from e
        if dtype.kind not in "biuf" and not is_float(dtype):
            raise SpecError(
                f"cast for field {name!r}: {dtype} must be a bool, integer or float dtype (or 'bfloat16')", field=name
            )
        out[name] = dtype.newbyteorder("=")
    return out
