"""The toy MLA target: the plain numpy forward is a causal transformer over the tree, and the
absorbed device forward (``verify_attn`` on the paged latent cache) matches it.

Bound, absorbed float32 vs plain float64: logits within ``LOGIT_TOL`` of the largest logit
magnitude, cache rows within ``ROW_TOL`` of the largest row entry. Float32 carries ~6e-8
relative rounding per operation; a forward chains ~10 roundings per layer through RMSNorm
(which renormalises) and dot products of length <= 512, and absorbing ``W_UK`` / ``W_UV``
reassociates the products, so errors of 1e-6 to 1e-5 are expected; 1e-4 leaves a margin while
still catching any indexing, masking or position error (those move logits by O(1)).
"""

import dataclasses

import numpy as np
import pytest
from numba import cuda

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.models.dense_ops import HostDenseOps, KernelDenseOps
from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
from ddtree_numba.models.toy_mla_device import DeviceToyMLA
from ddtree_numba.paging import shuffled_block_table
from ddtree_numba.reference.greedy_step import argmax_per_node

LOGIT_TOL = 1e-4
ROW_TOL = 1e-5
ON_SIMULATOR = K.SIMULATOR


def chain_tree(tokens, prefix):
    n = len(tokens)
    parents = np.arange(-1, n - 1, dtype=np.int32)[None]
    return ref.tree_from_parents(parents, np.asarray(tokens, np.int32)[None],
                                 prefix_lens=np.array([prefix], np.int32))


