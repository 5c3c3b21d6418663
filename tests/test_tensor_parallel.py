"""The single-process reference of tensor parallelism (ranks simulated in numpy, collectives as
sums): the sharded forward equals the unsharded one, greedy decoding is unchanged, and the
collectives move what the sharding says."""

import numpy as np
import pytest

from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
from ddtree_numba.models.toy_mla_tp import TensorParallelToyMLA

CONFIG = ToyMLAConfig.tiny(heads=4, ffn=64, vocab=64)


def problem(config, n=6, P=9, seed=0):
    rng = np.random.default_rng(seed)
    prefix = rng.standard_normal((config.layers, P, config.row_width)).astype(np.float32)
    tokens = rng.integers(0, config.vocab, n)
    visible = np.tril(np.ones((n, n), bool))
    visible[3, 1] = False                                   # a tree, not a chain
    return tokens, np.arange(P, P + n), visible, prefix


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_forward_equals_the_unsharded_one(tp):
    model = ToyMLA(CONFIG)
    args = problem(CONFIG, seed=tp)
    want_logits, want_rows = model.forward_rows(*args)
    sharded = TensorParallelToyMLA(model, tp)
    logits, rows = sharded.forward_rows(*args)
    np.testing.assert_array_equal(rows, want_rows)          # replicated: the same bits
    np.testing.assert_allclose(logits, want_logits, rtol=1e-12, atol=1e-12)
    n, c = len(args[0]), CONFIG
    assert sharded.traffic.calls == {"all_reduce": 2 * c.layers, "all_gather": 1}
    assert sharded.traffic.all_reduce == 2 * c.layers * n * c.hidden
    assert sharded.traffic.all_gather == n * c.vocab // tp


def test_greedy_decoding_is_the_same_on_two_ranks():
    """What a TP=2 step must reproduce: plain greedy decoding through the sharded forward is
    the unsharded model's, token for token."""
    model = ToyMLA(ToyMLAConfig.tiny())
    sharded = TensorParallelToyMLA(model, 2)
    rows = np.zeros((model.config.layers, 0, model.config.row_width), np.float32)
    token, tokens = 5, []
    for position in range(12):
        logits, new = sharded.forward_rows([token], [position], np.ones((1, 1), bool), rows)
        rows = np.concatenate([rows, new], axis=1)
        token = int(np.argmax(logits[0]))
        tokens.append(token)
    assert tokens == model.greedy(5, 12)


def test_a_rank_count_that_does_not_divide_is_refused():
    model = ToyMLA(ToyMLAConfig.tiny())                      # 2 heads
    with pytest.raises(ValueError, match=r"tp: expected a divisor of the model's heads \(2\)"):
        TensorParallelToyMLA(model, 4)
    with pytest.raises(ValueError, match="tp: expected a positive int"):
        TensorParallelToyMLA(model, 0)
    with pytest.raises(TypeError, match="model: expected a ToyMLA"):
        TensorParallelToyMLA(object(), 2)
