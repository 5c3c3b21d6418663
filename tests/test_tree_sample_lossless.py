"""Lossless in distribution, by a test that can fail: sampled speculative decoding of a tiny
Markov target, three tokens at a time, has exactly the target's joint distribution, whatever
the drafter and the tree; and the same test rejects a walk whose bonus token forgets to remove
the rejected children.

The target: ``V = 6`` tokens, ``p(next | last)`` a fixed random matrix. A run starts from a
uniformly drawn token and repeats sampled DDTree steps (``reference.tree_sample``: the tree's
children are the drafter's guesses for what follows their parent's token) until it has
emitted three tokens; the joint distribution of (start, t1, t2, t3) must be
``p(start) p(t1 | start) p(t2 | t1) p(t3 | t2)``. 200 000 seeded runs per configuration;
Pearson's chi-square over the 1296 cells (cells expected below 5 pooled), against the
critical value at a 1e-4 false-alarm rate (Wilson-Hilferty's approximation of the chi-square
quantile, exact to well under 1 % at these degrees of freedom)."""

import importlib

import numpy as np
import pytest

from ddtree_numba import reference as ref

# the module (``reference.tree_sample`` names the function: the package re-exports it)
tree_sample_module = importlib.import_module("ddtree_numba.reference.tree_sample")

V, RUNS, LENGTH = 6, 200_000, 3
TARGET = np.random.default_rng(7).dirichlet(np.full(V, 0.7), V).astype(np.float32)
TARGET /= TARGET.sum(1, keepdims=True)          # rows sum to 1 in float32 too
SHAPES = {                                      # parents of each node (node 0: the root)
    "bushy": [-1, 0, 0, 1, 1, 2],
    "chain": [-1, 0, 1, 2],
    "root only": [-1],
}


def tree_tokens(parents, root, drafter):
    """Node tokens of the tree for root token ``root``: the children of a node with token t
    are, in list order, the drafter's guesses for the token after t ("perfect": the target's
    most likely first, "useless": its least likely first)."""
    tokens = [root]
    for i in range(1, len(parents)):
        t = tokens[parents[i]]
        order = np.argsort(-TARGET[t], kind="stable") if drafter == "perfect" else np.argsort(
            TARGET[t], kind="stable")
        rank = sum(1 for j in range(1, i) if parents[j] == parents[i])
        tokens.append(int(order[rank]))
    return tokens


def decode(parents, drafter, seed):
    """``int[RUNS, 1 + LENGTH]``: each run's start token and its first LENGTH emitted tokens."""
    rng = np.random.default_rng(seed)
    parents = np.array(parents, np.int32)
    N = len(parents)
    # the tree depends on the last token alone: build the V trees once, pick one a run
    trees = ref.tree_from_parents(np.tile(parents, (V, 1)), np.array(
        [tree_tokens(parents, r, drafter) for r in range(V)], np.int32))
    start = rng.integers(0, V, RUNS).astype(np.int32)
    last = start.copy()
    emitted = np.full((RUNS, LENGTH + N), -1, np.int32)   # room for a last step's overshoot
    count = np.zeros(RUNS, np.int64)
    active = np.arange(RUNS)
    while len(active):
        bs, pick = len(active), last[active]
        result = ref.tree_sample(trees.token_ids[pick], trees.next_token[pick],
                                 trees.next_sibling[pick], TARGET[trees.token_ids[pick]],
                                 rng.random((bs, N), dtype=np.float32),
                                 rng.random(bs, dtype=np.float32))
        taken = result.accept_len.astype(np.int64) + 1          # accepted tokens + the bonus
        for j in range(int(taken.max())):                       # append them, column by column
            rows = np.flatnonzero(j < taken)
            emitted[active[rows], count[active[rows]] + j] = result.accept_tokens[rows, j]
        count[active] += taken
        last[active] = result.bonus_token
        active = active[count[active] < LENGTH]
    return np.column_stack([start, emitted[:, :LENGTH]])


def chi_square(samples):
    """Pearson's statistic of the observed (start, t1, t2, t3) counts against the target's
    joint distribution, and the 1e-4 critical value for its degrees of freedom."""
    observed = np.zeros((V,) * (LENGTH + 1))
    np.add.at(observed, tuple(samples.T), 1)
    expected = np.full((V,) * (LENGTH + 1), RUNS / V, np.float64)
    for step in range(LENGTH):
        shape = [1] * (LENGTH + 1)
        shape[step], shape[step + 1] = V, V
        expected = expected * TARGET.astype(np.float64).reshape(shape)
    observed, expected = observed.ravel(), expected.ravel()
    small = expected < 5
    cells_o = np.append(observed[~small], observed[small].sum())
    cells_e = np.append(expected[~small], expected[small].sum())
    statistic = float(((cells_o - cells_e) ** 2 / cells_e).sum())
    df = len(cells_o) - 1
    z = 3.719                                   # the standard normal's 1 - 1e-4 quantile
    critical = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


@pytest.mark.parametrize("shape, drafter", [("bushy", "perfect"), ("bushy", "useless"),
                                            ("chain", "perfect"), ("root only", "perfect")])
def test_sampled_decoding_has_the_targets_joint_distribution(shape, drafter):
    statistic, critical = chi_square(decode(SHAPES[shape], drafter, seed=1))
    assert statistic < critical, (statistic, critical)


def test_the_test_rejects_a_bonus_that_keeps_the_rejected_children(monkeypatch):
    """The classic mistake: drawing the bonus token from the whole distribution of the last
    node, so that a child rejected by the walk can come back as the bonus."""
    keep_all = tree_sample_module.sample_residual
    monkeypatch.setattr(tree_sample_module, "sample_residual",
                        lambda probs, removed, u: keep_all(probs, [], u))
    statistic, critical = chi_square(decode(SHAPES["bushy"], "perfect", seed=1))
    assert statistic > critical, (statistic, critical)
