"""The tensor-core variant of verify_attn (GPU): accuracy against float64 with a derived bound,
masking with NaN in invisible rows, clamped unchecked inputs, and determinism across launches.

The bound. The cache is 16-bit already; the kernel rounds two things more: the query rows to
the cache's type when it loads them, and the probabilities to that type for ``P V``. The first
is reproduced exactly on the host (``ml_dtypes`` rounds to nearest even, as ``cvt.rn`` does),
so the reference is computed in float64 from the *rounded* queries. What is left is the
rounding of each probability, a relative error of at most ``u`` (2^-8 for bfloat16, 2^-11 for
float16) per weight, so each output value is off by at most ``u * sum_t p_t |v_t| <= u *
max |v|``, plus float32 accumulation (``1e-4 * max |v|`` covers 10^4 slots with room). The
log-sum-exp is computed from float32 scores: ``1e-4 (1 + |lse|)``.
"""

import importlib

import ml_dtypes
import numpy as np
import pytest
from cases import paged_cache
from test_verify_attn import attn_problem, poisoned_problem

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref

pytestmark = pytest.mark.gpu
bfloat16 = ml_dtypes.bfloat16
UNIT_ROUNDOFF = {bfloat16: 2.0**-8, np.float16: 2.0**-11}


def rounded_queries(args, dtype):
    """The query rows as the kernel sees them: rounded to the cache's 16-bit type."""
    ql, qr = (a.astype(dtype).astype(np.float32) for a in args[:2])
    return (ql, qr, *args[2:])


def run_mma(args, sm_scale, **kw):
    from numba import cuda

    bs, N, H, Dc = args[0].shape
    poison = (cuda.to_device(np.full((bs, N, H, Dc), np.nan, np.float32)),
              cuda.to_device(np.full((bs, N, H), np.nan, np.float32)))
    out, lse = K.verify_attn(*args, sm_scale=sm_scale, variant="mma", out=poison, **kw)
    return out.copy_to_host(), lse.copy_to_host()


def check_mma(args, sm_scale, dtype, rows=None, **kw):
    """The mma variant against float64 from the rounded queries, within the bound above."""
    out, lse = run_mma(args, sm_scale, **kw)
    want_out, want_lse = ref.verify_attn(*rounded_queries(args, dtype), sm_scale=sm_scale)
    cache, num_nodes = args[2], args[6]
    v_max = float(np.nanmax(np.abs(cache[..., :args[0].shape[3]].astype(np.float64))))
    bound = (UNIT_ROUNDOFF[dtype] + 1e-4) * v_max
    for b in range(out.shape[0]):
        n = int(num_nodes[b])
        keep = np.ones(n, bool) if rows is None else rows[b, :n]
        got_lse, ref_lse = lse[b, :n][keep], want_lse[b, :n][keep]
        err = np.abs(out[b, :n][keep] - want_out[b, :n][keep])
        assert err.max(initial=0) <= bound, (b, err.max(), bound)
        lse_err = np.abs(got_lse - ref_lse) / (1 + np.abs(ref_lse))
        assert lse_err.max(initial=0) <= 1e-4, (b, lse_err.max())
        assert (out[b, n:] == 0).all() and np.isneginf(lse[b, n:]).all()
    return out, lse


@pytest.mark.parametrize("H, N, max_prefix, dtype", [
    (128, 16, 2000, bfloat16), (64, 64, 1500, bfloat16), (16, 257, 900, bfloat16),
    (8, 1025, 300, bfloat16), (128, 16, 700, np.float16), (8, 64, 5000, bfloat16),
])
def test_mma_matches_float64_at_real_shapes(H, N, max_prefix, dtype):
    """Ragged prefixes, shuffled pages (``paged_cache``), padding rows; DeepSeek's widths."""
    rng = np.random.default_rng(H * 7 + N)
    args = attn_problem(rng, bs=3, budget=N - 1, H=H, Dc=512, Dr=64, page_size=64,
                        max_prefix=max_prefix, dtype=dtype, L=15, Kk=8)
    check_mma(args, ref.deepseek_sm_scale(), dtype)


