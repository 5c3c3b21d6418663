"""tree_sample (verification under sampling): hand-built cases, SGLang's walk, the sampled
distribution against the target's (lossless), kernel vs reference bit for bit, bad input."""

import numpy as np
import pytest
from cases import random_parents

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.reference.tree_sample import SAMPLE_CHUNK, sample_residual

#           0 (root)
#         / | \
#        1  2  3         tokens 1, 2, 3
#           |
#           4            token 0
PARENTS = np.array([[-1, 0, 0, 0, 2]], np.int32)
TOKENS = np.array([[4, 1, 2, 3, 0]], np.int32)
V = 5


def hand_probs():
    p = np.full((1, 5, V), 0.2, np.float32)           # uniform after every node
    p[0, 2] = [0.5, 0.1, 0.1, 0.1, 0.2]               # after node 2: token 0 (node 4) likely
    return p


def sample(tree, probs, uniforms, bonus):
    return ref.tree_sample(tree.token_ids, tree.next_token, tree.next_sibling, probs,
                           np.asarray(uniforms, np.float32), np.asarray(bonus, np.float32))


@pytest.mark.parametrize("u_root, u_node2, bonus_u, path, tokens", [
    (0.1, 0.9, 0.5, [0, 1], [1, 2]),        # first child: u < 0.2; bonus uniform over V
    (0.3, 0.9, 0.5, [0, 2], [2, 3]),        # second child (0.2 <= u < 0.4); node 4 rejected
    (0.3, 0.2, 0.0, [0, 2, 4], [2, 0, 0]),  # ... and node 4 accepted (u < 0.5): leaf, bonus
    (0.7, 0.0, 0.5, [0], [4]),              # all children rejected: bonus from {0, 4}
    (0.7, 0.0, 0.4, [0], [0]),
])
def test_hand_built_tree(u_root, u_node2, bonus_u, path, tokens):
    tree = ref.tree_from_parents(PARENTS, TOKENS)
    res = sample(tree, hand_probs(), [[u_root, 0.5, u_node2, 0.5, 0.5]], [bonus_u])
    assert res.accept_nodes[0].tolist() == path + [-1] * (5 - len(path))
    assert res.accept_tokens[0].tolist() == tokens + [-1] * (5 - len(tokens))
    assert res.accept_len.tolist() == [len(path) - 1]


def test_residual_removes_exactly_the_rejected_children():
    probs = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    # without tokens 2 and 3 the residual is {0: 0.1, 1: 0.2}: token 0 below 1/3, then token 1
    assert sample_residual(probs, [2, 3], 0.0) == 0
    assert sample_residual(probs, [2, 3], 0.33) == 0
    assert sample_residual(probs, [2, 3], 0.34) == 1
    assert sample_residual(probs, [2, 3], np.nextafter(np.float32(1), 0)) == 1
    assert sample_residual(np.array([0, 0, 1, 0], np.float32), [], 0.0) == 2   # skips zeros
    assert sample_residual(np.array([0.5, 0.5], np.float32), [0, 1], 0.7) == 1  # all removed


def sglang_walk(token_ids, next_token, next_sibling, probs, uniforms):
    """SGLang's ``TreeSpeculativeSamplingTargetOnly`` walk at threshold_single = threshold_acc
    = 1, transcribed from its control flow: (accepted path, last node)."""
    cur, path = 0, [0]
    prob_acc, coin = np.float32(0), uniforms[0]
    index = 0
    while True:
        index = next_token[index]
        accepted = False
        while index != -1:
            p = probs[cur, token_ids[index]]
            prob_acc = np.float32(prob_acc + p)
            if coin <= prob_acc or p >= 1:
                prob_acc, coin = np.float32(0), uniforms[index]
                path.append(int(index))
                cur, accepted = index, True
                break
            index = next_sibling[index]
        if not accepted:
            return path


@pytest.mark.parametrize("seed", range(6))
def test_walk_equals_sglang_target_only_sampling(seed):
    """Same lists, same uniforms: the same accepted path as SGLang's kernel (away from the
    measure-zero boundary where a uniform equals a partial sum exactly)."""
    rng = np.random.default_rng(seed)
    parents, tokens = random_parents(rng, 4, 40)
    tree = ref.tree_from_parents(parents, tokens)
    probs = rng.dirichlet(np.full(60, 0.3), (4, 40)).astype(np.float32)
    uniforms = rng.random((4, 40), dtype=np.float32)
    res = sample(tree, probs, uniforms, rng.random(4, dtype=np.float32))
    for b in range(4):
        want = sglang_walk(tree.token_ids[b], tree.next_token[b], tree.next_sibling[b], probs[b],
                           uniforms[b])
        assert res.accept_nodes[b, : len(want)].tolist() == want
        assert res.accept_len[b] == len(want) - 1


