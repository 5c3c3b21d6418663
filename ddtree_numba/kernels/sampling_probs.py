"""The sampling distribution on the GPU: ``kernels.sampling_probs`` (temperature, top-k,
top-p per request), the reference's math (``reference.sampling_probs``) in float32.

One block per row of logits (grid ``bs N``, ``PROB_THREADS`` threads; the row belongs to
request ``row // N``). Thread ``tid`` owns the columns ``tid, tid + PROB_THREADS, ...`` of the
row and
folds them in that order; block results come from a tree in shared memory
(``_primitives.block_sum`` / ``block_max``), so every sum has one fixed order and a row's
result never depends on the rest of the launch. The row is read, not stored: each pass
recomputes ``z = x / T`` (and ``exp``) from the logits. A pass loads ``UNROLL`` of its
columns (``c, c + PROB_THREADS, ..., c + 7 PROB_THREADS``; ``T`` below is the temperature)
before it uses any of them: eight loads in flight a thread,
where a plain strided loop keeps one, and the order of the fold is unchanged.

* ``T < limits.GREEDY_TEMPERATURE`` (1e-5): the first index of the maximum (a block argmax),
  then a one-hot row.
* the maximum of ``z``;
* top-k (``0 < k < V``): the k-th largest ``z`` exactly, as an order-preserving 32-bit key
  (``_primitives.key_of_float``) built bit by bit from the top: a bit is set when at least
  ``k`` values have a key at or above the candidate (32 counting passes, integer and exact);
* ``w = exp(z - max)`` of the kept tokens and their sum;
* top-p (``p < 1``): the largest ``tau`` whose kept mass ``sum(w >= tau)`` reaches ``p sum(w)``,
  again bit by bit over the bits of the non-negative float ``w`` (31 passes of float32 sums in
  the fixed order);
* the final sum and ``probs = w / sum`` for the kept tokens, 0 elsewhere.

``row_distribution`` computes these numbers of one row and ``probability`` turns a
logit into its probability with them: ``kernels.tree_sample_logits`` calls the same two on
just the rows its walk visits, so its probabilities are these, bit for bit.

Up to ``4 + 32 + 31`` passes over the row when both filters are on: simple, and slow for
large vocabularies (a radix select with 8-bit digits would take 8); temperature alone is 3.
Every thread reaches every barrier (the branches on ``T``, ``k``, ``p`` are per row: uniform
over the block). Unchecked inputs stay in bounds: the row's request is ``row // N``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..limits import GREEDY_TEMPERATURE
from ..validation import check_sampling_probs, require_array
from ._device import (
    SIMULATOR,
    as_device,
    device_empty,
    kernel_for_block,
    launch,
    launch_stream,
)
from ._primitives import block_max, block_sum, float_to_bits, key_of_float

PROB_THREADS = 32 if SIMULATOR else 512
UNROLL = 8                  # columns a thread loads before it uses them
NEG_INF = float32(-math.inf)
GREEDY_BELOW = float32(GREEDY_TEMPERATURE)


@cuda.jit(device=True, inline="always")
def _columns(logits, row, col):
    """The ``UNROLL`` columns ``col, col + T, ..., col + 7 T`` of the row, loaded together
    (the caller checks that the last is ``< V``)."""
    T = PROB_THREADS
    return (logits[row, col], logits[row, col + T], logits[row, col + 2 * T],
            logits[row, col + 3 * T], logits[row, col + 4 * T], logits[row, col + 5 * T],
            logits[row, col + 6 * T], logits[row, col + 7 * T])


# Each pass below walks the thread's columns in order: whole groups of UNROLL (loaded
# together), then the last few one at a time.
WHOLE = (UNROLL - 1) * PROB_THREADS     # a group starting at col is whole if col + WHOLE < V
GROUP = UNROLL * PROB_THREADS


@cuda.jit(device=True, inline="always")
def _argmax_first(logits, row, red, red_i, tid, V):
    """All threads of the block (block reductions, with barriers): the first index of the
    row's maximum: each thread's first maximum in column order, then the block's largest
    value and, among equal values, the smallest index."""
    value, index = NEG_INF, int32(V)
    col = tid
    while col + WHOLE < V:
        j = 0
        for x in _columns(logits, row, col):
            if x > value or index == V:
                value, index = x, int32(col + j * PROB_THREADS)
            j += 1
        col += GROUP
    while col < V:
        if logits[row, col] > value or index == V:
            value, index = logits[row, col], int32(col)
        col += PROB_THREADS
    top = block_max(red, value, tid, PROB_THREADS)
    candidate = index if value == top else int32(V)
    return -block_max(red_i, -candidate, tid, PROB_THREADS)   # the minimum, by negation


@cuda.jit(device=True, inline="always")
def _max_scaled(logits, row, T, red, tid, V):
    """All threads of the block (a block reduction): the row's maximum of ``z = x / T``."""
    z_max = NEG_INF
    col = tid
    while col + WHOLE < V:
        for x in _columns(logits, row, col):
            z_max = max(z_max, x / T)
        col += GROUP
    while col < V:
        z_max = max(z_max, logits[row, col] / T)
        col += PROB_THREADS
    return block_max(red, z_max, tid, PROB_THREADS)


