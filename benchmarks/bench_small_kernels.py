"""Benchmark: draft_topk against torch and CuPy; tree_accept and commit_kv device time.

draft_topk: bs in {1, 8, 64}, L = 15, V in {32000, 163840}, K in {16, 256, 1024}, float32
logits (and bfloat16 at the largest size); ``gpu_us`` is the call as the launcher makes it
(``variant``: its default, in ``parts`` blocks a row), ``whole_rows_us`` the same with one
block a row (``parts=1``), and ``two_pass_us``, ``filtered_us``, ``resident_us`` each variant
that takes the logits in those parts. GB/s counts one read of the logits (the floor), against
the device-to-device copy bandwidth measured in the same run. Then, at bs 1 and V 163 840,
the resident and one-pass kernels in each number of parts they take (``parts_sweep``). Baselines:
``torch.topk`` + ``torch.logsumexp`` (eager, events) and CuPy written the obvious way
(log-softmax, then a full ``argsort``).

tree_accept / commit_kv: bs in {1, 64}, N in {64, 1025}, on trees from the reference builder
and accepted paths of depth up to L = 15 (FlashMLA-style cache: 576-wide rows, 64-row pages),
one float32 layer, and DeepSeek-V3's 61 bfloat16 layers at N = 1025: each alone (commit_kv
once per layer), the launches together, and ``accept_commit`` (all in one launch; its result
checked against theirs), with the floor of a graph replay (one empty kernel) in the same run.

Options: ``--quick`` (fewer configurations), ``--targets`` (draft_topk at the configurations
the performance targets name, the default launch and the baselines only: the fewest kernels
to compile), ``--bs N`` (draft_topk at batch size ``N`` only), ``--draft-topk-only``,
``--accept-commit-only``.
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np
import torch
from harness import Bench, copy_bandwidth_gbs, print_table
from numba import cuda

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.arrays import BFLOAT16
from ddtree_numba.kernels._device import launch, launch_stream
from ddtree_numba.kernels.draft_topk import (
    default_variant,
    filtered_applies,
    parts_per_row,
    resident_applies,
)


def bench_draft_topk(quick: bool, targets: bool = False, bs_only: int | None = None):
    # --targets writes a CSV of its own: its rows lack the other variants' columns
    bench = Bench("draft_topk_targets" if targets else "draft_topk")
    copy_gbs = copy_bandwidth_gbs(bench)
    L = 15
    configs = [(bs, V, k, "float32") for V in (32000, 163840) for k in (16, 256, 1024)
               for bs in (1, 8, 64)]
    configs += [(64, 163840, 256, "bfloat16"), (8, 163840, 256, "bfloat16")]
    if quick:
        configs = [c for c in configs if c[0] != 8][:6]
    if targets:                             # the configurations the issue sets targets for
        configs = [(1, 163840, 256, "float32"), (64, 163840, 256, "float32"),
                   (64, 163840, 256, "bfloat16"), (1, 163840, 16, "float32"),
                   (64, 32000, 256, "float32"), (64, 163840, 16, "float32")]
    if bs_only is not None:
        configs = [c for c in configs if c[0] == bs_only]
    for bs, V, k, dtype in configs:
        tdtype = torch.float32 if dtype == "float32" else torch.bfloat16
        x_t = (torch.randn((bs, L, V), device="cuda") * 3).to(tdtype)
        x = K.as_device(x_t)
        out = (K.as_device(cp.empty((bs, L, k), cp.float32)),
               K.as_device(cp.empty((bs, L, k), cp.int32)))

        parts = parts_per_row(bs * L, V, k)
        scratch = K.allocate_topk_scratch(bs, L, V, k)   # allocated outside the graph
        logits = x_t if dtype == "bfloat16" else x
        bits = x.reshape(bs * L, V).view(np.uint16 if dtype == "bfloat16" else np.uint32)
        variant = default_variant(bits, parts, k)       # what draft_topk launches

        def launch():
            K.draft_topk(logits, k, out=out, scratch=scratch)

        gpu = bench.time_device(launch, reps=20)
        # --targets times the default launch alone: every other variant is one more kernel
        # to compile (a first run spent its device command's 170 s compiling)
        whole_rows = gpu if parts == 1 or targets else bench.time_device(
            lambda: K.draft_topk(logits, k, out=out, parts=1), reps=20)
        per_variant = {}                    # every variant that takes these logits and parts
        for other in ("two_pass", "filtered", "resident"):
            if other == variant:
                per_variant[other] = gpu
            elif targets:
                continue
            elif ((other == "filtered" and filtered_applies(bits, k))
                  or (other == "resident" and resident_applies(bits, k, parts))
                  or other == "two_pass"):
                per_variant[other] = bench.time_device(
                    lambda: K.draft_topk(logits, k, out=out, scratch=scratch, variant=other),
                    reps=20)

        def torch_way():
            lse = torch.logsumexp(x_t.float(), dim=-1, keepdim=True)
            values, ids = torch.topk(x_t, k, dim=-1)
            return values.float() - lse, ids

        with torch.cuda.stream(torch.cuda.ExternalStream(bench.stream.ptr)):
            torch_t = bench.time_eager_events(torch_way, reps=10)
        x_c = cp.asarray(x_t.float()) if dtype == "bfloat16" else cp.asarray(x_t)

        def cupy_way():
            m = x_c.max(axis=-1, keepdims=True)
            lse = m + cp.log(cp.exp(x_c - m).sum(axis=-1, keepdims=True))
            ids = cp.argsort(-x_c, axis=-1)[..., :k]
            return cp.take_along_axis(x_c, ids, axis=-1) - lse, ids

        cupy_t = bench.time_eager_events(cupy_way, reps=3) if V * bs <= 8 * 163840 else None
        # exactness on this input: ids equal to the reference's (the variant measured)
        launch()
        host = x_t.float().cpu().numpy() if dtype == "bfloat16" else x_t.cpu().numpy()
        want_ids = ref.draft_topk(host[: min(bs, 2)], k)[1]
        exact = bool((out[1].copy_to_host()[: min(bs, 2)] == want_ids).all())
        nbytes = bs * L * V * x_t.element_size()
        gbs = nbytes / (gpu["ms"] * 1e-3) / 1e9
        variant_us = {f"{name}_us": t["ms"] * 1e3 if t else None
                      for name, t in ((v, per_variant.get(v)) for v in
                                      ("two_pass", "filtered", "resident"))}
        bench.add(bs=bs, L=L, V=V, k=k, dtype=dtype, variant=variant, parts=parts,
                  gpu_us=gpu["ms"] * 1e3,
                  whole_rows_us=None if parts > 1 and targets else whole_rows["ms"] * 1e3,
                  **variant_us,
                  read_gbs=gbs, pct_of_copy_bw=100 * gbs / copy_gbs, copy_gbs=copy_gbs,
                  torch_us=torch_t["ms"] * 1e3, speedup_vs_torch=torch_t["ms"] / gpu["ms"],
                  cupy_us=None if cupy_t is None else cupy_t["ms"] * 1e3, ids_exact=exact)
        torch.cuda.empty_cache()
    bench.write_csv()
    print_table(bench.rows, ["bs", "V", "k", "dtype", "variant", "parts", "gpu_us",
                             "whole_rows_us", "two_pass_us", "filtered_us", "resident_us",
                             "read_gbs", "pct_of_copy_bw",
                             "torch_us", "speedup_vs_torch", "cupy_us", "ids_exact"],
                f"draft_topk on {bench.gpu}, {bench.date}; copy bandwidth "
                f"{bench.rows[0]['copy_gbs']:.0f} GB/s (read + write)")
    if not targets:
        sweep_parts(quick)


def sweep_parts(quick: bool):
    """bs 1, L 15, V 163 840, float32 logits: the resident kernel in 7 (the fewest that hold a
    row), 8 and 16 parts, and the one-pass kernel in 1, 2, 4, ... parts (as far as the merge
    takes them)."""
    from ddtree_numba.kernels.draft_topk import max_parts

    bench = Bench("draft_topk_parts")
    L, V = 15, 163840
    x = K.as_device(torch.randn((1, L, V), device="cuda") * 3)
    for k in (16, 256):
        out = (K.as_device(cp.empty((1, L, k), cp.float32)),
               K.as_device(cp.empty((1, L, k), cp.int32)))
        runs = [("resident", parts) for parts in (7, 8, 16)]
        runs += [("filtered", 1 << i) for i in range(7) if (1 << i) <= max_parts(V, k)
                 and not (quick and i > 2)]
        for variant, parts in runs:
            scratch = K.allocate_topk_scratch(1, L, V, k, parts)
            t = bench.time_device(lambda: K.draft_topk(x, k, out=out, parts=parts,
                                                       scratch=scratch, variant=variant),
                                  reps=20)
            bench.add(bs=1, L=L, V=V, k=k, variant=variant, parts=parts,
                      gpu_us=t["ms"] * 1e3, chosen=parts == parts_per_row(L, V, k))
    bench.write_csv()
    print_table(bench.rows, ["k", "variant", "parts", "gpu_us", "chosen"],
                f"draft_topk, bs 1, V {V}: blocks per row")


@cuda.jit
def _empty_kernel(flag):
    """Does nothing (its argument keeps it a real launch): the floor of a graph replay."""
    if flag[0] == 12345:
        flag[0] = 0


def accepted_paths(tree, depth_limit, rng):
    """Predictions that follow the first child to depth_limit (a long accepted path)."""
    bs, N = tree.parents.shape
    predict = np.full((bs, N), 10**6, np.int32)
    for b in range(bs):
        cur = 0
        for _ in range(depth_limit):
            kids = np.flatnonzero(tree.parents[b] == cur)
            if not kids.size:
                break
            child = int(kids[rng.integers(0, min(3, kids.size))])
            predict[b, cur] = tree.token_ids[b, child]
            cur = child
    return predict


def bench_accept_commit(quick: bool):
    bench = Bench("accept_commit")
    rng = np.random.default_rng(1)
    flag = K.as_device(cp.zeros(1, cp.int32))
    floor = bench.time_device(lambda: launch(_empty_kernel, 1, 32, launch_stream())(flag))
    floor_us = floor["ms"] * 1e3
    L, page_size, D = 15, 64, 576
    # (bs, N, layers, cache dtype, longest prefix): one float32 layer, then DeepSeek-V3's 61
    # bf16 layers (prefixes kept short enough for the 61-layer cache to fit)
    configs = [(bs, N, 1, "float32", 8192) for N in (64, 1025) for bs in (1, 64)]
    configs += [(bs, 1025, 61, "bfloat16", 1024) for bs in (1, 64)]
    for bs, N, layers, dtype, max_prefix in configs[:3] if quick else configs:
        Kk = min(N - 1, 64)
        x = (rng.standard_normal((bs, L, Kk + 8)) * 3).astype(np.float32)
        lp, ids = ref.draft_topk(x, Kk)
        tree = ref.build_tree(lp, ids, np.zeros(bs, np.int32), N - 1)
        predict = accepted_paths(tree, L, rng)
        args = [K.as_device(a) for a in (tree.token_ids, tree.next_token, tree.next_sibling,
                                         predict)]
        res = K.allocate_accept(bs, N)

        def accept():
            K.tree_accept(*args, out=res)

        t_acc = bench.time_device(accept, reps=50)
        want = ref.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, predict)
        exact = bool((res.accept_nodes.copy_to_host() == want.accept_nodes).all())
        prefix = rng.integers(0, max_prefix, bs).astype(np.int32)
        pages_per = (int(prefix.max()) + N + page_size - 1) // page_size
        table = rng.permutation(bs * pages_per).astype(np.int32).reshape(bs, pages_per)
        cache_cp = cp.random.standard_normal((layers, bs * pages_per, page_size, D),
                                             dtype=cp.float32)
        if dtype == "bfloat16":                         # the bits of bf16 values
            cache_cp = (cache_cp.view(cp.uint32) >> 16).astype(cp.uint16)
        cache = K.as_device(cache_cp)                   # a view: both name one buffer
        if dtype == "bfloat16":
            cache = cache.view(BFLOAT16)
        c_args = [K.as_device(a) for a in (table, prefix, want.accept_nodes, want.accept_len)]
        new_prefix = K.as_device(cp.empty(bs, cp.int32))

        def commit():
            for layer in range(layers):
                K.commit_kv(cache[layer], *c_args, out=new_prefix)

        t_com = bench.time_device(commit, reps=50)
        t_both = bench.time_device(lambda: (accept(), commit()), reps=50)
        # the fused launch: the same result, from fresh copies of the cache
        before = cache_cp.copy()
        fused_out = (K.allocate_accept(bs, N), K.as_device(cp.empty(bs, cp.int32)))
        fused_args = [K.as_device(a) for a in (tree.token_ids, tree.next_token,
                                               tree.next_sibling, predict, table, prefix)]

        def fused():
            K.accept_commit(*fused_args[:4], cache, *fused_args[4:], out=fused_out)

        fused()
        fused_cache = cache_cp.copy()
        cache_cp[...] = before
        accept()
        commit()
        fused_exact = bool((fused_cache == cache_cp).all()
                           and (fused_out[0].accept_nodes.copy_to_host()
                                == want.accept_nodes).all())
        del before, fused_cache
        t_fused = bench.time_device(fused, reps=50)
        bench.add(bs=bs, N=N, layers=layers, cache=dtype,
                  mean_accept_len=float(want.accept_len.mean()),
                  tree_accept_us=t_acc["ms"] * 1e3, commit_kv_us=t_com["ms"] * 1e3,
                  both_us=t_both["ms"] * 1e3, accept_commit_us=t_fused["ms"] * 1e3,
                  graph_floor_us=floor_us, accept_exact=exact, fused_exact=fused_exact)
    bench.write_csv()
    print_table(bench.rows, ["bs", "N", "layers", "cache", "mean_accept_len", "tree_accept_us",
                             "commit_kv_us", "both_us", "accept_commit_us", "graph_floor_us",
                             "accept_exact", "fused_exact"],
                f"tree_accept / commit_kv (once per layer) / accept_commit on {bench.gpu}; "
                f"graph_floor_us: a graph of one empty kernel")


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    if "--draft-topk-only" not in sys.argv:
        bench_accept_commit(quick)
    if "--accept-commit-only" not in sys.argv:
        bs_only = int(sys.argv[sys.argv.index("--bs") + 1]) if "--bs" in sys.argv else None
        bench_draft_topk(quick, targets="--targets" in sys.argv, bs_only=bs_only)
