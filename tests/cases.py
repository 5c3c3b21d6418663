"""Seeded input generators shared by the tests (and the benchmarks)."""

from __future__ import annotations

import numpy as np

from ddtree_numba import reference as ref
from ddtree_numba.paging import shuffled_block_table


def random_topk(rng, bs, L, K, *, V=None, ties=False, neg_inf=0.0, peaked=False):
    """``(top_log_probs, top_token_ids)`` from ``reference.draft_topk`` of random logits.

    ``ties`` quantises logits to a few levels (equal log-probs, the tie rule matters);
    ``neg_inf`` is the fraction of logits set to ``-inf``; ``peaked`` makes a confident drafter.
    """
    V = max(K, 2 * K + 3) if V is None else V
    x = rng.standard_normal((bs, L, V)).astype(np.float32)
    if peaked:
        x *= 4.0
    if ties:
        x = np.round(x * 2.0) / 2.0
    if neg_inf:
        x[rng.random(x.shape) < neg_inf] = -np.inf
    return ref.draft_topk(x, K)


def random_tree_inputs(rng, *, bs=None, L=None, K=None, budget=None, ties=False, neg_inf=0.0):
    bs = int(rng.integers(1, 5)) if bs is None else bs
    L = int(rng.integers(1, 9)) if L is None else L
    K = int(rng.integers(1, 9)) if K is None else K
    budget = int(rng.integers(0, 60)) if budget is None else budget
    lp, ids = random_topk(rng, bs, L, K, ties=ties, neg_inf=neg_inf)
    roots = rng.integers(0, 1000, bs).astype(np.int32)
    prefix = rng.integers(0, 50, bs).astype(np.int32)
    return lp, ids, roots, budget, prefix


def random_parents(rng, bs, N, *, fill=None):
    """Random topological trees: ``parents[i] < i``; request b has ``fill[b]`` valid nodes."""
    parents = np.full((bs, N), -1, np.int32)
    tokens = np.full((bs, N), -1, np.int32)
    fill = rng.integers(1, N + 1, bs) if fill is None else fill
    for b in range(bs):
        n = int(fill[b])
        for i in range(1, n):
            parents[b, i] = rng.integers(0, i)
        tokens[b, :n] = rng.permutation(50)[:n] if n <= 50 else rng.integers(0, 10**6, n)
    return parents, tokens


def paged_cache(rng, bs, prefix_lens, N, *, page_size, D, dtype=np.float32, spare_pages=2):
    """A random paged cache with a shuffled block table covering ``prefix + N`` slots."""
    table, num_pages = shuffled_block_table(rng, prefix_lens, N, page_size,
                                            spare_pages=spare_pages)
    cache = rng.standard_normal((num_pages, page_size, D)).astype(dtype)
    return cache, table
