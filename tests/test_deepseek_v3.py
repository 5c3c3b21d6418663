"""The DeepSeek-V3 architecture: config reading, checkpoint loading, and the numpy reference
forward against Hugging Face ``transformers`` (fixtures written by transformers itself:
``tests/fixture_scripts/make_deepseek_v3_fixture.py``; CI needs neither torch nor transformers).
"""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from ddtree_numba.models.deepseek_v3 import Checkpoint, DeepseekV3Config
from ddtree_numba.models.deepseek_v3 import reference as ref
from ddtree_numba.models.deepseek_v3.checkpoint import dequantize_fp8

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "deepseek_v3_tiny")
#: the checkpoints transformers wrote (tests/fixture_scripts/make_deepseek_v3_fixture.py): with
#: and without the query LoRA (YaRN, a dense layer then grouped MoE), and every layer dense
#: without RoPE scaling, in several safetensors files
GOLDEN = ["q_lora", "no_q_lora", "dense_no_yarn"]

#: The architecture fields of DeepSeek-V3's and Kimi-K2's released config.json files.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
    "use_cache": True, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "ep_size": 1,
    "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840,
           "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
           "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
           "routed_scaling_factor": 2.827, "max_position_embeddings": 131072,
           "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 32.0},
           "rope_theta": 50000.0}


@pytest.mark.parametrize("d, heads, scale", [(DEEPSEEK_V3, 128, 0.1352338),
                                             (KIMI_K2, 64, 0.1308608)])
def test_released_configs_read_with_their_softmax_scale(d, heads, scale):
    c = DeepseekV3Config.from_dict(d)
    assert c.num_attention_heads == heads and c.row_width == 576 and c.q_lora_rank == 1536
    # 1/sqrt(192) times (0.1 ln(factor) + 1)^2: DeepSeek-V3's own inference code does the same
    assert c.sm_scale == pytest.approx(scale, rel=1e-6)
    assert c.is_moe_layer(c.first_k_dense_replace) and not c.is_moe_layer(0)


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 4096}, "sliding_window: unknown config field"),
    ({"hidden_act": "gelu"}, "hidden_act: expected 'silu'"),
    ({"scoring_func": "softmax"}, "scoring_func: expected 'sigmoid'"),
    ({"num_key_value_heads": 8}, "num_key_value_heads: expected num_attention_heads"),
    ({"model_type": "llama"}, "model_type: expected one of"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling: expected type 'yarn'"),
    ({"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "low_freq_factor": 1}},
     "rope_scaling.low_freq_factor: unknown"),
    ({"n_group": 7}, "n_group: expected a divisor"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim: expected an even width"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok: expected 1..n_routed_experts"),
])
def test_unknown_fields_and_unsupported_values_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        DeepseekV3Config.from_dict({**DEEPSEEK_V3, **change})


@pytest.mark.parametrize("field", ["n_group", "n_shared_experts", "q_lora_rank",
                                   "moe_intermediate_size", "max_position_embeddings"])
def test_a_missing_field_is_refused_rather_than_defaulted(field):
    """transformers defaults n_group to 8 and n_shared_experts to 1; a dataclass default
    would say 1 and 0: neither is assumed."""
    d = {k: v for k, v in DEEPSEEK_V3.items() if k != field}
    with pytest.raises(ValueError, match=f"{field}: missing from the config"):
        DeepseekV3Config.from_dict(d)


@pytest.mark.parametrize("rope, message", [
    ({"factor": 20}, "rope_scaling.factor: expected max_position_embeddings"),
    ({"mscale": None}, "rope_scaling.mscale: missing while mscale_all_dim is set"),
])
def test_yarn_settings_that_implementations_read_differently_are_refused(rope, message):
    scaling = {**DEEPSEEK_V3["rope_scaling"], **rope}
    scaling = {k: v for k, v in scaling.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        DeepseekV3Config.from_dict({**DEEPSEEK_V3, "rope_scaling": scaling})


def test_yarn_frequencies_blend_original_and_interpolated():
    c = DeepseekV3Config.from_dict(DEEPSEEK_V3)
    inv_freq, factor = ref.rope_inv_freq(c)
    plain = 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)
    assert factor == 1.0                                  # mscale == mscale_all_dim
    assert np.allclose(inv_freq[:10], plain[:10])         # fast dims: extrapolated (original)
    assert np.allclose(inv_freq[-8:], plain[-8:] / 40)    # slow dims: interpolated by 40
    assert (np.diff(inv_freq) < 0).all()


