"""Bad inputs to every public function: a clear TypeError / ValueError, inputs unmodified."""

import copy

import numpy as np
import pytest
from cases import paged_cache, random_topk

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref

IMPLS = [pytest.param(ref, id="reference"), pytest.param(K, id="kernels")]


def good_tree_args():
    lp, ids = random_topk(np.random.default_rng(0), 2, 3, 4)
    return dict(top_log_probs=lp, top_token_ids=ids, root_token_ids=np.array([1, 2], np.int32),
                budget=5, prefix_lens=np.array([0, 3], np.int32))


def call_build(impl, a):
    a = dict(a)
    return impl.build_tree(a.pop("top_log_probs"), a.pop("top_token_ids"),
                           a.pop("root_token_ids"), a.pop("budget"), **a)


def mutate(name, fn):
    def apply(a):
        a = copy.deepcopy(a)
        a[name] = fn(a[name])
        return a
    return apply


def _unsort(lp):
    lp[0, 0, :2] = lp[0, 0, 1::-1] - 0.0
    lp[0, 0, 0] = lp[0, 0, 1] - 1.0
    return lp


def _nan(lp):
    lp[1, 2, 3] = np.nan
    return lp


def _repeat(ids):
    ids[0, 1, 1] = ids[0, 1, 0]
    return ids


def _neg(ids):
    ids[0, 0, 0] = -5
    return ids


