"""build_tree: the reference's properties, Algorithm 1 written independently, the kernels."""

import dataclasses
import heapq
import importlib

import numpy as np
import pytest
from cases import random_parents, random_topk, random_tree_inputs

from ddtree_numba import DraftTree
from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.limits import ceil_words


# ------------------------------------------------------------------------------------------
# Properties of the reference
# ------------------------------------------------------------------------------------------
def assert_tree_invariants(tree: DraftTree, prefix_lens=None):
    bs, N = tree.parents.shape
    W = ceil_words(N)
    assert tree.visibility_bits.shape == (bs, N, W)
    for b in range(bs):
        n = int(tree.num_nodes[b])
        assert 1 <= n <= N
        par, dep = tree.parents[b], tree.depths[b]
        assert par[0] == -1 and dep[0] == 0 and tree.log_weights[b, 0] == 0
        for i in range(1, n):
            assert 0 <= par[i] < i
            assert dep[i] == dep[par[i]] + 1
        assert (np.diff(tree.log_weights[b, :n]) <= 0).all(), "scores must not rise"
        # visibility = ancestor closure
        for i in range(n):
            anc, a = set(), i
            while a >= 0:
                anc.add(a)
                a = par[a]
            assert set(np.flatnonzero(tree.visibility[b, i])) == anc
        np.testing.assert_array_equal(tree.visibility_bits[b], ref.pack_bits(tree.visibility[b], W))
        # first-child / next-sibling lists enumerate children in ascending index order
        for p in range(n):
            listed, c = [], tree.next_token[b, p]
            while c != -1:
                listed.append(int(c))
                c = tree.next_sibling[b, c]
            assert listed == [i for i in range(1, n) if par[i] == p]
            tokens = tree.token_ids[b, listed]
            assert len(set(tokens.tolist())) == len(listed), "siblings have distinct tokens"
        offset = 0 if prefix_lens is None else prefix_lens[b]
        np.testing.assert_array_equal(tree.positions[b, :n], offset + dep[:n])
        # padding
        assert (par[n:] == -1).all() and (dep[n:] == -1).all()
        assert (tree.token_ids[b, n:] == -1).all() and (tree.positions[b, n:] == -1).all()
        assert np.isneginf(tree.log_weights[b, n:]).all()
        assert (tree.next_token[b, n:] == -1).all() and (tree.next_sibling[b, n:] == -1).all()
        assert not tree.visibility[b, n:].any() and not tree.visibility[b, :, n:].any()
        assert (tree.visibility_bits[b, n:] == 0).all()


@pytest.mark.parametrize("seed", range(40))
def test_reference_invariants(seed):
    rng = np.random.default_rng(seed)
    bs, L, Kk = int(rng.integers(1, 5)), int(rng.integers(1, 17)), int(rng.integers(1, 65))
    budget = int(rng.integers(0, 301))
    lp, ids = random_topk(rng, bs, L, Kk, neg_inf=0.2 if seed % 4 == 0 else 0.0)
    roots = rng.integers(0, 100, bs).astype(np.int32)
    prefix = rng.integers(0, 1000, bs).astype(np.int32)
    tree = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    assert tree.parents.shape == (bs, budget + 1)
    assert_tree_invariants(tree, prefix)
    np.testing.assert_array_equal(tree.token_ids[:, 0], roots)


def algorithm1(lp: np.ndarray, budget: int):
    """DDTree Algorithm 1 written independently: a heap of rank tuples (paths).

    Returns the popped paths in order. Only used on inputs without score ties, where the
    order is unique.
    """
    L, K = lp.shape

    def score(path):
        s = np.float32(0.0)
        for d, r in enumerate(path):
            s = np.float32(s + lp[d, r])
        return s

    heap, popped = [(-score((0,)), (0,))], []
    while heap and len(popped) < budget:
        neg, path = heapq.heappop(heap)
        if neg == np.inf:
            break
        popped.append(path)
        if path[-1] + 1 < K:
            sibling = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (-score(sibling), sibling))
        if len(path) < L:
            child = path + (0,)
            heapq.heappush(heap, (-score(child), child))
    return popped


