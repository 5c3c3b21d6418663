"""The DeepSeek-V3 architecture as a step :class:`~ddtree_numba.interfaces.Target`: the
*absorbed* MLA forward over a draft tree, with attention by ``kernels.verify_attn`` over the
paged latent cache.

Per layer, for the ``T = bs N`` tree nodes at once (``W_UK``, ``W_UV``: the key and value
halves of each head's rows of ``kv_b_proj``)::

    h        = rms_norm(x)
    q        = q_b(rms_norm(q_a(h)))  or  q_proj(h)           [T, H, dn + Dr]
    q_latent = q_nope W_UK            (per head)               [T, H, Dc]   W_UK absorbed
    q_pe     = rope(q[..., dn:])                               [T, H, Dr]
    cache[slot P + j] = [rms_norm(kv_a(h)[:Dc]), rope(kv_a(h)[Dc:])]   rounded to the cache type
    o_latent = kernels.verify_attn(q_latent, q_pe, cache, ...)          [T, H, Dc]
    x       += o_proj(o_latent W_UV^T (per head))                        W_UV absorbed
    x       += mlp or moe (rms_norm(x))
    logits   = lm_head(rms_norm(x))

``q_nope . (c W_UK^T) = (q_nope W_UK) . c``, so attention reads each cached 576-wide row once
for all heads (:mod:`~ddtree_numba.models.deepseek_v3.reference` is the plain form that
defines the result; ``tests/test_deepseek_v3.py`` checks the step against its greedy decoding).

The dense layers here run in numpy (float64, on the host views of the device buffers): the
backend of numba's CUDA simulator and of the CPU. A GPU backend (cuBLAS through CuPy, captured
in the step's CUDA graph) is the next part of this work; attention already runs the package's
kernels either way.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...arrays import CACHE_DTYPES, host_view
from ...kernels import SIMULATOR, allocate_workspace, as_device, verify_attn
from ...kernels.verify_attn import choose_variant
from ...reference.commit_kv import store_node_rows
from ...validation import require_cache_dtype
from . import reference as ref
from .config import DeepseekV3Config


class DeepseekV3Target:
    """The absorbed-form forward on static buffers (``allocate`` once, ``forward`` per step).

    Parameters
    ----------
    config : DeepseekV3Config
    tensors : mapping
        Hugging Face tensor name -> array (a :class:`~ddtree_numba.models.deepseek_v3.Checkpoint`
        or a dict); read once, here.
    cache_dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``: how the cache stores its rows (each
        computed, rounded to float32, then once to the cache's type when written).
        ``kv_cache`` is ``[layers, num_pages, page_size, Dc + Dr]``.
    """

    def __init__(self, config: DeepseekV3Config, tensors, *, cache_dtype: str = "float32"):
        if not isinstance(config, DeepseekV3Config):
            raise TypeError(f"config: expected a DeepseekV3Config, got {type(config).__name__}")
        require_cache_dtype("cache_dtype", cache_dtype)
        self.config = c = config
        self.cache_dtype = cache_dtype
        self.vocab = c.vocab_size
        self.w = ref.Weights(tensors)
        self.inv_freq, self.attention_factor = ref.rope_inv_freq(c)
        H, dn, dv = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        self.w_uk, self.w_uv = [], []               # per layer: [H, dn, Dc], [H, dv, Dc]
        for layer in range(c.num_hidden_layers):
            kv_b = self.w(f"model.layers.{layer}.self_attn.kv_b_proj.weight")
            kv_b = kv_b.reshape(H, dn + dv, c.kv_lora_rank)
            self.w_uk.append(kv_b[:, :dn])
            self.w_uv.append(kv_b[:, dn:])
        self.sizes = None

    def allocate(self, *, bs: int, N: int, num_pages: int, page_size: int,
                 max_pages: int) -> None:
        c = self.config
        self.sizes = (bs, N)
        shape = (c.num_hidden_layers, num_pages, page_size, c.row_width)
        self.kv_cache = as_device(np.zeros(shape, CACHE_DTYPES[self.cache_dtype]),
                                  bf16_as_bits=False)
        H, Dc, Dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        self.q_latent = cuda.to_device(np.zeros((bs, N, H, Dc), np.float32))
        self.q_pe = cuda.to_device(np.zeros((bs, N, H, Dr), np.float32))
        self.o_latent = cuda.to_device(np.zeros((bs, N, H, Dc), np.float32))
        self.lse = cuda.to_device(np.zeros((bs, N, H), np.float32))
        self.logits = cuda.to_device(np.zeros((bs * N, c.vocab_size), np.float32))
        self.variant = choose_variant(None, self.cache_dtype, Dc, Dr, N)
        self.workspace = None if self.variant == "readable" else allocate_workspace(
            bs, N, H, Dc, max_pages * page_size, variant=self.variant)

    def kv_caches(self) -> list:
        return [self.kv_cache[layer] for layer in range(self.config.num_hidden_layers)]

    def forward(self, tree, block_table, prefix_lens):
        """Logits ``float32[bs * N, V]`` of every tree node; writes node ``j``'s row of every
        layer at slot ``P + j``."""
        if not SIMULATOR:
            raise NotImplementedError("DeepseekV3Target's dense layers run in numpy on numba's "
                                      "CUDA simulator; the GPU backend is not written yet")
        c, w = self.config, self.w
        bs, N = self.sizes
        T, H = bs * N, c.num_attention_heads
        tokens = host_view(tree.token_ids).reshape(T)
        positions = host_view(tree.positions)
        flat_positions = np.maximum(positions.reshape(T), 0)       # padding rows: position 0
        x = w("model.embed_tokens.weight")[np.maximum(tokens, 0)]  # padding rows: any token
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}"
            h = ref.rms_norm(x, w(f"{p}.input_layernorm.weight"), c.rms_norm_eps)
            q_nope, q_pe, rows = ref.attention_rows(c, w, layer, h, flat_positions,
                                                    self.inv_freq, self.attention_factor)
            host_view(self.q_latent)[:] = np.einsum(
                "thd,hdc->thc", q_nope, self.w_uk[layer]).reshape(bs, N, H, -1)
            host_view(self.q_pe)[:] = q_pe.reshape(bs, N, H, -1)
            store_node_rows(host_view(self.kv_cache)[layer], host_view(block_table),
                            host_view(prefix_lens), host_view(tree.num_nodes),
                            rows.astype(np.float32))        # rounded to the cache's type
            verify_attn(self.q_latent, self.q_pe, self.kv_cache[layer], block_table, prefix_lens,
                        tree.visibility_bits, tree.num_nodes, sm_scale=c.sm_scale,
                        out=(self.o_latent, self.lse), variant=self.variant,
                        workspace=self.workspace)
            o_latent = host_view(self.o_latent).astype(np.float64).reshape(T, H, -1)
            heads = np.einsum("thc,hdc->thd", o_latent, self.w_uv[layer]).reshape(T, -1)
            x = x + heads @ w(f"{p}.self_attn.o_proj.weight").T
            h = ref.rms_norm(x, w(f"{p}.post_attention_layernorm.weight"), c.rms_norm_eps)
            x = x + (ref.moe(c, w, f"{p}.mlp", h) if c.is_moe_layer(layer)
                     else ref.mlp(w, f"{p}.mlp", h))
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        host_view(self.logits)[:] = ref.rms_norm(x, w("model.norm.weight"),
                                                 c.rms_norm_eps) @ w(head).T
        return self.logits


def greedy(config: DeepseekV3Config, tensors, start_token: int, steps: int, *,
           cache_dtype: str = "float32") -> list:
    """Plain greedy decoding with the reference forward, one token per forward, the cache rows
    rounded to ``cache_dtype`` as the target stores them: the ``steps`` tokens after
    ``start_token`` (what a lossless step must emit)."""
    cache = require_cache_dtype("cache_dtype", cache_dtype)
    w = ref.Weights(tensors)
    rows = np.zeros((config.num_hidden_layers, 0, config.row_width))
    token, out = int(start_token), []
    for position in range(steps):
        logits, new = ref.forward(config, w, [token], [position], prefix_rows=rows)
        new = new.astype(np.float32).astype(cache).astype(np.float64)
        rows = np.concatenate([rows, new], axis=1)
        token = int(np.argmax(logits[0]))
        out.append(token)
    return out
