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

The dense layers run through a dense-operations backend on static buffers, so that a whole step
is one CUDA graph: on a GPU :class:`~ddtree_numba.models.cublas_ops.CublasDenseOps` (every
matrix product one cuBLAS call, float32 or bfloat16 weights), on numba's CUDA simulator
:class:`~ddtree_numba.models.dense_ops.HostDenseOps` (the same arithmetic in numpy float32).
The weights are laid out once, at construction, for that backend's grouped product
``out = x @ w`` with ``w [G, Din, Dout]`` (a Hugging Face ``Linear`` weight ``[out, in]``
transposed). YaRN's attention factor multiplies RoPE's cos and sin; RoPE is linear, so it is
folded into the weights that produce the rotated parts (the rope rows of the query projection,
the rope columns of ``kv_a``).

MoE on static shapes (a CUDA graph replays each launch with the shapes it was captured with,
whatever the routing). The router (:mod:`~ddtree_numba.models.deepseek_v3.routing`) writes a
dense ``[T, E]`` weight matrix (zero where a token did not choose an expert) and each token's
``k`` chosen experts in increasing order. Then, fixed per ``allocate`` by the token count
(unless the ``moe`` argument names one):

* ``T k <= E`` (decoding: few tokens), *gathered*: one matrix-vector product per (token, chosen
  expert) pair, ``T k`` of them in one batched call whose matrix addresses are computed on the
  device (``ops.linear_gathered``), so only the chosen experts' weights are read, as an engine
  decoding one token does;
