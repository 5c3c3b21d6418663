"""Each kernel of the step's and the toy models' small operations against its numpy twin:
``step.ops`` (argmax, advance), ``models.dense_ops`` (the toy MLA's dense layers) and
``models.toy_drafter`` (the drafter's logits).

The twins run on numpy arrays; the kernels on device arrays (the simulator in CI, the GPU with
``DDTREE_GPU=1``). Float results agree to float32 rounding (different summation orders: the
bound is 1e-5 relative); integer results (embed, argmax, advance) and the drafter's logits
(hashes, then float32 operations in the twin's order, products unfused) exactly.
"""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from ddtree_numba import kernels as K
from ddtree_numba.arrays import host_values
from ddtree_numba.contracts import AcceptResult
from ddtree_numba.kernels import as_device
from ddtree_numba.kernels._primitives import bfloat16_bits
from ddtree_numba.models.dense_ops import HostDenseOps, KernelDenseOps, rope_inv_freq
from ddtree_numba.models.toy_drafter import HostDraftOps, KernelDraftOps
from ddtree_numba.step.ops import HostStepOps, KernelStepOps

#: method -> (numpy twin, kernel) backends
BACKENDS = {
    **dict.fromkeys(("embed", "rms_norm", "linear", "rope", "kv_write", "silu_mul",
                     "linear_batched", "add_routed", "linear_gathered", "add_gathered"),
                   (HostDenseOps, KernelDenseOps)),
    "draft": (HostDraftOps, KernelDraftOps),
    **dict.fromkeys(("argmax", "advance"), (HostStepOps, KernelStepOps)),
}

RTOL = 1e-5


def run_both(method, *args, outputs):
    """Run ``method`` of both backends; ``outputs`` are the indices of the written arguments.

    Returns ``[(want, got), ...]`` per output."""
    host, kernel = BACKENDS[method]
    host_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    getattr(host(), method)(*host_args)
    dev_args = [as_device(a, bf16_as_bits=False) if isinstance(a, np.ndarray) else a
                for a in args]
    getattr(kernel(), method)(*dev_args)
    return [(host_args[i], host_values(dev_args[i])) for i in outputs]


