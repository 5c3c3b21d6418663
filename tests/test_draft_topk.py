"""draft_topk: the reference's rules and the kernel (ids exact, log-probs within a bound)."""

import zlib

import numpy as np
import pytest
from ml_dtypes import bfloat16
from numba import cuda

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref

EPS32 = np.finfo(np.float32).eps


def test_reference_order_ties_and_values():
    x = np.array([[[1.0, 3.0, 3.0, -np.inf, 2.0]]], np.float32)
    lp, ids = ref.draft_topk(x, 5)
    assert ids.tolist() == [[[1, 2, 4, 0, 3]]]                   # ties: smaller id first
    lse = np.log(np.exp([1.0, 3.0, 3.0, 2.0]).sum())
    np.testing.assert_allclose(lp[0, 0, :4], np.array([3, 3, 2, 1]) - lse, rtol=1e-6)
    assert lp[0, 0, 4] == -np.inf
    assert lp.dtype == np.float32 and ids.dtype == np.int32


def test_reference_all_neg_inf_row_and_fewer_finite_than_k():
    x = np.full((1, 2, 6), -np.inf, np.float32)
    x[0, 1, 4] = 0.5
    lp, ids = ref.draft_topk(x, 3)
    assert ids.tolist() == [[[0, 1, 2], [4, 0, 1]]]
    assert np.isneginf(lp[0, 0]).all()
    assert lp[0, 1].tolist() == [0.0, -np.inf, -np.inf]


def error_bound(x_row, lp_ref, V, threads, parts=1, rescale=0.0, tile=0, exp2=False):
    """|kernel - reference| bound: float32 sum-exp error (``parts`` slices of ``V / parts``
    terms, each term's rounding plus, for the one-pass kernel, up to ``tile`` more terms a
    thread (tiles are dealt whole) and about three roundings a rescale, at most ``rescale``
    of them a term; then about three roundings per slice to combine them) + rounding of lse
    and of x - lse. ``exp2``: terms as ``exp2((x - m) log2 e)`` on the hardware's
    approximation (relative error 2**-22 a term, and ``1.1 |x - m| 2**-23`` from rounding the
    argument and log2 e, whose softmax-weighted mean is at most ``1.1 ln V``): ``2 + 1.2 ln V``
    more."""
    finite = np.isfinite(lp_ref)
    lse = np.float64(x_row.max()) + np.log(np.exp(x_row.astype(np.float64) - x_row.max()).sum())
    terms = (V / (parts * threads) + tile) * (1 + 3 * rescale)
    sum_error = (terms + 16 + 3 * (parts - 1) + (2 + 1.2 * np.log(V) if exp2 else 0)) * EPS32
    return sum_error + EPS32 * abs(lse) + EPS32 * np.abs(lp_ref), finite


def check_kernel(x, k, parts=None, variant=None):
    from ddtree_numba.kernels.draft_topk import TOPK_THREADS, default_variant, parts_per_row
    from ddtree_numba.kernels.draft_topk_filtered import FILTER_THREADS, WORDS
    from ddtree_numba.kernels.draft_topk_resident import LOGITS_PER_THREAD, RESIDENT_THREADS

    if parts is None:
        parts = parts_per_row(x.shape[0] * x.shape[1], x.shape[2], k)
    lp, ids = K.draft_topk(x, k, parts=parts, variant=variant)
    if variant is None:                     # the launcher's choice, for the bound below
        host = np.asarray(x)
        bits = host.reshape(-1, host.shape[2]).view(np.uint16 if host.itemsize == 2 else
                                                    np.uint32)
        variant = default_variant(bits, parts, k)
    lp, ids = lp.copy_to_host(), ids.copy_to_host()
    want_lp, want_ids = ref.draft_topk(x, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(np.isneginf(lp), np.isneginf(want_lp))
    x32 = np.asarray(x).astype(np.float32)
    filtered = variant == "filtered"
    threads = {"filtered": FILTER_THREADS, "resident": RESIDENT_THREADS}.get(variant,
                                                                             TOPK_THREADS)
    # a rescale at most once a tile: 2 * WORDS logits a lane (float32 and bfloat16); the
    # resident kernel rescales each thread's sum once (of at most LOGITS_PER_THREAD logits,
    # fewer in a short slice: once per the logits a thread holds)
    per_thread = min(LOGITS_PER_THREAD, max(1.0, x.shape[2] / (parts * RESIDENT_THREADS)))
    rescale = {"filtered": 1 / (2 * WORDS), "resident": 1 / per_thread}.get(variant, 0.0)
    tile = 2 * WORDS if filtered else 0
    for b in range(x.shape[0]):
        for d in range(x.shape[1]):
            if np.isneginf(x32[b, d]).all():
                continue
            bound, finite = error_bound(x32[b, d], want_lp[b, d], x.shape[2], threads,
                                        parts, rescale, tile,
                                        exp2=variant in ("filtered", "resident"))
            err = np.abs(lp[b, d][finite] - want_lp[b, d][finite])
            assert (err <= bound[finite]).all(), (b, d, err.max())


@pytest.mark.parametrize("case", ["random", "ties", "neg_inf", "k1", "k_equals_v", "bf16",
                                  "signed_zeros"])
def test_kernel_matches_reference(case):
    rng = np.random.default_rng(zlib.crc32(case.encode()))   # hash() differs per process
    V, k = 96, 12
    x = rng.standard_normal((2, 2, V)).astype(np.float32)
    if case == "ties":
        x = np.round(x)                                 # many exactly equal logits
    if case == "neg_inf":
        x[0, 0] = -np.inf                               # a row of only -inf
        x[1, 1, 5:] = -np.inf                           # fewer than k finite entries
    if case == "k1":
        k = 1
    if case == "k_equals_v":
        k = V
    if case == "bf16":
        x = x.astype(bfloat16)
    if case == "signed_zeros":
        x[:] = 0.0
        x[..., ::3] = -0.0                              # -0.0 == +0.0: ties by id
    check_kernel(x, k)


@pytest.mark.parametrize("case", ["random", "ties", "neg_inf", "bf16", "k_equals_v"])
# (5 parts only on a GPU: on the simulator each case takes some 6 s of a CI core)
@pytest.mark.parametrize("parts", [2, 8] if K.SIMULATOR else [2, 5, 8])
def test_split_rows_equal_the_reference(case, parts):
    """Rows split over several blocks and merged: ids exact, log-probs within the bound;
    slices shorter than k and an empty last slice (V = 96 in 5 parts: 20 x 4 + 16; in 8:
    12 each)."""
    rng = np.random.default_rng(parts + zlib.crc32(case.encode()))
    V, k = 96, 12
    x = rng.standard_normal((2, 2, V)).astype(np.float32)
    if case == "ties":
        x = np.round(x)
    if case == "neg_inf":
        x[0, 0] = -np.inf
        x[1, 1, 5:] = -np.inf
        x[0, 1, :50] = -np.inf                          # whole slices of -inf
    if case == "bf16":
        x = x.astype(bfloat16)
    if case == "k_equals_v":
        k = V
        from ddtree_numba.kernels.draft_topk import MERGE_CAP

        parts = min(parts, MERGE_CAP // V)
    check_kernel(x, k, parts)


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated shuffles")
def test_kernel_with_its_gpu_scan_and_sort_on_emulated_shuffles(monkeypatch):
    """draft_topk with the block scan and the sort it takes on a GPU (warp shuffles), run on
    the simulator through emulated shuffles: ids exact, log-probs within the bound, whole and
    split rows, sorts within and past the block's length."""
    import importlib

    from simulated_warp import emulated_shuffles

    from ddtree_numba.kernels._primitives import _bitonic_sort_gpu, _warp_shuffle_scan_open

    module = importlib.import_module("ddtree_numba.kernels.draft_topk")   # not the function
    primitives = importlib.import_module("ddtree_numba.kernels._primitives")
    monkeypatch.setattr(module, "block_inclusive_scan_open", _warp_shuffle_scan_open)
    monkeypatch.setattr(primitives, "bitonic_sort_desc", _bitonic_sort_gpu)   # sort_desc_any's
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 96)).astype(np.float32)
    x[0, 1, ::2] = np.round(x[0, 1, ::2])               # ties
    with emulated_shuffles():
        for k, parts in ((12, 1), (40, 1), (12, 3)):      # 40: 64 candidates > 32 threads
            check_kernel(x, k, parts)


