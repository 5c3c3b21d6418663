"""The main job: greedy DDTree decoding of the toy MLA model, on the device, checked end to end.

``python -m ddtree_numba demo`` runs :func:`run_demo`. It decodes a few requests with
:class:`~ddtree_numba.GreedyStep` (drafter -> draft_topk -> build_tree -> the toy target's
absorbed MLA forward with ``verify_attn`` -> argmax -> tree_accept -> commit_kv, all on the
device) and checks three things:

1. at every step, the device step equals the numpy reference step
   (:func:`ddtree_numba.reference.greedy_step` around the plain-form model) on the same drafter
   logits: the same tree, the same accepted path, the same committed cache rows (within the
   float32-vs-float64 bound of the forward);
2. the speculative output equals the target's plain greedy decoding, token for token;
3. on a GPU, the CUDA-graph mode emits exactly the tokens of the eager mode, and how long a
   step takes in each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from .. import kernels as K
from .. import reference as ref
from ..models.toy_drafter import FixedDrafter, ToyDrafter
from ..models.toy_mla import ToyMLA, ToyMLAConfig
from ..models.toy_mla_device import DeviceToyMLA
from ..reference.commit_kv import slot_address
from .greedy import GreedyStep, check_step_sizes
from .sampled import SampledStep

CACHE_RTOL = 2e-4       # committed cache rows, device float32 vs reference float64


@dataclass(frozen=True)
class DemoSizes:
    bs: int
    steps: int
    L: int
    K: int
    budget: int
    config: ToyMLAConfig


def default_sizes(on_gpu: bool) -> DemoSizes:
    """Tiny on the simulator (the demo then takes well under a minute), larger on a GPU."""
    if on_gpu:
        return DemoSizes(bs=4, steps=12, L=8, K=8, budget=64, config=ToyMLAConfig.gpu())
    return DemoSizes(bs=2, steps=6, L=4, K=3, budget=12, config=ToyMLAConfig.tiny())


def graph_mode_available() -> bool:
    if K.SIMULATOR:
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def build_step(model: ToyMLA, continuation, sizes: DemoSizes, *, mode: str, accuracy: float,
               seed: int, sampling: dict | None = None) -> GreedyStep:
    """A GreedyStep (or, with ``sampling`` = ``{"temperature": .., "top_k": .., "top_p":
    ..}``, a SampledStep) around fresh device copies of the toy target and drafter."""
    drafter = ToyDrafter(continuation, vocab=model.config.vocab, accuracy=accuracy, seed=seed)
    common = dict(bs=sizes.bs, L=sizes.L, K=sizes.K, budget=sizes.budget,
                  max_steps=sizes.steps, mode=mode, seed=seed)
    if sampling:
        return SampledStep(DeviceToyMLA(model), drafter, **sampling, **common)
    return GreedyStep(DeviceToyMLA(model), drafter, **common)


def _committed_rows(cache, table, prefix_lens, page_size):
    """``[layers, sum(P), D]``: every committed row, request by request."""
    rows = []
    for b, P in enumerate(prefix_lens):
        slots = np.arange(int(P))
        rows.append(cache[(slice(None), *slot_address(table[b], page_size, slots))])
    return np.concatenate(rows, axis=1)


def _reference_for(step: GreedyStep, model: ToyMLA) -> tuple:
    """Give the reference model a cache of the step's geometry (its own, on the host); return
    the step's block table and page size."""
    table = step.block_table.copy_to_host()
    _, num_pages, page_size, _ = step.target.kv_cache.shape
    model.allocate(bs=step.bs, N=step.N, num_pages=num_pages, page_size=page_size,
                   max_pages=table.shape[1])
    return table, page_size