def paths_of(tree: DraftTree, b: int, lp_ranks) -> list:
    """Rank path of every non-root node of request b, in node order."""
    paths = {0: ()}
    for i in range(1, int(tree.num_nodes[b])):
        paths[i] = paths[int(tree.parents[b, i])] + (lp_ranks[i],)
    return [paths[i] for i in range(1, int(tree.num_nodes[b]))]


@pytest.mark.parametrize("seed", range(30))
def test_reference_matches_algorithm1_without_ties(seed):
    rng = np.random.default_rng(100 + seed)
    L, Kk, budget = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(0, 120))
    lp, ids = random_topk(rng, 1, L, Kk)
    tree = ref.build_tree(lp, ids, np.zeros(1, np.int32), budget)
    # rank of each node = position of its token in its depth row
    ranks = [-1] + [int(np.flatnonzero(ids[0, tree.depths[0, i] - 1] == tree.token_ids[0, i])[0])
                    for i in range(1, int(tree.num_nodes[0]))]
    assert paths_of(tree, 0, ranks) == algorithm1(lp[0], budget)


def test_ties_prefer_smaller_parent_then_smaller_rank():
    # depth 1: two equal tokens -> the rank-0 one first; depth 2 all equal -> the earlier parent
    lp = np.log(np.array([[[0.5, 0.5, 1.0], [0.25, 0.25, 0.25]]], np.float32))  # [1, 2, 3]
    lp[0, 0, 2] = -np.inf
    ids = np.array([[[7, 3, 9], [1, 2, 4]]], np.int32)
    tree = ref.build_tree(lp, ids, np.array([0], np.int32), 8)
    # pops: (0,0)=-0.69 -> node 1; (0,1)=-0.69 ties (0,0)'s child? child of 1 is -2.08; so
    # node 2 = (0,1); then children of 1 (parent 1 < 2) come before children of 2.
    assert tree.parents[0, 1:].tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert tree.token_ids[0, 1:].tolist() == [7, 3, 1, 2, 4, 1, 2, 4]
    assert tree.num_nodes[0] == 9


def test_neg_inf_is_never_pushed_and_budget_can_exceed_the_finite_prefixes():
    lp = np.array([[[-0.1, -np.inf], [-0.2, -np.inf]]], np.float32)
    ids = np.array([[[5, 6], [7, 8]]], np.int32)
    tree = ref.build_tree(lp, ids, np.array([1], np.int32), 10)
    assert tree.num_nodes[0] == 3                     # root -> 5 -> 7 and nothing else
    assert tree.token_ids[0, :3].tolist() == [1, 5, 7]
    all_inf = np.full((1, 2, 2), -np.inf, np.float32)
    assert ref.build_tree(all_inf, ids, np.array([1], np.int32), 10).num_nodes[0] == 1


@pytest.mark.parametrize("budget", [0, 1])
def test_budget_zero_and_one(budget):
    lp, ids = random_topk(np.random.default_rng(1), 2, 3, 4)
    tree = ref.build_tree(lp, ids, np.array([4, 5], np.int32), budget)
    assert tree.parents.shape == (2, budget + 1)
    assert (tree.num_nodes == budget + 1).all()
    if budget:
        assert (tree.token_ids[:, 1] == ids[:, 0, 0]).all()   # the best depth-1 token


def test_k1_is_a_chain_and_l1_is_a_star():
    lp, ids = random_topk(np.random.default_rng(2), 1, 6, 1)
    chain = ref.build_tree(lp, ids, np.zeros(1, np.int32), 10)
    assert chain.num_nodes[0] == 7 and chain.parents[0, 1:7].tolist() == [0, 1, 2, 3, 4, 5]
    lp, ids = random_topk(np.random.default_rng(3), 1, 1, 6)
    star = ref.build_tree(lp, ids, np.zeros(1, np.int32), 10)
    assert star.num_nodes[0] == 7 and (star.parents[0, 1:7] == 0).all()
    assert star.token_ids[0, 1:7].tolist() == ids[0, 0].tolist()


