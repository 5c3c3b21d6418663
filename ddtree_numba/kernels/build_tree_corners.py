"""``build_tree``'s select phase over the frontier's corners: variant ``"corners"`` (GPU).

The kernel of :mod:`ddtree_numba.reference.build_tree_corners` (read its docstring first: why
only the *corners* of each level's staircase of taken children can be the next pop, why a pop
changes three corners at most, and the bound on how many there are). It pops exactly as the
reference, one node at a time, like the ``"warp"`` variant, but each pop searches a frontier of
at most ``corner_bound(L, B)`` candidates (a few dozen in practice) held in *registers*, instead
of rescanning a 33-node group of the ``B``-candidate frontier in shared memory.

One block of ``SELECT_THREADS`` (128) threads per request; warp 0 pops, the whole block sets up
and writes the node table out (as the ``"warp"`` variant). Warp 0 holds the corners in
``32 P`` *slots*, ``P`` a lane (``P`` in ``SLOT_CHOICES``, the smallest with ``32 P >=
corner_bound(L, B)``; one kernel is compiled per ``P``, so that the slots are unrolled into
registers). Slot ``q`` of a lane holds one corner ``u`` and its candidate ``(u, taken[u])`` as
two uint32 registers, ``slot_key[q]`` (the candidate score's orderable key; 0: an empty slot)
and ``slot_node[q] = u``. The reference's next pop is the slot with the largest key, then the
smallest ``u`` (the parent popped first; two corners never share a parent, so the rank never
decides). A ``-inf`` candidate is never stored (what it dominates is ``-inf`` too). Each lane
keeps its own best slot in ``best_key``, ``best_node``, ``best_q``.

**A pop**, with every lane of warp 0 computing the same values (the warp is uniform except for
its slots):

1. ``hi`` = the warp's largest ``best_key`` (one ``redux.sync.max``); ``lo`` = the largest
   ``~best_node`` among the lanes whose key is ``hi`` (a second one): ``u = ~lo``, the popped
   score is ``float(hi)``. ``hi == 0``: nothing finite is left.
2. Two rounds of shared-memory loads: ``u``'s rank ``r = taken[u]``, depth ``d``, score,
   level neighbours ``pred[u]`` and ``succ[u]`` (the nodes of depth ``d`` popped just before and
   just after it) and newest child; then ``taken`` of both neighbours, ``succ``'s score, three
   log-probs and the newest node of depth ``d + 1``.
3. The three corners the pop changes (the reference module's docstring):

   * ``u`` itself, now with ``taken[u] = r + 1``: still a corner if ``r + 1 < K`` and its
     ``pred`` (if any) has more than ``r + 1`` children;
   * ``succ``, which becomes one if it has exactly ``r`` children (fewer: it already was);
   * ``c``, the new node (depth ``d + 1``): one if ``d + 1 < L`` and it is the first of its
     depth or the node before it there has a child (``level_full``).

4. One ``syncwarp`` (every lane has read what it needs), then every lane writes the same
   values to the shared tree arrays (the new node, ``taken[u]``, the level and child lists).
   The next pop's reads need no second ``syncwarp``: a lane sees its own writes, and another
   lane's writes of this pop are the same values (its writes of earlier pops are ordered before
   this one's by the ``syncwarp``).
5. The slots: the popped slot (in the one lane whose best it is) takes ``u``'s next
   candidate or, if ``u`` left the corners, the first new corner; other new corners go to the
   lowest and the highest lane with an empty slot (a ``ballot`` taken before the pop; when they
   are one lane, it has two empty slots, because ``32 P`` covers the bound after the pop). Each
   lane then rebuilds its best slot over its ``P`` slots (unrolled: registers only).

So a pop is two ``redux``, two dependent rounds of shared-memory loads and one ``syncwarp``,
plus arithmetic on registers; no shared-memory frontier and no rescan.

The chain starts with the two reductions. Reducing the *runner-up* (the warp's best slot but
the pop) beside the loads instead, and taking the next pop as the best of it and the three new
corners, was built and timed on an H100: 1 % faster at budget 64, 3-13 % slower from budget
128, where ``P`` is larger (``benchmarks/NOTES.md``). This kernel keeps the shorter loop.

Unchecked input that breaks the rules (a log-prob ``> 0``, NaN) can break the staircase; the
tree is then wrong, but every index stays in bounds (ranks below ``K``, depths at most ``L``,
node indices at most the budget), and a corner that finds no empty slot is dropped, not
written out of bounds.

Shared memory (static, per block)::

    score                     float32[1056]   4.2 KB   node scores
    node[TAKEN .. LAST_CHILD]   int16[9, 1056] 19.0 KB  the tree and the level lists: taken,
                                                        depth, parent, rank, pred, succ,
                                                        first_child, next_sib, last_child
    level_last, level_full      int16[65]x2    0.3 KB   per depth: newest node, has it a child
    lp_cache                  float32[4096]  16.4 KB   top_log_probs[b, d, r] for r < R
                                            -------
                                             39.9 KB   (< 48 KB; R = min(K, 4096 // L))
"""

