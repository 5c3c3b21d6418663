"""Reference ``verify_attn``: tree-masked MLA attention in the absorbed form, in float64.

DeepSeek-V3 / Kimi-K2 cache one latent row per token, ``[c | r]`` with ``c`` the ``Dc = 512``
compressed KV and ``r`` the ``Dr = 64`` shared rope key. With ``W_UK`` absorbed into the query
(``q_latent = W_UK^T q_nope``, done by the caller), every head attends over the same rows::

    s[i, h, t]   = sm_scale * (q_latent[i, h] . c[t] + q_rope[i, h] . r[t])
    visible(i,t) = t < P  or  (t = P + j and visibility[i, j])        # P = prefix_lens[b]
    out[i, h]    = sum_t softmax_t(s[i, h, :] over visible t) * c[t]  # [Dc]
    lse[i, h]    = log sum_{visible t} exp(s[i, h, t])                  # natural log

``out_latent`` is still in latent space: the caller applies ``W_UV`` (and ``W_O``) after.
Logical slot ``t`` of request ``b`` lives at ``kv_cache[block_table[b, t // page_size],
t % page_size]``; tree node ``j`` is slot ``P + j`` (the root at ``P``). Rows
``i >= num_nodes[b]`` are padding: ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import numpy as np

from ..validation import check_verify_attn
from .build_tree import unpack_bits
from .commit_kv import slot_address


def gather_slots(kv_cache, block_table_row, num_slots: int) -> np.ndarray:
    """Rows of logical slots ``[0, num_slots)`` of one request: ``[num_slots, Dc + Dr]``."""
    return gather_rows(kv_cache, block_table_row, np.arange(num_slots))


def gather_rows(kv_cache, block_table_row, slots) -> np.ndarray:
    """Rows of the logical slots ``slots`` (an int array) of one request: ``[len, Dc + Dr]``.
    Only their block-table entries and cache rows are read."""
    return kv_cache[slot_address(block_table_row, kv_cache.shape[1], np.asarray(slots, np.int64))]


def verify_attn(q_latent, q_rope, kv_cache, block_table, prefix_lens, visibility_bits,
                num_nodes, *, sm_scale):
    """Masked MLA-absorb attention of every tree node over its prefix and its ancestors.

    Only the rows a node sees are read into its result: the prefix (seen by every node) and
    the slots of its ancestors. Other branches' tree slots, padding slots, slots past
    ``P + num_nodes[b]``, unused pages and block-table entries past the pages in use may hold
    anything, NaN included.

    Parameters
    ----------
    q_latent : numpy.ndarray
        ``float32[bs, N, H, Dc]``: ``q_nope`` already multiplied by ``W_UK``.
    q_rope : numpy.ndarray
        ``float32[bs, N, H, Dr]``: rotary part of the queries (RoPE applied).
    kv_cache : numpy.ndarray
        ``float32|bfloat16|float16[num_pages, page_size, Dc + Dr]``: latent first, rope last.
    block_table : numpy.ndarray
        ``int32[bs, max_pages]``: page of each logical page of each request.
    prefix_lens : numpy.ndarray
        ``int32[bs]``: committed slots before the tree (``P``); the root sits at slot ``P``.
    visibility_bits : numpy.ndarray
        ``uint32[bs, N, W]``: packed ancestor mask (``DraftTree.visibility_bits``).
    num_nodes : numpy.ndarray
        ``int32[bs]``: valid tree nodes per request.
    sm_scale : float
        Softmax scale of the model (DeepSeek-V3 / Kimi-K2: ``192 ** -0.5 * mscale ** 2``).

    Returns
    -------
    tuple of numpy.ndarray
        ``out_latent`` ``float32[bs, N, H, Dc]`` and ``lse`` ``float32[bs, N, H]``.
    """
    sz = check_verify_attn(q_latent, q_rope, kv_cache, block_table, prefix_lens,
                           visibility_bits, num_nodes, sm_scale, check=True)
    out = np.zeros((sz.bs, sz.N, sz.H, sz.Dc), np.float32)
    lse = np.full((sz.bs, sz.N, sz.H), -np.inf, np.float32)
    for b in range(sz.bs):
        P, n = int(prefix_lens[b]), int(num_nodes[b])
        prefix = gather_rows(kv_cache, block_table[b], np.arange(P)).astype(np.float64)  # [P, D]
        ql = q_latent[b, :n].astype(np.float64)                    # [n, H, Dc]
        qr = q_rope[b, :n].astype(np.float64)                      # [n, H, Dr]
        tree_mask = unpack_bits(visibility_bits[b, :n], sz.N)      # [n, N]
        for i in range(n):
            # the rows node i sees: the whole prefix, then its ancestors' slots (itself last)
            path = P + np.flatnonzero(tree_mask[i])                # ancestors' slots
            rows = np.concatenate([prefix, gather_rows(kv_cache, block_table[b], path)
                                   .astype(np.float64)])           # [T_i, D], T_i = P + depth + 1
            c, r = rows[:, : sz.Dc], rows[:, sz.Dc :]              # [T_i, Dc], [T_i, Dr]
            s = sm_scale * (ql[i] @ c.T + qr[i] @ r.T)             # [H, T_i]
            m = s.max(axis=-1, keepdims=True)                      # [H, 1] finite: the root
            e = np.exp(s - m)                                      # [H, T_i]
            denom = e.sum(axis=-1, keepdims=True)                  # [H, 1]
            out[b, i] = (e / denom) @ c                            # [H, Dc]
            lse[b, i] = (m + np.log(denom))[:, 0]                  # [H]
    return out, lse


def plain_mla_attention(q_nope, q_rope, c, r, w_uk, w_uv, visible, *, sm_scale):
    """Non-absorbed MLA attention for one request, to check the absorbed form against.

    ``q_nope [n, H, dn]``, ``q_rope [n, H, Dr]``, latents ``c [T, Dc]`` and rope keys
    ``r [T, Dr]``, ``w_uk [H, Dc, dn]`` and ``w_uv [H, Dc, dv]`` the up-projections,
    ``visible [n, T]``. Returns ``out [n, H, dv]``::

        k_nope[t, h] = c[t] @ w_uk[h]            v[t, h] = c[t] @ w_uv[h]
        s[i, h, t]   = sm_scale * (q_nope[i, h] . k_nope[t, h] + q_rope[i, h] . r[t])
        out[i, h]    = softmax_t(s) @ v[:, h]
    """
    k_nope = np.einsum("tc,hcd->thd", c, w_uk)                      # [T, H, dn]
    v = np.einsum("tc,hcd->thd", c, w_uv)                           # [T, H, dv]
    s = np.einsum("ihd,thd->iht", q_nope, k_nope) + np.einsum("ihr,tr->iht", q_rope, r)
    s = np.where(visible[:, None, :], sm_scale * s, -np.inf)       # [n, H, T]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)                              # [n, H, T]
    return np.einsum("iht,thd->ihd", p, v)                          # [n, H, dv]


def deepseek_sm_scale(qk_head_dim: int = 192, rope_factor: float = 40.0,
                      mscale_all_dim: float = 1.0) -> float:
    """Softmax scale of DeepSeek-V3 / Kimi-K2 with YaRN: ``qk_head_dim ** -0.5 * mscale ** 2``.

    ``mscale = 0.1 * mscale_all_dim * ln(rope_factor) + 1`` (DeepSeek-V3: factor 40,
    mscale_all_dim 1 -> ``sm_scale ~= 0.1352``). The head dimension of the score is the
    un-absorbed ``qk_nope (128) + qk_rope (64) = 192``, not the 576-wide cache row.
    """
    mscale = 0.1 * mscale_all_dim * np.log(rope_factor) + 1.0 if rope_factor > 1 else 1.0
    return float(qk_head_dim ** -0.5 * mscale * mscale)
