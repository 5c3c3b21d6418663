"""Benchmark: sampled decoding on the GPU.

1. Tokens per step of the toy target and drafter (the demo's GPU sizes: bs 4, L 8, K 8,
   budget 64; 12 steps) at temperatures 0, 0.6 and 1.0, eager and as one CUDA graph; the two
   modes must emit the same tokens, and at temperature 0 the sampled step must emit plain
   greedy decoding. Two toy targets: the demo's (``logit_scale`` 4: its top logit leads by
   ~30, so even temperature 1 samples the argmax) and one with ``logit_scale`` 1 (top
   probability 0.35-0.93 at temperature 1, ~0.99 at 0.6: an LLM-like spread). Writes
   ``$OUT/sampled_tokens.csv``.
2. Device time of the sampling kernels at bs 64, N 257, V 163 840 (float32 logits:
   16 448 rows, 10.8 GB), for temperature only, top-k, top-p and both: ``sampling_probs``
   then ``tree_sample`` (every row's distribution written, then the walk), against the fused
   ``tree_sample_logits`` (the distribution of the visited rows only; its result must equal
   the pair's bit for bit) and against torch written the obvious way (vLLM's order: divide,
   top-k threshold by ``torch.topk``, top-p by an ascending sort and cumulative sum,
   ``softmax``, run in four row chunks so its sort fits in memory; then the walk vectorised
   over requests, a loop over depth and siblings, and the residual's inverse CDF by
   ``cumsum`` + ``searchsorted``); and ``sample_uniforms``. Bandwidth: the bytes every pass
   over the logits moves, per second, against the copy bandwidth measured in the same run.
   Writes ``$OUT/sampling_kernels.csv``.

Run from ``benchmarks/`` (``python3 bench_sampling.py [--tokens-only|--kernels-only]``).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from harness import Bench, copy_bandwidth_gbs, print_table

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.models.toy_mla import ToyMLAConfig
from ddtree_numba.step.demo import build_step, default_sizes, demo_problem, timed_run

TEMPERATURES = (0.0, 0.6, 1.0)
BS, BUDGET, VOCAB, DEPTH, TOPK = 64, 256, 163840, 15, 16
PARAMS = {"temperature": (1.0, 0, 1.0), "top-k 50": (0.6, 50, 1.0),
          "top-p 0.9": (1.0, 0, 0.9), "top-k 50, top-p 0.9": (0.6, 50, 0.9)}


def passes(top_k: int, top_p: float) -> int:
    """Passes of sampling_probs over a row of logits: max, sum and write, plus one per bit of
    each threshold search it runs (top-k, top-p: 32 each; see kernels/sampling_probs.py)."""
    return 3 + 32 * (top_k > 0) + 32 * (top_p < 1)


def bench_tokens():
    bench = Bench("sampled_tokens")
    for logit_scale in (4.0, 1.0):
        tokens_at(bench, logit_scale)
    bench.write_csv()
    print_table(bench.rows, ["logit_scale", "temperature", "tokens", "tokens_per_step",
                             "graph_equals_eager", "equals_greedy_step", "equals_plain_greedy",
                             "eager_wall_us", "graph_wall_us"],
                f"sampled toy decoding on {bench.gpu} (bs 4, L 8, K 8, budget 64, 12 steps, "
                f"drafter accuracy 0.8)")


def tokens_at(bench, logit_scale):
    sizes = default_sizes(True)
    sizes, model, starts, greedy, continuation = demo_problem(
        sizes.bs, sizes.steps, sizes.L, sizes.K, sizes.budget, seed=0,
        config=ToyMLAConfig.gpu(logit_scale=logit_scale))
    timed_run(build_step(model, continuation, sizes, mode="eager", accuracy=0.8, seed=0,
                         sampling={"temperature": 1.0}), starts)     # compile: not timed
    greedy_tokens = timed_run(build_step(model, continuation, sizes, mode="graph",
                                         accuracy=0.8, seed=0), starts)["tokens"]
    for temperature in TEMPERATURES:
        sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0}
        runs = {mode: timed_run(build_step(model, continuation, sizes, mode=mode, accuracy=0.8,
                                           seed=0, sampling=sampling), starts)
                for mode in ("eager", "graph")}
        tokens = runs["eager"]["tokens"]
        same_as_greedy = greedy_tokens == tokens
        emitted = sum(map(len, tokens))
        bench.add(logit_scale=logit_scale, temperature=temperature, bs=sizes.bs,
                  steps=sizes.steps, L=sizes.L, K=sizes.K, budget=sizes.budget, tokens=emitted,
                  tokens_per_step=emitted / (sizes.bs * sizes.steps),
                  graph_equals_eager=runs["graph"]["tokens"] == tokens,
                  equals_greedy_step=same_as_greedy,
                  equals_plain_greedy=all(t == greedy[b, : len(t)].tolist()
                                          for b, t in enumerate(tokens)),
                  eager_wall_us=runs["eager"]["wall_us"], graph_wall_us=runs["graph"]["wall_us"])


def torch_probs(x, temperature, top_k, top_p, chunks=4):
    """The obvious torch: divide, keep z >= the k-th largest, drop the ascending-sorted prefix
    whose cumulative probability is <= 1 - p, softmax (vLLM's apply_top_k_top_p)."""
    outs = []
    for part in x.chunk(chunks):
        z = part / temperature
        if top_k:
            kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, -float("inf"))
        if top_p < 1:
            z_sorted, order = torch.sort(z, dim=-1)
            cumulative = z_sorted.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1 - top_p
            drop[:, -1] = False
            z = z.scatter(-1, order, z_sorted.masked_fill(drop, -float("inf")))
            del z_sorted, order, cumulative, drop
        outs.append(z.softmax(dim=-1))
    return torch.cat(outs)