# -- checkpoints ------------------------------------------------------------------------------

def write_safetensors(path, tensors: dict):
    """A safetensors file written by hand (the format: 8-byte header length, JSON, data)."""
    codes = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_sharded_fp8_checkpoint_is_read_lazily_and_dequantised(tmp_path):
    rng = np.random.default_rng(0)
    config = {**DEEPSEEK_V3, "num_hidden_layers": 2, "first_k_dense_replace": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    w = rng.standard_normal((200, 300)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2, (2, 3)).astype(np.float32)
    norm = rng.standard_normal(300).astype(ml_dtypes.bfloat16)
    write_safetensors(tmp_path / "a.safetensors", {
        "model.layers.0.self_attn.q_a_proj.weight": w,
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": scale})
    write_safetensors(tmp_path / "b.safetensors", {
        "model.layers.1.input_layernorm.weight": norm,
        "model.layers.2.input_layernorm.weight": norm})        # the MTP layer: not listed
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.layers.0.self_attn.q_a_proj.weight": "a.safetensors",
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": "a.safetensors",
        "model.layers.1.input_layernorm.weight": "b.safetensors",
        "model.layers.2.input_layernorm.weight": "b.safetensors"}}))
    ckpt = Checkpoint(str(tmp_path))
    assert list(ckpt) == ["model.layers.0.self_attn.q_a_proj.weight",
                          "model.layers.1.input_layernorm.weight"]
    assert ckpt._handles == {}                                 # nothing opened yet
    got = ckpt["model.layers.0.self_attn.q_a_proj.weight"]
    want = w.astype(np.float32) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200, :300]
    np.testing.assert_array_equal(got, want)
    assert list(ckpt._handles) == ["a.safetensors"]            # only the shard it needed
    norm_got = ckpt["model.layers.1.input_layernorm.weight"]
    assert norm_got.dtype == ml_dtypes.bfloat16 and np.array_equal(norm_got, norm)
    with pytest.raises(KeyError, match="no such tensor"):
        ckpt["model.layers.2.input_layernorm.weight"]


def test_checkpoint_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="folder: expected a checkpoint folder"):
        Checkpoint(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    with pytest.raises(ValueError, match="holds neither model.safetensors"):
        Checkpoint(str(tmp_path))
    bad = {**DEEPSEEK_V3, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="quantization_config: only DeepSeek's block float8"):
        Checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match=r"scale_inv: expected float32\[2, 3\]"):
        dequantize_fp8(np.zeros((200, 300), np.float32), np.ones((2, 2), np.float32),
                       (128, 128))


# -- the reference forward against transformers ------------------------------------------------

@pytest.mark.parametrize("name", GOLDEN)
def test_reference_forward_equals_transformers(name):
    """Logits of two sequences of 12 tokens (causal), float64, against transformers' eager
    float64 forward of the same checkpoint: MLA with and without the query LoRA, YaRN RoPE
    (interleaved) and plain RoPE, dense layers, the group-limited sigmoid router, shared
    experts; one checkpoint sharded.

    The bound: transformers keeps four steps in float32 in a float64 model (RMSNorm, the RoPE
    frequencies with their cos and sin, the router, the attention softmax): the stored logits
    are 3.8e-6 from float64 at most (|logits| <= 16), layer 0's attention 2.5e-7; with those
    four steps patched to float64, transformers equals a float64 numpy forward to 2e-14 (checked
    when the fixtures were made). A wrong rope layout, scale or routing moves logits by O(1).
    The fixture's seed keeps every routing decision at least 7.8e-3 from a tie."""
    folder = os.path.join(FIXTURES, name)
    expected = np.load(os.path.join(folder, "expected.npz"))
    ckpt = Checkpoint(folder)
    for b, tokens in enumerate(expected["input_ids"]):
        logits, _ = ref.forward(ckpt.config, ckpt, tokens, np.arange(len(tokens)))
        want = expected["logits"][b]
        np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5)
        assert (logits.argmax(-1) == want.argmax(-1)).all()


