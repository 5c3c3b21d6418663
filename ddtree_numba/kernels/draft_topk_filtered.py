"""Draft top-K in one pass over the logits: ``kernels.draft_topk(..., variant="filtered")``.

The two-pass kernel (``draft_topk.py``) reads every row twice and pays a contended shared
atomic for every logit (its histogram): at bs = 64, V = 163 840 it runs at 17 % of the copy
bandwidth. This variant reads each logit once and, for almost every logit, does nothing but a
compare with a running *threshold key*; the exact selection then runs over the few thousand
logits that passed it.

**Why a threshold may drop logits.** Rank order is "key descending, id ascending" (the
orderable keys of ``_primitives``). If at least ``k`` logits of the slice have a key ``>= t``,
a logit whose key is below ``t`` is outranked by all of them and cannot be among the best
``k``: ``t`` is a *valid floor*. A logit whose key equals ``t`` may still be (smaller id), so
it is kept. Every floor below is valid by construction but one, the guessed floor, which is
checked before the result trusts it; so the held logits always contain the slice's best ``k``
(or the block reads its slice again), and the result is the same ids as the reference, bit
for bit.

Who touches what, for a block of ``FILTER_THREADS`` threads (``WARPS`` warps) on the slice of
``words[wlo:whi]`` of a row (a *word* is 8 bytes: two float32 or four bfloat16 logits)::

    per thread   the online log-sum-exp of the logits it loads: m (max), s (sum of exp(x - m),
                 rescaled by exp(m_old - m) when a tile raises m)
    per warp     a held set buf[w * WARP_CAP : (w + 1) * WARP_CAP] of packed candidates
                 (key << 32 | ~id), its count n and its floor (all held keys >= floor), in
                 registers that every lane of the warp agrees on; warps never wait for each
                 other inside the loop (no block barrier there)
    per block    floor_b[0]: the largest floor any warp has found (a shared atomic max);
                 every warp filters with max(own floor, floor_b[0]); floor_b[1]: the
                 guessed floor, every warp's first own floor

The loop: warp ``w`` takes tiles ``w, w + WARPS, ...`` of ``32 * LOADS`` words; lane ``l``
loads words ``tile + u * 32 + l`` for ``u < LOADS`` (a 256-byte coalesced row across the warp
for each ``u``; ``LOADS`` is ``WORDS`` for float32 and ``WORDS / 2`` for bfloat16: ``2 * WORDS``
logits a lane either way). The loads of a warp's next tile are issued before its current tile
is used (``ahead``, then copied to ``word``): ``LOADS`` 8-byte loads stay in flight a lane while it
computes, so DRAM latency overlaps the work. A bfloat16 tile is half a float32 tile's bytes for
the same work, and on the H200 its loop took as long as float32's (one tile in flight a warp:
half the bytes in flight), so bfloat16 keeps *two* tiles in flight (``AHEAD_TILES``): the loop
filters two tiles an iteration, the first from ``ahead``, the second from ``ahead2``, and each
call reloads its own buffer with the tile two further on, so a load has two tiles' work to
arrive in. (Two calls of ``filter_tile``, not a loop over a pair of buffers: a buffer index that
is not a constant put them in local memory. Rotating the buffers by copies cannot work: a copy
of a register waits for its load. Float32 with two tiles in flight spills 8 bytes on sm_90 at
the 128-register bound, and so does bfloat16's row-slices kernel: both keep one.) Each lane
marks the logits at or above the filter in a bit mask ``passing``. If no lane has one
(``ballot``: the case the filter is for; at bs 64, V 163 840, K 256 on the H200 every tile
still had one before the guessed floor below, ``benchmarks/NOTES.md``) the tile costs its
loads, its max and its ``exp``; and where no lane's tile max reaches the cut (one ``ballot``
before the per-logit compares) not even the mask.
Otherwise a warp scan of the lanes' counts places them: when all fit the held set, lane ``l``
writes its own at ``n +`` (those of the lanes below it), from registers (the *fast append*).
When they would not fit, the tile is appended one value position at a time, a ``ballot`` of who
passes and each passing lane writing at ``n + popc(ballot & lanes_below)``, compacting whenever
the next position would not fit (the *slow append*: a few tiles a row). The filter is
``not (x < cut)``: a NaN (outside the contract, but a device array is not checked by default)
is held, never dropped (a lane that meets one in a tile skips the cheap exit there), so the
held set always contains the slice's best ``kk`` by key and every id written is a real one.
``floor_b`` is read without a fence: a stale value is a lower floor, still valid.

**Compaction** (one warp, when an append would pass ``WARP_CAP``): find a key ``t`` with at
least ``k`` held keys ``>= t``, as high as cheaply possible, and drop the held keys below it.
A 256-bin histogram of ``(key - floor) >> shift`` (``shift`` such that the held keys' span
fits 256 bins; the warp's own 256 counters in ``hist``) and a warp scan from the top bin find
the bin holding the ``k``-th key; while that bin is crowded (more than ``k + 32`` keys at or
above its lower edge) the next 8 bits refine it. The bin's lower edge is the new floor.
If ties at one exact key keep the warp full even so, the block falls back (below).

**The guessed floor.** A warp's own floor rises only as its held set fills: it is the
``kk``-th best of the eighth of the slice that warp has read, raised at a compaction. At
V 163 840, K 256 that let about 13 000 logits a row into the held sets and cost each warp
about five compactions (``benchmarks/NOTES.md``), where a floor near the slice's ``kk``-th key
would let in a few times ``kk``. So before the loop, while the first tile's loads are in
flight, the block guesses one from a sample: thread ``t`` loads words ``wlo + u seg + t``
(``u < LOADS``, ``seg = (whi - wlo) / LOADS``: ``LOADS`` coalesced chunks of
``FILTER_THREADS`` words spread over the slice; ``S`` = 4 096 logits on a GPU, 2.5 % of a
163 840-logit row) and takes the largest key among them; in each warp the lane whose maximum
ranks ``r``-th lowers ``floor_b[1]`` to it (a shared atomic min), so the guess is the
smallest of the warps' ``r``-th largest maxima, and each warp starts with it as its floor.

Nothing makes the guess valid: ``kk`` logits of the slice need not reach it. It is checked at
the end. Every logit whose key is at or above ``cut = max(guess, floor_b[0])`` is held (the
filter drops only keys below the cut, which never rises above that, and a compaction drops only
keys below its new floor), so if at least ``kk`` held keys reach ``cut`` they include the best
``kk``, and the final select runs over them; otherwise the block takes the two-pass fallback (a
second read, exact). The held keys are counted (by the final select's first histogram) rather
than trusting a compaction's floor: a compaction counts the warp's keys from its floor, the
guess, up, but a NaN (outside the contract) whose key is below the guess's still passes the
filter (``not x < cut``), so a warp can be full of keys its histogram does not see.

``r = ceil((2 kk S / logits + 2) / 9)``, at most ``GUESS_MAX_RANK`` (else no guess): in a model
of the guess (8 warps; rows of normal, Gumbel and Zipf-shaped logits in random order) the share
of a slice that reaches a rank-``r`` guess was about ``(12.8 r + 7) / S`` at the median and
``(9 r - 2) / S`` at the first percentile, and this ``r`` puts the first percentile at ``2 kk``
logits: at V 163 840, K 256, ``r = 2`` and ~1 400 logits a row reach the guess (the fewest in
300 rows: 484); for K 16..128, ``r = 1`` and ~800. A row whose large logits all avoid the
sample's chunks pays the second read.

**The end.** Each warp finds its largest held key as its loop ends (``tops``). After a block
barrier: the block's ``max`` and sum of ``exp`` (a block max of ``m``, each ``s`` rescaled to
it, a block sum); an exact radix select over the held keys at or above ``cut_key =
max(floor_b[0], floor_b[1])`` for the ``kk``-th largest key, whose first level's 2 048 bins
cover the held keys' own span ``[cut_key, largest held key]`` (``2**shift`` keys a bin): the
held keys (about 1 400 a row at V 163 840, K 256) spread over a narrow span, so one level finds
a bin that holds few enough keys in nearly every row (a level of fixed 11-bit digits of the key
took two at K 256; while the bin is crowded, the next level spreads its keys over the bins,
three levels at most); the held logits at or above the lower edge of that bin (those above it
and all in it, at most ``TOP_CAP``) gathered into ``top`` and sorted (bitonic, descending
packed keys). Each level and the gather read only the held entries (``counts``). Where a warp
overflowed, fewer than ``kk`` held keys reach the guess, or the ties at the ``kk``-th key do
not fit ``TOP_CAP`` (rows of many equal logits, e.g. all ``-inf``), the block runs the two-pass
select on its slice instead (a second read of the slice, exact, with its ordered-ties path):
correctness never depends on the data.

Rows must be whole words (``V`` a multiple of 2 for float32, of 4 for bfloat16, 8-byte
aligned) and ``k <= FILTER_MAX_K`` (a warp's held set must have room above ``k``); the
launcher refuses the variant otherwise. Rows of many equal logits (e.g. ``-inf`` padding) take
the fallback: a floor is a key, and ties at it are kept.

Precision: tiles are dealt whole, so a lane sums at most ``V / (parts * FILTER_THREADS)`` terms
plus one tile's share (``2 * WORDS`` logits); a rescale (at most one a tile) adds about three
roundings; combining the threads adds about ``log2(FILTER_THREADS) + 3``. A term is
``exp2((x - m) log2 e)``: the hardware's ``ex2`` (``_primitives.exp2_ftz``: relative error
about ``2**-22``; terms below ``2**-126`` become 0, less than ``V * 2**-126`` of a sum that
holds a term 1) after one multiply, whose rounding (and that of ``LOG2E``,
``1.1 * 2**-24`` relative) makes a relative error of about ``1.1 |x - m| 2**-23`` in the term;
weighted by the terms (the softmax) ``|x - m|`` averages at most ``ln V``, so the sum gains at
most ``(2 + 1.2 ln V) 2**-23`` relative error (about 16 units of float32 rounding at
``V = 163 840``, against ~640 from the summation). ``tests/test_draft_topk.py`` checks that
bound.

Warp intrinsics (``ballot_sync``, ``shfl_sync``, ``syncwarp``): a GPU variant; the simulator
runs it only through the tests' emulated shuffles.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, uint32, uint64

from ._device import SIMULATOR, kernel_for_block
from ._primitives import (
    FULL_MASK,
    bits_to_float,
    block_max,
    block_scan_scratch,
    block_sum,
    exp2_ftz,
    float_of_key,
    orderable_key,
    shr_u32,
    sort_desc_any,
    warp_inclusive_scan,
    warp_max_key,
)
from .draft_topk import (
    BINS,
    NEG_INF,
    SORT_CAP,
    _find_threshold_digit,
    _select_top,
    _write_top,
    store_part,
)

FILTER_THREADS = 64 if SIMULATOR else 256   # whole warps
WARPS = FILTER_THREADS // 32
WARP_CAP = 128 if SIMULATOR else 512        # candidates a warp holds
FILTER_MAX_K = WARP_CAP // 2                # room above k for the appends between compactions
TOP_CAP = 2 * FILTER_MAX_K                  # the final sort: kk - 1 + the ties at the kk-th key
WORDS = 2 if SIMULATOR else 8               # float32: 8-byte loads a lane a tile
LOG2E = float32(1.4426950408889634)       # exp(x) = exp2(x log2 e)
WARP_BINS = 256                             # a compaction's histogram, per warp
BLOCKS_PER_SM = 2                           # blocks an SM runs at once: <= 128 registers
COUNTS = WARPS + 1                          # held per warp, and the overflow flag
GUESS_MAX_RANK = 8                          # the guessed floor's rank in a warp, at most
AHEAD_TILES = {False: 1, True: 2}           # a warp's tiles in flight: float32, bfloat16
SCAN_SCRATCH = block_scan_scratch(FILTER_THREADS)
assert WARPS * WARP_CAP <= SORT_CAP and WARPS * WARP_BINS <= BINS


@cuda.jit(device=True, inline="always")
def _key_of(packed):
    return uint32(packed >> uint64(32))


@cuda.jit(device=True, inline="always")
def _cut_of(key):
    """The float a logit must reach to pass the filter of key ``key`` (0: no filter yet)."""
    return NEG_INF if key == 0 else float_of_key(key)


@cuda.jit(device=True, inline="always")
def _held_top(buf, base, n, lane):
    """Warp-collective: the largest key of the held set ``buf[base : base + n]`` (0 when it is
    empty), in every lane. Lane ``l`` reads entries ``l, l + 32, ...``."""
    cuda.syncwarp()                         # the lanes' appends to buf visible to the warp
    top = uint32(0)
    for j in range(lane, n, 32):
        top = max(top, _key_of(buf[base + j]))
    return warp_max_key(top)


@cuda.jit(device=True, inline="always")
def _compact(buf, base, n, floor, need, hist, hbase, lane, lanes_below):
    """Warp-collective (all 32 lanes, uniform arguments): raise the floor of the held set
    ``buf[base : base + n]`` (``n > need``) to the lower edge of the histogram bin that holds
    its ``need``-th largest key at or above ``floor``, drop the keys below, and return
    ``(new n, new floor)``. Held keys are ``>= floor`` but for one kind the filter's float
    compare lets through: a NaN (outside the contract), whose key may lie below the floor's.
    When fewer than ``need`` keys reach ``floor`` the floor stays and those below it are
    dropped; that takes such NaNs under a guessed floor, which the end checks (module
    notes). (A ``-0.0`` under a ``+0.0`` floor is not below it: both have one key.)"""
    top = _held_top(buf, base, n, lane)
    lo = floor                              # the bins cover [lo, hi] ...
    hi = top
    # ... in 256 bins of 2**shift keys. (uint32() throughout: numba widens uint32 - uint32
    # to 64 bits, and clz of a 64-bit span would be 32 more, the shift 0, the bins past 255).
    # hi < lo only where every held key is below the floor (NaNs, see above): no key is in
    # range, the new floor is lo and the keep pass drops them all
    span = uint32(hi - lo) if hi >= lo else uint32(0)
    # the smallest shift with (span >> shift) < 256 = WARP_BINS: span has 32 - clz bits,
    # of which the top 8 stay
    shift = uint32(max(0, 24 - cuda.clz(span))) if span > 0 else uint32(0)
    above = 0                               # held keys above [lo, hi]
    b = 0
    run = 0
    while True:
        for i in range(lane, WARP_BINS, 32):
            hist[hbase + i] = 0
        cuda.syncwarp()                     # cleared before the atomics
        for j in range(lane, n, 32):
            key = _key_of(buf[base + j])
            if lo <= key and key <= hi:
                cuda.atomic.add(hist, hbase + int32(uint32(key - lo) >> shift), 1)
        cuda.syncwarp()                     # counted before the scan reads
        # lane l sums bins 255 - 8 l .. 248 - 8 l (the top bins first: 8 = WARP_BINS / 32
        # bins a lane); a warp scan of those sums finds the lane whose bins hold the
        # need-th key counted from the top
        first = WARP_BINS - 1 - 8 * lane
        local = 0
        for q in range(8):
            local += hist[hbase + first - q]
        incl = warp_inclusive_scan(int32(local), lane)
        excl = incl - local
        hit = above + excl < need and need <= above + incl
        hits = cuda.ballot_sync(FULL_MASK, hit)
        if hits == 0:                       # fewer than need keys in [lo, hi] (first pass
            b = 0                           # only, NaNs below the floor): the floor stays
            break
        src = cuda.ffs(hits) - 1            # exactly one lane
        if hit:
            b = first
            run = above + excl
            for q in range(8):
                count = hist[hbase + first - q]
                if run + count >= need:
                    b = first - q
                    break
                run += count
        b = cuda.shfl_sync(FULL_MASK, b, src)           # the bin, and the keys above it
        run = cuda.shfl_sync(FULL_MASK, run, src)
        in_bin = cuda.shfl_sync(FULL_MASK, hist[hbase + b], src)
        # close enough: an edge that keeps at most 32 keys more than need spares a round,
        # and leaves the set at least WARP_CAP - FILTER_MAX_K - 32 free slots
        if shift == 0 or run + in_bin <= need + 32:
            break
        above = run                         # refine: the next 8 bits of bin b
        lo = uint32(lo + (uint32(b) << shift))
        hi = uint32(min(uint64(lo) + (uint64(1) << uint64(shift)) - uint64(1),
                        uint64(0xFFFFFFFF)))
        shift = uint32(max(0, int32(shift) - 8))
        cuda.syncwarp()                     # every lane read hist before it is cleared
    new_floor = uint32(lo + (uint32(b) << shift))
    kept = 0
    for c in range(0, n, 32):               # keep keys >= new_floor, in order, in place
        j = c + lane
        packed = buf[base + j] if j < n else uint64(0)
        keep = j < n and _key_of(packed) >= new_floor
        mask = cuda.ballot_sync(FULL_MASK, keep)
        cuda.syncwarp()                     # the chunk read before any lane writes over it
        if keep:                            # (to kept + rank <= j: never an unread entry)
            buf[base + kept + cuda.popc(mask & lanes_below)] = packed
        kept += cuda.popc(mask)
    cuda.syncwarp()                         # the compacted set visible to the whole warp
    return kept, new_floor


@cuda.jit(device=True, inline="always")
def _compact_and_share(buf, base, n, floor, need, hist, hbase, lane, lanes_below, floor_b):
    """Warp-collective (all 32 lanes, uniform arguments; every lane makes the same atomic,
    which is harmless). ``_compact``, then the new floor shared with the block (a shared
    atomic max: a warp's floor is valid for all where the warp's own is, i.e. always without
    a guessed floor, and under one as far as the guess is, which the end checks) and the
    filter's new cut, ``max(own floor, the block's)``. Returns ``(new n, new floor, cut)``."""
    n, floor = _compact(buf, base, n, floor, need, hist, hbase, lane, lanes_below)
    cuda.atomic.max(floor_b, 0, floor)
    return n, floor, _cut_of(max(floor, floor_b[0]))


def _make_filtered_kernels(bf16: bool, guess: bool = True, ahead_tiles: int | None = None):
    """``(whole_row_kernel, part_kernel)`` of the one-pass select, float32 or bfloat16;
    ``guess=False`` leaves out the guessed floor (the held sets' own floors only);
    ``ahead_tiles`` (1 or 2; ``AHEAD_TILES[bf16]`` by default; see ``filtered_kernels``): a
    warp's tiles in flight while it filters one (2: the loop filters two tiles an iteration,
    each from its own buffer of registers). The results do not depend on it: a warp filters the
    same tiles in order."""
    if ahead_tiles is None:
        ahead_tiles = AHEAD_TILES[bf16]
    if ahead_tiles not in (1, 2):
        raise ValueError(f"ahead_tiles: expected 1 or 2, got {ahead_tiles!r}")
    per_word = 4 if bf16 else 2             # logits in an 8-byte word
    AHEAD = ahead_tiles                     # a warp's tiles in flight
    WORD_SHIFT = 2 if bf16 else 1           # log2(per_word)
    # 8-byte loads a lane a tile: 2 * WORDS logits for either type (bfloat16 with 4 * WORDS
    # would hold 32 logits a lane in registers twice over and spill on sm_90)
    LOADS = 2 * WORDS // per_word
    # -inf in every logit of a word (the value a word past the slice reads as)
    neg_inf_word = uint64(0xFF80FF80FF80FF80) if bf16 else uint64(0xFF800000FF800000)
    _, select_top = _select_top(bf16)

    @cuda.jit(device=True, inline="always")
    def value_bits(word, j):
        """float32 bits of logit ``j`` of an 8-byte word (little-endian: logit 0 lowest)."""
        if bf16:
            return uint32((word >> uint64(16 * j)) & uint64(0xFFFF)) << uint32(16)
        return uint32((word >> uint64(32 * j)) & uint64(0xFFFFFFFF))

    @cuda.jit(device=True, inline="always")
    def pass_mask(word, left, cut):
        """Bit ``u * per_word + j`` set where logit ``j`` of the lane's word ``u`` of the tile
        exists (``u * 32 < left``, ``left`` the words from the lane's word 0 of the tile to the
        slice's end) and is not below ``cut`` (``not x < cut``: a NaN passes). A lane holds
        ``2 * WORDS`` logits (the mask has room for 32); the loops unroll, so ``word`` stays in
        registers."""
        passing = uint32(0)
        for u in range(LOADS):
            valid = int32(u * 32) < left
            for j in range(per_word):
                if valid and not bits_to_float(value_bits(word[u], j)) < cut:
                    passing |= uint32(1) << uint32(u * per_word + j)
        return passing

    @cuda.jit(device=True, inline="always")
    def guess_rank(n_words, kk):
        """``r``: the guessed floor is the smallest over the warps of the warp's ``r``-th
        largest sample maximum; 0 (no guess) where the slice is shorter than the sample's
        ``LOADS`` chunks of ``FILTER_THREADS`` words, or where ``r`` would pass
        ``GUESS_MAX_RANK``. ``r = ceil((2 kk S / logits + 2) / 9)``, ``S`` the sample's
        logits: with it, at most one row in a hundred of the module notes' model lets fewer
        than ``2 kk`` logits reach the guess."""
        logits = n_words * per_word
        sample = FILTER_THREADS * LOADS * per_word
        if not guess or n_words < LOADS * FILTER_THREADS:
            return 0
        # ceil((2 kk S / logits + 2) / 9) in integers: (2 kk S + 2 logits) / (9 logits),
        # rounded up by 9 logits - 1 (whence the 11)
        r = (2 * kk * sample + 11 * logits - 1) // (9 * logits)
        return r if r <= GUESS_MAX_RANK else 0

    @cuda.jit(device=True, inline="always")
    def guess_floor(words, wlo, whi, r, tid, red_u, floor_b):
        """Warp-collective, every warp of the block: thread ``t`` loads words ``wlo + u seg +
        t`` (``u < LOADS``, ``seg = (whi - wlo) // LOADS``: ``LOADS`` coalesced chunks of
        ``FILTER_THREADS`` words spread over the slice) and takes the largest key of their
        logits; the lane whose maximum ranks ``r``-th in its warp (ties: the lower lane
        first) lowers ``floor_b[1]`` to it (a shared atomic min). ``red_u[tid]`` holds the
        thread's maximum meanwhile."""
        lane = tid & 31
        warp = tid >> 5
        seg = (whi - wlo) // LOADS
        top_t = uint32(0)
        for u in range(LOADS):
            sampled = words[uint64(wlo + u * seg + tid)]
            for j in range(per_word):
                top_t = max(top_t, orderable_key(value_bits(sampled, j)))
        red_u[tid] = top_t
        cuda.syncwarp()                     # the warp's 32 maxima in place
        rank = int32(0)                     # by reading all 32: broadcasts, no conflict
        for other in range(32):
            v = red_u[warp * 32 + other]
            if v > top_t or (v == top_t and other < lane):
                rank = int32(rank + 1)
        if rank == r - 1:                   # ranks are distinct: one lane a warp
            cuda.atomic.min(floor_b, 1, top_t)

    @cuda.jit(device=True, inline="always")
    def filter_tile(words, ahead, word, tile, whi, lane, lane64, stride, m, s, n, floor, kk,
                    buf, base, hist, hbase, lanes_below, floor_b):
        """Warp-collective: filter the warp's tile at ``tile``, whose words ``ahead`` holds
        (loaded ``AHEAD`` tiles before), and reload ``ahead`` with the tile ``AHEAD`` further
        on. Returns ``(m, s, n, floor, overflow)``: the lane's running max and sum of
        ``exp(x - m)``, the warp's held count and floor, and whether ties at the floor filled
        the held set (then the block falls back). ``word`` is scratch for the tile."""
        overflow = False
        for u in range(LOADS):
            word[u] = ahead[u]
        left = int32(whi - tile) - int32(lane)
        left_ahead = int32(left - AHEAD * stride)
        # issue the loads of the tile AHEAD further into the buffer just read, before using
        # this one (a word past whi reads as -inf and is never loaded), so that DRAM latency
        # overlaps the work below (and, with AHEAD 2, the next tile's work too)
        for u in range(LOADS):
            ahead[u] = (words[uint64(tile + AHEAD * stride) + lane64 + uint64(u * 32)]
                        if int32(u * 32) < left_ahead else neg_inf_word)
        # online log-sum-exp (a missing word reads as -inf: no term, no max); the terms
        # as exp2((x - m) log2 e): one multiply and one MUFU.EX2, flushing results below
        # 2**-126 to 0 (see the precision note)
        tile_max = NEG_INF
        for u in range(LOADS):
            for j in range(per_word):
                tile_max = max(tile_max, bits_to_float(value_bits(word[u], j)))
        if tile_max > m:
            if m > NEG_INF:
                s *= math.exp(m - tile_max)
            m = tile_max
        if m > NEG_INF:
            for u in range(LOADS):
                for j in range(per_word):
                    s += exp2_ftz((bits_to_float(value_bits(word[u], j)) - m) * LOG2E)
        # the filter: keys >= max(own floor, the block's)
        cut = _cut_of(max(floor, floor_b[0]))
        # first the cheap exit: no lane's tile max reaches the cut (nor has a lane met a
        # NaN, which the max skips and the filter holds: then s is NaN, or m is still
        # -inf), so no logit of the tile passes: skip the per-logit compares. (A lane
        # that has seen only -inf, e.g. past the slice's end, takes the compares too:
        # time, not a wrong result)
        reach = not tile_max < cut or not s == s or not m > NEG_INF
        if cuda.ballot_sync(FULL_MASK, reach) == 0:
            return m, s, n, floor, False    # (uniform: the whole warp skips)
        passing = pass_mask(word, left, cut)
        mine = cuda.popc(passing)
        if cuda.ballot_sync(FULL_MASK, mine > 0) == 0:
            return m, s, n, floor, False    # (uniform: the whole warp skips)
        # end: the lanes' inclusive sums of passing logits; lane 31's (arriving) is the
        # warp's. A compaction needs n > kk (it keeps at least the kk largest)
        end = warp_inclusive_scan(int32(mine), lane)
        arriving = cuda.shfl_sync(FULL_MASK, end, 31)
        if n + arriving > WARP_CAP and n > kk:
            # make room first: compact (raising the floor), then filter the tile again
            n, floor, cut = _compact_and_share(buf, base, n, floor, kk, hist, hbase, lane,
                                               lanes_below, floor_b)
            passing = pass_mask(word, left, cut)
            mine = cuda.popc(passing)
            end = warp_inclusive_scan(int32(mine), lane)
            arriving = cuda.shfl_sync(FULL_MASK, end, 31)
        if n + arriving <= WARP_CAP:
            # fast append: lane l writes its passing logits at n + (those of the lanes
            # below l), lowest bit first. The word is picked from the registers by a
            # chain of selects (indexing `word` at run time would put it in local memory;
            # reading it again from global memory waits on a load each logit)
            at = base + n + end - mine
            first_id = (tile + lane) * per_word     # the id of the lane's first logit
            pending = passing
            while pending != 0:
                q = cuda.ffs(pending) - 1       # the lowest passing position
                pending = uint32(pending & (pending - uint32(1)))   # (32 bits)
                u = shr_u32(q, WORD_SHIFT)      # q = u * per_word + j
                j = q & (per_word - 1)
                picked = word[0]
                for w in range(1, LOADS):
                    if u == w:
                        picked = word[w]
                v = first_id + u * (32 * per_word) + j     # the logit's id in the row
                buf[at] = ((uint64(orderable_key(value_bits(picked, j))) << uint64(32))
                           | uint64(0xFFFFFFFF - v))
                at += 1
            n += arriving
            return m, s, n, floor, False
        # slow append (the set would overflow): one value position q (word q // per_word
        # of the lane, logit q % per_word of it) at a time, compacting when the next
        # position would not fit. A loop the compiler keeps rolled: one copy of the
        # compaction, and the word read again (an L1 hit) rather than indexing `word` at
        # run time, which would put it in local memory.
        for q in range(LOADS * per_word):
            i = tile + (q // per_word) * 32 + lane
            valid = i < whi
            x_bits = value_bits(words[i] if valid else neg_inf_word, q % per_word)
            take = valid and not bits_to_float(x_bits) < cut
            mask = cuda.ballot_sync(FULL_MASK, take)
            if n + cuda.popc(mask) > WARP_CAP:
                n, floor, cut = _compact_and_share(buf, base, n, floor, kk, hist, hbase,
                                                   lane, lanes_below, floor_b)
                take = valid and not bits_to_float(x_bits) < cut
                mask = cuda.ballot_sync(FULL_MASK, take)
                if n + cuda.popc(mask) > WARP_CAP:  # ties at the floor fill the set
                    overflow = True
                    break
            if take:
                v = i * per_word + q % per_word     # the logit's id in the row
                buf[base + n + cuda.popc(mask & lanes_below)] = (
                    (uint64(orderable_key(x_bits)) << uint64(32)) | uint64(0xFFFFFFFF - v))
            n += cuda.popc(mask)
        return m, s, n, floor, overflow    # overflow: the block falls back below

    # A block's select in four phases, which the kernels call one after the other (phase
    # helpers rather than one helper for the whole select: numba inlines a helper by copying
    # its IR, at a cost that grows with its size squared, and splicing in one helper holding
    # the whole select was 40-50 % of each kernel's compile time):
    #   filter_slice   the pass over the slice: the warps' held sets, the log-sum-exp terms
    #   held_edge      the exact radix select over the held keys, or "they cannot answer"
    #   gather_held    the held candidates at or above the edge into top, sorted
    #   select_again   (where they cannot) the two-pass select on the slice, into top

    @cuda.jit(device=True, inline="always")
    def filter_slice(words, wlo, whi, k, tid, buf, hist, red_u, red_f, counts, tops,
                     floor_b, slice_lo):
        """All threads call it. Filters ``words[wlo:whi]`` into the warps' held sets in
        ``buf``. Returns ``(m, s, kk)``: the slice's max logit, its sum of ``exp(x - m)``, and
        ``kk = min(k, logits)``. ``counts`` and ``tops`` then say what each warp holds,
        ``floor_b`` the floors and ``slice_lo`` the slice's start (visible to all: the last
        reduction ends with a barrier)."""
        T = FILTER_THREADS
        lane = tid & 31
        warp = tid >> 5
        base = warp * WARP_CAP              # this warp's held set in buf, its bins in hist
        hbase = warp * WARP_BINS
        lanes_below = (uint32(1) << uint32(lane)) - uint32(1)
        kk = min(k, (whi - wlo) * per_word)
        r = guess_rank(whi - wlo, kk)       # (the same in every thread)
        if tid == 0:
            floor_b[0] = uint32(0)          # key 0: below every logit (no floor yet)
            counts[WARPS] = 0               # the overflow flag
            slice_lo[0] = wlo               # the slice's start, for the fallback (below)
            # the guessed floor: the atomic min's start, lowered by each warp's guess
            floor_b[1] = uint32(0xFFFFFFFF) if r > 0 else uint32(0)
        cuda.syncthreads()                  # block state reset before any warp reads it

        m = NEG_INF
        s = float32(0.0)
        n = 0                               # held by this warp (uniform across its lanes)
        overflow = False
        word = cuda.local.array(LOADS, uint64)     # the tile being filtered
        ahead = cuda.local.array(LOADS, uint64)    # the warp's next tile, in flight meanwhile
        ahead2 = cuda.local.array(LOADS, uint64)   # (AHEAD 2) the tile after it
        stride = WARPS * 32 * LOADS                 # words between a warp's tiles
        # Loads index with uint64: numba adds a negative-index wrap to every signed index.
        # Lane `lane`'s word u of the tile at `tile` is words[tile + u * 32 + lane] (bytes
        # 8 (tile + u * 32 + lane) ..+7 of the row; logit j of it has id (tile + u * 32 + lane)
        # per_word + j); it exists when u * 32 < left = whi - tile - lane. One compare a word:
        # 32-bit for the next tile's loads (left_ahead); `left` is int64 as numba types
        # int32 - int32, so the mask's compares are 64-bit (int32(whi - tile - lane) would
        # narrow them; not yet measured)
        lane64 = uint64(lane)
        tile = wlo + warp * 32 * LOADS
        left = int32(whi - tile) - int32(lane)
        for u in range(LOADS):                      # the first tiles' loads
            ahead[u] = (words[uint64(tile) + lane64 + uint64(u * 32)]
                        if int32(u * 32) < left else neg_inf_word)
            if AHEAD == 2:
                ahead2[u] = (words[uint64(tile + stride) + lane64 + uint64(u * 32)]
                             if int32(u * 32) < int32(left - stride) else neg_inf_word)
        # the guessed floor, while the first tile is on its way: a floor that is likely
        # valid, checked at the end (fewer than kk held logits: the fallback)
        if r > 0:
            guess_floor(words, wlo, whi, r, tid, red_u, floor_b)
        cuda.syncthreads()                  # every warp's guess in floor_b[1]
        floor = floor_b[1]                  # every held key >= floor (0: none yet)
        while tile < whi:
            # one tile from each buffer in turn (two calls, not a loop over the buffers: an
            # index that is not a constant would put the buffers in local memory)
            m, s, n, floor, overflow = filter_tile(words, ahead, word, tile, whi, lane, lane64,
                                                   stride, m, s, n, floor, kk, buf, base,
                                                   hist, hbase, lanes_below, floor_b)
            tile += stride
            if AHEAD == 2 and not overflow and tile < whi:
                m, s, n, floor, overflow = filter_tile(words, ahead2, word, tile, whi, lane,
                                                       lane64, stride, m, s, n, floor, kk, buf,
                                                       base, hist, hbase, lanes_below, floor_b)
                tile += stride
            if overflow:
                break
        # the warp's largest held key: the top of the end's first histogram (read here, by
        # the warp itself, while other warps may still be streaming)
        held_top = _held_top(buf, base, n, lane)
        if lane == 0:
            counts[warp] = n
            tops[warp] = held_top
            if overflow:
                counts[WARPS] = 1
        # the block's log-sum-exp terms (both reductions end with a barrier: counts, tops,
        # the overflow flag and floor_b are visible after them)
        big = block_max(red_f, m, tid, T)
        total = block_sum(red_f, s * math.exp(m - big) if m > NEG_INF else float32(0.0),
                          tid, T)
        return big, total, kk

    @cuda.jit(device=True, inline="always")
    def held_edge(kk, tid, buf, hist, scratch, result, counts, tops, floor_b):
        """All threads call it, after :func:`filter_slice`. Returns ``(edge, again)``: the
        best ``kk`` of the slice are among the held keys at or above ``edge`` (with some ties
        at the ``kk``-th key, ``TOP_CAP`` at most), unless ``again``: a warp overflowed, the
        guessed floor was too high, or too many ties at the ``kk``-th key, and the block must
        read its slice again (:func:`select_again`)."""
        T = FILTER_THREADS
        # Every logit whose key is at or above cut_key = max(floor_b[0], the guess) is held:
        # the cut never rose above it, and a compaction drops only keys below its own floor.
        # Without a guess, floor_b[0] is valid (a compaction's warp held kk keys at or above
        # it). With one, neither need be (nothing makes the guess valid, and a NaN whose key
        # is below the guess's can pass the filter, so a compaction over [guess, top] may
        # find fewer than kk keys): the select's first level counts the held keys at or
        # above cut_key, and fewer than kk take the fallback.
        cut_key = max(floor_b[0], floor_b[1])
        short = False

        # exact radix select of the kk-th largest held key >= cut_key. The first level's
        # 2 048 bins cover the held keys' own span [cut_key, hi] (hi: the largest held key),
        # 2**shift keys a bin, shift = max(0, bits(hi - cut_key) - 11); while the bin of the
        # kk-th key and the keys above it do not fit TOP_CAP, the next level spreads that
        # bin's 2**shift keys over the bins (11 bits fewer of shift). Three levels at most:
        # the span has 32 bits. edge: the lower edge of the bin the last level found
        need = kk
        edge = cut_key
        ties = 0
        if counts[WARPS] == 0:
            lo = cut_key
            hi = tops[0]
            for w in range(1, WARPS):
                hi = max(hi, tops[w])
            # (uint32() throughout: numba widens uint32 - uint32 to 64 bits; hi < lo: no held
            # key reaches cut_key, the first level counts none and the block falls back)
            span = uint32(hi - lo) if hi >= lo else uint32(0)
            shift = uint32(max(0, 21 - cuda.clz(span)))     # (span >> shift) < 2 048
            for _level in range(3):
                for d in range(tid, BINS, T):
                    hist[d] = 0
                cuda.syncthreads()          # cleared before the atomics
                # the held entries only: warp w's buf[w * WARP_CAP : + counts[w]], thread
                # tid reading entries tid, tid + T of each
                for w in range(WARPS):
                    for j in range(tid, counts[w], T):
                        key = _key_of(buf[w * WARP_CAP + j])
                        if lo <= key and key <= hi:
                            cuda.atomic.add(hist, int32(uint32(key - lo) >> shift), 1)
                cuda.syncthreads()          # histogram complete
                in_range = _find_threshold_digit(hist, BINS, need, scratch, result, tid, T)
                if in_range < need:         # (level 0 only, the same in every thread)
                    short = True            # fewer than kk held keys reach cut_key
                    break
                need -= result[1]
                edge = uint32(lo + (uint32(result[0]) << shift))
                ties = result[2]
                cuda.syncthreads()          # everyone read result before it is reused (the
                                            # next level's two barriers would order that
                                            # too; this one is older than they are)
                if kk - need + ties <= TOP_CAP or shift == 0:
                    break
                lo = edge                   # refine: the bin's keys [edge, edge + 2**shift)
                hi = uint32(min(uint64(lo) + (uint64(1) << uint64(shift)) - uint64(1),
                                uint64(hi)))
                shift = uint32(max(0, int32(shift) - 11))
        again = counts[WARPS] != 0 or short or kk - need + ties > TOP_CAP
        return edge, again

    @cuda.jit(device=True, inline="always")
    def gather_held(edge, tid, buf, top, counts, n_cand):
        """All threads call it, where :func:`held_edge` did not say ``again``: gathers the held
        keys at or above ``edge`` (at most ``TOP_CAP``, as ``held_edge`` made sure) into
        ``top`` and sorts them, best first."""
        T = FILTER_THREADS
        if tid == 0:
            n_cand[0] = 0
        cuda.syncthreads()                  # counter reset before the atomics
        for w in range(WARPS):
            for j in range(tid, counts[w], T):
                packed = buf[w * WARP_CAP + j]
                if _key_of(packed) >= edge:
                    top[cuda.atomic.add(n_cand, 0, 1)] = packed
        cuda.syncthreads()                  # all gathered
        sort_desc_any(top, n_cand[0], tid, T)

    @cuda.jit(device=True, inline="always")
    def select_again(bits, whi, k, kk, tid, buf, top, hist, scratch, result, red_u, red_f,
                     n_cand, slice_lo):
        """All threads call it, where :func:`held_edge` said ``again``: the two-pass
        select on the slice (it reads the slice again), its best ``kk`` copied to ``top``.
        Returns ``(m, s)`` as :func:`filter_slice` does. The slice's start is read back from
        shared memory: nothing after the tile loop but this needs it, and held in a register
        across the loop it was the value NVVM 13.0 spilled in the row-slices kernel at the
        128-register bound (sm_90)."""
        T = FILTER_THREADS
        lo = slice_lo[0]
        big, total, _ = select_top(bits, lo * per_word, whi * per_word, k, tid, T, buf, hist,
                                   scratch, result, red_u, red_f, n_cand)
        for j in range(tid, kk, T):
            top[j] = buf[j]
        cuda.syncthreads()                  # top in place
        return big, total

    @cuda.jit(device=True, inline="always")
    def shared_state():
        """The kernel's shared arrays, one a line (the simulator tells them apart by line):
        ``(buf, top, hist, scratch, result, red_u, red_f, n_cand, counts, tops, floor_b,
        slice_lo)``: 47 232 B on a GPU (46.1 KiB, under numba's 48 KiB of static shared
        memory)."""
        buf = cuda.shared.array(SORT_CAP, uint64)       # held sets; the fallback's candidates
        top = cuda.shared.array(TOP_CAP, uint64)        # the final candidates
        hist = cuda.shared.array(BINS, int32)           # compactions' bins; the final select
        scratch = cuda.shared.array(SCAN_SCRATCH, int32)
        result = cuda.shared.array(3, int32)
        red_u = cuda.shared.array(FILTER_THREADS, uint32)
        red_f = cuda.shared.array(FILTER_THREADS, float32)
        n_cand = cuda.shared.array(1, int32)
        counts = cuda.shared.array(COUNTS, int32)       # held per warp; [WARPS]: overflow
        tops = cuda.shared.array(WARPS, uint32)         # each warp's largest held key
        floor_b = cuda.shared.array(2, uint32)          # [1]: the guessed floor
        slice_lo = cuda.shared.array(1, int32)          # the slice's first word
        return (buf, top, hist, scratch, result, red_u, red_f, n_cand, counts, tops,
                floor_b, slice_lo)

    @kernel_for_block(FILTER_THREADS, BLOCKS_PER_SM)
    def whole_row_kernel(words, bits, k, top_log_probs, top_token_ids):
        """Grid ``(rows,)``, block ``(FILTER_THREADS,)``: row ``words[row]`` -> K outputs."""
        row_id = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        (buf, top, hist, scratch, result, red_u, red_f, n_cand, counts, tops, floor_b,
         slice_lo) = shared_state()
        row_words = words[row_id]
        row_bits = bits[row_id]
        n_words = words.shape[1]
        m, total, kk = filter_slice(row_words, 0, n_words, k, tid, buf, hist, red_u, red_f,
                                    counts, tops, floor_b, slice_lo)
        edge, again = held_edge(kk, tid, buf, hist, scratch, result, counts, tops, floor_b)
        if again:
            m, total = select_again(row_bits, n_words, k, kk, tid, buf, top, hist, scratch,
                                    result, red_u, red_f, n_cand, slice_lo)
        else:
            gather_held(edge, tid, buf, top, counts, n_cand)
        lse = m + math.log(total) if m > NEG_INF else NEG_INF
        _write_top(top, k, lse, row_id, tid, FILTER_THREADS, top_log_probs, top_token_ids)

    @kernel_for_block(FILTER_THREADS, BLOCKS_PER_SM)
    def part_kernel(words, bits, k, chunk, part_keys, part_max, part_sum):
        """Grid ``(rows, parts)``: block ``(row, p)`` selects in ``words[row, p * chunk:(p +
        1) * chunk]`` and writes what the two-pass part kernel writes (the merge is shared)."""
        row_id = cuda.blockIdx.x
        p = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        n_words = words.shape[1]
        lo = min(p * chunk, n_words)
        hi = min(lo + chunk, n_words)
        (buf, top, hist, scratch, result, red_u, red_f, n_cand, counts, tops, floor_b,
         slice_lo) = shared_state()
        if lo == hi:                        # an empty slice (the whole block returns here)
            store_part(top, 0, NEG_INF, float32(0.0), row_id, p, k, tid, FILTER_THREADS,
                       part_keys, part_max, part_sum)
            return
        row_words = words[row_id]
        row_bits = bits[row_id]
        m, total, kk = filter_slice(row_words, lo, hi, k, tid, buf, hist, red_u, red_f, counts,
                                    tops, floor_b, slice_lo)
        edge, again = held_edge(kk, tid, buf, hist, scratch, result, counts, tops, floor_b)
        if again:
            m, total = select_again(row_bits, hi, k, kk, tid, buf, top, hist, scratch, result,
                                    red_u, red_f, n_cand, slice_lo)
        else:
            gather_held(edge, tid, buf, top, counts, n_cand)
        store_part(top, kk, m, total, row_id, p, k, tid, FILTER_THREADS, part_keys, part_max,
                   part_sum)

    return whole_row_kernel, part_kernel


@functools.cache
def filtered_kernels(bf16: bool, guess: bool = True, ahead_tiles: int | None = None):
    """``(whole_row_kernel, part_kernel)`` for float32 or bfloat16 logits, made once. By
    default whole rows keep ``AHEAD_TILES[bf16]`` tiles in flight a warp and row slices one:
    the bfloat16 row-slices kernel with two spills 8 bytes on sm_90 (128 registers). An
    explicit ``ahead_tiles`` is taken by both."""
    whole_row, part_kernel = _make_filtered_kernels(bf16, guess, ahead_tiles)
    if ahead_tiles is None and AHEAD_TILES[bf16] != 1:
        _, part_kernel = _make_filtered_kernels(bf16, guess, 1)   # (compiled when launched)
    return whole_row, part_kernel
