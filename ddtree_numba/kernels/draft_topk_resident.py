"""Draft top-K with each slice of a row held in registers: ``draft_topk(..., variant="resident")``.

At bs = 1 a step's drafter gives ``L = 15`` rows of ``V = 163 840`` logits: 9.8 MB, about 2.5 us
of the H200's bandwidth, but only 15 rows for 132 SMs. This variant splits each row into
``parts`` slices small enough for one block to *hold*: ``RESIDENT_THREADS`` threads a block,
``LOGITS_PER_THREAD`` logits a thread, in registers (24 576 logits a block on a GPU). Each
logit is read from DRAM once, with every load of a thread issued before any is used, and
everything after the load works on registers: no second pass over the slice, no sort of it.
The last block of a row to finish merges the parts' sorted lists (``draft_topk.merge_parts``),
in the same launch; a row that fits one block (``parts == 1``) writes its outputs directly.

Who holds what (``T`` threads, ``words``: the row viewed as 8-byte words, two float32 or four
bfloat16 logits each; the block's slice is ``words[wlo:whi]``)::

    thread t, register u     word wlo + u * T + t  (u < words_per_thread): a warp reads 256
                             contiguous bytes a load, all loads of a thread in flight at once
    keys[u * per_word + j]   the orderable key of logit j of that word (0: past the slice),
                             logit id (wlo + u * T + t) * per_word + j

Phases of a block, all on the registers (``kk = min(k, logits in the slice)``, ``W = T / 32``
warps)::

    1. max key of each thread; the block's max M (-> the max logit m) and the floor F: the
       smallest over the warps of the warp's j-th largest thread max, j = ceil(kk / W).
       Warp w has j threads whose max is >= its f_w >= F, so at least j * W >= kk logits
       are >= F and nothing below F can be among the best kk. (Each lane ranks its max
       among its warp's 32 by reading them all from shared memory.) For a smooth row of
       24 576 logits about 2 % pass F (the smallest of all 512 thread maxima, the first
       floor, let about 15 % through)
    2. s = sum of exp(x - m) over the slice: each thread sums exp(x - m_t) over its own
       logits (m_t its own max) right after its loads, before the block max's barrier, and
       rescales its sum by exp(m_t - m) after it; then a block sum
    3. the keys >= F counted, a block scan of the counts, and, when they are at most
       CAND_CAP, written packed (key << 32 | ~id) to each thread's slots of the scan: no
       atomics. Else the edge is raised first: a 256-bin histogram of the keys in [F, M],
       bin 255 - ((M - key) >> shift), shift the smallest multiple of 8 that fits [F, M]
       into 256 bins (whole key bytes, so each later round takes the next 8 bits)
       (shared atomics); a block scan from the top bin finds the bin b holding the kk-th
       key. If the keys at or above b are more than CAND_CAP (a crowded bin), the same
       histogram runs again on bin b's range with 8 bits fewer of shift: at most 4 rounds
       (32 bits). Then the keys >= b's lower edge are gathered as above
    4. the candidates (at most CAND_CAP, at least kk) sorted descending, one a thread, in
       registers and shuffles (_primitives.sort_desc_any); the first kk are the best

Why it is exact: the floor and each bin edge only ever drop keys that kk others outrank
(``_find_threshold_digit`` counts from the top), and the final order is the packed key's,
"key descending, id ascending", the reference's rank order. When all 32 bits are resolved
and the ties at the kk-th key still do not fit CAND_CAP (rows of many equal logits, e.g.
``-inf`` padding), the block runs the two-pass select (``draft_topk._select_top``) on its
slice instead: a second read, exact, with its ties taken in id order. Correctness never
depends on the data; speed does, a little (the floor F is loose when a row's large logits
sit in a few threads' registers, and 0 when a warp has fewer than j threads holding logits:
then every key passes it and the histogram decides).

Barriers: two for each of the two block reductions (a warp shuffle tree, then one value a
warp in shared memory), two for the floor, the gather's scan (one: an open scan, closed by the
barrier after its writes) and that one, two a histogram round plus the digit search's two (its
open scan's and the one that publishes the digit) where a round runs, and the sort's (about
20 at 512 candidates).

Precision: the sum is float32 over ``LOGITS_PER_THREAD`` terms a thread, one rescale of it
(a multiply by an ``ex2``: about three roundings) and a block reduction (``log2 T`` more
additions), so a part's ``s`` carries at most about ``LOGITS_PER_THREAD + 3 + log2 T``
float32 epsilons; the merge adds its three a part. (The tests' bound, ``error_bound`` in
``tests/test_draft_topk.py``, is looser: it allows 16 epsilons for the block's reduction.)
A term is ``exp2((x - m) log2 e)`` after one multiply, by libdevice's ``exp2f``: the
hardware's ``ex2`` (about ``2**-22`` relative) inside a range test that keeps results below
``2**-126`` rather than flushing them to 0 as ``draft_topk_filtered``'s ``exp2_ftz`` does.
That adds at most ``(2 + 1.2 ln V) 2**-23`` relative error to the sum.

The simulator runs this kernel as it is (64 threads, 8 logits a thread, so slices of 512
logits): the reductions and the sort have simulator versions in ``_primitives``.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, int64, uint32, uint64

from ._device import SIMULATOR, kernel_for_block
from ._primitives import (
    block_inclusive_scan_open,
    block_max_u32,
    block_scan_scratch,
    block_sum_f32,
    float_of_key,
    orderable_key,
    shr_u32,
    sort_desc_any,
)
from .draft_topk import (
    BINS,
    MAX_THREADS,
    MERGE_SLOTS,
    NEG_INF,
    SORT_CAP,
    _find_threshold_digit,
    _select_top,
    _write_top,
    merge_parts,
    select_shared,
    store_part,
)

RESIDENT_THREADS = 64 if SIMULATOR else 512     # whole warps, <= MAX_THREADS
LOGITS_PER_THREAD = 8 if SIMULATOR else 48      # a multiple of 4: whole words of either type
SLICE_CAP = RESIDENT_THREADS * LOGITS_PER_THREAD  # logits a block holds (24 576 on a GPU)
CAND_CAP = RESIDENT_THREADS                     # candidates sorted, one a thread
RESIDENT_MAX_K = RESIDENT_THREADS // 2          # k <= T (the floor) with room for ties
ROUND_BINS = 256                                # histogram bins a round: 8 bits of the key
KEY_NEG_INF = uint32(0x007FFFFF)                # orderable_key of -inf's bits 0xFF800000
LOG2E = float32(1.4426950408889634)             # exp(x) = exp2(x log2 e)
SCAN_SCRATCH = block_scan_scratch(RESIDENT_THREADS)
assert RESIDENT_THREADS <= MAX_THREADS and ROUND_BINS <= BINS and CAND_CAP <= SORT_CAP
assert MERGE_SLOTS <= SORT_CAP                  # the last block merges in ``cand``
assert SCAN_SCRATCH <= MAX_THREADS              # the two-pass fallback's scratch is as long


@cuda.jit(device=True, inline="always")
def _warp_floor(top_t, kk, tid, lane_max):
    """The floor of phase 1, from each thread's largest key ``top_t`` (0: it holds none):
    the smallest over the warps of the warp's ``j``-th largest ``top_t``, ``j = ceil(kk /
    warps)``; 0 where a warp has fewer than ``j`` threads holding keys (then every key
    passes the floor). All threads of the block call it; every thread returns the same
    value. ``lane_max`` (``uint64``, at
    least ``T + T / 32`` entries, free until the gather) holds the maxima, then the warps'
    floors. Two barriers; the caller's next barrier must come before ``lane_max`` is
    written again."""
    T = RESIDENT_THREADS
    lane = tid & 31
    warp = tid >> 5
    warps = T >> 5
    j = (kk + warps - 1) // warps               # <= 32: kk <= RESIDENT_MAX_K
    lane_max[tid] = uint64(top_t)
    cuda.syncthreads()                          # every thread's max in place
    # this thread's rank among its warp's 32 maxima (ties: the lower lane first), by reading
    # all 32: every lane reads the same entry at once (a broadcast, no bank conflict)
    rank = int32(0)
    for other in range(32):
        v = uint32(lane_max[warp * 32 + other])
        if v > top_t or (v == top_t and other < lane):
            rank = int32(rank + 1)
    if rank == j - 1:                           # ranks are distinct: one lane a warp
        lane_max[T + warp] = uint64(top_t)
    cuda.syncthreads()                          # every warp's j-th largest in place
    floor = uint32(0xFFFFFFFF)
    for w in range(warps):
        floor = min(floor, uint32(lane_max[T + w]))
    return floor


@cuda.jit(device=True, inline="always")
def _histogram_edge(keys, key_max, floor, kk, tid, hist, scratch, result):
    """An edge that at least ``kk`` and at most ``CAND_CAP`` of the block's keys reach, by
    rounds of a 256-bin histogram over ``[low, top]`` (at first ``[floor, key_max]``, then
    the bin of the ``kk``-th key with 8 bits less of shift), or 0 when ties at one key
    crowd the candidates (or fewer than ``kk`` keys reach the floor). All threads of the
    block call it (it has barriers); every thread returns the same value."""
    T = RESIDENT_THREADS
    top = key_max
    low = floor
    span = uint32(top - low) if top >= low else uint32(0)   # (top < low: all keys 0)
    shift = uint32(0)
    while (span >> shift) >= uint32(ROUND_BINS):   # the smallest multiple of 8 fitting
                                                # 256 bins (each later round: 8 bits more)
        shift = uint32(shift + 8)
    need = kk                                   # rank of the kk-th key among keys <= top
    above = 0                                   # keys > top (bins of earlier rounds)
    while True:
        for d in range(tid, ROUND_BINS, T):
            hist[d] = 0
        cuda.syncthreads()                      # bins cleared before the atomics; every
                                                # thread has read the last round's result
        if tid == 0:
            result[0] = -1                      # stays if no bin holds the need-th key
        for i in range(LOGITS_PER_THREAD):
            key = keys[i]
            if key >= low and key <= top:       # bin 255 holds top, bin 0 the lowest keys
                bin_down = int32(shr_u32(uint32(top - key), shift))   # 32-bit ops only
                cuda.atomic.add(hist, int32(ROUND_BINS - 1 - bin_down), 1)
        cuda.syncthreads()                      # histogram complete
        _find_threshold_digit(hist, ROUND_BINS, need, scratch, result, tid, T)
        if result[0] < 0:                       # fewer keys in range than need
            return uint32(0)
        b = uint32(result[0])                   # the bin of the need-th key from the top
        above += result[1]                      # keys in the bins above b
        need -= result[1]
        in_bin = result[2]
        # bin b's keys: [bin_top - width + 1, bin_top], cut at low (signed: bin 0's lower
        # edge may lie below key 0)
        bin_top = int64(top) - int64((uint32(ROUND_BINS - 1) - b) << shift)
        bin_width = int64(1) << shift
        bin_low = uint32(max(int64(low), bin_top - (bin_width - 1)))
        if above + in_bin <= CAND_CAP:
            return bin_low
        if shift == 0:                          # ties at one key crowd the candidates
            return uint32(0)
        top = uint32(bin_top)                   # (>= low here: it holds the need-th key)
        low = bin_low
        shift = uint32(shift - 8)               # bin_top - bin_low < 2 ** (shift + 8)


def _make_resident_kernels(bf16: bool):
    """``(whole_row_kernel, part_kernel)`` for float32 (``bf16=False``) or bfloat16 words."""
    per_word = 4 if bf16 else 2                 # logits an 8-byte word holds
    words_per_thread = LOGITS_PER_THREAD // per_word
    value_bits = 16 if bf16 else 32
    value_mask = uint64(0xFFFF if bf16 else 0xFFFFFFFF)
    _, select_top = _select_top(bf16)           # the fallback

    @cuda.jit(device=True, inline="always")
    def float_bits(word, j):
        """The float32 bits of logit ``j`` of an 8-byte word (little-endian: logit 0 is the
        low half or quarter; a bfloat16 is the top half of a float32)."""
        value = uint32((word >> uint64(value_bits * j)) & value_mask)
        return value << uint32(16) if bf16 else value

    @cuda.jit(device=True, inline="always")
    def _gather(keys, edge, wlo, tid, cand, scratch):
        """How many of the block's keys are ``>= edge`` (every thread gets the count); when
        they fit ``CAND_CAP``, also writes them to ``cand`` packed as ``key << 32 | ~id``,
        each thread's at its place in a block scan of the counts (no atomics, so no
        contended counter). All threads of the block call it; it ends with a barrier."""
        count = int32(0)
        for i in range(LOGITS_PER_THREAD):
            if keys[i] >= edge:
                count = int32(count + 1)
        # (an open scan: the barrier after the candidates closes it)
        inclusive, found = block_inclusive_scan_open(scratch, count, tid, RESIDENT_THREADS)
        if found <= CAND_CAP:                   # (the same for every thread)
            slot = int32(inclusive - count)     # this thread's first slot
            # Two constant loops over (word, logit), not one over the 48 keys: keys[] stays in
            # registers only if the loop unrolls, and NVVM 13.0 left a flat 48-step loop rolled
            # for sm_120 (keys[] in a 192 B local-memory frame; 13.5 and sm_90 unrolled it)
            first_id = uint32((wlo + tid) * per_word)   # logit 0 of the thread's word 0
            for u in range(words_per_thread):
                for j in range(per_word):
                    key = keys[u * per_word + j]
                    if key >= edge:             # logit j of word wlo + u * T + tid
                        logit_id = first_id + uint32(u * RESIDENT_THREADS * per_word + j)
                        cand[slot] = ((uint64(key) << uint64(32))
                                      | uint64(0xFFFFFFFF - logit_id))
                        slot = int32(slot + 1)
        cuda.syncthreads()                      # every candidate written
        return int32(found)

    # The kernels call the phases one after the other: load_keys (1, 2), find_candidates (3),
    # then the sort (4) or, where the candidates cannot answer, the two-pass select. (Phase
    # helpers rather than one helper for the whole select: numba inlines a helper by copying
    # its IR, at a cost that grows with its size squared; splicing in one helper holding the
    # whole select was about 40 % of each kernel's compile time.)

    @cuda.jit(device=True, inline="always")
    def load_keys(words, wlo, whi, k, tid, keys, cand, red_u, red_f):
        """Phases 1 and 2 on ``words[wlo:whi]`` of one row (every thread calls it): each
        thread's keys into its ``keys`` (registers: a local array indexed by constants).
        Returns ``(m, s, kk, key_max, floor)``: the slice's max logit, its sum of
        ``exp(x - m)``, ``kk = min(k, logits)``, the block's max key and the floor F."""
        T = RESIDENT_THREADS
        raw = cuda.local.array(words_per_thread, uint64)
        for u in range(words_per_thread):       # every load in flight before any is used
            w = uint64(wlo) + uint64(u * T + tid)
            raw[u] = words[w] if w < uint64(whi) else uint64(0)
        top_t = uint32(0)                       # this thread's largest key (0: holds none)
        for u in range(words_per_thread):
            held = uint64(wlo) + uint64(u * T + tid) < uint64(whi)
            for j in range(per_word):
                key = orderable_key(float_bits(raw[u], j)) if held else uint32(0)
                keys[u * per_word + j] = key
                top_t = max(top_t, key)
        # the thread's own sum of exp(x - m_t), m_t its largest logit, before any barrier:
        # a warp whose loads came in early sums while the block waits for the rest (a -inf
        # logit adds nothing; s_t = 0 where the thread holds no finite logit). Each term as
        # exp2((x - m_t) log2 e): one multiply and libdevice's exp2f (precision above)
        m_t = float_of_key(top_t)
        s_t = float32(0.0)
        if top_t > KEY_NEG_INF:
            for i in range(LOGITS_PER_THREAD):
                if keys[i] > KEY_NEG_INF:
                    s_t += math.exp2((float_of_key(keys[i]) - m_t) * LOG2E)

        # 1. the block's max key M (-> the max logit m), and the floor F: warp w's j-th
        #    largest thread maximum f_w (j = ceil(kk / warps)) has j threads of warp w at or
        #    above it, so F = min_w f_w has j logits of every warp, kk in all, at or above
        #    it: nothing below F can be among the best kk
        kk = min(k, (whi - wlo) * per_word)
        key_max = block_max_u32(red_u, top_t, tid, T)
        floor = _warp_floor(top_t, kk, tid, cand)
        floor = max(floor, uint32(1))           # never the "none" key 0 (past the slice)

        # 2. sum of exp(x - m): each thread's s_t (above) rescaled to the block's max m by
        #    exp(m_t - m), then a block sum (m = -inf when every logit is: no thread has a
        #    term). Its barriers also separate the floor's reads of cand from the gather's
        #    writes
        m = float_of_key(key_max)
        s = s_t * math.exp2((m_t - m) * LOG2E) if s_t > float32(0.0) else s_t
        total = block_sum_f32(red_f, s, tid, T)
        return m, total, kk, key_max, floor

    @cuda.jit(device=True, inline="always")
    def find_candidates(keys, key_max, floor, kk, wlo, tid, cand, hist, scratch, result):
        """Phase 3 (every thread calls it, after :func:`load_keys`): gathers the candidates
        into ``cand``. Returns ``(found, edge)``: ``found`` candidates, all keys at or above
        ``edge``; ``edge == 0`` where they cannot answer (ties crowd them, or fewer than
        ``kk`` keys reach the floor: key-0 NaNs of an unchecked row), and the block must run
        the two-pass select on its slice."""
        # 3. the candidates: the keys >= F, most often few enough to gather at once; else
        #    a histogram finds a higher edge that lets at most CAND_CAP through (two passes
        #    of the loop at most: the second edge's keys always fit)
        edge = floor
        while True:
            found = _gather(keys, edge, wlo, tid, cand, scratch)
            if found < kk:                      # only key-0 NaNs of an unchecked row
                edge = uint32(0)
                break
            if found <= CAND_CAP:               # gathered
                break
            edge = _histogram_edge(keys, key_max, floor, kk, tid, hist, scratch, result)
            if edge == 0:                       # ties at one key crowd the candidates
                break
        return found, edge

    @kernel_for_block(RESIDENT_THREADS)
    def whole_row_kernel(words, bits, k, top_log_probs, top_token_ids):
        """Grid ``(rows,)``, block ``(RESIDENT_THREADS,)``: row ``words[row]`` (at most
        ``SLICE_CAP`` logits) -> its K outputs."""
        row_id = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        cand = cuda.shared.array(SORT_CAP, uint64)  # candidates; the fallback's; the merge's
        hist, scratch, result, red_u, red_f, n_cand = select_shared()
        row_words = words[row_id]
        row_bits = bits[row_id]
        n_words = words.shape[1]
        keys = cuda.local.array(LOGITS_PER_THREAD, uint32)
        m, total, kk, key_max, floor = load_keys(row_words, 0, n_words, k, tid, keys, cand,
                                                 red_u, red_f)
        found, edge = find_candidates(keys, key_max, floor, kk, 0, tid, cand, hist, scratch,
                                      result)
        if edge == 0:
            # the two-pass select on the row (it reads the row again; a uniform branch)
            m, total, _ = select_top(row_bits, 0, n_words * per_word, k, tid, RESIDENT_THREADS,
                                     cand, hist, scratch, result, red_u, red_f, n_cand)
        else:
            # 4. sort the candidates, descending (one a thread, in registers and shuffles)
            sort_desc_any(cand, found, tid, RESIDENT_THREADS)
        lse = m + math.log(total) if m > NEG_INF else NEG_INF
        _write_top(cand, k, lse, row_id, tid, RESIDENT_THREADS, top_log_probs, top_token_ids)

    @kernel_for_block(RESIDENT_THREADS)
    def part_kernel(words, bits, k, chunk, part_keys, part_max, part_sum, row_done,
                    top_log_probs, top_token_ids):
        """Grid ``(rows, parts)``: block ``(row, p)`` selects in ``words[row, p * chunk:(p +
        1) * chunk]`` (``chunk <= SLICE_CAP / per_word`` words) and writes what the two-pass
        part kernel writes: its best ``k`` packed candidates sorted (``0`` past the slice's
        length), its max logit and its sum of ``exp(x - max)``. The row's last block to finish
        (``row_done[row]``: an atomic count of arrivals that wraps to 0) then merges the row's
        parts (``draft_topk.merge_parts``) and writes its K outputs: one launch a call."""
        row_id = cuda.blockIdx.x
        p = cuda.blockIdx.y
        parts = cuda.gridDim.y
        tid = cuda.threadIdx.x
        n_words = words.shape[1]
        lo = min(p * chunk, n_words)
        hi = min(lo + chunk, n_words)
        cand = cuda.shared.array(SORT_CAP, uint64)  # candidates; the fallback's; the merge's
        hist, scratch, result, red_u, red_f, n_cand = select_shared()
        if lo == hi:                            # an empty slice: no candidates
            store_part(cand, 0, NEG_INF, float32(0.0), row_id, p, k, tid, RESIDENT_THREADS,
                       part_keys, part_max, part_sum)
        else:
            row_words = words[row_id]
            row_bits = bits[row_id]
            keys = cuda.local.array(LOGITS_PER_THREAD, uint32)
            m, total, kk, key_max, floor = load_keys(row_words, lo, hi, k, tid, keys, cand,
                                                     red_u, red_f)
            found, edge = find_candidates(keys, key_max, floor, kk, lo, tid, cand, hist,
                                          scratch, result)
            if edge == 0:
                # the two-pass select on the slice (it reads the slice again; uniform)
                m, total, kk = select_top(row_bits, lo * per_word, hi * per_word, k, tid,
                                          RESIDENT_THREADS, cand, hist, scratch, result, red_u,
                                          red_f, n_cand)
            else:
                # 4. sort the candidates, descending (one a thread, in registers and shuffles)
                sort_desc_any(cand, found, tid, RESIDENT_THREADS)
            store_part(cand, kk, m, total, row_id, p, k, tid, RESIDENT_THREADS, part_keys,
                       part_max, part_sum)
        # Count this part done (as verify_attn's fused merge does). Each thread's fence orders
        # its stores before the barrier, the barrier before thread 0's count of arrivals;
        # atomic.inc wraps to 0 after the last part, so every count is 0 again for the next
        # launch, with no reset. The last block's threads fence again before they read what
        # the other parts wrote.
        cuda.threadfence()                      # this thread's stores are visible GPU-wide
        cuda.syncthreads()                      # ... and so every thread's of this block
        if tid == 0:
            arrived = cuda.atomic.inc(row_done, row_id, uint32(parts - 1))
            # (result, the select's scratch, is free after store_part: here the flag)
            result[0] = 1 if arrived == uint32(parts - 1) else 0
        cuda.syncthreads()                      # the flag is set
        if result[0] == 1:                      # the row's last block (a uniform branch)
            cuda.threadfence()                  # (in every thread, before its reads)
            merge_parts(part_keys, part_max, part_sum, row_id, k, cand, red_f, tid,
                        RESIDENT_THREADS, top_log_probs, top_token_ids)

    return whole_row_kernel, part_kernel


#: ``resident_kernels(bf16)``: the two kernels for float32 or bfloat16 logits, made once.
resident_kernels = functools.cache(_make_resident_kernels)
