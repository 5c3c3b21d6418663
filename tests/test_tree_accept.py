"""tree_accept: hand-built trees with known answers, random trees, kernel vs reference."""

import dataclasses

import numpy as np
import pytest
from cases import random_parents, random_tree_inputs

from ddtree_numba import AcceptResult
from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.kernels._device import SIMULATOR
from ddtree_numba.kernels.tree_accept import ACCEPT_THREADS, STAGE_ROUNDS

#           0 (root, token 100)
#         / | \
#        1  2  3         tokens 10, 11, 12
#       /   |
#      4    5            tokens 20, 21
#           |
#           6            token 30
PARENTS = np.array([-1, 0, 0, 0, 1, 2, 5], np.int32)
TOKENS = np.array([100, 10, 11, 12, 20, 21, 30], np.int32)


def hand_tree():
    return ref.tree_from_parents(PARENTS[None], TOKENS[None])


def accept(tree, predict):
    return ref.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, predict)


@pytest.mark.parametrize("predict, path, tokens", [
    # immediate rejection: the target wants 99 after the root
    ([99, 0, 0, 0, 0, 0, 0], [0], [99]),
    # first child accepted, then rejected below it
    ([10, 7, 0, 0, 0, 0, 0], [0, 1], [10, 7]),
    # leaves the first child for a later sibling (2), then the deepest leaf (6)
    ([11, 0, 21, 0, 0, 30, 42], [0, 2, 5, 6], [11, 21, 30, 42]),
    # last sibling
    ([12, 0, 0, 5, 0, 0, 0], [0, 3], [12, 5]),
])
def test_hand_built_tree(predict, path, tokens):
    res = accept(hand_tree(), np.array([predict], np.int32))
    k = len(path) - 1
    assert res.accept_len.tolist() == [k]
    assert res.accept_nodes[0].tolist() == path + [-1] * (7 - len(path))
    assert res.accept_tokens[0].tolist() == tokens + [-1] * (7 - len(tokens))
    assert res.bonus_token.tolist() == [tokens[-1]]


def test_root_without_children_and_batched_sizes():
    parents = np.array([[-1, 0, 1, -1], [-1, -1, -1, -1]], np.int32)
    tokens = np.array([[5, 6, 7, -1], [9, -1, -1, -1]], np.int32)
    tree = ref.tree_from_parents(parents, tokens)
    res = accept(tree, np.array([[6, 7, 8, 0], [3, 0, 0, 0]], np.int32))
    assert res.accept_len.tolist() == [2, 0]
    assert res.accept_tokens.tolist() == [[6, 7, 8, -1], [3, -1, -1, -1]]
    assert res.bonus_token.tolist() == [8, 3]


def follow_path_predictions(rng, tree, b, depth_bias):
    """Predictions that follow a random root path (any sibling), then stop at random."""
    N = tree.parents.shape[1]
    predict = rng.integers(10**6, 2 * 10**6, N).astype(np.int32)    # tokens no node has
    cur = 0
    while rng.random() < depth_bias:
        kids = np.flatnonzero(tree.parents[b] == cur)
        if kids.size == 0:
            break
        child = int(rng.choice(kids))
        predict[cur] = tree.token_ids[b, child]
        cur = child
    return predict


def assert_accept_equal(got, want):
    got = got.to_host()
    for f in dataclasses.fields(AcceptResult):
        np.testing.assert_array_equal(getattr(got, f.name), getattr(want, f.name), f.name)


@pytest.mark.parametrize("seed", range(30))
def test_kernel_matches_reference_on_built_trees(seed):
    rng = np.random.default_rng(seed)
    lp, ids, roots, budget, prefix = random_tree_inputs(rng, budget=int(rng.integers(0, 80)))
    tree = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    bias = [0.0, 0.5, 0.95][seed % 3]
    predict = np.stack([follow_path_predictions(rng, tree, b, bias)
                        for b in range(tree.parents.shape[0])])
    want = accept(tree, predict)
    assert_accept_equal(K.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling,
                                      predict), want)