@cuda.jit(device=True, inline="always")
def _count_at_least(logits, row, T, key, red_i, tid, V):
    """All threads of the block (a block reduction): how many ``z = x / T`` of the row have
    an order key ``>= key``."""
    count = int32(0)
    col = tid
    while col + WHOLE < V:
        for x in _columns(logits, row, col):
            if key_of_float(x / T) >= key:
                count += 1
        col += GROUP
    while col < V:
        if key_of_float(logits[row, col] / T) >= key:
            count += 1
        col += PROB_THREADS
    return block_sum(red_i, count, tid, PROB_THREADS)


@cuda.jit(device=True, inline="always")
def _weight(x, T, z_max, kth_key, tau_bits):
    """``exp(z - max)`` of a token that top-k (key ``>= kth_key``) and top-p (bits ``>=
    tau_bits``) keep, else 0."""
    z = x / T
    if key_of_float(z) < kth_key:
        return float32(0.0)
    w = math.exp(z - z_max)
    return w if float_to_bits(w) >= tau_bits else float32(0.0)


@cuda.jit(device=True, inline="always")
def _kept_mass(logits, row, T, z_max, kth_key, tau_bits, red, tid, V):
    """All threads of the block (a block reduction): the float32 sum of the kept weights,
    each thread in column order, then the tree."""
    mass = float32(0.0)
    col = tid
    while col + WHOLE < V:
        for x in _columns(logits, row, col):
            mass += _weight(x, T, z_max, kth_key, tau_bits)
        col += GROUP
    while col < V:
        mass += _weight(logits[row, col], T, z_max, kth_key, tau_bits)
        col += PROB_THREADS
    return block_sum(red, mass, tid, PROB_THREADS)


@cuda.jit(device=True, inline="always")
def row_distribution(logits, row, T, k, p, red, red_i, tid, V):
    """The numbers that define row ``row``'s distribution, computed by the whole block (every
    thread must call it; all get the result): ``(best, T, z_max, kth_key, tau_bits, total)``.
    ``best >= 0`` is the greedy one-hot's token (``T`` below 1e-5); else ``best = -1`` and a
    token's probability is its kept weight over ``total`` (:func:`probability`)."""
    if T < GREEDY_BELOW:                        # greedy: one-hot at the first maximum
        best = int32(_argmax_first(logits, row, red, red_i, tid, V))
        return best, T, float32(0.0), uint32(0), uint32(0), float32(1.0)
    z_max = _max_scaled(logits, row, T, red, tid, V)
    kth_key = uint32(0)                         # top-k: the k-th largest z's key
    if 0 < k < V:
        for bit in range(31, -1, -1):
            candidate = kth_key | (uint32(1) << uint32(bit))
            if _count_at_least(logits, row, T, candidate, red_i, tid, V) >= k:
                kth_key = candidate
    total = _kept_mass(logits, row, T, z_max, kth_key, uint32(0), red, tid, V)
    tau_bits = uint32(0)                        # top-p: the largest tau reaching p total
    if p < 1:
        target = p * total
        for bit in range(30, -1, -1):           # w >= 0: bit 31 (the sign) stays 0
            candidate = tau_bits | (uint32(1) << uint32(bit))
            if _kept_mass(logits, row, T, z_max, kth_key, candidate, red, tid, V) >= target:
                tau_bits = candidate
        total = _kept_mass(logits, row, T, z_max, kth_key, tau_bits, red, tid, V)
    return int32(-1), T, z_max, kth_key, tau_bits, total


