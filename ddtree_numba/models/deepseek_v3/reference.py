"""The DeepSeek-V3 architecture's forward in numpy float64, in the plain (non-absorbed) form:
the definition that the device forward is checked against, itself checked against Hugging Face
``transformers`` (``tests/test_deepseek_v3.py``, on fixtures that transformers wrote).

Per layer, for ``n`` new tokens after ``P`` cached ones (``x`` the residual stream)::

    h      = rms_norm(x)                                    input_layernorm
    q      = q_b(rms_norm(q_a(h)))   or  q_proj(h)          [n, H, dn + Dr]  (q_lora_rank or not)
    kv     = kv_a(h)                                        [n, Dc + Dr]
    c      = rms_norm(kv[:, :Dc])                           the latent: cached
    r      = rope(kv[:, Dc:])                               the rope key, shared by heads: cached
    k, v   = split(kv_b(c))  per head                       [T, H, dn], [T, H, dv]  (T = P + n)
    s      = sm_scale (q_nope . k + rope(q_pe) . r),  masked;  o = softmax(s) v
    x     += o_proj(o)
    x     += mlp(rms_norm(x))                               dense, or MoE from layer k on
    logits = lm_head(rms_norm(x))

RoPE rotates interleaved pairs ``(2i, 2i + 1)`` by ``position * inv_freq[i]`` (DeepSeek's
complex-number form; transformers' ``rope_interleave`` first moves the even dims before the odd
ones and rotates halves: the same dot products). With YaRN, ``inv_freq`` blends interpolated and
extrapolated frequencies over a ramp (:func:`rope_inv_freq`), cos and sin are multiplied by the
attention factor ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, and the softmax
scale by ``mscale(factor, mscale_all_dim)^2`` (:attr:`DeepseekV3Config.sm_scale`).

MoE (:func:`moe`): the router scores every expert with a sigmoid; a per-expert correction bias
is added *for choosing only*; the experts are grouped (``n_group``), each group is scored by the
sum of its two best biased scores, the ``topk_group`` best groups stay (the others' experts
cannot be chosen), and the ``num_experts_per_tok`` best experts among those are taken; their
*unbiased*
scores, normalised to sum 1 (``norm_topk_prob``) and times ``routed_scaling_factor``, weight
their outputs; the shared experts' output is added.

Weights are a mapping from Hugging Face tensor names to arrays (``model.layers.0.self_attn
.q_a_proj.weight``, ...; a ``Linear`` weight is ``[out, in]``), e.g. a lazy checkpoint
(:mod:`ddtree_numba.models.deepseek_v3.checkpoint`): each tensor is read when first used.
"""

from __future__ import annotations

import math

import numpy as np

from .config import DeepseekV3Config, yarn_mscale

#: The epsilon of the two low-rank norms (``q_a_layernorm``, ``kv_a_layernorm``): DeepSeek's
#: code and transformers build them with the default 1e-6, whatever ``rms_norm_eps`` says.
LORA_NORM_EPS = 1e-6


