"""Benchmark: the greedy DDTree step on the DeepSeek-V3 target at Moonlight-16B-A3B's layer
sizes, bfloat16 weights and cache, against plain greedy decoding of the same model.

The model: Moonlight-16B-A3B's per-layer dimensions (hidden 2048, 16 heads, MLA latent 512 +
rope 64, nope 128, value 128, no query LoRA, 64 routed experts of width 1408 with 6 a token
and 2 shared, sigmoid routing, the first layer dense with width 11264, vocabulary 163 840) with
``--layers`` layers instead of 27 (default 4: one dense, three MoE; about 2.4 B parameters),
random weights (``make_model``'s scales, so that logits have standard deviation ~4).

Per ``(bs, budget)``, in one run:

* ``plain_us_per_token``: one-token decoding (budget 0, graph mode) of the same target, device
  time per step (events), so per token per request, with the MoE gathered (each token's chosen
  experts only, as an engine decodes); ``plain_dense_moe_us``: the same with every expert on
  every token (what the step's MoE does at a tree's token count);
* ``eager_device_us`` / ``graph_device_us``: a DDTree step, device time (events, median);
  ``eager_equals_graph``: both modes emitted the same tokens over the timed steps;
  ``launches``: the numba kernels of one eager step (the cuBLAS calls not counted);
  ``tokens_per_step``: tokens emitted per request per step (the drafter follows the plain
  decoding 80 % of the time, L 8, K 8);
* ``speedup``: ``tokens_per_step * plain_us_per_token / graph_device_us``;
* ``agree``: the share of requests whose speculative tokens equal the plain decoding's over
  their common length (bfloat16 rounds a tree forward and a one-token forward differently,
  so near-ties can flip);
* per stage (graph replay of each stage alone, no L2 flush): the drafter, draft_topk,
  build_tree, target_forward (``attention_us``: the part spent in ``verify_attn``), argmax,
  accept + commit.

Then the agreement study (``--agreement``, ``AGREE_BS`` prompts, budget 64, eager): where the
step's tokens first differ from one-token decoding, and how close to a tie the one-token
decoding's logits were there (``margin``: its best logit minus its second best), against the
bfloat16 noise between the two forwards (``root_noise``: the largest difference between the
root's logits in the tree forward and in the one-token forward, the same context both;
``root_routing_flips``: the MoE layers where the two forwards chose other experts for the
root).

``--agreement-float32`` runs the study alone on the same model with float32 weights and cache
(the rounding then ~2^-24 instead of 2^-9: whether the differences come from rounding).

Writes ``$OUT/bench_deepseek_step.csv`` and ``$OUT/deepseek_agreement[_float32].csv``.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from bench_step import count_launches, stage_times, time_steps
from harness import Bench, print_table

from ddtree_numba import GreedyStep
from ddtree_numba.models.deepseek_v3 import DeepseekV3Config
from ddtree_numba.models.deepseek_v3.make_model import COMMON, random_tensor, tensor_shapes
from ddtree_numba.models.deepseek_v3.target import DeepseekV3Target
from ddtree_numba.models.toy_drafter import ToyDrafter

MOONLIGHT_LAYER = dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264,
                       moe_intermediate_size=1408, first_k_dense_replace=1,
                       num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                       v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_group=1,
                       topk_group=1, n_shared_experts=2, max_position_embeddings=8192,
                       rope_theta=50000.0, rope_scaling=None)
L, TOPK, STEPS = 8, 8, 8
AGREE_BS, AGREE_STEPS, AGREE_BUDGET = 16, 12, 64


def random_model(layers: int, seed: int = 0):
    """``(config, tensors)``: the model above with ``layers`` layers, weights in memory."""
    fields = {**COMMON, **MOONLIGHT_LAYER, "num_hidden_layers": layers}
    config = DeepseekV3Config.from_dict(fields)
    rng = np.random.default_rng(seed)
    tensors = {name: random_tensor(name, shape, fields["hidden_size"], rng)
               for name, shape in tensor_shapes(fields).items()}
    return config, tensors


def make_step(target, continuation, *, bs, budget, steps, mode):
    """A GreedyStep of at most ``steps`` steps after each ``start`` (``time_steps`` runs 2
    warm-up steps, then the timed ones)."""
    return GreedyStep(target, ToyDrafter(continuation, vocab=target.vocab, accuracy=0.8,
                                         seed=0),
                      bs=bs, L=L, K=TOPK, budget=budget, max_steps=steps, mode=mode)


def continuation_of(starts, plain_tokens) -> np.ndarray:
    """``int32[bs, 1 + longest]``: each start token, then its plain greedy decoding (what the
    toy drafter follows)."""
    out = np.zeros((len(starts), max(map(len, plain_tokens)) + 1), np.int32)
    out[:, 0] = starts
    for b, tokens in enumerate(plain_tokens):
        out[b, 1: len(tokens) + 1] = tokens
    return out


def margins(logits) -> np.ndarray:
    """Best minus second-best logit of each row."""
    top2 = np.partition(logits, -2, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def agreement(target, starts):
    """Per request: the first token where the step (budget ``AGREE_BUDGET``) differs from
    one-token decoding, the one-token decoding's margin there, and the root's noise."""
    bs = len(starts)
    plain = make_step(target, np.zeros((bs, 2), np.int32), bs=bs, budget=0,
                      steps=AGREE_STEPS * (L + 1) + 2, mode="eager")
    plain.start(starts)
    plain_margins, root_plain = [], None
    target.routing_log = plain_routes = []          # the first step's: the root's routing
    for _ in range(plain.max_steps):
        plain()
        target.routing_log = None
        logits = plain.target_logits.copy_to_host()                 # [bs, V]: N = 1
        root_plain = logits if root_plain is None else root_plain
        plain_margins.append(margins(logits))
    plain_tokens, plain_margins = plain.tokens(), np.array(plain_margins).T   # [bs, steps]
    continuation = continuation_of(starts, plain_tokens)
    step = make_step(target, continuation, bs=bs, budget=AGREE_BUDGET, steps=AGREE_STEPS,
                     mode="eager")
    step.start(starts)
    target.routing_log = tree_routes = []
    step()
    target.routing_log = None
    N = AGREE_BUDGET + 1
    root_tree = step.target_logits.copy_to_host().reshape(bs, N, -1)[:, 0]
    for _ in range(AGREE_STEPS - 1):
        step()
    rows = []
    for b, (spec, ref_tokens) in enumerate(zip(step.tokens(), plain_tokens, strict=True)):
        n = min(len(spec), len(ref_tokens))
        first = next((i for i in range(n) if spec[i] != ref_tokens[i]), None)
        rows.append(dict(request=b, tokens_compared=n, first_difference=first,
                         margin_there=None if first is None else float(plain_margins[b, first]),
                         root_noise=float(np.abs(root_tree[b] - root_plain[b]).max()),
                         # MoE layers whose experts for the root differ between the forwards
                         root_routing_flips=sum(
                             set(plain_layer[b]) != set(tree_layer[b * N])
                             for plain_layer, tree_layer in zip(plain_routes, tree_routes,
                                                                strict=True)),
                         median_margin=float(np.median(plain_margins[b, :n])),
                         smallest_margin_before=float(plain_margins[b, :first if first
                                                                     is not None else n].min())
                         if first != 0 else None))
    return rows


def main(layers: int = 4, quick: bool = False, agree: bool = False):
    bench = Bench("bench_deepseek_step")
    t0 = time.perf_counter()
    config, tensors = random_model(layers)
    target = DeepseekV3Target(config, tensors, cache_dtype="bfloat16",
                              weight_dtype="bfloat16")
    del tensors
    print(f"model: {layers} layers at Moonlight-16B-A3B's sizes, loaded in "
          f"{time.perf_counter() - t0:.0f} s")
    configs = [(1, 64)] if quick else [(1, 64), (1, 256), (8, 64)]
    rng = np.random.default_rng(1)
    for bs, budget in configs:
        starts = rng.integers(0, config.vocab_size, bs).astype(np.int32)
        plain_steps = (STEPS + 2) * (L + 1)         # as many tokens as the DDTree run can emit
        target.moe = "dense"
        plain = make_step(target, np.zeros((bs, 2), np.int32), bs=bs, budget=0,
                          steps=plain_steps + 2, mode="graph")
        _, plain_dense_us = time_steps(plain, starts, plain_steps)
        target.moe = "auto"                         # gathered at one token a request
        plain = make_step(target, np.zeros((bs, 2), np.int32), bs=bs, budget=0,
                          steps=plain_steps + 2, mode="graph")
        _, plain_us = time_steps(plain, starts, plain_steps)
        plain_tokens = plain.tokens()
        continuation = continuation_of(starts, plain_tokens)
        row = {"bs": bs, "budget": budget, "layers": layers, "L": L, "K": TOPK,
               "plain_us_per_token": plain_us, "plain_dense_moe_us": plain_dense_us}
        for mode in ("eager", "graph"):
            step = make_step(target, continuation, bs=bs, budget=budget, steps=STEPS + 3,
                             mode=mode)             # + 3: warm-up, timed, the launch count
            _, device_us = time_steps(step, starts, STEPS)
            row[f"{mode}_device_us"] = device_us
            if mode == "eager":
                eager_tokens = step.tokens()
                row["launches"] = count_launches(step)
            else:
                tokens = step.tokens()
                row["eager_equals_graph"] = tokens == eager_tokens
                row["tokens_per_step"] = float(np.mean([len(t) for t in tokens])
                                               / step.steps_done)
                row["agree"] = float(np.mean([
                    t[: len(p)] == p[: len(t)] for t, p in zip(tokens, plain_tokens,
                                                                strict=True)]))
                for name, us in stage_times(bench, step, reps=20,
                                            attention_name="attention").items():
                    row[f"{name}_us"] = us
        row["speedup"] = row["tokens_per_step"] * plain_us / row["graph_device_us"]
        bench.add(**row)
        bench.write_csv()                           # incrementally: a timeout keeps the rest
        print_table([row], list(row), f"bs {bs}, budget {budget}")
    cols = ["bs", "budget", "launches", "plain_us_per_token", "plain_dense_moe_us",
            "eager_device_us", "graph_device_us", "tokens_per_step", "speedup", "agree",
            "eager_equals_graph"]
    print_table(bench.rows, cols, f"DeepSeek-V3 target ({layers} layers at Moonlight's sizes, "
                f"bf16) on {bench.gpu}")
    print("wrote", bench.write_csv())
    if agree:
        agreement_study(target, "bfloat16")


def agreement_study(target, dtype: str):
    """The agreement study on ``target`` (weights and cache in ``dtype``), to
    ``$OUT/deepseek_agreement[_float32].csv``."""
    study = Bench("deepseek_agreement" + ("" if dtype == "bfloat16" else f"_{dtype}"))
    starts = np.random.default_rng(2).integers(0, target.vocab, AGREE_BS)
    for row in agreement(target, starts.astype(np.int32)):
        study.add(weights_and_cache=dtype, **row)
    print_table(study.rows, list(study.rows[0])[3:],
                f"Where the step (budget {AGREE_BUDGET}) first differs from one-token "
                f"decoding ({dtype} weights and cache)")
    print("wrote", study.write_csv())


if __name__ == "__main__":
    layers = [int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--layers=")]
    if "--agreement-float32" in sys.argv:      # the study alone, float32 weights and cache
        config, tensors = random_model(layers[0] if layers else 4)
        agreement_study(DeepseekV3Target(config, tensors, cache_dtype="float32",
                                         weight_dtype="float32"), "float32")
    else:
        main(layers=layers[0] if layers else 4, quick="--quick" in sys.argv,
             agree="--agreement" in sys.argv)
