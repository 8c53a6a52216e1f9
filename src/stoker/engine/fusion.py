"""Running a loader's transforms on its workers: the built-ins fused into batch assembly.

The public ops (`stoker.transforms`: `Normalize`, `Cast`, `RandomFlip`, `RandomCrop`)
say what to do to a batch; this module plans and runs them. Those at the head of the
`transform=` list are fused into batch assembly: a field they touch is read in its stored
dtype when that is exact in the delivered one. Chains the compiled kernel takes (`OnePass`:
Normalize with crops and a flip of one axis) run as the records are read from the file's
memory map, each record read once and written once (`Stage.put`, called by the assembler),
and so does a field's lone `Cast` (`LoneCast`, the `cast=` copy). Otherwise, after assembly,
each record is copied once, cast on the way, from its cropped source into its (possibly
reversed) place in the output, and elementwise ops run in place on up to 256 KiB of output
at a time while it is in cache (`Stage._direct`); where flips or crops do not commute with
the elementwise ops, the ops run one after the other on such chunks (`Stage._runs`). Every
way gives the result of calling the transforms one after the other on the unfused batch,
bit for bit. User functions after the head run on the whole batch (`Stage.run`), each with
its `batch_rng`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import reprlib
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import kernels as _compiled
from ..errors import SpecError, TransformError
from ..kernels import STREAM_MIN_BYTES, address, cast_into, cast_mapped
from ..transforms import DEFAULT_SEED, Cast, Normalize, RandomCrop, RandomFlip, Transform, batch_rng
from .executor import Stopped

if TYPE_CHECKING:
    from ..io.files import Catalog
    from ..plan.batches import BatchPlan

__all__ = ["LoneCast", "OnePass", "Stage", "Transformed", "describe_records", "first_position", "note_records"]

Batch = dict[str, np.ndarray]
Allocate = Callable[[tuple[int, ...], np.dtype], np.ndarray]

# Elementwise ops run on chunks of about this many bytes so each pass over a chunk hits the
# cache (measured: benchmarks/results/transforms_history.md).
CHUNK_BYTES = 256 << 10
# The one-pass kernel's float32 scratch when its output is narrower (a trailing Cast to 16
# bits): two compiled calls per chunk, each giving the GIL up and taking it back, so larger is
# faster here; 4 MiB keeps the scratch (one per worker, outside memory_budget) small
# (measured: benchmarks/results/transforms_history.md).
SCRATCH_BYTES = 4 << 20


# The one-pass compiled kernel (src/stoker/_kernels.c, loaded by stoker.kernels; None where no
# C compiler was found); without it the numpy path below gives the same numbers, slower.
_kernels: Any = _compiled._kernels

_KERNEL_SOURCES = {np.dtype(t): np.dtype(t).char for t in (np.int8, np.uint8, np.int16, np.uint16, np.float32)}
_KERNEL_SOURCES_F64 = {**_KERNEL_SOURCES, np.dtype(np.float64): "d"}


# 16-bit outputs the compiled row kernel narrows to as it computes (its codes: numpy's for
# float16, ml_dtypes' for bfloat16); other chains go through a float32 scratch (OnePass._narrow).
_NARROW = {"float16": "e", "bfloat16": "E"}


class OnePass:
    """A fused chain run by the compiled kernel: each record read once, written once.

    Applies to chains of crops, flips of one axis, `Normalize` ops of one dtype and at most
    one trailing `Cast`, on records of int8/uint8/int16/uint16/float32 (float64 too into
    float64), whose parameters vary at most along the axes after the flipped one (per channel,
    say). `plan` returns None for anything else, which then takes the numpy path.
    """

    def __init__(
        self,
        chain: list[tuple[int, Transform, tuple[int, ...]]],
        src: np.dtype,
        shape: tuple[int, ...],
        compute: np.dtype,
        out: np.dtype,
        layout: tuple[int, int, int, int],
        ops: list[tuple[int, int, np.ndarray, np.ndarray]],
    ) -> None:
        self.flips = [k for k, op, _ in chain if isinstance(op, RandomFlip)]
        self.crops = [(k, op) for k, op, _ in chain if isinstance(op, RandomCrop)]
        self.src, self.shape, self.compute, self.out = src, shape, compute, out
        self.outer, self.units, self.unit, self.row_axis = layout
        self.ops = ops  # (divide, vector, first, second); addresses taken per call (pickling moves them)
        self.record = chain[0][2]  # the stored record, before any crop
        strides = np.cumprod((1, *self.record[::-1]))[:-1][::-1] * src.itemsize
        self.strides = [int(s) for s in strides]

    @staticmethod
    def plan(chain: list[tuple[int, Transform, tuple[int, ...]]], src: np.dtype) -> OnePass | None:
        if _kernels is None or not chain:
            return None
        record = chain[0][2]
        norms = [op for _, op, _ in chain if isinstance(op, Normalize)]
        casts = [op for _, op, _ in chain if isinstance(op, Cast)]
        if not norms or len({n.dtype for n in norms}) != 1 or len(casts) > 1:
            return None
        compute = norms[0].dtype
        elementwise = [op for _, op, _ in chain if isinstance(op, Normalize | Cast)]
        if casts and elementwise[-1] is not casts[0]:
            return None
        out = casts[0].dtype if casts else compute
        if src not in (_KERNEL_SOURCES_F64 if compute == np.float64 else _KERNEL_SOURCES):
            return None
        axes = {op.axis for _, op, _ in chain if isinstance(op, RandomFlip)}
        if len(axes) > 1:
            return None
        shape = list(record)
        cropped: set[int] = set()
        for _, op, _ in chain:
            if isinstance(op, RandomCrop):
                for a, size in zip(op.axes, op.size, strict=True):
                    shape[a] = size
                cropped.update(a for a, size in zip(op.axes, op.size, strict=True) if size != record[a])
        if not shape or 0 in shape:
            return None
        d = len(shape)
        flip = axes.pop() if axes else None
        if flip is not None:
            if any(i in cropped for i in range(flip + 1, d)):
                return None  # the unit must be contiguous
            row = flip
        else:
            row = max(cropped, default=0)
        if any(i in cropped for i in range(1, row)):
            return None  # the rows before must be one stride apart
        outer, length = math.prod(shape[:row]), math.prod(shape[row:])
        units, unit = (shape[row], math.prod(shape[row + 1 :])) if flip is not None else (1, length)
        ops = []
        for n in norms:
            vecs = []
            for p in (n.first, n.second):
                full = np.broadcast_to(p, shape).reshape(outer, units, unit)
                if np.all(full == full.flat[0]):
                    vecs.append(np.ascontiguousarray(full.flat[0:1], compute))
                elif np.all(full == full[:1, :1]):
                    vecs.append(np.ascontiguousarray(full[0, 0], compute))
                else:
                    return None
            vector = int(len(vecs[0]) > 1 or len(vecs[1]) > 1)
            if vector:
                vecs = [np.ascontiguousarray(np.broadcast_to(v, (unit,))) for v in vecs]
            ops.append((int(n.divide), vector, vecs[0], vecs[1]))
        return OnePass(chain, src, tuple(shape), compute, out, (outer, units, unit, row), ops)

    def run(self, x: np.ndarray, y: np.ndarray, draws: Mapping[int, Any], row0: int, *, mapped: bool = False) -> bool:
        """Records `x` (rows `row0..` of the batch, any record stride) into `y`; True.

        Only the kernel reads `x`, so it may be a memory map (`mapped`, see LoneCast.run).
        """
        n = len(x)
        if n == 0:
            return True
        if x.dtype != self.src or x.shape[1:] != self.record or not x[0].flags.c_contiguous:
            raise AssertionError(f"kernel planned for {self.src} {self.record}, got {x.dtype} {x.shape}")
        if y.shape != (n, *self.shape) or not y.flags.c_contiguous or y.dtype != self.out:
            raise AssertionError(f"kernel output {self.out} {self.shape}, got {y.dtype} {y.shape}")
        rows = slice(row0, row0 + n)
        extra = None
        if self.crops:
            extra = np.zeros(n, np.int64)
            for k, op in self.crops:
                offsets = np.asarray(draws[k][rows], np.int64)
                extra += offsets @ np.asarray([self.strides[a] for a in op.axes], np.int64)
        flips = None
        if self.flips:
            mask = np.zeros(n, bool)
            for k in self.flips:
                mask ^= np.asarray(draws[k][rows], bool)
            flips = mask.view(np.uint8)
        args = tuple((divide, vector, address(p), address(q)) for divide, vector, p, q in self.ops)
        row_stride = self.strides[self.row_axis - 1] if self.row_axis else 0
        narrow = _NARROW.get(self.out.name) if self.compute == np.float32 else None
        if narrow is not None and _kernels.normalize(
            self.src.char, narrow, address(x), n, x.strides[0], 0 if extra is None else address(extra), row_stride,
            self.outer, self.units, self.unit, 0 if flips is None else address(flips), address(y), args,
            y.nbytes >= STREAM_MIN_BYTES,
        ):  # fmt: skip
            return True  # the row kernel narrowed each value in registers: no float32 scratch
        per = (
            n if self.out == self.compute else max(1, SCRATCH_BYTES // (math.prod(self.shape) * self.compute.itemsize))
        )
        scratch = None if self.out == self.compute else np.empty((min(n, per), *self.shape), self.compute)
        for a in range(0, n, per):
            b = min(n, a + per)
            dst = y[a:b] if scratch is None else scratch[: b - a]
            _kernels.normalize(
                self.src.char, self.compute.char, address(x[a:b]), b - a, x.strides[0],
                0 if extra is None else address(extra[a:b]), row_stride, self.outer, self.units, self.unit,
                0 if flips is None else address(flips[a:b]), address(dst), args,
                scratch is None and dst.nbytes >= STREAM_MIN_BYTES,  # the batch itself: streamed (see stoker.kernels)
            )  # fmt: skip
            if scratch is not None:
                self._narrow(y[a:b], dst)
        return True

    def _narrow(self, y: np.ndarray, computed: np.ndarray) -> None:
        """The float32 scratch into the output's dtype: float16 by F16C where built (numpy
        converts one value at a time);
        the scratch holds computed values, never a signalling NaN, so the two round alike.
        bfloat16 through cast_into, whose kernel loop rounds bit for bit as ml_dtypes' cast
        (which is one value at a time too)."""
        plain = (
            computed.dtype == np.float32 and y.flags.c_contiguous and computed.flags.c_contiguous
            and y.shape == computed.shape
        )  # fmt: skip
        stream = y.nbytes >= STREAM_MIN_BYTES
        if (
            plain
            and y.dtype == np.float16
            and _kernels.computed_to_float16(address(computed), computed.size, address(y), stream)
        ):
            return
        cast_into(y, computed)


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# What a wrong return is shown as: short, on one line (a batch's arrays would print thousands of lines).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxdict = 2, 40, 40, 8


def _returned(result: object) -> str:
    """What a transform returned instead of a batch, in a line: its type, and its keys or length."""
    if result is None:
        return "None"
    kind = type(result).__qualname__
    if isinstance(result, Mapping):
        wrong = {str(k)[:40]: type(v).__qualname__ for k, v in result.items() if not isinstance(v, np.ndarray)}
        return f"a {kind} whose values are not all numpy arrays ({_REPR.repr(wrong)})"
    if isinstance(result, np.ndarray):
        return f"a numpy array of shape {result.shape}"
    if isinstance(result, list | tuple):
        return f"a {kind} of {len(result)} items"
    return f"a {kind} ({_REPR.repr(result)})"


def describe_records(plan: BatchPlan, catalog: Catalog, limit: int = 8) -> str:
    """`(group, index)` ranges of a planned batch, with the file of each group's first field."""
    first_field = next(iter(catalog.fields))
    spans: list[tuple[int, str]] = []
    if plan.gather is not None:
        groups, index = plan.gather.groups, plan.gather.index
        for g in np.unique(groups).tolist():
            mine = index[groups == g]
            spans.append((g, f"{len(mine)} records within {int(mine.min())}..{int(mine.max())}"))
    else:
        for run in plan.runs:
            if run.count:
                step = f" step {run.step}" if run.step != 1 and run.count > 1 else ""
                spans.append((run.group, f"records {run.start}..{run.stop - 1}{step}"))
    parts = [f"group {g} ({catalog.files[g][first_field].path}) {what}" for g, what in spans[:limit]]
    if len(spans) > limit:
        parts.append(f"... {len(spans) - limit} more")
    return "; ".join(parts) or "no records"


