"""verify_attn reference: the absorb identity, causal equivalence, masking and padding."""

import numpy as np
import pytest
from cases import paged_cache, random_parents, random_topk

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


def causal_attention(q_latent, q_rope, rows, visible, scale):
    """Plain causal attention of one query ``[H, D*]`` over the first ``visible`` rows."""
    Dc = q_latent.shape[-1]
    s = scale * (q_latent @ rows[:visible, :Dc].T + q_rope @ rows[:visible, Dc:].T)  # [H, t]
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return (e / e.sum(-1, keepdims=True)) @ rows[:visible, :Dc], (m + np.log(e.sum(-1,
                                                                              keepdims=True)))[:, 0]


def chain_problem(rng, P, N, H, Dc, Dr, page_size):
    """A chain-shaped tree (K = 1) with its paged cache and queries."""
    lp, ids = random_topk(rng, 1, N - 1, 1)
    tree = ref.build_tree(lp, ids, np.zeros(1, np.int32), N - 1)
    cache, table = paged_cache(rng, 1, [P], N, page_size=page_size, D=Dc + Dr)
    ql = rng.standard_normal((1, N, H, Dc)).astype(np.float32)
    qr = rng.standard_normal((1, N, H, Dr)).astype(np.float32)
    return tree, cache, table, ql, qr


def test_chain_equals_causal_attention():
    P, N, H, Dc, Dr = 5, 7, 2, 8, 4
    tree, cache, table, ql, qr = chain_problem(np.random.default_rng(1), P, N, H, Dc, Dr, 3)
    out, lse = ref.verify_attn(ql, qr, cache, table, np.array([P], np.int32),
                               tree.visibility_bits, tree.num_nodes, sm_scale=0.25)
    rows = ref.gather_slots(cache, table[0], P + N).astype(np.float64)
    for i in range(N):
        want_out, want_lse = causal_attention(ql[0, i], qr[0, i], rows, P + i + 1, 0.25)
        np.testing.assert_allclose(out[0, i], want_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[0, i], want_lse, rtol=1e-6)


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


# ------------------------------------------------------------------------------------------
# Kernels against the float64 reference
# ------------------------------------------------------------------------------------------
from ml_dtypes import bfloat16  # noqa: E402

from ddtree_numba import kernels as K  # noqa: E402

#: Relative error bound, ||out - ref||_F / ||ref||_F per request, and for lse
#: max |lse - ref| / (1 + |ref|). The kernels read the same stored values as the reference
#: (bf16 widened exactly) and accumulate in float32: dot products of length <= 576 and sums of
#: <= P + N terms in float32 land near 1e-6; 2e-5 leaves a 10x margin.
REL_BOUND = 2e-5


def kernel_variants():
    return ["readable"] if K.SIMULATOR else ["readable", "tiled"]


def attn_problem(rng, *, bs, budget, H, Dc, Dr, page_size, max_prefix, dtype=np.float32, L=4,
                 Kk=3):
    lp, ids = random_topk(rng, bs, L, Kk)
    prefix = rng.integers(0, max_prefix + 1, bs).astype(np.int32)
    tree = ref.build_tree(lp, ids, np.zeros(bs, np.int32), budget, prefix_lens=prefix)
    N = budget + 1
    cache, table = paged_cache(rng, bs, prefix, N, page_size=page_size, D=Dc + Dr, dtype=dtype)
    ql = rng.standard_normal((bs, N, H, Dc)).astype(np.float32)
    qr = rng.standard_normal((bs, N, H, Dr)).astype(np.float32)
    return ql, qr, cache, table, prefix, tree.visibility_bits, tree.num_nodes