def test_tree_from_parents_matches_build_tree():
    lp, ids, roots, budget, prefix = random_tree_inputs(np.random.default_rng(4), budget=40)
    tree = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    wrapped = ref.tree_from_parents(tree.parents, tree.token_ids, prefix_lens=prefix)
    for f in dataclasses.fields(DraftTree):
        if f.name != "log_weights":
            np.testing.assert_array_equal(getattr(wrapped, f.name), getattr(tree, f.name), f.name)


@pytest.mark.parametrize("seed", range(5))
def test_tree_from_parents_random_topological_trees(seed):
    rng = np.random.default_rng(seed)
    parents, tokens = random_parents(rng, 3, 40)
    tree = ref.tree_from_parents(parents, tokens)
    assert_tree_invariants(tree)


# ------------------------------------------------------------------------------------------
# Kernels: bit-exact to the reference
# ------------------------------------------------------------------------------------------
def assert_trees_equal(got: DraftTree, want: DraftTree):
    got = got.to_host()
    for f in dataclasses.fields(DraftTree):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype and a.shape == b.shape, f.name
        np.testing.assert_array_equal(a, b, err_msg=f.name)


def kernel_variants():
    # (the simulator leaves "threshold" to tests/test_build_tree_threshold.py, whose inputs
    # take its every path: a CI core's minutes go further there)
    return (["scan", "levels"] if K.SIMULATOR
            else ["scan", "warp", "corners", "levels", "threshold"])


# 120 seeded inputs on a GPU; 20 on the simulator, where each takes some 5 s of a CI core
# (every third with ties, every fifth with -inf, as on the GPU)
RANDOM_SEEDS = range(20) if K.SIMULATOR else range(120)


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_kernel_bit_exact_random(seed):
    rng = np.random.default_rng(1000 + seed)
    lp, ids, roots, budget, prefix = random_tree_inputs(
        rng, ties=seed % 3 == 0, neg_inf=0.3 if seed % 5 == 0 else 0.0)
    want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    for variant in kernel_variants():
        assert_trees_equal(K.build_tree(lp, ids, roots, budget, prefix_lens=prefix,
                                        variant=variant), want)


@pytest.mark.parametrize("case", ["budget0", "budget1", "k1", "l1", "all_neg_inf", "no_prefix",
                                  "ties", "more_budget_than_prefixes", "one_word_boundary"])
def test_kernel_bit_exact_edges(case):
    rng = np.random.default_rng(7)
    kw = {"budget0": dict(budget=0), "budget1": dict(budget=1), "k1": dict(K=1, budget=20),
          "l1": dict(L=1, K=8, budget=20), "all_neg_inf": dict(budget=10),
          "no_prefix": dict(budget=30), "ties": dict(budget=50),
          "more_budget_than_prefixes": dict(L=2, K=3, budget=40),
          "one_word_boundary": dict(L=6, K=6, budget=64)}[case]
    lp, ids, roots, budget, prefix = random_tree_inputs(rng, bs=3, ties=case == "ties", **kw)
    if case == "all_neg_inf":
        lp[1] = -np.inf
    if case == "no_prefix":
        prefix = None
    want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    for variant in kernel_variants():
        assert_trees_equal(K.build_tree(lp, ids, roots, budget, prefix_lens=prefix,
                                        variant=variant), want)


def test_kernel_accepts_device_arrays_and_fills_preallocated_outputs():
    from numba import cuda

    lp, ids, roots, budget, prefix = random_tree_inputs(np.random.default_rng(8), budget=25)
    want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    out = K.allocate_tree(lp.shape[0], budget + 1)
    got = K.build_tree(cuda.to_device(lp), cuda.to_device(ids), cuda.to_device(roots), budget,
                       prefix_lens=cuda.to_device(prefix), out=out)
    assert got is out
    assert_trees_equal(got, want)


