"""Reference ``build_tree`` (DDTree Algorithm 1) and ``tree_from_parents``.

Best-first construction, per request ``b`` (``lp = top_log_probs[b]``, ``[L, K]``)::

    node 0 = root: token root_token_ids[b], depth 0, score 0
    candidate (p, r): the rank-r token of depth depth(p) + 1 below node p,
                      score(p, r) = float32(score(p) + lp[depth(p), r])   # one float32 add
    frontier = {(0, 0)}
    while frontier and fewer than `budget` nodes were taken:
        pop the candidate with the highest score, ties: smaller p, then smaller r
        it becomes node c = (nodes taken so far) + 1
        push (p, r + 1)   if r + 1 < K          # the next sibling in rank order
        push (c, 0)       if depth(c) < L       # the best child of the new node
    a candidate whose score is -inf is never pushed.

Why best-first gives the best tree: rows are sorted and log-probs are ``<= 0``, so a candidate
never outscores the candidate that pushed it. Pops therefore come in non-increasing score order
and the first ``budget`` pops are the ``budget`` highest-scoring prefixes; every prefix of a
taken path was taken before it, so they form a tree. Nodes are numbered in pop order
(``parents[i] < i``), which interleaves depths.

Because each node has at most one pending candidate (its next unexpanded rank), the tie rule
"smaller p, then smaller r" only ever compares different parents.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..contracts import DraftTree
from ..validation import check_build_tree, check_host_tree_size, check_tree_from_parents


def best_first(lp: np.ndarray, budget: int):
    """Pop order of one request: lists ``parents``, ``depths``, ``ranks``, ``scores``.

    ``lp`` is ``float32[L, K]``; the root is entry 0 of each list (parent -1, rank -1).
    """
    L, K = lp.shape
    parents, depths, ranks = [-1], [0], [-1]
    scores = [np.float32(0.0)]
    frontier = []                                   # heap of (-score, parent, rank)

    def push(p: int, r: int):
        s = np.float32(scores[p] + lp[depths[p], r])   # float32 + float32 -> one rounding
        if s != -np.inf:
            heapq.heappush(frontier, (-s, p, r))

    push(0, 0)
    while frontier and len(parents) - 1 < budget:
        neg_score, p, r = heapq.heappop(frontier)   # highest score, then smaller p, smaller r
        c = len(parents)
        parents.append(p)
        depths.append(depths[p] + 1)
        ranks.append(r)
        scores.append(np.float32(-neg_score))
        if r + 1 < K:
            push(p, r + 1)
        if depths[c] < L:
            push(c, 0)
    return parents, depths, ranks, scores


def build_tree(top_log_probs, top_token_ids, root_token_ids, budget, *, prefix_lens=None):
    """Build one best-first draft tree per request.

    Parameters
    ----------
    top_log_probs : numpy.ndarray
        ``float32[bs, L, K]``: per-depth top-K log-probs, rows sorted descending, all ``<= 0``.
    top_token_ids : numpy.ndarray
        ``int32[bs, L, K]``: their token ids (distinct within a row).
    root_token_ids : numpy.ndarray
        ``int32[bs]``: the root token of each tree (the previous step's bonus token).
    budget : int
        Draft nodes per tree, root excluded (``B``); the trees hold ``N = B + 1`` nodes. The
        math holds for any size, but the host must hold the ``bool[bs, N, N]`` visibility
        mask: ``bs * N * N <= limits.MAX_ELEMENTS`` (the GPU kernel: ``N <= MAX_NODES``).
    prefix_lens : numpy.ndarray, optional
        ``int32[bs]``: committed tokens before the root; sets ``DraftTree.positions``.

    Returns
    -------
    DraftTree
        Numpy arrays padded to ``N = budget + 1``.
    """
    sizes = check_build_tree(top_log_probs, top_token_ids, root_token_ids, budget, prefix_lens,
                             check=True)
    check_host_tree_size("budget", sizes.bs, sizes.N, f"budget={sizes.budget} (N = budget + 1)")
    tree = DraftTree.allocate(sizes.bs, sizes.N)
    for b in range(sizes.bs):
        parents, depths, ranks, scores = best_first(top_log_probs[b], sizes.budget)
        n = len(parents)                                            # root included
        tree.num_nodes[b] = n
        tree.parents[b, :n] = parents                               # [n]
        tree.depths[b, :n] = depths                                 # [n]
        tree.log_weights[b, :n] = scores                            # [n]
        tree.token_ids[b, 0] = root_token_ids[b]
        d = np.asarray(depths[1:], np.int64) - 1                     # row of each pop
        r = np.asarray(ranks[1:], np.int64)                         # rank of each pop
        tree.token_ids[b, 1:n] = top_token_ids[b, d, r]             # [n - 1]
    _derive_links_and_masks(tree, prefix_lens)
    return tree


def tree_from_parents(parents, token_ids, *, prefix_lens=None) -> DraftTree:
    """Wrap a tree from any source (EAGLE, a static tree, an engine's buffers) as a DraftTree.

    Parameters
    ----------
    parents : numpy.ndarray
        ``int32[bs, N]``: ``-1`` at the root (node 0) and at padding; ``0 <= parents[i] < i``
        for every valid node (topological order); valid nodes come first.
    token_ids : numpy.ndarray
        ``int32[bs, N]``: token of each node (node 0 = root token).
    prefix_lens : numpy.ndarray, optional
        ``int32[bs]``: committed tokens before the root.

    Returns
    -------
    DraftTree
        Links, depths, visibility and positions derived from ``parents``; ``log_weights`` is 0
        for every valid node (the source had no scores) and ``-inf`` at padding.
    """
    num_nodes = check_tree_from_parents(parents, token_ids, prefix_lens)
    bs, N = parents.shape
    tree = DraftTree.allocate(bs, N)
    for b in range(bs):
        n = int(num_nodes[b])
        tree.num_nodes[b] = n
        tree.parents[b, :n] = parents[b, :n]
        tree.token_ids[b, :n] = token_ids[b, :n]
        tree.log_weights[b, :n] = 0.0
        tree.depths[b, 0] = 0
        for i in range(1, n):                                       # parents[i] < i: in order
            tree.depths[b, i] = tree.depths[b, parents[b, i]] + 1
    _derive_links_and_masks(tree, prefix_lens)
    return tree


def _derive_links_and_masks(tree: DraftTree, prefix_lens) -> None:
    """Fill next_token, next_sibling, visibility, visibility_bits and positions from parents."""
    bs, N = tree.parents.shape
    W = tree.visibility_bits.shape[2]
    for b in range(bs):
        n = int(tree.num_nodes[b])
        last_child = np.full(n, -1)                   # most recent child seen, per node
        for i in range(1, n):                         # ascending i: children in index order
            p = tree.parents[b, i]
            if last_child[p] < 0:
                tree.next_token[b, p] = i             # smallest child index
            else:
                tree.next_sibling[b, last_child[p]] = i   # next larger sibling index
            last_child[p] = i
        tree.visibility[b, 0, 0] = n > 0
        for i in range(1, n):                         # row i = row parent(i) plus i itself
            tree.visibility[b, i] = tree.visibility[b, tree.parents[b, i]]
            tree.visibility[b, i, i] = True
        offset = 0 if prefix_lens is None else int(prefix_lens[b])
        tree.positions[b, :n] = offset + tree.depths[b, :n]
    tree.visibility_bits[...] = pack_bits(tree.visibility, W)


def pack_bits(mask: np.ndarray, W: int) -> np.ndarray:
    """``bool[..., N]`` -> ``uint32[..., W]``: bit ``j % 32`` of word ``j // 32`` is ``mask[j]``.

    ``packbits`` (little bit order) puts ``mask[j]`` at bit ``j % 8`` of byte ``j // 8``; read
    four bytes as one little-endian word, byte ``j // 8`` is byte ``(j // 8) % 4`` of word
    ``j // 32``, so the bit lands at ``8 (j // 8 % 4) + j % 8 = j % 32``. Temporaries are an
    eighth of the mask (a bool-per-bit or uint64 version needs 1x to 8x more).
    """
    packed = np.packbits(mask, axis=-1, bitorder="little")              # [..., ceil(N/8)]
    words = np.zeros(mask.shape[:-1] + (W * 4,), np.uint8)              # [..., 4W]
    words[..., : packed.shape[-1]] = packed
    return words.view("<u4").astype(np.uint32)                         # [..., W]


def unpack_bits(bits: np.ndarray, N: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``uint32[..., W]`` -> ``bool[..., N]``."""
    shifted = bits[..., :, None] >> np.arange(32, dtype=np.uint32)      # [..., W, 32]
    return (shifted & 1).astype(bool).reshape(bits.shape[:-1] + (-1,))[..., :N]
