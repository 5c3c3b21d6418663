"""Sampled DDTree decoding end to end: SampledStep on the device against the reference sampled
step, temperature 0 against greedy decoding, mixed batches, reproducibility, and the checks.
(Lossless in distribution is shown on the walk itself: tests/test_tree_sample.py.)"""

import numpy as np
import pytest

from ddtree_numba import GreedyStep, SampledStep
from ddtree_numba import reference as ref
from ddtree_numba.models.toy_drafter import FixedDrafter, ToyDrafter
from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
from ddtree_numba.models.toy_mla_device import DeviceToyMLA

TINY = ToyMLAConfig.tiny(layers=1)


def toy(config=TINY, *, bs=3, steps=3, L=3, seed=1):
    model = ToyMLA(config)
    starts = np.random.default_rng(seed).integers(0, config.vocab, bs).astype(np.int32)
    greedy = np.array([model.greedy(int(s), steps * (L + 1)) for s in starts], np.int32)
    return model, starts, np.concatenate([starts[:, None], greedy], axis=1)


def decode(cls, model, continuation, starts, *, steps=3, L=3, K=2, budget=6, mode="eager",
           **options):
    step = cls(DeviceToyMLA(model), ToyDrafter(continuation, vocab=model.config.vocab,
                                               accuracy=0.7, seed=0),
               bs=len(starts), L=L, K=K, budget=budget, max_steps=steps, mode=mode, **options)
    step.start(starts)
    outs = []
    for _ in range(steps):
        step()
        outs.append(step.last_step())
    return step.tokens(), outs, step


def test_temperature_zero_is_greedy_decoding():
    """One-hot distributions make the walk accept what greedy verification accepts: the
    tokens equal GreedyStep's and the target's plain greedy decoding."""
    model, starts, continuation = toy()
    greedy, _, _ = decode(GreedyStep, model, continuation, starts)
    sampled, _, _ = decode(SampledStep, model, continuation, starts, temperature=0.0, top_k=3,
                           top_p=0.5, seed=9)
    assert sampled == greedy
    for b in range(len(starts)):
        assert greedy[b] == continuation[b, 1: len(greedy[b]) + 1].tolist()


def test_device_step_equals_reference_step_in_a_mixed_batch():
    """Request 0 samples at temperature 1, request 1 is greedy, request 2 uses top-k and
    top-p: every step's uniforms are the reference's bits and its accepted tokens the
    reference sampled step's (on the same drafter logits)."""
    model, starts, continuation = toy()
    T = np.array([1.0, 0.0, 0.7], np.float32)
    k, p = np.array([0, 0, 5], np.int32), np.array([1.0, 1.0, 0.9], np.float32)
    tokens, outs, step = decode(SampledStep, model, continuation, starts, temperature=T,
                                top_k=k, top_p=p, seed=123)
    greedy, _, _ = decode(GreedyStep, model, continuation, starts)
    assert tokens[1] == greedy[1]
    table = step.block_table.copy_to_host()
    _, num_pages, page_size, _ = step.target.kv_cache.shape
    model.allocate(bs=3, N=step.N, num_pages=num_pages, page_size=page_size,
                   max_pages=table.shape[1])
    roots, prefix = starts.copy(), np.zeros(3, np.int32)
    for got in outs:
        want = ref.sampled_step(model, FixedDrafter(got["draft_logits"]), roots, table, prefix,
                                k=2, budget=6, temperature=T, top_k=k, top_p=p, seed=123)
        np.testing.assert_array_equal(got["uniforms"], want.uniforms)
        np.testing.assert_array_equal(got["bonus_uniforms"], want.bonus_uniforms)
        np.testing.assert_array_equal(got["accept"].accept_tokens, want.accept.accept_tokens)
        np.testing.assert_array_equal(got["prefix_lens"], want.prefix_lens)   # after the step
        for b in range(3):
            n = int(want.tree.num_nodes[b])
            np.testing.assert_allclose(got["probs"][b, :n], want.probs[b, :n], atol=1e-6)
        roots, prefix = want.accept.bonus_token.copy(), want.prefix_lens


def test_a_run_is_reproducible_from_its_seed():
    model, starts, continuation = toy(bs=2)
    runs = [decode(SampledStep, model, continuation, starts, temperature=1.0, seed=s)[0]
            for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_sampled_step_errors_are_clear():
    model, starts, continuation = toy(bs=2)
    target = DeviceToyMLA(model)
    drafter = ToyDrafter(continuation, vocab=model.config.vocab, accuracy=0.7, seed=0)
    base = dict(bs=2, L=3, K=2, budget=4, max_steps=2)
    for options, error, match in (
            ({"temperature": -0.5}, ValueError, "temperature: expected finite, >= 0"),
            ({"temperature": [1.0, 1.0, 1.0]}, ValueError, "temperature: expected a number or 2"),
            ({"top_p": 0.0}, ValueError, r"top_p: expected in \(0, 1\]"),
            ({"top_k": -1}, ValueError, "top_k: expected >= 0"),
            ({"top_k": 1.5}, TypeError, "top_k: expected ints"),
            ({"seed": -1}, ValueError, "seed: expected an int in"),
            ({"temperature": "hot"}, TypeError, "temperature: expected numbers")):
        with pytest.raises(error, match=match):
            SampledStep(target, drafter, **base, **options)


GPU_TOY = ToyMLAConfig.gpu(vocab=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_gpu_graph_equals_eager_and_temperature_zero_is_greedy(temperature):
    model, starts, continuation = toy(GPU_TOY, bs=4, steps=4, L=8, seed=2)
    runs = {mode: decode(SampledStep, model, continuation, starts, steps=4, L=8, K=8,
                         budget=64, mode=mode, temperature=temperature, top_p=0.95, seed=7)[0]
            for mode in ("eager", "graph")}
    assert runs["eager"] == runs["graph"]
    if temperature == 0:
        greedy = decode(GreedyStep, model, continuation, starts, steps=4, L=8, K=8,
                        budget=64)[0]
        assert runs["eager"] == greedy


def test_sampled_demo_checks_itself():
    from ddtree_numba.step.demo import run_demo

    lines = []
    summary = run_demo(bs=1, steps=2, L=2, k=2, budget=3, temperature=0.8, top_k=4, seed=1,
                       out=lines.append)
    assert lines[-1] == "device step == reference sampled step at every step: True"
    assert len(summary["tokens"][0]) >= 2


def test_values_the_cast_would_change_are_refused():
    model, starts, continuation = toy(bs=2)
    target = DeviceToyMLA(model)
    drafter = ToyDrafter(continuation, vocab=model.config.vocab, accuracy=0.7, seed=0)
    base = dict(bs=2, L=3, K=2, budget=4, max_steps=2)
    for options, match in (({"top_k": 2**32}, "top_k: expected a value that int32 holds"),
                           ({"top_p": 1e-50}, "top_p: expected a value that float32 holds"),
                           ({"temperature": 1e300}, "temperature: expected a value that float32")):
        with pytest.raises(ValueError, match=match):
            SampledStep(target, drafter, **base, **options)