def _checked_steps(step: GreedyStep, model: ToyMLA, starts, reference_step, own: str,
                   out) -> dict:
    """Decode ``step.max_steps`` steps, checking each against ``reference_step(drafter, roots,
    table, prefix)`` (the reference step on the same drafter logits): the same tree, accepted
    path and tokens, prefix lengths and ``own`` array (``target_predict`` of a greedy step,
    ``uniforms`` of a sampled one), and committed cache rows within ``CACHE_RTOL``."""
    table, page_size = _reference_for(step, model)
    roots, prefix = np.asarray(starts, np.int32).copy(), np.zeros(step.bs, np.int32)
    step.start(starts)
    history = []
    for s in range(step.max_steps):
        step()
        got = step.last_step()
        want = reference_step(FixedDrafter(got["draft_logits"]), roots, table, prefix)
        tree, accept = got["tree"], got["accept"]
        same = (np.array_equal(tree.parents, want.tree.parents)
                and np.array_equal(tree.token_ids, want.tree.token_ids)
                and np.array_equal(got[own], getattr(want, own))
                and np.array_equal(accept.accept_nodes, want.accept.accept_nodes)
                and np.array_equal(accept.accept_tokens, want.accept.accept_tokens)
                and np.array_equal(got["prefix_lens"], want.prefix_lens))
        if not same:
            raise AssertionError(f"step {s}: the device step disagrees with the reference")
        cache_dev = _committed_rows(step.target.kv_cache.copy_to_host(), table, want.prefix_lens,
                                    page_size)
        cache_want = _committed_rows(model.kv_cache, table, want.prefix_lens, page_size)
        scale = np.abs(cache_want).max()
        if np.abs(cache_dev - cache_want).max() > CACHE_RTOL * scale:
            raise AssertionError(f"step {s}: committed cache rows differ from the reference")
        for b in range(step.bs):
            k = int(accept.accept_len[b])
            n = int(tree.num_nodes[b])
            depth = int(tree.depths[b, :n].max())
            out(f"step {s} req {b}: tree {n - 1:3d} draft nodes, depth {depth}; "
                f"accepted {k} (path {accept.accept_nodes[b, : k + 1].tolist()}) -> tokens "
                f"{accept.accept_tokens[b, : k + 1].tolist()}")
        history.append({"tree": tree, "accept": accept})
        roots, prefix = want.accept.bonus_token.copy(), want.prefix_lens
    return {"tokens": step.tokens(), "history": history}


def checked_run(step: GreedyStep, model: ToyMLA, starts, *, out=print) -> dict:
    """Decode ``step.max_steps`` steps, checking each against the reference step."""
    def reference_step(drafter, roots, table, prefix):
        return ref.greedy_step(model, drafter, roots, table, prefix, k=step.K,
                               budget=step.budget)

    return _checked_steps(step, model, starts, reference_step, "target_predict", out)


def checked_sampled_run(step: SampledStep, model: ToyMLA, starts, *, out=print) -> dict:
    """Decode ``step.max_steps`` sampled steps, checking each against the reference sampled
    step with the step's own parameters, on the same drafter logits: the same uniforms, bit for
    bit, and the same accepted tokens (which the float32-vs-float64 probabilities could only
    change for logits that tie in float32 or a uniform within rounding of a partial sum)."""
    params = {"temperature": step.temperature.copy_to_host(),
              "top_k": step.top_k.copy_to_host(), "top_p": step.top_p.copy_to_host()}

    def reference_step(drafter, roots, table, prefix):
        return ref.sampled_step(model, drafter, roots, table, prefix, k=step.K,
                                budget=step.budget, seed=step.seed, **params)

    return _checked_steps(step, model, starts, reference_step, "uniforms", out)


def timed_run(step: GreedyStep, starts) -> dict:
    """Host time per ``step()`` call and wall time per step (one synchronisation at the end)."""
    step.start(starts)
    step.synchronize()
    host = []
    t0 = time.perf_counter()
    for _ in range(step.max_steps):
        t = time.perf_counter()
        step()
        host.append(time.perf_counter() - t)
    step.synchronize()
    wall = (time.perf_counter() - t0) / step.max_steps
    return {"tokens": step.tokens(), "host_us": 1e6 * float(np.median(host)),
            "wall_us": 1e6 * wall}


#: The demo's words for the step's sizes (its options), in check_step_sizes' order
DEMO_SIZE_NAMES = ("bs", "L", "k", "budget", "steps")