def first_position(plan: BatchPlan, shard: tuple[int, int]) -> int:
    """Position of the batch's first record in the epoch's global sequence.

    `plan.position` is where this shard resumes after the batch: the shard takes positions
    `start + i, start + i + c, ...`, so the batch began `c * rows` positions earlier, at
    this shard's offset `i`. With `pad_last` only `valid` rows are records, and the last
    batches of an epoch resume at its end: their number is then derived from that end, still
    the same on every run and resume.
    """
    i, c = shard
    real = plan.rows if plan.valid is None else plan.valid
    return plan.position - c * real + i


def _exact_in(src: np.dtype, dst: np.dtype) -> bool:
    """Whether every value of `src` is exact in `dst`: numpy's "safe" casts, less 64-bit
    integers into float64 (which numpy calls safe, but which round past 2**53)."""
    if not np.can_cast(src, dst, "safe"):
        return False
    if src.kind in "iu" and dst.kind == "f":
        return src.itemsize * 8 - (src.kind == "i") <= np.finfo(dst).nmant + 1
    return True


class LoneCast:
    """A field's chain that is one `Cast` of records read in their stored dtype: cast as
    they are read (the `cast=` path, the compiled kernel's loops), not read then cast, which
    saves writing and reading a float32 copy (measured: benchmarks/results/transforms_history.md)."""

    def __init__(self, src: np.dtype, out: np.dtype) -> None:
        self.src, self.out = src, out

    def run(self, x: np.ndarray, y: np.ndarray, draws: Mapping[int, Any], row0: int, *, mapped: bool = False) -> bool:
        """Records `x` (rows `row0..` of the batch) cast into `y`; True once done.

        `mapped`: `x` is a memory map of a file, which only a compiled kernel may read (its
        reads are guarded against the file being cut short); False, nothing read, where numpy would.
        """
        if mapped:
            return cast_mapped(y, x)
        cast_into(y, x)
        return True


