"""Reference ``sampling_probs``: the target's logits turned into the distribution a request
samples from (temperature, then top-k, then top-p), per request.

For request ``b`` with temperature ``T``, ``k = top_k[b]`` and ``p = top_p[b]``, each row of
logits ``x`` (float32, ``V`` values) becomes::

    T < 1e-5:   one-hot at argmax(x), the smallest index on ties (exactly greedy decoding: the
                sampled walk then accepts what greedy verification accepts); 1e-5 is
                ``limits.GREEDY_TEMPERATURE``, vLLM's threshold
    z        = x / T                              float32 division
    top-k    : 0 < k < V keeps the tokens with z >= the k-th largest z (ties at it kept);
               k = 0 or k >= V keeps every token
    w        = exp(z - max z) on the kept tokens, 0 elsewhere
    top-p    : p < 1 keeps, of those, the largest w until their mass reaches p sum(w): the
               tokens with w >= tau, tau the largest value with  sum(w >= tau) >= p sum(w)
               (so ties at tau are kept); p = 1 keeps them all
    probs    = w / sum(w over the kept tokens)     (float32)

The order (temperature, top-k on the scaled logits, top-p on the distribution top-k leaves)
is vLLM's (``apply_top_k_top_p``) and SGLang's (temperature, then FlashInfer's top-k and top-p
renormalisation). Their top-p keeps the tokens whose larger neighbours in sorted order hold
less than ``p`` of the mass: the same set, except that a sort keeps an arbitrary part of a tie
at the threshold where this keeps all of it.

Here ``exp`` and the sums are float64; the kernel (``kernels.sampling_probs``) computes in
float32, so its probabilities agree within a few float32 ulps, and its kept sets agree
except where weights that differ in float64 tie in float32 (logits within ~1e-7 of each other
relative to their size: the kernel keeps the whole tie) or a partial mass lies within float32
rounding of ``p sum(w)``.
"""

from __future__ import annotations

import numpy as np

from ..limits import GREEDY_TEMPERATURE
from ..validation import check_sampling_probs


def sampling_probs(logits, temperature, top_k, top_p) -> np.ndarray:
    """The sampling distribution of every row of ``logits``.

    Parameters
    ----------
    logits : numpy.ndarray
        ``float32[bs, N, V]``: the target's logits after each tree node (finite or ``-inf``).
    temperature : numpy.ndarray
        ``float32[bs]``, ``>= 0``; below 1e-5 greedy.
    top_k : numpy.ndarray
        ``int32[bs]``, ``>= 0``; 0 keeps every token.
    top_p : numpy.ndarray
        ``float32[bs]`` in ``(0, 1]``; 1 keeps every token.

    Returns
    -------
    numpy.ndarray
        ``float32[bs, N, V]``: each row sums to 1.
    """
    sz = check_sampling_probs(logits, temperature, top_k, top_p, check=True)
    out = np.zeros((sz.bs, sz.N, sz.V), np.float32)
    for b in range(sz.bs):
        for i in range(sz.N):
            out[b, i] = _row(logits[b, i], temperature[b], int(top_k[b]), top_p[b])
    return out


def _row(x, T, k, p) -> np.ndarray:
    V = len(x)
    if T < GREEDY_TEMPERATURE:
        row = np.zeros(V, np.float32)
        row[int(np.argmax(x))] = 1                      # np.argmax: first index on ties
        return row
    z = (x / np.float32(T)).astype(np.float32)
    keep = np.ones(V, bool)
    if 0 < k < V:
        kth = np.sort(z)[::-1][k - 1]
        keep = z >= kth
    w = np.where(keep, np.exp(z.astype(np.float64) - float(z.max())), 0.0)
    if p < 1:
        ordered = np.sort(w[keep])[::-1]
        mass = np.cumsum(ordered)
        reach = int(np.searchsorted(mass, float(p) * mass[-1]))   # first prefix with mass >= p
        tau = ordered[min(reach, len(ordered) - 1)]
        keep &= w >= tau
        w = np.where(keep, w, 0.0)
    return (w / w.sum()).astype(np.float32)
