"""Pure planning: epoch order, rank x worker partition, padding, and resume math.

Vocabulary:
- *position*: an index into the epoch order (``order[position]`` is the file index).
- *pool*: what an epoch still has to deliver, as sorted disjoint half-open ranges of positions.
  A fresh epoch's pool is ``[(0, n)]``; after a resume it is whatever was not yet delivered.
- *stream*: one (rank, worker) pair. Streams are numbered ``rank * num_workers + worker``.

Every rank gets the same number of items when ``world_size > 1`` (``"pad"`` repeats items from
the start of the pool, ``"drop"`` leaves the remainder out), so collective ops cannot hang on an
uneven last step. Within a rank, workers get contiguous runs whose sizes are multiples of the
batch size (``quantum``) wherever possible, so a DataLoader emits only one short batch per rank.
Nothing here does I/O; everything is tested exhaustively.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import ResumeOrderError

Range = tuple[int, int]
Ranges = list[Range]
PARTITION_MODES = ("pad", "drop")


# ---------------------------------------------------------------- range arithmetic

def ranges_len(rs: Iterable[Range]) -> int:
    return sum(b - a for a, b in rs)


def normalize(rs: Iterable[Range]) -> Ranges:
    """Sort, drop empties and merge overlapping/adjacent ranges."""
    out: Ranges = []
    for a, b in sorted((int(a), int(b)) for a, b in rs if b > a):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def subtract(rs: Iterable[Range], minus: Iterable[Range]) -> Ranges:
    """``rs`` without the positions in ``minus`` (both as ranges)."""
    out: Ranges = []
    cut = normalize(minus)
    for a, b in normalize(rs):
        cur = a
        for c, d in cut:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out


def take(pool: Sequence[Range], start: int, stop: int) -> Ranges:
    """Positions ``start..stop`` (pool indices, no wrap) of the concatenated pool, as ranges."""
    out: Ranges = []
    offset = 0
    for a, b in pool:
        n = b - a
        lo, hi = max(start - offset, 0), min(stop - offset, n)
        if lo < hi:
            out.append((a + lo, a + hi))
        offset += n
        if offset >= stop:
            break
    return out


def take_wrapped(pool: Sequence[Range], start: int, stop: int) -> Ranges:
    """Like :func:`take` but pool indices past the end wrap to the start (padding); keeps order."""
    m = ranges_len(pool)
    out: Ranges = []
    if m == 0:
        return out
    while start < stop:
        base = (start // m) * m
        lo, hi = start - base, min(stop - base, m)
        out.extend(take(pool, lo, hi))
        start = base + hi
    return out


def positions(rs: Iterable[Range]) -> np.ndarray:
    """Expand ranges into an int64 array of positions (in range order)."""
    parts = [np.arange(a, b, dtype=np.int64) for a, b in rs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# ---------------------------------------------------------------- splitting

def split_counts(total: int, parts: int, quantum: int = 1) -> list[int]:
    """Split ``total`` into ``parts`` contiguous sizes, as even as possible in units of ``quantum``.

    Whole quanta (batches) are dealt first; the leftover partial quantum goes to the part that
    a round-robin consumer visits right after the last whole one, so it is delivered last.
    """
    if parts <= 0:
        raise ValueError("parts must be >= 1")
    q = max(1, int(quantum))
    full, rest = divmod(total, q)
    per, extra = divmod(full, parts)
    sizes = [(per + (1 if i < extra else 0)) * q for i in range(parts)]
    if rest:
        sizes[extra % parts] += rest
    return sizes


def per_rank(total: int, world_size: int, mode: str = "pad") -> int:
    """Items each rank receives: ``ceil`` with padding, ``floor`` when dropping; ``total`` for one rank."""
    if mode not in PARTITION_MODES:
        raise ValueError(f"partition must be one of {PARTITION_MODES}, got {mode!r}")
    if world_size <= 1:
        return total
    return -(-total // world_size) if mode == "pad" else total // world_size


def stream_spans(total: int, world_size: int, num_workers: int, mode: str = "pad", quantum: int = 1) -> list[Range]:
    """``(start, stop)`` in *virtual* pool indices for every stream (may run past ``total``: padding)."""
    w = max(1, num_workers)
    c = per_rank(total, world_size, mode)
    spans: list[Range] = []
    for r in range(max(1, world_size)):
        start = r * c
        for size in split_counts(c, w, quantum):
            spans.append((start, start + size))
            start += size
    return spans


def stream_positions(pool: Sequence[Range], world_size: int, rank: int, num_workers: int, worker: int,
                     mode: str = "pad", quantum: int = 1) -> Ranges:
    """The epoch positions, in delivery order, of stream (rank, worker) for this pool."""
    total = ranges_len(pool)
    spans = stream_spans(total, world_size, num_workers, mode, quantum)
    a, b = spans[rank * max(1, num_workers) + worker]
    return take_wrapped(pool, a, b)


def stream_rest(pool: Sequence[Range], world_size: int, rank: int, num_workers: int, worker: int, mode: str,
                quantum: int, delivered: int) -> Ranges:
    """The positions stream (rank, worker) has left after delivering its first ``delivered``: the resume
    of one stream on the layout it was saved on (a worker's own state under torchdata's StatefulDataLoader)."""
    mine = stream_positions(pool, world_size, rank, num_workers, worker, mode, quantum)
    return take(mine, max(0, int(delivered)), ranges_len(mine))


def rank_batches(total: int, world_size: int, rank: int, num_workers: int, mode: str, quantum: int,
                 batch_size: int | None, drop_last: bool = False) -> int:
    """Batches rank ``rank`` delivers in an epoch of ``total`` items split over ``num_workers`` streams:
    the loader's length, the same before and after a resume (torchdata's ``len()`` never changes)."""
    spans = stream_spans(total, world_size, num_workers, mode, quantum)
    w = max(1, num_workers)
    return sum(batches_per_stream([b - a for a, b in spans[rank * w:(rank + 1) * w]], batch_size, drop_last))


# ---------------------------------------------------------------- epoch order

def node_blocks(total: int, world_size: int, local_world_size: int, mode: str = "pad") -> list[Range]:
    """Contiguous blocks of positions owned by each node (ranks are node-major)."""
    nodes = max(1, world_size // max(1, local_world_size))
    c = per_rank(total, world_size, mode) * max(1, local_world_size)
    blocks = []
    for k in range(nodes):
        a = min(k * c, total)
        b = total if k == nodes - 1 else min((k + 1) * c, total)
        blocks.append((a, b))
    return blocks


def epoch_order(n: int, *, seed: int = 0, epoch: int = 0, shuffle: bool | str = False,
                blocks: Sequence[Range] | None = None, reshuffle_every: int | None = None) -> np.ndarray:
    """File index at each position of the epoch.

    ``shuffle=False``: listing order. ``True`` or ``"global"``: one seeded permutation of all files
    per epoch. ``"node"``: each block of positions (one node's share, see :func:`node_blocks`) holds
    the same contiguous slice of the listing every epoch, permuted within itself, so a node keeps its
    files and its cache stays hot; with ``reshuffle_every=N`` the slices rotate one node onward
    every N epochs. Identical on every rank.
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    if shuffle == "node" and blocks and len(blocks) > 1:
        order = np.empty(n, dtype=np.int64)
        stride = blocks[0][1] - blocks[0][0]
        rotation = epoch // reshuffle_every if reshuffle_every else 0
        shift = (rotation * stride) % n if n else 0
        for k, (a, b) in enumerate(blocks):
            rng = np.random.default_rng([int(seed), int(epoch), k, 0x5EED])
            order[a:b] = (a + shift + rng.permutation(b - a)) % n
        return order
    rng = np.random.default_rng([int(seed), int(epoch), 0x5EED])
    return rng.permutation(n).astype(np.int64)


# ---------------------------------------------------------------- delivery and resume

def batches_per_stream(lengths: Sequence[int], batch_size: int | None, drop_last: bool = False) -> list[int]:
    b = max(1, batch_size or 1)
    return [n // b if drop_last else -(-n // b) for n in lengths]


def round_robin_taken(batches: Sequence[int], delivered: int) -> list[int]:
    """Batches taken from each stream after ``delivered`` round-robin steps over non-exhausted streams.

    This is how a DataLoader with workers interleaves an IterableDataset's worker streams.
    """
    taken = [0] * len(batches)
    left = int(delivered)
    active = [i for i, b in enumerate(batches) if b > 0]
    while left > 0 and active:
        smallest = min(batches[i] - taken[i] for i in active)
        full_rounds = min(smallest, left // len(active))
        if full_rounds:
            for i in active:
                taken[i] += full_rounds
            left -= full_rounds * len(active)
        else:
            for i in active:
                if left == 0:
                    break
                taken[i] += 1
                left -= 1
        active = [i for i in active if taken[i] < batches[i]]
    return taken


def items_delivered(lengths: Sequence[int], batch_size: int | None, drop_last: bool,
                    batches_delivered: int) -> list[int]:
    """Items delivered from each worker stream of one rank after ``batches_delivered`` batches."""
    b = max(1, batch_size or 1)
    taken = round_robin_taken(batches_per_stream(lengths, batch_size, drop_last), batches_delivered)
    return [min(n, t * b) for n, t in zip(lengths, taken)]


def remaining_pool(pool: Sequence[Range], world_size: int, num_workers: int, mode: str, quantum: int,
                   delivered: Sequence[int]) -> Ranges:
    """What is left of ``pool`` once stream ``s`` delivered its first ``delivered[s]`` items.

    Left = positions assigned to some stream minus positions delivered by any stream (a padded
    duplicate delivered once counts as delivered). The result is a new pool for any layout.
    """
    total = ranges_len(pool)
    spans = stream_spans(total, world_size, num_workers, mode, quantum)
    if len(delivered) != len(spans):
        raise ValueError(f"expected {len(spans)} delivered counts (world_size x num_workers), got {len(delivered)}")
    assigned: Ranges = []
    done: Ranges = []
    for (a, b), d in zip(spans, delivered):
        assigned.extend(take_wrapped(pool, a, b))
        done.extend(take_wrapped(pool, a, a + min(int(d), b - a)))
    return subtract(assigned, done)


# ---------------------------------------------------------------- array-free epoch order (Feistel)
#
# A keyed bijection over [0, n) evaluated for any positions on demand: a balanced Feistel network
# on the smallest even number of bits covering n, with cycle-walking (re-encrypt until the value
# falls below n; the domain is under 4n, so a value walks ~2 times on average). Vectorised over
# numpy uint64 arrays, so a process computes the part of an epoch it delivers, chunk by chunk, and
# never holds an n-element permutation. Keys come from numpy's SeedSequence over
# (seed, epoch, block, salt): identical on every platform, process and numpy version.

ORDER_VERSION = 2  # 1: numpy permutation arrays (epoch_order); 2: Feistel bijection (order_at)
FEISTEL_ROUNDS = 6
DEFAULT_CHUNK = 1 << 16
_U64 = (1 << 64) - 1
_SALT = 0xFE15_7E1


def _feistel_keys(seed: int, epoch: int, block: int) -> np.ndarray:
    ss = np.random.SeedSequence([int(seed) & _U64, int(epoch) & _U64, int(block) & _U64, _SALT])
    return ss.generate_state(FEISTEL_ROUNDS, dtype=np.uint64)


def _mix(x: np.ndarray) -> np.ndarray:
    """The 64-bit finaliser of MurmurHash3 (a bijective avalanche), elementwise."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    out: np.ndarray = x ^ (x >> np.uint64(33))
    return out


def _encrypt(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    h = np.uint64(half)
    left, right = x >> h, x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    out: np.ndarray = (left << h) | right
    return out


def permute(n: int, seed: int, epoch: int, positions: np.ndarray, *, block: int = 0) -> np.ndarray:
    """``perm[positions]`` for the seeded permutation ``perm`` of ``[0, n)`` of ``(seed, epoch, block)``.

    A bijection for every ``n`` (0 and 1 included); the same on every process and platform. Costs
    O(len(positions)) time and memory, independent of ``n``.
    """
    pos: np.ndarray = np.asarray(positions, dtype=np.int64).reshape(-1)
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    if n <= 1 or pos.size == 0:
        return np.array(pos)  # a copy
    half = max(1, ((int(n) - 1).bit_length() + 1) // 2)
    keys = _feistel_keys(seed, epoch, block)
    y = _encrypt(pos.astype(np.uint64), keys, half)
    limit = np.uint64(n)
    out = y >= limit
    while out.any():  # cycle-walking: the domain is [0, 4^half) and 4^half < 4n
        idx = np.flatnonzero(out)
        y[idx] = _encrypt(y[idx], keys, half)
        out[idx] = y[idx] >= limit
    return y.astype(np.int64)


def order_at(n: int, positions: np.ndarray, *, seed: int = 0, epoch: int = 0, shuffle: bool | str = False,
             blocks: Sequence[Range] | None = None, reshuffle_every: int | None = None) -> np.ndarray:
    """File index at each of ``positions`` of the epoch order (version :data:`ORDER_VERSION`).

    The modes mean what they mean in :func:`epoch_order` -- ``False``: listing order; ``True`` or
    ``"global"``: one seeded permutation of all files per epoch; ``"node"`` with ``blocks`` (see
    :func:`node_blocks`): block ``k`` holds the same contiguous slice of the listing every epoch (one
    node onward every ``reshuffle_every`` epochs), permuted within itself -- but the permutations
    are Feistel bijections computed for ``positions`` only, so no process holds an n-element array.
    """
    pos: np.ndarray = np.asarray(positions, dtype=np.int64).reshape(-1)
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    if not shuffle:
        return np.array(pos)  # a copy
    if shuffle == "node" and blocks and len(blocks) > 1:
        out = np.empty_like(pos)
        stride = blocks[0][1] - blocks[0][0]
        rotation = epoch // reshuffle_every if reshuffle_every else 0
        shift = (rotation * stride) % n if n else 0
        starts = np.array([a for a, _ in blocks], dtype=np.int64)
        which = np.searchsorted(starts, pos, side="right") - 1
        for k in np.unique(which):
            a, b = blocks[int(k)]
            sel = which == k
            local = permute(b - a, seed, epoch, pos[sel] - a, block=int(k) + 1)
            out[sel] = (a + shift + local) % n
        return out
    return permute(n, seed, epoch, pos)


def order_chunks(n: int, ranges: Iterable[Range], *, seed: int = 0, epoch: int = 0, shuffle: bool | str = False,
                 blocks: Sequence[Range] | None = None, reshuffle_every: int | None = None,
                 chunk: int = DEFAULT_CHUNK) -> Iterator[np.ndarray]:
    """File indices at the positions ``ranges`` (e.g. :func:`stream_positions`), in order, in chunks.

    The array-free replacement for ``epoch_order(...)[positions(ranges)]``: memory per chunk only.
    """
    step = max(1, int(chunk))
    for a, b in ranges:
        for lo in range(int(a), int(b), step):
            yield order_at(n, np.arange(lo, min(lo + step, int(b)), dtype=np.int64), seed=seed, epoch=epoch,
                           shuffle=shuffle, blocks=blocks, reshuffle_every=reshuffle_every)


def check_order_version(state: Mapping[str, Any]) -> None:
    """Refuse a resume state whose epoch order is not this version's (:data:`ORDER_VERSION`).

    A state saved under another order would resume the right *positions* of a different
    permutation: some files twice, others never. Raises :class:`ucmagic.errors.ResumeOrderError`.
    An unshuffled state resumes under any version: its order is the listing's, in every version.
    """
    if state.get("shuffle", True) is False:
        return
    got = state.get("order_version", 1)
    if got != ORDER_VERSION:
        raise ResumeOrderError(
            f"this resume state was saved with epoch-order version {got!r} and this ucmagic uses version "
            f"{ORDER_VERSION} (a different permutation of the files): resuming it would repeat some files "
            "and skip others. Start the epoch again instead (dataset.set_epoch(state['epoch'])), or resume "
            "with the ucmagic version that saved it"
        )