def filtered_case(case, rng):
    """``(x, k, parts)`` for the one-pass kernel on the simulator (2 warps of 32 lanes, 128
    candidates a warp, tiles of 128 logits a warp: ``draft_topk_filtered``): 256 logits a
    warp, so every warp compacts at least once."""
    V, k, parts = 512, 40, 1
    x = rng.standard_normal((1, 2, V)).astype(np.float32)
    if case == "k_max":
        k = 64                                          # FILTER_MAX_K on the simulator
    if case == "rising":                                # every tile raises every lane's max:
        x[0, 0] = np.linspace(-30, 30, V)               # a rescale a tile, an insert a tile
    if case == "ties_fall_back":
        # round(N(0, 1)): ~34 logits of 512 are >= 2, so the 40th largest is 1 and has ~120
        # ties, more than top's 128 can take beside the 34: the two-pass fallback
        x = np.round(x)
    if case == "few_ties":
        x[0, 0, ::7] = 0.5                              # 74 equal keys spread over the row
    if case == "neg_inf":
        x[0, 0] = -np.inf                               # all -inf: 256 ties fill each warp
        x[0, 1, 30:] = -np.inf                          # fewer finite than k
    if case == "signed_zeros":
        x[0, 0, ::2] = -0.0
        x[0, 0, 1::2] = 0.0
    if case == "k1":
        k = 1
    if case == "split":
        x = rng.standard_normal((1, 2, 1024)).astype(np.float32)
        parts = 2                                       # 256 logits a warp again
    if case == "wide_span":
        x *= np.float32(1e30)                           # keys spread over many binades
    if case == "guess_rising":
        # 1 024 logits a row: a guess of rank 3 (thread t samples words t and 256 + t);
        # rising, so the guess is word 285's larger logit, about 450 logits reach it, and
        # every warp compacts above it
        x = rng.standard_normal((1, 2, 1024)).astype(np.float32)
        x[0, 0] = np.linspace(-30, 30, 1024)
    if case == "guess_short":
        # lanes 0-2 of each warp sample one large logit each (words 0-2 and 32-34), so the
        # guess is 10 and only 6 logits reach it: fewer than k, the fallback's second read
        x = rng.standard_normal((1, 2, 1024)).astype(np.float32)
        x[0, :, [0, 2, 4, 64, 66, 68]] = 10.0
    return x, k, parts


FILTERED_CASES = ["random", "k_max", "rising", "ties_fall_back", "few_ties", "neg_inf",
                  "signed_zeros", "k1", "split", "wide_span", "guess_rising", "guess_short"]