def test_chain_tree_equals_one_token_at_a_time():
    model = ToyMLA(ToyMLAConfig.tiny(seed=3))
    tokens = [5, 17, 2, 40, 33]
    greedy_rows = np.empty((2, 0, model.config.row_width), np.float32)
    step_logits = []
    for pos, tok in enumerate(tokens):
        logits, rows = model.forward_rows([tok], [pos], [[True]], greedy_rows)
        greedy_rows = np.concatenate([greedy_rows, rows], axis=1)
        step_logits.append(logits[0])
    tree = chain_tree(tokens, 0)
    logits, rows = model.forward_rows(tokens, tree.positions[0], tree.visibility[0],
                                      np.empty((2, 0, model.config.row_width), np.float32))
    np.testing.assert_allclose(logits, np.array(step_logits), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(rows, greedy_rows)


def test_greedy_is_argmax_of_its_own_forward():
    model = ToyMLA(ToyMLAConfig.tiny(seed=1))
    out = model.greedy(7, 6)
    tree = chain_tree([7] + out[:-1], 0)
    logits, _ = model.forward_rows(tree.token_ids[0], tree.positions[0], tree.visibility[0],
                                   np.empty((2, 0, model.config.row_width), np.float32))
    assert np.argmax(logits, axis=1).tolist() == out


def test_a_node_sees_only_its_ancestors():
    model = ToyMLA(ToyMLAConfig.tiny(seed=2))
    parents = np.array([[-1, 0, 0, 1, 2]], np.int32)          # 3 under 1, 4 under 2
    tokens = np.array([[4, 9, 11, 30, 8]], np.int32)
    prefix_rows = np.random.default_rng(0).standard_normal((2, 3, model.config.row_width))
    tree = ref.tree_from_parents(parents, tokens, prefix_lens=np.array([3], np.int32))
    base, _ = model.forward_rows(tokens[0], tree.positions[0], tree.visibility[0], prefix_rows)
    tokens2 = tokens.copy()
    tokens2[0, 2] = 50                                         # not an ancestor of 1 or 3
    changed, _ = model.forward_rows(tokens2[0], tree.positions[0], tree.visibility[0],
                                    prefix_rows)
    np.testing.assert_array_equal(changed[[0, 1, 3]], base[[0, 1, 3]])
    assert not np.allclose(changed[[2, 4]], base[[2, 4]])


def device_tree(tree):
    return dataclasses.replace(tree, **{f.name: K.as_device(getattr(tree, f.name))
                                        for f in dataclasses.fields(tree)})


def absorbed_vs_plain(config, ops, *, bs, budget, prefix_lens, page_size, seed):
    rng = np.random.default_rng(seed)
    model = ToyMLA(config)
    N, L, k = budget + 1, 4, 3
    logits = rng.standard_normal((bs, L, config.vocab)).astype(np.float32) * 2
    top_lp, top_ids = ref.draft_topk(logits, k)
    roots = rng.integers(0, config.vocab, bs).astype(np.int32)
    prefix_lens = np.asarray(prefix_lens, np.int32)
    tree = ref.build_tree(top_lp, top_ids, roots, budget, prefix_lens=prefix_lens)
    table, num_pages = shuffled_block_table(rng, prefix_lens, N, page_size)
    cache = (rng.standard_normal((config.layers, num_pages, page_size, config.row_width))
             .astype(np.float32))                            # prefix rows: anything
    model.allocate(bs=bs, N=N, num_pages=num_pages, page_size=page_size,
                   max_pages=table.shape[1])
    want_cache = model.kv_cache
    want_cache[:] = cache
    predict = argmax_per_node(model.forward(tree, table, prefix_lens), tree.num_nodes)

    device = DeviceToyMLA(model, ops=ops)
    device.allocate(bs=bs, N=N, num_pages=num_pages, page_size=page_size,
                    max_pages=table.shape[1])
    device.kv_cache.copy_to_device(cache)
    got_logits = device.forward(device_tree(tree), cuda.to_device(table),
                                cuda.to_device(prefix_lens)).copy_to_host()
    got_cache = device.kv_cache.copy_to_host()
    for b in range(bs):
        n, P = int(tree.num_nodes[b]), int(prefix_lens[b])
        want_logits, _ = model.forward_rows(
            tree.token_ids[b, :n], tree.positions[b, :n], tree.visibility[b, :n, :n],
            cache[:, table[b, np.arange(P) // page_size], np.arange(P) % page_size])
        err = np.abs(got_logits[b * N: b * N + n] - want_logits).max()
        assert err <= LOGIT_TOL * np.abs(want_logits).max(), (b, err)
        assert (np.argmax(got_logits[b * N: b * N + n], axis=1) == predict[b, :n]).all()
    err = np.abs(got_cache - want_cache).max()
    assert err <= ROW_TOL * np.abs(want_cache).max(), err


@pytest.mark.parametrize("seed", range(3))
def test_absorbed_forward_matches_plain_forward(seed):
    ops = HostDenseOps() if ON_SIMULATOR else KernelDenseOps()
    absorbed_vs_plain(ToyMLAConfig.tiny(seed=seed), ops, bs=3, budget=9,
                      prefix_lens=[5, 0, 17], page_size=4, seed=seed)


def test_absorbed_forward_with_the_dense_kernels():
    """The same check with every dense operation a numba kernel (slow on the simulator)."""
    config = ToyMLAConfig.tiny(layers=1, hidden=16, ffn=16, vocab=24)
    absorbed_vs_plain(config, KernelDenseOps(), bs=2, budget=3, prefix_lens=[2, 0], page_size=4,
                      seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("bs,budget", [(1, 64), (4, 256)])
def test_absorbed_forward_matches_plain_forward_gpu_size(bs, budget):
    absorbed_vs_plain(ToyMLAConfig.gpu(vocab=1024), KernelDenseOps(), bs=bs, budget=budget,
                      prefix_lens=[100, 0, 700, 64][:bs], page_size=64, seed=bs)


@pytest.mark.parametrize("field,value", [("heads", 0), ("qk_rope_dim", 7), ("vocab", 2.5)])
def test_bad_config_is_a_clear_error(field, value):
    with pytest.raises(ValueError, match=field):
        ToyMLA(dataclasses.replace(ToyMLAConfig.tiny(), **{field: value}))