def test_mma_small_widths_and_edges():
    """Dc = 16, Dr = 16 (one k-step per warp, idle warps), page size 1, empty prefixes,
    one node, bs = 1."""
    for seed, (bs, budget, max_prefix, page_size) in enumerate(
            [(1, 0, 0, 1), (2, 3, 0, 16), (4, 8, 40, 1), (1, 0, 1, 4)]):
        args = attn_problem(np.random.default_rng(seed), bs=bs, budget=budget, H=3, Dc=16,
                            Dr=16, page_size=page_size, max_prefix=max_prefix, dtype=bfloat16)
        check_mma(args, 0.3, bfloat16)


@pytest.mark.parametrize("seed", range(3))
def test_mma_never_reads_invisible_rows(seed):
    """NaN in every row a query cannot see and in unused pages, -1 and then garbage pages in
    the block table past the pages in use (unchecked): the rows that see only finite rows
    match the clean problem."""
    clean, poisoned, garbage, checked = poisoned_problem(
        np.random.default_rng(seed), dtype=bfloat16, N=40, H=5, Dc=32, Dr=16, page_size=16,
        max_prefix=300)
    out, _ = check_mma(poisoned, 0.3, bfloat16, rows=checked)
    unchecked, _ = run_mma((*poisoned[:3], garbage, *poisoned[4:]), 0.3, check=False)
    want, _ = run_mma(clean, 0.3)
    np.testing.assert_array_equal(out[checked], want[checked])   # the very same bits
    np.testing.assert_array_equal(unchecked[checked], want[checked])


def test_mma_unchecked_inputs_stay_in_bounds():
    """``check=False`` with num_nodes past N, prefixes past the table and negative: clamped,
    no fault (the launch completes and later launches still work)."""
    rng = np.random.default_rng(5)
    args = list(attn_problem(rng, bs=3, budget=7, H=4, Dc=32, Dr=16, page_size=4,
                             max_prefix=30, dtype=bfloat16))
    args[4] = np.array([10**6, -5, 3], np.int32)        # prefix_lens
    args[6] = np.array([99, 2, -1], np.int32)           # num_nodes
    out, lse = K.verify_attn(*args, sm_scale=0.3, variant="mma", check=False)
    out.copy_to_host()
    check_mma(attn_problem(rng, bs=1, budget=3, H=2, Dc=16, Dr=16, page_size=4, max_prefix=9,
                           dtype=bfloat16), 0.3, bfloat16)


def test_mma_rows_do_not_depend_on_the_launch():
    """A request's rows are bit-identical alone and inside a larger batch with more nodes and
    heads of other requests: split boundaries depend only on the request's own prefix."""
    rng = np.random.default_rng(11)
    args = attn_problem(rng, bs=3, budget=30, H=16, Dc=512, Dr=64, page_size=32,
                        max_prefix=3000, dtype=bfloat16, L=8, Kk=4)
    out, lse = run_mma(args, 0.1)
    for b in range(3):
        alone = tuple(a[b:b + 1] for a in args[:2]) + (args[2],) + tuple(
            a[b:b + 1] for a in args[3:])
        one_out, one_lse = run_mma(alone, 0.1)
        np.testing.assert_array_equal(one_out[0], out[b])
        np.testing.assert_array_equal(one_lse[0], lse[b])
    # fewer heads in the launch: head h of the 16 equals head h of a 4-head launch
    four = (args[0][:, :, :4].copy(), args[1][:, :, :4].copy(), *args[2:])
    out4, _ = run_mma(four, 0.1)
    np.testing.assert_array_equal(out4, out[:, :, :4])


@pytest.fixture
def fused_merge(monkeypatch):
    """Launches whose kernel merges its own splits, whatever their size."""
    kva = importlib.import_module("ddtree_numba.kernels.verify_attn")

    monkeypatch.setattr(kva, "FUSED_MERGE_ROW_BLOCKS_PER_SM", 0)


