"""A tiny DeepSeek-style MLA decoder with seeded random weights: the target model of the demo.

It is small enough for numba's CUDA simulator and keeps every piece of DeepSeek-V3's attention
that the verify kernels depend on::

    x    = embed[token]                                     per layer:
    h    = rms_norm(x) ;  q = h W_q  -> q_nope [H, dn], q_pe [H, Dr] (RoPE at the position)
    kv   = h W_kv_a    -> c = rms_norm(kv[:Dc])  (the latent, Dc wide; cached)
                          r = rope(kv[Dc:])      (the shared rope key, Dr wide; cached)
    k_nope = c W_UK[h] [dn],  v = c W_UV[h] [dv]                (per head, from the latent)
    s    = sm_scale (q_nope . k_nope + q_pe . r),  o = softmax(s) v,  x += o W_o
    x   += W_down (silu(rms_norm(x) W_gate) * (rms_norm(x) W_up))
    logits = rms_norm(x) lm_head

The cache holds one ``Dc + Dr`` row per token per layer (latent first, rope last), exactly the
layout of ``kernels.verify_attn`` and FlashMLA; ``kv_cache`` is ``[layers, num_pages,
page_size, Dc + Dr]``, one paged cache per layer sharing the block table.

This module is the *plain* (non-absorbed) form in numpy float64: keys and values are expanded
per head from the cached latent. :class:`ToyMLA` is also a
:class:`~ddtree_numba.interfaces.Target` on numpy arrays (what ``reference.greedy_step`` runs).
The device forward (:mod:`ddtree_numba.models.toy_mla_device`) uses the *absorbed* form:
``q_nope . (c W_UK) = (W_UK q_nope) . c``, so attention runs on the latent directly and
``W_UV`` is applied once to the attention output.

RoPE pairs adjacent dims ``(2i, 2i + 1)`` (DeepSeek's complex-number form) with frequency
``theta ** (-2 i / Dr)``. ``sm_scale = 1 / sqrt(dn + Dr)``; the toy has no YaRN scaling (the
real models' scale is ``reference.deepseek_sm_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..arrays import CACHE_DTYPES
from ..contracts import DraftTree
from ..reference.commit_kv import slot_address
from ..validation import require_cache_dtype

RMS_EPS = 1e-6


@dataclass(frozen=True)
class ToyMLAConfig:
    """Sizes of the toy model (DeepSeek-V3 names: ``kv_lora_rank`` is ``Dc``)."""

    vocab: int = 64
    hidden: int = 32
    layers: int = 2
    heads: int = 2
    kv_lora_rank: int = 16       # Dc
    qk_nope_dim: int = 8         # dn
    qk_rope_dim: int = 8         # Dr (even)
    v_head_dim: int = 8          # dv
    ffn: int = 64
    rope_theta: float = 10000.0
    logit_scale: float = 4.0     # spreads the logits so that argmax near-ties are rare
    bigram: float = 0.7          # share of lm_head tied to a permuted embedding (see ToyMLA)
    seed: int = 0

    @property
    def row_width(self) -> int:
        """The width of a cache row, ``Dc + Dr``."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def sm_scale(self) -> float:
        return float((self.qk_nope_dim + self.qk_rope_dim) ** -0.5)

    @staticmethod
    def tiny(**overrides) -> ToyMLAConfig:
        """Simulator-sized (the default sizes)."""
        return replace(ToyMLAConfig(), **overrides)

    @staticmethod
    def gpu(**overrides) -> ToyMLAConfig:
        """A larger toy for the GPU: DeepSeek's attention geometry (Dc 512, Dr 64) at 4 heads."""
        return replace(ToyMLAConfig(vocab=4096, hidden=512, layers=2, heads=4, kv_lora_rank=512,
                                    qk_nope_dim=64, qk_rope_dim=64, v_head_dim=64, ffn=1024),
                       **overrides)

    def validate(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "kv_lora_rank", "qk_nope_dim",
                     "qk_rope_dim", "v_head_dim", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.qk_rope_dim % 2:
            raise ValueError(f"qk_rope_dim: expected an even width (RoPE pairs dims), "
                             f"got {self.qk_rope_dim}")


@dataclass
class LayerWeights:
    attn_norm: np.ndarray    # [D]
    w_q: np.ndarray          # [D, H * (dn + Dr)]   per head: nope dims, then rope dims
    w_kv_a: np.ndarray       # [D, Dc + Dr]
    kv_norm: np.ndarray      # [Dc]
    w_uk: np.ndarray         # [H, Dc, dn]  k_nope = c @ w_uk[h]
    w_uv: np.ndarray         # [H, Dc, dv]  v      = c @ w_uv[h]
    w_o: np.ndarray          # [H * dv, D]
    ffn_norm: np.ndarray     # [D]
    w_gate_up: np.ndarray    # [D, 2 F]     gate columns, then up columns
    w_down: np.ndarray       # [F, D]


def rms_norm(x, weight):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * weight


def rope(x, positions, theta: float):
    """Rotate adjacent pairs of the last axis of ``x [..., n, Dr]`` by ``positions [n]``."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2.0 * np.arange(half) / x.shape[-1])           # [Dr/2]
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq        # [n, Dr/2]
    shape = (len(positions),) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = np.cos(angle).reshape(shape), np.sin(angle).reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


class ToyMLA:
    """Seeded random weights (float32) and the numpy plain-form forward (float64 math).

    ``cache_dtype`` (``"float32"``, ``"bfloat16"`` or ``"float16"``) is how the cache stores its
    rows: each new row is computed in float32 and rounded once to it (to nearest even), and
    attention reads the rounded values, in this forward as in the device forward.
    """

    def __init__(self, config: ToyMLAConfig, *, cache_dtype: str = "float32"):
        config.validate()
        require_cache_dtype("cache_dtype", cache_dtype)
        self.config = c = config
        self.cache_dtype = cache_dtype
        self.vocab = c.vocab
        rng = np.random.default_rng(c.seed)

        def init(*shape, fan_in):
            return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

        def norm_weight(n):
            return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

        D, H, Dc, Dr = c.hidden, c.heads, c.kv_lora_rank, c.qk_rope_dim
        dn, dv, F = c.qk_nope_dim, c.v_head_dim, c.ffn
        self.embed = rng.standard_normal((c.vocab, D)).astype(np.float32)
        self.layers = [
            LayerWeights(
                attn_norm=norm_weight(D), w_q=init(D, H * (dn + Dr), fan_in=D),
                w_kv_a=init(D, Dc + Dr, fan_in=D), kv_norm=norm_weight(Dc),
                w_uk=init(H, Dc, dn, fan_in=Dc), w_uv=init(H, Dc, dv, fan_in=Dc),
                w_o=init(H * dv, D, fan_in=H * dv), ffn_norm=norm_weight(D),
                w_gate_up=init(D, 2 * F, fan_in=D), w_down=init(F, D, fan_in=F))
            for _ in range(c.layers)]
        self.final_norm = norm_weight(D)
        # Random transformers fall into repeating one token. A share ``bigram`` of the lm_head
        # is tied to the embedding through a random permutation, so a hidden state close to
        # embed[t] predicts next_of[t], and the attention layers move the prediction away from
        # it for a good part of the tokens (context matters, as the tree verification needs).
        self.next_of = rng.permutation(c.vocab)
        tied = np.empty((D, c.vocab), np.float32)
        tied[:, self.next_of] = self.embed.T / np.sqrt(D)
        self.lm_head = (c.logit_scale * (c.bigram * tied + (1 - c.bigram)
                                         * init(D, c.vocab, fan_in=D))).astype(np.float32)

    # -- the plain forward ------------------------------------------------------------------
    def forward_rows(self, tokens, positions, visible, prefix_rows):
        """Run ``n`` new tokens after a cached prefix.

        Parameters
        ----------
        tokens, positions : numpy.ndarray
            ``int[n]``: the new tokens and their RoPE positions.
        visible : numpy.ndarray
            ``bool[n, n]``: which new tokens each new token attends to (itself included).
        prefix_rows : numpy.ndarray
            ``[layers, P, Dc + Dr]``: the cached rows every new token attends to.

        Returns
        -------
        tuple
            ``logits`` float64 ``[n, V]`` and the new cache rows ``float32[layers, n, Dc + Dr]``
            (values of the cache's type: rounded before any token attends to them).
        """
        c = self.config
        n, P = len(tokens), prefix_rows.shape[1]
        mask = np.concatenate([np.ones((n, P), bool), np.asarray(visible, bool)], axis=1)
        x = self.embed[np.asarray(tokens)].astype(np.float64)               # [n, D]
        new_rows = np.empty((c.layers, n, c.row_width), np.float32)
        every_head, every_column = slice(0, c.heads), slice(0, c.ffn)
        for layer, w in enumerate(self.layers):
            h = rms_norm(x, w.attn_norm)
            new_rows[layer] = self.cache_rows(w, h, positions)
            rows = np.concatenate([prefix_rows[layer], new_rows[layer]]).astype(np.float64)
            x = x + self.attention(w, h, positions, rows, mask, every_head)
            x = x + self.mlp(w, rms_norm(x, w.ffn_norm), every_column)
        return rms_norm(x, self.final_norm) @ self.lm_head, new_rows

    # -- the forward's pieces (a tensor-parallel rank runs them on its heads and columns) ---
    def cache_rows(self, w: LayerWeights, h, positions) -> np.ndarray:
        """The new cache rows ``float32[n, Dc + Dr]`` of one layer (latent normalised, rope key
        rotated, both rounded to the cache's type)."""
        c = self.config
        kv = h @ w.w_kv_a
        rows = np.empty((len(h), c.row_width), np.float32)
        rows[:, : c.kv_lora_rank] = rms_norm(kv[:, : c.kv_lora_rank], w.kv_norm)
        rows[:, c.kv_lora_rank:] = rope(kv[:, c.kv_lora_rank:], positions, c.rope_theta)
        return self.rounded_to_cache(rows)

    def attention(self, w: LayerWeights, h, positions, rows, mask, heads: slice) -> np.ndarray:
        """The attention output of ``heads`` through their rows of ``W_o``: ``[n, D]``, the
        layer's whole residual update when ``heads`` is every head, one rank's share of it
        under tensor parallelism (the shares sum to the whole)."""
        c = self.config
        H, Dc, dn, Dr, dv = c.heads, c.kv_lora_rank, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim
        n = len(h)
        q = (h @ w.w_q).reshape(n, H, dn + Dr)[:, heads]
        q_nope, q_pe = q[..., :dn], rope(q[..., dn:], positions, c.rope_theta)
        latent, rope_key = rows[:, :Dc], rows[:, Dc:]                       # [T, Dc], [T, Dr]
        k_nope = latent @ w.w_uk[heads]                                     # [h, T, dn]
        value = latent @ w.w_uv[heads]                                      # [h, T, dv]
        scores = (q_nope.transpose(1, 0, 2) @ k_nope.transpose(0, 2, 1)
                  + q_pe.transpose(1, 0, 2) @ rope_key.T) * c.sm_scale      # [h, n, T]
        scores = np.where(mask[None], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out = (p @ value).transpose(1, 0, 2).reshape(n, -1)                 # [n, h dv]
        return out @ w.w_o[heads.start * dv: heads.stop * dv]

    def mlp(self, w: LayerWeights, h, columns: slice) -> np.ndarray:
        """The MLP's output through the ``columns`` of its hidden layer: ``[n, D]``, the whole
        update when ``columns`` is every column, a rank's share under tensor parallelism."""
        F = self.config.ffn
        gate = h @ w.w_gate_up[:, columns]
        up = h @ w.w_gate_up[:, F + columns.start: F + columns.stop]
        return (silu(gate) * up) @ w.w_down[columns]

    def rounded_to_cache(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (float32) rounded to the cache's type, as float32 values."""
        return rows.astype(CACHE_DTYPES[self.cache_dtype]).astype(np.float32)

    # -- the Target interface (numpy: what reference.greedy_step runs) ---------------------
    def allocate(self, *, bs: int, N: int, num_pages: int, page_size: int,
                 max_pages: int) -> None:
        """A zeroed numpy cache ``[layers, num_pages, page_size, Dc + Dr]`` of the cache
        type."""
        c = self.config
        self.sizes = (bs, N)
        self.kv_cache = np.zeros((c.layers, num_pages, page_size, c.row_width),
                                 CACHE_DTYPES[self.cache_dtype])

    def kv_caches(self) -> list:
        """One ``[num_pages, page_size, Dc + Dr]`` cache per layer (views of ``kv_cache``)."""
        return [self.kv_cache[layer] for layer in range(self.config.layers)]

    def forward(self, tree: DraftTree, block_table, prefix_lens) -> np.ndarray:
        """The plain-form forward of every tree node (:class:`~ddtree_numba.interfaces.Target`).

        Writes node ``j``'s row at slot ``P + j`` of every layer's cache and returns the logits
        ``float64[bs * N, V]`` (zeros on padding rows).
        """
        tree = tree.to_host()
        block_table, prefix_lens = np.asarray(block_table), np.asarray(prefix_lens)
        bs, N = tree.token_ids.shape
        page_size = self.kv_cache.shape[2]
        logits = np.zeros((bs * N, self.config.vocab))
        for b in range(bs):
            n, P = int(tree.num_nodes[b]), int(prefix_lens[b])
            pages, offsets = slot_address(block_table[b], page_size, np.arange(P))
            prefix_rows = self.kv_cache[:, pages, offsets].astype(np.float32)
            node_logits, rows = self.forward_rows(tree.token_ids[b, :n], tree.positions[b, :n],
                                                  tree.visibility[b, :n, :n], prefix_rows)
            where = slot_address(block_table[b], page_size, P + np.arange(n))
            self.kv_cache[:, where[0], where[1]] = rows
            logits[b * N: b * N + n] = node_logits
        return logits

    def greedy(self, start_token: int, steps: int) -> list:
        """Plain greedy decoding, one token per forward: the ``steps`` tokens after ``start``."""
        c = self.config
        rows = np.empty((c.layers, 0, c.row_width), np.float32)
        token, out = int(start_token), []
        for position in range(steps):
            logits, new = self.forward_rows([token], [position], [[True]], rows)
            rows = np.concatenate([rows, new], axis=1)
            token = int(np.argmax(logits[0]))
            out.append(token)
        return out