def torch_walk(token_ids, next_token, next_sibling, probs, uniforms, bonus_uniforms,
               max_children):
    """The walk in torch ops over all requests at once; the bonus by cumsum + searchsorted."""
    bs, N = token_ids.shape
    rows = torch.arange(bs, device=probs.device)
    cur = torch.zeros(bs, dtype=torch.long, device=probs.device)
    active = torch.ones(bs, dtype=torch.bool, device=probs.device)
    length = torch.zeros(bs, dtype=torch.long, device=probs.device)
    for _ in range(N - 1):
        c = next_token[rows, cur].long()
        acc = torch.zeros(bs, device=probs.device)
        chosen = torch.full_like(cur, -1)
        searching = active.clone()
        for _ in range(max_children):
            valid = searching & (c > 0)
            token = token_ids[rows, c.clamp(min=0)].long()
            acc = acc + torch.where(valid, probs[rows, cur, token], 0.0)
            hit = valid & (uniforms[rows, cur] < acc)
            chosen = torch.where(hit, c, chosen)
            searching = searching & valid & ~hit
            c = next_sibling[rows, c.clamp(min=0)].long()
        active = chosen >= 0
        if not bool(active.any()):              # one host round trip per depth
            break
        cur = torch.where(active, chosen, cur)
        length += active
    residual = probs[rows, cur].clone()
    c = next_token[rows, cur].long()
    for _ in range(max_children):
        valid = c > 0
        token = token_ids[rows, c.clamp(min=0)].long()
        residual[rows[valid], token[valid]] = 0
        c = next_sibling[rows, c.clamp(min=0)].long()
    cdf = residual.cumsum(dim=-1)
    bonus = torch.searchsorted(cdf, (bonus_uniforms * cdf[:, -1]).unsqueeze(1), right=True)
    return length, bonus


def boosted_logits(tree):
    """float32 logits [bs, N, V] where, at every node, its first child's token is likely
    (+14 over a standard normal: ~0.8 of the mass at temperature 1), so walks go deep."""
    bs, N = tree.token_ids.shape
    x = torch.randn((bs, N, VOCAB), device="cuda")
    first = torch.as_tensor(tree.next_token, device="cuda").long()
    tokens = torch.as_tensor(tree.token_ids, device="cuda").long()
    has = first > 0
    b_idx, n_idx = torch.nonzero(has, as_tuple=True)
    x[b_idx, n_idx, tokens[b_idx, first[b_idx, n_idx]]] += 14.0
    return x


