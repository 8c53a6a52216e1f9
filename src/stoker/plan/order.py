"""Record order, shards and resume points: pure, deterministic index arithmetic.

Everything here is a function of its arguments alone (no I/O, no clock, no global RNG) and
works on whole numpy arrays at a time, so the plan's Python work grows with batches, not
records. Random choices come from `numpy.random.SeedSequence` keyed by `(seed, epoch)`
and a per-purpose stream number, then from fixed uint64 arithmetic: the same arguments give
the same order on every machine and numpy version.

Positions and shards:
    An epoch is one global sequence of positions `0, 1, ..., total - 1` (after shuffling,
    position `p` names record `perm(p)`). Shard `i` of `c` takes the positions
    `p >= start` with `p % c == i` relative to `start`, i.e. `start + i + c * m` for
    `m = 0, 1, ...`. The shards of an epoch are disjoint and together cover
    `[start, total)`. With `even` sharding each shard stops after `even_length`
    records, so every shard yields the same number (the few left over are dropped).

Parts of a shard:
    Shard `(i + c * w, c * W)` is part `w` of `W` of shard `(i, c)`: it takes the shard's
    `m`-th position where `m % W == w` (a DataLoader worker of a rank). With `even` and
    `even_over=c` the trim stays the shard's: shard `(i, c)` keeps its first
    `L = even_length(total, c, start)` positions and part `w` takes those with `m < L`
    (`shard_take`), so the parts of a shard together take exactly what it would alone,
    and part `w` of every shard takes the same number.

Elastic resume:
    Data-parallel shards move in lockstep: when a shard has consumed `k` records of its
    own subsequence, so has every other shard. Then exactly the positions
    `start <= p < start + c * k` are consumed, and nothing beyond. The resume position is
    `P = start + c * k` (`resume_position`), whatever the shard's index. A new job
    with any shard count `c'` continues with shard `j` taking `P + j + c' * m`: every
    position of the epoch is then read exactly once across both jobs, no repeats, no
    skips. If shards were *not* in lockstep, resuming from the smallest `k` among them
    still skips nothing but repeats what the faster shards read beyond it.

Example:
    >>> perm = index_permutation(10, seed=7, epoch=0)
    >>> sorted(perm(np.arange(10)).tolist()) == list(range(10))
    True
    >>> shard_positions(10, (1, 3), start=2).tolist()
    [3, 6, 9]
    >>> resume_position(2, count=3, index=1, start=2)
    8
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import SpecError
from ..kernels import permute

__all__ = [
    "MAX_RECORDS",
    "Permutation",
    "validate_shard",
    "diff_fingerprint_parts",
    "even_length",
    "fingerprint",
    "index_permutation",
    "permute_groups",
    "resume_position",
    "shard_from_rank",
    "shard_length",
    "shard_positions",
    "shard_take",
    "validate_even_over",
    "window_shuffle",
]

# Positions travel as int64; 2**62 leaves headroom for `start + c * k` style sums.
MAX_RECORDS = 1 << 62
# Six rounds: a Feistel network needs at least four to look random as a permutation
# (Luby-Rackoff); two more because the half width can be as small as one bit.
ROUNDS = 6
# Independent streams of the same (seed, epoch): one per kind of random choice, so that
# e.g. the group order in "files" mode tells nothing about the global record order.
STREAM_RECORDS = 0
STREAM_GROUPS = 1
STREAM_WINDOWS = 2

_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer constants (Steele et al.)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


def _check_count(name: str, value: object, *, limit: int = MAX_RECORDS) -> int:
    """`value` as an int in `[0, limit]`, or SpecError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) <= limit:
        raise SpecError(f"{name}={value!r} must be an integer in [0, {limit}]")
    return int(value)