def test_reference_with_a_cached_prefix_equals_the_whole_sequence():
    """Running 12 tokens as 7 cached ones then 5 new ones gives the same logits and rows: the
    cache rows are all that attention needs of the past."""
    folder = os.path.join(FIXTURES, "q_lora")
    ckpt = Checkpoint(folder)
    tokens = np.load(os.path.join(folder, "expected.npz"))["input_ids"][0]
    whole, rows = ref.forward(ckpt.config, ckpt, tokens, np.arange(12))
    _, prefix = ref.forward(ckpt.config, ckpt, tokens[:7], np.arange(7))
    tail, tail_rows = ref.forward(ckpt.config, ckpt, tokens[7:], np.arange(7, 12),
                                  prefix_rows=prefix)
    np.testing.assert_allclose(tail, whole[7:], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(tail_rows, rows[:, 7:], rtol=1e-12, atol=1e-12)


def test_the_transformers_bound_catches_a_wrong_rope_layout(monkeypatch):
    """The tolerance above is far below what a plausible mistake moves: RoPE on split halves
    (``rotate_half`` without the interleave) instead of interleaved pairs."""
    folder = os.path.join(FIXTURES, "q_lora")
    expected = np.load(os.path.join(folder, "expected.npz"))
    ckpt = Checkpoint(folder)
    tokens = expected["input_ids"][0]
    right = ref.rope

    def halves(x, positions, inv_freq, attention_factor=1.0):
        half = x.shape[-1] // 2
        pairs = np.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)
        rotated = right(pairs, positions, inv_freq, attention_factor)
        return np.concatenate([rotated[..., 0::2], rotated[..., 1::2]], axis=-1)

    monkeypatch.setattr(ref, "rope", halves)
    logits, _ = ref.forward(ckpt.config, ckpt, tokens, np.arange(len(tokens)))
    assert np.abs(logits - expected["logits"][0]).max() > 1e-2


# -- the absorbed forward and the step on the DeepSeek-V3 target ----------------------------------

