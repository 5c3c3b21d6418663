"""GPU best-first tree builder: ``kernels.build_tree``, bit-exact to ``reference.build_tree``.

Which select runs: ``"corners"`` below budget ``THRESHOLD_FROM_BUDGET`` (128), ``"threshold"``
from there on (no pops at all: every node above a rising floor, level by level; see
:mod:`ddtree_numba.kernels.build_tree_threshold`), ``"scan"`` on the simulator. The others
(``"warp"``, ``"levels"``) are asked for by name; ``"levels"`` is also the threshold select's
fall-back where ties crowd its list. This module holds the pop-based selects and the launcher.

The reference keeps the frontier in a heap. Two facts make a heap unnecessary for the pops:

1. **One pending candidate per node.** Candidate ``(p, r + 1)`` is pushed only when ``(p, r)``
   is popped, so every taken node ``p`` has at most one candidate waiting: its next unexpanded
   rank ``next_rank[p]``, with score ``cand[p]`` (``-inf`` = none). The frontier is the array
   ``cand[0:count]``, and "highest score, ties by smaller p, then smaller r" becomes
   "largest ``cand[p]``, ties by smaller ``p``" (two candidates never share a ``p``).
2. **New candidates are appended.** A pop changes only ``cand[p]`` (its next sibling) and
   ``cand[c]`` (the new node's first child), so the arg-max can be maintained incrementally.

Launches (one batch, no host synchronisation, no per-request Python loop)::

    select kernel   grid (bs,)                  one request per block: the select
    finish kernel   grid (ceil(N / rows), bs)   ``rows`` tree rows per block (``finish_rows``:
                                                32, fewer where the grid would not fill the
                                                SMs): tokens, positions, visibility_bits,
                                                visibility, in parallel
                                                (:mod:`ddtree_numba.kernels.build_tree_finish`)

Select, variant ``"scan"`` (readable; the simulator path): one thread per request; each pop
scans ``cand[0:count]`` for the arg-max, ``O(count)`` per pop and ``O(B^2)`` per tree.

Select, variant ``"corners"`` (the default on a GPU below budget 128): the pops searched over
the frontier's corners only, held in one warp's registers;
:mod:`ddtree_numba.kernels.build_tree_corners`.

Select, variant ``"warp"`` (GPU sm_80+, needs warp intrinsics): a two-level tournament
run by one warp. Scores are compared as *orderable keys* (float32 bits mapped to uint32 so that
unsigned order = float order; key 0 = no candidate). Lane ``l`` owns the contiguous node group
``[33 l, 33 l + 33)`` (``33 * 32 = 1056`` nodes, so ``N <= 1056``) and keeps its group's best
``(key, node)`` in registers. A pop is

* ``redux.sync.max`` of the 32 lane bests (one instruction), then ``ffs(ballot(best == max))``:
  the lowest lane holding the max, i.e. the smallest node index among equal scores (groups are
  contiguous and ascending, and each lane keeps the smallest node of its own ties): the
  reference's order;
* a handful of shared-memory reads (``next_rank``, ``depth``, ``score`` of ``p``; two log-probs
  from a shared-memory copy of ``top_log_probs[b, :, :R]``), one lane writing the new node;
* the refresh of the two lane bests that changed: the whole warp rescans the popped node's
  group (each lane reads 2 of its 33 entries, one more ``redux`` + ``ballot``), and the new
  node's lane compares one key.

So a pop costs two warp reductions and four dependent shared-memory round trips, whatever
``N``, with no block-wide barrier inside the loop (only ``syncwarp``). The loop's indices are
unsigned, because numba adds a negative-index wrap to every signed index, and its bounds are
precomputed. History: the first version rescanned the group serially in its owner lane
(33 dependent loads) and reduced with a 5-step ``shfl_xor`` tree: 0.78 us per pop on the H200;
now 0.59-0.71 us; see ``benchmarks/NOTES.md``. The other
three warps of the block help with the set-up (initialise shared arrays, stage log-probs) and
the coalesced write-out.

Why the order is exactly the reference's: both pop the maximum of the same frontier with the
same tie rule; scores are the same float32 sums (``score(p) + lp``, one rounding, never a
subtraction); ``-inf`` candidates are never selected (a selection needs ``> -inf``, key ``> 0``).

Shared memory of the warp variant (static, per block)::

    cand, score       uint32, float32[1056]   8.4 KB   candidate key per node, node scores
    next_rank                 int32[1056]     4.2 KB   next unexpanded rank per node
    parent, depth, rank,
    first_child, next_sib,
    last_child                int16[1056]x6  12.7 KB   the tree under construction
    lp_cache                  float32[4096]  16.4 KB   top_log_probs[b, d, r] for r < R
                                            -------
                                             41.7 KB   (< 48 KB; R = min(K, 4096 // L))
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int16, int32, uint32

from ..contracts import DraftTree
from ..limits import MAX_DEPTH, MAX_NODES, ceil_words
from ..validation import check_build_tree, require_buffer
from ._device import (
    CACHE_KERNELS,
    SIMULATOR,
    as_device,
    device_empty,
    launch,
    launch_stream,
    resolve_variant,
)
from ._primitives import FULL_MASK, float_of_key, key_of_float, warp_max_u32
from .build_tree_finish import (
    FINISH_THREADS,
    _finish_kernel,
    launch_finish,
)

NODE_CAPACITY = MAX_NODES           # 1056 = 32 lanes x 33 nodes
GROUP = NODE_CAPACITY // 32         # nodes owned by one lane in the warp tournament (33)
LP_CACHE = 4096                     # float32 log-probs staged in shared memory per request
SELECT_THREADS = 128                # warp variant: 1 warp pops, 4 warps set up and write out
#: From this budget on, the default GPU select is ``"threshold"`` (no pops), below it
#: ``"corners"`` (one pop at a time over the frontier's corners). On the H200
#: (``benchmarks/results/build_tree.csv``, 2026-12-05; graph replay, L2 flushed) the
#: threshold select takes 42 / 57 / 59 us at budget 128 and bs 1 / 8 / 64 against the
#: corners pops' 59 / 61 / 61, and wins more at 256 and 1 024; at budget 64 the pops win
#: (30 / 32 / 32 against 31 / 38 / 50).
THRESHOLD_FROM_BUDGET = 128
NEG_INF = float32(-np.inf)


# ------------------------------------------------------------------------------------------
# Variant "scan": one thread per request, a linear arg-max per pop (readable, simulator-safe)
# ------------------------------------------------------------------------------------------
@cuda.jit(cache=CACHE_KERNELS)
def _select_scan_kernel(lp, budget, parents, depths, log_weights, next_token, next_sibling,
                        ranks, num_nodes):
    """Grid ``(bs,)``, block ``(1,)``. Writes rows ``[0, N)`` of the node table of request b."""
    b = cuda.blockIdx.x
    L, K = lp.shape[1], lp.shape[2]
    N = parents.shape[1]
    cand = cuda.shared.array(NODE_CAPACITY, float32)       # frontier score of node p's candidate
    next_rank = cuda.shared.array(NODE_CAPACITY, int32)    # rank r of node p's candidate
    last_child = cuda.shared.array(NODE_CAPACITY, int32)   # newest child of p (list tail)

    for i in range(N):                                      # padding everywhere first
        cand[i] = NEG_INF
        last_child[i] = -1
        parents[b, i] = -1
        depths[b, i] = -1
        log_weights[b, i] = NEG_INF
        next_token[b, i] = -1
        next_sibling[b, i] = -1
        ranks[b, i] = -1
    depths[b, 0] = 0                                        # the root: depth 0, score 0
    log_weights[b, 0] = 0.0
    cand[0] = float32(0.0) + lp[b, 0, 0]                    # frontier = {(0, 0)}
    next_rank[0] = 0

    count = 1
    while count - 1 < budget:
        # 1. pop: the largest cand[p]; strict '>' keeps the smaller p on ties
        best = NEG_INF
        p = -1
        for q in range(count):
            if cand[q] > best:
                best = cand[q]
                p = q
        if p < 0:                                           # only -inf left: frontier empty
            break
        # 2. the popped candidate (p, r) becomes node c
        r = next_rank[p]
        dp = depths[b, p]
        c = count
        parents[b, c] = p
        depths[b, c] = dp + 1
        log_weights[b, c] = best
        ranks[b, c] = r
        if last_child[p] < 0:                               # children are appended in index
            next_token[b, p] = c                            # order, so the first one is the
        else:                                               # smallest and each link points
            next_sibling[b, last_child[p]] = c              # to the next larger sibling
        last_child[p] = c
        # 3. push (p, r + 1) and (c, 0); -inf means "not pushed"
        cand[p] = NEG_INF
        if r + 1 < K:
            cand[p] = log_weights[b, p] + lp[b, dp, r + 1]
            next_rank[p] = r + 1
        cand[c] = NEG_INF
        if dp + 1 < L:
            cand[c] = best + lp[b, dp + 1, 0]
            next_rank[c] = 0
        count += 1
    num_nodes[b] = count


# ------------------------------------------------------------------------------------------
# Variant "warp": one warp per request, a two-level tournament (GPU only)
# ------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline="always")
def _log_prob(lp, lp_cache, b, d, r, R):
    """``top_log_probs[b, d, r]`` from the shared copy when ``r < R``, else from global."""
    if r < R:
        return lp_cache[uint32(d * R + r)]         # unsigned: no negative-index wrap
    return lp[b, d, r]


@cuda.jit(device=True, inline="always")
def _candidate_key(score):
    """Orderable key of a candidate score; key 0 (= not pushed) for ``-inf``."""
    if score == NEG_INF:
        return uint32(0)
    return key_of_float(score)


@cuda.jit(cache=CACHE_KERNELS)
def _select_warp_kernel(lp, budget, parents, depths, log_weights, next_token, next_sibling,
                        ranks, num_nodes):
    """Grid ``(bs,)``, block ``(SELECT_THREADS,)``; warp 0 pops, all threads set up / write."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % 32
    L, K = lp.shape[1], lp.shape[2]

    cand = cuda.shared.array(NODE_CAPACITY, uint32)     # orderable key of p's candidate
    score = cuda.shared.array(NODE_CAPACITY, float32)
    next_rank = cuda.shared.array(NODE_CAPACITY, int32)
    parent_s = cuda.shared.array(NODE_CAPACITY, int16)
    depth_s = cuda.shared.array(NODE_CAPACITY, int16)
    rank_s = cuda.shared.array(NODE_CAPACITY, int16)
    first_child = cuda.shared.array(NODE_CAPACITY, int16)
    next_sib = cuda.shared.array(NODE_CAPACITY, int16)
    last_child = cuda.shared.array(NODE_CAPACITY, int16)
    lp_cache = cuda.shared.array(LP_CACHE, float32)
    count_s = cuda.shared.array(1, int32)

    # 1. set-up by the whole block: empty frontier, empty lists, log-probs staged
    R = min(K, LP_CACHE // L)                       # cached ranks per depth row
    for i in range(tid, NODE_CAPACITY, SELECT_THREADS):
        cand[i] = 0
        first_child[i] = -1
        next_sib[i] = -1
        last_child[i] = -1
    for e in range(tid, L * R, SELECT_THREADS):     # lp_cache[d * R + r] = lp[b, d, r]
        d = e // R
        lp_cache[e] = lp[b, d, e - d * R]
    cuda.syncthreads()                              # staging done before warp 0 reads it

    if tid < 32:
        # The pops: node indices unsigned (< 2**16 here), so that numba indexes shared memory
        # without its negative-index wrap, and the bounds precomputed (r < last_rank rather
        # than r + 1 < K, whose 64-bit sum ptxas cannot narrow). numba still widens uint32
        # arithmetic to 64 bits. This loop is one warp's dependent chain, so every instruction
        # in it is latency.
        last_rank = uint32(K - 1)                   # a sibling exists while r < last_rank
        last_depth = uint32(L - 1)                  # a child exists while depth < last_depth
        R32 = uint32(R)
        B32 = uint32(budget)
        lane32 = uint32(lane)
        # root: node 0, candidate (0, 0) in lane 0's group
        if lane == 0:
            score[0] = 0.0
            depth_s[0] = 0
            parent_s[0] = -1
            rank_s[0] = -1
            next_rank[0] = 0
            cand[0] = _candidate_key(float32(0.0) + lp_cache[0])
        cuda.syncwarp(FULL_MASK)                    # lane 0's writes visible to the warp
        best_key = cand[0] if lane == 0 else uint32(0)   # this lane's group best: key, node
        best_node = int32(0)

        count = uint32(1)
        while count - uint32(1) < B32:
            # 2. global arg-max: one redux max, then the lowest lane holding it
            m = warp_max_u32(best_key)
            if m == 0:                              # frontier empty (uniform across the warp)
                break
            w = int32(cuda.ffs(cuda.ballot_sync(FULL_MASK, best_key == m)) - 1)
            p = uint32(cuda.shfl_sync(FULL_MASK, best_node, w))

            # 3. pop candidate (p, r) as node c; every lane computes the same values
            s_pop = float_of_key(m)                 # exact: the key is a bijection
            r = uint32(next_rank[p])
            dp = uint32(depth_s[p])
            c = count
            sib = uint32(0)                         # key of (p, r + 1)
            if r < last_rank:
                sib = _candidate_key(score[p] + _log_prob(lp, lp_cache, b, dp, r + uint32(1),
                                                          R32))
            child = uint32(0)                       # key of (c, 0)
            if dp < last_depth:
                child = _candidate_key(s_pop + _log_prob(lp, lp_cache, b, dp + uint32(1),
                                                         uint32(0), R32))
            cuda.syncwarp(FULL_MASK)                # all reads of p's entries done before
            if lane == 0:                           # lane 0 overwrites them
                cand[p] = sib
                next_rank[p] = r + uint32(1)
                cand[c] = child
                next_rank[c] = 0
                score[c] = s_pop
                depth_s[c] = dp + uint32(1)
                parent_s[c] = p
                rank_s[c] = r
                last = last_child[p]
                if last < 0:
                    first_child[p] = c
                else:
                    next_sib[uint32(last)] = c
                last_child[p] = c
            cuda.syncwarp(FULL_MASK)                # new keys visible to every lane

            # 4. refresh the lane bests that changed. Group w lost its best: the warp rescans
            #    its 33 entries together, lane j taking entries 2j and 2j + 1 (contiguous, so
            #    the lowest lane holding the max holds the smallest node).
            first = uint32(2) * lane32               # this lane's entries of group w
            q0 = uint32(w) * uint32(GROUP) + first
            local_key = uint32(0)
            local_node = int32(0)
            if first < uint32(GROUP):
                local_key = cand[q0]
                local_node = int32(q0)
                if first + uint32(1) < uint32(GROUP) and cand[q0 + uint32(1)] > local_key:
                    local_key = cand[q0 + uint32(1)]
                    local_node = int32(q0 + uint32(1))
            group_max = warp_max_u32(local_key)
            j = int32(cuda.ffs(cuda.ballot_sync(FULL_MASK, local_key == group_max)) - 1)
            group_node = cuda.shfl_sync(FULL_MASK, local_node, j)
            if lane == w:
                best_key = group_max
                best_node = group_node
            elif lane32 == c // uint32(GROUP):      # c is the largest node of its group:
                if child > best_key:                # it wins only if strictly better
                    best_key = child
                    best_node = int32(c)
            count += uint32(1)
        if lane == 0:
            count_s[0] = count
    cuda.syncthreads()                              # the tree is complete before write-out

    # 5. coalesced write-out of rows [0, N), padding included
    write_node_table(b, tid, count_s[0], parent_s, depth_s, score, first_child, next_sib,
                     rank_s, parents, depths, log_weights, next_token, next_sibling, ranks,
                     num_nodes)


@cuda.jit(device=True, inline="always")
def write_node_table(b, tid, count, parent_s, depth_s, score, first_child, next_sib, rank_s,
                     parents, depths, log_weights, next_token, next_sibling, ranks, num_nodes):
    """Rows ``[0, N)`` of request ``b``'s node table from the shared arrays of a select kernel
    of ``SELECT_THREADS`` threads (thread ``tid`` writes rows ``tid, tid + 128, ...``,
    coalesced): the ``count`` nodes, then padding."""
    N = parents.shape[1]
    if tid == 0:
        num_nodes[b] = count
    for i in range(tid, N, SELECT_THREADS):
        if i < count:
            parents[b, i] = parent_s[i]
            depths[b, i] = depth_s[i]
            log_weights[b, i] = score[i]
            next_token[b, i] = first_child[i]
            next_sibling[b, i] = next_sib[i]
            ranks[b, i] = rank_s[i]
        else:
            parents[b, i] = -1
            depths[b, i] = -1
            log_weights[b, i] = NEG_INF
            next_token[b, i] = -1
            next_sibling[b, i] = -1
            ranks[b, i] = -1


# ------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------
def _tree_layout(bs: int, N: int) -> dict:
    """``{field: (dtype, shape)}`` of a :class:`~ddtree_numba.DraftTree` of ``bs`` trees of
    ``N`` nodes: what the kernels write, every element."""
    W = ceil_words(N)
    return {"token_ids": (np.int32, (bs, N)), "parents": (np.int32, (bs, N)),
            "depths": (np.int32, (bs, N)), "log_weights": (np.float32, (bs, N)),
            "num_nodes": (np.int32, (bs,)), "next_token": (np.int32, (bs, N)),
            "next_sibling": (np.int32, (bs, N)), "visibility": (np.bool_, (bs, N, N)),
            "visibility_bits": (np.uint32, (bs, N, W)), "positions": (np.int32, (bs, N))}


def allocate_tree(bs: int, N: int) -> DraftTree:
    """Device buffers for a :class:`~ddtree_numba.DraftTree` (the kernels write every
    element)."""
    return DraftTree(**{name: device_empty(shape, dtype)
                        for name, (dtype, shape) in _tree_layout(bs, N).items()})


def checked_tree(out, bs: int, N: int) -> DraftTree:
    """``out`` if each of its buffers has the dtype and shape the kernels write (they index
    without bounds checks: a smaller buffer would be written out of bounds), else a
    ``TypeError`` / ``ValueError`` naming the buffer; a new :func:`allocate_tree` when ``out``
    is None."""
    if out is None:
        return allocate_tree(bs, N)
    if not isinstance(out, DraftTree):
        raise TypeError(f"out: expected a DraftTree (allocate_tree), got {type(out).__name__}")
    for name, (dtype, shape) in _tree_layout(bs, N).items():
        require_buffer(f"out.{name}", getattr(out, name), dtype, shape, "allocate_tree",
                       contiguous=True)                 # (mask_views flattens the mask)
    return out


def build_tree(top_log_probs, top_token_ids, root_token_ids, budget, *, prefix_lens=None,
               check=None, variant=None, out=None, scratch=None) -> DraftTree:
    """Build one best-first draft tree per request on the GPU (two launches, a select, then
    the finish; no sync).

    Parameters
    ----------
    top_log_probs : array
        ``float32[bs, L, K]``, rows sorted descending, values ``<= 0`` (numpy or device).
    top_token_ids : array
        ``int32[bs, L, K]``.
    root_token_ids : array
        ``int32[bs]``.
    budget : int
        Draft nodes per tree (``N = budget + 1 <= 1056``).
    prefix_lens : array, optional
        ``int32[bs]``; positions are ``prefix_lens + depths``.
    check : bool, optional
        Run the value checks of ``validation.check_build_tree``. Default:
        on for numpy inputs, off for device inputs (they would need a host copy).
    variant : str, optional
        Default by platform and budget: ``"scan"`` on the simulator (readable: one thread, a
        linear arg-max per pop); on a GPU ``"corners"`` below ``THRESHOLD_FROM_BUDGET`` (the
        pops over the frontier's corners, held in registers;
        :mod:`~ddtree_numba.kernels.build_tree_corners`) and ``"threshold"`` from it on (no
        pops: every node above a rising floor, sorted once;
        :mod:`~ddtree_numba.kernels.build_tree_threshold`). Also ``"warp"`` (GPU only): the
        pops over the whole frontier, a two-level tournament in shared memory; ``"levels"``:
        the select level by level (:mod:`~ddtree_numba.kernels.build_tree_levels`).
    out : DraftTree, optional
        Preallocated device buffers (:func:`~ddtree_numba.kernels.allocate_tree`) to fill,
        e.g. for graph capture; a buffer of another shape or dtype, or a strided one, is
        refused (ValueError).
    scratch : device array, optional
        ``int32[bs, N]`` for the rank of each node; allocated when omitted.

    Returns
    -------
    DraftTree
        Device arrays, bit-identical to :func:`ddtree_numba.reference.build_tree`.
    """
    sz = check_build_tree(top_log_probs, top_token_ids, root_token_ids, budget, prefix_lens,
                          check=check)
    if sz.N > NODE_CAPACITY:
        raise ValueError(f"budget: expected at most {NODE_CAPACITY - 1} (the kernels hold "
                         f"N = budget + 1 <= {NODE_CAPACITY} nodes in shared memory), "
                         f"got {budget}")
    if sz.L > MAX_DEPTH:
        raise ValueError(f"top_log_probs: expected L <= {MAX_DEPTH}, got L = {sz.L}")
    if variant is None and not SIMULATOR and budget >= THRESHOLD_FROM_BUDGET:
        variant = "threshold"
    variant = resolve_variant(variant, readable="scan", fast="corners", gpu_only=("warp",),
                              anywhere=("levels", "threshold"))
    lp = as_device(top_log_probs)
    ids = as_device(top_token_ids)
    roots = as_device(root_token_ids)
    has_prefix = prefix_lens is not None
    prefix = as_device(prefix_lens) if has_prefix else roots   # placeholder, never read
    tree = checked_tree(out, sz.bs, sz.N)
    if scratch is None:
        ranks = device_empty((sz.bs, sz.N), np.int32)
    else:
        require_buffer("scratch", scratch, np.int32, (sz.bs, sz.N), "the rank of each node")
        ranks = scratch
    if sz.bs == 0:
        return tree

    launch_select(variant, lp, sz.budget, tree, ranks)
    launch_finish(ids, roots, prefix, has_prefix, tree, ranks)
    return tree


def launch_select(variant: str, lp, budget: int, tree: DraftTree, ranks) -> None:
    """Launch the selection kernel alone (validated device inputs; used by the benchmarks)."""
    N = tree.parents.shape[1]
    if not 0 <= budget < N <= NODE_CAPACITY:       # the kernels' shared and local arrays
        raise ValueError(f"budget: expected 0 <= budget < N <= {NODE_CAPACITY} (N = {N}), "
                         f"got {budget}")
    if not (1 <= lp.shape[1] <= MAX_DEPTH and lp.shape[2] >= 1):   # the pops' bounds
        raise ValueError(f"top_log_probs: expected [bs, L, K] with 1 <= L <= {MAX_DEPTH} and "
                         f"K >= 1, got {list(lp.shape)}")
    bs = lp.shape[0]
    node_table = (tree.parents, tree.depths, tree.log_weights, tree.next_token,
                  tree.next_sibling, ranks, tree.num_nodes)
    if variant == "warp":
        launch(_select_warp_kernel, bs, SELECT_THREADS, launch_stream())(lp, budget, *node_table)
    elif variant == "corners":
        from .build_tree_corners import corners_select_kernel, slots_per_lane

        kernel = corners_select_kernel(slots_per_lane(lp.shape[1], budget))
        launch(kernel, bs, SELECT_THREADS, launch_stream())(lp, budget, *node_table)
    elif variant == "levels":
        from .build_tree_levels import LEVEL_THREADS, _select_levels_kernel

        launch(_select_levels_kernel, bs, LEVEL_THREADS, launch_stream())(
            lp, budget, *node_table)
    elif variant == "threshold":
        from .build_tree_threshold import ARENA_BYTES, THREADS, _select_threshold_kernel

        # (a request whose ties crowd the list takes the levels select in the same block)
        launch(_select_threshold_kernel, bs, THREADS, launch_stream(), ARENA_BYTES)(
            lp, budget, *node_table)
    else:
        launch(_select_scan_kernel, bs, 1, launch_stream())(lp, budget, *node_table)


def build_specs():
    """Specialisations launched by :func:`build_tree` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec
    from .build_tree_corners import SLOT_CHOICES, corners_select_kernel
    from .build_tree_levels import LEVEL_THREADS, _select_levels_kernel
    from .build_tree_threshold import ARENA_BYTES, THREADS, _select_threshold_kernel

    i1, i2, i3 = types.int32[::1], types.int32[:, ::1], types.int32[:, :, ::1]
    select = (types.float32[:, :, ::1], types.int64, i2, i2, types.float32[:, ::1], i2, i2, i2,
              i1)
    inputs = (i3, i1, i1, types.boolean)             # top_token_ids, roots, prefix, has_prefix
    outputs = (i2, i2, types.uint32[:, :, ::1], types.uint8[::1], types.uint64[::1],
               types.int64)                          # finish_outputs
    finish = (*inputs, i2, i2, i2, i1, types.int64, *outputs)   # ..., rows_per_block, outputs
    return [
        KernelSpec("build_tree", "select scan", _select_scan_kernel, select, 1, False),
        KernelSpec("build_tree", "select warp", _select_warp_kernel, select, SELECT_THREADS, True),
        *(KernelSpec("build_tree", f"select corners P={P}", corners_select_kernel(P), select,
                     SELECT_THREADS, True) for P in SLOT_CHOICES),
        KernelSpec("build_tree", "select levels", _select_levels_kernel, select, LEVEL_THREADS,
                   True),
        KernelSpec("build_tree", "select threshold", _select_threshold_kernel, select, THREADS,
                   True, dynamic_shared=ARENA_BYTES),
        KernelSpec("build_tree", "finish", _finish_kernel, finish, FINISH_THREADS, True),
    ]