* otherwise (a tree of many nodes), *dense*: every expert on every token (two batched products
  over the stacked experts' weights, ``[E, T, F]`` in between). That is ``E / k`` times the
  expert FLOPs of a grouped MoE, but with ``T k > E`` (more pairs than experts) a grouped MoE
  reads most experts' weights too, and at a tree's ``T`` the weights, not the FLOPs, are
  what the layer waits for. Memory: ``E T (3 F + D)`` float32 activations, shared by the
  layers (3.3 GB at Moonlight's sizes and ``T = 2056``: bs 8, budget 256).

Either way each token then sums its chosen experts' outputs times their weights, experts in
increasing index, zero weights skipped (``add_gathered`` / ``add_routed``: the same order).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...arrays import BFLOAT16, CACHE_DTYPES, host_values
from ...kernels import SIMULATOR, allocate_workspace, as_device, verify_attn
from ...kernels.verify_attn import choose_variant
from ...validation import require_cache_dtype
from ..dense_ops import HostDenseOps
from . import reference as ref
from .config import DeepseekV3Config
from .routing import check_routing

WEIGHT_DTYPES = ("float32", "bfloat16")
MOE_PATHS = ("auto", "gathered", "dense")


def default_ops():
    """:class:`~ddtree_numba.models.dense_ops.HostDenseOps` on the simulator,
    :class:`~ddtree_numba.models.cublas_ops.CublasDenseOps` on a GPU."""
    if SIMULATOR:
        return HostDenseOps()
    from ..cublas_ops import CublasDenseOps
    return CublasDenseOps()


class DeepseekV3Target:
    """The absorbed-form forward on static buffers (``allocate`` once, ``forward`` per step).

    Parameters
    ----------
    config : DeepseekV3Config
    tensors : mapping
        Hugging Face tensor name -> array (a :class:`~ddtree_numba.models.deepseek_v3.Checkpoint`
        or a dict); each tensor is read once, here, and laid out on the device.
    cache_dtype : str
        ``"float32"``, ``"bfloat16"`` or ``"float16"``: how the cache stores its rows (each
        computed, rounded to float32, then once to the cache's type when written).
        ``kv_cache`` is ``[layers, num_pages, page_size, Dc + Dr]``.
    weight_dtype : str
        ``"float32"`` or ``"bfloat16"``: how the dense weights are kept (bfloat16 halves their
        memory; the products' inputs are then rounded to bfloat16 too, accumulation float32).
    ops : object, optional
        The dense-operations backend (default
        :func:`~ddtree_numba.models.deepseek_v3.target.default_ops`).
    moe : str
        ``"auto"`` (gathered when the step's ``T k <= E``, else dense: see the module
        docstring), ``"gathered"`` or ``"dense"``.
    """

    def __init__(self, config: DeepseekV3Config, tensors, *, cache_dtype: str = "float32",
                 weight_dtype: str = "float32", ops=None, moe: str = "auto"):
        if not isinstance(config, DeepseekV3Config):
            raise TypeError(f"config: expected a DeepseekV3Config, got {type(config).__name__}")
        require_cache_dtype("cache_dtype", cache_dtype)
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype: expected one of {WEIGHT_DTYPES}, got "
                             f"{weight_dtype!r}")
        if moe not in MOE_PATHS:
            raise ValueError(f"moe: expected one of {MOE_PATHS}, got {moe!r}")
        self.moe = moe
        self.config = c = config
        if c.n_routed_experts:
            check_routing(c)
        self.cache_dtype, self.weight_dtype = cache_dtype, weight_dtype
        self.ops = ops if ops is not None else default_ops()
        self.vocab = c.vocab_size
        inv_freq, factor = ref.rope_inv_freq(c)
        self.inv_freq = as_device(np.asarray(inv_freq, np.float64))
        self._load(tensors, factor)
        self.sizes = None
        #: A diagnostic: when a list, each MoE layer's chosen experts (``int32[T, k]``) are
        #: appended to it as host copies, in layer order. It synchronises, so eager mode only.
        self.routing_log = None

    # -- weights, laid out for ``ops.linear`` (``[G, Din, Dout]``) ------------------------------
    def _vector(self, tensors, name):
        return as_device(np.asarray(tensors[name], np.float32))

    def _matrix(self, weight):
        """A ``Linear`` weight ``[out, in]`` (float32 numpy) as ``[1, in, out]``, or an already
        grouped ``[G, Din, Dout]``, in the weight type."""
        w = np.ascontiguousarray(weight.T[None] if weight.ndim == 2 else weight,
                                 dtype=np.float32)
        if self.weight_dtype == "bfloat16":
            w = w.astype(BFLOAT16)                  # as_device keeps its bits, as uint16
        return as_device(w)

    def _load(self, tensors, attention_factor):
        c = self.config
        H, dn, dr, dv, Dc = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                             c.v_head_dim, c.kv_lora_rank)

        def read(name):                             # bfloat16 -> float32 is exact
            return np.asarray(tensors[name], np.float32)

        def split_query(q):                         # [H (dn + dr), in] -> nope, rope parts
            q = q.reshape(H, dn + dr, -1)
            return (self._matrix(q[:, :dn].reshape(H * dn, -1)),
                    self._matrix(q[:, dn:].reshape(H * dr, -1) * attention_factor))

        def gate_up_down(prefix):                   # [2F, D] (gate rows, then up), [D, F]
            return (np.concatenate([read(f"{prefix}.gate_proj.weight"),
                                    read(f"{prefix}.up_proj.weight")]),
                    read(f"{prefix}.down_proj.weight"))

        def mlp(prefix):                            # gate and up side by side: one product
            gate_up, down = gate_up_down(prefix)
            return self._matrix(gate_up), self._matrix(down)

        def experts(prefix):                        # every expert's, stacked: [E, D, 2F], [E, F, D]
            pairs = [gate_up_down(f"{prefix}.{e}") for e in range(c.n_routed_experts)]
            return (self._matrix(np.stack([gate_up.T for gate_up, _ in pairs])),
                    self._matrix(np.stack([down.T for _, down in pairs])))

        self.embed = as_device(np.asarray(tensors["model.embed_tokens.weight"], np.float32))
        self.final_norm = self._vector(tensors, "model.norm.weight")
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        self.lm_head = self._matrix(read(head))
        self.layers = []
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}"
            a = f"{p}.self_attn"
            w = {"attn_norm": self._vector(tensors, f"{p}.input_layernorm.weight"),
                 "ffn_norm": self._vector(tensors, f"{p}.post_attention_layernorm.weight"),
                 "kv_norm": self._vector(tensors, f"{a}.kv_a_layernorm.weight")}
            if c.q_lora_rank is None:
                w["q_nope"], w["q_rope"] = split_query(read(f"{a}.q_proj.weight"))
            else:
                w["q_a"] = self._matrix(read(f"{a}.q_a_proj.weight"))
                w["q_a_norm"] = self._vector(tensors, f"{a}.q_a_layernorm.weight")
                w["q_nope"], w["q_rope"] = split_query(read(f"{a}.q_b_proj.weight"))
            kv_a = read(f"{a}.kv_a_proj_with_mqa.weight").copy()          # [Dc + dr, D]
            kv_a[Dc:] *= attention_factor                                  # the rope columns
            w["kv_a"] = self._matrix(kv_a)
            kv_b = read(f"{a}.kv_b_proj.weight").reshape(H, dn + dv, Dc)
            w["w_uk"] = self._matrix(kv_b[:, :dn])                         # [H, dn, Dc]
            w["w_uv"] = self._matrix(kv_b[:, dn:].transpose(0, 2, 1))      # [H, Dc, dv]
            w["o"] = self._matrix(read(f"{a}.o_proj.weight"))
            if c.is_moe_layer(layer):
                w["router"] = as_device(np.ascontiguousarray(
                    read(f"{p}.mlp.gate.weight").T[None], np.float32))     # float32 always
                w["bias"] = self._vector(tensors, f"{p}.mlp.gate.e_score_correction_bias")
                w["experts"] = experts(f"{p}.mlp.experts")
                w["shared"] = mlp(f"{p}.mlp.shared_experts") if c.n_shared_experts else None
            else:
                w["mlp"] = mlp(f"{p}.mlp")
            self.layers.append(w)

    # -- the Target protocol --------------------------------------------------------------------
    def allocate(self, *, bs: int, N: int, num_pages: int, page_size: int,
                 max_pages: int) -> None:
        c = self.config
        T, H, Dc, dr = bs * N, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim

        def empty(*shape):
            return cuda.device_array(shape, np.float32)

        self.sizes = (bs, N)
        shape = (c.num_hidden_layers, num_pages, page_size, c.row_width)
        self.kv_cache = as_device(np.zeros(shape, CACHE_DTYPES[self.cache_dtype]),
                                  bf16_as_bits=False)
        self.x, self.h = empty(T, c.hidden_size), empty(T, c.hidden_size)
        if c.q_lora_rank is not None:
            self.q_a, self.q_a_normed = empty(T, c.q_lora_rank), empty(T, c.q_lora_rank)
        self.q_nope = empty(T, H * c.qk_nope_head_dim)
        self.q_latent, self.q_pe = empty(T, H * Dc), empty(T, H * dr)
        self.kv = empty(T, c.row_width)
        self.o_latent, self.lse = empty(bs, N, H, Dc), empty(bs, N, H)
        self.o = empty(T, H * c.v_head_dim)
        widths = set()                      # the MLP widths: dense layers, shared experts
        if any(not c.is_moe_layer(layer) for layer in range(c.num_hidden_layers)):
            widths.add(c.intermediate_size)
        if c.n_routed_experts:
            if c.n_shared_experts:
                widths.add(c.moe_intermediate_size * c.n_shared_experts)
            E, f, k = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok
            self.router_logits, self.route_weights = empty(T, E), empty(T, E)
            self.route_experts = cuda.device_array((T, k), np.int32)
            self.gathered_moe = (T * k <= E if self.moe == "auto"       # the module docstring's
                                 else self.moe == "gathered")           # rule
            rows = (T * k,) if self.gathered_moe else (E, T)    # per pair, or per expert x token
            self.expert_gate_up = empty(*rows, 2 * f)
            self.expert_act, self.expert_out = empty(*rows, f), empty(*rows, c.hidden_size)
        self.gate_up = {f: empty(T, 2 * f) for f in widths}
        self.act = {f: empty(T, f) for f in widths}
        self.logits = empty(T, c.vocab_size)
        self.variant = choose_variant(None, self.cache_dtype, Dc, dr, N)
        self.workspace = None if self.variant == "readable" else allocate_workspace(
            bs, N, H, Dc, max_pages * page_size, variant=self.variant)

    def kv_caches(self) -> list:
        return [self.kv_cache[layer] for layer in range(self.config.num_hidden_layers)]

    def attend(self, layer: int, tree, block_table, prefix_lens) -> None:
        """Layer ``layer``'s attention: ``o_latent = verify_attn(q_latent, q_pe, cache)``."""
        c = self.config
        bs, N = self.sizes
        H, Dc, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        verify_attn(self.q_latent.reshape(bs, N, H, Dc), self.q_pe.reshape(bs, N, H, dr),
                    self.kv_cache[layer], block_table, prefix_lens, tree.visibility_bits,
                    tree.num_nodes, sm_scale=c.sm_scale, out=(self.o_latent, self.lse),
                    variant=self.variant, workspace=self.workspace)

    def _mlp(self, weights, out):
        """``out += down(silu(gate(h)) * up(h))`` with ``weights = (gate_up, down)``."""
        gate_up, down = weights
        f = down.shape[1]
        self.ops.linear(self.h, gate_up, self.gate_up[f])
        self.ops.silu_mul(self.gate_up[f], self.act[f])
        self.ops.linear(self.act[f], down, out, residual=out)

    def _moe(self, w):
        """The routed experts (gathered: each token's chosen ones; dense: every expert on
        every token), summed with the routing weights; then the shared experts."""
        ops, c = self.ops, self.config
        ops.linear(self.h, w["router"], self.router_logits)
        ops.route(self.router_logits, w["bias"], c, self.route_weights, self.route_experts)
        if self.routing_log is not None:
            self.routing_log.append(host_values(self.route_experts))
        gate_up, down = w["experts"]
        f = self.config.moe_intermediate_size
        rows = self.expert_act.size // f                    # T k pairs, or E T
        if self.gathered_moe:
            ops.linear_gathered(self.h, gate_up, self.route_experts, self.expert_gate_up)
        else:
            ops.linear_batched(self.h, gate_up, self.expert_gate_up)
        ops.silu_mul(self.expert_gate_up.reshape(rows, 2 * f), self.expert_act.reshape(rows, f))
        if self.gathered_moe:
            ops.linear_gathered(self.expert_act, down, self.route_experts, self.expert_out)
            ops.add_gathered(self.expert_out, self.route_experts, self.route_weights, self.x)
        else:
            ops.linear_batched(self.expert_act, down, self.expert_out)
            ops.add_routed(self.expert_out, self.route_weights, self.x)
        if w["shared"] is not None:
            self._mlp(w["shared"], self.x)

    def forward(self, tree, block_table, prefix_lens):
        """Logits ``float32[bs * N, V]`` of every tree node; writes node ``j``'s row of every
        layer at slot ``P + j``. No host synchronisation on a GPU; every buffer preallocated."""
        c, ops = self.config, self.ops
        bs, N = self.sizes
        T, H, Dc = bs * N, c.num_attention_heads, c.kv_lora_rank
        eps, lora_eps = c.rms_norm_eps, ref.LORA_NORM_EPS
        positions = tree.positions.reshape(T)
        ops.embed(tree.token_ids.reshape(T), self.embed, self.x)
        for layer, w in enumerate(self.layers):
            ops.rms_norm(self.x, w["attn_norm"], self.h, eps)
            source = self.h
            if c.q_lora_rank is not None:
                ops.linear(self.h, w["q_a"], self.q_a)
                ops.rms_norm(self.q_a, w["q_a_norm"], self.q_a_normed, lora_eps)
                source = self.q_a_normed
            ops.linear(source, w["q_nope"], self.q_nope)
            ops.linear(self.q_nope, w["w_uk"], self.q_latent)              # absorb W_UK
            ops.linear(source, w["q_rope"], self.q_pe)
            ops.rope(self.q_pe, positions, self.inv_freq)
            ops.linear(self.h, w["kv_a"], self.kv)
            ops.kv_write(self.kv, w["kv_norm"], self.inv_freq, tree.positions, tree.num_nodes,
                         prefix_lens, block_table, self.kv_cache[layer], lora_eps)
            self.attend(layer, tree, block_table, prefix_lens)
            ops.linear(self.o_latent.reshape(T, H * Dc), w["w_uv"], self.o)  # absorb W_UV
            ops.linear(self.o, w["o"], self.x, residual=self.x)
            ops.rms_norm(self.x, w["ffn_norm"], self.h, eps)
            if "mlp" in w:
                self._mlp(w["mlp"], self.x)
            else:
                self._moe(w)
        ops.rms_norm(self.x, self.final_norm, self.h, eps)
        ops.linear(self.h, self.lm_head, self.logits)
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
