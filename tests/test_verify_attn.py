"""verify_attn reference: the absorb identity, causal equivalence, masking and padding."""

import numpy as np
import pytest
from cases import paged_cache, random_topk

from ddtree_numba import reference as ref


def small_problem(rng, bs=2, budget=6, H=3, Dc=8, Dr=4, page_size=4):
    lp, ids = random_topk(rng, bs, 3, 3)
    prefix = rng.integers(0, 9, bs).astype(np.int32)
    tree = ref.build_tree(lp, ids, np.zeros(bs, np.int32), budget, prefix_lens=prefix)
    N = budget + 1
    cache, table = paged_cache(rng, bs, prefix, N, page_size=page_size, D=Dc + Dr)
    q_latent = rng.standard_normal((bs, N, H, Dc)).astype(np.float32)
    q_rope = rng.standard_normal((bs, N, H, Dr)).astype(np.float32)
    return tree, prefix, cache, table, q_latent, q_rope


def test_absorbed_equals_plain_mla():
    """softmax(q_nope W_UK^T c + ...) @ (c W_UV) == (softmax(q_latent . c + ...) @ c) W_UV."""
    rng = np.random.default_rng(0)
    H, Dc, Dr, dn, dv = 3, 16, 4, 5, 6
    tree, prefix, cache, table, _, q_rope = small_problem(rng, bs=1, H=H, Dc=Dc, Dr=Dr)
    N, n, P = tree.parents.shape[1], int(tree.num_nodes[0]), int(prefix[0])
    w_uk = rng.standard_normal((H, Dc, dn))
    w_uv = rng.standard_normal((H, Dc, dv))
    q_nope = rng.standard_normal((1, N, H, dn))
    q_latent = np.einsum("bihd,hcd->bihc", q_nope, w_uk).astype(np.float32)  # absorbed W_UK
    scale = 0.3
    out, _ = ref.verify_attn(q_latent, q_rope, cache, table, prefix, tree.visibility_bits,
                             tree.num_nodes, sm_scale=scale)
    rows = ref.gather_slots(cache, table[0], P + N).astype(np.float64)
    visible = np.concatenate([np.ones((n, P), bool), tree.visibility[0, :n]], axis=1)
    plain = ref.plain_mla_attention(q_nope[0, :n], q_rope[0, :n].astype(np.float64),
                                    rows[:, :Dc], rows[:, Dc:], w_uk, w_uv, visible,
                                    sm_scale=scale)
    absorbed = np.einsum("ihc,hcd->ihd", out[0, :n].astype(np.float64), w_uv)
    # q_latent is float32, so the two agree to float32 rounding of the inputs
    np.testing.assert_allclose(absorbed, plain, rtol=1e-4, atol=1e-4)


def test_chain_equals_causal_attention():
    rng = np.random.default_rng(1)
    lp, ids = random_topk(rng, 1, 6, 1)                         # K = 1: a chain
    P, N, H, Dc, Dr = 5, 7, 2, 8, 4
    tree = ref.build_tree(lp, ids, np.zeros(1, np.int32), N - 1)
    cache, table = paged_cache(rng, 1, [P], N, page_size=3, D=Dc + Dr)
    ql = rng.standard_normal((1, N, H, Dc)).astype(np.float32)
    qr = rng.standard_normal((1, N, H, Dr)).astype(np.float32)
    out, lse = ref.verify_attn(ql, qr, cache, table, np.array([P], np.int32),
                               tree.visibility_bits, tree.num_nodes, sm_scale=0.25)
    rows = ref.gather_slots(cache, table[0], P + N).astype(np.float64)
    for i in range(N):                                          # causal: slots [0, P + i]
        s = 0.25 * (ql[0, i] @ rows[: P + i + 1, :Dc].T + qr[0, i] @ rows[: P + i + 1, Dc:].T)
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(out[0, i], (p / p.sum(-1, keepdims=True)) @ rows[: P + i + 1,
                                   :Dc], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[0, i], s.max(-1) + np.log(np.exp(s - s.max(-1,
                                   keepdims=True)).sum(-1)), rtol=1e-6)


def test_output_depends_only_on_ancestors_and_padding_rows():
    rng = np.random.default_rng(2)
    tree, prefix, cache, table, ql, qr = small_problem(rng)
    args = (table, prefix, tree.visibility_bits, tree.num_nodes)
    out, lse = ref.verify_attn(ql, qr, cache, *args, sm_scale=0.5)
    page_size = cache.shape[1]
    for b in range(2):
        n = int(tree.num_nodes[b])
        assert (out[b, n:] == 0).all() and np.isneginf(lse[b, n:]).all()
        for j in range(1, n):
            changed = cache.copy()
            slot = prefix[b] + j
            changed[table[b, slot // page_size], slot % page_size] += 10.0
            out2, _ = ref.verify_attn(ql, qr, changed, *args, sm_scale=0.5)
            for i in range(n):
                same = np.array_equal(out2[b, i], out[b, i])
                assert same == (not tree.visibility[b, i, j]), (b, i, j)


def test_empty_prefix_and_one_page():
    rng = np.random.default_rng(3)
    tree, _, _, _, ql, qr = small_problem(rng, bs=1, budget=2, page_size=8)
    prefix = np.zeros(1, np.int32)
    cache, table = paged_cache(rng, 1, prefix, 3, page_size=8, D=12, spare_pages=0)
    assert table.shape == (1, 1)
    out, lse = ref.verify_attn(ql, qr, cache, table, prefix, tree.visibility_bits,
                               tree.num_nodes, sm_scale=1.0)
    # the root sees only itself: softmax over one slot
    np.testing.assert_allclose(out[0, 0, 0], cache[table[0, 0], 0, :8], rtol=1e-6)


def test_deepseek_sm_scale():
    assert ref.deepseek_sm_scale() == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
    assert ref.deepseek_sm_scale() != pytest.approx(576 ** -0.5)
