"""The best-first tree built level by level: a model of a parallel ``build_tree``.

``reference.best_first`` pops one node at a time, so a kernel that follows it
is a chain of ``B`` dependent pops. This module computes the same tree (same nodes, same
numbering, same scores) in ``L`` rounds of work that is parallel within a round. It is a
numpy model of the GPU algorithm, not a second definition: ``tests/test_build_tree_levels.py``
checks it equal to ``best_first`` on random rows and on the edge cases (ties within and across
depths, rows of zeros, ``-inf`` entries, budget 0 and 1, ``K = 1``, ``L = 1``).

**The order.** Give every node the key ``(-score, parent, rank)``, ``parent`` being the
parent's pop index: the reference's heap compares exactly this key. A node enters the heap
only when its parent (rank 0) or its previous sibling pops, and its key is larger than that
node's: a child scores at most its parent (``fl(s + lp) <= s`` for ``lp <= 0``) and a sibling
at most its previous sibling (rows are sorted); on equal scores the child's parent is the
popped node itself, which popped after its own parent, and the sibling has the same parent
and a larger rank. So no pop is followed by a smaller key, and no node outside the heap has a
key below one inside it: the pops are the nodes of the implicit ``K``-ary tree of depth ``L``
in key order (only finite scores count), and the tree of budget ``B`` is the set ``S`` of the
``B`` first, numbered by their position. Write ``x < y`` for "``x`` comes first"; a parent
always comes before its children.

**Level by level.** Let ``G`` be the best ``B`` nodes found so far, sorted by ``<``, and
``P_{d-1}`` its nodes of depth ``d - 1`` in that order (``P_0`` = the root). Round ``d``:

1. *Candidates.* Every parent ``u`` of ``P_{d-1}`` (at index ``u``) adds the same row
   ``lp[d - 1]``: its children's scores ``fl(s_u + lp[d - 1, r])`` fall with ``r``, and with
   the parents in order they also fall with ``u`` (``fl`` is monotone). So the child ``(u, r)``
   is preceded by every ``(u', r')`` with ``u' <= u``, ``r' <= r``: ``(u + 1)(r + 1) - 1``
   nodes of its own depth. It can be in ``S`` only if ``(u + 1)(r + 1) <= B``; it is also
   dropped when it scores below the ``B``-th node of ``G`` (which ``B`` found nodes precede),
   and when its score is ``-inf`` (never a node). At most ``sum_u min(K, B // (u + 1))``, about
   ``B (ln B + 1)``, candidates remain, each a prefix of its parent's row.
2. *Merge.* ``G`` = the ``B`` first of ``G`` and the candidates, sorted by the key
   ``(-score, position of the parent in G, rank)``. Every parent is in ``G`` (or is the root,
   first of all), so the key compares any two nodes exactly as ``<`` does; positions shift as
   nodes are inserted, but never change their relative order.
3. ``P_d`` = the nodes of depth ``d`` in ``G``, in order. Stop when it is empty.

Why nothing of ``S`` is lost: by induction ``S ∩ depth(d - 1) ⊆ P_{d-1}``; every node of ``S``
at depth ``d`` is a child of one of them that passes both tests of step 1, so it is a
candidate; and ``S`` restricted to the nodes found so far is their ``B`` first, which ``G``
keeps. After round ``L`` (or an empty level), ``G = S`` in pop order.

On a GPU a round is a scan to lay out the candidates (one parent a thread, a binary search
for its prefix length), a sort of them by the 64-bit key (orderable score, parent index,
rank), and a merge-path with ``G``: a few dozen barriers a level instead of one dependent pop
per node. ``candidates`` (the second return value) records how many each round generated.
"""

from __future__ import annotations

import numpy as np


def best_first_by_levels(lp: np.ndarray, budget: int):
    """The reference's pop order, computed level by level (see the module docstring).

    Parameters
    ----------
    lp : numpy.ndarray
        ``float32[L, K]``: the per-depth log-probs, rows sorted descending, ``<= 0``.
    budget : int
        ``B``, the nodes to take after the root.

    Returns
    -------
    tuple
        ``((parents, depths, ranks, scores), candidates)``: the four lists of
        ``reference.best_first`` (the root first), and the number of
        candidates each round generated.
    """
    L, K = lp.shape
    B = int(budget)
    # G: the best nodes found so far, in pop order; node = (score, parent, depth, rank) with
    # parent an index into G (-1: the root). The root is not counted in B.
    G: list[tuple] = []
    candidates = []
    parents_prev = [-1]                  # P_0: the root (-1 stands for it)
    for d in range(1, L + 1):
        if B == 0 or not parents_prev:
            break
        full = len(G) == B
        floor = G[-1][0] if full else np.float32(-np.inf)   # the B-th node's score
        # 1. candidates: a prefix of each parent's row
        row = lp[d - 1]
        level = []
        for u, g in enumerate(parents_prev):
            s_u = np.float32(0.0) if g < 0 else G[g][0]
            for r in range(min(K, B // (u + 1))):          # (u + 1)(r + 1) <= B
                s = np.float32(s_u + row[r])                # one float32 rounding
                if s == -np.inf or s < floor:               # falls with r: the rest too
                    break
                level.append((s, g, d, r))
        candidates.append(len(level))
        # 2. merge: sort by (-score, position of the parent, rank); parents are all in G
        merged = sorted(G + level, key=lambda n: (-n[0], n[1], n[3]))[:B]
        # positions changed: re-point every parent at its node's new index
        new_index = {id(node): i for i, node in enumerate(merged)}
        old = G
        G = [(s, -1 if p < 0 else new_index[id(old[p])], depth, r)
             for s, p, depth, r in merged]
        # 3. the next round's parents: this depth's nodes of G, in order
        parents_prev = [i for i, node in enumerate(G) if node[2] == d]
    parents = [-1] + [p + 1 for _, p, _, _ in G]            # node i + 1 is G[i]
    depths = [0] + [depth for _, _, depth, _ in G]
    ranks = [-1] + [r for _, _, _, r in G]
    scores = [np.float32(0.0)] + [s for s, _, _, _ in G]
    return (parents, depths, ranks, scores), candidates