@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_reference_past_the_registers_staging(seed):
    """Trees of more nodes than a block stages from registers (``STAGE_ROUNDS`` entries a
    thread: 96 on the simulator's 32-thread blocks), so the loop that stages the rest runs
    too; the budget is spent (K 8, L 8) and the paths are long."""
    rng = np.random.default_rng(80 + seed)
    lp, ids, roots, _, prefix = random_tree_inputs(rng, bs=2, L=8, K=8)
    tree = ref.build_tree(lp, ids, roots, 150, prefix_lens=prefix)
    assert SIMULATOR is False or tree.num_nodes.min() > STAGE_ROUNDS * ACCEPT_THREADS
    predict = np.stack([follow_path_predictions(rng, tree, b, 0.95) for b in range(2)])
    assert_accept_equal(K.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling,
                                      predict), accept(tree, predict))


@pytest.mark.parametrize("seed", range(10))
def test_kernel_matches_reference_on_foreign_sibling_orders(seed):
    """Trees from tree_from_parents: numbering is not best-first, lists are not score order."""
    rng = np.random.default_rng(50 + seed)
    parents, tokens = random_parents(rng, 3, 30)
    tree = ref.tree_from_parents(parents, tokens)
    # engines may order sibling lists differently: reverse every list (still a valid tree)
    nt, ns = tree.next_token.copy(), np.full_like(tree.next_sibling, -1)
    for b in range(3):
        for p in range(int(tree.num_nodes[b])):
            kids = np.flatnonzero(tree.parents[b] == p)[::-1]
            nt[b, p] = kids[0] if kids.size else -1
            for a, c in zip(kids[:-1], kids[1:], strict=True):
                ns[b, a] = c
    predict = np.stack([follow_path_predictions(rng, tree, b, 0.9) for b in range(3)])
    want = ref.tree_accept(tree.token_ids, nt, ns, predict)
    assert_accept_equal(K.tree_accept(tree.token_ids, nt, ns, predict), want)


def assert_accept_well_formed(res, token_ids, target_predict):
    """What any input, even links that are not a tree, must give with ``check=False``: a path
    of ``k <= N - 1`` in-range nodes from the root, its tokens, the bonus, then ``-1`` fill."""
    res = res.to_host()
    bs, N = token_ids.shape
    for b in range(bs):
        k = int(res.accept_len[b])
        assert 0 <= k <= N - 1, (b, k)
        path = res.accept_nodes[b, : k + 1]
        assert path[0] == 0 and ((path >= 0) & (path < N)).all()
        assert (res.accept_nodes[b, k + 1 :] == -1).all()
        np.testing.assert_array_equal(res.accept_tokens[b, :k], token_ids[b, path[1:]])
        assert res.accept_tokens[b, k] == res.bonus_token[b] == target_predict[b, path[-1]]
        assert (res.accept_tokens[b, k + 1 :] == -1).all()


def test_kernel_unchecked_self_loop_accepts_at_most_n_minus_1():
    """Node 1 is its own first child and always matches: the walk must stop after N - 1
    accepts (it accepted N before, one past the longest path, and at N = 1056 wrote past the
    shared ``path`` row)."""
    N = 4
    tokens = np.array([[5, 7, -1, -1]], np.int32)
    first = np.array([[1, 1, -1, -1]], np.int32)       # 0 -> 1 -> 1 -> 1 ...
    sibling = np.full((1, N), -1, np.int32)
    predict = np.array([[7, 7, 0, 0]], np.int32)
    with pytest.raises(ValueError, match="links to a node twice"):
        ref.tree_accept(tokens, first, sibling, predict)   # the reference always checks
    res = K.tree_accept(tokens, first, sibling, predict, check=False)
    assert_accept_well_formed(res, tokens, predict)
    assert res.accept_len.copy_to_host().tolist() == [N - 1]


@pytest.mark.parametrize("seed", range(3))
def test_kernel_unchecked_garbage_links_stay_well_formed(seed):
    """Random links (cycles, self-loops, out-of-range values) with tokens that often match."""
    rng = np.random.default_rng(900 + seed)
    bs, N = 16, int(rng.integers(1, 12))
    tokens = rng.integers(0, 3, (bs, N)).astype(np.int32)
    first = rng.integers(-3, N + 3, (bs, N)).astype(np.int32)
    sibling = rng.integers(-3, N + 3, (bs, N)).astype(np.int32)
    predict = rng.integers(0, 3, (bs, N)).astype(np.int32)
    res = K.tree_accept(tokens, first, sibling, predict, check=False)
    assert_accept_well_formed(res, tokens, predict)