from __future__ import annotations

from functools import cache

from numba import cuda, float32, int16, int32, uint32

from ..limits import MAX_DEPTH, MAX_NODES
from ..reference.build_tree_corners import corner_bound
from ._device import kernel_for_block
from ._primitives import FULL_MASK, float_of_key, key_of_float, warp_max_u32
from .build_tree import LP_CACHE, NEG_INF, SELECT_THREADS, _log_prob, write_node_table

NODE_CAPACITY = MAX_NODES
DEPTH_CAPACITY = MAX_DEPTH + 1      # depths 0 .. L, L <= 64
SLOT_CHOICES = (2, 4, 8, 16)        # slots a lane holds: 64 to 512 corners a warp
# 32 x 16 slots hold every frontier the limits allow: L <= 64 and B <= 1055 give at most
# 64 + floor(sqrt(2 * 64 * 1055)) = 431 corners
assert 32 * SLOT_CHOICES[-1] >= corner_bound(MAX_DEPTH, MAX_NODES - 1)
# The int16 fields of a node, rows of one shared array (one base address for all of them)
TAKEN, DEPTH, PARENT, RANK, PRED, SUCC, FIRST_CHILD, NEXT_SIB, LAST_CHILD = range(9)
NODE_FIELDS = 9
ONE = uint32(1)
NONE = uint32(0xFFFFFFFF)             # "no lane" / "no slot": never a lane or slot index
NO_NODE = int32(-1)


def slots_per_lane(L: int, budget: int) -> int:
    """``P``: the fewest slots a lane can hold so that warp 0 holds every corner."""
    need = corner_bound(L, budget)
    return next(P for P in SLOT_CHOICES if 32 * P >= need)


@cuda.jit(device=True, inline="always")
def _finite_key(score):
    """The orderable key of a candidate's score; 0 (no candidate) for ``-inf`` and NaN (only
    unchecked input makes a NaN: a ``+inf`` score plus a ``-inf`` log-prob). A select, not a
    branch: this runs three times a pop on the warp's critical path."""
    key = key_of_float(score)
    return key if score > NEG_INF else uint32(0)