def test_emitted_tokens_have_the_target_distribution():
    """Lossless: whatever the tree, the first emitted token is distributed as the target's
    distribution after the root, and the second as the target's after the first (chi-square
    bounds at 20 000 draws, a 1e-6 false-alarm rate)."""
    rng = np.random.default_rng(0)
    n, V = 20000, 6
    tree = ref.tree_from_parents(np.array([[-1, 0, 0, 1, 1]], np.int32),
                                 np.array([[0, 3, 1, 4, 2]], np.int32))
    probs = rng.dirichlet(np.ones(V), (1, 5)).astype(np.float32)
    # what comes after the first token t: node 1's row if t = 3, node 2's if t = 1, else the
    # root is the last accepted node and the second token is the next step's (not tested)
    first, second = np.zeros(V), {3: np.zeros(V)}
    uniforms = rng.random((n, 1, 5), dtype=np.float32)
    bonus = rng.random((n, 1), dtype=np.float32)
    for d in range(n):
        res = sample(tree, probs, uniforms[d], bonus[d])
        t = res.accept_tokens[0, 0]
        first[t] += 1
        if t == 3:
            second[3][res.accept_tokens[0, 1]] += 1
    for counts, p in ((first, probs[0, 0]), (second[3], probs[0, 1])):
        expected = counts.sum() * p.astype(np.float64)
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 35.9                     # chi-square, 5 degrees of freedom, p = 1e-6


@pytest.mark.parametrize("seed, bs, N, V", [(0, 3, 30, 70), (1, 1, 1, 5), (2, 5, 64, 300),
                                            (3, 2, 12, 1), (4, 4, 50, 64)])