def given(value, default):
    """``value``, or ``default`` where it is None (0 is a value, which the checks refuse)."""
    return default if value is None else value


def demo_problem(bs, steps, L, k, budget, seed, config: ToyMLAConfig | None = None):
    """The demo's sizes (defaults for this backend where ``None``), the toy model (``config``,
    default this backend's), the start tokens and the drafter's view of the future (the greedy
    continuation)."""
    base = default_sizes(not K.SIMULATOR)
    if config is not None:
        base = replace(base, config=config)
    sizes = DemoSizes(bs=given(bs, base.bs), steps=given(steps, base.steps), L=given(L, base.L),
                      K=given(k, base.K), budget=given(budget, base.budget), config=base.config)
    # refused before the expected output is decoded (the slow part)
    check_step_sizes(bs=sizes.bs, L=sizes.L, K=sizes.K, budget=sizes.budget,
                     max_steps=sizes.steps, vocab=sizes.config.vocab, names=DEMO_SIZE_NAMES)
    model = ToyMLA(sizes.config)
    starts = np.random.default_rng(seed).integers(0, sizes.config.vocab,
                                                  sizes.bs).astype(np.int32)
    length = sizes.steps * (min(sizes.L, sizes.budget) + 1)
    greedy = np.array([model.greedy(int(s), length) for s in starts], np.int32)
    continuation = np.concatenate([starts[:, None], greedy], axis=1)
    return sizes, model, starts, greedy, continuation


def _graph_against_eager(model, continuation, sizes, starts, tokens, *, accuracy, seed,
                         sampling, out) -> dict:
    """On a GPU with CuPy: time eager and graph steps, and check both emit ``tokens``."""
    if not graph_mode_available():
        out("time per step: eager only here (CUDA graphs need a GPU and CuPy)")
        return {}
    timings = {mode: timed_run(build_step(model, continuation, sizes, mode=mode,
                                          accuracy=accuracy, seed=seed, sampling=sampling),
                               starts) for mode in ("eager", "graph")}
    same = all(t["tokens"] == tokens for t in timings.values())
    out("time per step: " + "; ".join(f"{m} {t['host_us']:.0f} us host, {t['wall_us']:.0f} us "
                                      f"wall" for m, t in timings.items()))
    out(f"graph == eager, token for token: {same}")
    if not same:
        raise AssertionError("the CUDA-graph step emitted different tokens from eager")
    return {"timings": timings, "graph_matches_eager": same}


