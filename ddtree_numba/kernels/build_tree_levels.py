"""``build_tree``'s select phase level by level: variant ``"levels"`` (no chain of pops).

The kernel of :mod:`ddtree_numba.reference.build_tree_levels` (read its docstring first: the
order, the candidate bound and why nothing is lost). One block of ``LEVEL_THREADS`` threads per
request keeps ``G``, the best nodes found so far in pop order, as packed 64-bit keys in shared
memory::

    key = orderable(score) << 32  |  0xFFFFFFFF - ((parent + 1) << 11 | rank)

``parent`` is the parent's position in ``G`` (``-1``: the root), so a *descending* order of keys
is the pop order: score first, then the parent popped earlier, then the smaller rank. Key 0 is
"no node" (every real key is larger: even ``-inf`` has a nonzero orderable key). Round ``d``:

a. ``plist``: the positions in ``G`` of its depth ``d - 1`` nodes, in order (a block scan);
b. every parent ``u`` (thread ``u``, ``u + T``, ...) finds by binary search how many of its
   children pass the two tests (``(u + 1)(r + 1) <= B``; finite and not below the ``B``-th key
   of ``G``), a prefix ``r < count[u]`` of its row; a block scan gives ``offsets``;
c. the candidates, ``CHUNK`` (2048) at a time: candidate ``j`` finds its parent by binary search in
   ``offsets``, is scored ``fl(s_u + lp[d - 1, r])`` and packed; the chunk is sorted (bitonic,
   descending) and merged into ``G``: every element's new position is its index plus the number
   of larger keys in the other list (a binary search), all read before a barrier (a thread
   holds its ``HELD`` elements in registers) and written after it, the first ``B`` kept; then
   the parents' positions inside the keys (and ``plist``) are moved to the new positions
   (``newpos``; ``-2``: dropped, whose children are skipped).

After the last round the node table is written: node ``i + 1`` is ``G[i]``; the child lists come
from one more sort, of ``(parent, rank)`` pairs: siblings are consecutive there, ranks ``0 ..
m - 1`` (a parent's taken children are a prefix of its row).

The body is the device function ``select_levels``: ``_select_levels_kernel`` calls it
with static shared arrays, and the ``"threshold"`` select calls it as its fall-back with slices
of its own shared memory (``build_tree_threshold``), in a block of the same ``LEVEL_THREADS``
(512) threads. (Before the twenty-ninth session this kernel ran 1 024 threads and kept a
merge's elements in a local array indexed at run time, 64 B of stack; the timings in the docs
are from that build.)

Barriers: a round is bound by them (about 7 us a round on the H200 with the shared-memory scan
and sort, 1 024 threads). On a GPU the two block scans take 1 barrier each (open scans, closed
by the barrier after their sums), and a sort takes ``bitonic_sort_desc``'s GPU path
(``kernels._primitives``: strides below 32 in registers, and more than ``T`` keys two or
four a thread); the simulator runs the shared-memory versions of both.

Shared memory (static in this kernel, on a GPU): ``G`` 8 448 B, depths 2 112 B, candidates 16 384 B,
``plist``, ``offsets`` and ``newpos`` 12 672 B, the round's first ``min(K, B)`` log-probs
4 224 B, the block scan's 64 B (one int32 a warp; one a thread on the simulator), ``state``
8 B: 43 912 B of the 49 152 B a static allocation may take.
"""

from __future__ import annotations

from numba import cuda, float32, int16, int32, uint32, uint64

from ..limits import MAX_NODES
from ._device import SIMULATOR, kernel_for_block
from ._primitives import (
    bitonic_sort_desc,
    block_inclusive_scan_open,
    block_scan_scratch,
    float_of_key,
    key_of_float,
)

NODE_CAPACITY = MAX_NODES           # as build_tree: N <= 1056
CAND_CAP = 2048                     # the candidate buffer: a power of two >= NODE_CAPACITY
CHUNK = 64 if SIMULATOR else CAND_CAP   # candidates sorted and merged at once (the simulator
                                        # takes small chunks so that tests cover several)
