"""The best-first tree as everything above a rising score floor: a model of a parallel builder.

``reference.best_first`` pops one node at a time. This module computes the same tree (same
nodes, numbering and float32 scores) without pops: it *materializes* every node of the
implicit ``K``-ary tree that could still be in it, level by level, keeps a floor under the
scores that only rises, and sorts the survivors once at the end. It is a numpy model of the
GPU kernel (:mod:`ddtree_numba.kernels.build_tree_threshold`), not a second definition:
``tests/test_build_tree_threshold.py`` checks it equal to ``best_first`` on random rows and on
the edge cases (ties within and across depths, rows of zeros, ``-inf``, budget 0 and 1,
``K = 1``, ``L = 1``) and at small capacities, where every path below is taken.

**The order** (proved in :mod:`~ddtree_numba.reference.build_tree_levels`): the reference pops
the nodes of the implicit tree in the total order "score descending, then the parent's
position, then the rank", and the tree of budget ``B`` is the root and the ``B`` first other
nodes, numbered by position. So:

* every node of the tree scores at least ``T``, the ``B``-th best *score* among all non-root
  nodes;
* the ``B``-th best score of *any* ``B`` or more distinct non-root nodes is ``<= T`` (a subset
  cannot beat the whole set at its own ``B``-th place). Such a score is a *floor*: no node
  below it can be in the tree.

**Which children can matter** (a cap independent of the scores). Call ``m(u)`` the product of
``rank + 1`` along ``u``'s path (``m(root) = 1``). All nodes ``(a', r')`` of ``u``'s depth with
``a'`` no later than ``u``'s parent ``a`` and ``r' <= rank(u)`` score at least ``u`` (the same
row is added to scores that are at least ``a``'s) and come no later; by induction there are at
least ``m(u)`` of them, ``u`` included. So the child ``(u, r)`` is preceded by ``m(u) (r + 1)
- 1`` nodes and can be in the tree only if ``m(u) (r + 1) <= B``; it also has ``depth(u)``
non-root ancestors and ``r`` earlier siblings, so ``r < B - depth(u)``. Its *width*
``min(K, B // m(u), B - depth(u))`` bounds the ranks of ``u``'s children. Among those, the
ones at or above the floor are a prefix of the row (scores fall with the rank): one binary
search per parent counts them.

**The levels.** The list holds the root and every node found so far at or above the floor, in
level order (each parent's children consecutive, in rank order). Level ``d`` expands the
nodes of depth ``d`` (the list's tail) into their counted children. When the list would
outgrow its ``capacity``:

1. the floor rises towards the ``B``-th best score of the list itself (if it holds ``B``
   non-root nodes), the list keeps only the nodes at or above it, and the children are
   counted again;
2. if they still do not fit, the floor rises towards the ``B``-th best score of the list
   *and* the pending children together (a select over the children without storing them),
   and again;
3. if they still do not fit, ties at the floor crowd the list (e.g. rows of zeros, where every
   node scores 0): the model gives up (``None``) and the kernel hands the request to the
   ``"levels"`` select, which takes any input.

*Towards*: a rise is a radix select of the ``B``-th best key, 8 bits a round, most significant
first (:func:`floor_edge`). Each round finds the bin that holds that key; the bin's lower edge
is already a floor (it is at most the key), and the select stops at the first round whose edge
leaves at most a cap of nodes (:func:`floor_caps`: ``B`` plus up to 32), usually after one or
two rounds instead of four. Where ties or close scores crowd the bins, it runs all four and
the floor is the ``B``-th best key itself.

Nothing the tree needs is ever dropped: a node leaves only when it scores below a floor, and
a parent always scores at least its children, so the list stays closed under parents.

**The order at the end.** If the list holds more nodes than the final sort's power of two
(:func:`floor_caps`), the floor rises once more, towards the ``B``-th best score of the list.
What is left (the root, the tree, and nodes below it at or above the floor) is sorted by the key
``(-score, position of the parent, list index)`` (for siblings the list index is the rank
order). The parent's position is what the sort computes, so the sort repeats with the
positions it found until they no longer change; positions only matter between equal scores,
so one sort is exact when no two adjacent nodes tie. A fixed point is the true order (by
induction over the depth: the root comes first, and two nodes compare by their scores, then
by their parents, which are shallower); each repeat settles one more level of equal-scored
ancestors, so at most ``L + 1`` repeats settle every one. The tree is the first ``B + 1``.
"""