BAD_TREE = [
    ("float64 log-probs", mutate("top_log_probs", lambda x: x.astype(np.float64)), TypeError,
     "top_log_probs: expected float32[bs, L, K], got float64[2, 3, 4]"),
    ("int64 ids", mutate("top_token_ids", lambda x: x.astype(np.int64)), TypeError,
     "top_token_ids: expected int32"),
    ("rank 2", mutate("top_log_probs", lambda x: x[0]), ValueError, "expected rank 3"),
    ("K mismatch", mutate("top_token_ids", lambda x: x[..., :3].copy()), ValueError,
     "axis 2 is K=4"),
    ("bs mismatch", mutate("root_token_ids", lambda x: x[:1].copy()), ValueError,
     "axis 0 is bs=2"),
    ("strided", mutate("top_log_probs", lambda x: np.asfortranarray(x)), ValueError,
     "C-contiguous"),
    ("NaN", mutate("top_log_probs", _nan), ValueError, "NaN is not allowed"),
    ("unsorted", mutate("top_log_probs", _unsort), ValueError, "sorted descending"),
    ("positive", mutate("top_log_probs", lambda x: x + 5.0), ValueError, "must be <= 0"),
    ("negative id", mutate("top_token_ids", _neg), ValueError, "expected ids >= 0"),
    ("repeated id", mutate("top_token_ids", _repeat), ValueError, "distinct within a row"),
    ("budget < 0", mutate("budget", lambda x: -1), ValueError, "budget: expected an int in"),
    ("budget float", mutate("budget", lambda x: 2.0), TypeError, "budget: expected an int"),
    ("list input", mutate("root_token_ids", lambda x: x.tolist()), TypeError,
     "root_token_ids: expected a numpy array"),
    ("prefix dtype", mutate("prefix_lens", lambda x: x.astype(np.int64)), TypeError,
     "prefix_lens"),
    ("negative prefix", mutate("prefix_lens", lambda x: -x - 1), ValueError, "prefix_lens"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("label, bad, exc, message", BAD_TREE, ids=[c[0] for c in BAD_TREE])
def test_build_tree_rejects(impl, label, bad, exc, message):
    args = bad(good_tree_args())
    before = copy.deepcopy(args)
    with pytest.raises(exc, match=message.replace("[", r"\[").replace("]", r"\]")):
        call_build(impl, args)
    for key, value in before.items():                   # inputs never modified
        np.testing.assert_array_equal(np.asarray(args[key]), np.asarray(value))


def test_kernel_build_tree_budget_over_capacity():
    a = good_tree_args()
    a["budget"] = 5000
    with pytest.raises(ValueError, match="budget: expected at most 1055"):
        call_build(K, a)


@pytest.mark.parametrize("impl", IMPLS)
def test_draft_topk_rejects(impl):
    x = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"k: expected an int in \[1, 8\], got 9"):
        impl.draft_topk(x, 9)
    with pytest.raises(ValueError, match=r"k: expected an int in \[1, 8\], got 0"):
        impl.draft_topk(x, 0)
    with pytest.raises(TypeError, match=r"logits: expected float32\|bfloat16"):
        impl.draft_topk(x.astype(np.float64), 2)
    bad = x.copy()
    bad[0, 1, 3] = np.nan
    with pytest.raises(ValueError, match="logits: NaN is not allowed"):
        impl.draft_topk(bad, 2)
    bad[0, 1, 3] = np.inf
    with pytest.raises(ValueError, match=r"logits: \+inf is not allowed"):
        impl.draft_topk(bad, 2)


def accept_args():
    tree = ref.tree_from_parents(np.array([[-1, 0, 0, 1]], np.int32),
                                 np.array([[9, 1, 2, 3]], np.int32))
    return [tree.token_ids, tree.next_token, tree.next_sibling, np.zeros((1, 4), np.int32)]


@pytest.mark.parametrize("impl", IMPLS)
def test_tree_accept_rejects(impl):
    args = accept_args()
    with pytest.raises(ValueError, match=r"target_predict: expected int32\[bs=1, N=4\], got "
                                         r"int32\[1, 5\]"):
        impl.tree_accept(*args[:3], np.zeros((1, 5), np.int32))
    cyc = [a.copy() for a in args]
    cyc[2][0, 2] = 1                                    # node 1 linked twice: not a tree
    with pytest.raises(ValueError, match="links to a node twice"):
        impl.tree_accept(*cyc)
    out = [a.copy() for a in args]
    out[1][0, 0] = 7
    with pytest.raises(ValueError, match=r"next_token: expected -1 or a node index"):
        impl.tree_accept(*out)


def commit_args(rng=None):
    rng = rng or np.random.default_rng(0)
    prefix = np.array([2, 0], np.int32)
    cache, table = paged_cache(rng, 2, prefix, 4, page_size=2, D=3)
    nodes = np.array([[0, 1, 3, -1], [0, -1, -1, -1]], np.int32)
    return [cache, table, prefix, nodes, np.array([2, 0], np.int32)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("label, edit, message", [
    ("not increasing", lambda a: a[3].__setitem__((0, 2), 1), "not a root path"),
    ("not from root", lambda a: a[3].__setitem__((0, 0), 2), "not a root path"),
    ("k too large", lambda a: a[4].__setitem__(0, 4), r"accept_len: expected values in"),
    ("table too short", lambda a: a[2].__setitem__(0, 50), "block_table maps only"),
    ("page out of range", lambda a: a[1].__setitem__((0, 0), 999), "uses a page outside"),
    ("shared page", lambda a: a[1].__setitem__((1, 0), a[1][0, 0]), "used twice"),
])
def test_commit_kv_rejects_and_leaves_cache_alone(impl, label, edit, message):
    args = commit_args()
    edit(args)
    cache_before = args[0].copy()
    with pytest.raises(ValueError, match=message):
        impl.commit_kv(*args)
    np.testing.assert_array_equal(args[0], cache_before)


def attn_args():
    rng = np.random.default_rng(0)
    tree = ref.tree_from_parents(np.array([[-1, 0, 1]], np.int32), np.array([[1, 2, 3]], np.int32))
    prefix = np.array([3], np.int32)
    cache, table = paged_cache(rng, 1, prefix, 3, page_size=4, D=6)
    ql = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    qr = rng.standard_normal((1, 3, 2, 2)).astype(np.float32)
    return [ql, qr, cache, table, prefix, tree.visibility_bits, tree.num_nodes]


def test_verify_attn_rejects():
    a = attn_args()
    with pytest.raises(TypeError, match="sm_scale"):
        ref.verify_attn(*a)                             # sm_scale is required
    with pytest.raises(ValueError, match="sm_scale: expected a finite float > 0"):
        ref.verify_attn(*a, sm_scale=0.0)
    bad = [x.copy() for x in a]
    bad[5][0, 2, 0] &= ~np.uint32(1 << 2)               # row 2 hides its own slot
    with pytest.raises(ValueError, match=r"visibility_bits: row \[0, 2\] must show"):
        ref.verify_attn(*bad, sm_scale=0.5)
    bad = [x.copy() for x in a]
    bad[2] = bad[2][..., :5].copy()
    with pytest.raises(ValueError, match="kv_cache: expected last axis Dc \\+ Dr = 6"):
        ref.verify_attn(*bad, sm_scale=0.5)
    bad = [x.copy() for x in a]
    bad[4][0] = 10
    with pytest.raises(ValueError, match="block_table maps only"):
        ref.verify_attn(*bad, sm_scale=0.5)


def test_tree_from_parents_rejects():
    tok = np.array([[1, 2, 3]], np.int32)
    with pytest.raises(ValueError, match=r"expected 0 <= parents\[2\] < 2, got 2"):
        ref.tree_from_parents(np.array([[-1, 0, 2]], np.int32), tok)
    with pytest.raises(ValueError, match="root \\(node 0\\) must have parent -1"):
        ref.tree_from_parents(np.array([[0, 0, 1]], np.int32), tok)
    with pytest.raises(ValueError, match="padding must be contiguous"):
        ref.tree_from_parents(np.array([[-1, -1, 0]], np.int32), tok)


def test_kernel_variant_is_checked():
    a = good_tree_args()
    a["variant"] = "bogus"
    with pytest.raises(ValueError, match=r"variant: expected one of "
                                         r"\('scan', 'corners', 'warp', 'levels', 'threshold'\)"):
        call_build(K, a)
    if K.SIMULATOR:
        for variant in ("corners", "warp"):
            a["variant"] = variant
            with pytest.raises(ValueError, match=f"'{variant}' needs warp intrinsics"):
                call_build(K, a)


# --------------------------------------------------------------------------------------------
# Positions and slots are int32: prefix_lens + N must not pass MAX_POSITION
# --------------------------------------------------------------------------------------------
POSITION_MESSAGE = r"prefix_lens: expected P \+ N <= 2147483647"


@pytest.mark.parametrize("impl", IMPLS)
def test_build_tree_rejects_positions_past_int32(impl):
    """``positions = prefix_lens + depths`` wrapped around int32 (to negative positions)."""
    a = good_tree_args()                                # budget 5: N = 6
    a["prefix_lens"] = np.array([0, 2**31 - 6], np.int32)
    with pytest.raises(ValueError, match=POSITION_MESSAGE):
        call_build(impl, a)
    a["prefix_lens"] = np.array([0, 2**31 - 7], np.int32)    # P + N = MAX_POSITION: fine
    tree = call_build(impl, a).to_host()
    assert tree.positions[1].max() == 2**31 - 7 + tree.depths[1].max()


def test_tree_from_parents_rejects_positions_past_int32():
    parents, tokens = np.array([[-1, 0, 1]], np.int32), np.array([[1, 2, 3]], np.int32)
    with pytest.raises(ValueError, match=POSITION_MESSAGE):
        ref.tree_from_parents(parents, tokens, prefix_lens=np.array([2**31 - 3], np.int32))
    tree = ref.tree_from_parents(parents, tokens, prefix_lens=np.array([2**31 - 4], np.int32))
    assert tree.positions.tolist() == [[2**31 - 4, 2**31 - 3, 2**31 - 2]]


def huge_table(P, N):
    """A block table whose capacity passes ``P + N``: every slot check but the position one
    would pass or blame the table (2**19 + 1 pages of 4096 slots, all page 0)."""
    return np.zeros((1, 2**19 + 1), np.int32), np.zeros((2, 4096, 3), np.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_kv_rejects_slots_past_int32(impl):
    P, N = 2**31 - 3, 4
    table, cache = huge_table(P, N)
    nodes = np.array([[0, 1, -1, -1]], np.int32)
    with pytest.raises(ValueError, match=POSITION_MESSAGE):
        impl.commit_kv(cache, table, np.array([P], np.int32), nodes, np.array([1], np.int32))
    assert not cache.any()


def test_verify_attn_check_rejects_slots_past_int32():
    from ddtree_numba.validation import check_verify_attn

    a = attn_args()                                     # N = 3, Dc = 4, Dr = 2
    table, _ = huge_table(2**31 - 2, 3)
    cache = np.zeros((2, 4096, 6), np.float32)
    with pytest.raises(ValueError, match=POSITION_MESSAGE):
        check_verify_attn(a[0], a[1], cache, table, np.array([2**31 - 2], np.int32), a[5],
                          a[6], 0.5)


# --------------------------------------------------------------------------------------------
# Found by sweeping every public function with bad arguments
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_build_tree_huge_budget_is_named_budget(impl):
    """``budget = 2**40`` with prefix lengths was blamed on ``prefix_lens`` (P + N overflow)."""
    a = good_tree_args()
    a["budget"] = 2**40
    with pytest.raises(ValueError, match=r"budget: expected an int in \[0, 2147483646\]"):
        call_build(impl, a)


@pytest.mark.parametrize("impl", IMPLS)
def test_big_endian_dtype_is_named_in_the_message(impl):
    """A big-endian float32 array was refused as "expected float32, got float32"."""
    a = mutate("top_log_probs", lambda x: x.astype(">f4"))(good_tree_args())
    with pytest.raises(TypeError, match=r"got big-endian float32\[2, 3, 4\]"):
        call_build(impl, a)


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_kv_empty_path_rows_are_named_accept_nodes(impl):
    """``accept_nodes`` with N = 0 (no room for the root) was reported as
    ``accept_len: expected values in [0, N-1=-1]``."""
    args = commit_args()
    args[3] = args[3][:, :0].copy()
    with pytest.raises(ValueError, match=r"accept_nodes: expected N >= 1"):
        impl.commit_kv(*args)


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_kv_zero_page_size_is_named_kv_cache(impl):
    """A cache with ``page_size = 0`` was blamed on ``prefix_lens`` (and the unchecked GPU
    path of verify_attn divides by it)."""
    args = commit_args()
    args[0] = np.zeros((args[0].shape[0], 0, 3), np.float32)
    with pytest.raises(ValueError, match=r"kv_cache: expected page_size >= 1"):
        impl.commit_kv(*args)


def test_verify_attn_zero_page_size_is_named_kv_cache():
    from ddtree_numba.validation import check_verify_attn

    a = attn_args()
    a[2] = np.zeros((a[2].shape[0], 0, 6), np.float32)
    with pytest.raises(ValueError, match=r"kv_cache: expected page_size >= 1"):
        check_verify_attn(*a, 0.5, check=False)        # a shape check: runs unchecked too


@pytest.mark.parametrize("scale", [1e300, 1e-50, 3.5e38])
def test_verify_attn_sm_scale_must_fit_float32(scale):
    """The kernels scale in float32: ``sm_scale = 1e300`` became inf (the kernel returned NaN,
    the reference inf) and ``1e-50`` became 0 (uniform attention); both are refused."""
    with pytest.raises(ValueError, match="sm_scale: expected a finite float > 0"):
        ref.verify_attn(*attn_args(), sm_scale=scale)