def run_demo(*, bs=None, steps=None, L=None, k=None, budget=None, accuracy: float = 0.8,
             seed: int = 0, plot: str | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, out=print) -> dict:
    """Decode with the toy MLA target and check the result (see the module docstring).

    ``temperature > 0`` decodes by sampling (:class:`~ddtree_numba.step.sampled.SampledStep`,
    with ``top_k`` and ``top_p``): every step is checked against the reference sampled step,
    and on a GPU graph mode against eager; plain greedy decoding is then no longer the
    expected output, and ``plot`` is not drawn."""
    if temperature > 0:
        if plot:
            raise ValueError("plot: the tree plot is drawn by the greedy demo (temperature 0)")
        return _run_sampled_demo(bs=bs, steps=steps, L=L, k=k, budget=budget,
                                 accuracy=accuracy, seed=seed, out=out,
                                 sampling={"temperature": temperature, "top_k": top_k,
                                           "top_p": top_p})
    sizes, model, starts, greedy, continuation = demo_problem(bs, steps, L, k, budget, seed)
    t0 = time.perf_counter()
    out(f"toy MLA target: {sizes.config.layers} layers, {sizes.config.heads} heads, "
        f"Dc {sizes.config.kv_lora_rank}, Dr {sizes.config.qk_rope_dim}, vocab "
        f"{sizes.config.vocab}; bs {sizes.bs}, L {sizes.L}, K {sizes.K}, budget "
        f"{sizes.budget}; drafter accuracy {accuracy}\n")

    step = build_step(model, continuation, sizes, mode="eager", accuracy=accuracy, seed=seed)
    checked = checked_run(step, model, starts, out=out)
    seconds = time.perf_counter() - t0
    tokens = checked["tokens"]
    lossless = all(tokens[b] == greedy[b, : len(tokens[b])].tolist() for b in range(sizes.bs))
    accepted = [int(h["accept"].accept_len[b]) for h in checked["history"]
                for b in range(sizes.bs)]
    out("")
    for b in range(sizes.bs):
        out(f"request {b}: start {starts[b]} -> {tokens[b]}")
    mean_accept = float(np.mean(accepted))
    out(f"\n{sum(map(len, tokens))} tokens in {sizes.steps} steps x {sizes.bs} requests: "
        f"mean accepted length {mean_accept:.2f} draft tokens per step "
        f"({mean_accept + 1:.2f} tokens per target forward, the bonus included); "
        f"{seconds:.1f} s ({'CUDA simulator' if K.SIMULATOR else 'GPU'}, reference checks "
        f"included)")
    summary = {"tokens": tokens, "mean_accept_len": mean_accept, "lossless": lossless,
               "sizes": sizes}
    summary.update(_graph_against_eager(model, continuation, sizes, starts, tokens,
                                        accuracy=accuracy, seed=seed, sampling=None, out=out))

    if plot:
        from ..plot import draw_tree

        s, b = max(((s, b) for s in range(sizes.steps) for b in range(sizes.bs)),
                   key=lambda sb: int(checked["history"][sb[0]]["accept"].accept_len[sb[1]]))
        h = checked["history"][s]
        k = int(h["accept"].accept_len[b])
        draw_tree(h["tree"], b, plot, accepted=h["accept"].accept_nodes[b, : k + 1],
                  title=f"step {s}, request {b}: accepted path (orange) of {k} draft tokens")
        out(f"saved the tree of step {s}, request {b} to {plot}")

    out(f"device step == reference step at every step: True; output == plain greedy "
        f"decoding: {lossless}")
    if not lossless:
        raise AssertionError("speculative output differs from plain greedy decoding")
    return summary


def _run_sampled_demo(*, bs, steps, L, k, budget, accuracy, seed, sampling, out) -> dict:
    sizes, model, starts, _, continuation = demo_problem(bs, steps, L, k, budget, seed)
    out(f"toy MLA target, sampled: temperature {sampling['temperature']}, top-k "
        f"{sampling['top_k']}, top-p {sampling['top_p']}, seed {seed}; bs {sizes.bs}, L "
        f"{sizes.L}, K {sizes.K}, budget {sizes.budget}; the drafter guesses the greedy "
        f"continuation (accuracy {accuracy})\n")
    t0 = time.perf_counter()
    step = build_step(model, continuation, sizes, mode="eager", accuracy=accuracy, seed=seed,
                      sampling=sampling)
    checked = checked_sampled_run(step, model, starts, out=out)
    tokens = checked["tokens"]
    mean_accept = float(np.mean([int(h["accept"].accept_len[b]) for h in checked["history"]
                                 for b in range(sizes.bs)]))
    out("")
    for b in range(sizes.bs):
        out(f"request {b}: start {starts[b]} -> {tokens[b]}")
    out(f"\n{sum(map(len, tokens))} tokens in {sizes.steps} steps x {sizes.bs} requests: mean "
        f"accepted length {mean_accept:.2f} draft tokens per step; "
        f"{time.perf_counter() - t0:.1f} s ({'CUDA simulator' if K.SIMULATOR else 'GPU'}, "
        f"reference checks included)")
    summary = {"tokens": tokens, "mean_accept_len": mean_accept, "sizes": sizes}
    summary.update(_graph_against_eager(model, continuation, sizes, starts, tokens,
                                        accuracy=accuracy, seed=seed, sampling=sampling,
                                        out=out))
    out("device step == reference sampled step at every step: True")
    return summary