from __future__ import annotations

import numpy as np

#: The list's capacity on the GPU (the kernel's shared memory: 11 bytes a node, score,
#: parent, rank, mult and depth, plus one 64-bit word a node for the counts and the final
#: sort).
CAPACITY = 2048


def score_keys(scores) -> np.ndarray:
    """uint32 keys whose unsigned order is the float32 order (``-0.0`` and ``+0.0`` equal),
    as the kernels' ``key_of_float``; 0 for a NaN (below every floor: never a node)."""
    bits = np.asarray(scores, np.float32).reshape(-1).view(np.uint32).copy()
    bits[bits == 0x80000000] = 0
    keys = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)
    return np.where(keys <= 0xFF800000, keys, 0).astype(np.uint32)   # NaN: 0, no node


#: The smallest key of a finite score: ``key(-inf) + 1`` (a floor that keeps every finite one).
FINITE_FLOOR = int(score_keys([-np.inf])[0]) + 1


def floor_edge(keys, k: int, cap: int) -> tuple[int, int]:
    """A floor at most the ``k``-th largest of ``keys`` (uint32, with repeats), found by the
    kernel's radix select: rounds of 8 bits, most significant first, each finding the bin that
    holds the ``k``-th key among those that match the digits found so far. It stops at the first
    round where the bin's lower edge (the digits so far, zeros below) leaves at most ``cap``
    keys at or above it, and returns that edge; after four rounds the edge is the ``k``-th key
    itself (``cap < k`` asks for it). Returns ``(edge, rounds)``.

    Any key at most the ``k``-th largest is a floor (nothing below it is in the tree); a lower
    one keeps more nodes, so the cap bounds what it keeps, and a rise that would take four
    rounds takes one or two where the keys spread over many bins."""
    keys = np.asarray(keys, np.uint32)
    prefix, need, rounds = 0, k, 0
    for shift in (24, 16, 8, 0):
        rounds += 1
        high = 0xFFFFFFFF ^ ((1 << (shift + 8)) - 1)       # the bits already decided
        alive = keys[(keys & high) == prefix]
        counts = np.bincount((alive >> shift) & 0xFF, minlength=256)
        above = np.cumsum(counts[::-1])                      # keys in bins 255, 255..254, ...
        i = int(np.searchsorted(above, need))                # first run that reaches `need`
        digit = 255 - i
        reached = k - need + int(above[i])                   # keys at or above the bin's edge
        need -= int(above[i - 1]) if i > 0 else 0
        prefix |= digit << shift
        if reached <= cap:
            break
    return prefix, rounds


def kth_largest(keys, k: int) -> int:
    """The ``k``-th largest of ``keys`` (uint32, with repeats): :func:`floor_edge` run to its
    fourth round."""
    return floor_edge(keys, k, 0)[0]