def unchecked_walk(tokens, first, sibling, predict):
    """The kernel's walk as it was written before its entries were packed, for any links
    (the reference refuses invalid trees): ``(k, path, bonus)`` of one request."""
    N = len(tokens)
    cur, k, path, steps = 0, 0, [0], 0
    while k < N - 1:
        want = predict[cur]
        c = first[cur]
        while 0 < c < N and tokens[c] != want and steps < N:
            c = sibling[c]
            steps += 1
        if c <= 0 or c >= N or steps >= N:
            break
        k += 1
        path.append(int(c))
        cur = c
        steps += 1
    return k, path, predict[cur]


EXTREME_LINKS = (-2**31, -1056, -2, -1, 0, 2**31 - 1)


@pytest.mark.parametrize("seed", range(3))
def test_kernel_unchecked_garbage_links_walk_as_written(seed):
    """Random links, extreme ones among them (N, N + 1, -N, -2**31, 2**31 - 1, ...), and
    tokens that often match: the accepted path, tokens and bonus equal those of the walk
    written out in numpy, exactly."""
    rng = np.random.default_rng(700 + seed)
    bs = 8
    for N in (1, 2, 5, int(rng.integers(6, 40))):
        links = np.r_[np.arange(-3, N + 3), EXTREME_LINKS].astype(np.int32)
        tokens = rng.integers(-1, 3, (bs, N)).astype(np.int32)
        first = rng.choice(links, (bs, N)).astype(np.int32)
        sibling = rng.choice(links, (bs, N)).astype(np.int32)
        predict = rng.integers(-1, 3, (bs, N)).astype(np.int32)
        res = K.tree_accept(tokens, first, sibling, predict, check=False)
        lens, nodes = res.accept_len.copy_to_host(), res.accept_nodes.copy_to_host()
        got_tokens, bonus = res.accept_tokens.copy_to_host(), res.bonus_token.copy_to_host()
        for b in range(bs):
            k, path, want_bonus = unchecked_walk(tokens[b], first[b], sibling[b], predict[b])
            assert lens[b] == k and bonus[b] == want_bonus, (N, b)
            np.testing.assert_array_equal(nodes[b, : k + 1], path)
            np.testing.assert_array_equal(got_tokens[b, :k], tokens[b, path[1:]])


@pytest.mark.parametrize("bad", [1056, 1057, 0, -1, -1056, -2**31, 2**31 - 1])
def test_kernel_unchecked_sibling_at_the_row_end_is_never_loaded(bad):
    """At N = MAX_NODES (the shared rows' length): the root's first child does not match, its
    sibling N - 1 (the last node) does, and N - 1's first child does not match either, whose
    next sibling is ``bad``, past the rows or negative. The walk loads each sibling's entry at
    a clamped index while its range test runs, so a link of N must never be loaded (the
    simulator refuses a read past a shared array) nor a negative one wrap around: one node
    accepted, N - 1."""
    from ddtree_numba.limits import MAX_NODES

    N = MAX_NODES
    assert bad in (N, N + 1) or bad <= 0 or bad >= 2**31 - 1
    tokens = np.full((1, N), 9, np.int32)
    first = np.full((1, N), -1, np.int32)
    sibling = np.full((1, N), -1, np.int32)
    predict = np.zeros((1, N), np.int32)
    predict[0, 0], predict[0, N - 1] = 5, 6
    first[0, 0], sibling[0, 1] = 1, N - 1          # root -> 1 (token 9) -> N - 1 (token 5)
    tokens[0, N - 1] = 5
    first[0, N - 1], sibling[0, 2] = 2, bad         # N - 1 -> 2 (token 9) -> bad
    res = K.tree_accept(tokens, first, sibling, predict, check=False)
    assert_accept_well_formed(res, tokens, predict)
    assert res.accept_len.copy_to_host().tolist() == [1]
    assert res.accept_nodes.copy_to_host()[0, :2].tolist() == [0, N - 1]
    assert res.bonus_token.copy_to_host().tolist() == [6]
