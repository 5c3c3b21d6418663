"""DeepSeek-V3's MoE router on static buffers: ``route_kernel`` (numba.cuda) and its numpy
twin ``route_host``, both float32, for the device forward.

For each token ``t`` (one block each, a thread per expert) from the router logits
``logits[t, :E]``::

    score[e]  = sigmoid(logits[t, e])
    biased[e] = score[e] + bias[e]                       (e_score_correction_bias: choosing only)
    group g   = experts [g E/G, (g + 1) E/G); its score = the sum of its two best biased
    kept      = the topk_group best groups (ties: the lower group index)
    chosen    = the k best biased scores among the kept groups' experts (ties: lower index;
                a NaN biased score ranks as -inf)
    weights[t, e] = score[e] / (sum of the chosen scores + 1e-20)  (norm_topk_prob, else score[e])
                    x routed_scaling_factor                for the chosen e, 0 for the others
    experts[t, :k] = the chosen e, in increasing order

the rule of :func:`~ddtree_numba.models.deepseek_v3.reference.route` (the float64 reference).
"The k best, ties to the lower index" needs no sort and no passes of arg-max: an expert is among
them when fewer than k candidates beat it (a larger score, or an equal one at a lower index), a
count each thread makes for its own expert; groups likewise. The forward then adds
``weights[t, e] x expert_e(h_t)`` over the chosen experts in increasing ``e``, either over
every expert with the dense weights (a zero weight adds nothing) or over the ``k`` pairs
``(t, experts[t, s])``: both give every launch the same shape whatever the routing, which is
what a CUDA graph needs (see :mod:`~ddtree_numba.models.deepseek_v3.target` for when each is
used).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from ...kernels._device import CACHE_KERNELS, launch, launch_stream

MAX_EXPERTS = 512       # experts a block holds, one thread each (DeepSeek-V3: 256)
MAX_GROUPS = 32         # (DeepSeek-V3: 8)


@cuda.jit(device=True, inline="always")
def _score(logits, t, e):
    """``sigmoid(logits[t, e])`` in float32."""
    return float32(1) / (float32(1) + math.exp(-logits[t, e]))


@cuda.jit(device=True, inline="always")
def _beats(value_a, index_a, value_b, index_b):
    """Whether ``a`` ranks before ``b``: a larger value, or an equal one at a lower index."""
    return value_a > value_b or (value_a == value_b and index_a < index_b)


@cuda.jit(cache=CACHE_KERNELS)
def _route_kernel(logits, bias, n_group, topk_group, top_k, normalise, scaling, weights,
                  experts):
    """One block per token ``t``; thread ``e`` owns expert ``e`` (``blockDim >= E``; threads
    past ``E`` only join the barriers). No passes of arg-max: a thread finds its expert's (or
    group's) rank by counting who beats it, "the best first, ties to the lower index" as a
    count, so every expert is decided at once."""
    t, e = cuda.blockIdx.x, cuda.threadIdx.x
    E = logits.shape[1]
    per_group = E // n_group
    biased = cuda.shared.array(MAX_EXPERTS, float32)
    group_score = cuda.shared.array(MAX_GROUPS, float32)
    group_kept = cuda.shared.array(MAX_GROUPS, int32)
    chosen = cuda.shared.array(MAX_EXPERTS, int32)
    score_of_rank = cuda.shared.array(MAX_EXPERTS, float32)    # the chosen scores, best first
    score = float32(0)
    if e < E:
        score = _score(logits, t, e)
        b = score + bias[e]
        biased[e] = b if not math.isnan(b) else float32(-math.inf)     # NaN ranks last
    cuda.syncthreads()                          # every biased score is in shared memory
    # 1. thread g < G: group g's score, the sum of its two best biased scores
    if e < n_group:
        first, second = float32(-math.inf), float32(-math.inf)
        for i in range(e * per_group, (e + 1) * per_group):
            if biased[i] > first:
                first, second = biased[i], first
            elif biased[i] > second:
                second = biased[i]
        group_score[e] = first + second
    cuda.syncthreads()                          # every group score is in shared memory
    # 2. thread g < G: group g is kept when fewer than topk_group groups beat it
    if e < n_group:
        beaten_by = 0
        for h in range(n_group):
            if _beats(group_score[h], h, group_score[e], e):
                beaten_by += 1
        group_kept[e] = beaten_by < topk_group
    cuda.syncthreads()                          # every group's verdict is in shared memory
    # 3. thread e < E: an expert of a kept group is chosen when fewer than top_k experts of
    #    kept groups beat it; its score goes to slot `rank` (the order the sum below needs)
    if e < E:
        rank = top_k
        if group_kept[e // per_group]:
            rank = 0
            for i in range(E):
                if group_kept[i // per_group] and _beats(biased[i], i, biased[e], e):
                    rank += 1
        chosen[e] = rank < top_k
        if rank < top_k:
            score_of_rank[rank] = score
    cuda.syncthreads()                          # chosen[] and score_of_rank[] are complete
    # 4. the weights: the chosen scores normalised (summed best first) and scaled, zeros
    #    elsewhere; the chosen indices in increasing order (slot = chosen experts below e)
    if e < E:
        total = float32(0)
        for r in range(top_k):
            total += score_of_rank[r]
        denominator = total + float32(1e-20) if normalise else float32(1)
        w = float32(0)
        if chosen[e]:
            w = score / denominator * scaling
            slot = 0
            for i in range(e):
                slot += chosen[i]
            experts[t, slot] = e
        weights[t, e] = w


def check_routing(config) -> None:
    """Refuse a config the router cannot follow: more experts or groups than a block holds,
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


