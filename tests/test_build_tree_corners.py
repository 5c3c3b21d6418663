"""The corner-frontier model of build_tree's pops equals the reference's best-first pops: same
nodes, numbering, depths, ranks and float32 scores, on random rows and on the edges (ties
within and across depths, rows of zeros, absorbed additions, -inf entries and rows, budget 0
and 1, K = 1, L = 1); and no pop searches more corners than the model's bound."""

import numpy as np
import pytest
from test_build_tree_levels import KINDS, LARGE_SIZES, SMALL_SIZES, sorted_rows

from ddtree_numba.reference import best_first
from ddtree_numba.reference.build_tree_corners import best_first_by_corners, corner_bound


def assert_same(lp, budget):
    want = best_first(lp, budget)
    got, most = best_first_by_corners(lp, budget)
    for name, a, b in zip(("parents", "depths", "ranks"), want[:3], got[:3], strict=True):
        assert list(a) == list(b), name
    assert np.array_equal(np.array(want[3], np.float32), np.array(got[3], np.float32))
    L = lp.shape[0]
    assert most <= corner_bound(L, budget)                   # the docstring's bound
    return most


@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_reference_on_every_kind_and_size(kind):
    rng = np.random.default_rng(10 + KINDS.index(kind))
    for L, K, budget in SMALL_SIZES:
        assert_same(sorted_rows(rng, L, K, kind), budget)


@pytest.mark.parametrize("kind", ("random", "zeros", "log_softmax"))
def test_equals_the_reference_at_large_budgets(kind):
    rng = np.random.default_rng(17)
    for L, K, budget in LARGE_SIZES:
        assert_same(sorted_rows(rng, L, K, kind), budget)


def test_the_frontier_searched_is_small_and_the_order_breaks_ties_by_parent_then_rank():
    """All scores 0: every pop ties. The model pops parent by parent in pop order, each
    parent's ranks in order, from a frontier of at most two corners a level."""
    lp = np.zeros((2, 2), np.float32)
    (parents, depths, ranks, _), most = best_first_by_corners(lp, 6)
    assert parents == [-1, 0, 0, 1, 1, 2, 2]
    assert ranks == [-1, 0, 1, 0, 1, 0, 1]
    assert depths == [0, 1, 1, 2, 2, 2, 2]
    assert most <= 2 * 2


def test_frontier_holds_the_next_pop():
    """``frontier`` (the docs' picture reads it): after ``B`` pops, the corners left hold the
    reference's next pop as their best finite candidate, and each has a next child."""
    rng = np.random.default_rng(5)
    for budget in (1, 7, 30):
        lp = sorted_rows(rng, 6, 8, "log_softmax")
        frontier = set()
        (parents, depths, _, scores), _ = best_first_by_corners(lp, budget, frontier)
        taken = np.bincount(np.array(parents[1:], dtype=int), minlength=len(parents))
        assert frontier and all(depths[u] < 6 and taken[u] < 8 for u in frontier)
        best = min(frontier, key=lambda u: (-np.float32(scores[u] + lp[depths[u], taken[u]]),
                                            u))
        assert best_first(lp, budget + 1)[0][budget + 1] == best
