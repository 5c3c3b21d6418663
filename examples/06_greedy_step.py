"""06: the full greedy step: decode with a toy MLA model, token for token lossless
=================================================================================

Everything comes together. :class:`~ddtree_numba.GreedyStep` owns static device buffers and runs
one greedy DDTree step per call, with no host synchronisation inside: the drafter's logits ->
``draft_topk`` -> ``build_tree`` -> the target's forward over every tree node (a tiny
DeepSeek-style MLA decoder in the absorbed form, whose attention is ``verify_attn`` on the
paged latent cache) -> argmax -> ``tree_accept`` -> ``commit_kv``.

The decisive property of greedy speculative decoding: the output is exactly the target's own
greedy decoding, however good or bad the drafter is. This example checks it, and checks every
step against the numpy reference step on the same drafter logits.
"""

# %%
import time

import numpy as np

from ddtree_numba import GreedyStep
from ddtree_numba.kernels import SIMULATOR
from ddtree_numba.models.toy_drafter import ToyDrafter
from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
from ddtree_numba.models.toy_mla_device import DeviceToyMLA
from ddtree_numba.step.demo import checked_run


def report(name: str, ok: bool) -> None:
    """Say whether a check matches the reference; stop the example if it does not."""
    print(f"{name}: {'matches the reference' if ok else 'DIFFERS FROM THE REFERENCE'}")
    if not ok:
        raise SystemExit(1)


def pick(simulator, gpu):
    """``gpu`` sizes on a GPU, ``simulator`` sizes on numba's CUDA simulator."""
    return simulator if SIMULATOR else gpu

config = pick(ToyMLAConfig.tiny(), ToyMLAConfig.gpu())
bs, L, K, budget, steps = pick((2, 4, 3, 12, 4), (4, 8, 8, 64, 12))
model = ToyMLA(config)
starts = np.random.default_rng(0).integers(0, config.vocab, bs).astype(np.int32)

# %%
# What speculative decoding must reproduce: the target's plain greedy decoding, one token per
# forward (numpy, the non-absorbed form). The toy drafter gets a noisy view of it.
greedy = np.array([model.greedy(int(s), steps * (L + 1)) for s in starts], np.int32)
continuation = np.concatenate([starts[:, None], greedy], axis=1)
print(f"request 0 plain greedy: {greedy[0, :12].tolist()} ...")

# %%
# The step: the target and drafter objects own their device buffers (weights, paged cache,
# activations); GreedyStep owns the rest (tree, accept result, emitted tokens).
drafter = ToyDrafter(continuation, vocab=config.vocab, accuracy=0.8)
step = GreedyStep(DeviceToyMLA(model), drafter, bs=bs, L=L, K=K, budget=budget,
                  max_steps=steps, mode="eager")
run = checked_run(step, model, starts)          # prints each step; raises on any mismatch
report("every device step (tree, predictions, accepted path, cache rows)", True)

tokens = run["tokens"]
for b in range(bs):
    print(f"request {b}: {len(tokens[b])} tokens in {steps} steps")
report("speculative output == plain greedy decoding",
       all(tokens[b] == greedy[b, : len(tokens[b])].tolist() for b in range(bs)))

# %%
# On a GPU, the same launches captured once as a CUDA graph and replayed every step: the host
# only enqueues one graph (a few microseconds), whatever the number of kernels.
if not SIMULATOR:
    graph_step = GreedyStep(DeviceToyMLA(model), ToyDrafter(continuation, vocab=config.vocab,
                                                            accuracy=0.8),
                            bs=bs, L=L, K=K, budget=budget, max_steps=steps, mode="graph")
    graph_step.start(starts)
    host = []
    for _ in range(steps):
        t0 = time.perf_counter()
        graph_step()
        host.append(time.perf_counter() - t0)
    print(f"graph replay: {1e6 * np.median(host):.1f} us of host time per step")
    report("CUDA graph == eager, token for token", graph_step.tokens() == tokens)

# %%
# The tree of the step that accepted the longest path, the path in orange.
from ddtree_numba.plot import draw_tree  # noqa: E402

s, b = max(((s, b) for s in range(steps) for b in range(bs)),
           key=lambda sb: int(run["history"][sb[0]]["accept"].accept_len[sb[1]]))
h = run["history"][s]
k = int(h["accept"].accept_len[b])
fig = draw_tree(h["tree"], b, accepted=h["accept"].accept_nodes[b, : k + 1],
                title=f"step {s}, request {b}: {k} draft tokens accepted (orange)")
print(f"drew the tree of step {s}, request {b} (pass a path to draw_tree to save it)")