@pytest.mark.parametrize("variant,head,budget", [
    *((None, head, budget) for head in (0, 1, 3, 5, 7) for budget in (0, 1, 2, 3, 6, 40, 70)),
    *((variant, head, budget) for variant in ("levels", "threshold") for head in (0, 5)
      for budget in (0, 1, 6, 70))])
def test_finish_writes_the_mask_in_words_from_any_alignment(variant, head, budget):
    """The finish writes the bool mask eight bytes a store from the first 8-byte aligned
    address on, and the bytes before and after alone: a mask that starts ``head`` bytes past
    an aligned address is exact, and the bytes around it are untouched (runs of 1 byte a
    block at budget 0, runs shorter than a word, rows that end inside a word, words that run
    from one row into the next), after the default select and after the levels and threshold
    selects."""
    from numba import cuda

    lp, ids, roots, _, prefix = random_tree_inputs(np.random.default_rng(10 + budget), bs=3,
                                                   budget=budget)
    want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    bs, N = lp.shape[0], budget + 1
    raw = cuda.to_device(np.full(bs * N * N + 8, 0xAB, np.uint8))   # guard bytes around it
    mask = raw[head:head + bs * N * N].view(np.bool_).reshape(bs, N, N)
    out = dataclasses.replace(K.allocate_tree(bs, N), visibility=mask)
    got = K.build_tree(lp, ids, roots, budget, prefix_lens=prefix, out=out, variant=variant)
    assert_trees_equal(got, want)
    around = raw.copy_to_host()
    assert (around[:head] == 0xAB).all() and (around[head + bs * N * N:] == 0xAB).all()


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("head,budget,small", [(0, 0, False), (3, 1, False), (0, 6, False),
                                               (5, 40, False), (1, 70, False), (3, 20, True)])
def test_finish_at_any_rows_per_block(rows, head, budget, small):
    """The finish kernel's grid takes ``rows_per_block`` rows a block (``finish_rows`` picks
    it from the batch and the SMs): every choice, a power of two or not, one block a row up to
    the row bits' room, writes the same tree (tokens, positions, both masks) over outputs
    filled with garbage, and leaves the bytes around a mask that starts ``head`` bytes past an
    aligned address untouched. ``small``: L 3, K 2 hold only 14 draft nodes, so the last rows
    are padding (token and position -1, no bits)."""
    from numba import cuda

    kbt = importlib.import_module("ddtree_numba.kernels.build_tree")   # not the function

    shape = {"L": 3, "K": 2} if small else {}
    lp, ids, roots, _, prefix = random_tree_inputs(np.random.default_rng(30 + budget), bs=2,
                                                   budget=budget, **shape)
    want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    assert not small or (want.num_nodes < budget + 1).all()     # padding rows exist
    bs, N = lp.shape[0], budget + 1
    raw = cuda.to_device(np.full(bs * N * N + 8, 0xAB, np.uint8))
    mask = raw[head:head + bs * N * N].view(np.bool_).reshape(bs, N, N)
    out = dataclasses.replace(K.allocate_tree(bs, N), visibility=mask)
    d_lp, d_ids, d_roots, d_prefix = (cuda.to_device(a) for a in (lp, ids, roots, prefix))
    ranks = cuda.device_array((bs, N), np.int32)
    kbt.launch_select("levels", d_lp, budget, out, ranks)
    for name in ("token_ids", "positions", "visibility_bits"):
        field = getattr(out, name)
        field.copy_to_device(np.full(field.shape, 0x5A5A5A5A, field.dtype))
    mask.copy_to_device(np.ones((bs, N, N), np.bool_))
    kbt.launch_finish(d_ids, d_roots, d_prefix, True, out, ranks, rows_per_block=rows)
    assert_trees_equal(out, want)
    around = raw.copy_to_host()
    assert (around[:head] == 0xAB).all() and (around[head + bs * N * N:] == 0xAB).all()