def bench_kernels():
    bench = Bench("sampling_kernels")
    copy_gbs = copy_bandwidth_gbs(bench)
    rng = np.random.default_rng(0)
    draft = (rng.standard_normal((BS, DEPTH, TOPK + 8)) * 3).astype(np.float32)
    lp, ids = ref.draft_topk(draft, TOPK)
    tree = ref.build_tree(lp, ids, np.zeros(BS, np.int32), BUDGET)
    N = BUDGET + 1
    rows = BS * N
    logits_t = boosted_logits(tree)
    logits = K.as_device(logits_t)
    probs = K.allocate_probs(BS, N, VOCAB)
    probs_t = torch.as_tensor(probs, device="cuda")
    nbytes = rows * VOCAB * 4
    common = dict(bs=BS, N=N, V=VOCAB, copy_gbs=copy_gbs)
    torch_stream = torch.cuda.ExternalStream(bench.stream.ptr)

    prefix = K.as_device(rng.integers(0, 8192, BS).astype(np.int32))
    uniforms = K.allocate_uniforms(BS, N)
    t = bench.time_device(lambda: K.sample_uniforms(7, prefix, N, out=uniforms), reps=50)
    bench.add(kernel="sample_uniforms", params="philox", **common, gpu_us=t["ms"] * 1e3)
    lists = [K.as_device(a) for a in (tree.token_ids, tree.next_token, tree.next_sibling)]
    lists_t = [torch.as_tensor(a, device="cuda") for a in lists]
    u_t = [torch.as_tensor(u, device="cuda") for u in uniforms]
    children = int(max(np.bincount(p[p >= 0], minlength=N).max() for p in tree.parents))
    two, fused = K.allocate_accept(BS, N), K.allocate_accept(BS, N)

    for name, (temperature, top_k, top_p) in PARAMS.items():
        params = [K.as_device(np.full(BS, v, dt)) for v, dt in
                  ((temperature, np.float32), (top_k, np.int32), (top_p, np.float32))]
        t_probs = bench.time_device(lambda p=params: K.sampling_probs(logits, *p, out=probs),
                                    reps=5, flush=False)
        t_walk = bench.time_device(lambda: K.tree_sample(*lists, probs, *uniforms, out=two),
                                   reps=20)
        t_fused = bench.time_device(lambda p=params: K.tree_sample_logits(
            *lists, logits, *p, *uniforms, out=fused), reps=20)
        exact = all(np.array_equal(getattr(two, f).copy_to_host(),
                                   getattr(fused, f).copy_to_host())
                    for f in ("accept_nodes", "accept_len", "accept_tokens", "bonus_token"))
        accept_len = fused.accept_len.copy_to_host()
        with torch.cuda.stream(torch_stream):
            t_torch = bench.time_eager_events(
                lambda t=temperature, k=top_k, p=top_p: torch_probs(
                    logits_t.view(rows, VOCAB), t, k, p), reps=3)
            t_torch_walk = bench.time_eager_events(
                lambda: torch_walk(*lists_t, probs_t, *u_t, children), reps=5)
            length, _ = torch_walk(*lists_t, probs_t, *u_t, children)
            want = torch_probs(logits_t.view(rows, VOCAB)[:512], temperature, top_k, top_p)
        torch.cuda.synchronize()
        got = probs_t.view(rows, VOCAB)[:512]
        host = probs_t[:2].cpu().numpy()
        sample = ref.sampling_probs(logits_t[:2].cpu().numpy(), *(np.full(2, v, dt) for v, dt in
                                    ((temperature, np.float32), (top_k, np.int32),
                                     (top_p, np.float32))))
        # the fused kernel's passes: those of sampling_probs but its write, at every visited
        # row, and the residual's pass over the last row of each request
        visited = int(accept_len.sum()) + BS
        n_passes = passes(top_k, top_p)
        unfused_ms = t_probs["ms"] + t_walk["ms"]
        torch_ms = t_torch["ms"] + t_torch_walk["ms"]
        bench.add(kernel="sampling_probs + tree_sample", params=name, **common,
                  sampling_probs_us=t_probs["ms"] * 1e3, tree_sample_us=t_walk["ms"] * 1e3,
                  gpu_us=unfused_ms * 1e3, fused_us=t_fused["ms"] * 1e3,
                  torch_probs_us=t_torch["ms"] * 1e3, torch_walk_us=t_torch_walk["ms"] * 1e3,
                  torch_us=torch_ms * 1e3, fused_vs_torch=torch_ms / t_fused["ms"],
                  unfused_vs_torch=torch_ms / unfused_ms, passes=n_passes,
                  probs_moved_gbs=(n_passes + 1) * nbytes / (t_probs["ms"] * 1e-3) / 1e9,
                  fused_moved_gbs=((n_passes - 1) * visited + BS) * VOCAB * 4
                  / (t_fused["ms"] * 1e-3) / 1e9,
                  mean_accept_len=float(accept_len.mean()), fused_equals_unfused=exact,
                  torch_lengths_agree=bool((length.cpu().numpy() == accept_len).all()),
                  max_abs_diff_vs_torch=float((got - want).abs().max()),
                  max_abs_diff_vs_reference=float(np.abs(host - sample).max()),
                  kept_same_as_reference=bool(((host > 0) == (sample > 0)).all()))
        del want, got
        torch.cuda.empty_cache()
        print(bench.rows[-1], flush=True)
    bench.write_csv()
    print_table(bench.rows, ["kernel", "params", "sampling_probs_us", "tree_sample_us",
                             "gpu_us", "fused_us", "torch_probs_us", "torch_walk_us",
                             "fused_vs_torch", "unfused_vs_torch", "probs_moved_gbs",
                             "fused_moved_gbs", "mean_accept_len", "fused_equals_unfused",
                             "torch_lengths_agree", "kept_same_as_reference"],
                f"sampling kernels on {bench.gpu}, bs {BS}, N {N}, V {VOCAB} (float32); copy "
                f"bandwidth {copy_gbs:.0f} GB/s (read + write)")


if __name__ == "__main__":
    if "--kernels-only" not in sys.argv:
        bench_tokens()
    if "--tokens-only" not in sys.argv:
        bench_kernels()
