"""Flash-decoding splits of the tiled variant: how many (host side) and how they merge (device).

The tiled variant cuts the slots ``[0, max_pages * page_size)`` of every request into
``splits`` equal ranges of whole 8-slot sub-tiles, one block per (split, 32-row tile, request),
so that even bs = 1 fills the GPU. Each block writes an unnormalised partial of its split,
``part_out = out / l`` and ``part_lse = m + log l`` (``-inf`` when the split saw no visible
slot of the row); the merge kernel combines the splits of every row by log-sum-exp
(``_merge_partials``: the tiled variant's merge; the tensor-core variant's, the same
expressions in the same order, is below and in ``mma.merge_rows``).

Why one module for the plan and the merge: both are the flash-decoding split and nothing else.
The plan decides the shape of the partial buffers (``allocate_workspace``) and the merge is
their only reader; the tiled kernel itself only sees ``slots_per_split``. A learner reads the
tiled kernel for one split, and this module for how splits are chosen and put back together.

Host side: :func:`~ddtree_numba.kernels.verify_attn.splits.choose_splits` picks the count
that minimises waves x block time (a partial last wave idles SMs, a partial tile still computes
all its scores); :func:`~ddtree_numba.kernels.verify_attn.splits.plan_splits` turns it into
``(splits, slots_per_split)`` for a launch. Only the block table's capacity is known on the
host without a synchronisation, so splits past a request's ``P + num_nodes`` return at once
with an empty partial.

The mma variant's splits are fixed by each request's own prefix length instead
(``prefix_split_slots``: determinism), and merged by the helpers ``prefix_splits``,
``split_max``, ``split_weight``, ``merged_value`` and ``merged_lse``: inside the mma kernel
in large launches, by ``_merge_prefix_kernel`` after it in small ones; the same bits.

Merge kernel: grid ``(N * H, bs)``, 128 threads; block ``(row, b)`` reads ``part_lse[:, b,
row]`` and, for each of its columns ``d`` (strided by 128), ``part_out[s, b, row, d]`` of every
split, and writes ``out[b, i, h, d]`` and ``lse[b, i, h]``.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, uint32

from ...limits import MAX_DC
from .._device import CACHE_KERNELS, sm_count
from .readable import NEG_INF
from .tiled import BM, BN, VSLOTS


def _split_cost(slots: int) -> float:
    """Time of one block over ``slots`` slots, in tile times: every tile computes all BN
    scores (576 of the 1088 FLOPs per slot and row), the weighted sum only the slots present."""
    full, rest = divmod(slots, BN)
    score_share = (MAX_DC + 64) / (2 * MAX_DC + 64)
    return full + (score_share + (1 - score_share) * rest / BN if rest else 0.0)


def choose_splits(bs: int, row_tiles: int, slots: int, sms: int = 132, max_waves: int = 4) -> int:
    """Slot splits for ``bs * row_tiles`` row tiles on ``sms`` SMs (one block per SM fits).

    A split of ``per_split = ceil(slots / s)`` slots (rounded up to a sub-tile) costs
    ``_split_cost`` tile times, and the launch ``waves`` of them with
    ``waves = ceil(blocks / sms)``: pick the split count that minimises that (a partial last
    wave idles SMs, a partial tile computes all its scores), the fewest splits on ties, at most
    ``max_waves`` waves.
    """
    tiles = max(bs * row_tiles, 1)
    best = None
    for s in range(1, max(1, min(-(-slots // BN), -(-max_waves * sms // tiles))) + 1):
        per_split, n = _split_slots(slots, s)
        cost = -(-tiles * n // sms) * _split_cost(per_split)
        if best is None or cost < best[0] - 1e-9:    # ties: the fewer splits
            best = (cost, n)
    return best[1]


def _split_slots(slots: int, splits: int) -> tuple:
    """``(slots_per_split, splits)`` covering ``slots``: equal shares, whole sub-tiles."""
    per_split = -(-slots // max(splits, 1))
    per_split = -(-per_split // VSLOTS) * VSLOTS
    return per_split, -(-slots // per_split)


def plan_splits(bs: int, N: int, H: int, max_slots: int, splits=None) -> tuple:
    """``(splits, slots_per_split)`` of the tiled variant for a slot capacity ``max_slots``.

    Only the capacity of the block table is known on the host without a synchronisation, so
    the splits cover ``[0, max_pages * page_size)``; splits past a request's
    ``P + num_nodes`` return at once with an empty partial.
    """
    row_tiles = -(-N * H // BM)
    n = choose_splits(bs, row_tiles, max_slots, sm_count()) if splits is None else int(splits)
    per_split, n = _split_slots(max_slots, n)
    return n, per_split


# Splits of the mma variant: fixed by the request's own prefix length (determinism).
PREFIX_SPLITS = 8           # a prefix is cut into at most this many splits ...
SPLIT_GRANULE = 128         # ... of a multiple of this many slots (a multiple of every tile)


def _prefix_split_slots(P):
    """Slots per split of a request whose prefix is ``P`` slots long: ``ceil(P / 8)`` rounded
    up to a multiple of 128, at least 128. It depends on ``P`` alone, so the split boundaries
    of a row (and so its result, to the bit) do not depend on the batch, the tree size or the
    GPU's SM count (the machine code, and so the bits, still differ between architectures);
    the tree slots ``[P, P + n)`` fill the last ``ceil(n / per) + 1`` splits at most."""
    per = (P + PREFIX_SPLITS - 1) // PREFIX_SPLITS
    per = (per + SPLIT_GRANULE - 1) // SPLIT_GRANULE * SPLIT_GRANULE
    return max(per, SPLIT_GRANULE)


#: the rule on the device (the same Python function, compiled for kernels)
prefix_split_slots = cuda.jit(device=True, inline="always")(_prefix_split_slots)


def max_prefix_splits(N: int) -> int:
    """The most splits any request with ``N`` tree slots can need under
    ``_prefix_split_slots``: 8 for the prefix, and the tree slots past them."""
    return PREFIX_SPLITS + -(-N // SPLIT_GRANULE)


@cuda.jit(device=True, inline="always")
def _merge_partials(part_out, part_lse, splits, b, row, d):
    """Combine split partials of one output element by log-sum-exp.

    ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse) * out_s`` (splits that saw
    no visible slot have ``lse_s = -inf`` and weigh 0).
    """
    M = NEG_INF
    for s in range(splits):
        M = max(M, part_lse[s, b, row])
    total = float32(0.0)
    value = float32(0.0)
    if M > NEG_INF:
        for s in range(splits):
            w = math.exp(part_lse[s, b, row] - M)
            total += w
            value += w * part_out[s, b, row, d]
        return value / total, M + math.log(total)
    return float32(0.0), NEG_INF


MAX_PREFIX_SPLITS = PREFIX_SPLITS + -(-1056 // SPLIT_GRANULE)   # for N up to MAX_NODES


# The merge of the mma variant's splits, one expression each. Two kernels use them: the mma
# kernel itself (its last block of a row block to finish merges that block's rows) and
# ``_merge_prefix_kernel`` (the same merge as a kernel of its own, one row per block: the
# readable form, and the test that the fused merge gives its bits). The same expressions in
# the same order give the same bits.

@cuda.jit(device=True, inline="always")
def prefix_splits(P, end, limit):
    """Splits that a request computes: ``ceil(end / prefix_split_slots(P))`` for its clamped
    prefix ``P`` and slot end ``end = min(P + n, capacity)`` (0 when it has no slot), at most
    ``limit`` (the workspace's)."""
    per = uint32(prefix_split_slots(P))        # (32-bit: no 64-bit division on the GPU)
    return min(int32(uint32(uint32(end) + per - uint32(1)) // per), limit)


@cuda.jit(device=True, inline="always")
def split_max(part_lse, splits, b, row):
    """``M``, the largest ``part_lse[s, b, row]`` over the request's splits (``-inf`` when
    none saw a visible slot)."""
    M = NEG_INF
    for s in range(splits):
        M = max(M, part_lse[s, b, row])
    return M


@cuda.jit(device=True, inline="always")
def split_weight(lse_s, M):
    """A split's unnormalised weight ``exp(lse_s - M)`` (0 where nothing was visible)."""
    return math.exp(lse_s - M) if M > NEG_INF else float32(0.0)


@cuda.jit(device=True, inline="always")
def merged_value(value, total):
    """One output value: ``sum_s w_s out_s`` over ``sum_s w_s`` (0 if nothing was visible)."""
    return value / total if total > 0 else float32(0.0)


@cuda.jit(device=True, inline="always")
def merged_lse(M, total):
    """The row's log-sum-exp, ``M + log sum_s w_s`` (``-inf`` if nothing was visible)."""
    return M + math.log(total) if total > 0 else NEG_INF


@cuda.jit(cache=CACHE_KERNELS)
def _merge_prefix_kernel(part_out, part_lse, prefix_lens, num_nodes, capacity, out, lse):
    """The merge of the mma variant's splits as a kernel of its own (the mma kernel runs the
    same merge in its last block of each row block): request ``b`` has ``prefix_splits(P,
    end)`` splits (``end = min(P + n, capacity)``, ``P`` and ``n`` clamped as the kernel
    clamps them); blocks of later splits wrote nothing.

    The split weights of the row are computed once, by the first ``splits`` threads, into
    shared memory (one barrier); then each thread sums its columns over the splits in split
    order."""
    weight = cuda.shared.array(MAX_PREFIX_SPLITS, float32)
    row = cuda.blockIdx.x
    b = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    N = out.shape[1]
    H = out.shape[2]
    Dc = out.shape[3]
    i = row // H
    h = row % H
    n = min(max(num_nodes[b], 0), N)
    if i >= n:                                  # padding row
        for d in range(tid, Dc, cuda.blockDim.x):
            out[b, i, h, d] = 0.0
        if tid == 0:
            lse[b, i, h] = NEG_INF
        return
    P = min(max(prefix_lens[b], 0), capacity)
    end = min(P + n, capacity)
    # the launcher sends only N <= MAX_NODES here (MAX_PREFIX_SPLITS covers it); the bound
    # keeps any other call inside the workspace and the weight array
    splits = prefix_splits(P, end, min(MAX_PREFIX_SPLITS, part_lse.shape[0]))
    M = split_max(part_lse, splits, b, row)     # every thread: the largest split lse
    if tid < splits:
        weight[tid] = split_weight(part_lse[tid, b, row], M)
    cuda.syncthreads()                          # the weights are written
    total = float32(0.0)
    for s in range(splits):                     # the same order in every thread
        total += weight[s]
    for d in range(tid, Dc, cuda.blockDim.x):
        value = float32(0.0)
        for s in range(splits):
            value += weight[s] * part_out[s, b, row, d]
        out[b, i, h, d] = merged_value(value, total)
    if tid == 0:
        lse[b, i, h] = merged_lse(M, total)


@cuda.jit(cache=CACHE_KERNELS)
def _merge_kernel(part_out, part_lse, num_nodes, out, lse):
    """Grid ``(N * H, bs)``, 128 threads: one query row per block, columns strided."""
    row = cuda.blockIdx.x
    b = cuda.blockIdx.y
    H = out.shape[2]
    Dc = out.shape[3]
    i = row // H
    h = row % H
    for d in range(cuda.threadIdx.x, Dc, cuda.blockDim.x):
        if i >= num_nodes[b]:                   # padding row
            value = float32(0.0)
            row_lse = NEG_INF
        else:
            value, row_lse = _merge_partials(part_out, part_lse, part_lse.shape[0], b, row, d)
        out[b, i, h, d] = value
        if d == 0:
            lse[b, i, h] = row_lse
