"""Numpy references: the definition of every stage of one DDTree step, greedy or sampled.

Each function validates its inputs with :mod:`ddtree_numba.validation`, computes in plain numpy
(float64 where precision matters) and returns numpy arrays. The GPU kernels in
:mod:`ddtree_numba.kernels` have the same names and arguments and are tested against these.
"""

from .build_tree import best_first, build_tree, pack_bits, tree_from_parents, unpack_bits
from .commit_kv import commit_kv
from .draft_topk import draft_topk, log_softmax_f64
from .greedy_step import StepOutput, argmax_per_node, greedy_step
from .sample_uniforms import sample_uniforms
from .sampled_step import SampledOutput, sampled_step
from .sampling_probs import sampling_probs
from .tree_accept import tree_accept
from .tree_sample import tree_sample, tree_sample_logits
from .verify_attn import deepseek_sm_scale, gather_slots, plain_mla_attention, verify_attn

__all__ = [
    "SampledOutput",
    "StepOutput",
    "argmax_per_node",
    "best_first",
    "build_tree",
    "commit_kv",
    "deepseek_sm_scale",
    "draft_topk",
    "gather_slots",
    "greedy_step",
    "log_softmax_f64",
    "pack_bits",
    "plain_mla_attention",
    "sample_uniforms",
    "sampled_step",
    "sampling_probs",
    "tree_accept",
    "tree_sample",
    "tree_sample_logits",
    "tree_from_parents",
    "unpack_bits",
    "verify_attn",
]
