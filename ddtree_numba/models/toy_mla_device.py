"""The toy MLA model on the device: the :class:`~ddtree_numba.interfaces.Target` that
:class:`~ddtree_numba.GreedyStep` runs around the DDTree kernels.

:class:`DeviceToyMLA` is the target forward in the *absorbed* form that MLA decoding kernels
use (DeepSeek-V3's inference code, FlashMLA). Per layer, for every tree node at once::

    h        = rms_norm(x)
    q_nope   = h W_q_nope                       [T, H, dn]
    q_latent = q_nope W_UK^T  (per head)        [T, H, Dc]   absorb W_UK into the query
    q_pe     = rope(h W_q_rope)                 [T, H, Dr]
    kv       = h W_kv_a                         [T, Dc + Dr]
    cache[slot P + j] = [rms_norm(kv[:Dc]), rope(kv[Dc:])]   one row per node, shared by heads
    o_latent = kernels.verify_attn(q_latent, q_pe, cache, ...)   [T, H, Dc]  still latent
    x       += (o_latent W_UV (per head)) W_o                    absorb W_UV after attention
    x       += W_down(silu(h W_gate) * h W_up),  h = rms_norm(x)
    logits   = rms_norm(x) lm_head

so attention reads each cached 576-wide row once for all heads instead of expanding per-head
keys and values (the plain form of :mod:`ddtree_numba.models.toy_mla`, which defines the result).
Both use the same cache rows; ``tests/test_toy_mla.py`` states and checks the bound between
them.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .. import kernels as K
from ..arrays import CACHE_DTYPES
from ..kernels.verify_attn import choose_variant
from .dense_ops import default_dense_ops, rope_inv_freq
from .toy_mla import RMS_EPS, ToyMLA


class DeviceToyMLA:
    """The toy model's absorbed-form forward on static device buffers (a GreedyStep target).

    Call :meth:`allocate` once for the step's sizes, then :meth:`forward` per step.
    ``kv_cache`` is ``[layers, num_pages, page_size, Dc + Dr]`` of the model's
    ``cache_dtype``: float32 (``verify_attn``'s tiled variant), or bfloat16 / float16, which
    on GPUs of compute capability 8.0 and up run the tensor-core variant ``"mma"`` (queries
    and probabilities rounded to the cache's type, float32 accumulation).
    """

    def __init__(self, model: ToyMLA, *, ops=None):
        self.model = model
        self.config = c = model.config
        self.cache_dtype = CACHE_DTYPES[model.cache_dtype]
        self.ops = ops if ops is not None else default_dense_ops()
        self.vocab = c.vocab
        H, dn, Dr = c.heads, c.qk_nope_dim, c.qk_rope_dim
        self.embed = K.as_device(model.embed)
        self.final_norm = K.as_device(model.final_norm)
        self.lm_head = K.as_device(model.lm_head[None])                     # [1, D, V]
        self.inv_freq = K.as_device(rope_inv_freq(Dr, c.rope_theta))       # float64 [Dr / 2]
        self.layers = []
        for w in model.layers:
            w_q = w.w_q.reshape(c.hidden, H, dn + Dr)
            self.layers.append({
                "attn_norm": K.as_device(w.attn_norm),
                "w_q_nope": K.as_device(w_q[..., :dn].reshape(1, c.hidden, H * dn)),
                "w_q_rope": K.as_device(w_q[..., dn:].reshape(1, c.hidden, H * Dr)),
                "w_uk_t": K.as_device(w.w_uk.transpose(0, 2, 1)),              # [H, dn, Dc]
                "w_kv_a": K.as_device(w.w_kv_a[None]),
                "kv_norm": K.as_device(w.kv_norm),
                "w_uv": K.as_device(w.w_uv),                                   # [H, Dc, dv]
                "w_o": K.as_device(w.w_o[None]),
                "ffn_norm": K.as_device(w.ffn_norm),
                "w_gate_up": K.as_device(w.w_gate_up[None]),
                "w_down": K.as_device(w.w_down[None]),
            })
        self.sizes = None

    def allocate(self, *, bs: int, N: int, num_pages: int, page_size: int,
                 max_pages: int) -> None:
        """Static activations for ``T = bs * N`` rows, a zeroed paged cache of ``num_pages``
        pages, and the attention workspace for block tables ``max_pages`` wide."""
        c = self.config
        T, H = bs * N, c.heads

        def empty(*shape):
            return cuda.device_array(shape, np.float32)

        self.sizes = (bs, N)
        self.kv_cache = K.as_device(
            np.zeros((c.layers, num_pages, page_size, c.row_width), self.cache_dtype),
            bf16_as_bits=False)
        self.x, self.h = empty(T, c.hidden), empty(T, c.hidden)
        self.q_nope = empty(T, H * c.qk_nope_dim)
        self.q_latent = empty(T, H * c.kv_lora_rank)
        self.q_rope = empty(T, H * c.qk_rope_dim)
        self.kv = empty(T, c.row_width)
        self.o_latent, self.lse = empty(bs, N, H, c.kv_lora_rank), empty(bs, N, H)
        self.o = empty(T, H * c.v_head_dim)
        self.gate_up, self.act = empty(T, 2 * c.ffn), empty(T, c.ffn)
        self.logits = empty(T, c.vocab)
        self.variant = choose_variant(None, self.model.cache_dtype, c.kv_lora_rank,
                                      c.qk_rope_dim, N)
        self.workspace = None if self.variant == "readable" else K.allocate_workspace(
            bs, N, H, c.kv_lora_rank, max_pages * page_size, variant=self.variant)

    def kv_caches(self) -> list:
        """One ``[num_pages, page_size, Dc + Dr]`` cache per layer (views of ``kv_cache``)."""
        return [self.kv_cache[layer] for layer in range(self.config.layers)]

    def attend(self, layer: int, tree, block_table, prefix_lens) -> None:
        """Layer ``layer``'s attention: ``o_latent = verify_attn(q_latent, q_rope, cache)``."""
        c = self.config
        bs, N = self.sizes
        K.verify_attn(self.q_latent.reshape(bs, N, c.heads, c.kv_lora_rank),
                      self.q_rope.reshape(bs, N, c.heads, c.qk_rope_dim), self.kv_cache[layer],
                      block_table, prefix_lens, tree.visibility_bits, tree.num_nodes,
                      sm_scale=c.sm_scale, out=(self.o_latent, self.lse),
                      variant=self.variant, workspace=self.workspace)

    def forward(self, tree, block_table, prefix_lens):
        """Logits ``float32[bs * N, V]`` at every node; writes each node's row of every layer
        at slot ``P + j``. No host synchronisation; every buffer is preallocated."""
        c, ops = self.config, self.ops
        bs, N = self.sizes
        T, H = bs * N, c.heads
        x, h = self.x, self.h
        positions = tree.positions.reshape(T)
        ops.embed(tree.token_ids.reshape(T), self.embed, x)
        for layer, w in enumerate(self.layers):
            ops.rms_norm(x, w["attn_norm"], h, RMS_EPS)
            ops.linear(h, w["w_q_nope"], self.q_nope)
            ops.linear(self.q_nope, w["w_uk_t"], self.q_latent)          # absorb W_UK
            ops.linear(h, w["w_q_rope"], self.q_rope)
            ops.rope(self.q_rope, positions, self.inv_freq)
            ops.linear(h, w["w_kv_a"], self.kv)
            ops.kv_write(self.kv, w["kv_norm"], self.inv_freq, tree.positions, tree.num_nodes,
                         prefix_lens, block_table, self.kv_cache[layer], RMS_EPS)
            self.attend(layer, tree, block_table, prefix_lens)
            ops.linear(self.o_latent.reshape(T, H * c.kv_lora_rank), w["w_uv"], self.o)
            ops.linear(self.o, w["w_o"], x, residual=x)                   # absorb W_UV, W_o
            ops.rms_norm(x, w["ffn_norm"], h, RMS_EPS)
            ops.linear(h, w["w_gate_up"], self.gate_up)
            ops.silu_mul(self.gate_up, self.act)
            ops.linear(self.act, w["w_down"], x, residual=x)
        ops.rms_norm(x, self.final_norm, h, RMS_EPS)
        ops.linear(h, self.lm_head, self.logits)
        return self.logits