def test_mma_fused_merge_gives_the_merge_kernels_bits(fused_merge):
    """The kernel merges its own splits (the last block of a row block to finish): its output
    equals, bit for bit, the merge kernel of ``splits`` run on the partials it left in the
    workspace, whichever block came last; ``arrivals`` is all zeros after every launch, so a
    second launch on the same workspace (as a CUDA graph replays it) gives the same bits.
    Ragged prefixes (several splits, one), a request whose second row block holds only
    padding rows (written by its first split's block), and a row count that is not a
    multiple of the 32-row block."""
    from numba import cuda

    from ddtree_numba.kernels.verify_attn import splits as sp

    rng = np.random.default_rng(21)
    args = list(attn_problem(rng, bs=4, budget=20, H=3, Dc=512, Dr=64, page_size=64,
                             max_prefix=2500, dtype=bfloat16, L=6, Kk=4))
    args[4] = np.array([2500, 0, 700, 1900], np.int32)          # prefix_lens
    args[2], args[3] = paged_cache(rng, 4, args[4], 21, page_size=64, D=576, dtype=bfloat16)
    args[6] = np.array([21, 5, 1, 13], np.int32)    # ragged: request 2 fills 3 of 63 rows
    bs, N, H, Dc = args[0].shape
    workspace = K.allocate_workspace(bs, N, H, Dc, 0, variant="mma")
    results = []
    for _ in range(2):
        out, lse = K.verify_attn(*args, sm_scale=0.2, variant="mma", workspace=workspace)
        results.append((out.copy_to_host(), lse.copy_to_host()))
        assert (workspace[2].copy_to_host() == 0).all()
    part_out, part_lse, _ = workspace
    merged = (cuda.to_device(np.full((bs, N, H, Dc), np.nan, np.float32)),
              cuda.to_device(np.full((bs, N, H), np.nan, np.float32)))
    capacity = args[3].shape[1] * 64
    sp._merge_prefix_kernel[(N * H, bs), 128](part_out, part_lse, cuda.to_device(args[4]),
                                              cuda.to_device(args[6]), capacity, *merged)
    want_out, want_lse = (m.copy_to_host() for m in merged)
    for out, lse in results:
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)
    assert (want_out[2, 1:] == 0).all() and np.isneginf(want_lse[2, 1:]).all()
    check_mma(args, 0.2, bfloat16)


def test_mma_small_and_large_launches_merge_to_the_same_bits(monkeypatch):
    """Where the launch has few row blocks a merge kernel follows the mma kernel; where it has
    many the kernel merges itself: the same bits either way."""
    kva = importlib.import_module("ddtree_numba.kernels.verify_attn")

    rng = np.random.default_rng(12)
    args = attn_problem(rng, bs=2, budget=40, H=8, Dc=512, Dr=64, page_size=64,
                        max_prefix=3000, dtype=bfloat16, L=8, Kk=4)
    results = []
    for per_sm in (0, 10**9):           # always fused, never fused
        monkeypatch.setattr(kva, "FUSED_MERGE_ROW_BLOCKS_PER_SM", per_sm)
        results.append(run_mma(args, 0.1))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_mma_refuses_a_workspace_of_another_shape():
    rng = np.random.default_rng(8)
    args = attn_problem(rng, bs=2, budget=3, H=2, Dc=32, Dr=16, page_size=4, max_prefix=9,
                        dtype=bfloat16)
    tiled = K.allocate_workspace(2, 4, 2, 32, 64)               # the tiled variant's pair
    other = K.allocate_workspace(2, 4, 3, 32, 0, variant="mma")     # another head count
    for workspace in (tiled, other):
        with pytest.raises(ValueError, match="workspace: expected float32"):
            K.verify_attn(*args, sm_scale=0.3, variant="mma", workspace=workspace)


def test_mma_is_the_default_for_16_bit_caches_and_refuses_what_it_cannot_run():
    rng = np.random.default_rng(3)
    args = attn_problem(rng, bs=1, budget=3, H=2, Dc=32, Dr=16, page_size=4, max_prefix=9,
                        dtype=bfloat16)
    from ddtree_numba.kernels.verify_attn import choose_variant

    assert choose_variant(None, "bfloat16", 512, 64) == "mma"
    assert choose_variant(None, "float32", 512, 64) == "tiled"
    assert choose_variant(None, "bfloat16", 8, 4) == "tiled"
    assert choose_variant(None, "bfloat16", 512, 64, N=1057) == "tiled"   # past its merge
    f32 = (*args[:2], args[2].astype(np.float32), *args[3:])
    with pytest.raises(ValueError, match="variant: 'mma' cannot run: it needs a bfloat16"):
        K.verify_attn(*f32, sm_scale=0.3, variant="mma")