def _check_seed(name: str, value: object) -> int:
    """Seeds and epochs: non-negative integers of any size (what SeedSequence accepts)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise SpecError(f"{name}={value!r} must be a non-negative integer")
    return int(value)


def _round_keys(seed: int, epoch: int, stream: int) -> np.ndarray:
    """ROUNDS 64-bit round keys for one (seed, epoch, stream), from SeedSequence."""
    sequence = np.random.SeedSequence([seed, epoch], spawn_key=(stream,))
    return sequence.generate_state(ROUNDS, dtype=np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fixed, well-mixing bijection of uint64 (wraps on purpose)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@dataclass(frozen=True, slots=True)
class Permutation:
    """A seeded bijection of `[0, n)`, evaluated at any positions without an n-sized table.

    A balanced Feistel network over `[0, 2**bits)`, `bits` the smallest even width with
    `2**bits >= n` (at least 2), encrypts a position; results `>= n` are encrypted
    again (cycle walking) until they land in range, which keeps it a bijection of
    `[0, n)`. As `2**bits < 4 * n`, a lane walks fewer than four steps on average.
    Built by `index_permutation`; `stream` separates independent uses of one
    `(seed, epoch)`.

    Example:
        >>> p = Permutation(5, seed=1, epoch=2)
        >>> sorted(p(np.arange(5)).tolist())
        [0, 1, 2, 3, 4]
    """

    n: int
    seed: int
    epoch: int
    stream: int = STREAM_RECORDS
    _half: int = field(init=False, repr=False, compare=False)
    _keys: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = _check_count("n", self.n)
        seed = _check_seed("seed", self.seed)
        epoch = _check_seed("epoch", self.epoch)
        stream = _check_seed("stream", self.stream)
        bits = max(2, (n - 1).bit_length())  # n = 0, 1 still get a (trivial) 2-bit domain
        bits += bits % 2
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "epoch", epoch)
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "_half", bits // 2)
        object.__setattr__(self, "_keys", _round_keys(seed, epoch, stream))

    def __len__(self) -> int:
        return self.n

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Where each position goes: `perm(positions)`, int64, the same shape as `positions`.

        Raises:
            SpecError: a position is not an integer in `[0, n)`.
        """
        positions = np.asarray(positions)
        if positions.dtype.kind not in "iu" and positions.size:
            raise SpecError(f"positions must be integers, got dtype {positions.dtype}")
        done = permute(self._keys, self._half, self.n, positions) if positions.dtype == np.int64 else None
        if done is not None:  # compiled: the same values, one call
            out, bad = done
            if bad >= 0:
                raise self._outside(positions)
            return out
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= self.n):
            raise self._outside(positions)
        x = positions.astype(np.uint64).ravel()
        n = np.uint64(self.n)
        y = self._encrypt(x)
        # Cycle walking, vectorized: only the lanes still out of range go round again.
        lanes = np.flatnonzero(y >= n)
        while lanes.size:
            z = self._encrypt(y[lanes])
            y[lanes] = z
            lanes = lanes[z >= n]
        return y.astype(np.int64).reshape(positions.shape)

    def _outside(self, positions: np.ndarray) -> SpecError:
        return SpecError(
            f"positions must lie in [0, {self.n}); got values in [{int(positions.min())}, {int(positions.max())}]"
        )

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over `[0, 2**(2 * half))`."""
        half = np.uint64(self._half)
        mask = np.uint64((1 << self._half) - 1)
        left = x >> half
        right = x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << half) | right


def index_permutation(n: int, seed: int, epoch: int) -> Permutation:
    """The epoch's record order for "global" shuffle: position `p` reads record `perm(p)`.

    Args:
        n: records in the epoch, `0 <= n <= MAX_RECORDS`.
        seed: the user's seed (non-negative); epochs with the same seed differ by `epoch`.
        epoch: the epoch number (non-negative).

    Example:
        >>> perm = index_permutation(2**40, seed=0, epoch=0)
        >>> bool(perm(np.array([0, 1, 2**40 - 1])).max() < 2**40)
        True
    """
    return Permutation(n, seed, epoch, STREAM_RECORDS)


def permute_groups(num_groups: int, seed: int, epoch: int) -> np.ndarray:
    """The order groups are opened in for "files" shuffle: a permutation of `arange(num_groups)`.

    Drawn from its own stream, independent of `index_permutation` for the same
    seed and epoch.

    Example:
        >>> sorted(permute_groups(4, seed=3, epoch=0).tolist())
        [0, 1, 2, 3]
    """
    perm = Permutation(num_groups, seed, epoch, STREAM_GROUPS)
    return perm(np.arange(perm.n, dtype=np.int64))


def window_shuffle(num_items: int, window: int, seed: int, epoch: int) -> np.ndarray:
    """Item order shuffled only within consecutive windows of `window` items.

    Returns `order` (int64, length `num_items`): output position `k` holds item
    `order[k]`, and `order[k]` lies in the same window `k // window` (the last may be
    shorter), so no item moves `window` or more places. `window=1` keeps the order.

    Example:
        >>> order = window_shuffle(7, 3, seed=0, epoch=0)
        >>> [sorted(order[i:i + 3].tolist()) for i in range(0, 7, 3)]
        [[0, 1, 2], [3, 4, 5], [6]]
    """
    num_items = _check_count("num_items", num_items)
    seed, epoch = _check_seed("seed", seed), _check_seed("epoch", epoch)
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise SpecError(f"window={window!r} must be a positive integer")
    items = np.arange(num_items, dtype=np.int64)
    if window == 1 or num_items <= 1:
        return items
    # Distinct random keys (a permutation's values), sorted within each window: a uniform-
    # looking order per window, and no key ties to break.
    keys = Permutation(num_items, seed, epoch, STREAM_WINDOWS)(items)
    return np.lexsort((keys, items // int(window))).astype(np.int64)


def validate_shard(shard: object) -> tuple[int, int]:
    """`shard` as `(index, count)` of ints, or SpecError saying what is wrong.

    Accepts a tuple or list (a state read back from JSON holds lists) of two integers,
    not bools, with `count >= 1` and `0 <= index < count`.
    """
    message = f"shard={shard!r} must be (index, count) with 0 <= index < count"
    if not isinstance(shard, tuple | list) or len(shard) != 2:
        raise SpecError(message)
    index, count = shard
    for value in (index, count):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise SpecError(f"{message}; {value!r} is not an integer")
    index, count = int(index), int(count)
    if count < 1:
        raise SpecError(f"{message}; count must be at least 1")
    if not 0 <= index < count:
        raise SpecError(message)
    return index, count


def shard_from_rank(rank: int, world_size: int) -> tuple[int, int]:
    """The `shard` for one process of a data-parallel job: `(rank, world_size)`.

    Use the job's process rank and size, e.g. `torch.distributed.get_rank()` and
    `get_world_size()`, or `jax.process_index()` and `jax.process_count()`; each
    process then reads a disjoint `1 / world_size` of every epoch.

    Example:
        >>> shard_from_rank(3, 8)
        (3, 8)
    """
    try:
        return validate_shard((rank, world_size))
    except SpecError as e:
        e.add_note(f"from rank={rank!r}, world_size={world_size!r}: rank must be in [0, world_size)")
        raise


def shard_length(total: int, index: int, count: int, start: int = 0) -> int:
    """Positions of `[start, total)` that shard `index` of `count` takes."""
    index, count = validate_shard((index, count))
    total, start = _check_count("total", total), _check_count("start", start)
    remaining = total - start - index
    return 0 if remaining <= 0 else -(-remaining // count)


def even_length(total: int, count: int, start: int = 0) -> int:
    """Records every one of `count` shards can provide from `start`: the least shard length.

    The last shard has the fewest, `ceil((total - start - (count - 1)) / count)`, which is
    `(total - start) // count`.
    """
    _, count = validate_shard((0, count))
    total, start = _check_count("total", total), _check_count("start", start)
    return max(0, total - start) // count


def validate_even_over(shard: tuple[int, int], even_over: object) -> int | None:
    """`even_over` as the shard count evenness is computed over, or SpecError: None (the
    shard's own count) or a positive integer that divides the count of `shard`."""
    if even_over is None:
        return None
    _, count = validate_shard(shard)
    if isinstance(even_over, bool) or not isinstance(even_over, numbers.Integral) or even_over < 1:
        raise SpecError(f"even_over={even_over!r} must be a positive integer or None")
    if count % int(even_over):
        raise SpecError(f"even_over={even_over!r} must divide the shard count of shard={tuple(shard)!r}")
    return int(even_over)


def shard_take(
    total: int, shard: tuple[int, int], start: int = 0, *, even: bool = False, even_over: int | None = None
) -> int:
    """Positions of `[start, total)` that `shard` takes: all of its own without `even`.

    With `even`, shard `(j, C)` is part `w = j // n` of `W = C // n` of shard `(j % n, n)`,
    `n = even_over` (None: `C`, one part): that shard keeps its first `even_length(total, n,
    start)` positions, and part `w` takes the `m`-th of them for `m % W == w`.

    Example:
        >>> [shard_take(1001, (w, 3), even=True, even_over=1) for w in range(3)]
        [334, 334, 333]
        >>> shard_take(1001, (1, 3), even=True)
        333
    """
    index, count = validate_shard(shard)
    total, start = _check_count("total", total), _check_count("start", start)
    over = validate_even_over((index, count), even_over)
    if not even:
        return shard_length(total, index, count, start)
    over = count if over is None else over
    part, parts = index // over, count // over
    return max(0, -(-(even_length(total, over, start) - part) // parts))


def shard_positions(
    total: int, shard: tuple[int, int], start: int = 0, *, even: bool = False, even_over: int | None = None
) -> np.ndarray:
    """The epoch positions shard `(index, count)` takes from `start`, in order (int64).

    These are `start + index + count * m` below `total`; with `even` only the first
    `shard_take` of them, so every shard (with `even_over`: part `w` of every shard) yields
    the same number. Materializes one shard's positions: for slices of them, use
    `start + index + count * arange(a, b)`.
    """
    index, count = validate_shard(shard)
    length = shard_take(total, (index, count), start, even=even, even_over=even_over)
    return start + index + count * np.arange(length, dtype=np.int64)


def resume_position(consumed_by_this_shard: int, count: int, index: int, start: int) -> int:
    """Epoch position `P` to resume from: every position below it is consumed.

    Assumes lockstep data parallelism (every shard of the `count`-shard job, begun at
    `start`, consumed `consumed_by_this_shard` records), so `P = start + count * k`
    for any `index`. Shard `j` of a new job with `c'` shards continues with
    positions `P + j + c' * m`; see the module docstring.

    Example:
        >>> resume_position(5, count=4, index=2, start=0)
        20
    """
    validate_shard((index, count))
    consumed = _check_count("consumed_by_this_shard", consumed_by_this_shard)
    start = _check_count("start", start)
    position = start + count * consumed
    if position > MAX_RECORDS:
        raise SpecError(
            f"resume position {position} (start={start} + count={count} * {consumed}) is past {MAX_RECORDS}"
        )
    return position


def _canonical(value: object, where: str) -> object:
    """`value` as plain JSON types: numpy scalars and arrays, tuples and sets made plain."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, np.ndarray):
        return _canonical(value.tolist(), where)
    if isinstance(value, np.generic):
        return _canonical(value.item(), where)
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SpecError(f"fingerprint part {where} has key {k!r}; keys must be strings")
            out[k] = _canonical(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, set | frozenset):
        items = [_canonical(v, where) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    raise SpecError(f"fingerprint part {where} is a {type(value).__name__}, which has no canonical JSON form")


def _dumps(value: object, where: str) -> str:
    """Canonical JSON: sorted keys, no spaces, tuples as lists."""
    return json.dumps(_canonical(value, where), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def fingerprint(parts: Mapping[str, object]) -> str:
    """A short stable hex digest of `parts`: the first 16 hex digits of sha256 of canonical JSON.

    Equal for equal contents whatever the key order, tuple-or-list, or numpy-or-Python
    numbers, so a state saved as JSON and read back fingerprints the same.

    Example:
        >>> fingerprint({"b": (1, 2), "a": "x"}) == fingerprint({"a": "x", "b": [1, 2]})
        True
    """
    return hashlib.sha256(_dumps(parts, "parts").encode()).hexdigest()[:16]


def diff_fingerprint_parts(saved: Mapping[str, object], current: Mapping[str, object]) -> list[str]:
    """Sorted keys whose values differ (or that only one side has), to name them in errors.

    Example:
        >>> diff_fingerprint_parts({"seed": 1, "n": 5}, {"seed": 2, "n": 5, "window": 3})
        ['seed', 'window']
    """
    keys = set(saved) | set(current)
    missing = object()
    differ = []
    for key in keys:
        a, b = saved.get(key, missing), current.get(key, missing)
        if a is missing or b is missing or _dumps(a, repr(key)) != _dumps(b, repr(key)):
            differ.append(key)
    return sorted(differ)
