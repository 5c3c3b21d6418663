"""02: build the draft tree best-first, and draw it
================================================


``build_tree`` grows one tree per request: starting from the root (the last committed token),
it repeatedly takes the highest-scoring candidate (a parent and the rank of a token at the
next depth), so the first ``budget`` nodes are the ``budget`` most likely continuations. The
kernel must match the reference bit for bit. The picture (``tree.png``) shows each node's token
and cumulative log-probability.
"""

# %%
from _common import pick, report  # noqa: I001

import dataclasses
import os

import numpy as np

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref

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
# Draw request 0: depth down the page, siblings side by side, score under each token.
def draw(tree, b, path="tree.png", highlight=()):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = int(tree.num_nodes[b])
    n_show = min(n, 40)
    x_of, next_x = {}, [0.0]

    def place(i):                           # leaves left to right, parents centred above
        kids = [c for c in range(1, n_show) if tree.parents[b, c] == i]
        if not kids:
            x_of[i] = next_x[0]
            next_x[0] += 1.0
        else:
            for c in kids:
                place(c)
            x_of[i] = sum(x_of[c] for c in kids) / len(kids)

    place(0)
    fig, ax = plt.subplots(figsize=(max(6, next_x[0] * 0.8), 1.4 * (tree.depths[b].max() + 1)))
    for i in range(1, n_show):
        p = tree.parents[b, i]
        ax.plot([x_of[p], x_of[i]], [-tree.depths[b, p], -tree.depths[b, i]], color="0.6",
                zorder=1)
    for i in range(n_show):
        color = "tab:orange" if i in highlight else "tab:blue"
        ax.scatter(x_of[i], -tree.depths[b, i], s=500, color=color, zorder=2)
        ax.text(x_of[i], -tree.depths[b, i], str(tree.token_ids[b, i]), ha="center",
                va="center", color="white", fontsize=8, zorder=3)
        ax.text(x_of[i], -tree.depths[b, i] - 0.35, f"{tree.log_weights[b, i]:.2f}",
                ha="center", fontsize=7)
    ax.set_axis_off()
    ax.set_title(f"draft tree of request {b}: token (cumulative log-prob), node order = pop order")
    fig.savefig(path, dpi=110, bbox_inches="tight")   # left open: the docs gallery shows it
    return path


out = os.environ.get("DDTREE_EXAMPLE_OUT", ".")
print("drew", draw(want, 0, os.path.join(out, "tree.png")))
