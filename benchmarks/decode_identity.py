"""Is verification bit-identical to decoding? The logits of the accepted path against one-token
decoding, row by row, on the GPU toy target.

A greedy DDTree step computes logits for every tree node; along the accepted path those rows
predict the tokens that plain decoding would predict one step at a time. In exact arithmetic
the two are equal. In floating point they agree only if every kernel computes a query row's
result the same way whatever else shares the launch: the same split boundaries, the same
reduction order, the same tiles. Where they differ, a near-tie of the argmax can flip, and
greedy speculative decoding stops being lossless in practice (more often in 16-bit).

For each cache type (float32: ``verify_attn``'s tiled variant; bfloat16: the tensor-core
variant ``mma``) and budget, this runs ``STEPS`` speculative steps at bs 4 and one-token
decoding (budget 0) over the same tokens, keeps the logits row of every emitted position in
both, and counts the rows that are bit-identical, the largest difference, and whether the
emitted tokens agree. Writes ``$OUT/decode_identity.csv``.
"""

from __future__ import annotations

import numpy as np
from harness import Bench, print_table

from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
from ddtree_numba.step.demo import DemoSizes, build_step

BS, L, TOPK, STEPS = 4, 8, 8, 6


def path_logits(model, continuation, starts, budget: int, steps: int) -> tuple:
    """``({(request, position): logits row}, tokens)`` of ``steps`` steps at ``budget``: the
    target's logits at every node of each step's accepted path (root first), by position."""
    sizes = DemoSizes(bs=len(starts), steps=steps, L=L if budget else 1, K=TOPK if budget else 1,
                      budget=budget, config=model.config)
    step = build_step(model, continuation, sizes, mode="eager", accuracy=0.7, seed=1)
    step.start(starts)
    rows = {}
    for _ in range(steps):
        step()
        got = step.last_step()
        logits = step.target_logits.copy_to_host()          # [bs * N, V]
        tree, accept = got["tree"], got["accept"]
        for b in range(len(starts)):
            for node in accept.accept_nodes[b]:
                if node < 0:
                    break
                rows[b, int(tree.positions[b, node])] = logits[b * step.N + node]
    return rows, step.tokens()


def main():
    bench = Bench("decode_identity")
    config = ToyMLAConfig.gpu(vocab=1024)
    starts = np.random.default_rng(0).integers(0, config.vocab, BS).astype(np.int32)
    for cache in ("float32", "bfloat16"):
        model = ToyMLA(config, cache_dtype=cache)
        length = STEPS * (L + 1)
        greedy = np.array([model.greedy(int(s), length) for s in starts], np.int32)
        continuation = np.concatenate([starts[:, None], greedy], axis=1)
        plain, plain_tokens = path_logits(model, continuation, starts, 0, length)
        for budget in (16, 64, 256):
            spec, spec_tokens = path_logits(model, continuation, starts, budget, STEPS)
            common = sorted(set(spec) & set(plain))
            same = [np.array_equal(spec[k].view(np.uint32), plain[k].view(np.uint32))
                    for k in common]
            diff = max(float(np.abs(spec[k] - plain[k]).max()) for k in common)
            agree = all(s == p[: len(s)] or p == s[: len(p)]
                        for s, p in zip(spec_tokens, plain_tokens, strict=True))
            bench.add(cache=cache, budget=budget, rows=len(common), bit_identical=sum(same),
                      rate=sum(same) / len(common), max_abs_diff=diff, tokens_agree=agree,
                      reference_agree=all(t == greedy[b, : len(t)].tolist()
                                          for b, t in enumerate(spec_tokens)))
            bench.write_csv()
    print_table(bench.rows, list(bench.rows[0]), f"accepted-path logits vs one-token decoding "
                f"on {bench.gpu} (toy: 2 layers, 4 heads, Dc 512, Dr 64; bs {BS}, L {L}, K {TOPK})")
    print("wrote", bench.write_csv())


if __name__ == "__main__":
    main()