def test_finish_rows_fill_the_sms_and_refuse_a_bad_count():
    """``finish_rows``: 32 rows a block while the grid has two blocks an SM, halved down to one
    row where it would not; ``launch_finish`` refuses a count outside ``1 .. FINISH_ROWS``
    before launching."""
    kbt = importlib.import_module("ddtree_numba.kernels.build_tree")   # not the function
    from ddtree_numba.kernels.build_tree_finish import FINISH_ROWS, finish_rows

    assert [finish_rows(bs, N, 132) for bs, N in
            [(1, 257), (1, 65), (1, 1025), (8, 257), (8, 1025), (64, 257), (64, 1025)]] == \
        [1, 1, 2, 8, 32, 32, 32]
    assert finish_rows(1, 1, 132) == 1 and finish_rows(1000, 2, 1) == FINISH_ROWS
    lp, ids, roots, budget, prefix = random_tree_inputs(np.random.default_rng(9), bs=1, budget=4)
    out = K.allocate_tree(1, budget + 1)
    args = (K.as_device(ids), K.as_device(roots), K.as_device(prefix), True, out,
            K.as_device(np.zeros((1, budget + 1), np.int32)))
    for bad in (0, FINISH_ROWS + 1):
        with pytest.raises(ValueError, match=rf"rows_per_block: expected 1 .. {FINISH_ROWS}, "
                                             rf"got {bad}"):
            kbt.launch_finish(*args, rows_per_block=bad)
    with pytest.raises(TypeError):
        kbt.launch_finish(*args, rows_per_block=2.5)


def test_kernel_refuses_preallocated_buffers_it_would_write_past():
    """The kernels index without bounds checks: an ``out`` tree or a ``scratch`` whose shape
    or dtype is not what a launch writes is refused before any launch, naming the buffer."""
    import dataclasses

    from numba import cuda

    lp, ids, roots, budget, _ = random_tree_inputs(np.random.default_rng(9), bs=3, budget=40)
    bs, N = lp.shape[0], budget + 1
    good = K.allocate_tree(bs, N)
    narrow = dataclasses.replace(good, visibility_bits=cuda.device_array((bs, N, 1), np.uint32))
    with pytest.raises(ValueError, match=r"out.visibility_bits: expected uint32\[3, 41, 2\]"):
        K.build_tree(lp, ids, roots, budget, out=narrow)
    short = dataclasses.replace(good, parents=cuda.device_array((bs, N - 1), np.int32))
    with pytest.raises(ValueError, match=r"out.parents: expected int32\[3, 41\]"):
        K.build_tree(lp, ids, roots, budget, out=short)
    wrong = dataclasses.replace(good, visibility=cuda.device_array((bs, N, N), np.uint8))
    with pytest.raises(ValueError, match="out.visibility: expected bool"):
        K.build_tree(lp, ids, roots, budget, out=wrong)
    with pytest.raises(TypeError, match="out: expected a DraftTree"):
        K.build_tree(lp, ids, roots, budget, out=(good,))
    strided = dataclasses.replace(
        good, visibility=cuda.device_array((bs, N, 2 * N), np.bool_)[:, :, ::2])
    with pytest.raises(ValueError, match="out.visibility: expected a C-contiguous buffer"):
        K.build_tree(lp, ids, roots, budget, out=strided)
    with pytest.raises(ValueError, match=r"scratch: expected int32\[3, 41\]"):
        K.build_tree(lp, ids, roots, budget, scratch=cuda.device_array((bs, N - 1), np.int32))