def test_kernel_equals_reference_bit_for_bit(seed, bs, N, V):
    """Random trees (ragged, some with one node), peaked, flat and sparse target rows, uniforms
    at 0 and just below 1, vocabularies below, at and above one chunk."""
    rng = np.random.default_rng(seed)
    parents, tokens = random_parents(rng, bs, N)
    if V == 1:                                      # one token: only a chain has no repeats
        parents[:, 1:] = np.where(parents[:, 1:] >= 0, np.arange(N - 1), -1)
    for b in range(bs):                             # distinct tokens among siblings
        for i in range(N):
            kids = np.nonzero(parents[b] == i)[0]
            tokens[b, kids] = (rng.permutation(V)[: len(kids)] if len(kids) <= V
                               else np.arange(len(kids)) % V)
    tree = ref.tree_from_parents(parents, tokens)
    alpha = rng.choice([0.05, 1.0, 5.0], (bs, N, 1))
    probs = rng.gamma(np.broadcast_to(alpha, (bs, N, V)))
    probs[rng.random((bs, N, V)) < 0.3] = 0                   # sparse rows (top-k / top-p)
    probs[..., 0] += 1e-3
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    uniforms = rng.random((bs, N), dtype=np.float32)
    uniforms[:, ::7] = 0
    uniforms[:, 3::11] = np.nextafter(np.float32(1), np.float32(0))
    bonus = rng.random(bs, dtype=np.float32)
    args = (tree.token_ids, tree.next_token, tree.next_sibling, probs, uniforms, bonus)
    want = ref.tree_sample(*args)
    got = K.tree_sample(*args).to_host()
    for field in ("accept_nodes", "accept_len", "accept_tokens", "bonus_token"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def test_unchecked_device_inputs_stay_in_bounds():
    """check=False with links and tokens outside their ranges: an answer, not a crash."""
    token_ids = np.array([[0, 9999, -5, 2]], np.int32)
    next_token = np.array([[1, 3, 77, 1]], np.int32)                 # a cycle and a bad link
    next_sibling = np.array([[-1, 2, 1, -9]], np.int32)
    probs = np.full((1, 4, 3), 1 / 3, np.float32)
    res = K.tree_sample(*(K.as_device(a) for a in (token_ids, next_token, next_sibling, probs)),
                        K.as_device(np.zeros((1, 4), np.float32)),
                        K.as_device(np.zeros(1, np.float32)), check=False).to_host()
    assert 0 <= res.accept_len[0] <= 3 and 0 <= res.bonus_token[0] < 3


@pytest.mark.parametrize("change, message", [
    ({"uniforms": np.ones((1, 5), np.float32)}, r"uniforms: expected values in \[0, 1\)"),
    ({"bonus_uniforms": np.array([-0.1], np.float32)}, r"bonus_uniforms: expected values"),
    ({"target_probs": "negative"}, r"target_probs: expected probabilities"),
    ({"target_probs": "nan"}, r"target_probs: expected probabilities"),
    ({"target_probs": "unnormalised"}, r"target_probs: expected each tree node's row to sum"),
    ({"target_probs": np.zeros((1, 5, 5), np.float64)}, r"target_probs: expected float32"),
    ({"uniforms": np.zeros((1, 4), np.float32)}, r"uniforms: expected float32\[bs=1, N=5\]"),
])
def test_bad_input_is_refused_by_name(change, message):
    tree = ref.tree_from_parents(PARENTS, TOKENS)
    args = {"target_probs": hand_probs(), "uniforms": np.full((1, 5), 0.5, np.float32),
            "bonus_uniforms": np.array([0.5], np.float32)}
    for key, value in change.items():
        if isinstance(value, str):
            p = hand_probs()
            p[0, 2, 1] = {"negative": -0.1, "nan": np.nan, "unnormalised": 0.6}[value]
            value = p
        args[key] = value
    before = {k: np.array(v, copy=True) for k, v in args.items()}
    for fn in (ref.tree_sample, K.tree_sample):
        with pytest.raises((ValueError, TypeError), match=message):
            fn(tree.token_ids, tree.next_token, tree.next_sibling, args["target_probs"],
               args["uniforms"], args["bonus_uniforms"])
    for k, v in args.items():                                  # nothing the caller owns changed
        np.testing.assert_array_equal(v, before[k])


def test_padding_rows_may_hold_anything():
    """Rows of nodes the walk cannot reach (padding) are neither checked nor read."""
    parents = np.array([[-1, 0, -1, -1]], np.int32)
    tokens = np.array([[1, 2, -1, -1]], np.int32)
    tree = ref.tree_from_parents(parents, tokens)
    probs = np.full((1, 4, 4), 0.25, np.float32)
    probs[0, 2:] = np.nan
    args = (tree.token_ids, tree.next_token, tree.next_sibling, probs,
            np.array([[0.1, 0.9, 0.5, 0.5]], np.float32), np.array([0.6], np.float32))
    want = ref.tree_sample(*args)
    got = K.tree_sample(*args).to_host()
    assert want.accept_nodes[0].tolist() == [0, 1, -1, -1]
    np.testing.assert_array_equal(got.accept_tokens, want.accept_tokens)
    assert SAMPLE_CHUNK == 64


def test_repeated_sibling_tokens_are_refused():
    """Two children with one token would count its probability twice (not lossless)."""
    tree = ref.tree_from_parents(np.array([[-1, 0, 0]], np.int32),
                                 np.array([[5, 1, 1]], np.int32))
    with pytest.raises(ValueError, match="token_ids: the children of node .0, 0. repeat token 1"):
        ref.tree_sample(tree.token_ids, tree.next_token, tree.next_sibling,
                        np.full((1, 3, 2), 0.5, np.float32), np.zeros((1, 3), np.float32),
                        np.zeros(1, np.float32))


def test_a_batch_of_repeated_trees_names_the_first_bad_request():
    """Validation walks each distinct tree once (a batch often repeats one); the error still
    names the first request that fails, whichever of its trees it is."""
    tree = ref.tree_from_parents(np.tile(PARENTS, (6, 1)), np.tile(TOKENS, (6, 1)))
    uniforms, bonus = np.full((6, 5), 0.5, np.float32), np.full(6, 0.5, np.float32)
    probs = np.tile(hand_probs(), (6, 1, 1))
    probs[4, 2, 1], probs[3, 1, 0] = np.nan, 0.7                # request 3 fails first
    with pytest.raises(ValueError, match=r"sum to 1 .* at node \(3, 1\)"):
        ref.tree_sample(tree.token_ids, tree.next_token, tree.next_sibling, probs, uniforms,
                        bonus)
    probs[3, 1, 0] = hand_probs()[0, 1, 0]
    with pytest.raises(ValueError, match=r"got nan at index \(4, 2, 1\)"):
        ref.tree_sample(tree.token_ids, tree.next_token, tree.next_sibling, probs, uniforms,
                        bonus)
    tokens = tree.token_ids.copy()
    tokens[[2, 5], 2] = tokens[2, 1]                        # two bad requests of one new tree
    with pytest.raises(ValueError, match=r"children of node \(2, 0\) repeat"):
        ref.tree_sample(tokens, tree.next_token, tree.next_sibling, np.tile(hand_probs(),
                        (6, 1, 1)), uniforms, bonus)


def test_device_lists_with_host_probabilities_are_not_walked_unchecked():
    """Default checks run only when every input is on the host: with the lists on the device
    nothing walks them on the host (a cycle there must not hang validation)."""
    tree = ref.tree_from_parents(PARENTS, TOKENS)
    cyclic = tree.next_sibling.copy()
    cyclic[0, 1] = 1                                   # node 1 is its own next sibling
    res = K.tree_sample(K.as_device(tree.token_ids), K.as_device(tree.next_token),
                        K.as_device(cyclic), hand_probs(), np.full((1, 5), 0.9, np.float32),
                        np.array([0.5], np.float32)).to_host()
    assert 0 <= res.bonus_token[0] < V


def test_an_out_buffer_of_the_wrong_shape_is_refused():
    tree = ref.tree_from_parents(PARENTS, TOKENS)
    out = K.allocate_accept(1, 4)                       # N = 4 where the tree has 5 nodes
    for fn, last in ((K.tree_sample, (hand_probs(), np.zeros((1, 5), np.float32),
                                      np.zeros(1, np.float32))),
                     (K.tree_accept, (np.zeros((1, 5), np.int32),))):
        with pytest.raises(ValueError, match=r"out.accept_nodes: expected int32\[1, 5\]"):
            fn(tree.token_ids, tree.next_token, tree.next_sibling, *last, out=out)


# -- tree_sample_logits: the walk straight from the logits ------------------------------------
def sampling_case(seed, bs, N, V):
    """A ragged random tree (distinct sibling tokens), logits that favour each node's first
    child (so walks go deep), a -inf per row, and per-request parameters that mix greedy,
    temperature only, top-k, top-p and both."""
    rng = np.random.default_rng(seed)
    parents, tokens = random_parents(rng, bs, N)
    for b in range(bs):
        for i in range(N):
            kids = np.nonzero(parents[b] == i)[0]
            tokens[b, kids] = rng.permutation(V)[: len(kids)]
    tree = ref.tree_from_parents(parents, tokens)
    logits = (rng.standard_normal((bs, N, V)) * 2).astype(np.float32)
    for b in range(bs):
        for i in range(N):
            if tree.next_token[b, i] > 0:
                logits[b, i, tree.token_ids[b, tree.next_token[b, i]]] += 9
    logits[:, :, V // 2] = -np.inf if V > 2 else logits[:, :, V // 2]
    pick = np.arange(bs) % 5
    params = (np.array([0.0, 1.0, 0.7, 1.3, 0.9], np.float32)[pick],
              np.array([0, 0, min(5, V), 0, min(40, V)], np.int32)[pick],
              np.array([1.0, 1.0, 1.0, 0.8, 0.9], np.float32)[pick])
    uniforms = rng.random((bs, N), dtype=np.float32)
    bonus = rng.random(bs, dtype=np.float32)
    return tree, logits, params, uniforms, bonus


FIELDS = ("accept_nodes", "accept_len", "accept_tokens", "bonus_token")


@pytest.mark.parametrize("seed, bs, N, V", [
    (0, 5, 6, 70), (1, 3, 3, 300), (2, 1, 1, 5),
    pytest.param(4, 5, 30, 70, marks=pytest.mark.gpu),
    pytest.param(5, 10, 64, 9000, marks=pytest.mark.gpu),    # whole groups of 8 x 512 columns
])
def test_logits_kernel_equals_the_two_kernels_bit_for_bit(seed, bs, N, V):
    """tree_sample_logits == tree_sample(sampling_probs(...)) field for field, and the same
    path and tokens as the reference (whose float64 probabilities could differ only within
    rounding of a uniform: not at these seeds)."""
    tree, logits, params, uniforms, bonus = sampling_case(seed, bs, N, V)
    lists = (tree.token_ids, tree.next_token, tree.next_sibling)
    fused = K.tree_sample_logits(*lists, logits, *params, uniforms, bonus).to_host()
    probs = K.sampling_probs(logits, *params)
    two = K.tree_sample(*(K.as_device(a) for a in lists), probs, K.as_device(uniforms),
                        K.as_device(bonus)).to_host()
    want = ref.tree_sample_logits(*lists, logits, *params, uniforms, bonus)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(fused, field), getattr(two, field), err_msg=field)
        np.testing.assert_array_equal(getattr(fused, field), getattr(want, field),
                                      err_msg=field)
    assert fused.accept_len.max() >= min(1, N - 1)     # a walk went past the root's row


def test_logits_kernel_at_temperature_zero_is_greedy_accept():
    """T = 0: one-hot rows, so the walk accepts what greedy verification accepts and the bonus
    is the last node's argmax."""
    tree, logits, (_, top_k, top_p), uniforms, bonus = sampling_case(5, 4, 24, 50)
    got = K.tree_sample_logits(tree.token_ids, tree.next_token, tree.next_sibling, logits,
                               np.zeros(4, np.float32), top_k, top_p, uniforms,
                               bonus).to_host()
    predict = logits.argmax(-1).astype(np.int32)
    want = ref.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, predict)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def test_logits_kernel_never_reads_rows_the_walk_does_not_visit():
    """NaN in the logits of padding nodes and of nodes off the walked path change nothing
    (device inputs: no value checks, which would refuse NaN anywhere)."""
    tree, logits, params, uniforms, bonus = sampling_case(6, 3, 20, 40)
    lists = [K.as_device(a) for a in (tree.token_ids, tree.next_token, tree.next_sibling)]
    rest = [K.as_device(a) for a in (*params, uniforms, bonus)]
    clean = K.tree_sample_logits(*lists, K.as_device(logits), *rest).to_host()
    dirty = logits.copy()
    for b in range(3):
        visited = set(clean.accept_nodes[b][clean.accept_nodes[b] >= 0].tolist())
        dirty[b, [i for i in range(20) if i not in visited]] = np.nan
    got = K.tree_sample_logits(*lists, K.as_device(dirty), *rest).to_host()
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(clean, field), err_msg=field)


