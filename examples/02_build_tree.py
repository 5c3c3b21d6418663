"""02: build the draft tree best-first, and draw it
================================================


``build_tree`` grows one tree per request: starting from the root (the last committed token),
it repeatedly takes the highest-scoring candidate (a parent and the rank of a token at the
next depth), so the first ``budget`` nodes are the ``budget`` most likely continuations. The
kernel must match the reference bit for bit. The picture shows each node's token and cumulative
log-probability.
"""

# %%
import dataclasses

import numpy as np

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref


def report(name: str, ok: bool) -> None:
    """Say whether a check matches the reference; stop the example if it does not."""
    print(f"{name}: {'matches the reference' if ok else 'DIFFERS FROM THE REFERENCE'}")
    if not ok:
        raise SystemExit(1)


def pick(simulator, gpu):
    """``gpu`` sizes on a GPU, ``simulator`` sizes on numba's CUDA simulator."""
    return simulator if K.SIMULATOR else gpu

bs, L, k, budget = pick((2, 4, 4, 16), (64, 15, 256, 256))
rng = np.random.default_rng(1)
logits = (rng.standard_normal((bs, L, 4 * k)) * 3).astype(np.float32)
top_lp, top_ids = ref.draft_topk(logits, k)
roots = rng.integers(0, 100, bs).astype(np.int32)

want = ref.build_tree(top_lp, top_ids, roots, budget)
got = K.build_tree(top_lp, top_ids, roots, budget).to_host()
same = all(np.array_equal(getattr(got, f.name), getattr(want, f.name))
           for f in dataclasses.fields(want))
print(f"request 0: {int(want.num_nodes[0]) - 1} nodes, parents {want.parents[0, :12]} ...")
report("build_tree (every field)", same)


# %%
# Draw request 0 (``ddtree_numba.plot.draw_tree``): depth down the page, siblings side by side,
# the cumulative log-probability under each token. The figure stays open (the gallery and
# notebooks show it); ``draw_tree(want, 0, "tree.png")`` would save it instead.
from ddtree_numba.plot import draw_tree  # noqa: E402

fig = draw_tree(want, 0, max_nodes=40)
print(f"drew the first {min(40, int(want.num_nodes[0]))} nodes of request 0")