def floor_caps(budget: int, capacity: int) -> tuple[int, int]:
    """``(mid, end)``: the most non-root nodes a floor rise may leave in the list during the
    levels and at the end. During the levels a little above ``B`` (up to 32 more, and at most a
    quarter of the room left), so that the levels after a rise have room to grow; at the end
    one less than the power of two the final sort pads to (``n`` nodes, root included, sort in
    ``2 ** ceil(log2 n)`` slots), so a rise there shrinks the sort, or is skipped."""
    B = int(budget)
    mid = B + min(32, max(0, capacity - B - 1) // 4)
    end = (1 << B.bit_length()) - 1                          # 2 ** ceil(log2(B + 1)) - 1
    return mid, end


def best_first_by_threshold(lp: np.ndarray, budget: int, capacity: int = CAPACITY):
    """The reference's pop order, from a rising floor (see the module docstring).

    Parameters
    ----------
    lp : numpy.ndarray
        ``float32[L, K]``: the per-depth log-probs, rows sorted descending, ``<= 0``.
    budget : int
        ``B``, the nodes to take after the root.
    capacity : int
        The most nodes the list may hold (the kernel's ``CAPACITY``).

    Returns
    -------
    tuple
        ``(tree, stats)``. ``tree``: the four lists of ``reference.best_first``
        (``parents, depths, ranks, scores``, the root first), or ``None`` where ties at the
        floor crowd the list (the kernel's fall-back). ``stats``: a dict with ``selects`` (the
        floor's rises before the end), ``end`` (whether it rose at the end), ``rounds`` (the
        radix rounds of every rise, the end's included), ``most`` (the most nodes the list
        held), ``sorts``, and ``levels``: for each level expanded, the children each of its
        parents got (the counts the kernel scans).
    """
    L, K = lp.shape
    B = int(budget)
    # the list: the root, then every node found at or above the floor, in level order
    score = [np.float32(0.0)]
    parent, rank, depth, mult = [-1], [-1], [0], [1]
    stats = {"selects": 0, "end": False, "rounds": 0, "most": 1, "sorts": 0, "levels": []}
    mid_cap, end_cap = floor_caps(B, capacity)
    floor = FINITE_FLOOR
    start = 0                                   # the first node of the depth being expanded
    if B + 1 > capacity:
        return None, stats

    def counts_at(floor):
        """How many children of each parent in ``[start, n)`` are at or above ``floor``."""
        out = []
        row = lp[d]
        for p in range(start, len(score)):
            width = max(0, min(K, B // mult[p], B - d))
            keys = score_keys(np.float32(score[p]) + row[:width])   # one float32 rounding each
            out.append(int(np.count_nonzero(keys >= floor)))       # a prefix (keys fall)
        return out

    def raise_floor(keys, cap):
        """The floor rises to an edge at most the ``B``-th best of ``keys`` that leaves at
        most ``cap`` of them (:func:`floor_edge`); the list keeps what reaches it."""
        nonlocal floor, start, score, parent, rank, depth, mult
        edge, rounds = floor_edge(keys, B, cap)
        floor = max(floor, edge)
        stats["rounds"] += rounds
        keep = [0] + [i for i in range(1, len(score)) if score_keys(score[i])[0] >= floor]
        new = {old: i for i, old in enumerate(keep)}
        start = sum(1 for i in keep if i < start)
        score = [score[i] for i in keep]
        parent = [-1] + [new[parent[i]] for i in keep[1:]]     # parents are never dropped
        rank, depth, mult = ([a[i] for i in keep] for a in (rank, depth, mult))

    for d in range(L):
        if start == len(score):                 # no node of depth d: nothing deeper either
            break
        counts = counts_at(floor)
        n = len(score)
        if n + sum(counts) > capacity and n - 1 >= B:
            stats["selects"] += 1               # 1. the B-th best of the list
            raise_floor(score_keys(score[1:]), mid_cap)
            counts = counts_at(floor)
        n = len(score)
        if n + sum(counts) > capacity:
            stats["selects"] += 1               # 2. ... of the list and the children
            children = [np.float32(score[p]) + lp[d, :c]
                        for p, c in zip(range(start, n), counts, strict=True)]
            raise_floor(np.concatenate([score_keys(score[1:])]
                                       + [score_keys(c) for c in children]), mid_cap)
            counts = counts_at(floor)
        n = len(score)
        if n + sum(counts) > capacity:          # 3. ties at the floor crowd the list
            return None, stats
        stats["levels"].append(counts)
        for p, c in zip(range(start, n), counts, strict=True):
            for r in range(c):                  # each parent's children, in rank order
                score.append(np.float32(score[p] + lp[d, r]))
                parent.append(p)
                rank.append(r)
                depth.append(d + 1)
                mult.append(min(mult[p] * (r + 1), B + 1))
        start = n
        stats["most"] = max(stats["most"], len(score))

    if len(score) - 1 > end_cap:                # a floor that shrinks the final sort
        raise_floor(score_keys(score[1:]), end_cap)
        stats["end"] = True
    n = len(score)
    keys = score_keys(score)
    pos = list(range(n))                        # any start: one sort is exact without ties
    for _ in range(L + 2):
        stats["sorts"] += 1
        order = sorted(range(n), key=lambda i: (-int(keys[i]),
                                                -1 if parent[i] < 0 else pos[parent[i]], i))
        new_pos = [0] * n
        for j, i in enumerate(order):
            new_pos[i] = j
        ties = any(keys[order[j]] == keys[order[j - 1]] for j in range(1, n))
        settled = new_pos == pos
        pos = new_pos
        if not ties or settled:
            break
    tree = order[:B + 1]
    return ([-1 if parent[i] < 0 else pos[parent[i]] for i in tree], [depth[i] for i in tree],
            [rank[i] for i in tree], [score[i] for i in tree]), stats
