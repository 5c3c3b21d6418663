"""Greedy DDTree decoding end to end: the reference step, GreedyStep on the device (eager and
CUDA graph), the composition of the kernels without host round trips, and the demo.

The decisive property: greedy speculative decoding emits exactly the tokens of the target's
plain greedy decoding (``ToyMLA.greedy``, one token per forward, numpy float64), for any
drafter, budget and batch.
"""

import numpy as np
import pytest

from ddtree_numba import GreedyStep
from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.arrays import CACHE_DTYPES
from ddtree_numba.interfaces import Drafter, Target
from ddtree_numba.models.bigram import BigramTarget, noisy_drafter_logits
from ddtree_numba.models.toy_drafter import FixedDrafter, ToyDrafter
from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
from ddtree_numba.models.toy_mla_device import DeviceToyMLA
from ddtree_numba.step.demo import DemoSizes, build_step, checked_run, run_demo


@pytest.mark.parametrize("budget", [0, 1, 16, 64])
@pytest.mark.parametrize("confidence", [0.0, 3.0, 12.0])
def test_reference_step_is_lossless(budget, confidence):
    rng = np.random.default_rng(budget + int(confidence))
    bs, L, k, steps, page = 3, 5, 4, 5, 8
    target = BigramTarget(vocab=50, row_width=4, seed=1)
    pages = (steps * (L + 1) + budget + 1 + page) // page + 1
    table = rng.permutation(bs * pages).astype(np.int32).reshape(bs, pages)
    target.allocate(bs=bs, N=budget + 1, num_pages=bs * pages, page_size=page,
                    max_pages=pages)
    cache = target.kv_cache
    roots = rng.integers(0, 50, bs).astype(np.int32)
    start, prefix, emitted = roots.copy(), np.zeros(bs, np.int32), [[] for _ in range(bs)]
    for _ in range(steps):
        logits = noisy_drafter_logits(target, roots, L, confidence=confidence, rng=rng)
        out = ref.greedy_step(target, FixedDrafter(logits), roots, table, prefix, k=k,
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


def test_models_implement_the_step_interfaces():
    """One Target / Drafter interface for both steps: the numpy models for the reference step,
    the device ones for GreedyStep."""
    model = ToyMLA(ToyMLAConfig.tiny())
    assert isinstance(model, Target) and isinstance(DeviceToyMLA(model), Target)
    assert isinstance(BigramTarget(vocab=8, row_width=2), Target)
    drafter = ToyDrafter(np.zeros((1, 4), np.int32), vocab=64)
    assert isinstance(drafter, Drafter)
    assert isinstance(FixedDrafter(np.zeros((1, 2, 64), np.float32)), Drafter)
    assert not isinstance(object(), Target)


# -- GreedyStep ------------------------------------------------------------------------------

def setup(config, *, bs, steps, L, k, budget, accuracy, seed, mode="eager",
          cache_dtype="float32"):
    model = ToyMLA(config, cache_dtype=cache_dtype)
    starts = np.random.default_rng(seed).integers(0, config.vocab, bs).astype(np.int32)
    length = steps * (min(L, budget) + 1)
    greedy = np.array([model.greedy(int(s), length) for s in starts], np.int32)
    continuation = np.concatenate([starts[:, None], greedy], axis=1)
    sizes = DemoSizes(bs=bs, steps=steps, L=L, K=k, budget=budget, config=config)
    step = build_step(model, continuation, sizes, mode=mode, accuracy=accuracy, seed=seed)
    return model, step, starts, greedy


def decode(step, starts):
    step.start(starts)
    accepted = []
    for _ in range(step.max_steps):
        step()
        accepted.append(step.last_step()["accept"].accept_len)
    return step.tokens(), np.array(accepted)


TINY = ToyMLAConfig.tiny(layers=1)


@pytest.mark.parametrize("budget", [0, 1, 16])
@pytest.mark.parametrize("accuracy", [0.3, 1.0])
@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_step_is_lossless(budget, accuracy, bs):
    L, steps = 3, 3
    _, step, starts, greedy = setup(TINY, bs=bs, steps=steps, L=L, k=2, budget=budget,
                                    accuracy=accuracy, seed=budget + bs)
    tokens, accepted = decode(step, starts)
    for b in range(bs):
        assert tokens[b] == greedy[b, : len(tokens[b])].tolist()
        assert len(tokens[b]) == steps + accepted[:, b].sum()
    if budget == 0:
        assert (accepted == 0).all()                    # plain greedy: one token per step
    if accuracy == 1.0 and budget >= L:
        assert (accepted == L).all()                    # a perfect drafter: L + 1 per step


def test_greedy_step_is_lossless_at_budget_64_and_ragged_batch():
    _, step, starts, greedy = setup(TINY, bs=2, steps=2, L=6, k=4, budget=64, accuracy=0.7,
                                    seed=11)
    tokens, accepted = decode(step, starts)
    for b in range(2):
        assert tokens[b] == greedy[b, : len(tokens[b])].tolist()


def test_device_step_equals_reference_step_every_step():
    """The composition: build_tree's device outputs feed the target forward (verify_attn),
    argmax, tree_accept and commit_kv; each step is checked against the numpy reference step
    (same tree, predictions, path, prefix lengths, committed cache rows)."""
    model, step, starts, greedy = setup(ToyMLAConfig.tiny(), bs=3, steps=3, L=4, k=3,
                                        budget=12, accuracy=0.7, seed=4)
    run = checked_run(step, model, starts, out=lambda line: None)
    for b in range(3):
        assert run["tokens"][b] == greedy[b, : len(run["tokens"][b])].tolist()


class LayerByLayer:
    """A target that shows only the ``Target`` interface (no ``kv_cache`` stack): the step must
    then accept and commit in two halves, ``tree_accept`` and ``commit_kv`` per layer."""

    def __init__(self, target):
        self.target, self.vocab = target, target.vocab

    def allocate(self, **sizes):
        self.target.allocate(**sizes)

    def kv_caches(self):
        return self.target.kv_caches()

    def forward(self, tree, block_table, prefix_lens):
        return self.target.forward(tree, block_table, prefix_lens)


def test_step_fuses_accept_and_commit_only_for_a_stacked_cache():
    """The toy target keeps its layers in one array: one ``accept_commit`` launch. The same
    target behind the bare interface runs the two halves, with the same tokens, accepted
    lengths and committed cache."""
    config = ToyMLAConfig.tiny()
    runs = []
    for wrap in (False, True):
        model, step, starts, greedy = setup(config, bs=2, steps=3, L=4, k=3, budget=12,
                                            accuracy=0.7, seed=8)
        if wrap:
            step = GreedyStep(LayerByLayer(step.target), step.drafter, bs=2, L=4, K=3,
                              budget=12, max_steps=3, seed=8)
        names = [name for name, _ in step.stages()]
        fused = "accept_commit" in names
        assert fused != wrap and (("tree_accept" in names) == ("commit_kv" in names) == wrap)
        tokens, accepted = decode(step, starts)
        for b in range(2):
            assert tokens[b] == greedy[b, : len(tokens[b])].tolist()
        cache = np.stack([c.copy_to_host() for c in step.target.kv_caches()])
        runs.append((tokens, accepted, cache))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    np.testing.assert_array_equal(runs[0][2], runs[1][2])


def test_stacked_kv_cache_needs_the_layers_themselves():
    """A ``kv_cache`` attribute counts as the stack only when its layers are the very arrays
    (memory, shape, strides) that ``kv_caches()`` returns."""
    from numba import cuda

    from ddtree_numba.step.greedy import stacked_kv_cache

    class Holder:
        def __init__(self, stack, layers):
            self.kv_cache, self.layers = stack, layers

        def kv_caches(self):
            return self.layers

    stack = cuda.to_device(np.zeros((3, 2, 4, 5), np.float32))
    assert stacked_kv_cache(Holder(stack, [stack[i] for i in range(3)])) is stack
    copies = [cuda.to_device(stack[i].copy_to_host()) for i in range(3)]
    assert stacked_kv_cache(Holder(stack, copies)) is None              # other memory
    assert stacked_kv_cache(Holder(stack, [stack[i] for i in (0, 2, 1)])) is None  # order
    assert stacked_kv_cache(Holder(stack, [stack[i] for i in range(2)])) is None   # count
    single = stack[1]
    assert stacked_kv_cache(Holder(None, [single])) is single            # one layer


def test_step_makes_no_host_transfer(monkeypatch):
    """Inside a step nothing is copied between host and device (so nothing synchronises)."""
    _, step, starts, _ = setup(TINY, bs=2, steps=2, L=3, k=2, budget=8, accuracy=0.8, seed=2)
    step.start(starts)
    from numba import cuda

    def forbidden(*args, **kwargs):
        raise AssertionError("host transfer inside a step")

    array_type = type(step.prefix_lens)
    monkeypatch.setattr(cuda, "to_device", forbidden)
    monkeypatch.setattr(array_type, "copy_to_host", forbidden)
    monkeypatch.setattr(array_type, "copy_to_device", forbidden)
    step()
    monkeypatch.undo()
    assert len(step.tokens()[0]) >= 1


def test_greedy_step_errors_are_clear():
    model = ToyMLA(TINY)
    drafter = ToyDrafter(np.zeros((2, 40), np.int32), vocab=TINY.vocab)

    def make(**kwargs):
        args = {"bs": 2, "L": 3, "K": 2, "budget": 4, "max_steps": 2, **kwargs}
        return GreedyStep(DeviceToyMLA(model), drafter, **args)

    with pytest.raises(ValueError, match="bs"):
        make(bs=0)
    with pytest.raises(ValueError, match="budget"):
        make(budget=-1)
    with pytest.raises(ValueError, match="budget"):
        make(budget=1056)                               # N = 1057 > the kernels' 1056
    with pytest.raises(ValueError, match="L"):
        make(L=65)
    with pytest.raises(ValueError, match="K"):
        make(K=TINY.vocab + 1)
    with pytest.raises(TypeError, match="bs"):
        make(bs=2.0)
    with pytest.raises(ValueError, match="mode"):
        make(mode="fast")
    if K.SIMULATOR:
        with pytest.raises(ValueError, match="graph"):
            make(mode="graph")
    with pytest.raises(ValueError, match="drafter.vocab"):
        GreedyStep(DeviceToyMLA(model), ToyDrafter(np.zeros((2, 40), np.int32), vocab=9),
                   bs=2, L=3, K=2, budget=4, max_steps=2)
    with pytest.raises(ValueError, match="continuation"):
        make(bs=3)
    with pytest.raises(ValueError, match="accuracy"):
        ToyDrafter(np.zeros((2, 40), np.int32), vocab=TINY.vocab, accuracy=1.5)
    with pytest.raises(ValueError, match="max_steps"):
        make(max_steps=2**40)                           # petabytes of cache: refused, named
    with pytest.raises(ValueError, match="page_size"):
        make(page_size=2**40)
    step = make()
    with pytest.raises(RuntimeError, match="start"):
        step()
    with pytest.raises(RuntimeError, match="last_step"):
        step.last_step()                                # nothing written yet: no garbage
    with pytest.raises(ValueError, match="root_token_ids"):
        step.start(np.array([0, TINY.vocab], np.int32))
    with pytest.raises(ValueError, match="root_token_ids"):
        step.start(np.array([0, 1, 2], np.int32))
    step.start(np.array([1, 2], np.int32))
    with pytest.raises(RuntimeError, match="last_step"):
        step.last_step()
    step()
    assert step.last_step()["tree"].num_nodes.shape == (2,)
    step()
    with pytest.raises(RuntimeError, match="max_steps"):
        step()


# -- on the GPU: a larger toy, budgets to 256, eager and graph --------------------------------

GPU_TOY = ToyMLAConfig.gpu(vocab=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [0, 1, 16, 64, 256])
@pytest.mark.parametrize("bs", [1, 8])
def test_gpu_lossless_and_graph_equals_eager(budget, bs):
    runs = {}
    for mode in ("eager", "graph"):
        _, step, starts, greedy = setup(GPU_TOY, bs=bs, steps=4, L=8, k=8, budget=budget,
                                        accuracy=0.7, seed=budget + bs, mode=mode)
        tokens, accepted = decode(step, starts)
        for b in range(bs):
            assert tokens[b] == greedy[b, : len(tokens[b])].tolist(), (mode, b)
        runs[mode] = (tokens, accepted, step.target.kv_cache.copy_to_host(),
                      step.last_step()["tree"].parents)
    eager, graph = runs["eager"], runs["graph"]
    assert eager[0] == graph[0]
    np.testing.assert_array_equal(eager[1], graph[1])
    np.testing.assert_array_equal(eager[3], graph[3])


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_16_bit_cache_is_lossless(cache_dtype):
    """The simulator's path for a 16-bit cache (rows rounded when written, widened when read)
    against the plain greedy decoding of the model with the same cache type."""
    _, step, starts, greedy = setup(TINY, bs=2, steps=3, L=3, k=2, budget=8, accuracy=0.6,
                                    seed=5, cache_dtype=cache_dtype)
    tokens, _ = decode(step, starts)
    assert step.target.kv_cache.dtype == np.dtype(CACHE_DTYPES[cache_dtype])
    for b in range(2):
        assert tokens[b] == greedy[b, : len(tokens[b])].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("budget, bs", [(16, 1), (64, 8), (256, 2)])
def test_gpu_16_bit_cache_runs_the_tensor_cores_and_is_lossless(cache_dtype, budget, bs):
    """With a bfloat16 or float16 cache the toy target's attention is the mma variant. The
    speculative tokens equal, in eager and graph mode, both the device's own one-token
    decoding (budget 0: the same kernels, one node per step) and the plain-form reference
    with the same cache type."""
    runs = {}
    for mode, b_ in (("eager", budget), ("graph", budget), ("eager", 0)):
        _, step, starts, greedy = setup(GPU_TOY, bs=bs, steps=4 if b_ else 20, L=8, k=8,
                                        budget=b_, accuracy=0.7, seed=budget + bs, mode=mode,
                                        cache_dtype=cache_dtype)
        assert step.target.variant == "mma"
        runs[mode, b_] = decode(step, starts)[0]
        for b in range(bs):
            assert runs[mode, b_][b] == greedy[b, : len(runs[mode, b_][b])].tolist(), (mode, b)
    assert runs["eager", budget] == runs["graph", budget]
    for b in range(bs):                                  # one-token decoding, same kernels
        spec, plain = runs["eager", budget][b], runs["eager", 0][b]
        n = min(len(spec), len(plain))
        assert spec[:n] == plain[:n]


@pytest.mark.gpu
def test_gpu_graph_replay_after_restart_is_identical():
    _, step, starts, greedy = setup(GPU_TOY, bs=4, steps=3, L=8, k=8, budget=64,
                                    accuracy=0.8, seed=3, mode="graph")
    first, _ = decode(step, starts)
    second, _ = decode(step, starts)                 # start() again: same graph, same state
    assert first == second


# -- the demo (the main job) ------------------------------------------------------------------

def test_demo_checks_itself_and_draws_the_accepted_path(tmp_path):
    lines = []
    plot = tmp_path / "tree.png"
    summary = run_demo(bs=2, steps=2, plot=str(plot), out=lines.append)
    assert summary["lossless"]
    assert lines[-1] == ("device step == reference step at every step: True; output == plain "
                         "greedy decoding: True")
    assert plot.stat().st_size > 10_000


def test_more_accurate_drafter_accepts_more():
    # L 4, K 2, budget 16: the drafter's top-1 chain always fits in the tree, so a drafter
    # whose top token is always right gets every draft accepted
    sizes = {"bs": 1, "steps": 3, "L": 4, "k": 2, "budget": 16, "seed": 3, "out": lambda s: None}
    low = run_demo(accuracy=0.0, **sizes)
    high = run_demo(accuracy=1.0, **sizes)
    assert high["mean_accept_len"] == 4
    assert low["mean_accept_len"] < high["mean_accept_len"]


def test_greedy_step_refuses_objects_that_are_no_target_or_drafter_and_bad_seeds():
    """``None`` or a plain object as the target or drafter ended in an AttributeError, and a
    negative or non-int seed in numpy's SeedSequence error naming no argument."""
    model = ToyMLA(TINY)
    drafter = ToyDrafter(np.zeros((2, 40), np.int32), vocab=TINY.vocab)
    args = {"bs": 2, "L": 3, "K": 2, "budget": 4, "max_steps": 2}
    for bad in (None, object()):
        with pytest.raises(TypeError, match="target: expected a Target"):
            GreedyStep(bad, drafter, **args)
        with pytest.raises(TypeError, match="drafter: expected a Drafter"):
            GreedyStep(DeviceToyMLA(model), bad, **args)
    with pytest.raises(ValueError, match="seed: expected an int in"):
        GreedyStep(DeviceToyMLA(model), drafter, seed=-1, **args)
    with pytest.raises(TypeError, match="seed: expected an int"):
        GreedyStep(DeviceToyMLA(model), drafter, seed="x", **args)
