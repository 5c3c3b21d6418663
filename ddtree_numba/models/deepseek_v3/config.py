"""The DeepSeek-V3 architecture's sizes, read from a Hugging Face ``config.json``.

DeepSeek-V3 (``model_type`` ``"deepseek_v3"``), Kimi-K2 (``"kimi_k2"``, the same architecture
with other sizes) and Moonlight share ``DeepseekV3ForCausalLM``. :meth:`DeepseekV3Config.from_dict`
takes the fields that define the forward, refuses a field it does not know by name (never a
silent default: a new field may change the math), and refuses values this implementation does
not compute (another activation, router or RoPE scaling), saying which. Fields that do not
change the forward (token ids, dtype, training-only losses, the multi-token-prediction layers
that greedy decoding does not run) are listed in :data:`IGNORED_FIELDS`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields

from ...reference.verify_attn import deepseek_sm_scale

MODEL_TYPES = ("deepseek_v3", "kimi_k2")

#: Fields that do not change the forward of one token sequence, and why.
IGNORED_FIELDS = {
    "architectures": "metadata", "auto_map": "metadata", "_name_or_path": "metadata",
    "transformers_version": "metadata", "torch_dtype": "the loader's dtype decides",
    "dtype": "the loader's dtype decides", "bos_token_id": "tokenizer",
    "eos_token_id": "tokenizer", "pad_token_id": "tokenizer", "use_cache": "runtime option",
    "initializer_range": "training", "aux_loss_alpha": "training loss", "seq_aux": "training loss",
    "ep_size": "expert parallelism layout", "num_nextn_predict_layers":
    "multi-token-prediction layers: not part of the next-token forward",
    "output_router_logits": "training", "router_aux_loss_coef": "training",
    "model_type": "checked", "quantization_config": "the checkpoint loader reads it",
    "head_dim": "qk_rope_head_dim in transformers' config", "rope_interleave": "checked",
    "qk_head_dim": "checked: qk_nope_head_dim + qk_rope_head_dim",
    "pretraining_tp": "checked", "attention_dropout": "checked", "moe_layer_freq": "checked",
    "scoring_func": "checked", "topk_method": "checked", "hidden_act": "checked",
    "attention_bias": "checked", "mlp_bias": "checked", "num_key_value_heads": "checked",
    "rope_scaling": "checked", "rope_parameters": "checked",
}

#: Fields that may be left out, with the value transformers' DeepseekV3Config gives them. Every
#: other field must be present: a default that differs between implementations (transformers
#: defaults n_group to 8, a dataclass would to 1) would silently compute another model.
OPTIONAL_FIELDS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

#: Fields of the MoE layers, required only when ``n_routed_experts`` is set.
MOE_FIELDS = {"n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
              "n_shared_experts", "norm_topk_prob", "routed_scaling_factor",
              "first_k_dense_replace", "moe_intermediate_size"}

#: Fields whose value is fixed: ``name -> (accepted values, what else would mean)``.
FIXED_VALUES = {
    "hidden_act": (("silu",), "another MLP activation"),
    "scoring_func": (("sigmoid",), "DeepSeek-V2's softmax router"),
    "topk_method": (("noaux_tc",), "another expert selection"),
    "moe_layer_freq": ((1,), "dense layers between MoE layers"),
    "attention_bias": ((False,), "biases in the attention projections"),
    "mlp_bias": ((False,), "biases in the MLP projections"),
    "pretraining_tp": ((1,), "a tensor-parallel split of the linear layers"),
    "attention_dropout": ((0, 0.0), "dropout at inference"),
    "rope_interleave": ((True,), "RoPE on split halves instead of interleaved pairs"),
}


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (DeepSeek-V3: factor 40 over 4096 positions; Kimi-K2: 32)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class DeepseekV3Config:
    """Sizes and options of one DeepSeek-V3-architecture model (Hugging Face names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int            # the dense MLP of the first layers
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int                 # Dc: the cached latent
    qk_nope_head_dim: int             # dn
    qk_rope_head_dim: int             # Dr: the cached rope key, shared by heads
    v_head_dim: int                   # dv
    q_lora_rank: int | None = None    # None: the query is one projection of the hidden state
    moe_intermediate_size: int | None = None     # each expert's MLP
    first_k_dense_replace: int = 0    # layers [0, k) dense MLP, the rest MoE
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v3"
    extra: dict = field(default_factory=dict, compare=False, repr=False)   # ignored fields

    # -- derived sizes --------------------------------------------------------------------
    @property
    def row_width(self) -> int:
        """The width of a cache row, ``kv_lora_rank + qk_rope_head_dim`` (576 for V3 and K2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """``mscale^2 / sqrt(dn + Dr)``: with YaRN, the softmax scale grows by the square of
        ``0.1 mscale_all_dim ln(factor) + 1`` (DeepSeek-V3: 1/sqrt(192) x 1.369^2 = 0.1352)."""
        y = self.rope_scaling
        if y is None or not y.mscale_all_dim:
            return self.qk_head_dim ** -0.5
        return deepseek_sm_scale(self.qk_head_dim, y.factor, y.mscale_all_dim)

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts is not None and layer >= self.first_k_dense_replace

    # -- reading ----------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str) -> DeepseekV3Config:
        """Read ``config.json`` (a file, or the checkpoint folder holding it)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict) -> DeepseekV3Config:
        """The config of a Hugging Face ``config.json`` dict; ``ValueError`` naming the field
        for an unknown field or an unsupported value."""
        if not isinstance(d, dict):
            raise TypeError(f"config: expected a dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {MODEL_TYPES}, got {model_type!r}")
        known = {f.name for f in fields(cls)} - {"extra", "rope_scaling"}
        unknown = sorted(k for k in d if k not in known and k not in IGNORED_FIELDS)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown config field (this implementation "
                             f"computes the fields of DeepseekV3Config and ignores only "
                             f"{sorted(IGNORED_FIELDS)}); refusing rather than ignoring it")
        for name, (accepted, meaning) in FIXED_VALUES.items():
            if name in d and d[name] not in accepted:
                raise ValueError(f"{name}: expected {accepted[0]!r}, got {d[name]!r} "
                                 f"({meaning} is not implemented)")
        heads = d.get("num_attention_heads")
        if d.get("num_key_value_heads", heads) != heads:
            raise ValueError(f"num_key_value_heads: expected num_attention_heads = {heads} "
                             f"(MLA), got {d['num_key_value_heads']}")
        required = known - set(OPTIONAL_FIELDS) - {"model_type"}
        if d.get("n_routed_experts") is None:       # a dense model: no MoE field needed
            required -= MOE_FIELDS
        missing = sorted(k for k in required if k not in d)
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            missing = [k for k in missing if k != "rope_theta"]
        if missing:
            raise ValueError(f"{missing[0]}: missing from the config (required: implementations "
                             f"default it differently)")
        values = {k: d[k] for k in known if k in d}
        # transformers 5 writes RoPE as "rope_parameters", rope_theta inside; 4.x "rope_scaling"
        rope = d.get("rope_scaling") or d.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in d:
            values["rope_theta"] = rope["rope_theta"]
        values["rope_scaling"] = _rope_scaling(rope)
        config = cls(**values, extra={k: d[k] for k in d if k in IGNORED_FIELDS})
        config.validate()
        y = config.rope_scaling
        if y is not None and (y.factor * y.original_max_position_embeddings
                              != config.max_position_embeddings):
            raise ValueError(f"rope_scaling.factor: expected max_position_embeddings / "
                             f"original_max_position_embeddings = "
                             f"{config.max_position_embeddings}/"
                             f"{y.original_max_position_embeddings}, got {y.factor} "
                             f"(transformers rotates with the ratio, DeepSeek's code with "
                             f"the factor: they would differ)")
        if d.get("qk_head_dim", config.qk_head_dim) != config.qk_head_dim:
            raise ValueError(f"qk_head_dim: expected qk_nope_head_dim + qk_rope_head_dim = "
                             f"{config.qk_head_dim}, got {d['qk_head_dim']}")
        return config

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even width (RoPE pairs), got "
                             f"{self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank < 1):
            raise ValueError(f"q_lora_rank: expected a positive int or null, got "
                             f"{self.q_lora_rank!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace: expected 0..{self.num_hidden_layers}, "
                             f"got {self.first_k_dense_replace}")
        if self.n_routed_experts is None:
            return
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if not isinstance(k, int) or not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok: expected 1..n_routed_experts = {e}, got {k!r}")
        if self.n_group < 1 or e % self.n_group:
            raise ValueError(f"n_group: expected a divisor of n_routed_experts = {e}, got "
                             f"{self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: expected 1..n_group = {self.n_group}, got "
                             f"{self.topk_group}")
        if k > self.topk_group * (e // self.n_group):
            raise ValueError(f"num_experts_per_tok: {k} experts cannot come from "
                             f"{self.topk_group} groups of {e // self.n_group}")


def _rope_scaling(d) -> YarnScaling | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError(f"rope_scaling: expected a dict or null, got {d!r}")
    kind = d.get("rope_type", d.get("type"))
    if kind in (None, "default") and "factor" not in d:
        return None
    if kind != "yarn":
        raise ValueError(f"rope_scaling: expected type 'yarn' (or none), got {kind!r}")
    allowed = {f.name for f in fields(YarnScaling)} | {"type", "rope_type", "rope_theta"}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"rope_scaling.{unknown[0]}: unknown YaRN field; refusing rather "
                         f"than ignoring it")
    for name in ("factor", "original_max_position_embeddings"):
        if name not in d:
            raise ValueError(f"rope_scaling.{name}: missing from a YaRN config")
    if d.get("mscale_all_dim") and "mscale" not in d:
        raise ValueError("rope_scaling.mscale: missing while mscale_all_dim is set (DeepSeek's "
                         "code reads it as 1, transformers as absent: say which)")
    return YarnScaling(**{k: d[k] for k in d if k in {f.name for f in fields(YarnScaling)}})


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention-temperature factor ``0.1 mscale ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
