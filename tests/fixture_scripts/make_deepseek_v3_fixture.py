"""Make the tiny DeepSeek-V3 fixtures: checkpoints and logits computed by Hugging Face transformers.

Written against transformers 5.24.0 with torch 2.13.0 (CPU). The tests that read these fixtures need
neither: they load the weights with safetensors/numpy and compare their own forward pass with the
logits stored here.

For each variant this writes ``tests/fixtures/deepseek_v3_tiny/<variant>/``:

* ``config.json`` and the weights (float32), from ``save_pretrained``; routed experts are
  stored one matrix per expert (``mlp.experts.<e>.{gate,up,down}_proj.weight``), as on the Hub;
* ``generation_config.json``, also from ``save_pretrained``;
* ``expected.npz``:

  - ``input_ids`` int32 [2, 12], random token ids (positions 0..11, causal mask, no cache);
  - ``logits`` float64 [2, 12, vocab], the forward of the model cast with ``.double()``.
    transformers still does some steps in float32 in that mode (RMSNorm, the rotary cos/sin, the
    router's scores, the attention softmax), so a reimplementation done wholly in float64 agrees
    to about 4e-6 (absolute, logits up to 16), not 1e-12;
  - ``logits_float32`` float32 [2, 12, vocab], the forward of the float32 model;
  - ``layer0_attn_out`` float64 [2, 12, hidden], the output of layer 0's self-attention
    (after ``o_proj``, before the residual add), from the float64 forward;
  - ``transformers_version`` and ``torch_version``, 0-d string arrays.

To run the saved checkpoint through transformers again, load it with
``DeepseekV3ForCausalLM.from_pretrained(folder, attn_implementation="eager",
experts_implementation="eager")`` and ``torch.set_num_threads(1)``: then the float32 logits come
out bit for bit. config.json keeps neither choice, and the defaults (SDPA attention, grouped-GEMM
experts) give float32 logits a few 1e-6 away.

The variants:

* ``q_lora``: 3 layers (layer 0 dense, layers 1-2 MoE), query through the LoRA pair
  ``q_a_proj -> q_a_layernorm -> q_b_proj``;
* ``no_q_lora``: 2 layers (layer 0 dense, layer 1 MoE), query through one ``q_proj``;
* ``dense_no_yarn``: 2 dense layers, the query LoRA, rotary embeddings without scaling, saved
  in several files (``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``).

The first two use YaRN rotary scaling, grouped top-k routing with a score correction bias and
one shared expert; all three interleaved rotary weights and untied embeddings. The script is
deterministic: run it again and the files come out the same. Run it from the repository root,
with a Python environment that has torch, transformers, safetensors and numpy::

    /path/to/venv/bin/python tests/fixture_scripts/make_deepseek_v3_fixture.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RMSNorm,
    DeepseekV3TopkRouter,
)

OUT_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v3_tiny"

SEED = 22  # one whose routing is far from any tie (see MIN_ROUTING_MARGIN)
BATCH, SEQ_LEN = 2, 12

# Standard deviations of the random weights, chosen so that attention is far from uniform and
# the logits are O(1-10).
LINEAR_STD = 0.15  # every nn.Linear weight, the router weights and the expert matrices
EMBED_STD = 1.0  # token embeddings
LM_HEAD_STD = 0.5  # output projection (it reads the unit-scale output of the final norm)
NORM_WEIGHT_STD = 0.1  # RMSNorm weights are 1 + NORM_WEIGHT_STD * randn
BIAS_STD = 0.1  # e_score_correction_bias of each MoE router

# A reimplementation must route every token to the same experts as transformers, so no choice of
# the routers may be a near tie: every group and expert kept must beat every one left out by this.
MIN_ROUTING_MARGIN = 5e-3

# Settings shared by both variants: every feature of the architecture switched on.
BASE_CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,  # dense MLP (layers < first_k_dense_replace)
    moe_intermediate_size=32,  # each routed expert, and the shared expert (times n_shared_experts)
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rope_interleave=True,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    num_mtp_layers=0,  # no multi-token-prediction module: the checkpoint holds the base model only
    dtype="float32",
    attn_implementation="eager",
    experts_implementation="eager",
)

VARIANTS = {
    "q_lora": dict(q_lora_rank=24, num_hidden_layers=3),
    "no_q_lora": dict(q_lora_rank=None, num_hidden_layers=2),
    # every layer dense, RoPE without scaling (the softmax scale without YaRN's mscale)
    "dense_no_yarn": dict(q_lora_rank=24, num_hidden_layers=2, first_k_dense_replace=2,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
# variants saved in several safetensors files with a model.safetensors.index.json, as the Hub
# ships large checkpoints (the other variants: one model.safetensors)
SHARDED = {"dense_no_yarn": "40KB"}


def randomize_weights(model: DeepseekV3ForCausalLM, generator: torch.Generator) -> None:
    """Overwrite every weight of ``model`` with seeded random values (see the *_STD constants)."""

    def randn(shape) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if isinstance(module, DeepseekV3RMSNorm):
                    param.copy_(1.0 + NORM_WEIGHT_STD * randn(param.shape))
                elif module is model.model.embed_tokens:
                    param.copy_(EMBED_STD * randn(param.shape))
                elif module is model.lm_head:
                    param.copy_(LM_HEAD_STD * randn(param.shape))
                else:
                    param.copy_(LINEAR_STD * randn(param.shape))
            if isinstance(module, DeepseekV3TopkRouter):
                bias = module.e_score_correction_bias  # a buffer, zeros after __init__
                bias.copy_(BIAS_STD * randn(bias.shape))


def forward(model: DeepseekV3ForCausalLM, input_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Logits of a plain forward (positions 0..T-1, causal mask, no cache) and the output of
    layer 0's self-attention, both as numpy arrays."""
    captured = {}

    def keep_attn_out(module, args, output):
        captured["attn_out"] = output[0].detach()

    hook = model.model.layers[0].self_attn.register_forward_hook(keep_attn_out)
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        hook.remove()
    return logits.numpy(), captured["attn_out"].numpy()


