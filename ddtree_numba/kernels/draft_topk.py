"""Draft top-K on the GPU: ``kernels.draft_topk``, ids bit-exact to the reference.

One block per ``[b, d, :]`` row of ``V`` logits (``rows = bs * L``), or, when the rows are too
few to fill the GPU, ``parts`` blocks per row and a merge (below). The selection never sorts
the vocabulary: it finds the K-th largest key by **radix select** on the float bits, then sorts
only the few survivors. Two other variants for ``K <= 256``, each the default on a GPU where
it was measured faster: ``draft_topk_filtered`` (``variant="filtered"``: each logit read once
and, mostly, only compared with a running floor; :func:`filtered_pays`) and
``draft_topk_resident`` (``variant="resident"``: few rows, each slice held in registers;
:func:`resident_pays`).

*Orderable keys* (``_primitives.orderable_key``) map float32 bits to uint32 so that unsigned
order = float order, with ``-0.0 == +0.0`` as in the reference. The rank order is "key
descending, id ascending", so a candidate is packed as ``(key << 32) | (0xFFFFFFFF - id)`` and
one descending uint64 sort gives the reference's order.

Phases of a block (``T`` threads, ``v`` strided by ``T``: coalesced)::

    1. one pass over the row: the largest key (the max logit m) and a 2048-bin
       histogram of key bits 31..21 (shared-memory atomics)                   V reads
    2. the bin t holding the K-th largest key: a block suffix scan of the histogram
       if more than TIE_CAP keys share bin t: refine on bits 20..10, then 9..0,
       re-reading the row (from L2) and counting only keys in the chosen bin   (rare)
    3. one more pass: sum of exp(x - m) for the log-sum-exp, and the candidates: keys
       above the threshold bin and keys in it (at most K - 1 + TIE_CAP), appended with
       a shared atomic counter                                               V reads
    4. bitonic sort of the candidates in shared memory (descending uint64), write the
       first K: log-prob = x - lse, id                                            K writes

**Split rows.** At bs = 1 a step has ``L = 15`` rows: 15 blocks on a GPU of 132 SMs. Then
(:func:`parts_per_row`) block ``(row, p)`` runs the same phases 1-4 on the slice ``row[p *
chunk:(p + 1) * chunk]`` and writes its best ``k`` packed candidates, its max ``m_p`` and its
``s_p = sum exp(x - m_p)``; a second launch, one block per row, merges the parts' sorted
lists pairwise, keeping the best ``k`` of each pair (``merge_parts``), and writes the
first ``k``, with ``lse = M + log(sum_p s_p exp(m_p - M))``, ``M = max_p m_p``. Exact: each of
the row's best ``k`` is among the best ``k`` of its own slice, and the packed order (key, then
id) is the same total order in both launches. (The merge used to sort all ``parts * k``
candidates: at bs 1, V 163 840, k 256 in 4 parts the pairwise merge took the whole call from
76 to 56 us on the H200.)

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
float32 epsilons, plus one rounding of ``lse`` and one of ``x - lse``; a split row adds
about three epsilons per part (``exp(m_p - M)``, the product, the sum) while each part sums
only ``V / parts`` terms: ``(V / (parts T) + 16 + 3 parts)``. ``tests/test_draft_topk.py``
checks exactly that bound.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from ..arrays import data_address, storage_kind
from ..limits import MAX_K
from ..validation import check_draft_topk, require_array, require_int
from ._device import (
    CACHE_KERNELS,
    SIMULATOR,
    as_device,
    device_empty,
    launch,
    launch_stream,
    resolve_variant,
    sm_count,
)
from ._primitives import (
    FULL_MASK,
    bits_of_key,
    bits_to_float,
    block_inclusive_scan_open,
    block_max,
    block_sum,
    float_of_key,
    orderable_key,
    sort_desc_any,
    sync_warp,
    warp_max_f32,
    warp_sum_f32,
)

TOPK_THREADS = 32 if SIMULATOR else 512   # a power of two, at most MAX_THREADS
MAX_THREADS = 512
BINS = 2048                  # radix digits per level: 11 + 11 + 10 bits
TIE_CAP = 3072               # candidates taken from the threshold bin without refining
SORT_CAP = 4096              # >= MAX_K - 1 + TIE_CAP, a power of two
UNROLL = 8                   # loads in flight per thread in the passes over a row
SPLIT_MIN_CHUNK = 64 if SIMULATOR else 4096   # logits a block reads at least in a split row
# parts * k candidates a two-pass split gives the merge at most (parts_per_row's rule): on
# the H200, when the merge sorted all of them, 4096 (k = 256 in 16 parts) cost more than the
# split saved (165 us against 144 at bs 1, V = 163840), while k = 16 in 18 parts took 68 us
# against 123
MERGE_CAP = 1024
MERGE_SLOTS = 4096           # keys the merge holds in shared memory (32 KiB)
MAX_PARTS = 64               # blocks per row at most
NEG_INF = float32(-np.inf)
# (shift, mask) of the three radix levels: bits 31..21, 20..10, 9..0
LEVEL_SHIFT = (21, 10, 0)
LEVEL_MASK = (0x7FF, 0x7FF, 0x3FF)


# ------------------------------------------------------------------------------------------
# Block-wide helpers (every thread of the block must call them; reductions and the scan are
# in _primitives)
# ------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline="always")
def _find_threshold_digit(hist, nbins, need, scratch, result, tid, T):
    """The digit t with ``count(d > t) < need <= count(d >= t)``.

    Thread j owns ``per = ceil(nbins / T)`` bins counted from the top; a block scan of the
    per-thread sums tells the one thread whose range contains the crossing. Writes
    ``result[0] = t``, ``result[1] = count(d > t)``, ``result[2] = hist[t]``, and returns
    ``count(d >= 0)`` to every thread; where that is below ``need``, no digit qualifies and
    ``result`` is left as it was.
    """
    per = (nbins + T - 1) // T
    top = nbins - 1 - tid * per             # this thread's bins: top, top - 1, ...
    local = 0
    for q in range(per):
        if top - q >= 0:
            local += hist[top - q]
    incl, total = block_inclusive_scan_open(scratch, local, tid, T)   # (closed below)
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
    cuda.syncthreads()                      # result visible to all threads (and the
    return total                            # scan's scratch read: it closes the scan)


# ------------------------------------------------------------------------------------------
# The kernels (one specialisation per storage type: float32 bits or bfloat16 bits)
# ------------------------------------------------------------------------------------------
def _make_select_top(bf16: bool):
    """``(load_bits, select_top)`` device functions for float32 (``bf16=False``) or bfloat16
    bits (the one-pass kernels of ``draft_topk_filtered`` fall back on this select)."""
    if bf16:

        @cuda.jit(device=True, inline="always")
        def load_bits(row, v):
            return uint32(row[v]) << uint32(16)          # bfloat16 = top half of a float32

    else:

        @cuda.jit(device=True, inline="always")
        def load_bits(row, v):
            return uint32(row[v])

    @cuda.jit(device=True, inline="always")
    def select_top(row, lo, hi, k, tid, T, cand, hist, scratch, result, red_u, red_f, n_cand):
        """Phases 1-4a on the logits ``row[lo:hi]`` (all threads call it): afterwards
        ``cand[0:kk]`` holds the ``kk = min(k, hi - lo)`` best packed candidates, best first.
        Returns ``(m, s, kk)``: the slice's max logit and sum of ``exp(x - m)``. The shared
        arrays come from the kernel (``select_shared``: one set a kernel)."""
        buf = cuda.local.array(UNROLL, uint32)  # UNROLL loads in flight per thread
        kk = min(k, hi - lo)

        # 1. pass over the slice: largest key (-> the max logit) and the first-level histogram
        for d in range(tid, BINS, T):
            hist[d] = 0
        cuda.syncthreads()                  # histogram cleared before the atomics
        max_key = uint32(0)
        for v0 in range(lo + tid, hi, UNROLL * T):
            for u in range(UNROLL):         # issue all loads first (unrolled: registers) ...
                v = v0 + u * T
                buf[u] = load_bits(row, v) if v < hi else uint32(0)
            for u in range(UNROLL):         # ... then use them
                if v0 + u * T < hi:
                    key = orderable_key(buf[u])
                    max_key = max(max_key, key)
                    cuda.atomic.add(hist, int32(key >> uint32(LEVEL_SHIFT[0])), 1)
        m = float_of_key(block_max(red_u, max_key, tid, T))   # max logit (-inf allowed)

        # 2. radix select of the kk-th largest key
        need = kk
        prefix = uint32(0)                  # key bits fixed so far ...
        mask = uint32(0)                    # ... and which bits those are
        ties = 0
        for level in range(len(LEVEL_SHIFT)):
            shift = uint32(LEVEL_SHIFT[level])
            digit_mask = uint32(LEVEL_MASK[level])
            if level > 0:                   # count the next digit of keys in the chosen bin
                for d in range(tid, BINS, T):
                    hist[d] = 0
                cuda.syncthreads()          # cleared before the atomics
                for v0 in range(lo + tid, hi, UNROLL * T):
                    for u in range(UNROLL):
                        v = v0 + u * T
                        buf[u] = load_bits(row, v) if v < hi else uint32(0)
                    for u in range(UNROLL):
                        key = orderable_key(buf[u])
                        if v0 + u * T < hi and (key & mask) == prefix:
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

        # 3. pass over the slice: sum of exp(x - max), and the candidates (keys above the
        #    threshold bin, and the bin itself)
        if tid == 0:
            n_cand[0] = 0
        cuda.syncthreads()                  # counter reset before the atomics
        ordered_ties = ties > TIE_CAP       # only when all 32 bits are resolved
        s = float32(0.0)
        for v0 in range(lo + tid, hi, UNROLL * T):
            for u in range(UNROLL):
                v = v0 + u * T
                buf[u] = load_bits(row, v) if v < hi else uint32(0)
            for u in range(UNROLL):
                v = v0 + u * T
                if v < hi:
                    x = bits_to_float(buf[u])
                    if x > NEG_INF:
                        s += math.exp(x - m)
                    key = orderable_key(buf[u])
                    high = key & mask
                    if high > prefix or (high == prefix and not ordered_ties):
                        slot = cuda.atomic.add(n_cand, 0, 1)
                        cand[slot] = (uint64(key) << uint64(32)) | uint64(0xFFFFFFFF - v)
        total = block_sum(red_f, s, tid, T)
        if ordered_ties:                    # the first `need` equal keys in id order
            span = (hi - lo + T - 1) // T   # thread tid counts ties in lo + [tid * span, ..)
            first = lo + tid * span
            last = min(first + span, hi)
            mine = 0
            for v in range(first, last):
                if orderable_key(load_bits(row, v)) == prefix:
                    mine += 1
            # (an open scan: the barrier after the candidates closes it)
            rank = block_inclusive_scan_open(scratch, mine, tid, T)[0] - mine
            base = kk - need                # slots after the keys above the threshold
            for v in range(first, last):
                if rank < need and orderable_key(load_bits(row, v)) == prefix:
                    cand[base + rank] = (uint64(prefix) << uint64(32)) | uint64(0xFFFFFFFF - v)
                    rank += 1
            if tid == 0:
                n_cand[0] = kk
        cuda.syncthreads()                  # all candidates written

        # 4a. sort the candidates descending
        sort_desc_any(cand, n_cand[0], tid, T)
        return m, total, kk

    return load_bits, select_top


@cuda.jit(device=True, inline="always")
def select_shared():
    """The shared arrays :func:`select_top` works in (static, one set per kernel):
    ``(hist, scratch, result, red_u, red_f, n_cand)``. (One array a line: the simulator tells
    shared arrays apart by the line that makes them.)"""
    hist = cuda.shared.array(BINS, int32)
    scratch = cuda.shared.array(MAX_THREADS, int32)
    result = cuda.shared.array(3, int32)
    red_u = cuda.shared.array(MAX_THREADS, uint32)
    red_f = cuda.shared.array(MAX_THREADS, float32)
    n_cand = cuda.shared.array(1, int32)
    return hist, scratch, result, red_u, red_f, n_cand


#: ``_select_top(bf16)``: ``(load_bits, select_top)``, made once per kind.
_select_top = functools.cache(_make_select_top)


@cuda.jit(device=True, inline="always")
def store_part(cand, kk, m, total, row_id, p, k, tid, T, part_keys, part_max, part_sum):
    """A part kernel's result, slot ``(row_id, p)`` of the scratch: its best ``kk <= k``
    packed candidates ``cand[0:kk]`` (then ``0``, below every real key, up to ``k``), its max
    logit ``m`` and its sum ``total`` of ``exp(x - m)``. An empty slice stores ``kk = 0``,
    ``m = -inf``, ``total = 0``: it adds nothing to the merge."""
    for r in range(tid, k, T):
        part_keys[row_id, p, r] = cand[r] if r < kk else uint64(0)
    if tid == 0:
        part_max[row_id, p] = m
        part_sum[row_id, p] = total


def _make_topk_kernels(bf16: bool):
    """``(whole_row_kernel, part_kernel)`` for float32 (``bf16=False``) or bfloat16 bits."""
    _, select_top = _select_top(bf16)

    @cuda.jit(cache=CACHE_KERNELS)
    def whole_row_kernel(logit_bits, k, top_log_probs, top_token_ids):
        """Grid ``(rows,)``, block ``(TOPK_THREADS,)``; row ``logit_bits[row, :]`` -> K
        outputs."""
        row_id = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        cand = cuda.shared.array(SORT_CAP, uint64)
        hist, scratch, result, red_u, red_f, n_cand = select_shared()
        m, total, _ = select_top(logit_bits[row_id], 0, logit_bits.shape[1], k, tid,
                                 TOPK_THREADS, cand, hist, scratch, result, red_u, red_f,
                                 n_cand)
        lse = m + math.log(total) if m > NEG_INF else NEG_INF
        _write_top(cand, k, lse, row_id, tid, TOPK_THREADS, top_log_probs, top_token_ids)

    @cuda.jit(cache=CACHE_KERNELS)
    def part_kernel(logit_bits, k, chunk, part_keys, part_max, part_sum):
        """Grid ``(rows, parts)``: block ``(row, p)`` selects in ``row[p * chunk:(p + 1) *
        chunk]`` and writes its best ``k`` packed candidates (``0``, below every real key,
        past the slice's length), its max logit and its sum of ``exp(x - max)``."""
        row_id = cuda.blockIdx.x
        p = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        V = logit_bits.shape[1]
        lo = min(p * chunk, V)
        hi = min(lo + chunk, V)
        T = TOPK_THREADS                    # a constant step (see _device.launch)
        cand = cuda.shared.array(SORT_CAP, uint64)
        if lo == hi:                        # an empty slice (the whole block returns here)
            store_part(cand, 0, NEG_INF, float32(0.0), row_id, p, k, tid, T, part_keys,
                       part_max, part_sum)
            return
        hist, scratch, result, red_u, red_f, n_cand = select_shared()
        m, total, kk = select_top(logit_bits[row_id], lo, hi, k, tid, T, cand, hist, scratch,
                                  result, red_u, red_f, n_cand)
        store_part(cand, kk, m, total, row_id, p, k, tid, T, part_keys, part_max, part_sum)

    return whole_row_kernel, part_kernel


@cuda.jit(device=True, inline="always")
def _write_top(cand, k, lse, row_id, tid, T, top_log_probs, top_token_ids):
    """4b. Unpack the first ``k`` sorted candidates: id, and log-prob ``x - lse``."""
    for r in range(tid, k, T):
        packed = cand[r]
        key = uint32(packed >> uint64(32))
        token = int32(0xFFFFFFFF - (packed & uint64(0xFFFFFFFF)))
        x = bits_to_float(bits_of_key(key))
        top_token_ids[row_id, r] = token
        top_log_probs[row_id, r] = x - lse if x > NEG_INF else NEG_INF


@cuda.jit(device=True, inline="always")
def _row_lse_serial(row_max, row_sum, parts, tid, stats):
    """``stats[0] = lse = M + log(sum_p s_p exp(m_p - M))``, ``M = max_p m_p``, by thread 0 in
    part order (the simulator's: it has no shuffles)."""
    if tid == 0:
        big = NEG_INF
        for q in range(parts):
            big = max(big, row_max[q])
        total = float32(0.0)
        for q in range(parts):
            m_q = row_max[q]
            if m_q > NEG_INF:
                total += row_sum[q] * math.exp(m_q - big)
        stats[0] = big + math.log(total) if big > NEG_INF else NEG_INF


@cuda.jit(device=True, inline="always")
def _row_lse_by_warp(row_max, row_sum, parts, tid, stats):
    """The same ``lse`` by warp 0: lane ``l`` loads parts ``l`` and ``l + 32`` (all four loads
    in flight at once, where thread 0's loop waits for each), then a shuffle tree takes the
    max and, after it, the sum (every lane ends with both)."""
    if tid < 32:
        m0 = row_max[tid] if tid < parts else NEG_INF
        m1 = row_max[tid + 32] if tid + 32 < parts else NEG_INF
        s0 = row_sum[tid] if tid < parts else float32(0.0)
        s1 = row_sum[tid + 32] if tid + 32 < parts else float32(0.0)
        big = warp_max_f32(max(m0, m1))
        total = float32(0.0)
        if m0 > NEG_INF:
            total += s0 * math.exp(m0 - big)
        if m1 > NEG_INF:
            total += s1 * math.exp(m1 - big)
        total = warp_sum_f32(total)
        if tid == 0:
            stats[0] = big + math.log(total) if big > NEG_INF else NEG_INF


_row_lse = _row_lse_serial if SIMULATOR else _row_lse_by_warp


@cuda.jit(device=True, inline="always")
def _part_key(part_keys, row_id, j, n, log_k2, parts, k):
    """Slot ``j`` of the merge's lists: rank ``j % k2`` of part ``j / k2`` (key 0 past the
    parts, past their ``k`` keys and past the ``n`` slots)."""
    q = j >> log_k2
    r = j & ((int32(1) << log_k2) - int32(1))
    return part_keys[row_id, q, r] if j < n and q < parts and r < k else uint64(0)


@cuda.jit(device=True, inline="always")
def _merge_barrier(stride_done, stride_next):
    """The wait between two steps of the merge: a block barrier when either step moves
    elements between warps (a stride of 64 or more), else the warp's own ``sync_warp``."""
    if stride_done >= 64 or stride_next >= 64:
        cuda.syncthreads()
    else:
        sync_warp()


@cuda.jit(device=True, inline="always")
def _mate(j, half, k2, log_k2):
    """The slot that slot ``j`` of list ``q = j / k2`` is paired with: rank ``k2 - 1 - j % k2``
    of list ``q + half``."""
    return ((j >> log_k2) + half) * k2 + k2 - int32(1) - (j & (k2 - int32(1)))


@cuda.jit(device=True, inline="always")
def _pairing_in_shared(lists, half, k2, log_k2, t, T):
    """The round's pairing, ``c[j] = max(A[j], B[k2 - 1 - j])`` for every slot ``j < half
    k2``, on stride 32's slots: pair index ``i`` (``t, t + T, ..``; at least 32 of them, for
    rounds of fewer slots, past which the slots are skipped) takes slots ``2 i - i % 32`` and
    that plus 32."""
    n_slots = half * k2
    i = t
    while i < max(n_slots // int32(2), int32(32)):
        e = (i << int32(1)) - (i & int32(31))
        for c in range(2):
            j = e + int32(c) * int32(32)
            if j < n_slots:
                partner = lists[_mate(j, half, k2, log_k2)]
                if partner > lists[j]:
                    lists[j] = partner
        i += T


@cuda.jit(device=True, inline="always")
def _clean_step_in_shared(lists, n_slots, stride, t, T):
    """One half-cleaner step of ``stride`` over ``lists[0:n_slots]``: pair ``i`` (``t, t + T,
    ..``) is slots ``e = 2 i - i % stride`` and ``e + stride`` (entry ``i % stride`` of run ``i
    / stride`` of ``2 stride`` slots); the lower slot keeps the larger key."""
    i = t
    while i < n_slots // int32(2):
        low = i & (stride - int32(1))
        e = ((i - low) << int32(1)) + low
        a = lists[e]
        b = lists[e + stride]
        if a < b:
            lists[e] = b
            lists[e + stride] = a
        i += T


@cuda.jit(device=True, inline="always")
def _merge_round_in_shared(lists, half, k2, log_k2, t, T):
    """A round of :func:`merge_parts` step by step in shared memory (the simulator's: it has
    no shuffles). A step of stride 32 or less calls ``sync_warp``, which the simulator makes
    a block barrier (it has no warp barrier of its own): there every step waits for the whole
    block."""
    _pairing_in_shared(lists, half, k2, log_k2, t, T)
    stride = k2 // int32(2)
    _merge_barrier(int32(32), stride)       # the winners in place
    while stride > 0:                       # half-cleaners: sort each bitonic list
        _clean_step_in_shared(lists, half * k2, stride, t, T)
        if stride > 1:
            _merge_barrier(stride, stride // int32(2))
        stride //= int32(2)


@cuda.jit(device=True, inline="always")
def _clean_by_shuffle(x, lane, stride):
    """A half-cleaner step of ``stride < 32`` on one register: the partner slot is the same
    register of lane ``lane ^ stride``; the lower slot keeps the larger key. Every lane of the
    warp calls it (full mask; numba shuffles 64-bit values as int64)."""
    y = uint64(cuda.shfl_xor_sync(FULL_MASK, int64(x), stride))
    return max(x, y) if lane & stride == 0 else min(x, y)


@cuda.jit(device=True, inline="always")
def _merge_round_in_registers(lists, half, k2, log_k2, t, T):
    """A round of :func:`merge_parts` with its steps of stride 32 and less in registers (a GPU's:
    shuffles). Lane ``l`` of pair index ``i = t, t + T, ..`` holds slots ``e = 2 i - i % 32``
    (``lo``) and ``e + 32`` (``hi``): its warp's 64-slot chunk, lane ``l`` at ``l`` and ``32 +
    l``. A step of stride 32 is the lane's own ``lo`` against its ``hi``; of stride ``s < 32``,
    each register against the same register of lane ``l ^ s``. So those steps need no shared
    memory and no barrier. Lists of ``k2 <= 64`` do their pairing in the same registers (each
    slot's max with its mate, read from shared memory); longer lists pair in shared memory and
    take the strides ``k2 / 2 .. 64`` there, a block barrier after each."""
    n_slots = half * k2
    stride = k2 // int32(2)
    paired = k2 >= int32(128)
    if paired:                              # (the same branch in every thread)
        _pairing_in_shared(lists, half, k2, log_k2, t, T)
        cuda.syncthreads()                  # the winners in place
        while stride >= int32(64):
            _clean_step_in_shared(lists, n_slots, stride, t, T)
            cuda.syncthreads()              # slots moved between warps
            stride //= int32(2)
    lane = t & int32(31)
    i = t                                   # whole warps: a warp's pair indices are 32
    while i < max(n_slots // int32(2), int32(32)):      # consecutive ones (or none)
        e = (i << int32(1)) - (i & int32(31))
        lo = uint64(0)                      # slots past the round's (a list past them all)
        hi = uint64(0)                      # carry key 0 through the steps, never stored
        if e < n_slots:
            lo = lists[e]
            if not paired:
                lo = max(lo, lists[_mate(e, half, k2, log_k2)])
        if e + int32(32) < n_slots:
            hi = lists[e + int32(32)]
            if not paired:
                hi = max(hi, lists[_mate(e + int32(32), half, k2, log_k2)])
        s = stride
        if s == int32(32):                  # lo and hi are a pair
            lo, hi = max(lo, hi), min(lo, hi)
            s = int32(16)
        while s > 0:
            lo = _clean_by_shuffle(lo, lane, s)
            hi = _clean_by_shuffle(hi, lane, s)
            s //= int32(2)
        if e < n_slots:
            lists[e] = lo
        if e + int32(32) < n_slots:
            lists[e + int32(32)] = hi
        i += T


_merge_round = _merge_round_in_shared if SIMULATOR else _merge_round_in_registers


@cuda.jit(device=True, inline="always")
def merge_parts(part_keys, part_max, part_sum, row_id, k, lists, stats, tid, T, top_log_probs,
                top_token_ids):
    """The row's top K from its parts' sorted lists (each part's best ``k`` contain every one
    of the row's best ``k`` that lies in the part), and its log-sum-exp from the parts' ``(max,
    sum)``; every thread of the block calls it (``T`` whole warps). ``lists``: ``MERGE_SLOTS``
    shared uint64, ``stats``: one shared float32.

    A tree of pairwise merges that keep only the best ``k2`` (``k`` rounded up to a power of
    two; the lists padded with key 0 to ``k2`` and to a power-of-two count ``P2``). Lists
    ``q`` and ``q + half`` (both descending) merge into list ``q``: ``c[j] = max(A[j],
    B[k2 - 1 - j])`` pairs A's ``j``-th best with B's ``j``-th worst; the ``k2`` winners are
    the best ``k2`` of both lists and form a bitonic sequence (falling, then rising), which
    the half-cleaners of strides ``k2 / 2, .., 1`` sort descending. ``log2 P2`` rounds of
    ``1 + log2 k2`` steps; no step sorts more than ``k2`` keys at once.

    Who touches what: the round's lists are one run of ``half k2`` slots, and thread ``t``
    takes the pairs ``i = t, t + T, ..`` of every step. Pair ``i`` of stride ``s`` is slots
    ``e = 2 i - i % s`` and ``e + s`` (entry ``i % s`` of run ``i / s`` of ``2 s`` slots; a
    run never crosses a list, ``s < k2``); the pairing's pair ``i`` is the slots of stride
    32's. With ``T`` a multiple of 32, warp ``w``'s pairs then lie in its own chunks of 64
    slots, ``[64 w + 2 m T, 64 w + 2 m T + 64)``, for every stride up to 32. So on a GPU
    (``_merge_round_in_registers``) each lane holds its two slots of that chunk in registers
    for the steps of stride 32 and less: its own pair at 32, shuffles below, no shared memory
    and no barrier; lists of up to 64 keys pair in those registers too. A stride of 64 or more
    moves slots between warps: shared memory and a block barrier, as at the end of a round
    (the next round reads lists other warps wrote). The simulator, which has no shuffles,
    takes each step in shared memory (``_merge_round_in_shared``), a block barrier between
    any two. Loops over a thread's pairs are ``while`` loops: a ``range`` with a runtime
    bound has numba work out its trip count in 64-bit signed arithmetic at every entry, some
    50 instructions on the step's critical path.
    """
    parts = part_keys.shape[1]
    log_k2 = int32(0)
    while (int32(1) << log_k2) < k:
        log_k2 += int32(1)
    k2 = int32(1) << log_k2
    p2 = int32(1)
    while p2 < parts:
        p2 *= int32(2)                      # p2 * k2 <= MERGE_SLOTS, checked by the launcher
    n = p2 * k2
    t = int32(tid)
    T = int32(T)
    # slots i, i + T, i + 2 T, i + 3 T: the four loads of a thread in flight before any store
    for i in range(t, n, int32(4) * T):
        x0 = _part_key(part_keys, row_id, i, n, log_k2, parts, k)
        x1 = _part_key(part_keys, row_id, i + T, n, log_k2, parts, k)
        x2 = _part_key(part_keys, row_id, i + int32(2) * T, n, log_k2, parts, k)
        x3 = _part_key(part_keys, row_id, i + int32(3) * T, n, log_k2, parts, k)
        lists[i] = x0
        if i + T < n:
            lists[i + T] = x1
        if i + int32(2) * T < n:
            lists[i + int32(2) * T] = x2
        if i + int32(3) * T < n:
            lists[i + int32(3) * T] = x3
    _row_lse(part_max[row_id], part_sum[row_id], parts, tid, stats)
    cuda.syncthreads()                      # lists and lse in place
    half = p2 // int32(2)
    while half > 0:                         # lists 0 .. 2 half - 1 -> 0 .. half - 1
        _merge_round(lists, half, k2, log_k2, t, T)
        cuda.syncthreads()                  # every list of the round merged
        half //= int32(2)
    _write_top(lists, k, stats[0], row_id, tid, T, top_log_probs, top_token_ids)


@cuda.jit(cache=CACHE_KERNELS)
def _merge_kernel(part_keys, part_max, part_sum, k, top_log_probs, top_token_ids):
    """Grid ``(rows,)``, block ``(TOPK_THREADS,)``: ``merge_parts`` for each row (the second
    launch of a split row in the two-pass and one-pass variants)."""
    lists = cuda.shared.array(MERGE_SLOTS, uint64)
    stats = cuda.shared.array(1, float32)
    merge_parts(part_keys, part_max, part_sum, cuda.blockIdx.x, k, lists, stats,
                cuda.threadIdx.x, TOPK_THREADS, top_log_probs, top_token_ids)


def merge_slots(parts: int, k: int) -> int:
    """Shared-memory keys ``merge_parts`` holds for ``parts`` lists of ``k``: both
    rounded up to powers of two."""
    return (1 << max(0, parts - 1).bit_length()) * (1 << max(0, k - 1).bit_length())


def max_parts(V: int, k: int) -> int:
    """The most blocks a row may be split into: ``MAX_PARTS``, at most ``V``, and lists the
    merge can hold (:func:`merge_slots` ``<= MERGE_SLOTS``)."""
    parts = min(V, MAX_PARTS)
    while parts > 1 and merge_slots(parts, k) > MERGE_SLOTS:
        parts -= 1
    return max(1, parts)


#: ``_kernels(bf16)``: the two kernels for float32 or bfloat16 logits, made once per kind.
_kernels = functools.cache(_make_topk_kernels)


def parts_per_row(rows: int, V: int, k: int, variant: str | None = None) -> int:
    """How many blocks read each row, for ``variant`` (``None``: the default). For the
    resident kernel, asked for or the default (:func:`resident_pays`), :func:`resident_parts`.
    Else split only where it pays (H200,
    bench_small_kernels): when the rows would keep at most a quarter of the SMs busy (bs = 1:
    15 rows; at bs = 8, 120 rows, splitting measured slower), into as many parts as fit two
    blocks per SM, each slice at least ``max(SPLIT_MIN_CHUNK, 64 k)`` logits (smaller slices
    lose to their own sort), and ``parts * k <= MERGE_CAP`` candidates for the merge;
    otherwise 1."""
    if variant == "resident" or (variant is None and resident_pays(rows, V, k)):
        return resident_parts(rows, V, k)
    sms = sm_count()
    if rows < 1 or 4 * rows > sms:
        return 1
    min_chunk = max(SPLIT_MIN_CHUNK, 64 * k)
    return max(1, min(2 * sms // rows, V // min_chunk, MERGE_CAP // k, MAX_PARTS))


def resident_min_parts(V: int) -> int:
    """The fewest blocks a row of ``V`` logits needs in the resident kernel: slices of at most
    ``SLICE_CAP`` logits (whole 8-byte words)."""
    from .draft_topk_resident import SLICE_CAP

    return -(-V // SLICE_CAP)


def resident_parts(rows: int, V: int, k: int) -> int:
    """The resident kernel's blocks a row: one if the row fits a block, else the fewest that
    hold it, raised to the next power of two (the merge's list count) while the grid stays
    within the SMs and the merge's capacity (:func:`max_parts`)."""
    need = resident_min_parts(V)
    if need == 1:
        return 1
    pow2 = 1 << (need - 1).bit_length()
    return max(need, min(pow2, sm_count() // max(rows, 1), max_parts(V, k)))


def resident_pays(rows: int, V: int, k: int) -> bool:
    """Whether the default takes the resident kernel: on a GPU, ``k <= RESIDENT_MAX_K``, ``V``
    a multiple of 4 (whole 8-byte words in either type), rows too long for one block, and the
    blocks it needs fit the SMs in one wave (``rows * resident_min_parts(V) <= SMs``: at bs 1,
    L 15, V 163 840, 105 blocks). H200, bs 1, L 15, k 256: 36 against 41-51 us for the
    two-pass kernel at V 163 840, 26 against 30 at V 32 000; at V 4 096 (a row a block) 19
    against 17 (an earlier build), so there the two-pass kernel stays."""
    from .draft_topk_resident import RESIDENT_MAX_K

    if SIMULATOR or rows < 1 or k > RESIDENT_MAX_K or V % 4:
        return False
    need = resident_min_parts(V)
    return 2 <= need <= max_parts(V, k) and rows * need <= sm_count()


def resident_applies(logits_bits, k: int, parts: int) -> bool:
    """Whether the ``"resident"`` variant takes these logits (the element-bit view
    ``uint32|uint16[rows, V]``) in ``parts`` blocks a row: ``k <= RESIDENT_MAX_K``, rows of
    whole 8-byte words, the first 8-byte aligned, and slices of at most ``SLICE_CAP``
    logits."""
    from .draft_topk_resident import RESIDENT_MAX_K, SLICE_CAP

    per_word = 8 // logits_bits.dtype.itemsize
    chunk_words = -(-(logits_bits.shape[1] // per_word) // parts)
    return (k <= RESIDENT_MAX_K and _whole_words(logits_bits)
            and chunk_words * per_word <= SLICE_CAP)


def allocate_topk_scratch(bs: int, L: int, V: int, k: int, parts: int | None = None):
    """The buffers a split :func:`draft_topk` writes between its blocks (``None`` when rows
    are not split): ``(part_keys uint64[rows, parts, k], part_max float32[rows, parts],
    part_sum float32[rows, parts], row_done uint32[rows])``; ``row_done`` starts at zero and
    every call leaves it so (the resident kernel's count of finished parts: a tuple made by
    hand must start it at zero too). Allocate once
    and pass as ``scratch=`` to keep the launches capturable in a CUDA graph; one call at a
    time may use it."""
    rows = bs * L
    parts = parts_per_row(rows, V, k) if parts is None else parts
    if parts == 1:
        return None
    return (device_empty((rows, parts, k), np.uint64), device_empty((rows, parts), np.float32),
            device_empty((rows, parts), np.float32), as_device(np.zeros(rows, np.uint32)))


def filtered_applies(logits_bits, k: int) -> bool:
    """Whether the one-pass ``"filtered"`` variant takes these logits (the element-bit view
    ``uint32|uint16[rows, V]``): ``k <= FILTER_MAX_K`` and rows of whole 8-byte words, the
    first 8-byte aligned."""
    from .draft_topk_filtered import FILTER_MAX_K

    return k <= FILTER_MAX_K and _whole_words(logits_bits)


def _whole_words(logits_bits) -> bool:
    """Rows of whole 8-byte words, the first 8-byte aligned: what the kernels that load the
    logits as ``uint64`` words (``"filtered"``, ``"resident"``) need."""
    per_word = 8 // logits_bits.dtype.itemsize
    return logits_bits.shape[1] % per_word == 0 and data_address(logits_bits) % 8 == 0


#: The one-pass kernel is the default where a row has at least this many logits per kept one.
#: H200, bench_small_kernels.py (L 15): with whole rows (parts 1) it beat the two-pass kernel
#: at V / k = 640, 2 000 and 10 240 (bs 8 and 64, float32 and bfloat16: 1.1-1.9x) and lost at
#: V / k = 125 (V 32 000, k 256: 306 against 198 us at bs 64): a warp's held set fills and
#: compacts too often while its floor is still low. With split rows (bs 1) it lost everywhere.
FILTER_MIN_V_PER_K = 512


def filtered_pays(parts: int, V: int, k: int) -> bool:
    """Whether the default takes the one-pass kernel (where it applies): whole rows a block
    (``parts == 1``) and ``V >= FILTER_MIN_V_PER_K * k``, float32 or bfloat16 logits (bfloat16
    at bs 64, V 163 840, k 256 on the H200: 582 against 903 us for the two-pass kernel)."""
    return parts == 1 and V >= FILTER_MIN_V_PER_K * k


def default_variant(logits_bits, parts: int, k: int) -> str:
    """The variant :func:`~ddtree_numba.kernels.draft_topk` launches when none is asked for,
    on the element-bit view ``uint32|uint16[rows, V]`` of the logits split in ``parts`` blocks
    a row: on a GPU, ``"resident"`` where it pays (:func:`resident_pays`) and applies
    (:func:`resident_applies`), else ``"filtered"`` where that applies
    (:func:`filtered_applies`) and pays (:func:`filtered_pays`), else ``"two_pass"`` (always
    on the simulator)."""
    rows, V = logits_bits.shape
    if SIMULATOR:
        return "two_pass"
    if resident_pays(rows, V, k) and resident_applies(logits_bits, k, parts):
        return "resident"
    if filtered_pays(parts, V, k) and filtered_applies(logits_bits, k):
        return "filtered"
    return "two_pass"


def draft_topk(logits, k, *, check=None, out=None, parts=None, scratch=None, variant=None):
    """Per-depth log-softmax top-K of the drafter's logits on the GPU (one or two launches,
    no sync).

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
    parts : int, optional
        Blocks per row (``1 <= parts <=``
        :func:`~ddtree_numba.kernels.draft_topk.max_parts`: at most 64, ``V``, and lists the
        merge holds); default :func:`~ddtree_numba.kernels.draft_topk.parts_per_row` for the
        variant asked for (or the default one). With
        more than one, each block selects in a slice of the row and a second launch merges
        the slices.
    scratch : tuple, optional
        :func:`allocate_topk_scratch` buffers for those ``parts`` (allocated here if None;
        when ``parts`` is omitted, their shape sets it): four arrays (the fourth, a count the
        resident kernel keeps, is new in this version; the three-array tuple of earlier
        versions is refused).
    variant : str, optional
        ``"two_pass"``; ``"filtered"`` (one pass over the logits: ``draft_topk_filtered``;
        a GPU with warp intrinsics, ``k <= 256`` and rows of whole 8-byte words:
        :func:`~ddtree_numba.kernels.draft_topk.filtered_applies`); or ``"resident"`` (each
        slice held in registers, read once: ``draft_topk_resident``; ``k <= 256``, whole
        8-byte words, slices of at most 24 576 logits:
        :func:`~ddtree_numba.kernels.draft_topk.resident_applies`; runs on the simulator
        too). Default (:func:`~ddtree_numba.kernels.draft_topk.default_variant`):
        ``"resident"`` on a GPU where its blocks fit the SMs in one wave (bs 1), else
        ``"filtered"`` where it applies and was measured faster (whole rows a block and ``V >=
        512 k``), else ``"two_pass"`` (always on the simulator).

    Returns
    -------
    tuple
        ``(top_log_probs, top_token_ids)`` device arrays; ids equal the reference's exactly,
        log-probs within the bound stated in the module docstring (the one-pass kernel's:
        in ``draft_topk_filtered``'s).
    """
    sz = check_draft_topk(logits, k, check=check)
    if sz.k > MAX_K:
        raise ValueError(f"k: expected at most {MAX_K} (the shared-memory sort), got {sz.k}")
    rows = sz.bs * sz.L
    if variant is not None:                 # else chosen below, from the logits' bits
        variant = resolve_variant(variant, readable="two_pass", fast="filtered",
                                  anywhere=("resident",))
    if parts is None:                       # given scratch fixes it (no device query)
        parts = (scratch[0].shape[1] if isinstance(scratch, tuple) and scratch
                 else parts_per_row(rows, sz.V, sz.k, variant))
    parts = require_int("parts", parts, low=1, high=max_parts(sz.V, sz.k))
    if parts > 1:
        if scratch is None:
            scratch = allocate_topk_scratch(sz.bs, sz.L, sz.V, sz.k, parts)
        if not isinstance(scratch, tuple) or len(scratch) != 4:
            raise TypeError(f"scratch: expected the tuple allocate_topk_scratch(bs, L, V, k, "
                            f"parts) returns, got {type(scratch).__name__}")
        sizes = {"rows": rows, "parts": parts, "k": sz.k}
        for i, (dtype, dims) in enumerate(((np.uint64, ("rows", "parts", "k")),
                                           (np.float32, ("rows", "parts")),
                                           (np.float32, ("rows", "parts")),
                                           (np.uint32, ("rows",)))):
            require_array(f"scratch[{i}]", scratch[i], (dtype,), dims, sizes)
    is_bf16 = storage_kind(logits) == "bfloat16"
    if SIMULATOR and is_bf16:               # the simulator has no bf16: widen exactly on host
        logits = np.asarray(logits).astype(np.float32)
        is_bf16 = False
    x = as_device(logits)
    bits = x.reshape(rows, sz.V)
    bits = bits.view(np.uint16) if is_bf16 else bits.view(np.uint32)
    if variant is None:
        variant = default_variant(bits, parts, sz.k)
    if variant == "filtered" and not filtered_applies(bits, sz.k):
        from .draft_topk_filtered import FILTER_MAX_K

        raise ValueError(f"variant: 'filtered' takes k <= {FILTER_MAX_K} and rows of whole "
                         f"8-byte words (V a multiple of {8 // bits.dtype.itemsize}, aligned); "
                         f"got k={sz.k}, V={sz.V}")
    if variant == "resident" and not resident_applies(bits, sz.k, parts):
        from .draft_topk_resident import RESIDENT_MAX_K, SLICE_CAP

        raise ValueError(f"variant: 'resident' takes k <= {RESIDENT_MAX_K}, rows of whole "
                         f"8-byte words (V a multiple of {8 // bits.dtype.itemsize}, aligned) "
                         f"and slices of at most {SLICE_CAP} logits (parts >= "
                         f"{resident_min_parts(sz.V)}); got k={sz.k}, V={sz.V}, parts={parts}")
    if out is None:
        top_lp = device_empty((sz.bs, sz.L, sz.k), np.float32)
        top_ids = device_empty((sz.bs, sz.L, sz.k), np.int32)
    else:                                   # the kernels write k per row unchecked
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"out: expected a tuple (top_log_probs, top_token_ids), got "
                            f"{type(out).__name__}")
        top_lp, top_ids = out
        sizes = {"bs": sz.bs, "L": sz.L, "k": sz.k}
        require_array("out[0]", top_lp, (np.float32,), ("bs", "L", "k"), sizes)
        require_array("out[1]", top_ids, (np.int32,), ("bs", "L", "k"), sizes)
    if rows:
        stream = launch_stream()
        outputs = (top_lp.reshape(rows, sz.k), top_ids.reshape(rows, sz.k))
        if variant in ("filtered", "resident"):     # kernels that load 8-byte words
            if variant == "filtered":
                from .draft_topk_filtered import FILTER_THREADS as threads
                from .draft_topk_filtered import filtered_kernels as kernels
            else:
                from .draft_topk_resident import RESIDENT_THREADS as threads
                from .draft_topk_resident import resident_kernels as kernels

            whole_row, part = kernels(is_bf16)
            words = bits.view(np.uint64)    # [rows, V / per_word]: 8-byte loads
            if parts == 1:
                launch(whole_row, rows, threads, stream)(words, bits, sz.k, *outputs)
            elif variant == "filtered":
                chunk = math.ceil(words.shape[1] / parts)       # in words
                launch(part, (rows, parts), threads, stream)(words, bits, sz.k, chunk,
                                                             *scratch[:3])
            else:                           # the row's last block merges: one launch
                chunk = math.ceil(words.shape[1] / parts)
                launch(part, (rows, parts), threads, stream)(words, bits, sz.k, chunk,
                                                             *scratch, *outputs)
        else:
            whole_row, part = _kernels(is_bf16)
            if parts == 1:
                launch(whole_row, rows, TOPK_THREADS, stream)(bits, sz.k, *outputs)
            else:
                chunk = math.ceil(sz.V / parts)
                launch(part, (rows, parts), TOPK_THREADS, stream)(bits, sz.k, chunk,
                                                                  *scratch[:3])
        if parts > 1 and variant != "resident":
            launch(_merge_kernel, rows, TOPK_THREADS, stream)(*scratch[:3], sz.k, *outputs)
    return top_lp, top_ids


def build_specs():
    """Specialisations launched by :func:`draft_topk` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    out = (types.float32[:, ::1], types.int32[:, ::1])
    part = (types.int64, types.int64, types.uint64[:, :, ::1], types.float32[:, ::1],
            types.float32[:, ::1])
    specs = []
    for name, bits in (("float32", types.uint32), ("bfloat16", types.uint16)):
        whole_row, part_kernel = _kernels(name == "bfloat16")
        specs += [
            KernelSpec("draft_topk", f"{name} logits", whole_row,
                       (bits[:, ::1], types.int64, *out), TOPK_THREADS, True),
            KernelSpec("draft_topk", f"{name} logits, row slices", part_kernel,
                       (bits[:, ::1], *part), TOPK_THREADS, True),
        ]
    from .draft_topk_filtered import FILTER_THREADS, filtered_kernels

    for name, bits in (("float32", types.uint32), ("bfloat16", types.uint16)):
        whole_row, part_kernel = filtered_kernels(name == "bfloat16")
        words = (types.uint64[:, ::1], bits[:, ::1])
        specs += [
            KernelSpec("draft_topk", f"{name} logits, one pass", whole_row,
                       (*words, types.int64, *out), FILTER_THREADS, True),
            KernelSpec("draft_topk", f"{name} logits, one pass, row slices", part_kernel,
                       (*words, *part), FILTER_THREADS, True),
        ]
    from .draft_topk_resident import RESIDENT_THREADS, resident_kernels

    for name, bits in (("float32", types.uint32), ("bfloat16", types.uint16)):
        whole_row, part_kernel = resident_kernels(name == "bfloat16")
        words = (types.uint64[:, ::1], bits[:, ::1])
        specs += [
            KernelSpec("draft_topk", f"{name} logits, resident", whole_row,
                       (*words, types.int64, *out), RESIDENT_THREADS, True),
            KernelSpec("draft_topk", f"{name} logits, resident, row slices", part_kernel,
                       (*words, *part, types.uint32[::1], *out), RESIDENT_THREADS, True),
        ]
    specs.append(KernelSpec("draft_topk", "merge of the slices", _merge_kernel,
                            (types.uint64[:, :, ::1], types.float32[:, ::1],
                             types.float32[:, ::1], types.int64, *out), TOPK_THREADS, True))
    return specs