# 512 threads: the "threshold" select's block, which runs this select as its fall-back
LEVEL_THREADS = 32 if SIMULATOR else 512
G_HELD = -(-NODE_CAPACITY // LEVEL_THREADS)     # G elements a thread holds in a merge
C_HELD = CHUNK // LEVEL_THREADS                 # chunk elements a thread holds
HELD = G_HELD + C_HELD                          # a merge's elements per thread
SCAN_SCRATCH = block_scan_scratch(LEVEL_THREADS)        # the block scan's shared int32s
# What the arrays and key fields above assume (a change to one constant must keep them true)
assert CHUNK % LEVEL_THREADS == 0 and CHUNK & (CHUNK - 1) == 0 and CHUNK <= CAND_CAP
assert CAND_CAP >= NODE_CAPACITY and LEVEL_THREADS * G_HELD >= NODE_CAPACITY
RANK_RADIX = 2048      # a key's low word: (parent + 1) * RANK_RADIX + rank: an 11-bit rank
assert NODE_CAPACITY <= RANK_RADIX
LOW = uint64(0xFFFFFFFF)
NEG_INF = float32(-float("inf"))


@cuda.jit(device=True, inline="always")
def _pack(score, parent, rank):
    """The descending-order key of a node (see the module docstring)."""
    low = uint64((parent + 1) * RANK_RADIX + rank)
    return (uint64(key_of_float(score)) << uint64(32)) | (LOW - low)


@cuda.jit(device=True, inline="always")
def _score(key):
    return float_of_key(uint32(key >> uint64(32)))


@cuda.jit(device=True, inline="always")
def _parent(key):
    return int32((LOW - (key & LOW)) // uint64(RANK_RADIX)) - 1


@cuda.jit(device=True, inline="always")
def _rank(key):
    return int32((LOW - (key & LOW)) % uint64(RANK_RADIX))


@cuda.jit(device=True, inline="always")
def _count_larger(keys, n, key):
    """How many of ``keys[0:n]`` (descending) are larger than ``key``: a binary search."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] > key:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit(device=True, inline="always")
def _scan_owned(values, n, scratch, tid, T):
    """All threads of the block, after a barrier that put ``values[0:n]`` in place (it has
    a block scan and barriers). In place, the inclusive prefix sums of ``values[0:n]``:
    thread ``t`` owns the contiguous span ``[t s, (t + 1) s)``, ``s = ceil(n / T)``, sums it,
    and one block scan of the span sums gives each thread its offset. Returns the total."""
    span = (n + T - 1) // T
    first = tid * span
    last = min(first + span, n)
    own = 0
    for i in range(first, last):
        own += values[i]
    inclusive, total = block_inclusive_scan_open(scratch, own, tid, T)
    before = inclusive - own
    for i in range(first, last):
        before += values[i]
        values[i] = before
    cuda.syncthreads()                      # the sums are in place before anyone reads them
                                            # (and the scan's scratch read: it closes it)
    return total


@cuda.jit(device=True, inline="always")
def _node_fields(key, depth, node, L, K):
    """``(parent, depth, rank)`` of tree node ``node`` (G's element ``node - 1``). Valid input
    always gives ``0 <= parent < node``, ``1 <= depth <= L`` and ``0 <= rank < K``; only
    unchecked input that breaks the rules (a log-prob > 0) can break them, and then the node
    hangs under the root as its first child: the tree is wrong, but the child lists and the
    finish kernel (which walks parents to the root and reads ``top_token_ids[b, depth - 1,
    rank]``) stay in bounds and terminate."""
    parent = _parent(key) + 1
    rank = _rank(key)
    d = int32(depth)
    if 0 <= parent < node and 1 <= d <= L and 0 <= rank < K:
        return parent, d, rank
    return int32(0), int32(1), int32(0)


@cuda.jit(device=True, inline="always")
def select_levels(lp, B, parents, depths, log_weights, next_token, next_sibling, ranks,
                  num_nodes, b, tid, T, g_key, g_depth, cand, plist, offsets, newpos, scratch,
                  lp_row, state):
    """The node table of request ``b`` by this block of ``T`` threads (``T`` a multiple of 32,
    at least ``LEVEL_THREADS``: a merge holds ``HELD`` elements a thread), in the shared arrays
    given (their sizes as in ``_select_levels_kernel``, but ``scratch``:
    ``block_scan_scratch(T)``). Every thread calls it; it begins
    by writing shared memory, so the caller puts a barrier before it if the block read these
    arrays as something else (the ``"threshold"`` select's fall-back does)."""
    L, K = lp.shape[1], lp.shape[2]
    N = parents.shape[1]
    # a merge's elements of this thread, in registers: every index below is a constant once
    # the loops over G_HELD and C_HELD are unrolled (a dynamic index would put them in local
    # memory)
    my_key = cuda.local.array(HELD, uint64)
    my_depth = cuda.local.array(HELD, int16)
    my_pos = cuda.local.array(HELD, int32)

    if tid == 0:
        state[0] = 0
        state[1] = 1
        plist[0] = -1                                      # round 1: the root's children
    cuda.syncthreads()                                     # state set before anyone reads it
    for d in range(1, L + 1):
        n = state[0]
        P = state[1]
        if B == 0 or P == 0:
            break
        floor = uint64(0) if n < B else g_key[B - 1]       # the B-th key (0: none yet)
        # the round's log-probs, read once (coalesced) instead of by every dependent step of
        # the searches below, each a global load's latency
        # (a parent takes at most B // (u + 1) <= B children: ranks below min(K, B) only)
        for r in range(tid, min(K, B), T):
            lp_row[r] = lp[b, d - 1, r]
        cuda.syncthreads()                                 # the row in place
        # b. how many children of each parent can be taken: a prefix of its row
        for u in range(tid, P, T):
            pp = plist[u]
            s_u = float32(0.0) if pp < 0 else _score(g_key[pp])
            lo = 0
            hi = min(K, B // (u + 1))
            while lo < hi:                                 # first r that fails
                mid = (lo + hi) // 2
                s = s_u + lp_row[mid]
                if s > NEG_INF and _pack(s, pp, mid) > floor:
                    lo = mid + 1
                else:
                    hi = mid
            offsets[u] = lo
        cuda.syncthreads()                                 # counts in place
        M = _scan_owned(offsets, P, scratch, tid, T)
        # c. the candidates, CHUNK at a time, merged into G
        for c0 in range(0, M, CHUNK):
            m = min(CHUNK, M - c0)
            m2 = 1
            while m2 < m:
                m2 *= 2
            for j in range(tid, m2, T):
                key = uint64(0)
                if j < m:
                    g = c0 + j
                    lo = 0                                 # parent: first u with offsets > g
                    hi = P - 1
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if offsets[mid] > g:
                            hi = mid
                        else:
                            lo = mid + 1
                    r = g - (offsets[lo - 1] if lo > 0 else 0)     # its rank in the row
                    pp = plist[lo]
                    if pp != -2:                           # parent still in G
                        s_u = float32(0.0) if pp < 0 else _score(g_key[pp])
                        key = _pack(s_u + lp_row[r], pp, r)
                cand[j] = key
            cuda.syncthreads()                             # the chunk written before sorting
            bitonic_sort_desc(cand, m2, tid, T)
            n = state[0]
            # merge: new position = own index + larger keys in the other list. This thread's
            # elements: slot q < G_HELD is G's i = tid + q T, slot G_HELD + q the chunk's
            # j = tid + q T; a slot with nothing to move gets position B (never written)
            for q in range(G_HELD):
                i = tid + q * T
                key = uint64(0)
                dep = int16(0)
                pos = B
                if i < n:
                    key = g_key[i]
                    dep = g_depth[i]
                    pos = i + _count_larger(cand, m, key)
                my_key[q] = key
                my_depth[q] = dep
                my_pos[q] = pos
            for q in range(C_HELD):
                j = tid + q * T
                key = uint64(0)
                pos = B
                if j < m:
                    key = cand[j]
                    if key != 0:
                        pos = j + _count_larger(g_key, n, key)
                my_key[G_HELD + q] = key
                my_depth[G_HELD + q] = int16(d)
                my_pos[G_HELD + q] = pos
            kept = min(B, n + _count_larger(cand, m, uint64(0)))   # nonzero keys: a prefix
            cuda.syncthreads()                             # every read done before the writes
            for q in range(G_HELD):                        # old position -> new one
                i = tid + q * T
                if i < n:
                    newpos[i] = my_pos[q] if my_pos[q] < B else -2
            for q in range(HELD):                          # the first B of the merge
                if my_pos[q] < B:
                    g_key[my_pos[q]] = my_key[q]
                    g_depth[my_pos[q]] = my_depth[q]
            cuda.syncthreads()                             # G and newpos complete
            # the parents' positions inside the keys, and this round's parent list, moved
            for i in range(tid, kept, T):
                key = g_key[i]
                pp = _parent(key)
                if pp >= 0:
                    # newpos[pp] < 0 (a parent the merge dropped) needs a log-prob > 0, which
                    # the checks refuse; unchecked, the node then hangs under the root: the
                    # tree is wrong, but every index stays in bounds
                    g_key[i] = _pack(_score(key), max(newpos[pp], 0), _rank(key))
            for u in range(tid, P, T):
                if plist[u] >= 0:
                    plist[u] = newpos[plist[u]]
            if tid == 0:
                state[0] = kept
            cuda.syncthreads()                             # keys, plist and n up to date
        # a. the next round's parents: G's depth-d nodes, in order
        n = state[0]
        for i in range(tid, n, T):
            newpos[i] = 1 if g_depth[i] == d else 0
        cuda.syncthreads()                                 # flags in place
        count = _scan_owned(newpos, n, scratch, tid, T)
        for i in range(tid, n, T):
            if g_depth[i] == d:
                plist[newpos[i] - 1] = i                   # inclusive count - 1: its slot
        if tid == 0:
            state[1] = count
        cuda.syncthreads()                                 # plist complete for the next round

    # the node table: node i + 1 is G[i]; child lists from a sort of (parent, rank) pairs
    n = state[0]
    if tid == 0:
        num_nodes[b] = n + 1
    for i in range(tid, N, T):
        next_token[b, i] = -1
        next_sibling[b, i] = -1
        if i == 0:
            parents[b, 0] = -1
            depths[b, 0] = 0
            log_weights[b, 0] = 0.0
            ranks[b, 0] = -1
        elif i <= n:
            key = g_key[i - 1]
            parent, depth, rank = _node_fields(key, g_depth[i - 1], i, L, K)
            parents[b, i] = parent
            depths[b, i] = depth
            log_weights[b, i] = _score(key)
            ranks[b, i] = rank
        else:
            parents[b, i] = -1
            depths[b, i] = -1
            log_weights[b, i] = NEG_INF
            ranks[b, i] = -1
    n2 = 1
    while n2 < n:
        n2 *= 2
    # (parent node, rank, node) as bits 32-63, 16-31 and 0-15 (nodes < MAX_NODES < 2**16)
    for i in range(tid, n2, T):
        cand[i] = uint64(0)
        if i < n:
            parent, _, rank = _node_fields(g_key[i], g_depth[i], i + 1, L, K)
            cand[i] = ((uint64(parent) << uint64(32)) | (uint64(rank) << uint64(16))
                       | uint64(i + 1))
    cuda.syncthreads()                                     # pairs in place before sorting
    bitonic_sort_desc(cand, n2, tid, T)
    for j in range(tid, n, T):                             # descending: rank r + 1 before r
        node = int32(cand[j] & uint64(0xFFFF))
        parent = int32(cand[j] >> uint64(32))
        rank = int32((cand[j] >> uint64(16)) & uint64(0xFFFF))
        if rank == 0:
            next_token[b, parent] = node
        if j > 0 and int32(cand[j - 1] >> uint64(32)) == parent:
            next_sibling[b, node] = int32(cand[j - 1] & uint64(0xFFFF))


@kernel_for_block(LEVEL_THREADS)
def _select_levels_kernel(lp, budget, parents, depths, log_weights, next_token, next_sibling,
                          ranks, num_nodes):
    """Grid ``(bs,)``, block ``(LEVEL_THREADS,)``; the node table of request ``b``."""
    g_key = cuda.shared.array(NODE_CAPACITY, uint64)       # G, descending (pop order)
    g_depth = cuda.shared.array(NODE_CAPACITY, int16)
    cand = cuda.shared.array(CAND_CAP, uint64)
    plist = cuda.shared.array(NODE_CAPACITY, int32)        # this round's parents (positions)
    offsets = cuda.shared.array(NODE_CAPACITY, int32)      # counts, then inclusive sums
    newpos = cuda.shared.array(NODE_CAPACITY, int32)       # old position -> new (-2: dropped)
    scratch = cuda.shared.array(SCAN_SCRATCH, int32)
    lp_row = cuda.shared.array(NODE_CAPACITY, float32)    # lp[b, d - 1, :min(K, B)]
    state = cuda.shared.array(2, int32)                    # [n = |G|, parents this round]
    # a constant step (see _device.launch)
    select_levels(lp, budget, parents, depths, log_weights, next_token, next_sibling, ranks,
                  num_nodes, cuda.blockIdx.x, cuda.threadIdx.x, LEVEL_THREADS, g_key, g_depth,
                  cand, plist, offsets, newpos, scratch, lp_row, state)