def rope_inv_freq(config: DeepseekV3Config) -> tuple:
    """``(inv_freq float64[Dr / 2], attention_factor)``: RoPE frequencies, with YaRN's blend of
    interpolated (``/ factor``) and original frequencies when the config scales RoPE."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    freq = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    y = config.rope_scaling
    if y is None:
        return 1.0 / freq, 1.0

    def correction_dim(rotations):      # the dim whose wavelength makes `rotations` turns
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp                   # 1: the original frequency (fast dims), 0: interpolated
    inv_freq = (1.0 / (y.factor * freq)) * (1.0 - keep) + (1.0 / freq) * keep
    if y.mscale and y.mscale_all_dim:
        factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    else:
        factor = yarn_mscale(y.factor, 1.0)
    return inv_freq, factor


def rope(x, positions, inv_freq, attention_factor=1.0):
    """Rotate interleaved pairs ``(2i, 2i + 1)`` of the last axis of ``x [n, ..., Dr]`` by
    ``positions[t] * inv_freq[i]``, cos and sin times ``attention_factor``."""
    x = np.asarray(x, np.float64)
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq           # [n, Dr / 2]
    angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
    cos, sin = np.cos(angle) * attention_factor, np.sin(angle) * attention_factor
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def rms_norm(x, weight, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x):
    return x / (1.0 + np.exp(-x))


class Weights:
    """Float64 copies of a name -> array mapping, each read once and then kept (``w(name)``
    gives the tensor as float64). Keeping them makes repeated forwards cheap on the small
    checkpoints the reference is meant for; a model of billions of parameters would need 8
    bytes each, so a GPU forward of a real checkpoint must not go through this class (the
    simulator's :class:`~ddtree_numba.models.deepseek_v3.target.DeepseekV3Target`, made for tiny
    checkpoints, does)."""

    def __init__(self, tensors):
        self.tensors, self.cache = tensors, {}

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.cache:
            self.cache[name] = np.asarray(self.tensors[name], np.float64)
        return self.cache[name]

    def has(self, name: str) -> bool:
        return name in self.tensors


def mlp(w: Weights, prefix: str, x):
    """``down(silu(gate(x)) * up(x))`` with the weights under ``prefix``."""
    gate, up = x @ w(f"{prefix}.gate_proj.weight").T, x @ w(f"{prefix}.up_proj.weight").T
    return (silu(gate) * up) @ w(f"{prefix}.down_proj.weight").T


def route(config: DeepseekV3Config, logits, bias) -> tuple:
    """``(experts int[n, k], weights float64[n, k])``: the router's choice for each token."""
    c = config
    n, E, k = logits.shape[0], c.n_routed_experts, c.num_experts_per_tok
    scores = 1.0 / (1.0 + np.exp(-logits))                                # [n, E] sigmoid
    biased = scores + bias                                                # for choosing only
    groups = biased.reshape(n, c.n_group, E // c.n_group)
    group_score = np.sort(groups, axis=-1)[..., -2:].sum(-1)              # best two per group
    kept = np.argsort(-group_score, axis=-1, kind="stable")[:, : c.topk_group]
    group_mask = np.zeros((n, c.n_group), bool)
    np.put_along_axis(group_mask, kept, True, axis=-1)
    biased = np.where(np.repeat(group_mask, E // c.n_group, axis=-1), biased, -np.inf)
    experts = np.argsort(-biased, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts, weights * c.routed_scaling_factor


def moe(config: DeepseekV3Config, w: Weights, prefix: str, x):
    """The MoE layer under ``prefix`` (``...mlp``): routed experts plus shared experts."""
    logits = x @ w(f"{prefix}.gate.weight").T
    experts, weights = route(config, logits, w(f"{prefix}.gate.e_score_correction_bias"))
    out = np.zeros_like(x)
    for e in np.unique(experts):
        tokens, slot = np.nonzero(experts == e)
        out[tokens] += weights[tokens, slot, None] * mlp(w, f"{prefix}.experts.{e}", x[tokens])
    if config.n_shared_experts:
        out += mlp(w, f"{prefix}.shared_experts", x)
    return out


def attention_rows(config: DeepseekV3Config, w: Weights, layer: int, h, positions,
                   inv_freq, attention_factor):
    """``(q_nope [n, H, dn], q_pe [n, H, Dr] rotated, cache rows [n, Dc + Dr])`` of layer
    ``layer`` for the normed hidden states ``h [n, D]``."""
    c, p = config, f"model.layers.{layer}.self_attn"
    n, H = len(h), c.num_attention_heads
    if c.q_lora_rank is None:
        q = h @ w(f"{p}.q_proj.weight").T
    else:
        q = rms_norm(h @ w(f"{p}.q_a_proj.weight").T, w(f"{p}.q_a_layernorm.weight"),
                     LORA_NORM_EPS) @ w(f"{p}.q_b_proj.weight").T
    q = q.reshape(n, H, c.qk_head_dim)
    q_nope = q[..., : c.qk_nope_head_dim]
    q_pe = rope(q[..., c.qk_nope_head_dim:], positions, inv_freq, attention_factor)
    kv = h @ w(f"{p}.kv_a_proj_with_mqa.weight").T                       # [n, Dc + Dr]
    rows = np.empty((n, c.row_width))
    rows[:, : c.kv_lora_rank] = rms_norm(kv[:, : c.kv_lora_rank],
                                         w(f"{p}.kv_a_layernorm.weight"), LORA_NORM_EPS)
    rows[:, c.kv_lora_rank:] = rope(kv[:, c.kv_lora_rank:], positions, inv_freq,
                                    attention_factor)
    return q_nope, q_pe, rows


def forward(config: DeepseekV3Config, tensors, tokens, positions, visible=None,
            prefix_rows=None) -> tuple:
    """Logits of ``n`` new tokens after ``P`` cached ones, in the plain form.

    Parameters
    ----------
    tensors : mapping
        Hugging Face tensor name -> array (wrapped in a ``Weights``).
    tokens, positions : array
        ``int[n]``.
    visible : array, optional
        ``bool[n, n]``: which new tokens each attends to (default causal).
    prefix_rows : array, optional
        ``[layers, P, Dc + Dr]``: the cached rows every new token sees (default none).

    Returns
    -------
    tuple
        ``logits float64[n, V]`` and the new cache rows ``float64[layers, n, Dc + Dr]``.
    """
    c = config
    w = tensors if isinstance(tensors, Weights) else Weights(tensors)
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    n, H, Dc = len(tokens), c.num_attention_heads, c.kv_lora_rank
    dn, dv = c.qk_nope_head_dim, c.v_head_dim
    if visible is None:
        visible = np.tril(np.ones((n, n), bool))
    if prefix_rows is None:
        prefix_rows = np.zeros((c.num_hidden_layers, 0, c.row_width))
    P = prefix_rows.shape[1]
    mask = np.concatenate([np.ones((n, P), bool), np.asarray(visible, bool)], axis=1)
    inv_freq, attention_factor = rope_inv_freq(c)
    x = w("model.embed_tokens.weight")[tokens]                             # [n, D]
    new_rows = np.empty((c.num_hidden_layers, n, c.row_width))
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}"
        h = rms_norm(x, w(f"{p}.input_layernorm.weight"), c.rms_norm_eps)
        q_nope, q_pe, new_rows[layer] = attention_rows(c, w, layer, h, positions, inv_freq,
                                                       attention_factor)
        rows = np.concatenate([np.asarray(prefix_rows[layer], np.float64), new_rows[layer]])
        kv = (rows[:, :Dc] @ w(f"{p}.self_attn.kv_b_proj.weight").T).reshape(-1, H, dn + dv)
        k_nope, value = kv[..., :dn], kv[..., dn:]                         # [T, H, dn | dv]
        scores = (np.einsum("nhd,thd->hnt", q_nope, k_nope)
                  + np.einsum("nhd,td->hnt", q_pe, rows[:, Dc:])) * c.sm_scale
        scores = np.where(mask[None], scores, -np.inf)
        prob = np.exp(scores - scores.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        heads = np.einsum("hnt,thd->nhd", prob, value).reshape(n, H * dv)
        x = x + heads @ w(f"{p}.self_attn.o_proj.weight").T
        h = rms_norm(x, w(f"{p}.post_attention_layernorm.weight"), c.rms_norm_eps)
        x = x + (moe(c, w, f"{p}.mlp", h) if c.is_moe_layer(layer) else mlp(w, f"{p}.mlp", h))
    head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    return rms_norm(x, w("model.norm.weight"), c.rms_norm_eps) @ w(head).T, new_rows
