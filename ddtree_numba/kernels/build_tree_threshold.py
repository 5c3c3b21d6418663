"""``build_tree``'s select phase as everything above a rising floor: variant ``"threshold"``.

The kernel of :mod:`ddtree_numba.reference.build_tree_threshold` (read its docstring first:
the order, the floor, the width of a parent's children and why nothing the tree needs is
dropped). No pops and no per-level sort: one block of ``THREADS`` threads per request
materializes, level by level, every node that could still be in the tree into a list in
shared memory, raises the floor by a radix select only when the list would overflow, and
sorts what is left once.

**The list** (shared memory, ``CAPACITY`` entries, in level order: each parent's children
consecutive, in rank order): ``score`` (float32), ``parent`` (the parent's list index),
``rank``, ``depth`` and ``mult`` (``m(u)``, the product of ``rank + 1`` along the path,
capped at ``B + 1``; in the final phase the node's position). ``work`` (uint64) holds a
level's per-parent child counts and their prefix sums, a compaction's keep flags, and at the
end the sort keys.

**A level** ``d`` (every thread runs the same loop; ``n``, ``start``, ``floor`` are computed
alike by all, from block-wide sums):

1. The next row ``lp[b, d + 1, :min(K, B)]`` is loaded into registers (``ROW_PER_THREAD`` a
   thread) now and stored to ``lp_row`` at the level's end, after a barrier and with one of
   its own: its latency overlaps the level. Rows of at most ``ROW_HALF`` (528) ranks
   (``min(K, B) <= 528``: the targets' budgets 64 and 256) alternate between ``lp_row``'s two
   halves instead: row ``d + 1``, loaded a level ahead, is stored into the half that row ``d - 1``
   held when level ``d`` starts, and the level's own barriers publish it: no store phase and
   no barrier for it.
2. *Count*: thread ``t`` takes parents ``start + t``, ``start + t + T``, ...; a binary search
   over its row prefix of ``width = min(K, B // mult, B - d)`` ranks counts the children at or
   above the floor; a block scan turns the counts into inclusive sums in ``work`` (``M``, the
   level's total). Where the level has at most ``T`` parents (most levels), each thread scans
   its one count from a register.
3. *Overflow* (``n + M > CAPACITY``, the same decision in every thread): if the list holds
   ``B`` nodes, the floor rises towards the ``B``-th best key of the list (a radix select), the
   list is compacted, the
   children are counted again; if they still do not fit, the same with the pending children
   included (each one scored again where the select reads it, never stored); if they still do
   not fit, ties crowd the list, and the block builds the tree with the ``"levels"`` select
   instead (``build_tree_levels.select_levels``), in the same shared memory.
4. *Expand*: the level's children lie parent after parent in rank order (child ``r`` of
   parent ``u`` is entry ``n + (exclusive sum of u) + r``); thread ``t`` writes a run of about
   ``M / T`` of them, finding its first parent by a binary search over the sums and each next
   one by a step. (The earlier scheme, a warp a parent, left most warps idle while a few
   walked the widest level's parents one after another: 5.7 of the 12.4 us of expansions at
   budget 256, ``benchmarks/NOTES.md``.)

**The end.** If more than ``2^ceil(log2(B + 1)) - 1`` non-root nodes are listed, the floor
rises towards the ``B``-th best score, so that the sort pads to no more slots than
``B + 1`` nodes need; the list is compacted, and the survivors are sorted by the 64-bit key
``orderable(score) << 32 | ~((position of the parent + 1) << 12 | list index)`` (descending:
score, then the earlier parent, then the earlier sibling), again with the positions found,
until no two adjacent scores tie or the positions settle. Position ``j`` becomes node ``j``.

**The radix select** towards the ``k``-th largest key: up to four rounds of 8 bits, most
significant first; a round zeroes a 256-bin histogram, counts the keys that match the digits
found so far (shared ``atomic.add``), then one block scan over the bins (highest first) finds
the bin that holds the ``k``-th key: 4 barriers (the zeroing, the counts, the scan's, the
digit) and a pass over the keys a round. It stops after the first round whose bin edge leaves
at most ``B`` + 32 keys during the levels (the model's ``floor_caps``), or
``2^ceil(log2(B + 1)) - 1`` at the end: the edge is a floor too.

Shared memory: one dynamic block of ``ARENA_BYTES`` (``_device.shared_layout``), seen as one
array of each type. The list takes 22 528 B (``CAPACITY`` x 11 B),
``work`` 16 384 B, the row 4 224 B, the histogram 1 024 B, scan and flags under 100 B: 44.2 KB
on a GPU. The fall-back's arrays (43.9 KB) lie over the same bytes: it starts after a barrier,
when nothing of the list is read again. (With static arrays the two sets would need 88 KB: one
block an SM of sm_120's 100 KB; the fall-back launched as a kernel of its own cost the graph 3.5
us warm and up to 11 after an L2 flush at bs 1, though it returned at once.)
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int8, int16, int32, uint32, uint64

from ..limits import MAX_NODES
from ..reference.build_tree_threshold import CAPACITY as GPU_CAPACITY
from ..reference.build_tree_threshold import FINITE_FLOOR as _FINITE_FLOOR
from ._device import SIMULATOR, STATIC_SHARED_LIMIT, kernel_for_block, shared_layout
from ._primitives import block_inclusive_scan_open, block_scan_scratch, key_of_float, sort_desc_any
from .build_tree_levels import CAND_CAP, LEVEL_THREADS, NODE_CAPACITY, select_levels

THREADS = 32 if SIMULATOR else 512
# the simulator takes a small list, so that its tests overflow it and cover every path
CAPACITY = 256 if SIMULATOR else GPU_CAPACITY
PER_THREAD = CAPACITY // THREADS            # list entries a thread holds in a compaction
ROW = MAX_NODES                             # a row's staged ranks: min(K, B) <= 1055 < ROW
ROW_PER_THREAD = -(-ROW // THREADS)         # next-row values a thread prefetches
# rows of at most ROW_HALF ranks alternate between the two halves of the row's array (the
# simulator's is small, so that its tests take both ways)
ROW_HALF = 16 if SIMULATOR else ROW // 2
assert 2 * ROW_HALF <= ROW
BINS = 256                                  # the radix select's 8-bit digits
SCAN_SCRATCH = block_scan_scratch(THREADS)
FINITE_FLOOR = uint32(_FINITE_FLOOR)
LOW = uint64(0xFFFFFFFF)
KEY_POS_INF = uint32(0xFF800000)        # the key of +inf: larger keys are NaNs
INDEX_BITS = 12                             # a sort key's list index: its low 12 bits
assert CAPACITY % THREADS == 0 and CAPACITY & (CAPACITY - 1) == 0
assert CAPACITY <= 1 << INDEX_BITS
assert BINS <= THREADS or BINS % THREADS == 0
# the fall-back's merge holds build_tree_levels.HELD elements a thread, of LEVEL_THREADS
assert THREADS >= LEVEL_THREADS and THREADS % 32 == 0

# The one dynamic shared block: the list's arrays, then (at the fall-back, the same bytes)
# the "levels" select's; offsets in elements of each array's type
(AT_WORK, AT_SCORE, AT_ROW, AT_HIST, AT_SCRATCH, AT_FOUND, AT_FLAGS, AT_PARENT, AT_RANK,
 AT_MULT, AT_DEPTH), LIST_BYTES = shared_layout(
    (np.uint64, CAPACITY), (np.float32, CAPACITY), (np.float32, ROW), (np.int32, BINS),
    (np.int32, SCAN_SCRATCH), (np.int32, 3), (np.int32, 4), (np.int16, CAPACITY),
    (np.int16, CAPACITY), (np.int16, CAPACITY), (np.int8, CAPACITY))
(AT_G_KEY, AT_CAND, AT_LEVELS_ROW, AT_PLIST, AT_OFFSETS, AT_NEWPOS, AT_LEVELS_SCRATCH, AT_STATE,
 AT_G_DEPTH), LEVELS_BYTES = shared_layout(
    (np.uint64, NODE_CAPACITY), (np.uint64, CAND_CAP), (np.float32, NODE_CAPACITY),
    (np.int32, NODE_CAPACITY), (np.int32, NODE_CAPACITY), (np.int32, NODE_CAPACITY),
    (np.int32, SCAN_SCRATCH), (np.int32, 2), (np.int16, NODE_CAPACITY))
ARENA_BYTES = max(LIST_BYTES, LEVELS_BYTES)   # the launch's dynamic shared memory
assert ARENA_BYTES <= STATIC_SHARED_LIMIT     # no opt-in needed, on sm_90 or sm_120


@cuda.jit(device=True, inline="always")
def _score_key(x):
    """The orderable key of a score; 0 (below every floor: no node) for a NaN, which only
    unchecked input makes (``+inf + -inf``), as the other selects treat it."""
    key = key_of_float(x)
    return key if key <= KEY_POS_INF else uint32(0)


@cuda.jit(device=True, inline="always")
def _div_u32(a, b):
    """``a // b`` for ``0 <= a < 2**32``, ``0 < b < 2**32``, as one 32-bit unsigned division
    (about 20 instructions inline). numba widens ``int32 // int32`` to 64 bits; LLVM guards
    such a division with a test of both operands' high words, a branch and a 32-bit division
    for the common case, and keeps a call of ``__cuda_sm20_div_s64`` (about 70 instructions)
    for the rest. The kernel had 25 such calls (of which 13 are gone with this and the loops'
    ``int32`` bounds below: a loop ``range(start, stop, T)`` over 64-bit bounds divides by
    ``T`` for its trip count); its sm_90 code shrank by about 900 instructions."""
    return int32(uint32(a) // uint32(b))


@cuda.jit(device=True, inline="always")
def _scan_in_place(values, n, scratch, tid, T):
    """``values[0:n]`` (uint64 holding int32 counts) -> their inclusive sums, in place; thread
    ``t`` owns the span ``[t s, (t + 1) s)``, ``s = ceil(n / T)``. Returns the total. Ends
    with a barrier."""
    span = _div_u32(n + T - 1, T)
    first = tid * span
    last = min(first + span, n)
    own = int32(0)
    for i in range(first, last):
        own = int32(own + int32(values[i]))
    inclusive, total = block_inclusive_scan_open(scratch, own, tid, T)
    before = int32(inclusive - own)
    for i in range(first, last):
        before = int32(before + int32(values[i]))
        values[i] = uint64(before)
    cuda.syncthreads()                      # the sums in place before anyone reads them
                                            # (and the scan's scratch read: it closes it)
    return int32(total)


@cuda.jit(device=True, inline="always")
def _parent_of(sums, P, j):
    """``(u, r)``: child ``j`` of a level is rank ``r`` of parent ``u`` (``u < P``), where
    ``sums[0:P]`` are the inclusive sums of the parents' counts: the first ``u`` with
    ``sums[u] > j`` (a binary search)."""
    lo = uint32(0)                          # unsigned: 32-bit index math, no wrap check
    hi = uint32(P - 1)
    while lo < hi:
        mid = uint32((lo + hi) >> uint32(1))
        if int32(sums[mid]) > j:
            hi = mid
        else:
            lo = uint32(mid + uint32(1))
    before = int32(sums[uint32(lo - uint32(1))]) if lo > uint32(0) else int32(0)
    return int32(lo), int32(j - before)


@cuda.jit(device=True, inline="always")
def _children_above(s_p, m_p, lp_row, at, d, K, B, floor):
    """How many children of a parent (score ``s_p``, ``m(u) = m_p``, depth ``d``) score at or
    above ``floor``: a binary search over the first ``min(K, B // m_p, B - d)`` ranks of the
    row at ``lp_row[at:]`` (those are a prefix: the scores fall with the rank)."""
    width = min(K, _div_u32(B, m_p), B - d)          # the ranks that can matter
    lo = uint32(0)
    hi = uint32(max(width, 0))
    while lo < hi:                                   # the first rank below the floor
        mid = uint32((lo + hi) >> uint32(1))
        if _score_key(s_p + lp_row[at + mid]) >= floor:
            lo = uint32(mid + uint32(1))
        else:
            hi = mid
    return int32(lo)


@cuda.jit(device=True, inline="always")
def _count_children(score, mult, lp_row, at, work, scratch, start, n, d, K, B, floor, tid, T):
    """Step 2: ``work[0:n - start]`` = the inclusive sums of the children at or above
    ``floor`` of parents ``start .. n - 1``; returns their total ``M``. Ends with a barrier."""
    P = n - start
    if P <= T:                              # uniform: thread t counts parent start + t and
        count = int32(0)                    # scans its count from a register
        if tid < P:
            count = _children_above(score[start + tid], int32(mult[start + tid]), lp_row,
                                    at, d, K, B, floor)
        inclusive, total = block_inclusive_scan_open(scratch, count, tid, T)
        if tid < P:
            work[tid] = uint64(inclusive)
        cuda.syncthreads()                  # the sums in place before anyone reads them
                                            # (and the scan's scratch read: it closes it)
        return int32(total)
    for p in range(int32(start + tid), n, T):      # (int32 bounds: a 32-bit trip count)
        work[p - start] = uint64(_children_above(score[p], int32(mult[p]), lp_row, at, d, K,
                                                 B, floor))
    cuda.syncthreads()                      # counts in place
    return _scan_in_place(work, P, scratch, tid, T)


@cuda.jit(device=True, inline="always")
def _expand(score, parent, rank, depth, mult, work, lp_row, at, n, start, M, d, B, tid, T):
    """Step 4: the level's ``M`` children at list entries ``n .. n + M - 1`` (``work[0:P]``
    the inclusive sums of parents ``start .. n - 1``'s counts), this thread's run of them.

    The children lie parent after parent in rank order (child ``j`` of the level is node
    ``n + j``). Thread ``t`` writes the run ``j = t s .. t s + s - 1``, ``s = ceil(M / T)``
    made odd (so that neighbouring lanes' runs start in different shared-memory banks): its
    first parent by a binary search over the sums, each next one by a step (or by a search
    again, past parents without children). Every thread writes about ``M / T`` children
    however the parents' widths differ."""
    P = n - start
    per = _div_u32(M + T - 1, T) | 1            # children a thread: odd (the banks)
    j = int32(tid * per)
    j_end = int32(min(j + per, M))
    u = int32(0)
    first = int32(0)                            # the level's index of parent u's rank 0
    end = int32(0)                              # ... and one past its last child
    s_p = float32(0.0)
    m_p = int32(1)
    while j < j_end:
        if j >= end:                            # parent u is done (end 0: none found yet)
            if end > 0 and u + 1 < P and int32(work[u + 1]) > j:
                u = int32(u + 1)                # the next parent has children: a step
            else:
                u, _ = _parent_of(work, P, j)   # else search (the first child, or a gap)
            first = int32(work[u - 1]) if u > 0 else int32(0)
            end = int32(work[u])
            s_p = score[start + u]
            m_p = int32(mult[start + u])
        r = j - first
        c = uint32(n + j)
        score[c] = s_p + lp_row[at + r]         # one float32 rounding, as the reference
        parent[c] = int16(start + u)
        rank[c] = int16(r)
        depth[c] = int8(d + 1)
        mult[c] = int16(min(m_p * (r + 1), B + 1))
        j = int32(j + 1)


@cuda.jit(device=True, inline="always")
def _floor_edge(k, cap, score, n, with_children, work, start, M, lp_row, at, hist, scratch,
                found, tid, T):
    """A floor at most the ``k``-th largest key among the list's non-root nodes and,
    ``with_children``, the level's ``M`` pending children (scored where they are read, with
    the row at ``lp_row[at:]``; ``work`` holds the sums), that leaves at most ``cap`` of those
    keys, or the ``k``-th key itself (the model's ``floor_edge``). Needs at least ``k`` keys.
    All threads of the block call it (it has barriers); every thread returns the same key."""
    prefix = uint32(0)
    need = int32(k)
    P = n - start
    for round_ in range(4):                 # the key's four bytes, most significant first
        shift = uint32(24 - 8 * round_)     # this round's digit: key bits shift .. shift + 7
        # the bits above the digit, found by the earlier rounds (none in round 0): a key
        # counts in this round when they equal prefix
        decided = uint32(~((uint64(1) << uint64(shift + uint32(8))) - uint64(1)) & LOW)
        for i in range(tid, int32(BINS), T):
            hist[i] = 0
        cuda.syncthreads()                  # the bins zeroed before any count
        for i in range(int32(1 + tid), n, T):   # the list (not the root)
            key = _score_key(score[i])
            if key & decided == prefix:
                cuda.atomic.add(hist, int32((key >> shift) & uint32(0xFF)), 1)
        if with_children:
            for j in range(tid, M, T):
                u, r = _parent_of(work, P, j)
                key = _score_key(score[start + u] + lp_row[at + r])
                if key & decided == prefix:
                    cuda.atomic.add(hist, int32((key >> shift) & uint32(0xFF)), 1)
        cuda.syncthreads()                  # every key counted
        # the bin holding the k-th key: inclusive sums over the bins from the highest down
        span = _div_u32(BINS + T - 1, T)
        first = tid * span
        last = min(first + span, BINS)
        own = int32(0)
        for i in range(first, last):
            own = int32(own + hist[BINS - 1 - i])
        inclusive, _ = block_inclusive_scan_open(scratch, own, tid, T)   # (closed below)
        before = int32(inclusive - own)
        for i in range(first, last):
            count = hist[BINS - 1 - i]
            if before < need <= before + count:          # one thread, one bin
                found[0] = int32(BINS - 1 - i)
                found[1] = int32(need - before)          # its rank within the bin
                found[2] = int32(before + count)         # the round's keys in this bin or above
            before = int32(before + count)
        cuda.syncthreads()                  # the digit found before everyone reads it
        prefix |= uint32(found[0]) << shift
        reached = int32(k - need + found[2])    # keys at or above the bin's lower edge
        need = found[1]
        # (found is written again only after the next round's scan, or the next call's,
        # whose barriers every thread reaches after reading it here)
        if reached <= cap:                  # uniform: the edge already keeps few enough
            break
    return prefix


@cuda.jit(device=True, inline="always")
def _compact(floor, score, parent, rank, depth, mult, work, scratch, n, start, tid, T):
    """All threads of the block (it has barriers): keep the root and the nodes at or above
    ``floor``, in order, parents re-pointed. Returns the new ``(n, start)``."""
    for i in range(tid, n, T):
        work[i] = uint64(1) if i == 0 or _score_key(score[i]) >= floor else uint64(0)
    cuda.syncthreads()                      # flags in place
    kept = _scan_in_place(work, n, scratch, tid, T)   # work[i]: kept nodes in 0 .. i
    new_start = int32(work[start - 1]) if start > 0 else int32(0)
    # read this thread's entries (registers: the loop unrolls), then write them after a
    # barrier: an entry moves only down, possibly onto one another thread has not read yet
    s_ = cuda.local.array(PER_THREAD, float32)
    p_ = cuda.local.array(PER_THREAD, int16)
    r_ = cuda.local.array(PER_THREAD, int16)
    d_ = cuda.local.array(PER_THREAD, int8)
    m_ = cuda.local.array(PER_THREAD, int16)
    to = cuda.local.array(PER_THREAD, int32)
    for q in range(PER_THREAD):
        i = tid + q * T
        to[q] = -1
        if i < n and (i == 0 or _score_key(score[i]) >= floor):
            to[q] = int32(work[i]) - 1
            s_[q] = score[i]
            pp = int32(parent[i])
            # a parent is never dropped (it scores at least its child); unchecked input
            # that breaks that re-points the node at the kept node before its parent
            p_[q] = int16(int32(work[pp]) - 1) if pp >= 0 else int16(-1)
            r_[q] = rank[i]
            d_[q] = depth[i]
            m_[q] = mult[i]
    cuda.syncthreads()                      # every entry read before any moves
    for q in range(PER_THREAD):
        c = to[q]
        if c >= 0:
            score[c] = s_[q]
            parent[c] = p_[q]
            rank[c] = r_[q]
            depth[c] = d_[q]
            mult[c] = m_[q]
    cuda.syncthreads()                      # the compacted list in place
    return kept, new_start


@cuda.jit(device=True, inline="always")
def _sort_key(score, parent_position, i):
    """The descending-order key of list entry ``i`` (the module docstring)."""
    low = uint64(((parent_position + 1) << INDEX_BITS) + i)   # the index below its parent's
    return (uint64(_score_key(score)) << uint64(32)) | (LOW - low)


@cuda.jit(device=True, inline="always")
def _entry_of(key):
    """The list index a :func:`_sort_key` holds (its low 12 bits, complemented)."""
    return int32((LOW - (key & LOW)) & uint64((1 << INDEX_BITS) - 1))


@kernel_for_block(THREADS)
def _select_threshold_kernel(lp, budget, parents, depths, log_weights, next_token,
                             next_sibling, ranks, num_nodes):
    """Grid ``(bs,)``, block ``(THREADS,)``, ``ARENA_BYTES`` of dynamic shared memory; the
    node table of request ``b``."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    # the loops stride by blockDim.x (a division at each loop's entry, _device.launch), not by
    # the constant THREADS: with the constant, LLVM unrolled them and the kernel spilled on
    # sm_90 (128 registers, 204 B) for no measured gain (71.9 -> 71.5 us at bs 1, budget 256)
    T = cuda.blockDim.x
    L, K = lp.shape[1], lp.shape[2]
    N = parents.shape[1]
    B = int32(budget)
    # one dynamic shared block (ARENA_BYTES) seen as arrays of five types, all aliasing its
    # first byte; the list's arrays are slices of them (the fall-back's too, at the end)
    u64 = cuda.shared.array(0, uint64)
    f32 = cuda.shared.array(0, float32)
    i32 = cuda.shared.array(0, int32)
    i16 = cuda.shared.array(0, int16)
    i8 = cuda.shared.array(0, int8)
    work = u64[AT_WORK:AT_WORK + CAPACITY]         # counts and sums; keep flags; sort keys
    score = f32[AT_SCORE:AT_SCORE + CAPACITY]
    lp_row = f32[AT_ROW:AT_ROW + ROW]              # lp[b, d, :min(K, B)] at lp_row[at:]
                                                   # (halves: rows d and d + 1, one a half)
    hist = i32[AT_HIST:AT_HIST + BINS]
    scratch = i32[AT_SCRATCH:AT_SCRATCH + SCAN_SCRATCH]
    found = i32[AT_FOUND:AT_FOUND + 3]             # the radix select's digit, rank, reach
    flags = i32[AT_FLAGS:AT_FLAGS + 4]             # the final sorts' "tie", "moved", by parity
    parent = i16[AT_PARENT:AT_PARENT + CAPACITY]
    rank = i16[AT_RANK:AT_RANK + CAPACITY]
    mult = i16[AT_MULT:AT_MULT + CAPACITY]         # m(u); in the end the node's position
    depth = i8[AT_DEPTH:AT_DEPTH + CAPACITY]
    ahead = cuda.local.array(ROW_PER_THREAD, float32)

    width0 = int32(min(K, B))                      # ranks ever read from a row
    if tid == 0:                                   # the root
        score[0] = float32(0.0)
        parent[0] = -1
        rank[0] = -1
        depth[0] = 0
        mult[0] = 1
    for r in range(tid, width0, T):
        lp_row[r] = lp[b, 0, r]
    # rows of at most ROW_HALF ranks alternate between lp_row's halves: row d + 1 is stored
    # at level d's start, from registers loaded a level before, and needs no barrier of its
    # own (the count's, the level's first, publishes it); wider rows take one store and
    # barrier a level
    halves = width0 <= ROW_HALF
    if halves:
        for q in range(ROW_PER_THREAD):            # row 1, stored at level 0's start
            r = tid + q * T
            ahead[q] = lp[b, 1, r] if 1 < L and r < width0 else float32(0.0)
    for i in range(tid, int32(4), T):              # the 4 flags (below) zeroed, published
        flags[i] = 0                               # by the next barrier too
    cuda.syncthreads()                             # the root and row 0 in place

    n = int32(1)                                   # list entries
    start = int32(0)                               # the first node of depth d
    floor = FINITE_FLOOR
    fallback = B + 1 > CAPACITY
    # the most non-root nodes a floor rise leaves (the model's floor_caps): during the levels
    # B and some room, at the end one less than the power of two the final sort pads to
    # (B plus up to 32, at most a quarter of the spare room, so that the levels after a
    # rise have room to grow)
    mid_cap = B + min(32, max(0, CAPACITY - B - 1) // 4)
    end_cap = int32(1)
    while end_cap < B + 1:
        end_cap *= 2
    end_cap -= 1
    d = int32(0)
    # One pass a level, then one for the end. Every thread takes the same branches (the
    # decisions read only values that are alike in all of them), and most helpers have one
    # call site (_parent_of, _children_above and _scan_in_place, short ones, have two): the
    # kernel's code stays small enough for the instruction cache.
    while not fallback:
        level = d < L and start < n                # False: the end
        # row d: lp_row[at:], the first half, or (halves, odd d) the second
        at = int32(ROW_HALF) if halves and d & 1 else int32(0)
        if level and halves:                       # 1. row d + 1 (in registers since level
            other = int32(ROW_HALF) - at           # d - 1) into the other half, which
            for q in range(ROW_PER_THREAD):        # level d - 1's last barrier freed; row
                r = tid + q * T                    # d + 2 into the registers
                if r < width0:
                    lp_row[other + r] = ahead[q]
                ahead[q] = lp[b, d + 2, r] if d + 2 < L and r < width0 else float32(0.0)
        elif level:
            for q in range(ROW_PER_THREAD):        # 1. the next row, into registers
                r = tid + q * T
                ahead[q] = lp[b, d + 1, r] if d + 1 < L and r < width0 else float32(0.0)
        # 2. count; 3. while the level does not fit, raise the floor: from the list alone
        # (stage 0, if it holds B nodes), then with the pending children (stage 1). At the
        # end, once from the list if it holds more than end_cap nodes.
        stage = 0 if n - 1 >= B else 1             # 0: from the list; 1: with the children;
                                                   # 2: neither fits (the fall-back)
        while True:
            M = int32(0)
            if level:
                M = _count_children(score, mult, lp_row, at, work, scratch, start, n, d, K,
                                    B, floor, tid, T)
            if level:
                again = n + M > CAPACITY and stage < 2
            else:
                again = n - 1 > end_cap and stage == 0
            if not again:
                break
            floor = max(floor, _floor_edge(B, mid_cap if level else end_cap, score, n,
                                           level and stage == 1, work, start, M, lp_row, at,
                                           hist, scratch, found, tid, T))
            n, start = _compact(floor, score, parent, rank, depth, mult, work, scratch, n,
                                start, tid, T)
            stage += 1
        if not level:
            break
        if n + M > CAPACITY:                       # ties crowd the list
            fallback = True
            break
        # 4. expand: each thread writes an even run of the level's children (_expand)
        _expand(score, parent, rank, depth, mult, work, lp_row, at, n, start, M, d, B, tid, T)
        cuda.syncthreads()                         # the level written, lp_row read
        if not halves:                             # (uniform) the next row over this one
            for q in range(ROW_PER_THREAD):
                r = tid + q * T
                if r < width0:
                    lp_row[r] = ahead[q]
            cuda.syncthreads()                     # the next row in place
        start = n
        n = int32(n + M)
        d += 1

    if fallback:                                   # uniform: no barrier is skipped
        # ties crowd the list: the "levels" select builds the tree instead, in this block and
        # in the same shared memory (its arrays are other slices of the block)
        cuda.syncthreads()                         # every read of the list done
        g_key = u64[AT_G_KEY:AT_G_KEY + NODE_CAPACITY]             # G, in pop order
        g_depth = i16[AT_G_DEPTH:AT_G_DEPTH + NODE_CAPACITY]
        cand = u64[AT_CAND:AT_CAND + CAND_CAP]                     # a round's candidates
        plist = i32[AT_PLIST:AT_PLIST + NODE_CAPACITY]             # a round's parents
        offsets = i32[AT_OFFSETS:AT_OFFSETS + NODE_CAPACITY]       # counts, then sums
        newpos = i32[AT_NEWPOS:AT_NEWPOS + NODE_CAPACITY]          # old position -> new
        levels_scratch = i32[AT_LEVELS_SCRATCH:AT_LEVELS_SCRATCH + SCAN_SCRATCH]
        levels_row = f32[AT_LEVELS_ROW:AT_LEVELS_ROW + NODE_CAPACITY]   # a row of lp
        state = i32[AT_STATE:AT_STATE + 2]                         # |G|, parents a round
        select_levels(lp, B, parents, depths, log_weights, next_token, next_sibling, ranks,
                      num_nodes, b, tid, T, g_key, g_depth, cand, plist, offsets, newpos,
                      levels_scratch, levels_row, state)
        return

    # the order: sort by (score, parent's position, index) until the positions settle
    for i in range(tid, n, T):
        mult[i] = int16(i)                         # positions: any start
    cuda.syncthreads()                             # positions in place
    for it in range(L + 2):                        # one sort, then at most L + 1 repeats:
                                                   # each settles one level of tied ancestors
        now = (it & 1) * 2                         # this sort's flags; the others reset
        for i in range(tid, n, T):
            pp = int32(parent[i])
            work[i] = _sort_key(score[i], int32(mult[pp]) if pp >= 0 else int32(-1), i)
        sort_desc_any(work, n, tid, T)             # (its padding barrier publishes the keys;
                                                   # it ends with one)
        if tid == 0:                               # the next sort's flags: every thread
            flags[2 - now] = 0                     # read them (last sort) before the
            flags[3 - now] = 0                     # barriers above
        for j in range(tid, n, T):
            i = _entry_of(work[j])
            if j > 0 and (work[j] >> uint64(32)) == (work[j - 1] >> uint64(32)):
                flags[now] = 1                     # two equal scores side by side
            if int32(mult[i]) != j:
                flags[now + 1] = 1                 # a position moved
                mult[i] = int16(j)                 # (entry i is this thread's alone)
        cuda.syncthreads()                         # flags and positions complete
        if flags[now] == 0 or flags[now + 1] == 0:   # uniform
            break

    # the node table: position j is node j
    nt = int32(min(n, B + 1))
    for j in range(tid, int32(N), T):
        next_token[b, j] = -1
        if j < nt:
            i = _entry_of(work[j])
            pp = int32(parent[i])
            up = int32(mult[pp]) if pp >= 0 else int32(-1)
            if j == 0:                             # node 0 has no parent; unchecked input
                up = -1                            # (a log-prob > 0) can put another node
            elif not 0 <= up < j:                  # first, whose parent then hangs under
                up = 0                             # node 0: the tree is wrong, not cyclic
            parents[b, j] = up
            depths[b, j] = int32(depth[i])
            log_weights[b, j] = score[i]
            ranks[b, j] = int32(rank[i])
            sib = -1                               # the next rank: the next entry, if kin
            if j > 0 and i + 1 < n and int32(parent[i + 1]) == pp:
                q = int32(mult[i + 1])
                if q < nt:
                    sib = q
            next_sibling[b, j] = sib
        else:
            parents[b, j] = -1
            depths[b, j] = -1
            log_weights[b, j] = float32(-float("inf"))
            ranks[b, j] = -1
            next_sibling[b, j] = -1
    if tid == 0:
        num_nodes[b] = nt
    cuda.syncthreads()                             # every next_token reset before the links
    for j in range(int32(1 + tid), nt, T):
        i = _entry_of(work[j])
        pp = int32(parent[i])
        up = int32(mult[pp]) if pp >= 0 else int32(0)
        if rank[i] == 0 and 0 <= up < j:
            next_token[b, up] = j
