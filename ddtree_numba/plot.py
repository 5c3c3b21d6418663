"""Draw a draft tree (matplotlib, imported only when called): one request, the root on top,
depth down the page, siblings side by side, each node's token inside it and its cumulative
log-probability under it; the accepted path, when given, in orange."""

from __future__ import annotations


def draw_tree(tree, b: int, path: str | None = None, *, accepted=(), max_nodes: int = 48,
              title: str | None = None, keep_open: bool = False):
    """Draw request ``b`` of ``tree`` (a host :class:`~ddtree_numba.DraftTree`); save it to
    ``path`` if given (returns ``path``), else leave the figure open (returns the figure).

    Parameters
    ----------
    tree : DraftTree
        Numpy fields (``tree.to_host()`` for device trees).
    b : int
        The request to draw.
    path : str, optional
        Output file (PNG, SVG or PDF, by extension). None: nothing is written, the matplotlib
        figure stays open and is returned (sphinx-gallery and notebooks show open figures).
    accepted : sequence of int
        Node indices to highlight (``AcceptResult.accept_nodes[b, :k + 1]``).
    max_nodes : int
        Draw the first ``max_nodes`` nodes (pop order: the best ones).
    keep_open : bool
        Leave the matplotlib figure open (for sphinx-gallery, which shows open figures).
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")           # saving only: no window
    import matplotlib.pyplot as plt

    n = min(int(tree.num_nodes[b]), max_nodes)
    parents, depths = tree.parents[b], tree.depths[b]
    children = {i: [c for c in range(1, n) if parents[c] == i] for i in range(n)}
    x_of, next_leaf = {}, [0.0]

    def place(i):                       # leaves left to right, each parent centred above
        if not children[i]:
            x_of[i] = next_leaf[0]
            next_leaf[0] += 1.0
            return
        for c in children[i]:
            place(c)
        x_of[i] = sum(x_of[c] for c in children[i]) / len(children[i])

    place(0)
    accepted = {int(a) for a in accepted if 0 <= a < n}
    height = int(depths[:n].max()) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * next_leaf[0]), 1.3 * height + 0.6))
    for i in range(1, n):
        on_path = i in accepted and int(parents[i]) in accepted
        ax.plot([x_of[int(parents[i])], x_of[i]], [-depths[parents[i]], -depths[i]],
                color="tab:orange" if on_path else "0.65", lw=2.5 if on_path else 1.0, zorder=1)
    for i in range(n):
        ax.scatter(x_of[i], -depths[i], s=520, zorder=2,
                   color="tab:orange" if i in accepted else "tab:blue")
        ax.text(x_of[i], -depths[i], str(tree.token_ids[b, i]), ha="center", va="center",
                color="white", fontsize=8, zorder=3)
        ax.text(x_of[i], -depths[i] - 0.36, f"{tree.log_weights[b, i]:.2f}", ha="center",
                fontsize=7)
    ax.set_axis_off()
    ax.set_title(title or f"draft tree of request {b}: token (cumulative log-prob)"
                 + (", accepted path in orange" if accepted else ""), fontsize=10)
    if path is None:
        return fig
    fig.savefig(path, dpi=110, bbox_inches="tight")
    if not keep_open:
        plt.close(fig)
    return path