@cache
def corners_select_kernel(P: int):
    """The select kernel with ``P`` slots a lane (compiled once per ``P``)."""

    @kernel_for_block(SELECT_THREADS)
    def _select_corners_kernel(lp, budget, parents, depths, log_weights, next_token,
                               next_sibling, ranks, num_nodes):
        """Grid ``(bs,)``, block ``(SELECT_THREADS,)``; warp 0 pops, all threads set up and
        write out."""
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        L, K = lp.shape[1], lp.shape[2]

        node = cuda.shared.array((NODE_FIELDS, NODE_CAPACITY), int16)   # node[TAKEN, u], ...
        score = cuda.shared.array(NODE_CAPACITY, float32)
        level_last = cuda.shared.array(DEPTH_CAPACITY, int16)  # newest node of each depth
        level_full = cuda.shared.array(DEPTH_CAPACITY, int16)  # 1: that node has a child
        lp_cache = cuda.shared.array(LP_CACHE, float32)
        count_s = cuda.shared.array(1, int32)

        # Set-up by the whole block: empty lists, the root, log-probs staged
        R = min(K, LP_CACHE // L)                   # cached ranks per depth row
        for i in range(tid, NODE_CAPACITY, SELECT_THREADS):
            node[TAKEN, i] = 0
            node[SUCC, i] = -1
            node[FIRST_CHILD, i] = -1
            node[NEXT_SIB, i] = -1
            node[LAST_CHILD, i] = -1
        for d in range(tid, DEPTH_CAPACITY, SELECT_THREADS):
            level_last[d] = 0 if d == 0 else -1     # depth 0: the root alone
            level_full[d] = 0
        if tid == 0:                                # the root: node 0
            score[0] = 0.0
            node[DEPTH, 0] = 0
            node[PARENT, 0] = -1
            node[RANK, 0] = -1
            node[PRED, 0] = -1
        for e in range(tid, L * R, SELECT_THREADS):   # lp_cache[d * R + r] = lp[b, d, r]
            d = e // R
            lp_cache[e] = lp[b, d, e - d * R]
        cuda.syncthreads()                          # set-up done before warp 0 reads it

        if tid < 32:
            # As in the "warp" variant, indices are unsigned (no negative-index wrap in
            # numba's indexing), sums are cast back to 32 bits (numba computes them in 64)
            # and the bounds are precomputed: a candidate (u, r + 1) exists while
            # r < last_rank, a child candidate while d < last_depth.
            last_rank = uint32(K - 1)
            last_depth = uint32(L - 1)
            R32 = uint32(R)
            B32 = uint32(budget)
            lane32 = uint32(lane)
            # this lane's corners: slot q holds slot_key[q] (0: empty) and the parent
            # slot_node[q];
            # registers, because every index is a constant once the loops over q unroll
            slot_key = cuda.local.array(P, uint32)
            slot_node = cuda.local.array(P, uint32)
            for q in range(P):
                slot_key[q] = uint32(0)
                slot_node[q] = uint32(0)
            if lane == 0:                           # the root's candidate (0, 0)
                slot_key[0] = _finite_key(float32(0.0) + lp_cache[0])
            best_key = slot_key[0]                  # this lane's largest slot: key, node, q
            best_node = uint32(0)
            best_q = uint32(0)
            # bit q set: slot q is empty (all of them, but slot 0 where it took the root's)
            empty = uint32((1 << P) - 1) if best_key == 0 else uint32((1 << P) - 2)

            count = uint32(1)
            while count <= B32:                     # count - 1 pops so far, of B
                lanes_empty = cuda.ballot_sync(FULL_MASK, empty != uint32(0))   # read in step 5

                # 1. the largest slot of the warp: its key, then the smallest node holding it
                hi = warp_max_u32(best_key)
                if hi == 0:                         # nothing finite left (uniform)
                    break
                lo = warp_max_u32(uint32(~best_node) if best_key == hi else uint32(0))
                u = uint32(~lo)                     # the parent; the pop is (u, taken[u])
                mine = best_key == hi and best_node == u    # one lane: nodes are distinct
                s_pop = float_of_key(hi)            # exact: the key is a bijection

                # 2. what the pop reads: u's fields, then its neighbours' and the log-probs
                r = uint32(node[TAKEN, u])
                d = uint32(node[DEPTH, u])
                s_u = score[u]
                before = int32(node[PRED, u])       # -1: u is the first of its depth
                after = int32(node[SUCC, u])        # -1: u is the newest of its depth
                older = int32(node[LAST_CHILD, u])  # -1: this is u's first child
                r1 = uint32(r + ONE)
                d1 = uint32(d + ONE)
                newest = int32(level_last[d1])      # the node before c at depth d + 1
                has_child = level_full[d1] != 0
                # node 0 stands in for a missing neighbour; its values are then not used
                v_before = uint32(max(before, int32(0)))
                v_after = uint32(max(after, int32(0)))
                taken_before = uint32(node[TAKEN, v_before])
                taken_after = uint32(node[TAKEN, v_after])
                s_after = score[v_after]
                lp_popped = _log_prob(lp, lp_cache, b, d, r, R32)
                lp_next = _log_prob(lp, lp_cache, b, d, r1, R32) if r < last_rank else NEG_INF
                lp_child = lp_cache[uint32(d1 * R32)] if d < last_depth else NEG_INF

                # 3. the three corners the pop changes; key 0: none (or -inf)
                key_u = uint32(0)                   # u's next candidate (u, r + 1)
                if r < last_rank and (before == NO_NODE or taken_before > r1):
                    key_u = _finite_key(s_u + lp_next)
                key_after = uint32(0)               # after's candidate (after, r)
                if after != NO_NODE and taken_after == r:
                    key_after = _finite_key(s_after + lp_popped)
                c = count                           # the new node; its candidate (c, 0)
                key_c = uint32(0)
                if d < last_depth and (newest == NO_NODE or has_child):
                    key_c = _finite_key(s_pop + lp_child)

                # 4. the tree, written by every lane alike (the module docstring)
                cuda.syncwarp(FULL_MASK)            # every lane's reads done before any write
                node[TAKEN, u] = r1
                node[LAST_CHILD, u] = c
                if older == NO_NODE:                # children are made in rank order
                    node[FIRST_CHILD, u] = c
                else:
                    node[NEXT_SIB, uint32(older)] = c
                score[c] = s_pop
                node[DEPTH, c] = d1
                node[PARENT, c] = u
                node[RANK, c] = r
                node[PRED, c] = newest
                if newest != NO_NODE:
                    node[SUCC, uint32(newest)] = c
                level_last[d1] = c
                level_full[d1] = 0                  # c, the newest of its depth, has none
                if after == NO_NODE:                # u is the newest of its depth
                    level_full[d] = 1

                # 5. the slots. The popped one keeps u, or takes the first new corner; the
                #    others go to the lowest and the highest lane with an empty slot (the
                #    first empty slot there; the second where one lane takes both)
                keep_key, keep_node = key_u, u
                first_key, first_node = key_after, v_after
                second_key, second_node = key_c, c
                if first_key == 0:
                    first_key, first_node = second_key, second_node
                    second_key = uint32(0)
                if keep_key == 0:
                    keep_key, keep_node = first_key, first_node
                    first_key, first_node = second_key, second_node
                    second_key = uint32(0)
                # (all 32-bit and unsigned, NONE where there is none: numba would compare
                # signed values in 64 bits, two instructions each, on the critical path)
                lowest = uint32(cuda.ffs(lanes_empty) - ONE)        # NONE: no lane (bad input)
                highest = uint32(uint32(31) - cuda.clz(lanes_empty))
                empty_1 = uint32(cuda.ffs(empty) - ONE)              # this lane's empty slots
                empty_2 = uint32(cuda.ffs(empty & uint32(empty - ONE)) - ONE)
                to_keep = best_q if mine else NONE                   # which slot takes what
                to_first = empty_1 if lane32 == lowest and first_key != 0 else NONE
                to_second = NONE
                if lane32 == highest and second_key != 0:
                    to_second = empty_2 if lane32 == lowest else empty_1
                best_key = uint32(0)
                best_node = uint32(0)
                empty = uint32(0)
                for q in range(P):
                    k = slot_key[q]
                    n = slot_node[q]
                    if uint32(q) == to_keep:
                        k, n = keep_key, keep_node
                    if uint32(q) == to_first:
                        k, n = first_key, first_node
                    if uint32(q) == to_second:
                        k, n = second_key, second_node
                    slot_key[q] = k
                    slot_node[q] = n
                    if k > best_key or (k == best_key and k != 0 and n < best_node):
                        best_key, best_node, best_q = k, n, uint32(q)
                    if k == 0:
                        empty |= uint32(1 << q)
                count = uint32(count + ONE)
            if lane == 0:
                count_s[0] = count
        cuda.syncthreads()                          # the tree is complete before write-out

        # Coalesced write-out of rows [0, N), padding included
        write_node_table(b, tid, count_s[0], node[PARENT], node[DEPTH], score,
                         node[FIRST_CHILD], node[NEXT_SIB], node[RANK], parents, depths,
                         log_weights, next_token, next_sibling, ranks, num_nodes)

    return _select_corners_kernel