def check_against_reference(args, sm_scale, variant, **kw):
    from numba import cuda

    ql = args[0]
    bs, N, H, Dc = ql.shape
    poison = (cuda.to_device(np.full((bs, N, H, Dc), np.nan, np.float32)),
              cuda.to_device(np.full((bs, N, H), np.nan, np.float32)))
    out, lse = K.verify_attn(*args, sm_scale=sm_scale, variant=variant, out=poison, **kw)
    out, lse = out.copy_to_host(), lse.copy_to_host()
    want_out, want_lse = ref.verify_attn(*args, sm_scale=sm_scale)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an output was not written"
    for b in range(bs):
        n = int(args[6][b])
        err = np.linalg.norm(out[b] - want_out[b]) / max(np.linalg.norm(want_out[b]), 1e-30)
        assert err <= REL_BOUND, (variant, b, err)
        assert (out[b, n:] == 0).all() and np.isneginf(lse[b, n:]).all()
        lse_err = np.abs(lse[b, :n] - want_lse[b, :n]) / (1 + np.abs(want_lse[b, :n]))
        assert lse_err.max() <= REL_BOUND, (variant, b, lse_err.max())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_kernel_matches_reference_small(seed, dtype):
    rng = np.random.default_rng(seed)
    args = attn_problem(rng, bs=int(rng.integers(1, 4)), budget=int(rng.integers(0, 8)), H=2,
                        Dc=int(rng.choice([8, 40])), Dr=4, page_size=int(rng.choice([1, 4, 16])),
                        max_prefix=int(rng.choice([0, 5, 20])), dtype=dtype)
    for variant in kernel_variants():
        check_against_reference(args, 0.3, variant)