def run_model_demo(folder: str, *, bs=None, steps=None, L=None, k=None, budget=None,
                   accuracy: float = 0.8, seed: int = 0, cache_dtype: str = "float32",
                   out=print, progress_stream=None) -> dict:
    """Greedy DDTree decoding of a local DeepSeek-V3-architecture checkpoint (``demo --model``).

    The checkpoint's tensors are read (a progress bar on stderr), the plain-form reference
    decodes each request greedily (the expected output, and the toy drafter's view of the
    future), and :class:`~ddtree_numba.GreedyStep` decodes the same requests on
    :class:`~ddtree_numba.models.deepseek_v3.target.DeepseekV3Target` (the absorbed form,
    attention by ``kernels.verify_attn``). Raises ``AssertionError`` unless the two emit the
    same tokens. The target's dense layers run in numpy on numba's CUDA simulator and on
    cuBLAS on a GPU."""
    from ..models.deepseek_v3 import Checkpoint
    from ..models.deepseek_v3.target import DeepseekV3Target, greedy
    from ..progress import Progress

    bs, steps, L = given(bs, 2), given(steps, 3), given(L, 3)
    k, budget = given(k, 2), given(budget, 6)
    checkpoint = Checkpoint(folder)
    c = checkpoint.config
    check_step_sizes(bs=bs, L=L, K=k, budget=budget, max_steps=steps, vocab=c.vocab_size,
                     names=DEMO_SIZE_NAMES)                        # before the slow decoding
    experts = (f"{c.n_routed_experts} experts ({c.num_experts_per_tok} a token)"
               if c.n_routed_experts else "dense")
    out(f"{c.model_type} checkpoint {folder}: {c.num_hidden_layers} layers, "
        f"{c.num_attention_heads} heads, latent {c.kv_lora_rank} + rope "
        f"{c.qk_rope_head_dim}, {experts}, vocabulary {c.vocab_size}; {cache_dtype} cache; "
        f"bs {bs}, L {L}, K {k}, budget {budget}; drafter accuracy {accuracy}\n")
    t0 = time.perf_counter()
    weights = {}                                # read once; both forwards use it
    with Progress("loading weights", len(checkpoint), progress_stream) as bar:
        for name in checkpoint:
            weights[name] = checkpoint[name]
            bar.advance()
    target = DeepseekV3Target(c, weights, cache_dtype=cache_dtype)
    starts = np.random.default_rng(seed).integers(0, c.vocab_size, bs).astype(np.int32)
    length = steps * (min(L, budget) + 1)
    with Progress("reference greedy decoding", bs, progress_stream) as bar:
        expected = []
        for s in starts:
            expected.append(greedy(c, weights, int(s), length, cache_dtype=cache_dtype))
            bar.advance()
    expected = np.array(expected, np.int32).reshape(bs, length)
    continuation = np.concatenate([starts[:, None], expected], axis=1)
    step = GreedyStep(target, ToyDrafter(continuation, vocab=c.vocab_size, accuracy=accuracy,
                                         seed=seed),
                      bs=bs, L=L, K=k, budget=budget, max_steps=steps, seed=seed)
    step.start(starts)
    with Progress("decoding", steps, progress_stream) as bar:
        for _ in range(steps):
            step()
            bar.advance()
    tokens = step.tokens()
    lossless = all(tokens[b] == expected[b, : len(tokens[b])].tolist() for b in range(bs))
    mean_accept = sum(map(len, tokens)) / (bs * steps) - 1     # each step emits k + 1
    out("")
    for b in range(bs):
        out(f"request {b}: start {starts[b]} -> {tokens[b]}")
    out(f"\n{sum(map(len, tokens))} tokens in {steps} steps x {bs} requests: mean accepted "
        f"length {mean_accept:.2f} draft tokens per step; {time.perf_counter() - t0:.1f} s "
        f"({'CUDA simulator' if K.SIMULATOR else 'GPU'})")
    out(f"output == the reference's plain greedy decoding: {lossless}")
    if not lossless:
        raise AssertionError("speculative output differs from plain greedy decoding")
    return {"tokens": tokens, "mean_accept_len": mean_accept, "lossless": lossless}
