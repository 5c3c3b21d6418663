"""Benchmark: the part of a step that only DDTree adds, at a real vocabulary, stage by stage.

A step's DDTree-specific stages, on the buffers one step hands from stage to stage:
``draft_topk`` (the drafter's ``[bs, L, V]`` logits to the top-``K`` log-probs and ids),
``build_tree`` (the default select for the budget, then the finish kernel) and
``accept_commit`` (the accepted path and its latent rows moved into the cache, every layer in
one launch). The drafter and the target's forward are not in it: they are the model's, not
DDTree's. Configurations: bs 1 and 8, L = 15, V = 163 840 (Kimi-K2's vocabulary), K = budget
= 256, float32 and bfloat16 logits; the cache is one float32 layer of 576 (MLA's latent and
RoPE key) or DeepSeek-V3's 61 bfloat16 layers; the target's predictions follow a random path
of the tree to depth 15 (a long accepted path: the most the commit moves).

Per stage: a CUDA graph of that stage alone, replayed between events with the L2 flushed,
median; ``whole_us``: one graph of the three stages in order, timed the same way.
``graph_floor_us``: a graph of one empty kernel (what any one-launch stage costs at least).
Every stage's output is checked against the reference (``exact``). Writes
``$OUT/ddtree_part.csv``.
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np
import torch
from bench_small_kernels import _empty_kernel, accepted_paths
from harness import Bench, print_table

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.arrays import BFLOAT16
from ddtree_numba.kernels._device import launch, launch_stream

L, V, BUDGET, PAGE, D = 15, 163_840, 256, 64, 576


def main(quick: bool = False):
    bench = Bench("ddtree_part")
    rng = np.random.default_rng(3)
    flag = K.as_device(cp.zeros(1, cp.int32))
    floor_us = bench.time_device(lambda: launch(_empty_kernel, 1, 32, launch_stream())(flag))
    floor_us = floor_us["ms"] * 1e3
    configs = [(1, "float32", 1, "float32"), (1, "bfloat16", 61, "bfloat16"),
               (8, "float32", 1, "float32"), (8, "bfloat16", 61, "bfloat16")]
    for bs, logit_dtype, layers, cache_dtype in configs[:2] if quick else configs:
        Kk, N = BUDGET, BUDGET + 1
        torch.manual_seed(bs * 100 + layers)
        x_t = (torch.randn((bs, L, V), device="cuda") * 3).to(
            torch.bfloat16 if logit_dtype == "bfloat16" else torch.float32)
        d_x = x_t if logit_dtype == "bfloat16" else K.as_device(x_t)
        topk_scratch = K.allocate_topk_scratch(bs, L, V, Kk)   # outside the graph
        want_ids = ref.draft_topk(x_t.float().cpu().numpy(), Kk)[1]
        # device buffers, one set for the chain (each stage reads what the last one wrote)
        topk = (K.as_device(cp.empty((bs, L, Kk), cp.float32)),
                K.as_device(cp.empty((bs, L, Kk), cp.int32)))
        K.draft_topk(d_x, Kk, out=topk, scratch=topk_scratch)
        # the later stages' references start from the kernel's top-K (its log-probs are
        # within the stated bound of the reference's, not equal to them)
        lp_h, ids_h = topk[0].copy_to_host(), topk[1].copy_to_host()
        roots = rng.integers(0, 1000, bs).astype(np.int32)
        prefix = rng.integers(0, 1024, bs).astype(np.int32)
        want_tree = ref.build_tree(lp_h, ids_h, roots, BUDGET, prefix_lens=prefix)
        predict = accepted_paths(want_tree, L, rng)
        want_acc = ref.tree_accept(want_tree.token_ids, want_tree.next_token,
                                   want_tree.next_sibling, predict)
        d_roots, d_prefix = K.as_device(cp.asarray(roots)), K.as_device(cp.asarray(prefix))
        tree = K.allocate_tree(bs, N)
        ranks = K.as_device(cp.empty((bs, N), cp.int32))
        d_predict = K.as_device(cp.asarray(predict))
        pages_per = (int(prefix.max()) + N + PAGE - 1) // PAGE
        table = K.as_device(cp.asarray(
            rng.permutation(bs * pages_per).astype(np.int32).reshape(bs, pages_per)))
        cache_cp = cp.random.standard_normal((layers, bs * pages_per, PAGE, D), cp.float32)
        if cache_dtype == "bfloat16":
            cache_cp = (cache_cp.view(cp.uint32) >> 16).astype(cp.uint16)
        cache = K.as_device(cache_cp)
        if cache_dtype == "bfloat16":
            cache = cache.view(BFLOAT16)
        accepted = (K.allocate_accept(bs, N), K.as_device(cp.empty(bs, cp.int32)))

        def topk_stage():
            K.draft_topk(d_x, Kk, out=topk, scratch=topk_scratch)

        def tree_stage():
            K.build_tree(topk[0], topk[1], d_roots, BUDGET, prefix_lens=d_prefix, out=tree,
                         scratch=ranks)

        def accept_stage():
            K.accept_commit(tree.token_ids, tree.next_token, tree.next_sibling, d_predict,
                            cache, table, d_prefix, out=accepted)

        def whole():
            topk_stage()
            tree_stage()
            accept_stage()

        whole()                                        # the chain once, then checked
        cp.cuda.Device().synchronize()
        exact = (np.array_equal(topk[1].copy_to_host(), want_ids)
                 and np.array_equal(tree.parents.copy_to_host(), want_tree.parents)
                 and np.array_equal(tree.token_ids.copy_to_host(), want_tree.token_ids)
                 and np.array_equal(accepted[0].accept_nodes.copy_to_host(),
                                    want_acc.accept_nodes))
        times = {name: bench.time_device(f, reps=30)["ms"] * 1e3
                 for name, f in (("draft_topk_us", topk_stage), ("build_tree_us", tree_stage),
                                 ("accept_commit_us", accept_stage), ("whole_us", whole))}
        bench.add(bs=bs, L=L, V=V, K=Kk, budget=BUDGET, logits=logit_dtype, layers=layers,
                  cache=cache_dtype, **times,
                  sum_of_stages_us=sum(v for k, v in times.items() if k != "whole_us"),
                  graph_floor_us=floor_us, exact=bool(exact),
                  mean_accept_len=float(want_acc.accept_len.mean()))
    path = bench.write_csv()
    print_table(bench.rows, ["bs", "logits", "layers", "cache", "draft_topk_us",
                             "build_tree_us", "accept_commit_us", "sum_of_stages_us",
                             "whole_us", "graph_floor_us", "mean_accept_len", "exact"],
                f"the DDTree part of a step on {bench.gpu}, {bench.date} (L {L}, V {V}, "
                f"K = budget = {BUDGET}; device us, graph replay median, L2 flushed)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
