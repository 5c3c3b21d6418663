"""DeepSeek-V3's MoE router on static buffers: ``route_kernel`` (numba.cuda) and its numpy
twin ``route_host``, both float32, for the device forward.

For each token ``t`` (one thread each) from the router logits ``logits[t, :E]``::

    score[e]  = sigmoid(logits[t, e])
    biased[e] = score[e] + bias[e]                       (e_score_correction_bias: choosing only)
    group g   = experts [g E/G, (g + 1) E/G); its score = the sum of its two best biased
    kept      = the topk_group best groups (ties: the lower group index)
    chosen    = the k best biased scores among the kept groups' experts (ties: lower index)
    weights[t, e] = score[e] / (sum of the chosen scores + 1e-20)  (norm_topk_prob, else score[e])
                    x routed_scaling_factor                for the chosen e, 0 for the others

the rule of :func:`~ddtree_numba.models.deepseek_v3.reference.route` (the float64 reference),
written out as repeated arg-max passes so that a thread needs no sort. The forward then adds
``weights[t, e] x expert_e(h_t)`` for every expert (a zero weight adds nothing), so every
launch has the same shape whatever the routing: what a CUDA graph needs.

The ``[T, E]`` weights are dense. That costs memory and compute proportional to ``E`` per
token, which is what makes this the simple version: the forward runs every expert on every
token (see :mod:`~ddtree_numba.models.deepseek_v3.target`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ...kernels._device import SIMULATOR, launch, launch_stream

MAX_EXPERTS = 512       # bits of the chosen-expert mask a thread keeps (DeepSeek-V3: 256)
MASK_WORDS = MAX_EXPERTS // 32      # (a local array's size must be a plain constant)
MAX_GROUPS = 32         # bits of the kept-group mask (DeepSeek-V3: 8)
ROUTE_THREADS = 32 if SIMULATOR else 128


@cuda.jit(device=True, inline=True)
def _biased(logits, bias, t, e):
    """``(score, biased)`` of expert ``e`` for token ``t`` (float32)."""
    score = float32(1) / (float32(1) + math.exp(-logits[t, e]))
    return score, score + bias[e]


@cuda.jit
def _route_kernel(logits, bias, n_group, topk_group, top_k, normalise, scaling, weights):
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if t >= logits.shape[0]:
        return
    E = logits.shape[1]
    per_group = E // n_group
    # 1. the kept groups: topk_group passes of "best group not yet kept" (strict >: ties keep
    #    the lower index, as a stable sort of the negated scores does)
    kept = uint32(0)
    for _ in range(topk_group):
        best, best_g = -math.inf, int32(-1)
        for g in range(n_group):
            if kept & (uint32(1) << uint32(g)):
                continue
            first, second = -math.inf, -math.inf            # the group's two best
            for e in range(g * per_group, (g + 1) * per_group):
                _, b = _biased(logits, bias, t, e)
                if b > first:
                    first, second = b, first
                elif b > second:
                    second = b
            score = float32(first + second)
            if best_g < 0 or score > best:
                best, best_g = score, g
        kept |= uint32(1) << uint32(best_g)
    # 2. the chosen experts among the kept groups, and the sum of their scores
    chosen = cuda.local.array(MASK_WORDS, uint32)
    for w in range(MASK_WORDS):
        chosen[w] = uint32(0)
    total = float32(0)
    for _ in range(top_k):
        best, best_e, best_score = -math.inf, int32(-1), float32(0)
        for e in range(E):
            if not kept & (uint32(1) << uint32(e // per_group)):
                continue
            if chosen[e // 32] & (uint32(1) << uint32(e % 32)):
                continue
            score, b = _biased(logits, bias, t, e)
            if best_e < 0 or b > best:
                best, best_e, best_score = b, e, score
        chosen[best_e // 32] |= uint32(1) << uint32(best_e % 32)
        total += best_score
    # 3. the dense weights row: the chosen experts' scores, normalised and scaled; zeros
    denominator = total + float32(1e-20) if normalise else float32(1)
    for e in range(E):
        w = float32(0)
        if chosen[e // 32] & (uint32(1) << uint32(e % 32)):
            score, _ = _biased(logits, bias, t, e)
            w = score / denominator * scaling
        weights[t, e] = w


def check_routing(config) -> None:
    """Refuse a config the router cannot follow: more experts or groups than its masks hold,
    groups of unequal size or of one expert (a group's score is the sum of its two best),
    or more experts a token than the kept groups hold."""
    E, G = config.n_routed_experts, config.n_group
    k, kept = config.num_experts_per_tok, config.topk_group
    if E > MAX_EXPERTS or G > MAX_GROUPS:
        raise ValueError(f"n_routed_experts, n_group: the device router holds at most "
                         f"{MAX_EXPERTS} experts in {MAX_GROUPS} groups, got {E} in {G}")
    if E % G or E // G < 2:
        raise ValueError(f"n_group: expected groups of two or more experts each, {E} "
                         f"experts in {G} groups")
    if not 1 <= kept <= G or not 1 <= k <= kept * (E // G):
        raise ValueError(f"num_experts_per_tok, topk_group: expected 1 <= topk_group <= "
                         f"n_group and 1 <= k <= the kept groups' {kept * (E // G)} experts, "
                         f"got k = {k}, topk_group = {kept}")


def route_kernel(logits, bias, config, weights) -> None:
    """Launch the router kernel: ``weights float32[T, E]`` from ``logits float32[T, E]``
    and ``bias float32[E]`` (device arrays), on the current stream."""
    T = logits.shape[0]
    launch(_route_kernel, (T + ROUTE_THREADS - 1) // ROUTE_THREADS, ROUTE_THREADS,
           launch_stream())(logits, bias, np.int32(config.n_group),
                            np.int32(config.topk_group), np.int32(config.num_experts_per_tok),
                            bool(config.norm_topk_prob),
                            np.float32(config.routed_scaling_factor), weights)


def route_host(logits, bias, config, weights) -> None:
    """The kernel's numpy twin, in float32 and in place (``weights`` a numpy array or a
    simulator device array's host view)."""
    c = config
    logits = np.asarray(logits, np.float32)
    T, E = logits.shape
    score = np.float32(1) / (np.float32(1) + np.exp(-logits))
    biased = score + np.asarray(bias, np.float32)
    groups = biased.reshape(T, c.n_group, E // c.n_group)
    top2 = np.sort(groups, axis=-1)[..., -2:]
    group_score = (top2[..., 1] + top2[..., 0]).astype(np.float32)     # the kernel's order
    kept = np.argsort(-group_score, axis=-1, kind="stable")[:, : c.topk_group]
    allowed = np.zeros((T, c.n_group), bool)
    np.put_along_axis(allowed, kept, True, axis=-1)
    masked = np.where(np.repeat(allowed, E // c.n_group, axis=-1), biased, -np.inf)
    chosen = np.argsort(-masked, axis=-1, kind="stable")[:, : c.num_experts_per_tok]
    picked = np.take_along_axis(score, chosen, axis=-1)
    total = np.zeros(T, np.float32)
    for j in range(picked.shape[1]):                                     # the kernel's order
        total += picked[:, j]
    denominator = total + np.float32(1e-20) if c.norm_topk_prob else np.float32(1)
    out = np.zeros((T, E), np.float32)
    np.put_along_axis(out, chosen, picked / denominator[..., None] if c.norm_topk_prob
                      else picked, axis=-1)
    weights[...] = out * np.float32(c.routed_scaling_factor)


def build_specs():
    """The router kernel (for the build report)."""
    from numba import types

    from ...kernels._specs import KernelSpec

    f1, f2, i4 = types.float32[::1], types.float32[:, ::1], types.int32
    return [KernelSpec("deepseek_v3", "route", _route_kernel,
                       (f2, f1, i4, i4, i4, types.boolean, types.float32, f2), ROUTE_THREADS,
                       False)]
