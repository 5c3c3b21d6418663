"""The main job: greedy DDTree decoding of a toy target, reference and kernels side by side.

Per step and request: the drafter's logits -> draft top-K -> best-first tree -> the target's
predictions at every node -> greedy accept -> KV commit. The reference (numpy) pipeline and the
kernel pipeline run on the same inputs, and the demo checks that (1) every kernel output equals
the reference's and (2) the speculative output equals the target's plain greedy decoding.
"""

from __future__ import annotations

import time

import numpy as np

from . import kernels as K
from . import reference as ref
from .toy import BigramTarget, noisy_drafter_logits


def _format_tree(tree, b: int) -> str:
    n = int(tree.num_nodes[b])
    depth = int(tree.depths[b, :n].max())
    return f"{n - 1} draft nodes, depth {depth}"


def run_demo(*, bs=2, steps=6, L=4, k=4, budget=16, vocab=64, confidence=3.0, page_size=16,
             seed=0, out=print) -> dict:
    """Decode ``steps`` greedy DDTree steps for ``bs`` requests; return a summary dict."""
    rng = np.random.default_rng(seed)
    N = budget + 1
    target = BigramTarget(vocab=vocab, row_width=8, seed=seed)
    max_len = 1 + steps * (L + 1) + N
    pages = (max_len + page_size - 1) // page_size
    block_table = rng.permutation(bs * pages).astype(np.int32).reshape(bs, pages)
    cache_ref = np.zeros((bs * pages, page_size, 8), np.float32)
    cache_dev = K.as_device(cache_ref)
    roots = rng.integers(0, vocab, bs).astype(np.int32)
    start = roots.copy()
    prefix = np.zeros(bs, np.int32)
    emitted = [[] for _ in range(bs)]
    accepted = []
    t0 = time.perf_counter()
    for step in range(steps):
        logits = noisy_drafter_logits(target, roots, L, confidence=confidence, rng=rng)
        # the reference step
        res = ref.greedy_step(logits, roots, target.forward, cache_ref, block_table, prefix,
                              k=k, budget=budget)
        # the kernel step (the toy target runs on the host between kernels for now)
        lp, ids = K.draft_topk(logits, k)
        tree = K.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
        cache_host = cache_dev.copy_to_host()
        predict = target.forward(tree, cache_host, block_table, prefix)
        cache_dev = K.as_device(cache_host)
        acc = K.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, predict)
        new_prefix = K.commit_kv(cache_dev, block_table, prefix, acc.accept_nodes,
                                 acc.accept_len, check=True).copy_to_host()
        tree_h, acc_h = tree.to_host(), acc.to_host()
        same = (np.array_equal(tree_h.parents, res.tree.parents)
                and np.array_equal(tree_h.token_ids, res.tree.token_ids)
                and np.array_equal(acc_h.accept_tokens, res.accept.accept_tokens)
                and np.array_equal(new_prefix, res.prefix_lens)
                and np.array_equal(cache_dev.copy_to_host(), cache_ref))
        if not same:
            raise AssertionError(f"step {step}: the kernels disagree with the reference")
        for b in range(bs):
            kb = int(res.accept.accept_len[b])
            new = res.accept.accept_tokens[b, : kb + 1].tolist()
            emitted[b] += new
            accepted.append(kb)
            out(f"step {step} req {b}: tree {_format_tree(res.tree, b)}; accepted {kb} "
                f"(path {res.accept.accept_nodes[b, : kb + 1].tolist()}) -> tokens {new}")
        roots = res.accept.bonus_token.copy()
        prefix = res.prefix_lens
    seconds = time.perf_counter() - t0
    lossless = all(emitted[b] == target.greedy(int(start[b]), len(emitted[b]))
                   for b in range(bs))
    mean_accept = float(np.mean(accepted)) + 1.0
    out(f"\n{sum(map(len, emitted))} tokens in {steps} steps x {bs} requests; mean tokens per "
        f"step {mean_accept:.2f} (accepted + bonus); {seconds:.2f} s "
        f"({'CUDA simulator' if K.SIMULATOR else 'GPU'})")
    out(f"kernels == reference at every step: True; output == plain greedy decoding: {lossless}")
    if not lossless:
        raise AssertionError("speculative output differs from plain greedy decoding")
    return {"tokens": emitted, "mean_tokens_per_step": mean_accept, "lossless": lossless}