def route_kernel(logits, bias, config, weights, experts) -> None:
    """Launch the router kernel: ``weights float32[T, E]`` and ``experts int32[T, k]`` from
    ``logits float32[T, E]`` and ``bias float32[E]`` (device arrays), on the current stream."""
    T, E = logits.shape
    threads = (E + 31) // 32 * 32                           # a whole number of warps
    launch(_route_kernel, T, threads, launch_stream())(
        logits, bias, np.int32(config.n_group), np.int32(config.topk_group),
        np.int32(config.num_experts_per_tok), bool(config.norm_topk_prob),
        np.float32(config.routed_scaling_factor), weights, experts)


def route_host(logits, bias, config, weights, experts) -> None:
    """The kernel's numpy twin, in float32 and in place (``weights`` and ``experts`` numpy
    arrays or a simulator device array's host views)."""
    c = config
    logits = np.asarray(logits, np.float32)
    T, E = logits.shape
    score = np.float32(1) / (np.float32(1) + np.exp(-logits))
    biased = score + np.asarray(bias, np.float32)
    biased = np.where(np.isnan(biased), np.float32(-np.inf), biased)    # NaN ranks last
    groups = biased.reshape(T, c.n_group, E // c.n_group)
    top2 = np.sort(groups, axis=-1)[..., -2:]
    group_score = (top2[..., 1] + top2[..., 0]).astype(np.float32)     # the kernel's order
    kept = np.argsort(-group_score, axis=-1, kind="stable")[:, : c.topk_group]
    allowed = np.zeros((T, c.n_group), bool)
    np.put_along_axis(allowed, kept, True, axis=-1)
    candidate = np.repeat(allowed, E // c.n_group, axis=-1)
    index = np.broadcast_to(np.arange(E), (T, E))
    # candidates first, then the best biased score, then the lower index
    order = np.lexsort((index, -biased, ~candidate), axis=-1)
    chosen = order[:, : c.num_experts_per_tok]
    picked = np.take_along_axis(score, chosen, axis=-1)
    total = np.zeros(T, np.float32)
    for j in range(picked.shape[1]):                                     # the kernel's order
        total += picked[:, j]
    denominator = total + np.float32(1e-20) if c.norm_topk_prob else np.float32(1)
    out = np.zeros((T, E), np.float32)
    np.put_along_axis(out, chosen, picked / denominator[..., None] if c.norm_topk_prob
                      else picked, axis=-1)
    weights[...] = out * np.float32(c.routed_scaling_factor)
    experts[...] = np.sort(chosen, axis=-1)


def build_specs():
    """The router kernel (for the build report)."""
    from numba import types

    from ...kernels._specs import KernelSpec

    f1, f2, i4 = types.float32[::1], types.float32[:, ::1], types.int32
    return [KernelSpec("deepseek_v3", "route", _route_kernel,
                       (f2, f1, i4, i4, i4, types.boolean, types.float32, f2,
                        types.int32[:, ::1]), 64, True)]