def test_logits_kernel_unchecked_inputs_stay_in_bounds():
    """check=False with links and tokens outside their ranges: an answer, not a crash."""
    token_ids = np.array([[0, 9999, -5, 2]], np.int32)
    next_token = np.array([[1, 3, 77, 1]], np.int32)                 # a cycle and a bad link
    next_sibling = np.array([[-1, 2, 1, -9]], np.int32)
    params = (np.ones(1, np.float32), np.array([2], np.int32), np.full(1, 0.9, np.float32))
    res = K.tree_sample_logits(
        *(K.as_device(a) for a in (token_ids, next_token, next_sibling,
                                   np.zeros((1, 4, 3), np.float32), *params,
                                   np.zeros((1, 4), np.float32), np.zeros(1, np.float32))),
        check=False).to_host()
    assert 0 <= res.accept_len[0] <= 3 and 0 <= res.bonus_token[0] < 3


@pytest.mark.parametrize("change, message", [
    ({"logits": "nan"}, r"logits: expected finite values or -inf"),
    ({"temperature": np.full(2, -1, np.float32)}, r"temperature: expected finite, >= 0"),
    ({"top_p": np.zeros(2, np.float32)}, r"top_p: expected in \(0, 1\]"),
    ({"uniforms": np.ones((2, 10), np.float32)}, r"uniforms: expected values in \[0, 1\)"),
    ({"logits": np.zeros((2, 9, 30), np.float32)}, r"logits: expected float32\[bs=2, N=10"),
])
def test_logits_kernel_bad_input_is_refused_by_name(change, message):
    tree, logits, params, uniforms, bonus = sampling_case(7, 2, 10, 30)
    args = {"logits": logits, "temperature": params[0], "top_k": params[1],
            "top_p": params[2], "uniforms": uniforms, "bonus_uniforms": bonus}
    for key, value in change.items():
        if isinstance(value, str):
            value = logits.copy()
            value[1, 0, 3] = np.nan
        args[key] = value
    before = {k: np.array(v, copy=True) for k, v in args.items()}
    for fn in (ref.tree_sample_logits, K.tree_sample_logits):
        with pytest.raises((ValueError, TypeError), match=message):
            fn(tree.token_ids, tree.next_token, tree.next_sibling, **args)
    for k, v in args.items():                                  # nothing the caller owns changed
        np.testing.assert_array_equal(v, before[k])


def test_a_tree_without_nodes_is_refused_even_unchecked():
    """N = 0 has no root to walk from: refused whatever ``check`` says (the kernels would read
    node 0)."""
    empty_i, empty_f = np.zeros((1, 0), np.int32), np.zeros((1, 0), np.float32)
    params = (np.ones(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32))
    for check in (True, False):
        with pytest.raises(ValueError, match=r"token_ids: expected N >= 1"):
            K.tree_sample(empty_i, empty_i, empty_i, np.zeros((1, 0, 3), np.float32), empty_f,
                          np.zeros(1, np.float32), check=check)
        with pytest.raises(ValueError, match=r"token_ids: expected N >= 1"):
            K.tree_sample_logits(empty_i, empty_i, empty_i, np.zeros((1, 0, 3), np.float32),
                                 *params, empty_f, np.zeros(1, np.float32), check=check)
