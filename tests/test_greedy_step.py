"""The reference greedy step end to end on the bigram toy, and the demo (kernels vs reference)."""

import numpy as np
import pytest

from ddtree_numba import reference as ref
from ddtree_numba.demo import run_demo
from ddtree_numba.toy import BigramTarget, noisy_drafter_logits


@pytest.mark.parametrize("budget", [0, 1, 16, 64])
@pytest.mark.parametrize("confidence", [0.0, 3.0, 12.0])
def test_reference_step_is_lossless(budget, confidence):
    rng = np.random.default_rng(budget + int(confidence))
    bs, L, k, steps, page = 3, 5, 4, 5, 8
    target = BigramTarget(vocab=50, row_width=4, seed=1)
    pages = (steps * (L + 1) + budget + 1 + page) // page + 1
    table = rng.permutation(bs * pages).astype(np.int32).reshape(bs, pages)
    cache = np.zeros((bs * pages, page, 4), np.float32)
    roots = rng.integers(0, 50, bs).astype(np.int32)
    start, prefix, emitted = roots.copy(), np.zeros(bs, np.int32), [[] for _ in range(bs)]
    for _ in range(steps):
        logits = noisy_drafter_logits(target, roots, L, confidence=confidence, rng=rng)
        out = ref.greedy_step(logits, roots, target.forward, cache, table, prefix, k=k,
                              budget=budget)
        for b in range(bs):
            kb = int(out.accept.accept_len[b])
            emitted[b] += out.accept.accept_tokens[b, : kb + 1].tolist()
        roots, prefix = out.accept.bonus_token, out.prefix_lens
        if budget == 0:
            assert (out.accept.accept_len == 0).all()
    for b in range(bs):
        assert emitted[b] == target.greedy(int(start[b]), len(emitted[b]))
        # committed cache rows are exactly the rows the target wrote for the emitted tokens
        tokens = [int(start[b])] + emitted[b][:-1]
        for pos, tok in enumerate(tokens):
            row = cache[table[b, pos // page], pos % page]
            np.testing.assert_array_equal(row, target.cache_row(tok, pos))


def test_confident_drafter_accepts_more():
    low = run_demo(bs=1, steps=3, L=4, k=2, budget=8, confidence=0.0, seed=3, out=lambda s: None)
    high = run_demo(bs=1, steps=3, L=4, k=2, budget=8, confidence=20.0, seed=3,
                    out=lambda s: None)
    assert high["mean_tokens_per_step"] == 5.0          # every draft accepted: L + 1 per step
    assert low["mean_tokens_per_step"] < high["mean_tokens_per_step"]


def test_demo_kernels_match_reference_and_are_lossless():
    lines = []
    summary = run_demo(bs=2, steps=3, out=lines.append)
    assert summary["lossless"]
    assert "kernels == reference at every step: True" in lines[-1]