def close(want, got, rtol=RTOL):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, np.abs(want).max()))


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_as_device_copies_a_length_one_axis_of_stride_zero():
    """``w[None]`` has stride 0 on its new axis; numpy calls that contiguous, numba a broadcast
    axis (a non-contiguous array, and a walk over every element to view it): as_device hands
    numba an ordinary copy."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert w[None].strides[0] == 0
    on_device = as_device(w[None])
    assert 0 not in on_device.strides
    assert on_device.is_c_contiguous()
    np.testing.assert_array_equal(on_device.copy_to_host(), w[None])
    one = np.float32([5.0])[None]                       # one element: numba still says "A"
    assert 0 in one.strides and 0 not in as_device(one).strides


def test_embed_zeroes_padding_tokens(rng):
    table = rng.standard_normal((10, 6)).astype(np.float32)
    tokens = np.array([3, -1, 9, 0, -1], np.int32)
    out = np.full((5, 6), np.nan, np.float32)
    [(want, got)] = run_both("embed", tokens, table, out, outputs=[2])
    np.testing.assert_array_equal(got, want)
    assert (got[1] == 0).all() and (got[0] == table[3]).all()


def test_rms_norm(rng):
    x = rng.standard_normal((5, 37)).astype(np.float32)
    w = rng.standard_normal(37).astype(np.float32)
    [(want, got)] = run_both("rms_norm", x, w, np.empty_like(x), 1e-6, outputs=[2])
    close(want, got)
    rms = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-6)
    close(x / rms * w, got)


@pytest.mark.parametrize("groups,residual", [(1, False), (2, True), (3, False)])
def test_linear_grouped_with_residual(rng, groups, residual):
    T, d_in, d_out = 19, 21, 18                     # not multiples of the 16 x 16 tile
    x = rng.standard_normal((T, groups * d_in)).astype(np.float32)
    w = rng.standard_normal((groups, d_in, d_out)).astype(np.float32)
    out = rng.standard_normal((T, groups * d_out)).astype(np.float32)
    args = (x, w, out, out) if residual else (x, w, out)
    [(want, got)] = run_both("linear", *args, outputs=[2])
    close(want, got)
    exact = np.concatenate([x[:, g * d_in:(g + 1) * d_in].astype(np.float64) @ w[g]
                            for g in range(groups)], axis=1)
    close(exact + (out if residual else 0), got)


def test_rope_rotates_pairs_per_head(rng):
    x = rng.standard_normal((4, 3 * 8)).astype(np.float32)     # 3 heads of Dr = 8
    positions = np.array([0, 5, 1000, -1], np.int32)
    inv = rope_inv_freq(8, 10000.0)
    [(want, got)] = run_both("rope", x, positions, inv, outputs=[0])
    close(want, got)
    np.testing.assert_array_equal(got[0], x[0])                 # position 0: identity
    norms = np.linalg.norm(got.reshape(4, 3, 4, 2), axis=-1)    # rotation keeps pair norms
    close(np.linalg.norm(x.reshape(4, 3, 4, 2), axis=-1), norms)


def kv_write_rows(rng, rows, Dc, Dr):
    """Random new rows ``[rows, Dc + Dr]``, a latent norm weight and the RoPE frequencies."""
    return (rng.standard_normal((rows, Dc + Dr)).astype(np.float32),
            rng.standard_normal(Dc).astype(np.float32), rope_inv_freq(Dr, 10000.0))


def test_kv_write_fills_only_valid_nodes_at_their_slots(rng):
    bs, N, Dc, Dr, page = 2, 4, 12, 6, 3
    kv, norm, inv = kv_write_rows(rng, bs * N, Dc, Dr)
    num_nodes = np.array([4, 2], np.int32)
    prefix = np.array([2, 0], np.int32)
    positions = np.array([[2, 3, 3, 4], [0, 1, -1, -1]], np.int32)
    table = np.array([[4, 1, 0], [2, 3, 5]], np.int32)
    cache = np.full((6, page, Dc + Dr), 7.0, np.float32)
    [(want, got)] = run_both("kv_write", kv, norm, inv, positions, num_nodes, prefix, table,
                             cache, 1e-6, outputs=[7])
    close(want, got)
    written = np.zeros(got.shape[:2], bool)
    for b in range(bs):
        for j in range(num_nodes[b]):
            s = prefix[b] + j
            written[table[b, s // page], s % page] = True
    assert (got[~written] == 7.0).all()                          # nothing else touched
    assert not (got[written] == 7.0).all()


def test_silu_mul(rng):
    gate_up = rng.standard_normal((3, 10)).astype(np.float32)
    [(want, got)] = run_both("silu_mul", gate_up, np.empty((3, 5), np.float32), outputs=[1])
    close(want, got)


def test_add_routed_sums_only_the_chosen_experts(rng):
    """``out[t] += sum_e weights[t, e] y[e, t]``; a zero weight adds nothing, not even
    ``0 * inf``."""
    y = rng.standard_normal((4, 6, 7)).astype(np.float32)           # [E, T, D]
    y[2, 3, 1] = np.inf                                              # (2, 3) has weight 0
    weights = rng.standard_normal((6, 4)).astype(np.float32)
    weights[3, 2] = weights[[1, 5]] = 0
    out = rng.standard_normal((6, 7)).astype(np.float32)
    [(want, got)] = run_both("add_routed", y, weights, out.copy(), outputs=[2])
    close(want, got)
    np.testing.assert_array_equal(got[[1, 5]], out[[1, 5]])
    exact = out + np.einsum("te,etd->td", weights.astype(np.float64), np.where(np.isinf(y), 0, y))
    close(exact, got)


@pytest.mark.parametrize("shared", [True, False])
def test_linear_batched_over_experts(rng, shared):
    E, T, d_in, d_out = 3, 19, 21, 18
    x = rng.standard_normal((T, d_in) if shared else (E, T, d_in)).astype(np.float32)
    w = rng.standard_normal((E, d_in, d_out)).astype(np.float32)
    [(want, got)] = run_both("linear_batched", x, w, np.empty((E, T, d_out), np.float32),
                             outputs=[2])
    close(want, got)
    close(np.matmul(x.astype(np.float64), w), got)


def _chosen_experts(rng, T, E, k):
    """``int32[T, k]``: ``k`` distinct experts a token, in increasing order (the router's)."""
    return np.sort(np.array([rng.choice(E, k, replace=False) for _ in range(T)], np.int32),
                   axis=-1)


@pytest.mark.parametrize("per_pair", [False, True])
def test_linear_gathered_reads_each_tokens_chosen_experts(rng, per_pair):
    """Pair ``p = t k + s``: ``x``'s row ``t`` (or ``p``) times expert ``experts[t, s]``."""
    E, T, k, d_in, d_out = 5, 7, 2, 21, 18
    experts = _chosen_experts(rng, T, E, k)
    x = rng.standard_normal((T * k if per_pair else T, d_in)).astype(np.float32)
    w = rng.standard_normal((E, d_in, d_out)).astype(np.float32)
    [(want, got)] = run_both("linear_gathered", x, w, experts,
                             np.full((T * k, d_out), np.nan, np.float32), outputs=[3])
    close(want, got)
    rows = x if per_pair else np.repeat(x, k, axis=0)
    exact = np.stack([rows[p].astype(np.float64) @ w[e] for p, e in
                      enumerate(experts.reshape(-1))])
    close(exact, got)


def test_add_gathered_is_add_routed_over_the_chosen_pairs(rng):
    """The same sums, in the same order, as ``add_routed`` over every expert with the dense
    weights (bit for bit on both backends); a zero weight adds nothing, not even ``0 * inf``."""
    E, T, k, D = 6, 5, 3, 7
    experts = _chosen_experts(rng, T, E, k)
    weights = np.zeros((T, E), np.float32)
    np.put_along_axis(weights, experts, rng.random((T, k)).astype(np.float32) + 0.1, axis=-1)
    weights[2, experts[2, 1]] = 0                            # chosen, but with weight 0
    y_pairs = rng.standard_normal((T * k, D)).astype(np.float32)
    y_pairs[2 * k + 1] = np.inf
    y_dense = np.zeros((E, T, D), np.float32)               # the same outputs, per expert
    for p, e in enumerate(experts.reshape(-1)):
        y_dense[e, p // k] = y_pairs[p]
    out = rng.standard_normal((T, D)).astype(np.float32)
    [(want, got)] = run_both("add_gathered", y_pairs, experts, weights, out.copy(),
                             outputs=[3])
    [(dense_want, dense_got)] = run_both("add_routed", y_dense, weights, out.copy(),
                                         outputs=[2])
    np.testing.assert_array_equal(want, dense_want)
    np.testing.assert_array_equal(got, dense_got)
    assert np.isfinite(got).all()


def test_numba_products_refuse_bfloat16_weights(rng):
    """KernelDenseOps' products read ``w`` as numbers; bfloat16 bits would be read as
    integers: refused by name (the cuBLAS backend takes them)."""
    w = as_device(rng.standard_normal((2, 4, 3)).astype(ml_dtypes.bfloat16).view(np.uint16))
    x = as_device(rng.standard_normal((5, 4)).astype(np.float32))
    ops = KernelDenseOps()
    with pytest.raises(TypeError, match="w: expected float32 weights"):
        ops.linear(x, w[:1], as_device(np.zeros((5, 3), np.float32)))
    with pytest.raises(TypeError, match="w: expected float32 weights"):
        ops.linear_gathered(x, w, as_device(np.zeros((5, 1), np.int32)),
                            as_device(np.zeros((5, 3), np.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.parametrize("groups,residual", [(1, None), (2, "same"), (3, "other")])
def test_cublas_linear_equals_the_twin(rng, weights, groups, residual):
    """The DeepSeek-V3 target's GPU backend: one cuBLAS call per grouped product, float32 or
    bfloat16 weights (the inputs then rounded to bfloat16 on both sides), the residual the
    output buffer itself or another."""
    from ddtree_numba.models.cublas_ops import CublasDenseOps

    T, d_in, d_out = 19, 40, 24
    x = rng.standard_normal((T, groups * d_in)).astype(np.float32)
    w = rng.standard_normal((groups, d_in, d_out)).astype(np.float32)
    if weights == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16).view(np.uint16)
    start = rng.standard_normal((T, groups * d_out)).astype(np.float32)
    extra = rng.standard_normal((T, groups * d_out)).astype(np.float32)
    want = start.copy()
    HostDenseOps().linear(x, w, want, None if residual is None else
                          (want if residual == "same" else extra))
    out = as_device(start)
    res = {None: None, "same": out, "other": as_device(extra)}[residual]
    CublasDenseOps().linear(as_device(x), as_device(w), out, res)
    close(want, out.copy_to_host())


@pytest.mark.gpu
def test_cublas_handle_follows_the_stream_and_is_captured_after_eager_use(rng):
    """One cuBLAS handle on the legacy stream, then on a stream of its own, then captured into
    a CUDA graph on a third, as a step's warm-up then capture does. cublasSetStream resets a
    handle's workspace to cuBLAS's pool; the backend sets its own again at every change of
    stream, so the captured product allocates nothing. Each result equals the twin."""
    import cupy as cp

    from ddtree_numba.models.cublas_ops import CublasDenseOps

    T, d_in, d_out = 19, 40, 24
    x = rng.standard_normal((T, d_in)).astype(np.float32)
    w = rng.standard_normal((1, d_in, d_out)).astype(np.float32)
    want = np.empty((T, d_out), np.float32)
    HostDenseOps().linear(x, w, want)
    ops, dx, dw = CublasDenseOps(), as_device(x), as_device(w)
    outs = [as_device(np.full((T, d_out), np.nan, np.float32)) for _ in range(3)]
    ops.linear(dx, dw, outs[0])                         # the legacy default stream
    own = cuda.stream()
    with K.use_stream(own):
        ops.linear(dx, dw, outs[1])
    own.synchronize()
    capturing = cp.cuda.Stream(non_blocking=True)
    capturing.begin_capture()
    try:
        with K.use_stream(capturing):
            ops.linear(dx, dw, outs[2])
    finally:
        graph = capturing.end_capture()
    graph.launch(capturing)
    capturing.synchronize()
    for out in outs:
        close(want, out.copy_to_host())


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.parametrize("shared", [True, False])
def test_cublas_linear_batched_equals_the_twin(rng, weights, shared):
    """The experts of a MoE layer in one batched cuBLAS call: one input for all (batch stride
    0) or one each."""
    from ddtree_numba.models.cublas_ops import CublasDenseOps

    E, T, d_in, d_out = 5, 19, 40, 24
    x = rng.standard_normal((T, d_in) if shared else (E, T, d_in)).astype(np.float32)
    w = rng.standard_normal((E, d_in, d_out)).astype(np.float32)
    if weights == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16).view(np.uint16)
    want = np.full((E, T, d_out), np.nan, np.float32)
    HostDenseOps().linear_batched(x, w, want)
    out = as_device(np.full((E, T, d_out), np.nan, np.float32))
    CublasDenseOps().linear_batched(as_device(x), as_device(w), out)
    close(want, out.copy_to_host())


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.parametrize("per_pair", [False, True])
def test_cublas_linear_gathered_equals_the_twin(rng, weights, per_pair):
    """Each token's chosen experts in one cublasGemmBatchedEx, the matrix addresses written on
    the device; called twice on one ops object with other experts, as a replayed graph is."""
    from ddtree_numba.models.cublas_ops import CublasDenseOps

    E, T, k, d_in, d_out = 6, 5, 3, 40, 24
    w = rng.standard_normal((E, d_in, d_out)).astype(np.float32)
    if weights == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16).view(np.uint16)
    ops, d_w = CublasDenseOps(), as_device(w)
    for _ in range(2):
        experts = _chosen_experts(rng, T, E, k)
        x = rng.standard_normal((T * k if per_pair else T, d_in)).astype(np.float32)
        want = np.full((T * k, d_out), np.nan, np.float32)
        HostDenseOps().linear_gathered(x, w, experts, want)
        out = as_device(np.full((T * k, d_out), np.nan, np.float32))
        ops.linear_gathered(as_device(x), d_w, as_device(experts), out)
        close(want, out.copy_to_host())


def test_argmax_first_index_on_ties_and_minus_one_on_padding(rng):
    bs, N, V = 2, 3, 300
    logits = rng.standard_normal((bs * N, V)).astype(np.float32)
    logits[0, [17, 250]] = 9.0                                   # a tie: the smaller id wins
    logits[1, :] = -np.inf
    logits[1, 299] = 0.0
    predict = np.full((bs, N), 99, np.int32)
    [(want, got)] = run_both("argmax", logits, np.array([3, 1], np.int32), predict,
                             outputs=[2])
    np.testing.assert_array_equal(got, want)
    assert got[0, 0] == 17 and got[0, 1] == 299 and (got[1, 1:] == -1).all()


def test_argmax_of_rows_wider_than_the_block(rng):
    """Each thread scans several columns (a row of 2 600 is more than twice the GPU's 1 024
    threads): ties inside one thread's columns and across threads keep the smallest id."""
    from ddtree_numba.step.ops import ROW_THREADS

    bs, N, V = 2, 2, 2 * ROW_THREADS + 552
    logits = rng.standard_normal((bs * N, V)).astype(np.float32)
    logits[0, [40, 40 + ROW_THREADS, 40 + 2 * ROW_THREADS]] = 9.0   # one thread's columns
    logits[1, [V - 1, 7 + ROW_THREADS, ROW_THREADS // 2 + 3]] = 9.0  # three threads
    logits[2, :] = 1.0                                               # every column tied
    predict = np.full((bs, N), 99, np.int32)
    [(want, got)] = run_both("argmax", logits, np.array([2, 2], np.int32), predict,
                             outputs=[2])
    np.testing.assert_array_equal(got, want)
    assert got[0, 0] == 40 and got[0, 1] == ROW_THREADS // 2 + 3 and got[1, 0] == 0



@pytest.mark.parametrize("accuracy", [0.0, 0.6, 1.0])
def test_draft_logits_follow_the_continuation(accuracy):
    bs, L, V = 2, 3, 40
    continuation = np.random.default_rng(1).integers(0, V, (bs, 12)).astype(np.int32)
    prefix = np.array([0, 9], np.int32)             # request 1 runs past the continuation
    logits = np.empty((bs, L, V), np.float32)
    [(want, got)] = run_both("draft", continuation, prefix, 5, accuracy, 6.0, 1.0, logits,
                             outputs=[6])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))   # bit for bit
    top = got[0].argmax(-1)
    truth = continuation[0, 1:1 + L]
    if accuracy == 1.0:
        np.testing.assert_array_equal(top, truth)
    if accuracy == 0.0:
        second = np.argsort(-got[0], axis=-1)[:, :2]
        assert ((second == truth[:, None]).any(axis=1)).all()   # the runner-up bonus


def test_draft_logits_equal_the_twin_bit_for_bit_over_many_rows():
    """About one row in ten has a bonus logit whose sum a fused multiply-add would round
    differently from the twin: on a GPU, 32 rows of a vocabulary several blocks wide."""
    bs, L, V = (2, 2, 40) if K.SIMULATOR else (4, 8, 5000)
    rng = np.random.default_rng(3)
    continuation = rng.integers(0, V, (bs, 20)).astype(np.int32)
    prefix = rng.integers(0, 10, bs).astype(np.int32)
    logits = np.empty((bs, L, V), np.float32)
    for noise in (1.3, 0.0):                        # 0: zeros whose sign must agree too
        [(want, got)] = run_both("draft", continuation, prefix, 11, 0.5, 6.0, noise, logits,
                                 outputs=[6])
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_advance_appends_tokens_and_moves_the_state():
    accept = AcceptResult(accept_nodes=np.zeros((2, 4), np.int32),
                          accept_len=np.array([2, 0], np.int32),
                          accept_tokens=np.array([[5, 6, 7, -1], [9, -1, -1, -1]], np.int32),
                          bonus_token=np.array([7, 9], np.int32))
    new_prefix = np.array([13, 4], np.int32)
    prefix, roots = np.array([10, 3], np.int32), np.array([1, 2], np.int32)
    emitted, count = np.full((2, 8), -1, np.int32), np.array([1, 3], np.int32)
    host = [a.copy() for a in (prefix, roots, emitted, count)]
    HostStepOps().advance(accept, new_prefix, *host)
    dev = [cuda.to_device(a) for a in (prefix, roots, emitted, count)]
    dev_accept = AcceptResult(*(cuda.to_device(getattr(accept, f)) for f in
                                ("accept_nodes", "accept_len", "accept_tokens", "bonus_token")))
    KernelStepOps().advance(dev_accept, cuda.to_device(new_prefix), *dev)
    for want, got in zip(host, dev, strict=True):
        np.testing.assert_array_equal(got.copy_to_host(), want)
    np.testing.assert_array_equal(host[0], new_prefix)
    np.testing.assert_array_equal(host[1], [7, 9])
    assert host[2][0, 1:4].tolist() == [5, 6, 7] and host[2][1, 3] == 9
    np.testing.assert_array_equal(host[3], [4, 4])


@pytest.mark.parametrize("dtype, ulp", [(ml_dtypes.bfloat16, 2.0**-7), (np.float16, 2.0**-10)])
def test_kv_write_rounds_each_value_once_to_a_16_bit_cache(rng, dtype, ulp):
    """A bfloat16 or float16 cache gets the float32 row rounded to its type (to nearest): the
    kernel's row and the twin's differ only where their float32 values straddle a rounding
    boundary, by at most one unit in the last place of the 16-bit type."""
    bs, N, Dc, Dr, page = 2, 4, 16, 8, 4
    kv, norm, inv = kv_write_rows(rng, bs * N, Dc, Dr)
    num_nodes = np.array([4, 3], np.int32)
    prefix = np.array([1, 5], np.int32)
    positions = np.array([[1, 2, 2, 3], [5, 6, 7, -1]], np.int32)
    table = np.array([[3, 0, 1], [2, 4, 5]], np.int32)
    cache = np.full((6, page, Dc + Dr), 7.0, dtype)
    [(want, got)] = run_both("kv_write", kv, norm, inv, positions, num_nodes, prefix, table,
                             cache, 1e-6, outputs=[7])
    assert got.dtype == dtype
    want, got = want.astype(np.float64), got.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=ulp, atol=0)
    assert (got == want).mean() > 0.9                     # almost all round identically
    assert (got == 7.0).sum() == (want == 7.0).sum()      # the same slots untouched


def test_bfloat16_bits_rounds_as_ml_dtypes():
    """``_primitives.bfloat16_bits``: to nearest, ties to even, overflow to infinity, NaN kept,
    bit for bit what ``ml_dtypes.bfloat16`` does."""
    specials = np.array([0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38,
                         1e-40, -1e-45, 1.00390625, 1.01171875, 1.0039062, 1.0039063],
                        np.float32)
    ties = (np.arange(64, dtype=np.uint32) << 16 | 0x8000).view(np.float32)   # exact halves
    x = np.concatenate([specials, ties, np.random.default_rng(3).standard_normal(512)
                        .astype(np.float32) * 10.0 ** np.arange(-8, 8).repeat(32)])

    @cuda.jit
    def kernel(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = bfloat16_bits(x[i])

    payload_nans = np.array([0x7FF92C0B, 0xFFF92C0B, 0x7F800001], np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        x = np.concatenate([x, payload_nans])
    out = cuda.to_device(np.zeros(x.size, np.uint16))
    kernel[(x.size + 63) // 64, 64](cuda.to_device(x), out)
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(out.copy_to_host(), want)   # NaNs included, bit for bit