def test_levels_kernel_bit_exact_past_the_small_sizes():
    """Ranks past 8, more than a chunk of candidates a round and a final sort of hundreds of
    nodes: what the GPU's sizes exercise, on the simulator's small blocks."""
    rng = np.random.default_rng(31)
    lp, ids = random_topk(rng, 1, 4, 16, V=40, peaked=True)
    roots, prefix = np.array([7], np.int32), np.array([100], np.int32)
    want = ref.build_tree(lp, ids, roots, 100, prefix_lens=prefix)
    assert want.num_nodes[0] == 101 and want.parents.max() > 0
    assert_trees_equal(K.build_tree(lp, ids, roots, 100, prefix_lens=prefix,
                                    variant="levels"), want)


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated warp intrinsics")
@pytest.mark.parametrize("variant", ["warp", "corners"])
@pytest.mark.parametrize("case", ["random", "ties", "neg_inf", "edges"])
def test_warp_selects_on_emulated_warp_intrinsics(monkeypatch, case, variant):
    """The GPU's selects (one warp pops with redux, ballot and shuffles; the block sets up
    and writes out) on the simulator, through emulated warp intrinsics: bit-exact to the
    reference, as on the GPU."""
    from simulated_warp import emulated_shuffles, take_gpu_variant

    take_gpu_variant(monkeypatch, "ddtree_numba.kernels.build_tree")
    take_gpu_variant(monkeypatch, "ddtree_numba.kernels.build_tree_corners")
    rng = np.random.default_rng(["random", "ties", "neg_inf", "edges"].index(case))
    if case == "edges":                             # budget 0 and 1, K = 1, L = 1, no prefix
        cases = [random_tree_inputs(rng, bs=2, **kw) for kw in (
            dict(budget=0), dict(budget=1), dict(K=1, budget=12), dict(L=1, K=8, budget=8))]
        cases[-1] = (*cases[-1][:4], None)
    else:
        cases = [random_tree_inputs(rng, bs=2, budget=40, ties=case == "ties",
                                    neg_inf=0.3 if case == "neg_inf" else 0.0)]
    with emulated_shuffles():
        for lp, ids, roots, budget, prefix in cases:
            want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
            assert_trees_equal(K.build_tree(lp, ids, roots, budget, prefix_lens=prefix,
                                            variant=variant), want)


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated warp intrinsics")
def test_corners_select_unchecked_positive_log_probs_stay_in_bounds(monkeypatch):
    """Log-probs > 0, NaN or +inf break the staircase the corners select relies on;
    unchecked, its tree is wrong but no index leaves its array (the simulator raises
    IndexError where a GPU would touch memory out of bounds) and it stops within the budget."""
    from numba import cuda
    from simulated_warp import emulated_shuffles, take_gpu_variant

    take_gpu_variant(monkeypatch, "ddtree_numba.kernels.build_tree")
    take_gpu_variant(monkeypatch, "ddtree_numba.kernels.build_tree_corners")
    rng = np.random.default_rng(4)
    lp, ids = random_topk(rng, 2, 5, 8, V=16)
    positive = np.ascontiguousarray(-lp[..., ::-1]) + 1.0      # ascending and positive
    nan = lp.copy()
    nan[:, 1:, 2] = np.nan                                       # NaN scores below depth 1
    # +inf, and only 2 finite ranks a row, so that the budget outlasts the finite nodes and
    # reaches the candidates past the last depth and rank, scored +inf + -inf = NaN
    inf = np.ascontiguousarray(lp[:, :3, :4])
    inf[:, :, 2:] = -np.inf
    inf[:, 0, 0] = np.inf
    roots, prefix = np.array([1, 2], np.int32), np.array([0, 9], np.int32)
    for bad in (positive, nan, inf):
        L, Kk = bad.shape[1:]
        with emulated_shuffles():
            tree = K.build_tree(cuda.to_device(bad), cuda.to_device(ids[:, :L, :Kk].copy()),
                                cuda.to_device(roots), 20, prefix_lens=cuda.to_device(prefix),
                                variant="corners")
        host = tree.to_host()
        assert ((host.parents >= -1) & (host.parents < 21)).all()
        assert (host.num_nodes <= 21).all() and (host.depths <= L).all()


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated shuffles")
def test_levels_kernel_with_its_gpu_scan_and_sort_on_emulated_shuffles(monkeypatch):
    """The levels select with the block scan and the sort it takes on a GPU (warp shuffles),
    run on the simulator through emulated shuffles: bit-exact on random rows, ties and -inf,
    and past the small sizes (several chunks a round, sorts longer than the block)."""
    from simulated_warp import emulated_shuffles

    from ddtree_numba.kernels import build_tree_levels
    from ddtree_numba.kernels._primitives import _bitonic_sort_gpu, _warp_shuffle_scan_open

    monkeypatch.setattr(build_tree_levels, "block_inclusive_scan_open", _warp_shuffle_scan_open)
    monkeypatch.setattr(build_tree_levels, "bitonic_sort_desc", _bitonic_sort_gpu)
    rng = np.random.default_rng(77)
    cases = [random_tree_inputs(rng, ties=seed % 2 == 0, neg_inf=0.3 if seed == 3 else 0.0)
             for seed in range(4)]
    lp, ids = random_topk(rng, 1, 4, 16, V=40, peaked=True)
    cases.append((lp, ids, np.array([7], np.int32), 100, np.array([100], np.int32)))
    with emulated_shuffles():
        for lp, ids, roots, budget, prefix in cases:
            want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
            assert_trees_equal(K.build_tree(lp, ids, roots, budget, prefix_lens=prefix,
                                            variant="levels"), want)