def test_kernel_chain_equals_causal_and_ancestor_only():
    P, N, H, Dc, Dr = 4, 6, 2, 8, 4
    tree, cache, table, ql, qr = chain_problem(np.random.default_rng(9), P, N, H, Dc, Dr, 4)
    prefix = np.array([P], np.int32)
    for variant in kernel_variants():
        out, _ = K.verify_attn(ql, qr, cache, table, prefix, tree.visibility_bits,
                               tree.num_nodes, sm_scale=0.25, variant=variant)
        out = out.copy_to_host()
        rows = ref.gather_slots(cache, table[0], P + N).astype(np.float64)
        for i in range(N):
            want_out, _ = causal_attention(ql[0, i], qr[0, i], rows, P + i + 1, 0.25)
            np.testing.assert_allclose(out[0, i], want_out, rtol=1e-4, atol=1e-5)
        # changing the last node's row changes only rows that have it as an ancestor (itself)
        changed = cache.copy()
        slot = P + N - 1
        changed[table[0, slot // 4], slot % 4] += 5.0
        out2, _ = K.verify_attn(ql, qr, changed, table, prefix, tree.visibility_bits,
                                tree.num_nodes, sm_scale=0.25, variant=variant)
        out2 = out2.copy_to_host()
        np.testing.assert_array_equal(out2[0, : N - 1], out[0, : N - 1])
        assert not np.array_equal(out2[0, N - 1], out[0, N - 1])


def test_kernel_rejects_bad_inputs_like_the_reference():
    rng = np.random.default_rng(1)
    args = list(attn_problem(rng, bs=1, budget=3, H=1, Dc=8, Dr=4, page_size=4, max_prefix=3))
    with pytest.raises(TypeError, match="sm_scale"):
        K.verify_attn(*args)
    bad = [a.copy() for a in args]
    bad[5][0, 1, 0] = np.uint32(2)                              # row 1 hides the root / itself
    with pytest.raises(ValueError, match=r"visibility_bits: row \[0, 1\] must show"):
        K.verify_attn(*bad, sm_scale=0.5)
    with pytest.raises(TypeError, match=r"q_rope: expected float32"):
        K.verify_attn(args[0], args[1].astype(np.float64), *args[2:], sm_scale=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("H, N, max_prefix, dtype", [
    (128, 16, 2000, np.float32), (64, 64, 1500, bfloat16), (128, 64, 600, bfloat16),
    (8, 1025, 300, np.float32), (64, 257, 100, np.float32),
])
def test_kernel_real_shapes(H, N, max_prefix, dtype):
    rng = np.random.default_rng(H + N)
    args = attn_problem(rng, bs=2, budget=N - 1, H=H, Dc=512, Dr=64, page_size=64,
                        max_prefix=max_prefix, dtype=dtype, L=15, Kk=8)
    check_against_reference(args, ref.deepseek_sm_scale(), "tiled")
    check_against_reference(args, ref.deepseek_sm_scale(), "tiled", splits=1)
    if N <= 64:
        check_against_reference(args, ref.deepseek_sm_scale(), "readable")


def test_workspace_shape_is_checked():
    if K.SIMULATOR:
        pytest.skip("the tiled variant (which uses the workspace) needs a GPU")
    rng = np.random.default_rng(2)
    args = attn_problem(rng, bs=1, budget=3, H=2, Dc=8, Dr=4, page_size=4, max_prefix=3)
    from numba import cuda

    bad = (cuda.device_array((7, 1, 8, 8), np.float32), cuda.device_array((7, 1, 8), np.float32))
    with pytest.raises(ValueError, match="workspace: expected float32"):
        K.verify_attn(*args, sm_scale=0.5, variant="tiled", splits=2, workspace=bad)


@pytest.mark.parametrize("bs, N, H, slots", [
    (1, 16, 128, 1088), (1, 16, 64, 1088), (1, 64, 128, 8256), (8, 16, 128, 32832),
    (1, 1, 2, 1), (3, 5, 2, 24), (1, 1025, 8, 1344), (64, 65, 128, 4160),
])
def test_split_plan_covers_every_slot_once(bs, N, H, slots):
    """The tiled variant's splits: equal ranges of whole 8-slot sub-tiles that cover
    ``[0, slots)`` with no empty split, chosen or forced."""
    import importlib

    kva = importlib.import_module("ddtree_numba.kernels.verify_attn.splits")
    for forced in (None, 1, 2, 7):
        n, per_split = kva.plan_splits(bs, N, H, slots, splits=forced)
        assert n >= 1 and per_split % kva.VSLOTS == 0
        assert (n - 1) * per_split < slots <= n * per_split, (n, per_split)
        if forced is not None:
            assert n <= forced
    # the benchmark's first row (132 SMs, 64 row tiles): 2 splits of 544 slots (4.65 tile
    # times each) fill one wave; 1 split takes 8.8 tile times, 3 or more need two waves
    assert kva.choose_splits(1, 64, 1088, sms=132) == 2


# ------------------------------------------------------------------------------------------
# Rows a query cannot see never influence it, NaN included
# ------------------------------------------------------------------------------------------
GARBAGE_PAGE = 2**30        # a block-table entry no cache has: reading it fails


def poisoned_problem(rng, *, dtype, bs=3, N=9, H=2, Dc=8, Dr=4, page_size=None, max_prefix=20):
    """A problem, and the same problem with every row a query may not see set to NaN.

    Returns ``(clean_args, poisoned_args, garbage_table, checked)``. In the poisoned cache the
    tree slots of a set ``S`` of nodes (every leaf and some random others, never the root),
    the padding slots ``[P + num_nodes, P + N)``, the rest of the last page and every unused
    page are NaN, and block-table entries past the pages that ``P + N`` slots use are ``-1``.
    ``garbage_table`` (for ``check=False`` calls) also points every entry past the pages of
    ``[0, P + num_nodes)`` at a page that does not exist. ``checked[b, i]``: node ``i`` is
    valid and sees no node of ``S``, so its rows must equal those of the clean problem.
    """
    page_size = int(rng.choice([1, 4, 16])) if page_size is None else page_size
    prefix = rng.integers(0, max_prefix + 1, bs).astype(np.int32)
    fill = rng.integers(1, N + 1, bs)
    fill[0] = N - 2                                    # at least one request has padding
    parents, tokens = random_parents(rng, bs, N, fill=fill)
    tree = ref.tree_from_parents(parents, tokens, prefix_lens=prefix)
    cache, table = paged_cache(rng, bs, prefix, N, page_size=page_size, D=Dc + Dr, dtype=dtype)
    ql = rng.standard_normal((bs, N, H, Dc)).astype(np.float32)
    qr = rng.standard_normal((bs, N, H, Dr)).astype(np.float32)
    clean = (ql, qr, cache, table, prefix, tree.visibility_bits, tree.num_nodes)

    bad = np.full_like(cache, np.nan)                  # start from all NaN: unused pages stay
    bad_table = table.copy()
    garbage = table.copy()
    checked = np.zeros((bs, N), bool)
    for b in range(bs):
        P, n = int(prefix[b]), int(tree.num_nodes[b])
        has_child = np.zeros(N, bool)
        has_child[parents[b, 1:n]] = True
        hidden = ~has_child[:n] | (rng.random(n) < 0.3)    # S: leaves and random nodes
        hidden[0] = False
        checked[b, :n] = ~(tree.visibility[b, :n, :n] & hidden[None, :]).any(axis=1)
        keep = np.concatenate([np.arange(P), P + np.flatnonzero(~hidden)])  # copied slots
        pages, rows = table[b, keep // page_size], keep % page_size
        bad[pages, rows] = cache[pages, rows]
        bad_table[b, (P + N + page_size - 1) // page_size:] = -1
        garbage[b, (P + n + page_size - 1) // page_size:] = GARBAGE_PAGE
    assert checked[:, 0].all() and (~checked).any()
    poisoned = (ql, qr, bad, bad_table, *clean[4:])
    return clean, poisoned, garbage, checked


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_reference_never_reads_invisible_rows(seed, dtype):
    clean, poisoned, _, checked = poisoned_problem(np.random.default_rng(seed), dtype=dtype)
    want_out, want_lse = ref.verify_attn(*clean, sm_scale=0.3)
    out, lse = ref.verify_attn(*poisoned, sm_scale=0.3)
    np.testing.assert_array_equal(out[checked], want_out[checked])
    np.testing.assert_array_equal(lse[checked], want_lse[checked])
    valid = np.arange(checked.shape[1])[None, :] < clean[6][:, None]
    assert (out[~valid] == 0).all() and np.isneginf(lse[~valid]).all()


def check_rows_against_reference(out, lse, want_out, want_lse, checked, num_nodes, variant):
    for b in range(out.shape[0]):
        rows = checked[b]
        err = (np.linalg.norm(out[b, rows] - want_out[b, rows])
               / max(np.linalg.norm(want_out[b, rows]), 1e-30))
        assert err <= REL_BOUND, (variant, b, err)
        lse_err = np.abs(lse[b, rows] - want_lse[b, rows]) / (1 + np.abs(want_lse[b, rows]))
        assert lse_err.max() <= REL_BOUND, (variant, b, lse_err.max())
        n = int(num_nodes[b])
        assert (out[b, n:] == 0).all() and np.isneginf(lse[b, n:]).all()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_kernel_never_reads_invisible_rows(seed, dtype):
    """NaN in every row a query cannot see, -1 and then a page that does not exist in the
    block-table entries past the pages in use: the rows that see only finite rows match the
    reference of the finite cache (the tiled variant on a GPU: several splits and one)."""
    clean, poisoned, garbage, checked = poisoned_problem(np.random.default_rng(seed),
                                                         dtype=dtype)
    want_out, want_lse = ref.verify_attn(*clean, sm_scale=0.3)
    num_nodes = clean[6]
    runs = [(poisoned, {}), ((*poisoned[:3], garbage, *poisoned[4:]), {"check": False})]
    for variant in kernel_variants():
        for args, kw in runs:
            for splits in ([None, 1, 3] if variant == "tiled" else [None]):
                out, lse = K.verify_attn(*args, sm_scale=0.3, variant=variant, splits=splits,
                                         **kw)
                check_rows_against_reference(out.copy_to_host(), lse.copy_to_host(), want_out,
                                             want_lse, checked, num_nodes, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_kernel_never_reads_invisible_rows_real_shapes(dtype):
    """The same at Kimi-K2 width (H = 64, 576-wide rows, pages of 64 slots): many 32-row
    tiles, several slot tiles, tree slots anywhere in a 128-slot tile."""
    rng = np.random.default_rng(7)
    clean, poisoned, garbage, checked = poisoned_problem(rng, dtype=dtype, bs=3, N=40, H=64,
                                                         Dc=512, Dr=64, page_size=64,
                                                         max_prefix=400)
    sm_scale = ref.deepseek_sm_scale()
    want_out, want_lse = ref.verify_attn(*clean, sm_scale=sm_scale)
    for args, kw in [(poisoned, {}), ((*poisoned[:3], garbage, *poisoned[4:]),
                                      {"check": False})]:
        for splits in (None, 1):
            out, lse = K.verify_attn(*args, sm_scale=sm_scale, variant="tiled", splits=splits,
                                     **kw)
            check_rows_against_reference(out.copy_to_host(), lse.copy_to_host(), want_out,
                                         want_lse, checked, clean[6], "tiled")


def test_prefix_merge_combines_the_splits_by_log_sum_exp():
    """The mma variant's merge (``splits._merge_prefix_kernel``, plain numba: it runs on the
    simulator too): per row, ``out = sum_s w_s out_s / sum_s w_s`` with ``w_s = exp(lse_s -
    max lse)``, over the splits that the request's own prefix gives it; splits that saw
    nothing (``lse -inf``) weigh 0; padding rows are zero with ``lse -inf``; partials past a
    request's splits (garbage: NaN here) are never read into a result."""
    from numba import cuda

    from ddtree_numba.kernels.verify_attn import splits as sp

    rng = np.random.default_rng(4)
    bs, N, H, Dc, capacity = 3, 5, 2, 40, 4096
    prefix = np.array([0, 300, 2000], np.int32)
    nodes = np.array([5, 3, 0], np.int32)
    S = sp.max_prefix_splits(N)
    part_out = np.full((S, bs, N * H, Dc), np.nan, np.float32)
    part_lse = np.full((S, bs, N * H), np.nan, np.float32)
    want_out = np.zeros((bs, N, H, Dc), np.float32)
    want_lse = np.full((bs, N, H), -np.inf, np.float32)
    for b in range(bs):
        P, n = int(prefix[b]), int(nodes[b])
        per = sp._prefix_split_slots(P)
        used = -(-min(P + n, capacity) // per)
        part_out[:used, b] = rng.standard_normal((used, N * H, Dc))
        part_lse[:used, b] = rng.standard_normal((used, N * H)) * 3
        if used > 1:
            part_lse[1, b, 0] = -np.inf                 # a split that saw no visible slot
        for row in range(n * H):
            lse_s = part_lse[:used, b, row].astype(np.float64)
            w = np.exp(lse_s - lse_s.max())
            want_out[b, row // H, row % H] = (w @ part_out[:used, b, row]) / w.sum()
            want_lse[b, row // H, row % H] = lse_s.max() + np.log(w.sum())
    out = cuda.to_device(np.full((bs, N, H, Dc), 7.0, np.float32))
    lse = cuda.to_device(np.full((bs, N, H), 7.0, np.float32))
    sp._merge_prefix_kernel[(N * H, bs), 32](
        cuda.to_device(part_out), cuda.to_device(part_lse), cuda.to_device(prefix),
        cuda.to_device(nodes), capacity, out, lse)
    np.testing.assert_allclose(out.copy_to_host(), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.copy_to_host(), want_lse, rtol=1e-5, atol=1e-6)


def test_mma_shared_traffic_matches_the_tiling():
    """The mma variant's shared-memory model (the benchmark's roofline) against the tiling
    counted by hand: every staged row copied in once, its 576 values read once per row tile
    (two row tiles of 16 query rows), its first 512 (V) read once, the float32 partial
    scores of 4 k-warps per row tile written and read once; and its ldmatrix count against
    the 30 LDSM a warp that the SASS of the tile loop holds (tests/test_build_report.py)."""
    from ddtree_numba.kernels.verify_attn import mma

    t = mma.shared_traffic(512, 64)
    row_bytes = 2 * (512 + 64)
    assert t["copies in (cp.async, apart)"] == mma.BN * row_bytes
    assert t["K fragments (scores)"] == mma.ROW_TILES * mma.BN * row_bytes
    assert t["V fragments (P V)"] == mma.BN * 2 * 512
    assert t["partial scores, written and read"] == 2 * mma.ROW_TILES * mma.KSPLIT * 16 * 4 * mma.BN
    probability_reads = mma.WARPS * mma.BM * mma.BN * 2           # every warp reads all of P
    ldmatrix = t["K fragments (scores)"] + probability_reads + t["V fragments (P V)"]
    assert ldmatrix // 512 // mma.WARPS == 30
    loads_and_stores = sum(t.values()) - t["copies in (cp.async, apart)"]
    flops = 2 * mma.BM * mma.BN * (512 + 64 + 512)
    assert loads_and_stores == 164864 and 13.5 < flops / loads_and_stores < 13.6
