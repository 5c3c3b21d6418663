"""Draft top-K on the GPU: ``kernels.draft_topk``, ids bit-exact to the reference.

One block per ``[b, d, :]`` row of ``V`` logits (``rows = bs * L``). The selection never sorts
the vocabulary: it finds the K-th largest key by **radix select** on the float bits, then sorts
only the few survivors.

*Orderable keys* (``_primitives.orderable_key``) map float32 bits to uint32 so that unsigned
order = float order, with ``-0.0 == +0.0`` as in the reference. The rank order is "key
descending, id ascending", so a candidate is packed as ``(key << 32) | (0xFFFFFFFF - id)`` and
one descending uint64 sort gives the reference's order.

Phases of a block (``T`` threads, ``v`` strided by ``T``: coalesced)::

    1. one pass over the row: the largest key (the max logit m) and a 2048-bin
       histogram of key bits 31..21 (shared-memory atomics)                   V reads
    2. the bin t holding the K-th largest key: a block suffix scan of the histogram
       if more than CAP keys share bin t: refine on bits 20..10, then 9..0,
       re-reading the row (from L2) and counting only keys in the chosen bin   (rare)
    3. one more pass: sum of exp(x - m) for the log-sum-exp, and the candidates: keys
       above the threshold bin and keys in it (at most K - 1 + CAP), appended with
       a shared atomic counter                                               V reads
    4. bitonic sort of the candidates in shared memory (descending uint64), write the
       first K: log-prob = x - lse, id                                            K writes

If all 32 key bits are resolved and more than CAP logits are *exactly equal* at the threshold
(e.g. a row of many -inf), phase 3 takes the tied ones in id order instead: each thread counts
the ties in a contiguous chunk of the row, one block scan gives each thread its first rank.

Memory: two reads of the row (the second mostly from L2) plus, rarely, the refinements. The
floor is one read: ``bs * L * V * itemsize`` bytes over the copy bandwidth. Each thread keeps
``UNROLL = 8`` loads in flight (all loads of a chunk are issued before any is used): with one
dependent load per iteration the first version was latency-bound at ~0.7 us per element per
thread (see ``benchmarks/NOTES.md``). Warp-aggregated histogram atomics (``match_any_sync``)
were tried and measured 1.5x slower.

Precision: the log-sum-exp is accumulated in float32 (``m`` is exact: the max logit) in a
different order than the float64 reference. Its error is at most about ``(V / T + 16)``
float32 epsilons, plus one rounding of ``lse`` and one of ``x - lse``;
``tests/test_draft_topk.py`` checks exactly that bound.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from ..arrays import storage_kind
from ..limits import MAX_K
from ..validation import check_draft_topk
from ._device import SIMULATOR, as_device, device_empty, launch, launch_stream
from ._primitives import (
    bits_of_key,
    bits_to_float,
    block_inclusive_scan,
    block_max,
    block_sum,
    float_of_key,
    orderable_key,
)

TOPK_THREADS = 32 if SIMULATOR else 512   # a power of two, at most MAX_THREADS
MAX_THREADS = 512
BINS = 2048                  # radix digits per level: 11 + 11 + 10 bits
TIE_CAP = 3072               # candidates taken from the threshold bin without refining
SORT_CAP = 4096              # >= MAX_K - 1 + TIE_CAP, a power of two
UNROLL = 8                   # loads in flight per thread in the passes over a row
NEG_INF = float32(-np.inf)
# (shift, mask) of the three radix levels: bits 31..21, 20..10, 9..0
LEVEL_SHIFT = (21, 10, 0)
LEVEL_MASK = (0x7FF, 0x7FF, 0x3FF)


# ------------------------------------------------------------------------------------------
# Block-wide helpers (every thread of the block must call them; reductions and the scan are
# in _primitives)
# ------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def _find_threshold_digit(hist, nbins, need, scratch, result, tid, T):
    """The digit t with ``count(d > t) < need <= count(d >= t)``.

    Thread j owns ``per = ceil(nbins / T)`` bins counted from the top; a block scan of the
    per-thread sums tells the one thread whose range contains the crossing. Writes
    ``result[0] = t``, ``result[1] = count(d > t)``, ``result[2] = hist[t]``.
    """
    per = (nbins + T - 1) // T
    top = nbins - 1 - tid * per             # this thread's bins: top, top - 1, ...
    local = 0
    for q in range(per):
        if top - q >= 0:
            local += hist[top - q]
    incl = block_inclusive_scan(scratch, local, tid, T)
    excl = incl - local
    if excl < need and need <= incl:        # exactly one thread
        run = excl
        for q in range(per):
            d = top - q
            if d >= 0:
                if run + hist[d] >= need:
                    result[0] = d
                    result[1] = run
                    result[2] = hist[d]
                    break
                run += hist[d]
    cuda.syncthreads()                      # result visible to all threads


@cuda.jit(device=True, inline=True)
def _bitonic_sort_desc(keys, n, tid, T):
    """Sort ``keys[0:n]`` descending in place (``n`` a power of two; shared memory)."""
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            for i in range(tid, n, T):
                j = i ^ stride
                if j > i:
                    descending = (i & size) == 0
                    a = keys[i]
                    b = keys[j]
                    if (a < b) == descending:
                        keys[i] = b
                        keys[j] = a
            cuda.syncthreads()              # this compare-exchange step done before the next
            stride //= 2
        size *= 2


# ------------------------------------------------------------------------------------------
# The kernel (one specialisation per storage type: float32 bits or bfloat16 bits)
# ------------------------------------------------------------------------------------------
def _make_topk_kernel(bf16: bool):
    if bf16:

        @cuda.jit(device=True, inline=True)
        def load_bits(row, v):
            return uint32(row[v]) << uint32(16)          # bfloat16 = top half of a float32

    else:

        @cuda.jit(device=True, inline=True)
        def load_bits(row, v):
            return uint32(row[v])

    @cuda.jit
    def topk_kernel(logit_bits, k, top_log_probs, top_token_ids):
        """Grid ``(rows,)``, block ``(T,)``; row ``logit_bits[row, :]`` -> K outputs."""
        row_id = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        T = cuda.blockDim.x
        row = logit_bits[row_id]
        V = row.shape[0]

        hist = cuda.shared.array(BINS, int32)
        scratch = cuda.shared.array(MAX_THREADS, int32)
        cand = cuda.shared.array(SORT_CAP, uint64)
        result = cuda.shared.array(3, int32)
        red_u = cuda.shared.array(MAX_THREADS, uint32)
        red_f = cuda.shared.array(MAX_THREADS, float32)
        n_cand = cuda.shared.array(1, int32)
        buf = cuda.local.array(UNROLL, uint32)  # UNROLL loads in flight per thread

        # 1. pass over the row: largest key (-> the max logit) and the first-level histogram
        for d in range(tid, BINS, T):
            hist[d] = 0
        cuda.syncthreads()                  # histogram cleared before the atomics
        max_key = uint32(0)
        for v0 in range(tid, V, UNROLL * T):
            for u in range(UNROLL):         # issue all loads first (unrolled: registers) ...
                v = v0 + u * T
                buf[u] = load_bits(row, v) if v < V else uint32(0)
            for u in range(UNROLL):         # ... then use them
                if v0 + u * T < V:
                    key = orderable_key(buf[u])
                    max_key = max(max_key, key)
                    cuda.atomic.add(hist, int32(key >> uint32(21)), 1)
        m = float_of_key(block_max(red_u, max_key, tid, T))   # max logit (-inf allowed)

        # 2. radix select of the K-th largest key
        need = k
        prefix = uint32(0)                  # key bits fixed so far ...
        mask = uint32(0)                    # ... and which bits those are
        ties = 0
        for level in range(3):
            shift = uint32(LEVEL_SHIFT[level])
            digit_mask = uint32(LEVEL_MASK[level])
            if level > 0:                   # count the next digit of keys in the chosen bin
                for d in range(tid, BINS, T):
                    hist[d] = 0
                cuda.syncthreads()          # cleared before the atomics
                for v0 in range(tid, V, UNROLL * T):
                    for u in range(UNROLL):
                        v = v0 + u * T
                        buf[u] = load_bits(row, v) if v < V else uint32(0)
                    for u in range(UNROLL):
                        key = orderable_key(buf[u])
                        if v0 + u * T < V and (key & mask) == prefix:
                            cuda.atomic.add(hist, int32((key >> shift) & digit_mask), 1)
            cuda.syncthreads()              # histogram complete
            _find_threshold_digit(hist, int32(digit_mask) + 1, need, scratch, result, tid, T)
            need -= result[1]
            prefix |= uint32(result[0]) << shift
            mask |= digit_mask << shift
            ties = result[2]
            cuda.syncthreads()              # everyone read result before it is reused
            if ties <= TIE_CAP:
                break

        # 3. pass over the row: sum of exp(x - max), and the candidates (keys above the
        #    threshold bin, and the bin itself)
        if tid == 0:
            n_cand[0] = 0
        cuda.syncthreads()                  # counter reset before the atomics
        ordered_ties = ties > TIE_CAP       # only when all 32 bits are resolved
        s = float32(0.0)
        for v0 in range(tid, V, UNROLL * T):
            for u in range(UNROLL):
                v = v0 + u * T
                buf[u] = load_bits(row, v) if v < V else uint32(0)
            for u in range(UNROLL):
                v = v0 + u * T
                if v < V:
                    x = bits_to_float(buf[u])
                    if x > NEG_INF:
                        s += math.exp(x - m)
                    key = orderable_key(buf[u])
                    high = key & mask
                    if high > prefix or (high == prefix and not ordered_ties):
                        slot = cuda.atomic.add(n_cand, 0, 1)
                        cand[slot] = (uint64(key) << uint64(32)) | uint64(0xFFFFFFFF - v)
        total = block_sum(red_f, s, tid, T)
        lse = m + math.log(total) if m > NEG_INF else NEG_INF
        if ordered_ties:                    # the first `need` equal keys in id order
            chunk = (V + T - 1) // T
            lo = tid * chunk
            mine = 0
            for v in range(lo, min(lo + chunk, V)):
                if orderable_key(load_bits(row, v)) == prefix:
                    mine += 1
            rank = block_inclusive_scan(scratch, mine, tid, T) - mine
            base = k - need                 # slots after the keys above the threshold
            for v in range(lo, min(lo + chunk, V)):
                if rank < need and orderable_key(load_bits(row, v)) == prefix:
                    cand[base + rank] = (uint64(prefix) << uint64(32)) | uint64(0xFFFFFFFF - v)
                    rank += 1
            if tid == 0:
                n_cand[0] = k
        cuda.syncthreads()                  # all candidates written

        # 4. sort the candidates descending and write the first K
        n = n_cand[0]
        n2 = 1
        while n2 < n:
            n2 *= 2
        for i in range(n + tid, n2, T):     # pad to a power of two with the smallest key
            cand[i] = uint64(0)
        cuda.syncthreads()                  # padding in place before sorting
        _bitonic_sort_desc(cand, n2, tid, T)
        for r in range(tid, k, T):
            packed = cand[r]
            key = uint32(packed >> uint64(32))
            token = int32(0xFFFFFFFF - (packed & uint64(0xFFFFFFFF)))
            x = bits_to_float(bits_of_key(key))
            top_token_ids[row_id, r] = token
            top_log_probs[row_id, r] = x - lse if x > NEG_INF else NEG_INF

    return topk_kernel


#: ``_kernel(bf16)``: the kernel for float32 or bfloat16 logits, made once per kind.
_kernel = functools.cache(_make_topk_kernel)


def draft_topk(logits, k, *, check=None, out=None):
    """Per-depth log-softmax top-K of the drafter's logits on the GPU (one launch).

    Parameters
    ----------
    logits : array
        ``float32|bfloat16[bs, L, V]`` (numpy, or a device array: numba, CuPy, torch).
    k : int
        Tokens kept per depth, ``1 <= k <= min(V, 1024)``.
    check : bool, optional
        Check values (no NaN / +inf). Default: on for numpy inputs only.
    out : tuple, optional
        Preallocated ``(float32[bs, L, k], int32[bs, L, k])`` device arrays.

    Returns
    -------
    tuple
        ``(top_log_probs, top_token_ids)`` device arrays; ids equal the reference's exactly,
        log-probs within the bound stated in the module docstring.
    """
    sz = check_draft_topk(logits, k, check=check)
    if sz.k > MAX_K:
        raise ValueError(f"k: expected at most {MAX_K} (the shared-memory sort), got {sz.k}")
    is_bf16 = storage_kind(logits) == "bfloat16"
    if SIMULATOR and is_bf16:               # the simulator has no bf16: widen exactly on host
        logits = np.asarray(logits).astype(np.float32)
        is_bf16 = False
    x = as_device(logits)
    rows = sz.bs * sz.L
    bits = x.reshape(rows, sz.V)
    bits = bits.view(np.uint16) if is_bf16 else bits.view(np.uint32)
    if out is None:
        top_lp = device_empty((sz.bs, sz.L, sz.k), np.float32)
        top_ids = device_empty((sz.bs, sz.L, sz.k), np.int32)
    else:
        top_lp, top_ids = out
    if rows:
        launch(_kernel(is_bf16), rows, TOPK_THREADS, launch_stream())(
            bits, sz.k, top_lp.reshape(rows, sz.k), top_ids.reshape(rows, sz.k))
    return top_lp, top_ids


def build_specs():
    """Specialisations launched by :func:`draft_topk` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    out = (types.int64, types.float32[:, ::1], types.int32[:, ::1])
    return [
        KernelSpec("draft_topk", "float32 logits", _kernel(False), (types.uint32[:, ::1], *out),
                   TOPK_THREADS, True),
        KernelSpec("draft_topk", "bfloat16 logits", _kernel(True), (types.uint16[:, ::1], *out),
                   TOPK_THREADS, True),
    ]
