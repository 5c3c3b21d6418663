"""Reference ``draft_topk``: per-depth log-softmax top-K of the block drafter's logits.

Math, for every request ``b`` and depth row ``d`` (``x = logits[b, d]``, length ``V``)::

    m   = max_v x[v]
    lse = m + log(sum_v exp(x[v] - m))          # float64 here
    top = the K largest x[v], in descending order of x, equal x by smaller v
    top_log_probs[b, d, r] = float32(x[top[r]] - lse)
    top_token_ids[b, d, r] = top[r]

The *order* is defined on the logits themselves, not on the rounded log-probs: log-softmax is
monotone, so the values come out non-increasing, and two different logits that round to the same
float32 log-prob keep the order of their logits. This makes the ids exactly reproducible by a
kernel whose log-sum-exp differs from this one in the last bits.

Edge rules: ``-inf`` logits give ``-inf`` log-probs (when fewer than K entries are finite the
rest of the row is ``-inf`` with ids ascending); a row of only ``-inf`` gives all ``-inf``
and ids ``0..K-1``. NaN and ``+inf`` logits are errors.
"""

from __future__ import annotations

import numpy as np

from ..validation import check_draft_topk


def log_softmax_f64(x: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis in float64; a row of only ``-inf`` stays ``-inf``."""
    x = x.astype(np.float64)                                    # [..., V]
    m = x.max(axis=-1, keepdims=True)                           # [..., 1]
    m_safe = np.where(np.isfinite(m), m, 0.0)                   # all -inf row: shift by 0
    with np.errstate(divide="ignore"):
        lse = m_safe + np.log(np.exp(x - m_safe).sum(axis=-1, keepdims=True))  # [..., 1]
    out = x - np.where(np.isfinite(lse), lse, 0.0)              # [..., V]
    return np.where(np.isneginf(x), -np.inf, out)


def draft_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` log-softmax values and token ids of each ``[b, d, :]`` row.

    Parameters
    ----------
    logits : numpy.ndarray
        ``float32|bfloat16[bs, L, V]``: the drafter's logits for the ``L`` draft positions.
    k : int
        Tokens kept per depth, ``1 <= k <= V``.

    Returns
    -------
    tuple of numpy.ndarray
        ``top_log_probs`` ``float32[bs, L, k]`` sorted descending and ``top_token_ids``
        ``int32[bs, L, k]``.
    """
    sizes = check_draft_topk(logits, k, check=True)
    x = np.asarray(logits).astype(np.float32)                   # [bs, L, V] exact for bf16
    # np.lexsort sorts by its last key first: primary -x (descending logit), then id ascending.
    ids = np.broadcast_to(np.arange(sizes.V), x.shape)          # [bs, L, V]
    order = np.lexsort((ids, -x), axis=-1)[..., : sizes.k]      # [bs, L, k]
    logp = log_softmax_f64(x)                                   # [bs, L, V] float64
    top_log_probs = np.take_along_axis(logp, order, axis=-1).astype(np.float32)  # [bs, L, k]
    return top_log_probs, order.astype(np.int32)