def test_levels_kernel_unchecked_positive_log_probs_stay_in_bounds():
    """Log-probs > 0 (refused when checked) break the rule that a child scores no higher
    than its parent; unchecked, the tree is wrong but no index leaves its array (the
    simulator raises IndexError where a GPU would read or write out of bounds)."""
    from numba import cuda

    rng = np.random.default_rng(4)
    lp, ids = random_topk(rng, 2, 5, 8, V=16)
    lp = np.ascontiguousarray(-lp[..., ::-1]) + 1.0            # ascending and positive
    roots, prefix = np.array([1, 2], np.int32), np.array([0, 9], np.int32)
    tree = K.build_tree(cuda.to_device(lp), cuda.to_device(ids), cuda.to_device(roots), 20,
                        prefix_lens=cuda.to_device(prefix), variant="levels")
    parents = tree.parents.copy_to_host()
    assert ((parents >= -1) & (parents < 21)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["warp", "corners", "levels", "threshold"])
@pytest.mark.parametrize("seed", range(200))
def test_fast_kernels_bit_exact_at_real_sizes(seed, variant):
    rng = np.random.default_rng(5000 + seed)
    bs = int(rng.integers(1, 17))
    L = int(rng.integers(1, 33))
    Kk = int(rng.choice([1, 2, 8, 64, 256, 1024]))
    budget = int(rng.choice([0, 1, 63, 64, 255, 256, 1024, 1055]))
    lp, ids = random_topk(rng, bs, L, Kk, V=Kk + 64, ties=seed % 4 == 0,
                          neg_inf=0.1 if seed % 7 == 0 else 0.0, peaked=seed % 2 == 0)
    roots = rng.integers(0, 1000, bs).astype(np.int32)
    prefix = rng.integers(0, 4096, bs).astype(np.int32)
    want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    assert_trees_equal(K.build_tree(lp, ids, roots, budget, prefix_lens=prefix,
                                    variant=variant), want)


@pytest.mark.gpu
def test_corners_select_exact_with_its_slots_nearly_full(monkeypatch):
    """The corners select with the fewest slots (2 a lane, 64 a warp) on trees whose frontier
    reaches 50 to 62 corners (the reference model counts them): the slot allocation near
    capacity, where the lowest and the highest lane with an empty slot meet, is still exact.
    (A pop adds at most two corners, so 62 before a pop fit in 64 after it.)"""
    from ddtree_numba.kernels import build_tree_corners
    from ddtree_numba.reference.build_tree_corners import best_first_by_corners

    monkeypatch.setattr(build_tree_corners, "slots_per_lane", lambda L, budget: 2)
    rng = np.random.default_rng(123)
    found = 0
    L, Kk, budget = 15, 1024, 1055
    for _ in range(200):
        # half-normal rows of a random width: about one in seven reaches 50 corners
        x = -np.abs(rng.standard_normal((1, L, Kk)) * rng.uniform(1, 4))
        lp = -np.sort(-x.astype(np.float32), axis=2)
        ids = np.broadcast_to(np.arange(Kk, dtype=np.int32), (1, L, Kk)).copy()
        _, most = best_first_by_corners(lp[0], budget)
        if not 50 <= most <= 62:
            continue
        found += 1
        roots, prefix = np.array([5], np.int32), np.array([17], np.int32)
        want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
        assert_trees_equal(K.build_tree(lp, ids, roots, budget, prefix_lens=prefix,
                                        variant="corners"), want)
        if found == 4:
            break
    assert found >= 1, "no input reached 50 corners: the test checked nothing"


