"""Small random checkpoints of the DeepSeek-V3 architecture, written as Hugging Face would.

``python -m ddtree_numba make-model DIR`` (or :func:`make_model`) writes ``config.json`` in the
form DeepSeek releases it (``model_type`` ``deepseek_v3``, YaRN under ``rope_scaling``),
``model.safetensors.index.json`` and the weights in bfloat16 shards
(``model-00001-of-0000n.safetensors``, the router's correction bias in float32 as in the
releases), with Hugging Face's tensor names: one matrix per routed expert, ``kv_a_proj_with_mqa``,
``kv_b_proj`` and so on. :class:`~ddtree_numba.models.deepseek_v3.Checkpoint` reads the result
like any downloaded checkpoint, so ``demo --model DIR`` can be tried without downloading weights.

Presets (every feature of the architecture on in both: a dense layer then MoE layers, grouped
routing with a correction bias, shared experts, YaRN, interleaved RoPE):

* ``tiny``: hidden 64, 4 heads, latent 32 + rope 8, query LoRA 24, 3 layers, 8 experts in 4
  groups, vocabulary 256: decodes on numba's CUDA simulator in seconds;
* ``small``: hidden 512, 8 heads, latent 512 + rope 64 (DeepSeek-V3's 576-wide cache rows),
  no query LoRA (as Moonlight), 3 layers, 16 experts, vocabulary 4096: 20.8 M parameters,
  41.7 MB, sized for a GPU.

The weights are seeded normal draws: a linear map of fan-in ``n`` gets standard deviation
``1.2 / sqrt(n)`` (activations keep their scale through the layers), the embedding 1, the
output head ``4 / sqrt(hidden)`` (logits of standard deviation ~4, so argmax near-ties are
rare), RMSNorm weights ``1 + 0.1 N(0, 1)``, router biases ``0.1 N(0, 1)``. The same preset and
seed give the same bytes.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from ...validation import require_int
from .checkpoint import INDEX, Checkpoint

PRESETS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                 n_shared_experts=1, max_position_embeddings=1024,
                 rope_scaling={"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 256, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "small": dict(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                  moe_intermediate_size=128, num_hidden_layers=3, first_k_dense_replace=1,
                  num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None,
                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                  topk_group=2, n_shared_experts=2, max_position_embeddings=16384,
                  rope_scaling={"type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 4096, "beta_fast": 32,
                                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}

#: The fields every preset shares, as in DeepSeek-V3's released config.json.
COMMON = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
          "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
          "topk_method": "noaux_tc", "moe_layer_freq": 1, "hidden_act": "silu",
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
          "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", "use_cache": True,
          "initializer_range": 0.02}


def tensor_shapes(config: dict) -> dict:
    """Hugging Face tensor name -> shape for a DeepSeek-V3 ``config.json`` dict, in the order
    the shards hold them."""
    D, V, H = config["hidden_size"], config["vocab_size"], config["num_attention_heads"]
    dn, dr, dv = (config["qk_nope_head_dim"], config["qk_rope_head_dim"],
                  config["v_head_dim"])
    Dc, q_lora = config["kv_lora_rank"], config["q_lora_rank"]
    shapes = {"model.embed_tokens.weight": (V, D)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes[f"{p}.input_layernorm.weight"] = (D,)
        a = f"{p}.self_attn"
        if q_lora:
            shapes[f"{a}.q_a_proj.weight"] = (q_lora, D)
            shapes[f"{a}.q_a_layernorm.weight"] = (q_lora,)
            shapes[f"{a}.q_b_proj.weight"] = (H * (dn + dr), q_lora)
        else:
            shapes[f"{a}.q_proj.weight"] = (H * (dn + dr), D)
        shapes[f"{a}.kv_a_proj_with_mqa.weight"] = (Dc + dr, D)
        shapes[f"{a}.kv_a_layernorm.weight"] = (Dc,)
        shapes[f"{a}.kv_b_proj.weight"] = (H * (dn + dv), Dc)
        shapes[f"{a}.o_proj.weight"] = (D, H * dv)
        shapes[f"{p}.post_attention_layernorm.weight"] = (D,)
        m = f"{p}.mlp"
        if layer < config["first_k_dense_replace"]:
            mlps = {m: config["intermediate_size"]}
        else:
            E, inner = config["n_routed_experts"], config["moe_intermediate_size"]
            shapes[f"{m}.gate.weight"] = (E, D)
            shapes[f"{m}.gate.e_score_correction_bias"] = (E,)
            mlps = {f"{m}.experts.{e}": inner for e in range(E)}
            mlps[f"{m}.shared_experts"] = inner * config["n_shared_experts"]
        for prefix, inner in mlps.items():
            shapes[f"{prefix}.gate_proj.weight"] = (inner, D)
            shapes[f"{prefix}.up_proj.weight"] = (inner, D)
            shapes[f"{prefix}.down_proj.weight"] = (D, inner)
    shapes["model.norm.weight"] = (D,)
    shapes["lm_head.weight"] = (V, D)
    return shapes


def random_tensor(name: str, shape: tuple, hidden: int, rng) -> np.ndarray:
    """One seeded weight (see the module docstring for the scales): bfloat16, except the
    router's correction bias (float32, as DeepSeek stores it)."""
    if name.endswith("e_score_correction_bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("norm.weight"):
        values = 1 + 0.1 * rng.standard_normal(shape)
    elif name == "model.embed_tokens.weight":
        values = rng.standard_normal(shape)
    elif name == "lm_head.weight":
        values = 4 / np.sqrt(hidden) * rng.standard_normal(shape)
    else:                                               # a linear map [out, in]
        values = 1.2 / np.sqrt(shape[1]) * rng.standard_normal(shape)
    return values.astype(ml_dtypes.bfloat16)


def make_model(folder: str, *, preset: str = "tiny", seed: int = 0, shards: int = 2,
               progress=None):
    """Write a random checkpoint of ``preset`` into ``folder`` (created if missing) and return
    it opened as a :class:`~ddtree_numba.models.deepseek_v3.Checkpoint`.

    Parameters
    ----------
    folder : str
        Must not already hold a ``config.json`` or safetensors files (nothing is overwritten;
        if writing fails midway, the files written so far are removed).
    preset : str
        ``"tiny"`` or ``"small"`` (``PRESETS`` in this module).
    seed : int
        Seeds every weight.
    shards : int
        Safetensors files to split the tensors over (at least 1; each gets a contiguous run of
        about the same number of tensors), listed by ``model.safetensors.index.json``.
    progress : callable, optional
        Called with ``(written, total)`` tensor counts as the tensors are made.
    """
    from safetensors.numpy import save_file

    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    seed = require_int("seed", seed, low=0, high=2**63 - 1)
    shards = require_int("shards", shards, low=1, high=999)
    if os.path.isdir(folder):
        taken = [f for f in sorted(os.listdir(folder))
                 if f == "config.json" or f == INDEX or f.endswith(".safetensors")]
        if taken:
            raise ValueError(f"folder: {folder!r} already holds a checkpoint ({taken[0]}); "
                             f"choose an empty or new folder")
    elif os.path.exists(folder):
        raise ValueError(f"folder: expected a directory, got {folder!r} (a file)")
    config = {**COMMON, **PRESETS[preset]}
    shapes = tensor_shapes(config)
    shards = min(shards, len(shapes))
    os.makedirs(folder, exist_ok=True)
    created = []                                # removed again if writing fails midway
    try:
        rng = np.random.default_rng(seed)
        weight_map, written, total = {}, 0, 0       # total: bytes, for the index
        for shard, run in enumerate(np.array_split(np.array(list(shapes)), shards)):
            file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
            tensors = {}
            for name in map(str, run):
                tensors[name] = random_tensor(name, shapes[name], config["hidden_size"], rng)
                total += tensors[name].nbytes
                weight_map[name] = file
                written += 1
                if progress is not None:
                    progress(written, len(shapes))
            created.append(os.path.join(folder, file))
            save_file(tensors, created[-1], metadata={"format": "pt"})
        for name, content in ((INDEX, {"metadata": {"total_size": total},
                                       "weight_map": weight_map}), ("config.json", config)):
            created.append(os.path.join(folder, name))
            with open(created[-1], "w") as f:
                json.dump(content, f, indent=2)
    except BaseException:                       # an I/O error, Ctrl-C: leave no half checkpoint
        for path in created:
            if os.path.exists(path):
                os.remove(path)
        raise
    return Checkpoint(folder)