class Stage:
    """A loader's transforms bound to its seed and shard; runs one batch on a worker.

    Picklable (built-ins and module-level functions), so process workers run the same code.
    """

    def __init__(
        self,
        transforms: Any,
        *,
        seed: int | None,
        shard: tuple[int, int],
        records: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        stored: Mapping[str, np.dtype],
    ) -> None:
        fns = list(transforms) if isinstance(transforms, list | tuple) else [transforms]
        if not fns:
            raise SpecError("transform= an empty list: pass None for no transform")
        for fn in fns:
            if not callable(fn):
                raise SpecError(f"transform {fn!r} is not callable; expected fn(batch, rng) -> dict")
        self.transforms = fns
        self.seed = DEFAULT_SEED if seed is None else int(seed)
        self.shard = shard
        self.head = 0  # how many leading built-ins are fused
        while self.head < len(fns) and isinstance(fns[self.head], Transform):
            self.head += 1
        shapes = {n: (tuple(s), np.dtype(d)) for n, (s, d) in records.items()}
        # Per field touched by the fused head: the ops in order and the record they see.
        self.chains: dict[str, list[tuple[int, Transform, tuple[int, ...]]]] = {}
        for k in range(self.head):
            op = fns[k]
            assert isinstance(op, Transform)
            for name in op.fields:
                if name not in shapes:
                    raise SpecError(f"transform {k} {op!r} names field {name!r}; fields are {list(shapes)}", field=name)
                shape, dtype = shapes[name]
                self.chains.setdefault(name, []).append((k, op, shape))
                shapes[name] = op.record(name, shape, dtype)
        self.records = shapes  # what the head delivers (user functions may change it further)
        self.direct = {name for name, chain in self.chains.items() if self._commutes(chain)}
        # A fused field is read in its stored dtype when every stored value is exact in the
        # dtype the loader would deliver (int8 -> float32, say): the ops then see the same numbers.
        self.assembly = {n: records[n][1] for n in records}
        for name in self.chains:
            src = stored.get(name)
            if src is not None and _exact_in(np.dtype(src), np.dtype(records[name][1])):
                self.assembly[name] = np.dtype(src)
        self.exact = all(isinstance(fn, Transform) for fn in fns)
        # Fields whose chain the compiled kernel runs in one pass (see OnePass), or whose one
        # Cast is done as the records are read (LoneCast).
        self.kernels: dict[str, OnePass | LoneCast] = {}
        for name in self.direct:
            chain = self.chains[name]
            one: OnePass | LoneCast | None
            if len(chain) == 1 and isinstance(chain[0][1], Cast):
                one = LoneCast(self.assembly[name], chain[0][1].dtype)
            else:
                one = OnePass.plan(chain, self.assembly[name])
            if one is not None:
                self.kernels[name] = one

    def record_fields(self, fields: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Fields the assembler may transform as it reads them: the delivered (shape, dtype) of each.

        Those the compiled kernel runs whose records are read in their stored dtype.
        """
        return {
            name: self.records[name]
            for name, one in self.kernels.items()
            if name in fields and np.dtype(fields[name].dtype) == one.src
        }

    def draws(self, plan: BatchPlan) -> dict[int, Any]:
        """Every fused transform's random parameters for the batch `plan`."""
        first = first_position(plan, self.shard)
        draws: dict[int, Any] = {}
        for chain in self.chains.values():
            for k, op, shape in chain:
                if k not in draws:
                    draws[k] = op.draw(batch_rng(self.seed, plan.epoch, first, k), plan.rows, shape)
        return draws

    def put(
        self, name: str, src: np.ndarray, dst: np.ndarray, row: int, *, draws: Mapping[int, Any], mapped: bool = False
    ) -> bool:
        """Stored records `src` (rows `row..` of the batch) transformed into `dst` (called by
        assembly); True once done. With `mapped` (`src` is a memory map), False, nothing
        read, where numpy would read it: the caller copies the records out and puts them again."""
        return self.kernels[name].run(src, dst, draws, row, mapped=mapped)

    def run(
        self, batch: Mapping[str, np.ndarray], plan: BatchPlan, allocate: Allocate, done: Collection[str] = ()
    ) -> Batch:
        """The transformed batch; errors carry a note naming the transform and the batch.

        Fields in `done` were transformed by the assembly (`put`) and are passed on as they are.
        """
        first = first_position(plan, self.shard)
        out = dict(batch)
        k = 0
        try:
            draws: dict[int, Any] = {}
            if any(name not in done for name in self.chains):
                draws = self.draws(plan)
            for name, chain in self.chains.items():
                if name not in done:
                    out[name] = self._fused(batch[name], name, chain, draws, allocate)
            for k in range(self.head, len(self.transforms)):
                fn = self.transforms[k]
                result = fn(out, batch_rng(self.seed, plan.epoch, first, k))
                if not isinstance(result, Mapping) or not all(isinstance(v, np.ndarray) for v in result.values()):
                    raise TransformError(
                        f"transform {k} ({_name(fn)}) returned {_returned(result)} on batch {plan.index} of epoch "
                        f"{plan.epoch} (first record at position {first} of the epoch's sequence); a transform "
                        "returns the batch: a dict of field name -> numpy array"
                    )
                out = dict(result)
        except TransformError:
            raise  # says all of the note below, and keeps it across a process worker's pickling
        except BaseException as e:
            e.add_note(
                f"stoker: in transform {k} ({_name(self.transforms[k])}) on batch {plan.index} of epoch "
                f"{plan.epoch} (first record at position {first} of the epoch's sequence)"
            )
            raise
        return out

    def _fused(
        self,
        x: np.ndarray,
        name: str,
        chain: list[tuple[int, Transform, tuple[int, ...]]],
        draws: Mapping[int, Any],
        allocate: Allocate,
    ) -> np.ndarray:
        shape, dtype = self.records[name]
        n = len(x)
        y = allocate((n, *shape), dtype)
        one = self.kernels.get(name)
        if one is not None and x.dtype == one.src and n and x[0].flags.c_contiguous:
            one.run(x, y, draws, 0)
            return y
        per = max(1, CHUNK_BYTES // max(1, math.prod(shape) * max(dtype.itemsize, 4)))
        if name in self.direct:
            self._direct(x, y, chain, draws, per)
            return y
        last = len(chain) - 1
        for a in range(0, n, per):
            rows = slice(a, min(n, a + per))
            cur = x[rows]
            for i, (k, op, _) in enumerate(chain):
                cur = op.apply(cur, draws[k], rows, y[rows] if i == last else None)
        return y

    def _direct(
        self,
        x: np.ndarray,
        y: np.ndarray,
        chain: list[tuple[int, Transform, tuple[int, ...]]],
        draws: Mapping[int, Any],
        per: int,
    ) -> None:
        """Crops as views of the source, flips as views of the output, one casting copy between.

        Used when flips and crops commute with the chain's elementwise ops (see `_commutes`).
        Each record is copied once, cast on the way, from its cropped source into its
        (possibly reversed) place in the output; the elementwise ops then run in place on
        `per` records at a time while they are in cache. Writing through a reversed view costs
        less than reading through one or reversing the rows in place first (measured:
        benchmarks/results/transforms_history.md).
        """
        n = len(x)
        views = [(k, op) for k, op, _ in chain if isinstance(op, RandomFlip | RandomCrop)]
        ops = [op for _, op, _ in chain if not isinstance(op, RandomFlip | RandomCrop)]
        inplace = all(isinstance(op, Normalize) and op.dtype == y.dtype for op in ops) or (
            len(ops) == 1 and isinstance(ops[0], Cast) and ops[0].dtype == y.dtype
        )
        if not inplace:  # e.g. Normalize then Cast to 16 bits: op after op on each run of rows
            self._runs(x, y, chain, draws, per)
            return
        norms = [op for op in ops if isinstance(op, Normalize)]
        for a in range(0, n, per):
            b = min(n, a + per)
            if not views:
                cast_into(y[a:b], x[a:b])
            for j in range(a, b) if views else ():
                src, dst = x[j], y[j]
                for k, op in views:
                    if isinstance(op, RandomCrop):
                        src = src[op.window(draws[k][j], src.ndim)]
                    elif isinstance(op, RandomFlip) and draws[k][j]:
                        dst = dst[op.reverse[1:]]
                cast_into(dst, src)
            for norm in norms:
                norm.inplace(y[a:b])

    def _runs(
        self,
        x: np.ndarray,
        y: np.ndarray,
        chain: list[tuple[int, Transform, tuple[int, ...]]],
        draws: Mapping[int, Any],
        per: int,
    ) -> None:
        """Runs of rows with the same crops and flips, each op applied in turn (see `_direct`)."""
        n = len(x)
        views: list[tuple[int, Transform]] = [(k, op) for k, op, _ in chain if isinstance(op, RandomFlip | RandomCrop)]
        ops = [(k, op) for k, op, _ in chain if not isinstance(op, RandomFlip | RandomCrop)]
        cuts = {0, n}
        for k, _ in views:
            p = np.asarray(draws[k]).reshape(n, -1)
            cuts.update((np.flatnonzero(np.any(p[1:] != p[:-1], axis=1)) + 1).tolist())
        edges = sorted(cuts)
        for lo, hi in itertools.pairwise(edges):
            for a in range(lo, hi, per):
                rows = slice(a, min(hi, a + per))
                src, dst = x[rows], y[rows]
                for k, op in views:
                    if isinstance(op, RandomCrop):
                        src = src[op.window(draws[k][a], src.ndim - 1, batch=True)]
                    elif isinstance(op, RandomFlip) and draws[k][a]:
                        dst = dst[op.reverse]
                cur = src
                for i, (k, op) in enumerate(ops):
                    cur = op.apply(cur, draws.get(k), rows, dst if i == len(ops) - 1 else None)

    def _commutes(self, chain: list[tuple[int, Transform, tuple[int, ...]]]) -> bool:
        """Whether crops can move to the front and flips to the end of `chain` unchanged."""
        axes: set[int] = set()
        flipped: set[int] = set()
        for _, op, _ in chain:
            if isinstance(op, RandomCrop):
                if flipped & set(op.axes):  # a crop of a flipped axis picks another window
                    return False
                axes.update(op.axes)
            elif isinstance(op, RandomFlip):
                axes.add(op.axis)
                flipped.add(op.axis)
            elif not isinstance(op, Normalize | Cast):
                return False
        return all(op.constant_along(sorted(axes), len(shape)) for _, op, shape in chain if isinstance(op, Normalize))

    def bind(
        self, assemble: Callable[[Any], tuple[Batch, BatchPlan]], allocate: Allocate, catalog: Catalog
    ) -> Transformed:
        """Assembly then this stage, as one function for worker threads."""
        return Transformed(assemble, self, allocate, catalog)

    def light(self, plan: BatchPlan) -> BatchPlan:
        """The plan without its index arrays: all a remote worker needs to run the stage."""
        return dataclasses.replace(plan, runs=(), gather=None)


def note_records(e: BaseException, plan: BatchPlan, catalog: Catalog) -> None:
    """Say which batch and which records a transform failed on."""
    e.add_note(f"stoker: batch {plan.index} of epoch {plan.epoch} holds {describe_records(plan, catalog)}")


class Transformed:
    """Assembly then the transform stage, on one worker thread (the thread executor's function)."""

    def __init__(
        self, assemble: Callable[[Any], tuple[Batch, BatchPlan]], stage: Stage, allocate: Allocate, catalog: Catalog
    ) -> None:
        self.assemble = assemble
        self.stage = stage
        self.allocate = allocate
        self.catalog = catalog

    def __call__(self, task: Any) -> tuple[Batch, BatchPlan]:
        batch, plan = self.assemble(task)
        try:
            return self.stage.run(batch, plan, self.allocate, getattr(task, "fused", ())), plan
        except Stopped:
            raise
        except BaseException as e:
            note_records(e, plan, self.catalog)
            raise
