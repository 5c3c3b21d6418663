"""The sampling distribution (temperature, top-k, top-p): the reference's definition against
an independent transcription of vLLM's sort-based filter, its edges, the kernel against the
reference, and the argument checks."""

import numpy as np
import pytest

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref


def params(bs, T, k, p):
    return (np.full(bs, T, np.float32), np.full(bs, k, np.int32), np.full(bs, p, np.float32))


def vllm_style(x, T, k, p):
    """vLLM's ``apply_top_k_top_p`` in numpy, written from its description: scale, mask below
    the k-th largest, then sort ascending, and mask the tokens whose cumulative probability is
    at most ``1 - p`` (keeping the largest); softmax of what is left. Ties are avoided by the
    inputs (a sort orders them arbitrarily)."""
    z = (x / np.float32(T)).astype(np.float64)
    if 0 < k < len(z):
        z = np.where(z < np.sort(z)[::-1][k - 1], -np.inf, z)
    order = np.argsort(z)
    probs = np.exp(z[order] - z.max())
    probs /= probs.sum()
    mask = np.cumsum(probs) <= 1 - p
    mask[-1] = False
    z[order[mask]] = -np.inf
    out = np.exp(z - z.max())
    return out / out.sum()


@pytest.mark.parametrize("T, k, p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 10, 1.0),
                                     (1.0, 0, 0.9), (0.8, 20, 0.5), (2.0, 3, 0.99)])
def test_reference_equals_vllm_order_and_rules(T, k, p):
    rng = np.random.default_rng(int(T * 10) + k)
    x = (rng.standard_normal((2, 3, 200)) * 2).astype(np.float32)     # no ties
    got = ref.sampling_probs(x, *params(2, T, k, p))
    for b in range(2):
        for i in range(3):
            want = vllm_style(x[b, i], T, k, p)
            np.testing.assert_allclose(got[b, i], want, rtol=1e-5, atol=1e-7)
            assert ((got[b, i] > 0) == (want > 0)).all()


def test_temperature_zero_is_one_hot_at_the_first_maximum():
    x = np.array([[[1, 5, 5, -np.inf], [0, 0, 0, 0]]], np.float32)
    got = ref.sampling_probs(x, *params(1, 0.0, 3, 0.5))
    np.testing.assert_array_equal(got, [[[0, 1, 0, 0], [1, 0, 0, 0]]])


def test_ties_at_the_thresholds_are_kept():
    x = np.array([[[3, 2, 2, 2, 1, -np.inf]]], np.float32)
    kept = ref.sampling_probs(x, *params(1, 1.0, 2, 1.0))[0, 0] > 0
    assert kept.tolist() == [True, True, True, True, False, False]    # k = 2: the tie at 2
    e = np.exp(np.array([3, 2, 2, 2, 1], np.float64) - 3)
    p = float((e[0] + e[1]) / e.sum())                                  # reached inside a tie
    kept = ref.sampling_probs(x, *params(1, 1.0, 0, p))[0, 0] > 0
    assert kept.tolist() == [True, True, True, True, False, False]
    only_top = ref.sampling_probs(x, *params(1, 1.0, 0, 1e-6))[0, 0]
    np.testing.assert_array_equal(only_top, [1, 0, 0, 0, 0, 0])


def test_rows_sum_to_one_and_minus_inf_is_never_sampled():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4, 50)).astype(np.float32)
    x[..., ::7] = -np.inf
    got = ref.sampling_probs(x, np.array([0.5, 1, 3], np.float32), np.array([0, 5, 60], np.int32),
                             np.array([1, 0.7, 0.95], np.float32))
    np.testing.assert_allclose(got.sum(-1), 1, atol=1e-6)
    assert (got[..., ::7] == 0).all()


CASES = [  # (bs, N, V, temperature, top_k, top_p)
    (2, 3, 100, [0.0, 0.7], [0, 5], [1.0, 0.9]),
    (3, 2, 64, [1.0, 1.5, 0.3], [0, 20, 64], [0.5, 1.0, 0.99]),
    (1, 1, 1, [1.0], [1], [0.5]),
    (2, 2, 300, [1.0, 1.0], [1, 299], [1.0, 0.2]),
]


@pytest.mark.parametrize("bs, N, V, T, k, p", CASES)
def test_kernel_matches_reference(bs, N, V, T, k, p):
    """Within float32 rounding (the kernel's exp and sums are float32), the same kept tokens;
    ties and -inf included."""
    rng = np.random.default_rng(V + bs)
    x = (rng.standard_normal((bs, N, V)) * 3).astype(np.float32)
    if V > 20:
        x[0, 0, 3] = -np.inf
        x[-1, -1, :8] = x[-1, -1, 8]                        # a tie of 9 values
    args = (x, np.array(T, np.float32), np.array(k, np.int32), np.array(p, np.float32))
    want = ref.sampling_probs(*args)
    got = K.sampling_probs(*args).copy_to_host()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(got > 0, want > 0)


def test_argument_errors_are_clear():
    x = np.zeros((2, 1, 4), np.float32)
    T, k, p = params(2, 1.0, 0, 1.0)
    for name, bad, match in (
            ("temperature", np.array([1, -1], np.float32), "temperature: expected finite, >= 0"),
            ("temperature", np.array([1, np.nan], np.float32), "temperature: expected finite"),
            ("top_k", np.array([0, -2], np.int32), "top_k: expected >= 0"),
            ("top_p", np.array([0, 1], np.float32), r"top_p: expected in \(0, 1\]"),
            ("top_p", np.array([1.5, 1], np.float32), r"top_p: expected in \(0, 1\]")):
        kw = {"temperature": T, "top_k": k, "top_p": p, name: bad}
        for fn in (ref.sampling_probs, K.sampling_probs):
            with pytest.raises(ValueError, match=match):
                fn(x, **kw)
    nan = x.copy()
    nan[1, 0, 2] = np.nan
    with pytest.raises(ValueError, match=r"logits: expected finite values or -inf, got nan"):
        K.sampling_probs(nan, T, k, p)
    empty = x.copy()
    empty[0, 0] = -np.inf
    with pytest.raises(ValueError, match="at least one finite value per row"):
        ref.sampling_probs(empty, T, k, p)
    with pytest.raises(TypeError, match="top_k: expected int32"):
        ref.sampling_probs(x, T, k.astype(np.int64), p)
    with pytest.raises(ValueError, match="out: expected float32"):
        K.sampling_probs(x, T, k, p, out=K.allocate_probs(2, 1, 5))
    with pytest.raises(TypeError, match="out: expected float32"):
        K.sampling_probs(x, T, k, p, out=np.zeros((2, 1, 4), np.int32))
    with pytest.raises(ValueError, match="temperature: 0.0001 in request 0 makes its "
                                         "logits overflow"):
        big = np.full((2, 1, 4), 3e35, np.float32)
        ref.sampling_probs(big, np.full(2, 1e-4, np.float32), k, p)


def test_temperatures_below_the_greedy_threshold_are_greedy():
    """Below 1e-5 (vLLM's threshold) a row is a one-hot at its argmax: no overflow, no NaN."""
    x = np.array([[[0.5, 2.0, 2.0, -1.0]]], np.float32)
    for T in (0.0, 1e-40, 9.9e-6):
        args = (x, np.array([T], np.float32), np.zeros(1, np.int32), np.ones(1, np.float32))
        np.testing.assert_array_equal(ref.sampling_probs(*args), [[[0, 1, 0, 0]]])
        np.testing.assert_array_equal(K.sampling_probs(*args).copy_to_host(), [[[0, 1, 0, 0]]])
