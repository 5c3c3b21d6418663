"""The best-first pops over a frontier cut to its *corners*: a model of a leaner serial builder.

``reference.best_first`` keeps a heap of every popped node's next child. This module pops the
same nodes in the same order while searching only a small subset of that frontier, the one a
warp could hold in registers; it is a numpy model of a GPU pop loop, not a second definition:
``tests/test_build_tree_corners.py`` checks it equal to ``best_first`` on the edge cases of
``build_tree`` (ties within and across depths, rows of zeros, ``-inf``, budget 0 and 1,
``K = 1``, ``L = 1``) and checks how many corners a frontier holds against the bound below.

**The frontier.** Let ``taken[u]`` be how many children node ``u`` has so far. The reference's
heap holds exactly one candidate per popped node ``u`` of depth ``< L`` with ``taken[u] < K``:
its next child ``(u, taken[u])``, scored ``fl(s_u + lp[depth(u), taken[u]])``, if finite. Its
key is ``(-score, u, rank)`` (``u`` is the parent's pop index).

**Domination.** Pops come in non-increasing score order (rows are sorted and log-probs are
``<= 0``, so a candidate never outscores the node that pushed it). Take two parents ``u' < u``
of the same depth (``u'`` popped first, so ``s_u' >= s_u``). They add the same row, so
``(u', r')`` with ``r' <= r`` scores at least ``(u, r)`` (``fl`` is monotone, the row falls
with the rank) and wins a tie by its parent: its key is smaller. Two consequences, by
induction over the pops:

* ``taken`` never rises along a level: ``taken[u'] >= taken[u]`` (``(u, r)`` pops only after
  ``(u', r)``). The taken children of a level form a staircase (a Young diagram) with the
  parents in pop order as its rows.
* A candidate ``(u, taken[u])`` whose predecessor ``v`` in the level (the parent popped just
  before ``u`` at that depth) has ``taken[v] == taken[u]`` is dominated by ``v``'s candidate
  and cannot be the next pop. The others are the staircase's outer *corners*: ``u`` is a corner
  iff it is the first parent of its level or ``taken[v] > taken[u]``.

So the next pop is the smallest key among the corners' candidates (``-inf`` ones skipped: what
they dominate is ``-inf`` too). A level has at most one corner per distinct ``taken`` value,
so ``c`` corners need at least ``c (c - 1) / 2`` children below the level: at most about
``sqrt(2 n_d)`` corners for ``n_d`` children, at most ``sqrt(2 L B) + L`` in all (and in
practice far fewer; the tests check the bound).

**A pop** of ``(u, r)`` makes node ``c`` and changes three corners at most: ``u`` (``taken[u]``
rose), the parent after ``u`` in its level (its predecessor's count rose) and ``c`` itself, the
last parent of the next level (a corner iff its depth is below ``L`` and it is the first there
or its predecessor has a child). No other node's test reads a changed count. On a GPU that is
a warp per request, its corners' keys in registers: a pop is a warp-wide maximum (two
``redux.sync``: the orderable score, then the smallest node holding it) and three slot
updates, instead of ``build_tree``'s rescans of 33-node groups in shared memory
(``kernels.build_tree_corners``).
"""

from __future__ import annotations

import math

import numpy as np


def corner_bound(L: int, budget: int) -> int:
    """The most corners a frontier can hold while a tree of ``budget`` nodes is built at depth
    ``L``: ``L + floor(sqrt(2 L budget))`` (the module docstring), and never more than the
    ``budget + 1`` nodes themselves."""
    return min(budget + 1, L + math.isqrt(2 * L * budget))


def best_first_by_corners(lp: np.ndarray, budget: int, frontier: set | None = None):
    """The reference's pop order, searching only the frontier's corners (module docstring).

    Parameters
    ----------
    lp : numpy.ndarray
        ``float32[L, K]``: the per-depth log-probs, rows sorted descending, ``<= 0``.
    budget : int
        ``B``, the nodes to take after the root.
    frontier : set, optional
        Filled with the corners left after the last pop (the nodes whose candidates the
        next pop would search; ``-inf`` ones included).

    Returns
    -------
    tuple
        ``((parents, depths, ranks, scores), most_corners)``: the four lists of
        ``reference.best_first`` (the root first), and the largest number of corners any pop
        searched.
    """
    L, K = lp.shape
    parents, depths, ranks = [-1], [0], [-1]
    scores = [np.float32(0.0)]
    taken = [0]                                  # children so far, per node
    level = [[0]] + [[] for _ in range(L)]       # level[d]: the nodes of depth d, pop order
    place = [0]                                  # a node's index in its level
    corners = {0}
    most = 0

    def is_corner(u: int) -> bool:
        d = depths[u]
        if d >= L or taken[u] >= K:              # no next child
            return False
        i = place[u]
        return i == 0 or taken[level[d][i - 1]] > taken[u]

    def candidate(u: int) -> np.float32:
        return np.float32(scores[u] + lp[depths[u], taken[u]])   # one float32 rounding

    while len(parents) - 1 < budget:
        most = max(most, len(corners))
        best = None
        for u in corners:
            s = candidate(u)
            if s == -np.inf:                     # never a node; nor what it dominates
                continue
            key = (-s, u, taken[u])
            if best is None or key < best:
                best = key
        if best is None:                         # nothing finite left
            break
        neg_score, u, r = best
        c = len(parents)
        parents.append(u)
        depths.append(depths[u] + 1)
        ranks.append(r)
        scores.append(np.float32(-neg_score))
        taken.append(0)
        taken[u] += 1
        d = depths[c]
        place.append(len(level[d]))
        level[d].append(c)
        # the three nodes whose corner test changed (the module docstring)
        after_u = level[depths[u]][place[u] + 1] if place[u] + 1 < len(level[depths[u]]) else -1
        for v in (u, after_u, c):
            if v >= 0:
                corners.discard(v)
                if is_corner(v):
                    corners.add(v)
    if frontier is not None:
        frontier.update(corners)
    return (parents, depths, ranks, scores), most