# with two tiles in flight a warp: the cases that overflow, compact or split (CI's time;
# test_filtered_two_tiles_ahead_filters_every_tile_once checks every tile is filtered once)
TWO_AHEAD_CASES = ["ties_fall_back", "neg_inf", "guess_rising", "split"]


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated warp intrinsics")
@pytest.mark.parametrize("case,guess,ahead", [
    *(pytest.param(case, guess, 1, id=f"{case}-{'guess' if guess else 'no_guess'}")
      for case in FILTERED_CASES for guess in (True, False)),
    *(pytest.param(case, True, 2, id=f"{case}-guess-two_ahead") for case in TWO_AHEAD_CASES)])
def test_filtered_kernel_on_emulated_warp_intrinsics(monkeypatch, case, guess, ahead):
    """The one-pass kernel (ballots, shuffles) through the emulated warp intrinsics: ids
    exact, log-probs within the bound, through compactions, the block's floor, the guessed
    floor (trusted, raised by compactions, or reached by too few logits) and the two-pass
    fallback where ties fill a warp or crowd the final sort. Without the guess, the small
    rows' warps compact (with it, most of them fall back instead). ``two_ahead``: the loop
    with two tiles in flight a warp (bfloat16's on a GPU; the simulator widens bfloat16 to
    float32, so it is float32's here), where a warp's slice may end after either call."""
    from simulated_warp import emulated_shuffles, take_gpu_variant

    import ddtree_numba.kernels.draft_topk_filtered as filtered

    take_gpu_variant(monkeypatch, "ddtree_numba.kernels.draft_topk")
    made = filtered.filtered_kernels
    monkeypatch.setattr(filtered, "filtered_kernels",
                        lambda bf16: made(bf16, guess=guess, ahead_tiles=ahead))
    x, k, parts = filtered_case(case, np.random.default_rng(zlib.crc32(case.encode())))
    with emulated_shuffles():
        check_kernel(x, k, parts, variant="filtered")