def routing_margin(model: DeepseekV3ForCausalLM, input_ids: torch.Tensor) -> float:
    """Smallest gap, over the MoE layers and the tokens, between the last group (by group score) or
    expert (by bias-corrected score) that a router keeps and the first one that it leaves out."""
    gaps = []

    def record_gaps(router, args, output):
        router_logits = output[0].double()
        choice = router_logits.sigmoid() + router.e_score_correction_bias.double()
        grouped = choice.view(len(choice), router.num_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(router.topk_group + 1, dim=-1)
        gaps.append((best.values[:, -2] - best.values[:, -1]).min())

        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, best.indices[:, :-1], True)
        kept_choice = grouped.masked_fill(~kept[:, :, None], float("-inf")).flatten(1)
        best = kept_choice.topk(router.top_k + 1, dim=-1)
        gaps.append((best.values[:, -2] - best.values[:, -1]).min())

    routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
    if not routers:  # dense layers only: no routing decision to keep away from a tie
        return float("inf")
    hooks = [router.register_forward_hook(record_gaps) for router in routers]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return min(gaps).item()


def make_variant(name: str, overrides: dict) -> None:
    out = OUT_DIR / name
    out.mkdir(parents=True, exist_ok=True)

    config = DeepseekV3Config(**{**BASE_CONFIG, **overrides})
    torch.manual_seed(SEED)  # the constructor's own init; every weight is overwritten below
    model = DeepseekV3ForCausalLM(config).eval()
    randomize_weights(model, torch.Generator().manual_seed(SEED))

    ids_generator = torch.Generator().manual_seed(SEED + 1)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ_LEN), generator=ids_generator)

    margin = routing_margin(model, input_ids)
    assert margin > MIN_ROUTING_MARGIN, f"{name}: routing margin {margin:.1e}, try another SEED"
    if name in SHARDED:
        model.save_pretrained(out, safe_serialization=True, max_shard_size=SHARDED[name])
    else:
        model.save_pretrained(out, safe_serialization=True)

    logits32, _ = forward(model, input_ids)
    logits64, attn_out64 = forward(model.double(), input_ids)
    assert logits64.dtype == np.float64 and attn_out64.dtype == np.float64

    np.savez(
        out / "expected.npz",
        input_ids=input_ids.numpy().astype(np.int32),
        logits=logits64,
        logits_float32=logits32,
        layer0_attn_out=attn_out64,
        transformers_version=np.array(transformers.__version__),
        torch_version=np.array(torch.__version__),
    )

    gap = np.abs(logits64 - logits32).max()
    print(f"{name}: logits std {logits64.std():.3f}, max |logit| {np.abs(logits64).max():.3f}, "
          f"max |float64 - float32| {gap:.1e}, routing margin {margin:.1e}")
    for path in sorted(out.iterdir()):
        print(f"  {path.relative_to(OUT_DIR.parent)}  {path.stat().st_size} bytes")


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one summation order, whatever the machine
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name, overrides in VARIANTS.items():
        make_variant(name, overrides)


if __name__ == "__main__":
    main()