@cuda.jit(device=True, inline="always")
def probability(x, col, dist):
    """The probability of the token ``col`` whose logit is ``x``, in the row whose
    :func:`row_distribution` is ``dist``."""
    best, T, z_max, kth_key, tau_bits, total = dist
    if best >= 0:
        return float32(1.0) if col == best else float32(0.0)
    return _weight(x, T, z_max, kth_key, tau_bits) / total


@kernel_for_block(PROB_THREADS)             # registers capped so the block fits
def _sampling_probs_kernel(logits, temperature, top_k, top_p, N, probs):
    red = cuda.shared.array(PROB_THREADS, float32)
    red_i = cuda.shared.array(PROB_THREADS, int32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    V = logits.shape[1]
    b = row // N
    dist = row_distribution(logits, row, temperature[b], top_k[b], top_p[b], red, red_i, tid,
                            V)
    col = tid
    while col + WHOLE < V:
        j = 0
        for x in _columns(logits, row, col):
            probs[row, col + j * PROB_THREADS] = probability(x, col + j * PROB_THREADS, dist)
            j += 1
        col += GROUP
    while col < V:
        probs[row, col] = probability(logits[row, col], col, dist)
        col += PROB_THREADS


def allocate_probs(bs: int, N: int, V: int):
    """Device buffer for :func:`sampling_probs`'s ``out=`` (``float32[bs, N, V]``)."""
    return device_empty((bs, N, V), np.float32)


def sampling_probs(logits, temperature, top_k, top_p, *, check=None, out=None):
    """The sampling distribution of every row of ``logits`` on the GPU (one launch, no sync).

    Parameters
    ----------
    logits, temperature, top_k, top_p : array
        As in :func:`ddtree_numba.reference.sampling_probs` (numpy or device arrays).
    check : bool, optional
        Value checks (temperatures, top-k, top-p, no NaN or +inf logits); default: on for
        numpy inputs only.
    out : device array, optional
        ``float32[bs, N, V]`` (:func:`allocate_probs`).

    Returns
    -------
    device array
        ``float32[bs, N, V]``; within float32 rounding of the reference (the same kept
        tokens except where weights tie in float32 or a partial mass lies within rounding of
        ``p sum(w)``).
    """
    sz = check_sampling_probs(logits, temperature, top_k, top_p, check=check)
    if out is None:
        out = allocate_probs(sz.bs, sz.N, sz.V)
    require_array("out", out, (np.float32,), ("bs", "N", "V"),
                  {"bs": sz.bs, "N": sz.N, "V": sz.V})
    rows = sz.bs * sz.N
    if rows:
        flat = as_device(logits).reshape(rows, sz.V)
        launch(_sampling_probs_kernel, rows, PROB_THREADS, launch_stream())(
            flat, as_device(temperature), as_device(top_k), as_device(top_p), sz.N,
            out.reshape(rows, sz.V))
    return out


def build_specs():
    """Specialisations launched by :func:`sampling_probs` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    f2, f1 = types.float32[:, ::1], types.float32[::1]
    sig = (f2, f1, types.int32[::1], f1, types.int64, f2)
    return [KernelSpec("sampling_probs", "temperature top-k top-p", _sampling_probs_kernel,
                       sig, PROB_THREADS, True)]