@pytest.mark.gpu
def test_warp_kernel_bit_exact_bs256():
    rng = np.random.default_rng(77)
    lp, ids = random_topk(rng, 256, 15, 64, V=80, peaked=True)
    roots = rng.integers(0, 1000, 256).astype(np.int32)
    prefix = rng.integers(0, 4096, 256).astype(np.int32)
    want = ref.build_tree(lp, ids, roots, 256, prefix_lens=prefix)
    assert_trees_equal(K.build_tree(lp, ids, roots, 256, prefix_lens=prefix, variant="warp"),
                       want)


def test_reference_refuses_a_budget_whose_buffers_the_host_cannot_hold():
    """``budget = 2**31`` asked numpy for the ``bool[bs, N, N]`` visibility mask (16 GiB and
    more) before failing with a MemoryError; the largest buffer is bounded by MAX_ELEMENTS."""
    from ddtree_numba.limits import MAX_ELEMENTS

    lp, ids = random_topk(np.random.default_rng(0), 2, 3, 4)
    roots = np.array([1, 2], np.int32)
    for budget in (2**31 - 2, 2**20, 32768):
        with pytest.raises(ValueError, match=r"budget: expected .* got budget=" + str(budget)):
            ref.build_tree(lp, ids, roots, budget)
    with pytest.raises(ValueError, match="budget: expected an int in"):
        ref.build_tree(lp, ids, roots, 2**31)              # N would pass int32 positions
    n = int((MAX_ELEMENTS // 2) ** 0.5)                      # bs * N * N <= MAX_ELEMENTS
    with pytest.raises(ValueError, match="budget"):
        ref.build_tree(lp, ids, roots, n)                   # N = n + 1: just past the bound
    assert ref.build_tree(lp, ids, roots, 40).num_nodes.tolist() == [40 + 1] * 2


def test_tree_from_parents_refuses_a_capacity_whose_mask_the_host_cannot_hold():
    from ddtree_numba.limits import MAX_ELEMENTS

    n = int(MAX_ELEMENTS ** 0.5) + 1                         # N * N > MAX_ELEMENTS
    parents = np.broadcast_to(np.int32(-1), (1, n))         # no memory: a read-only view
    tokens = np.broadcast_to(np.int32(1), (1, n))
    with pytest.raises(ValueError, match=r"parents: expected .* got N=" + str(n)):
        ref.tree_from_parents(np.ascontiguousarray(parents), np.ascontiguousarray(tokens))


@pytest.mark.parametrize("shape", [(1, 0, 4), (1, 3, 0)])
def test_launch_select_refuses_rows_without_depths_or_ranks(shape):
    """The select kernels bound their pops by ``L - 1`` and ``K - 1``: the benchmarks' direct
    launcher refuses ``L = 0`` or ``K = 0`` by name instead of launching."""
    import importlib

    kbt = importlib.import_module("ddtree_numba.kernels.build_tree")
    tree = kbt.allocate_tree(1, 2)
    ranks = K.as_device(np.zeros((1, 2), np.int32))
    lp = K.as_device(np.zeros(shape, np.float32))
    with pytest.raises(ValueError, match=r"top_log_probs: expected \[bs, L, K\] with 1 <= L"):
        kbt.launch_select("scan", lp, 1, tree, ranks)
