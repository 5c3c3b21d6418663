"""The level-by-level model of build_tree equals the reference's best-first pops: same nodes,
numbering, depths, ranks and float32 scores, on random rows and on the edges (ties within and
across depths, rows of zeros, absorbed additions, -inf entries and rows, budget 0 and 1, K = 1,
L = 1); and each round's candidates stay within the bound the model's proof uses."""

import itertools
import math

import numpy as np
import pytest

from ddtree_numba.reference import best_first
from ddtree_numba.reference.build_tree_levels import best_first_by_levels

KINDS = ("random", "ties", "zeros", "neg_inf", "absorbed", "log_softmax")
#: (L, K, budget): every small combination, then the large budgets
SMALL_SIZES = list(itertools.product((1, 2, 5, 15), (1, 2, 7, 64), (0, 1, 2, 17, 64)))
LARGE_SIZES = ((15, 256, 256), (15, 1024, 1024), (8, 64, 1055))


def sorted_rows(rng, L, K, kind):
    """``float32[L, K]`` log-prob rows sorted descending, ``<= 0``, of the given kind."""
    x = -np.abs(rng.standard_normal((L, K)) * 2)
    if kind == "ties":
        x = np.round(x)                                 # many equal scores, across depths too
    elif kind == "zeros":
        x = np.zeros((L, K))                            # every node ties with its parent
    elif kind == "neg_inf":
        x[:, rng.integers(0, K + 1):] = -np.inf         # short rows ...
        x[rng.integers(0, L)] = -np.inf                 # ... and a whole row of -inf
    elif kind == "absorbed":
        x[1:] *= 1e-9                                   # fl(s + lp) == s below depth 1
        x[0] *= 50
    elif kind == "log_softmax":
        z = rng.standard_normal((L, K + 5)) * 3
        x = (z - np.log(np.exp(z).sum(1, keepdims=True)))[:, :K]
    return -np.sort(-x.astype(np.float32), axis=1)


def assert_same(lp, budget):
    want = best_first(lp, budget)
    got, candidates = best_first_by_levels(lp, budget)
    for name, a, b in zip(("parents", "depths", "ranks"), want[:3], got[:3], strict=True):
        assert list(a) == list(b), name
    assert np.array_equal(np.array(want[3], np.float32), np.array(got[3], np.float32))
    if budget > 0:                                      # sum_u B // (u + 1) <= B (ln B + 1)
        assert max(candidates, default=0) <= budget * (math.log(budget) + 1)
    return candidates


@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_reference_on_every_kind_and_size(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    for L, K, budget in SMALL_SIZES:
        assert_same(sorted_rows(rng, L, K, kind), budget)


@pytest.mark.parametrize("kind", ("random", "zeros", "log_softmax"))
def test_equals_the_reference_at_large_budgets(kind):
    rng = np.random.default_rng(7)
    for L, K, budget in LARGE_SIZES:
        candidates = assert_same(sorted_rows(rng, L, K, kind), budget)
        assert len(candidates) <= L


def test_the_order_breaks_ties_by_parent_then_rank():
    """All scores 0: pops go parent by parent in pop order, each parent's ranks in order."""
    lp = np.zeros((2, 2), np.float32)
    (parents, depths, ranks, _), _ = best_first_by_levels(lp, 6)
    assert parents == [-1, 0, 0, 1, 1, 2, 2]
    assert ranks == [-1, 0, 1, 0, 1, 0, 1]
    assert depths == [0, 1, 1, 2, 2, 2, 2]