def chain_tree(tokens):
    """The device inputs of ``bs`` causal chains (each row sees itself and the rows before)."""
    from types import SimpleNamespace

    from ddtree_numba.kernels import as_device

    bs, N = tokens.shape
    bits = np.zeros((bs, N, (N + 31) // 32), np.uint32)
    for i in range(N):
        for j in range(i + 1):
            bits[:, i, j // 32] |= np.uint32(1 << (j % 32))
    positions = np.tile(np.arange(N, dtype=np.int32), (bs, 1))
    return SimpleNamespace(token_ids=as_device(tokens.astype(np.int32)),
                           positions=as_device(positions), visibility_bits=as_device(bits),
                           num_nodes=as_device(np.full(bs, N, np.int32)))


@pytest.mark.parametrize("name, moe", [(name, moe) for name in GOLDEN for moe in
                                       (("dense",) if name == "dense_no_yarn"   # no MoE layer
                                        else ("dense", "gathered"))])
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_absorbed_forward_equals_transformers(name, weight_dtype, moe):
    """The target's forward (absorbed MLA, the dense layers on this backend: numpy float32 on
    the simulator, cuBLAS on a GPU; MoE over every expert or over each token's chosen ones)
    over two causal chains of 12 tokens, in a shuffled paged cache, against transformers'
    logits.

    Bounds: float32 weights, 5e-5 (transformers' own float32 steps give 3.8e-6, float32
    products over widths <= 128 about 1e-5; measured 1.2e-5 on the simulator). bfloat16
    weights, 2 % of the largest logit: every product then rounds its inputs to bfloat16
    (relative error up to 2^-9 each, a dozen roundings on the way to a logit; measured 0.13 at
    |logits| <= 16)."""
    from ddtree_numba.arrays import host_values
    from ddtree_numba.kernels import as_device
    from ddtree_numba.models.deepseek_v3.target import DeepseekV3Target

    folder = os.path.join(FIXTURES, name)
    expected = np.load(os.path.join(folder, "expected.npz"))
    ckpt = Checkpoint(folder)
    tokens = expected["input_ids"]
    bs, N = tokens.shape
    target = DeepseekV3Target(ckpt.config, ckpt, weight_dtype=weight_dtype, moe=moe)
    target.allocate(bs=bs, N=N, num_pages=8, page_size=4, max_pages=3)
    assert target.gathered_moe == (moe == "gathered")
    table = np.array([[5, 0, 3], [1, 7, 2]], np.int32)                 # shuffled pages
    logits = target.forward(chain_tree(tokens), as_device(table),
                            as_device(np.zeros(bs, np.int32)))
    got = host_values(logits).reshape(bs, N, -1)
    want = expected["logits"]
    bound = 5e-5 if weight_dtype == "float32" else 0.02 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    if weight_dtype == "float32":
        assert (got.argmax(-1) == want.argmax(-1)).all()


def test_routing_log_keeps_each_moe_layers_chosen_experts():
    """The diagnostic behind the bf16 agreement study: with ``routing_log`` a list, a forward
    appends each MoE layer's ``[T, k]`` choice (distinct experts, increasing)."""
    from ddtree_numba.kernels import as_device
    from ddtree_numba.models.deepseek_v3.target import DeepseekV3Target

    ckpt = Checkpoint(os.path.join(FIXTURES, "q_lora"))
    c = ckpt.config
    tokens = np.array([[5, 17, 42]], np.int32)
    target = DeepseekV3Target(c, ckpt)
    target.allocate(bs=1, N=3, num_pages=2, page_size=4, max_pages=1)
    target.routing_log = log = []
    target.forward(chain_tree(tokens), as_device(np.zeros((1, 1), np.int32)),
                   as_device(np.zeros(1, np.int32)))
    moe_layers = sum(c.is_moe_layer(layer) for layer in range(c.num_hidden_layers))
    assert moe_layers >= 1 and len(log) == moe_layers
    for chosen in log:
        assert chosen.shape == (3, c.num_experts_per_tok)
        assert (np.diff(chosen, axis=1) > 0).all() and (chosen < c.n_routed_experts).all()


def _router_config(E=64, groups=8, kept=3, k=6, normalise=True):
    from dataclasses import replace

    config = Checkpoint(os.path.join(FIXTURES, "q_lora")).config
    return replace(config, n_routed_experts=E, n_group=groups, topk_group=kept,
                   num_experts_per_tok=k, norm_topk_prob=normalise, routed_scaling_factor=2.5)


@pytest.mark.parametrize("normalise", [True, False])
def test_router_kernel_twin_and_reference_choose_alike(normalise):
    """The device router (a kernel and its numpy twin, float32) against the float64 reference:
    the same experts for every token, weights to float32 rounding; with every logit equal, the
    ties go to the lower group and expert indices in all three."""
    from ddtree_numba.arrays import host_values
    from ddtree_numba.kernels import as_device
    from ddtree_numba.models.deepseek_v3.routing import route_host, route_kernel

    c = _router_config(normalise=normalise)
    rng = np.random.default_rng(3)
    for logits in (rng.standard_normal((37, 64)).astype(np.float32) * 2,
                   np.zeros((5, 64), np.float32)):
        bias = (rng.standard_normal(64) * 0.1).astype(np.float32) if logits.any() else \
            np.zeros(64, np.float32)
        twin = np.full(logits.shape, np.nan, np.float32)
        twin_experts = np.full((len(logits), c.num_experts_per_tok), -1, np.int32)
        route_host(logits, bias, c, twin, twin_experts)
        kernel = as_device(np.full(logits.shape, np.nan, np.float32))
        kernel_experts = as_device(twin_experts * 0 - 1)
        route_kernel(as_device(logits), as_device(bias), c, kernel, kernel_experts)
        kernel, kernel_experts = host_values(kernel), host_values(kernel_experts)
        experts, weights = ref.route(c, logits.astype(np.float64), bias.astype(np.float64))
        dense = np.zeros(logits.shape)
        np.put_along_axis(dense, experts, weights, axis=-1)
        for got, got_experts in ((twin, twin_experts), (kernel, kernel_experts)):
            assert ((got != 0) == (dense != 0)).all()
            np.testing.assert_allclose(got, dense, rtol=2e-6, atol=0)
            np.testing.assert_array_equal(got_experts, np.sort(experts, axis=-1))
        if not logits.any():                                 # ties: the lowest indices
            assert (np.nonzero(twin[0])[0] == np.arange(6)).all()


def test_router_kernel_and_twin_rank_nan_last_and_break_ties_alike():
    """A NaN logit ranks as -inf (never chosen while a finite candidate is left), infinite
    logits saturate the sigmoid, whole groups tie: the kernel and its twin choose the same
    experts in every row."""
    from ddtree_numba.arrays import host_values
    from ddtree_numba.kernels import as_device
    from ddtree_numba.models.deepseek_v3.routing import route_host, route_kernel

    c = _router_config()
    rng = np.random.default_rng(5)
    logits = np.round(rng.standard_normal((6, 64)), 1).astype(np.float32)   # many ties
    logits[0, :8] = np.nan                                   # a whole group of NaN
    logits[1, ::3] = np.inf
    logits[2, 1::2] = -np.inf
    logits[3] = 0
    logits[4, 40:48] = np.nan
    bias = np.zeros(64, np.float32)
    twin_w = np.full((6, 64), np.nan, np.float32)
    twin_e = np.full((6, c.num_experts_per_tok), -1, np.int32)
    route_host(logits, bias, c, twin_w, twin_e)
    kernel_w = as_device(twin_w.copy())
    kernel_e = as_device(twin_e.copy())
    route_kernel(as_device(logits), as_device(bias), c, kernel_w, kernel_e)
    np.testing.assert_array_equal(host_values(kernel_e), twin_e)
    np.testing.assert_allclose(host_values(kernel_w), twin_w, rtol=2e-6, atol=0)
    assert not np.isin(twin_e[0], np.arange(8)).any()       # the NaN group: never chosen
    np.testing.assert_array_equal(twin_e[3], np.arange(6))  # all tied: the lowest indices


@pytest.mark.parametrize("change, message", [
    ({"E": 1024, "groups": 8}, "n_routed_experts, n_group: the device router holds"),
    ({"E": 32, "groups": 32, "kept": 8}, "n_group: expected groups of two or more"),
    ({"E": 60, "groups": 8}, "n_group: expected groups of two or more"),
    ({"E": 64, "groups": 8, "kept": 1, "k": 9}, "num_experts_per_tok, topk_group"),
    ({"E": 64, "groups": 8, "kept": 9}, "num_experts_per_tok, topk_group")])
def test_router_refuses_configs_it_cannot_follow(change, message):
    from ddtree_numba.models.deepseek_v3.routing import check_routing

    with pytest.raises(ValueError, match=message):
        check_routing(_router_config(**change))


@pytest.mark.parametrize("name, cache_dtype, budget", [
    ("q_lora", "float32", 8), ("no_q_lora", "bfloat16", 8), ("q_lora", "float32", 0),
    ("no_q_lora", "float32", 1), ("dense_no_yarn", "float32", 8)])
def test_greedy_step_on_the_deepseek_v3_target_is_lossless(name, cache_dtype, budget):
    """GreedyStep around the absorbed-form target (``kernels.verify_attn`` over the paged
    latent cache) emits exactly the plain-form reference's greedy decoding of the checkpoint."""
    from ddtree_numba import GreedyStep
    from ddtree_numba.interfaces import Target
    from ddtree_numba.models.deepseek_v3.target import DeepseekV3Target, greedy
    from ddtree_numba.models.toy_drafter import ToyDrafter

    ckpt = Checkpoint(os.path.join(FIXTURES, name))
    c = ckpt.config
    starts, L, steps = np.array([5, 17], np.int32), 3, 3
    greedy_tokens = np.array([greedy(c, ckpt, int(s), steps * (L + 1), cache_dtype=cache_dtype)
                              for s in starts])
    continuation = np.concatenate([starts[:, None], greedy_tokens], axis=1)
    target = DeepseekV3Target(c, ckpt, cache_dtype=cache_dtype)
    assert isinstance(target, Target)
    step = GreedyStep(target, ToyDrafter(continuation, vocab=c.vocab_size, accuracy=0.6, seed=2),
                      bs=2, L=L, K=2, budget=budget, max_steps=steps)
    step.start(starts)
    for _ in range(steps):
        step()
    tokens = step.tokens()
    for b in range(2):
        assert len(tokens[b]) >= steps
        assert tokens[b] == greedy_tokens[b, : len(tokens[b])].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("bs, budget", [(1, 16), (4, 64)])
def test_gpu_step_on_a_bfloat16_model_is_lossless_against_one_token_decoding(tmp_path, bs,
                                                                             budget):
    """The ``small`` random checkpoint (DeepSeek-V3's 576-wide cache rows, MoE with groups and
    shared experts) with bfloat16 weights and cache, dense layers on cuBLAS: the speculative
    tokens of eager and graph mode equal each other and, up to the first near-tie flip, the
    same target's one-token decoding (budget 0: the same kernels, one node per step). The
    share of requests that decode identically to the end is printed (bfloat16 rounds a tree
    forward and a one-token forward differently; see the docs)."""
    from ddtree_numba import GreedyStep
    from ddtree_numba.models.deepseek_v3.make_model import make_model
    from ddtree_numba.models.deepseek_v3.target import DeepseekV3Target
    from ddtree_numba.models.toy_drafter import ToyDrafter

    ckpt = make_model(str(tmp_path / "small"), preset="small", seed=1)
    weights = {name: ckpt[name] for name in ckpt}
    c = ckpt.config
    starts = np.random.default_rng(budget).integers(0, c.vocab_size, bs).astype(np.int32)
    L, steps = 8, 6
    runs = {}
    for mode, b_ in (("eager", 0), ("eager", budget), ("graph", budget)):
        target = DeepseekV3Target(c, weights, cache_dtype="bfloat16", weight_dtype="bfloat16")
        if b_ == 0:
            continuation = np.zeros((bs, steps * (L + 1) * 2 + 1), np.int32)
        else:
            plain = runs["eager", 0]
            continuation = np.zeros((bs, max(map(len, plain)) + 1), np.int32)
            continuation[:, 0] = starts
            for b in range(bs):
                continuation[b, 1: len(plain[b]) + 1] = plain[b]
        step = GreedyStep(target, ToyDrafter(continuation, vocab=c.vocab_size, accuracy=0.8,
                                             seed=3),
                          bs=bs, L=L, K=8, budget=b_, max_steps=steps * (L + 1) if b_ == 0
                          else steps, mode=mode)
        step.start(starts)
        for _ in range(step.max_steps):
            step()
        runs[mode, b_] = step.tokens()
    assert runs["eager", budget] == runs["graph", budget]
    same = 0
    for b in range(bs):
        spec, plain = runs["eager", budget][b], runs["eager", 0][b]
        assert len(spec) / steps > 1.5                     # the drafter follows `plain`
        n = min(len(spec), len(plain))
        first = next((i for i in range(n) if spec[i] != plain[i]), n)
        assert first >= 1, (b, spec[:4], plain[:4])       # the root's token: a clear argmax
        same += first == n
    print(f"bs {bs}, budget {budget}: {same} of {bs} requests equal one-token decoding")
    assert same >= (bs + 1) // 2                           # flips are rare, not the rule


def test_deepseek_v3_target_refuses_bad_arguments():
    from ddtree_numba.models.deepseek_v3.target import DeepseekV3Target

    ckpt = Checkpoint(os.path.join(FIXTURES, "no_q_lora"))
    with pytest.raises(TypeError, match="config: expected a DeepseekV3Config"):
        DeepseekV3Target({"model_type": "deepseek_v3"}, ckpt)
    with pytest.raises(ValueError, match="cache_dtype: expected one of"):
        DeepseekV3Target(ckpt.config, ckpt, cache_dtype="int8")
    with pytest.raises(ValueError, match="weight_dtype: expected one of"):
        DeepseekV3Target(ckpt.config, ckpt, weight_dtype="float16")
    with pytest.raises(ValueError, match="moe: expected one of"):
        DeepseekV3Target(ckpt.config, ckpt, moe="grouped")


# -- make_model: random checkpoints written as Hugging Face would --------------------------------

def test_make_model_writes_a_sharded_bfloat16_checkpoint_the_loader_reads(tmp_path):
    import hashlib

    from ddtree_numba.models.deepseek_v3.make_model import PRESETS, make_model, tensor_shapes

    ckpt = make_model(str(tmp_path / "a"), preset="tiny", seed=3, shards=3)
    with open(tmp_path / "a" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) == 3
    with open(tmp_path / "a" / "config.json") as f:
        shapes = tensor_shapes(json.load(f))
    assert sorted(ckpt) == sorted(shapes)
    for name, shape in shapes.items():
        tensor = ckpt[name]
        assert tensor.shape == shape, name
        assert tensor.dtype == (np.float32 if name.endswith("bias") else ml_dtypes.bfloat16)
    c = ckpt.config
    assert (c.q_lora_rank, c.first_k_dense_replace, c.n_group, c.rope_scaling.factor) == (
        PRESETS["tiny"]["q_lora_rank"], 1, 4, 4.0)
    logits, _ = ref.forward(c, ckpt, [5, 6, 7], [0, 1, 2])
    assert np.isfinite(logits).all() and 1 < logits.std() < 10

    def digest(folder):
        return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest()
                for f in sorted(os.listdir(folder))}

    make_model(str(tmp_path / "b"), preset="tiny", seed=3, shards=3)
    make_model(str(tmp_path / "c"), preset="tiny", seed=4, shards=3)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")       # the same bytes
    assert digest(tmp_path / "a") != digest(tmp_path / "c")


def test_make_model_small_has_deepseek_v3_cache_rows_and_no_query_lora(tmp_path):
    from ddtree_numba.models.deepseek_v3.make_model import make_model

    c = make_model(str(tmp_path / "s"), preset="small", shards=1).config
    assert (c.row_width, c.q_lora_rank, c.num_attention_heads) == (576, None, 8)


def test_make_model_refuses_without_touching_the_folder(tmp_path):
    from ddtree_numba.models.deepseek_v3.make_model import make_model

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a checkpoint .config.json."):
        make_model(str(tmp_path))
    with pytest.raises(ValueError, match="preset: expected one of"):
        make_model(str(tmp_path / "x"), preset="huge")
    with pytest.raises(ValueError, match="shards: expected"):
        make_model(str(tmp_path / "x"), shards=0)
    assert sorted(os.listdir(tmp_path)) == ["config.json"]


def test_make_model_interrupted_leaves_no_half_checkpoint(tmp_path):
    """An error while writing (here from the progress callback, as Ctrl-C would come) removes
    the files already written, so the folder can be used again."""
    from ddtree_numba.models.deepseek_v3.make_model import make_model

    def stop(done, total):
        if done == 60:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_model(str(tmp_path), shards=3, progress=stop)
    assert os.listdir(tmp_path) == []
    assert len(make_model(str(tmp_path), shards=3)) == 91