def test_filtered_end_select_refines_a_crowded_bin_itself(monkeypatch):
    """The one-pass kernel's end select, level by level, at the simulator's sizes (emulated
    warp intrinsics) and the GPU's. Two rows of -5, but for the guess's sample (the words it
    reads, 0.5 to 0.625, so the guess lies there and no warp compacts), ``TOP_CAP + 22``
    consecutive floats from 1.0 up spread over the rest, and one 1e30. The first level's 2 048
    bins span the held keys from the guess's key to 1e30's, and the bin of the ``k``-th key
    holds the run of consecutive floats: more than ``TOP_CAP``. The second level's bins of 256
    units split it, into one crowded bin on the simulator (128 candidates fit; the third level
    finds the key: seen with a print) and into three on a GPU (512 fit). The two-pass fall-back
    is exact too and would hide a wrong refinement (a short count sends the block there), so
    it is replaced by one that writes nothing: ids exact means the levels found them."""
    import contextlib

    import ddtree_numba.kernels.draft_topk_filtered as filtered

    context = contextlib.nullcontext()
    if K.SIMULATOR:
        from simulated_warp import emulated_shuffles, take_gpu_variant

        take_gpu_variant(monkeypatch, "ddtree_numba.kernels.draft_topk")
        context = emulated_shuffles()

    @cuda.jit(device=True)
    def no_fallback(row, lo, hi, k, tid, T, cand, hist, scratch, result, red_u, red_f,
                    n_cand):
        return filtered.NEG_INF, np.float32(0.0), 0

    monkeypatch.setattr(filtered, "_select_top", lambda bf16: (None, no_fallback))
    whole_row, _ = filtered._make_filtered_kernels(False)   # not the cached kernels
    T, loads = filtered.FILTER_THREADS, filtered.WORDS       # float32: WORDS loads a lane
    V = 1024 if K.SIMULATOR else 32768                       # a guess of rank 4 / 8
    k = filtered.FILTER_MAX_K
    seg = V // 2 // loads                   # the guess reads words u seg + t, t < T
    sampled = np.concatenate([np.arange(2 * u * seg, 2 * (u * seg + T)) for u in range(loads)])
    rest = np.setdiff1d(np.arange(V), np.r_[sampled, 2 * T + 44])
    rng = np.random.default_rng(11)
    x = np.full((2, V), -5.0, np.float32)
    for row in x:
        row[sampled] = 0.5 + rng.permutation(sampled.size) * (0.125 / sampled.size)
        run = filtered.TOP_CAP + 22
        row[rng.choice(rest, run, replace=False)] = 1 + np.arange(run) * 2.0**-23
        row[2 * T + 44] = 1e30
    bits = cuda.to_device(x.view(np.uint32))
    lp, ids = cuda.device_array((2, k), np.float32), cuda.device_array((2, k), np.int32)
    with context:
        whole_row[2, T](bits.view(np.uint64), bits, k, lp, ids)
    np.testing.assert_array_equal(ids.copy_to_host(), ref.draft_topk(x[:, None], k)[1][:, 0])


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated warp intrinsics")
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
def test_filtered_two_tiles_ahead_filters_every_tile_once(monkeypatch, bf16):
    """Two tiles in flight a warp (bfloat16's default; ``filter_tile`` called twice an
    iteration, each call reloading its own buffer two tiles on): every tile of a warp is
    filtered once, in order. Rows whose two warps take 0 to 7 tiles (odd and even counts, a
    row that ends inside a tile; compactions in either call) give the reference's ids and the
    very bits of the log-probs of the loop with one tile in flight. Without the guess (whose
    sample falls short on rows this small) and with the two-pass fall-back replaced by one
    that writes nothing: it is exact, and a tile skipped or read twice sends a block there."""
    from simulated_warp import emulated_shuffles

    import ddtree_numba.kernels.draft_topk_filtered as filtered

    @cuda.jit(device=True)
    def no_fallback(row, lo, hi, k, tid, T, cand, hist, scratch, result, red_u, red_f,
                    n_cand):
        return filtered.NEG_INF, np.float32(0.0), 0

    monkeypatch.setattr(filtered, "_select_top", lambda bf16: (None, no_fallback))
    k, T = 16, filtered.FILTER_THREADS
    rng = np.random.default_rng(21)
    for V in (128, 384, 900, 1792):         # tiles of 128 logits: 1, 3, 7 (+4 logits), 14
        x = (rng.standard_normal((2, 1, V)) * 3).astype(bfloat16 if bf16 else np.float32)
        x[1, 0, : V // 2] = np.sort(x[1, 0, : V // 2])  # a rising half: compactions
        bits = x.reshape(2, V).view(np.uint16 if bf16 else np.uint32)
        got = []
        for ahead in (1, 2):
            whole_row, _ = filtered._make_filtered_kernels(bf16, guess=False, ahead_tiles=ahead)
            lp, ids = np.zeros((2, k), np.float32), np.zeros((2, k), np.int32)
            with emulated_shuffles():
                whole_row[2, T](bits.view(np.uint64), bits, k, lp, ids)
            got.append((lp, ids))
        np.testing.assert_array_equal(got[1][1], ref.draft_topk(x, k)[1][:, 0], err_msg=f"{V}")
        np.testing.assert_array_equal(got[1][1], got[0][1])
        np.testing.assert_array_equal(got[1][0].view(np.uint32), got[0][0].view(np.uint32))


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated warp intrinsics")
def test_filtered_bfloat16_kernel_on_emulated_warp_intrinsics():
    """The bfloat16 one-pass kernel itself (``draft_topk`` widens bfloat16 to float32 on the
    simulator, so it is launched here by hand on the bits): four logits a word, half the loads
    a tile, bfloat16's many ties; ids exact, log-probs within the bound."""
    from simulated_warp import emulated_shuffles

    from ddtree_numba.kernels.draft_topk_filtered import FILTER_THREADS, WORDS, filtered_kernels

    rng = np.random.default_rng(16)
    x = (rng.standard_normal((2, 1, 1024)) * 3).astype(bfloat16)
    x[1, 0, ::5] = x[1, 0, 7]                           # a run of equal keys in row 1
    k = 40
    bits = x.reshape(2, 1024).view(np.uint16)
    lp, ids = np.zeros((2, k), np.float32), np.zeros((2, k), np.int32)
    whole_row, _ = filtered_kernels(True)               # two tiles in flight a warp
    with emulated_shuffles():
        whole_row[2, FILTER_THREADS](bits.view(np.uint64), bits, k, lp, ids)
    want_lp, want_ids = ref.draft_topk(x, k)
    np.testing.assert_array_equal(ids, want_ids[:, 0])
    # one tile in flight: a warp filters the same tiles in the same order, so the same bits
    lp1, ids1 = np.zeros((2, k), np.float32), np.zeros((2, k), np.int32)
    one_ahead, _ = filtered_kernels(True, ahead_tiles=1)
    with emulated_shuffles():
        one_ahead[2, FILTER_THREADS](bits.view(np.uint64), bits, k, lp1, ids1)
    np.testing.assert_array_equal(ids1, ids)
    np.testing.assert_array_equal(lp1.view(np.uint32), lp.view(np.uint32))
    x32 = x.astype(np.float32)
    for b in range(2):
        bound, _ = error_bound(x32[b, 0], want_lp[b, 0], 1024, FILTER_THREADS,
                               rescale=1 / (2 * WORDS), tile=2 * WORDS, exp2=True)
        assert (np.abs(lp[b] - want_lp[b, 0]) <= bound).all()


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated warp intrinsics")
def test_filtered_kernel_writes_real_ids_for_unchecked_nan(monkeypatch):
    """NaN is outside the contract, but an unchecked call must still write ids of the row:
    the filter holds NaNs rather than dropping them, so a row of mostly NaN still has kk held
    candidates (here 500 of 512 logits NaN, k = 40)."""
    from simulated_warp import emulated_shuffles, take_gpu_variant

    take_gpu_variant(monkeypatch, "ddtree_numba.kernels.draft_topk")
    x = np.random.default_rng(8).standard_normal((1, 1, 512)).astype(np.float32)
    x[0, 0, :500] = np.nan
    with emulated_shuffles():
        _, ids = K.draft_topk(x, 40, check=False, variant="filtered")
    ids = ids.copy_to_host()[0, 0]
    assert ((0 <= ids) & (ids < 512)).all() and len(set(ids.tolist())) == 40
    # negative NaNs (bits 0xFFC00000, keys below -inf's) fill warp 0's first tile. They pass
    # the guessed floor's filter, so the warp's held set fills and it compacts, but its
    # histogram counts from the guess up, finds fewer than k keys and shares the guess as
    # floor_b[0]: the end must count the held keys at or above it, not trust that floor
    # (when it did, the final select ran over 28 keys for 40 and what it wrote depended on
    # what shared memory held before: in one simulator run 12 ids came out -1)
    x = np.random.default_rng(1).standard_normal((2, 512)).astype(np.float32)[1:][None]
    x[0, 0, :128] = -np.float32(np.nan)
    with emulated_shuffles():
        _, ids = K.draft_topk(x, 40, check=False, variant="filtered")
    finite = np.where(np.isnan(x), -np.inf, x)          # the NaNs rank below every logit
    np.testing.assert_array_equal(ids.copy_to_host(), ref.draft_topk(finite, 40)[1])


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated warp intrinsics")
@pytest.mark.parametrize("case", ["ties_at_the_cut", "nan_in_a_low_tile", "nan_among_neg_inf"])
def test_filtered_cheap_exit_keeps_every_tile_that_can_pass(monkeypatch, case):
    """The one-pass kernel's cheap exit (no lane's tile max reaches the cut) must not skip a
    tile whose max *equals* the cut (its ties can be among the best k), nor one whose only
    passing logit is a NaN (the max skips NaNs; the filter holds them, outside the contract),
    whether the lane's running max is finite (then its sum is NaN) or still -inf."""
    from simulated_warp import emulated_shuffles, take_gpu_variant

    take_gpu_variant(monkeypatch, "ddtree_numba.kernels.draft_topk")
    if case == "ties_at_the_cut":
        # 128 ones (every 8th logit) and -5 elsewhere: the guess is 1.0, the cut is exactly
        # each tile's max; 2.0s in tiles 5-7 let 52 logits in, so nothing falls back,
        # so a skipped tile would lose the lowest-id ones, which the best 40 are made of
        x = np.full((1, 1, 1024), -5.0, np.float32)
        x[0, 0, ::8] = 1.0
        x[0, 0, [650, 800, 900, 1000]] = 2.0                # tiles 5, 6, 7 (128 logits a tile)
        with emulated_shuffles():
            _, ids = K.draft_topk(x, 40, variant="filtered")
        np.testing.assert_array_equal(ids.copy_to_host(), ref.draft_topk(x, 40)[1])
    else:
        # the first tile (logits 0-127) all far below the guess (or -inf) but for one NaN:
        # the NaN's key is the row's largest, so the held set, and the first id written,
        # must have it
        x = np.random.default_rng(3).standard_normal((1, 1, 1024)).astype(np.float32)
        x[0, 0, :128] = -10.0 if case == "nan_in_a_low_tile" else -np.inf
        x[0, 0, 3] = np.nan
        with emulated_shuffles():
            _, ids = K.draft_topk(x, 40, check=False, variant="filtered")
        ids = ids.copy_to_host()[0, 0]
        assert ids[0] == 3 and ((0 <= ids) & (ids < 1024)).all() and len(set(ids)) == 40


def test_filtered_variant_refuses_what_it_cannot_take(monkeypatch):
    from simulated_warp import take_gpu_variant

    take_gpu_variant(monkeypatch, "ddtree_numba.kernels.draft_topk")
    x = np.zeros((1, 2, 97), np.float32)                # odd V: not whole 8-byte words
    with pytest.raises(ValueError, match="variant: 'filtered'.*V=97"):
        K.draft_topk(x, 4, variant="filtered")
    from ddtree_numba.kernels.draft_topk_filtered import FILTER_MAX_K

    with pytest.raises(ValueError, match=f"variant: 'filtered' takes k <= {FILTER_MAX_K}.*k=300"):
        K.draft_topk(np.zeros((1, 1, 1024), np.float32), 300, variant="filtered")


def resident_case(case, rng):
    """``(x, k, parts)`` for the resident kernel. On the simulator a block is 64 threads of 8
    logits (slices of at most 512, at most 64 candidates sorted, k <= 32); on a GPU 512
    threads of 48 (24 576, 512, k <= 256): sizes scale with ``SLICE_CAP``."""
    from ddtree_numba.kernels.draft_topk_resident import RESIDENT_MAX_K, SLICE_CAP

    V, k, parts = SLICE_CAP, RESIDENT_MAX_K, 1
    x = rng.standard_normal((1, 2, V)).astype(np.float32)
    if case == "split":                                 # 3 slices; the merge pads to 4 lists
        V, k, parts = 2 * SLICE_CAP + 100, 12, 3        # of 16 (k rounded up)
        x = rng.standard_normal((1, 2, V)).astype(np.float32)
    if case == "empty_slice":                           # 20 words in 6 parts of 4: the last
        V, k, parts = 40, 6, 6                          # slice is empty
        x = rng.standard_normal((1, 2, V)).astype(np.float32)
    if case == "no_floor":                              # 20 words: a warp with fewer than
        V, k = 40, 30                                   # j = k / warps threads holding
                                                        # logits, no floor
        x = rng.standard_normal((1, 2, V)).astype(np.float32)
    if case == "ties_fall_back":                        # one key SLICE_CAP times: more ties
        x[0, 0] = 0.0                                   # than CAND_CAP at 32 bits, the
        x[0, 1, ::3] = 0.0                              # two-pass select on the slice
    if case == "refine":
        # lanes 0-11 of every warp hold a cluster (keys within 2**17 of each other), the
        # other lanes smaller logits: with fewer cluster lanes a warp than j = k / warps, the
        # floor is a small lane's max and the whole cluster passes it, more than CAND_CAP.
        # One logit far above the cluster: the first round's bins are 2**24 keys wide and the
        # cluster sits in one of them; it is histogrammed again with 2**16-wide bins (and on a
        # GPU, with more keys, again with 2**8)
        x = (0.5 * rng.random((1, 2, V))).astype(np.float32)
        cluster = (np.arange(V) // 2) % 32 < 12         # lane of logit i: (word i // 2) % 32
        x[:, :, cluster] = 1.0 + rng.random((1, 2, int(cluster.sum()))) * 1e-2
        x[0, :, 7] = 1e30
    if case == "direct":                                # lanes' maxima close together: the
        x = rng.random((1, 2, V)).astype(np.float32)    # keys >= the floor fit CAND_CAP
    if case == "neg_inf":
        x[0, 0] = -np.inf                               # all -inf: ties, the fallback
        x[0, 1, 20:] = -np.inf                          # fewer finite than k
    if case == "signed_zeros":
        x[0, 0, ::2] = -0.0
        x[0, 0, 1::2] = 0.0
    if case == "k1":
        k = 1
    if case == "sorted":                                # a falling row: the floor is exact
        x[0, 0] = np.sort(x[0, 0])[::-1]
    if case == "wide_span":
        x *= np.float32(1e30)
    return x, k, parts


@pytest.mark.parametrize("case", ["random", "direct", "split", "empty_slice", "no_floor",
                                  "ties_fall_back", "refine", "neg_inf", "signed_zeros", "k1",
                                  "sorted", "wide_span"])
def test_resident_kernel_matches_reference(case):
    """The resident kernel (runs on the simulator as it is): ids exact, log-probs within the
    bound, whole rows and slices merged, through the floor, refinement rounds and the
    two-pass fallback."""
    x, k, parts = resident_case(case, np.random.default_rng(zlib.crc32(case.encode())))
    check_kernel(x, k, parts, variant="resident")


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated shuffles")
@pytest.mark.parametrize("case", ["random", "split", "ties_fall_back", "refine"])
def test_resident_kernel_with_its_gpu_reductions_on_emulated_shuffles(monkeypatch, case):
    """The resident kernel with what it takes on a GPU (warp-shuffle reductions, scan and
    sort) on the simulator's emulated shuffles: ids exact, log-probs within the bound."""
    import importlib

    from simulated_warp import emulated_shuffles

    primitives = importlib.import_module("ddtree_numba.kernels._primitives")
    resident = importlib.import_module("ddtree_numba.kernels.draft_topk_resident")
    topk = importlib.import_module("ddtree_numba.kernels.draft_topk")
    monkeypatch.setattr(resident, "block_max_u32", primitives._block_max_u32_by_warps)
    monkeypatch.setattr(resident, "block_sum_f32", primitives._block_sum_f32_by_warps)
    monkeypatch.setattr(topk, "block_inclusive_scan_open", primitives._warp_shuffle_scan_open)
    monkeypatch.setattr(resident, "block_inclusive_scan_open", primitives._warp_shuffle_scan_open)
    monkeypatch.setattr(primitives, "bitonic_sort_desc", primitives._bitonic_sort_gpu)
    x, k, parts = resident_case(case, np.random.default_rng(zlib.crc32(case.encode())))
    with emulated_shuffles():
        check_kernel(x, k, parts, variant="resident")


def test_resident_kernel_writes_real_ids_for_unchecked_nan():
    """NaN is outside the contract, but an unchecked call must stay in bounds and write ids of
    the row. Quiet NaNs are the top keys (many ties: the two-pass fallback). NaNs of bits
    0xFFFFFFFF get key 0, which the kernel reads as "no logit": threads that hold only those
    take the floor away, the search finds fewer keys in range than k and the slice takes the
    two-pass select, which ranks them last: the 12 real logits, then NaN ids in id order."""
    from ddtree_numba.kernels.draft_topk_resident import RESIDENT_MAX_K, SLICE_CAP

    x = np.random.default_rng(8).standard_normal((1, 2, SLICE_CAP)).astype(np.float32)
    x[0, 0, : SLICE_CAP - 12] = np.nan
    x[0, 1].view(np.uint32)[: SLICE_CAP - 12] = 0xFFFFFFFF
    _, ids = K.draft_topk(x, RESIDENT_MAX_K, check=False, variant="resident")
    ids = ids.copy_to_host()[0]
    assert ((0 <= ids) & (ids < SLICE_CAP)).all()
    assert len(set(ids[0].tolist())) == RESIDENT_MAX_K
    assert sorted(ids[1, :12].tolist()) == list(range(SLICE_CAP - 12, SLICE_CAP))
    assert ids[1, 12:].tolist() == list(range(RESIDENT_MAX_K - 12))


def test_resident_scratch_counts_return_to_zero():
    """The count of finished parts wraps to 0 in every row, so the same scratch serves the
    next call (and every replay of a captured graph) with the same result."""
    from ddtree_numba.kernels.draft_topk import allocate_topk_scratch
    from ddtree_numba.kernels.draft_topk_resident import SLICE_CAP

    x = np.random.default_rng(9).standard_normal((1, 3, 3 * SLICE_CAP)).astype(np.float32)
    scratch = allocate_topk_scratch(1, 3, x.shape[2], 12, parts=3)
    want = ref.draft_topk(x, 12)[1]
    for _ in range(2):
        _, ids = K.draft_topk(x, 12, parts=3, scratch=scratch, variant="resident")
        np.testing.assert_array_equal(ids.copy_to_host(), want)
        assert (scratch[3].copy_to_host() == 0).all()


def test_resident_bfloat16_kernel():
    """The bfloat16 resident kernel itself (``draft_topk`` widens bfloat16 on the simulator,
    so it is launched by hand on the bits): four logits a word; ids exact, log-probs within
    the bound."""
    from ddtree_numba.kernels.draft_topk_resident import (
        LOGITS_PER_THREAD,
        RESIDENT_THREADS,
        SLICE_CAP,
        resident_kernels,
    )

    rng = np.random.default_rng(17)
    V, k = SLICE_CAP, 20
    x = (rng.standard_normal((2, 1, V)) * 3).astype(bfloat16)
    x[1, 0, ::5] = x[1, 0, 7]                           # a run of equal keys in row 1
    bits = x.reshape(2, V).view(np.uint16)
    lp, ids = np.zeros((2, k), np.float32), np.zeros((2, k), np.int32)
    whole_row, _ = resident_kernels(True)
    whole_row[2, RESIDENT_THREADS](bits.view(np.uint64), bits, k, lp, ids)
    want_lp, want_ids = ref.draft_topk(x, k)
    np.testing.assert_array_equal(ids, want_ids[:, 0])
    x32 = x.astype(np.float32)
    for b in range(2):
        bound, _ = error_bound(x32[b, 0], want_lp[b, 0], V, RESIDENT_THREADS,
                               rescale=1 / LOGITS_PER_THREAD, exp2=True)   # a thread's rescale
        assert (np.abs(lp[b] - want_lp[b, 0]) <= bound).all()


def test_kernel_refuses_outputs_it_would_write_past():
    """``out`` of another shape, dtype or kind is refused before any launch, naming it (the
    kernels write ``k`` entries a row without bounds checks)."""
    from numba import cuda

    x = np.random.default_rng(4).standard_normal((2, 3, 64)).astype(np.float32)
    lp = cuda.device_array((2, 3, 8), np.float32)
    ids = cuda.device_array((2, 3, 8), np.int32)
    with pytest.raises(ValueError, match=r"out\[0\]: expected float32\[bs=2, L=3, k=8\]"):
        K.draft_topk(x, 8, out=(cuda.device_array((2, 3, 4), np.float32), ids))
    with pytest.raises(TypeError, match=r"out\[1\]: expected int32"):
        K.draft_topk(x, 8, out=(lp, cuda.device_array((2, 3, 8), np.int64)))
    with pytest.raises(TypeError, match="out: expected a tuple"):
        K.draft_topk(x, 8, out=[lp, ids])
    got_lp, got_ids = K.draft_topk(x, 8, out=(lp, ids))     # the right buffers are filled
    assert got_lp is lp and got_ids is ids
    np.testing.assert_array_equal(ids.copy_to_host(), ref.draft_topk(x, 8)[1])


def test_resident_variant_refuses_what_it_cannot_take():
    from ddtree_numba.kernels.draft_topk_resident import RESIDENT_MAX_K, SLICE_CAP

    with pytest.raises(ValueError, match="variant: 'resident'.*V=97"):
        K.draft_topk(np.zeros((1, 2, 97), np.float32), 4, variant="resident")
    with pytest.raises(ValueError, match=f"variant: 'resident' takes k <= {RESIDENT_MAX_K}"):
        K.draft_topk(np.zeros((1, 1, 4 * RESIDENT_MAX_K), np.float32), RESIDENT_MAX_K + 1,
                     variant="resident")
    x = np.zeros((1, 1, 2 * SLICE_CAP), np.float32)     # one block cannot hold the row
    with pytest.raises(ValueError, match="parts >= 2.*parts=1"):
        K.draft_topk(x, 4, parts=1, variant="resident")


def test_the_default_takes_the_resident_kernel_where_its_blocks_fit_one_wave(monkeypatch):
    """``resident_pays`` on a GPU of 132 SMs: bs 1 (15 rows) at V 163 840 takes 105 blocks;
    bs 8 (120 rows) would take 840; rows that fit one block, k above the kernel's limit and V
    not whole words of bfloat16 do not qualify. ``resident_parts`` rounds the fewest parts up
    to a power of two within the SMs."""
    import importlib

    module = importlib.import_module("ddtree_numba.kernels.draft_topk")
    resident = importlib.import_module("ddtree_numba.kernels.draft_topk_resident")
    monkeypatch.setattr(module, "SIMULATOR", False)
    monkeypatch.setattr(module, "sm_count", lambda: 132)
    monkeypatch.setattr(resident, "SLICE_CAP", 24576)
    monkeypatch.setattr(resident, "RESIDENT_MAX_K", 256)
    assert module.resident_pays(15, 163840, 256)
    assert module.resident_parts(15, 163840, 256) == 8          # 7 needed, 8 fit 132 SMs
    assert module.resident_parts(15, 4096, 256) == 1            # the row fits one block,
    assert not module.resident_pays(15, 4096, 256)              # where the two-pass wins
    assert not module.resident_pays(120, 163840, 256)           # bs 8: two waves and more
    assert not module.resident_pays(15, 163840, 257)
    assert not module.resident_pays(15, 163842, 16)             # whole float32 words only
    assert module.parts_per_row(15, 163840, 256) == 8
    assert module.parts_per_row(15, 163840, 256, "two_pass") == 4      # its own rule
    assert module.parts_per_row(120, 163840, 256, "resident") == 7     # asked for: it holds


def test_split_row_with_an_empty_slice():
    """V = 9 in 4 parts of 3: the fourth slice is empty and contributes nothing."""
    x = np.random.default_rng(3).standard_normal((1, 2, 9)).astype(np.float32)
    check_kernel(x, 4, parts=4)
    check_kernel(x, 9, parts=4)                         # k = V: every slice shorter than k


def test_split_scratch_and_parts_are_checked():
    from ddtree_numba.kernels.draft_topk import allocate_topk_scratch

    x = np.zeros((1, 2, 96), np.float32)
    with pytest.raises(ValueError, match="parts"):
        K.draft_topk(x, 12, parts=0)
    with pytest.raises(ValueError, match="parts"):
        K.draft_topk(x, 12, parts=97)                   # more parts than logits
    with pytest.raises(ValueError, match="scratch"):
        K.draft_topk(x, 12, parts=3, scratch=allocate_topk_scratch(1, 2, 96, 12, parts=2))
    scratch = allocate_topk_scratch(1, 2, 96, 12, parts=3)
    lp, ids = K.draft_topk(x, 12, parts=3, scratch=scratch)
    np.testing.assert_array_equal(ids.copy_to_host(), ref.draft_topk(x, 12)[1])
    assert allocate_topk_scratch(1, 2, 96, 12, parts=1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("V, k", [(32000, 16), (32000, 256), (163840, 1024), (163840, 256),
                                  (5000, 1024), (1500, 1024)])
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
@pytest.mark.parametrize("variant", ["two_pass", "filtered", "resident"])
def test_kernel_real_sizes(V, k, dtype, variant):
    if variant in ("filtered", "resident") and k > 256:
        pytest.skip("the one-pass and resident kernels take k <= 256")
    rng = np.random.default_rng(V + k)
    x = (rng.standard_normal((3, 5, V)) * 3).astype(dtype)
    x[0, 0] = np.round(x[0, 0].astype(np.float32))     # massive ties: refinement levels
    x[1, 2, 100:] = -np.inf                             # fewer finite than k
    x[2, 4] = -np.inf                                   # all -inf: the ordered-ties path
    check_kernel(x, k, variant=variant)


def test_the_default_takes_the_one_pass_kernel_where_it_was_measured_faster():
    """``filtered_pays``: whole rows a block and at least 512 logits a row per kept one, for
    float32 and bfloat16 alike (the simulator always takes the two-pass kernel, so the rule
    itself is what CI can check)."""
    from ddtree_numba.kernels.draft_topk import FILTER_MIN_V_PER_K, filtered_pays

    assert filtered_pays(1, 163840, 256)
    assert not filtered_pays(4, 163840, 256)                    # split rows (bs 1)
    assert not filtered_pays(1, 32000, 256)                     # V / k = 125
    assert filtered_pays(1, FILTER_MIN_V_PER_K * 16, 16)
    assert not filtered_pays(1, FILTER_MIN_V_PER_K * 16 - 1, 16)


MERGE_CASES = [(1, 1), (3, 1), (2, 5), (8, 16), (2, 33), (5, 128), (2, 256), (8, 256), (64, 16)]


@pytest.mark.parametrize("parts, k", MERGE_CASES)
def test_merge_of_the_parts_sorted_lists(parts, k):
    """``merge_parts`` alone (the merge kernel): the best ``k`` of the parts' lists, ties of
    key broken by id, and the row's log-sum-exp from the parts' ``(max, sum)``; lists shorter
    than ``k`` (padded with key 0) and parts whose max is -inf. Rounds whose steps wait for a
    warp only (``k <= 64``) and for the block (``k >= 128``), and 64 parts (two a lane in the
    log-sum-exp)."""
    check_merge(parts, k)


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated shuffles")
@pytest.mark.parametrize("parts, k", MERGE_CASES)
def test_merge_with_its_gpu_rounds_on_emulated_shuffles(monkeypatch, parts, k):
    """The GPU's merge (strides of 32 and less in registers and shuffles, the pairing in them
    for lists of up to 64; the log-sum-exp by one warp's shuffles) on the simulator."""
    import importlib

    from simulated_warp import emulated_shuffles

    module = importlib.import_module("ddtree_numba.kernels.draft_topk")   # not the function
    monkeypatch.setattr(module, "_merge_round", module._merge_round_in_registers)
    monkeypatch.setattr(module, "_row_lse", module._row_lse_by_warp)
    with emulated_shuffles():
        check_merge(parts, k)


def check_merge(parts, k):
    from numba import cuda

    from ddtree_numba.kernels.draft_topk import TOPK_THREADS, _merge_kernel
    from ddtree_numba.reference.build_tree_threshold import score_keys  # the kernels' keys

    rng = np.random.default_rng(parts * 1000 + k)
    rows = 2
    part_keys = np.zeros((rows, parts, k), np.uint64)
    part_max = np.full((rows, parts), -np.inf, np.float32)
    part_sum = np.zeros((rows, parts), np.float32)
    want_ids, want_x = [], []
    for row in range(rows):
        ids = rng.permutation(100_000)[: parts * k].astype(np.int64)
        x = np.round(rng.standard_normal(parts * k) * 2, 1).astype(np.float32)  # key ties
        keep = rng.random(parts * k) < 0.8                     # shorter lists, some empty
        keep[: k] = True                                       # at least k keys in the row
        rng.shuffle(keep)
        packed = (score_keys(x).astype(np.uint64) << np.uint64(32)) | (
            np.uint64(0xFFFFFFFF) - ids.astype(np.uint64))
        for p in range(parts):
            mine = np.arange(p * k, (p + 1) * k)[keep[p * k:(p + 1) * k]]
            if mine.size:
                part_keys[row, p, : mine.size] = np.sort(packed[mine])[::-1]
                part_max[row, p] = x[mine].max()
                part_sum[row, p] = np.exp(x[mine] - x[mine].max()).sum()
        best = np.sort(packed[keep])[::-1][:k]
        want_ids.append((np.uint64(0xFFFFFFFF) - (best & np.uint64(0xFFFFFFFF))).astype(np.int64))
        finite = part_max[row] > -np.inf
        top = part_max[row].max()
        lse = top + np.log((part_sum[row][finite] * np.exp(part_max[row][finite] - top)).sum())
        x_of_id = dict(zip(ids.tolist(), x.tolist(), strict=True))
        want_x.append(np.array([x_of_id[i] for i in want_ids[-1].tolist()]) - lse)
    lp = cuda.device_array((rows, k), np.float32)
    out_ids = cuda.device_array((rows, k), np.int32)
    _merge_kernel[rows, TOPK_THREADS](cuda.to_device(part_keys), cuda.to_device(part_max),
                                      cuda.to_device(part_sum), k, lp, out_ids)
    np.testing.assert_array_equal(out_ids.copy_to_host(), np.array(want_ids))
    np.testing.assert_allclose(lp.copy_to_host(), np.array(want_x), rtol=0, atol=1e-5)
