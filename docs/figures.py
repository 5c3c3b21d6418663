"""Figures and tables generated at every docs build (offline; nothing committed can go stale).

* ``ddtree_step.png``: one greedy step of the tiny toy MLA model through the numpy references,
  the draft tree with the accepted path highlighted.
* ``perf_*.png`` and ``perf_*.md``: plots and tables from the committed benchmark CSVs
  (``benchmarks/results``), each labelled with the GPU and the date of the run.
* ``layout_*.png``: which thread / warp of each fast kernel owns which rows, slots and bytes,
  computed from the kernel modules' own constants (block sizes, tile shapes, lane splits) with
  the kernels' index formulas, and checked to cover each tile exactly once, so a change in a
  kernel changes its picture (or fails the build).
* ``thumb_*.png``: gallery thumbnails of the examples that draw no figure themselves.
"""

from __future__ import annotations

import csv
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ddtree_step_figure(path: str) -> dict:
    """Run one reference greedy step on the toy MLA target; draw its tree and accepted path."""
    from ddtree_numba import reference as ref
    from ddtree_numba.models.toy_drafter import ToyDrafter
    from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
    from ddtree_numba.plot import draw_tree

    model = ToyMLA(ToyMLAConfig.tiny())
    start, L, k, budget = 0, 4, 3, 14
    continuation = np.array([[start, *model.greedy(start, 12)]], np.int32)
    drafter = ToyDrafter(continuation, vocab=model.config.vocab, accuracy=0.6, seed=0)
    drafter.allocate(bs=1, L=L)
    model.allocate(bs=1, N=budget + 1, num_pages=2, page_size=16, max_pages=2)
    table, prefix = np.array([[1, 0]], np.int32), np.zeros(1, np.int32)
    step = ref.greedy_step(model, drafter, continuation[:, 0], table, prefix, k=k,
                           budget=budget)
    n = int(step.accept.accept_len[0])
    plt = _plt()
    draw_tree(step.tree, 0, path, accepted=step.accept.accept_nodes[0, : n + 1], keep_open=True,
              title=f"one greedy step: budget {budget}, K {k}, L {L}\nthe accepted path "
                    f"(orange) commits {n} draft tokens + the bonus")
    fig = plt.gcf()                     # draw_tree sizes for screens; the page shows it at
    ax = fig.axes[0]                    # its natural width, so enlarge the type and nodes
    for t in ax.texts:
        t.set_fontsize(t.get_fontsize() + 4)
        if t.get_color() != "white":    # the scores: keep the edges from crossing them
            t.set_bbox({"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    for c in ax.collections:
        c.set_sizes([900])
    ax.title.set_fontsize(12)
    fig.set_size_inches(7.5, fig.get_size_inches()[1])
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return {"accepted": n, "tokens": step.accept.accept_tokens[0, : n + 1].tolist(),
            "tree": step.tree}


def _rows(name: str) -> list:
    path = os.path.join(RESULTS, f"{name}.csv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def _when(rows):
    """``GPU, date`` of a results table; every date when the rows come from several runs (a
    CSV whose rows were re-measured in part)."""
    dates = sorted({r["date"] for r in rows})
    return f"{rows[0]['gpu']}, {' and '.join(dates)}"


def _table(rows, columns, headers, path, digits=1):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            try:
                cells.append(f"{float(v):,.{digits}f}" if "." in v or "e" in v else v)
            except ValueError:
                cells.append(v)
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        lines.append("")
        lines.append(f"*{_when(rows)}.*")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _stage_table(rows, stages, path):
    """Per-stage device times, one row per stage and one column per configuration (the
    transpose of the CSV: nine stage columns do not fit the page, four configurations do)."""
    lines = ["| stage | " + " | ".join(f"{_cache_label(r)}, bs {r['bs']}, B {r['budget']}"
                                      for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for st in stages:                   # "-": a stage that the row's run did not have
        lines.append(f"| `{st[:-3]}` | " + " | ".join(f"{float(r[st]):,.1f}" if r.get(st)
                                                      else "-" for r in rows) + " |")
    lines += ["", f"*{_when(rows)}; microseconds.*"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _cache_label(row) -> str:
    """``f32`` or ``bf16``: the cache type of a bench_step row."""
    return "bf16" if row.get("cache") == "bfloat16" else "f32"


def performance_figures(out: str) -> None:
    plt = _plt()

    rows = _rows("build_tree")
    if rows:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for bs in sorted({int(r["bs"]) for r in rows}):
            sel = [r for r in rows if int(r["bs"]) == bs]
            ax.plot([int(r["budget"]) for r in sel], [float(r["gpu_us"]) for r in sel], "o-",
                    label=f"kernel, bs {bs}")
            ax.plot([int(r["budget"]) for r in sel], [float(r["python_heap_us"]) for r in sel],
                    "x--", label=f"Python heap, bs {bs}")
        ax.set(xscale="log", yscale="log", xlabel="budget B", ylabel="microseconds",
               title=f"build_tree ({rows[0]['gpu']}, {rows[0]['date']})")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))   # beside the lines
        _save(fig, out, "perf_build_tree.png", dpi=110)
        _table(rows, ["bs", "budget", "gpu_us", "default_select", "threshold_select_us",
                      "corners_select_us", "warp_select_us", "levels_select_us",
                      "python_heap_us", "speedup_vs_heap"],
               ["bs", "budget", "kernel us", "default select", "threshold select us",
                "corners select us", "warp select us", "levels select us", "Python heap us",
                "speed-up"],
               os.path.join(out, "perf_build_tree.md"))

    rows = _rows("verify_attn")
    if rows:
        labels = [f"bs{r['bs']} N{r['N']}\nP{int(r['prefix']) // 1024}k H{r['H']}\n"
                  f"{'bf16' if r['dtype'] == 'bfloat16' else 'f32'}" for r in rows]
        x = np.arange(len(rows))
        fig, ax = plt.subplots(figsize=(8, 3.6))
        ax.bar(x, [float(r["tflops"]) for r in rows], label="verify_attn (tiled)")
        ax.axhline(float(rows[0]["sgemm_tflops"]), color="k", ls="--",
                   label="cuBLAS SGEMM (same run)")
        ax.set_xticks(x, labels, fontsize=6)
        ax.set(ylabel="TFLOP/s", title=f"verify_attn ({rows[0]['gpu']}, {rows[0]['date']})")
        ax.set_ylim(0, 1.3 * float(rows[0]["sgemm_tflops"]))    # room above the SGEMM line
        ax.legend(fontsize=8, loc="upper left", ncol=2)          # ... for the legend
        _save(fig, out, "perf_verify_attn.png", dpi=110)
        _table(rows, ["bs", "N", "prefix", "H", "dtype", "gpu_us", "tflops", "pct_of_sgemm",
                      "cupy_fp32_us", "torch_bf16_us"],
               ["bs", "N", "prefix", "H", "cache", "kernel us", "TFLOP/s", "% of SGEMM",
                "CuPy f32 us", "torch bf16 us"], os.path.join(out, "perf_verify_attn.md"))

    rows = _rows("bench_step")
    if rows:
        x = np.arange(len(rows))
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"wspace": 0.3})
        labels = [f"{_cache_label(r)}\nbs {r['bs']}\nB {r['budget']}" for r in rows]
        for ax, key, title in ((axes[0], "host_us", "host time per step"),
                               (axes[1], "device_us", "device time per step")):
            ax.bar(x - 0.2, [float(r[f"eager_{key}"]) for r in rows], 0.4, label="eager")
            ax.bar(x + 0.2, [float(r[f"graph_{key}"]) for r in rows], 0.4, label="CUDA graph")
            ax.set_xticks(x, labels, fontsize=8)
            ax.set(yscale="log", ylabel="microseconds", title=title)
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2,
                   fontsize=9, frameon=False)       # one legend, under both plots
        fig.suptitle(f"GreedyStep, toy MLA target ({_when(rows)})",
                     fontsize=10)
        _save(fig, out, "perf_step.png", dpi=110)
        stages = [c for c in rows[0] if c.endswith("_us") and not c.startswith(("eager",
                                                                               "graph"))]
        _table(rows, ["cache", "attention", "bs", "budget", "launches", "mean_accept_len",
                      "eager_host_us", "graph_host_us", "eager_device_us", "graph_device_us"],
               ["cache", "attention", "bs", "budget", "launches", "accepted per step",
                "eager host us",
                "graph host us", "eager device us", "graph device us"],
               os.path.join(out, "perf_step.md"))
        _stage_table(rows, stages, os.path.join(out, "perf_step_stages.md"))

    rows = _rows("draft_topk")
    if rows:
        _table(rows, ["bs", "V", "k", "dtype", "parts", "gpu_us", "whole_rows_us", "read_gbs",
                      "pct_of_copy_bw", "torch_us", "speedup_vs_torch"],
               ["bs", "V", "K", "logits", "blocks per row", "kernel us",
                "one block per row us", "GB/s", "% of copy BW", "torch us", "speed-up"],
               os.path.join(out, "perf_draft_topk.md"))
    rows = _rows("accept_commit")
    if rows:
        _table(rows, ["bs", "N", "layers", "cache", "mean_accept_len", "tree_accept_us",
                      "commit_kv_us", "both_us", "accept_commit_us", "graph_floor_us"],
               ["bs", "N", "layers", "cache", "accepted", "tree_accept us",
                "commit_kv us (all layers)", "both us", "accept_commit us",
                "empty graph us"],
               os.path.join(out, "perf_accept_commit.md"))


# ------------------------------------------------------------------------------------------
# Thread layouts of the fast kernels: who owns which rows, slots and bytes
# ------------------------------------------------------------------------------------------
def _kernel_module(stage: str):
    """The module of a kernel, by its stage name. verify_attn's tiled variant is read through
    ``_verify_attn_tiled`` below: the one place that names where its constants live."""
    import importlib

    return importlib.import_module(f"ddtree_numba.kernels.{stage}")


def _verify_attn_tiled():
    """The module holding the tiled verify_attn kernel's constants (BM, BN, ...)."""
    return _kernel_module("verify_attn.tiled")


def _gpu_value(module, name: str):
    """Constant ``name`` of ``module`` as on a GPU. The docs build on the simulator, where
    block sizes written ``X = a if SIMULATOR else b`` take the small value ``a``: read ``b``
    from the source instead."""
    import ast
    import inspect

    for node in ast.parse(inspect.getsource(module)).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.IfExp)
                and any(getattr(t, "id", None) == name for t in node.targets)
                and getattr(node.value.test, "id", None) == "SIMULATOR"):
            return ast.literal_eval(node.value.orelse)
    return getattr(module, name)


# Eight light colours for warps; the highlighted thread is drawn in black on top.
_WARP_COLOURS = ["#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7",
                 "#d9d9d9"]


def _save(fig, out: str, name: str, dpi: int = 100) -> None:
    """Write ``fig`` as ``out/name``, cropped to what it draws, and free it."""
    fig.savefig(os.path.join(out, name), dpi=dpi, bbox_inches="tight")
    _plt().close(fig)


def _title(ax, text: str, fontsize: float = 10) -> None:
    """A left-aligned title wrapped to the figure's width (~90 characters a line), so that a
    figure keeps its natural width and stays readable in the page's column."""
    import textwrap

    ax.set_title(textwrap.fill(text.replace("\n", " "), 90), fontsize=fontsize, loc="left")


def _warp_image(ax, owner, mine, xlabel, ylabel, title, warps):
    """Draw ``owner[row, col]`` (a warp id per cell) in warp colours, ``mine`` (bool) black."""
    from matplotlib.colors import ListedColormap

    rgb = ListedColormap(_WARP_COLOURS[:warps])(owner % warps)[..., :3]
    rgb[mine] = 0.0
    ax.imshow(rgb, aspect="auto", interpolation="nearest",
              extent=(-0.5, owner.shape[1] - 0.5, owner.shape[0] - 0.5, -0.5))
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    _title(ax, title)
    ax.tick_params(labelsize=9)


def _lane_split(lane: int) -> tuple:
    """``(lane_a, lane_b)`` of the tiled verify_attn kernel: a from lane bits 0 and 2, b from
    bits 1, 3 and 4 (the kernel's two lines, restated)."""
    return (lane & 1) | ((lane >> 1) & 2), ((lane >> 1) & 1) | ((lane >> 2) & 6)


def _owners(shape, what: str, cells) -> tuple:
    """``(warp, thread)`` maps of a tile from ``cells`` = ``(row, col, warp, lane)``, asserting
    that every element has exactly one owning thread."""
    owner, thread = np.full(shape, -1), np.full(shape, -1)
    for row, col, w, lane in cells:
        assert thread[row, col] < 0, f"two threads own one {what}"
        owner[row, col], thread[row, col] = w, 32 * w + lane
    assert (thread >= 0).all(), f"an element ({what}) of the tile has no owner"
    return owner, thread


def verify_attn_layout(out: str) -> None:
    """Ownership in one block of the tiled verify_attn kernel, phase by phase, and the lanes."""
    plt = _plt()
    va = _verify_attn_tiled()
    BM, BN, warps = va.BM, va.BN, va.TILED_THREADS // 32
    cols = 4 * va.COL4                                  # latent columns (MAX_DC)
    w_me, lane_me = 5, 13                               # the highlighted thread
    a_me, b_me = _lane_split(lane_me)

    # 1. scores: warp w, lane (a, b): rows 16 (w // 4) + a + 4 r, slots 32 (w % 4) + b + 8 k
    s_owner, s_thread = _owners((BM, BN), "score", (
        (16 * (w // 4) + a + 4 * r, 32 * (w % 4) + b + 8 * k, w, lane)
        for w in range(warps) for lane in range(32) for a, b in [_lane_split(lane)]
        for r in range(4) for k in range(4)))
    # 2. softmax: warp w owns rows 16 (w // 4) + (w % 4) + 4 r, all BN slots (lane + 32 k)
    m_owner = np.full((BM, BN), -1)
    for w in range(warps):
        for r in range(4):
            m_owner[16 * (w // 4) + w % 4 + 4 * r, :] = w
    assert (m_owner >= 0).all(), "a softmax row has no owner"
    m_mine = np.zeros((BM, BN), bool)
    for r in range(4):
        for k in range(BN // 32):
            m_mine[16 * (w_me // 4) + w_me % 4 + 4 * r, lane_me + 32 * k] = True
    # 3. output: rows of quad 4 (w // 4) + a, columns 4 (32 (w % 4) + b + 8 j) + e
    o_owner, o_thread = _owners((BM, cols), "output", (
        (16 * (w // 4) + a + 4 * r, 4 * (32 * (w % 4) + b + 8 * j) + e, w, lane)
        for w in range(warps) for lane in range(32) for a, b in [_lane_split(lane)]
        for r in range(4) for j in range(4) for e in range(4)))

    me = 32 * w_me + lane_me
    fig, axes = plt.subplots(3, 1, figsize=(8, 11.5),
                             gridspec_kw={"hspace": 0.5, "height_ratios": [1, 1.7, 1]})
    _warp_image(axes[0], s_owner, s_thread == me, f"slot of the tile (BN = {BN})",
                f"query row (BM = {BM})",
                "1. S = Q K^T: warp w computes rows 16 (w // 4) .. +15, slots 32 (w % 4) .. +31.\n"
                f"Black: the 4 x 4 scores of thread {me} (warp {w_me}, lane {lane_me}, a = "
                f"{a_me}, b = {b_me}):\nrows 16 (w // 4) + a + 4 r, slots 32 (w % 4) + b + 8 k",
                warps)
    _warp_image(axes[1], m_owner, m_mine, f"slot of the tile (BN = {BN})", "query row: its warp",
                "2-3. mask and online softmax: warp w owns row quad w, rows 16 (w // 4) + (w % 4)"
                f" + 4 r,\nall {BN} slots (a row's max and sum: warp shuffles). Black: thread "
                f"{me}'s slots lane + 32 k", warps)
    axes[1].set_yticks(range(BM), [f"{r}: w{m_owner[r, 0]}" for r in range(BM)], fontsize=7.5)
    _warp_image(axes[2], o_owner, o_thread == me, f"latent column of the output (Dc <= {cols})",
                "query row",
                "4. O += P C: warp w holds rows 16 (w // 4) .. +15, columns 128 (w % 4) .. +127."
                f"\nBlack: the 4 x 16 outputs of thread {me}: its quad's 4 rows, columns "
                "4 (32 (w % 4) + b + 8 j) + e", warps)
    for w in range(warps):                  # labels between the highlighted thread's rows
        y = 16 * (w // 4) + a_me + 2
        axes[0].text(32 * (w % 4) + 15.5, y, f"warp {w}", ha="center", va="center",
                     fontsize=10, weight="bold")
        axes[2].text(128 * (w % 4) + 63.5, y, f"warp {w}", ha="center", va="center",
                     fontsize=10, weight="bold")
    _save(fig, out, "layout_verify_attn.png")

    fig, ax = plt.subplots(figsize=(7.5, 3.0))
    grid = np.zeros((4, 8), int)
    for lane in range(32):
        a, b = _lane_split(lane)
        grid[a, b] = lane
    ax.imshow((np.arange(8)[None, :] % 2) * 0.15 + (np.arange(4)[:, None] % 2) * 0.1,
              cmap="Greys", vmin=0, vmax=1, aspect="auto")
    for a in range(4):
        for b in range(8):
            ax.text(b, a, str(grid[a, b]), ha="center", va="center", fontsize=12)
    ax.set_xticks(range(8), [f"b = {b}" for b in range(8)], fontsize=9)
    ax.set_yticks(range(4), [f"a = {a}" for a in range(4)], fontsize=9)
    _title(ax, "lane -> (a, b): a = lane bits 0, 2 (the row quad); b = bits 1, 3, 4 (slots, "
                 "columns).\nLanes n, n^1 share b: one K / C read serves both; n, n^2 share a: "
                 "one Q / P read")
    _save(fig, out, "layout_verify_attn_lanes.png")


def build_tree_layout(out: str) -> None:
    """The warp tournament of build_tree at one pop of a real tree: which lane owns which
    nodes, each lane's best candidate, the winner; and the rescan of the winner's group."""
    from ddtree_numba.reference.build_tree import best_first

    plt = _plt()
    bt = _kernel_module("build_tree")
    group, capacity = bt.GROUP, bt.NODE_CAPACITY
    lanes = capacity // group
    L, K, count = 15, 8, 300
    rng = np.random.default_rng(1)
    lp = np.sort(np.log(rng.dirichlet(np.full(64, 0.3), size=L)).astype(np.float32),
                 axis=1)[:, ::-1][:, :K].copy()
    parents, depths, ranks, scores = best_first(lp, count - 1)   # nodes 0 .. count - 1
    # the frontier after `count` nodes: each node's next unexpanded rank (one candidate each)
    next_rank = [0] * count
    for c in range(1, count):
        next_rank[parents[c]] = ranks[c] + 1
    cand = np.full(capacity, -np.inf, np.float32)
    for p in range(count):
        r = next_rank[p]
        if depths[p] < L and r < K:
            cand[p] = np.float32(scores[p] + lp[depths[p], r])
    best = [max(range(l * group, (l + 1) * group), key=lambda q: (cand[q], -q))
            for l in range(lanes)]
    winner_lane = max(range(lanes), key=lambda l: (cand[best[l]], -l))
    p = best[winner_lane]
    more_parents = best_first(lp, count)[0]
    assert more_parents[count] == p, "the tournament's winner is not the reference's pop"

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 9.5),
                                  gridspec_kw={"height_ratios": [8, 1], "hspace": 0.35})
    img = np.ones((lanes, group, 3))
    img[::2] = 0.93                                     # alternate lanes: light bands
    taken = np.arange(lanes * group).reshape(lanes, group) < count
    img[taken] = (0.65, 0.81, 0.89)
    has = np.isfinite(cand).reshape(lanes, group)
    img[has] = (0.12, 0.47, 0.71)
    ax.imshow(img, aspect="auto", interpolation="nearest")
    for l in range(lanes):
        q = best[l]
        if np.isfinite(cand[q]):
            ax.plot(q - l * group, l, marker="*", color="orange" if l != winner_lane else "red",
                    markersize=15 if l == winner_lane else 10, markeredgecolor="k")
    ax.set_yticks(range(lanes), [f"lane {l}: [{l * group}, {(l + 1) * group})"
                                 for l in range(lanes)], fontsize=7.5)
    ax.set_xticks(range(0, group, 4))
    ax.set_xlabel(f"node - {group} l (position in the lane's group)", fontsize=10)
    _title(ax, f"build_tree, warp tournament: lane l owns nodes [{group} l, {group} l + "
                 f"{group}) ({lanes} x {group} = {capacity} = N max).\nA real tree of {count} "
                 f"nodes (L {L}, K {K}). Light: node taken, no candidate left; dark: node with "
                 f"a pending candidate.\nStar: the lane's best (in registers). Red: the max "
                 f"over lanes (redux.sync, lowest lane of the ballot), node {p}'s candidate pops "
                 f"next")
    strip = np.array([[(j // 2) % 2 for j in range(group)]])
    ax2.imshow(strip, cmap="Pastel1", aspect="auto", vmin=0, vmax=8)
    for j in range(group):
        ax2.text(j, 0, str(j // 2), ha="center", va="center", fontsize=8)
    ax2.set_yticks([])
    ax2.set_xticks(range(0, group, 4))
    _title(ax2, "after the pop, the whole warp rescans the winner's group: lane j reads "
                  "entries 2 j, 2 j + 1 (numbers: j)")
    _save(fig, out, "layout_build_tree.png")


def build_tree_corners_layout(out: str) -> None:
    """The corners select at one pop of a real tree: each level's staircase of taken children
    (parents in pop order as rows), the corners whose candidates the warp holds, and the next
    pop."""
    from ddtree_numba.reference.build_tree import best_first
    from ddtree_numba.reference.build_tree_corners import best_first_by_corners

    plt = _plt()
    L, K, count = 15, 8, 30
    rng = np.random.default_rng(7)                  # a peaked drafter: a tree 5 levels deep
    with np.errstate(divide="ignore"):              # a probability 0 is a -inf log-prob
        lp = np.sort(np.log(rng.dirichlet(np.full(64, 0.05), size=L)).astype(np.float32),
                     axis=1)[:, ::-1][:, :K].copy()
    corners = set()                                             # the model's frontier
    (parents, depths, _, scores), _ = best_first_by_corners(lp, count - 1, corners)
    taken = np.bincount(np.array(parents[1:]), minlength=count)
    levels = [[u for u in range(count) if depths[u] == d] for d in range(L)]
    cands = {u: np.float32(scores[u] + lp[depths[u], taken[u]]) for u in corners}
    cands = {u: s for u, s in cands.items() if np.isfinite(s)}  # corner u -> its score
    order = sorted(cands, key=lambda u: (-cands[u], u))         # largest, then smallest node
    pop = order[0]
    assert best_first(lp, count)[0][count] == pop, "the corners' best is not the next pop"
    shown = [d for d in range(L) if levels[d]][:5]
    fig, axes = plt.subplots(1, len(shown), figsize=(8, 4.2),
                             gridspec_kw={"width_ratios": [max(len(levels[d]), 1)
                                                           for d in shown]})
    for ax, d in zip(axes, shown, strict=True):
        level = levels[d]
        img = np.ones((K, len(level), 3))
        for j, u in enumerate(level):
            img[:taken[u], j] = (0.65, 0.81, 0.89)              # taken children
            if taken[u] < K:
                img[taken[u], j] = (1.0, 0.85, 0.55) if u in cands else (0.85, 0.85, 0.85)
        ax.imshow(img, aspect="auto", interpolation="nearest", origin="lower")
        if pop in level:
            ax.plot(level.index(pop), taken[pop], marker="*", markersize=16, color="red",
                    markeredgecolor="k")
        ax.set_xticks(range(len(level)), [str(u) for u in level], fontsize=7, rotation=90)
        ax.set_xlabel(f"depth {d}", fontsize=8)
        ax.set_yticks(range(K))
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("child rank", fontsize=9)
    fig.supxlabel("the parents of each depth, by node index (pop order)", fontsize=9, y=-0.04)
    fig.suptitle("\n".join([
        f"build_tree, corners select, after {count - 1} pops of a real tree (L {L}, K {K}). Blue: "
        f"children taken;",
        "each parent's next candidate is the cell above its column: orange where the parent "
        "is a corner",
        "(the first of its depth, or its predecessor has more children), grey where the "
        "predecessor's",
        f"candidate dominates it. Warp 0 holds the {len(cands)} corners' candidates in "
        "registers; two warp reductions",
        "find the best of them, the next pop (red star)."]), fontsize=9, x=0.02, ha="left",
        y=1.12)
    _save(fig, out, "layout_build_tree_corners.png")


def build_tree_threshold_layout(out: str) -> None:
    """One level of the threshold select on a real tree: each parent's count (the count
    phase), then which thread writes which of the level's children (the expansion)."""
    from ddtree_numba import reference as ref
    from ddtree_numba.reference.build_tree_threshold import best_first_by_threshold

    plt = _plt()
    T = _gpu_value(_kernel_module("build_tree_threshold"), "THREADS")
    L, B = 15, 256                          # bench_build_tree.py's kind of rows
    x = (np.random.default_rng(0).standard_normal((1, L, B + 16)) * 3).astype(np.float32)
    lp, _ = ref.draft_topk(x, B)
    _, stats = best_first_by_threshold(lp[0], B)
    d, counts = max(enumerate(stats["levels"]), key=lambda e: sum(e[1]))   # the widest level
    counts = np.array(counts)
    P, M = len(counts), int(counts.sum())
    per = -(-M // T) | 1                    # the kernel's run a thread (_expand): odd
    sums = np.cumsum(counts)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.8),
                                  gridspec_kw={"height_ratios": [3, 2], "hspace": 1.0})
    ax.bar(np.arange(P), counts, width=1.0, color=[_WARP_COLOURS[(u // 32) % 8]
                                                   for u in range(P)], edgecolor="none")
    ax.set_xlabel(f"parent u of depth {d} (its index in the level); colours: the warp whose "
                  f"thread u counts it", fontsize=9)
    ax.set_ylabel("children at or above the floor", fontsize=9)
    ax.set_xlim(-0.5, P - 0.5)
    _title(ax, f"build_tree, threshold select, one level of a real tree (B {B}, L {L}, the "
               f"widest level: {P} parents, {M} children). Count: thread u (of T = {T}) "
               f"counts parent u's children at or above the floor with a binary search of "
               f"the next row's log-probs; a block scan turns the counts into inclusive sums "
               f"(child j of the level belongs to the parent whose sums bracket j).")
    # two warps' runs of children, from a warp's first child where parents are a few wide
    shown = 64 * per
    j0 = int(sums[7]) // (32 * per) * (32 * per)
    j = np.arange(j0, j0 + shown)
    parent_of = np.searchsorted(sums, j, side="right")
    strip = np.ones((2, shown, 3))
    strip[0] = np.where((parent_of % 2 == 0)[:, None], (0.55, 0.55, 0.55), (0.85, 0.85, 0.85))
    writer = j // per
    strip[1] = plt.matplotlib.colors.to_rgba_array(
        [_WARP_COLOURS[(w // 32) % 2] for w in writer])[:, :3]
    picked = j0 // per + 37
    strip[1, writer == picked] = 0.0
    ax2.imshow(strip, aspect="auto", interpolation="nearest",
               extent=(j0 - 0.5, j0 + shown - 0.5, 1.5, -0.5))
    ax2.set_yticks([0, 1], ["parent", "writer"], fontsize=9)
    ax2.set_xlabel(f"child j of the level (list entry n + j; {shown} of its {M})", fontsize=9)
    _title(ax2, f"Expand: the children lie parent after parent (top: parents {parent_of[0]} "
                f"to {parent_of[-1]}, alternate greys). Thread t writes children t s .. t s + "
                f"s - 1, s = ceil(M / T) made odd = {per}: its first parent by a binary search "
                f"over the sums, each next one by a step. Bottom: the writers, a colour a warp, "
                f"thread {picked} black. A warp a parent would have left parent 0's "
                f"{counts[0]} children to one warp.")
    _save(fig, out, "layout_build_tree_threshold.png")


def _finish_writers(N: int, i0: int, rows: int, threads: int, head: int = 0):
    """Which thread of a finish block writes each byte of its rows of the bool mask, and
    whether as part of a ``uint64`` word (else alone): ``write_rows``'s index math restated,
    for request 0 with the mask starting ``head`` bytes before an 8-byte boundary."""
    first, end = i0 * N, (i0 + rows) * N
    q_lo = (first - head + 7) // 8
    q_hi = max(q_lo, (end - head) // 8)
    thread = np.full(rows * N, -1)
    in_word = np.zeros(rows * N, bool)
    for q in range(q_lo, q_hi):                         # words: thread (q - q_lo) % threads
        g = head + 8 * q - first
        thread[g:g + 8] = (q - q_lo) % threads
        in_word[g:g + 8] = True
    lead_end = head + 8 * q_lo if q_hi > q_lo else end
    tail = head + 8 * q_hi if q_hi > q_lo else end
    for start, stop in ((first, lead_end), (tail, end)):  # single bytes: thread g - start
        for g in range(start, stop):
            thread[g - first] = (g - start) % threads
    assert (thread >= 0).all(), "a byte of the block's rows has no writer"
    return thread.reshape(rows, N), in_word.reshape(rows, N)


def build_tree_finish_layout(out: str) -> None:
    """The finish kernel's bool mask: which thread writes which byte, at 32 rows a block (bs
    64) and at one row a block (bs 1), from write_rows' index math and the module's
    constants."""
    plt = _plt()
    fin = _kernel_module("build_tree_finish")
    T, rows_max = _gpu_value(fin, "FINISH_THREADS"), fin.FINISH_ROWS
    N = 257                                             # budget 256
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 8.2),
                                  gridspec_kw={"height_ratios": [3, 2], "hspace": 0.6})
    rows64 = fin.finish_rows(64, N, 132)
    thread, in_word = _finish_writers(N, 0, rows64, T)
    _warp_image(ax, thread // 32, thread == 37, f"column a (of N = {N})",
                f"row i0 + r (a block's {rows64} rows)",
                f"build_tree finish, bs 64, budget 256: {rows64} rows a block ({T} threads). "
                f"After each thread walked its row's path into shared bits, the block writes "
                f"its rows' bool mask, one contiguous run of {rows64 * N} bytes, as uint64 "
                f"words: thread t writes words t, t + {T}, ... (colours: warps; black: thread "
                f"37, eight bytes a word, {T * 8} bytes apart).", T // 32)
    rows1 = fin.finish_rows(1, N, 132)
    blocks = 4
    head = 3                                            # a mask 3 bytes before a boundary
    stripes = [_finish_writers(N, i0, rows1, T, head) for i0 in range(blocks)]
    thread1 = np.concatenate([t for t, _ in stripes])
    word1 = np.concatenate([w for _, w in stripes])
    img = plt.matplotlib.colors.to_rgba_array(                 # one colour a thread here
        [_WARP_COLOURS[t % 2] for t in thread1.ravel()])[:, :3].reshape(blocks * rows1, N, 3)
    img[~word1] = (0.35, 0.35, 0.35)
    img[word1 & (thread1 == 5)] = 0.0
    ax2.imshow(img, aspect="auto", interpolation="nearest")
    ax2.set_yticks(range(blocks * rows1), [f"block {i}: row {i}" for i in range(blocks)],
                   fontsize=8)
    ax2.set_xlabel(f"column a (of N = {N})", fontsize=10)
    _title(ax2, f"bs 1: {rows1} row a block (finish_rows: {-(-N // rows1)} blocks spread over "
                f"the SMs, where 32-row blocks made {-(-N // rows_max)}). A row of {N} bytes "
                f"starts anywhere in an 8-byte word (here the mask starts {head} bytes before "
                f"a boundary): the bytes before a row's first whole word and after its last "
                f"(dark grey) go one by one, the rest as words, a thread each (alternate "
                f"colours; thread 5 black): {N // 8} words or so, so warp 0 writes them and "
                f"the block's other {T // 32 - 1} warps have none.")
    _save(fig, out, "layout_build_tree_finish.png")


def draft_topk_layout(out: str) -> None:
    """draft_topk: one block per row of logits; T threads stride over V, UNROLL loads each."""
    plt = _plt()
    dt = _kernel_module("draft_topk")
    T, unroll = _gpu_value(dt, "TOPK_THREADS"), dt.UNROLL
    V = 129280                                          # DeepSeek-V3's vocabulary
    chunk = unroll * T
    fig, (ax0, ax) = plt.subplots(2, 1, figsize=(8, 5.2),
                                  gridspec_kw={"height_ratios": [1, 4], "hspace": 0.7})
    n_chunks = -(-V // chunk)
    strip = np.array([[i % 2 for i in range(n_chunks)]])
    ax0.imshow(strip, cmap="Blues", vmin=-1, vmax=3, aspect="auto")
    ax0.set_yticks([])
    ax0.set_xlabel(f"chunk of {chunk} logits (UNROLL x T = {unroll} x {T})", fontsize=9)
    _title(ax0, f"grid (bs L,): one block per row (b, d) of V logits. A row of V = {V}\n"
                  f"(DeepSeek-V3) is {n_chunks} chunks, read one after the other by the block")
    owner = np.tile(np.arange(T) // 32, (unroll, 1))
    mine = np.zeros_like(owner, bool)
    mine[:, 37] = True
    _warp_image(ax, owner, mine, f"thread t (T = TOPK_THREADS = {T} on a GPU: {T // 32} warps)",
                f"load u (UNROLL = {unroll})",
                f"one chunk: thread t loads elements v0 + u T + t, u < {unroll}, all issued "
                f"before any is used\n({unroll} loads in flight). A warp's load u is 32 "
                f"consecutive logits (128 bytes in float32): coalesced.\nColours: warps; "
                f"black: thread 37",
                len(_WARP_COLOURS))
    ax.set_yticks(range(unroll))
    _save(fig, out, "layout_draft_topk.png")


def accept_commit_layout(out: str) -> None:
    """tree_accept: a block per request (staging by all threads, the walk by thread 0);
    commit_kv: a thread per cache column, moving that column of every accepted row."""
    plt = _plt()
    ta, ck = _kernel_module("tree_accept"), _kernel_module("commit_kv")
    T_acc, T_com = _gpu_value(ta, "ACCEPT_THREADS"), _gpu_value(ck, "COMMIT_THREADS")
    N = ta.MAX_NODES
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7.5),
                                  gridspec_kw={"height_ratios": [1, 2.2], "hspace": 0.6})
    owner = np.tile((np.arange(N) % T_acc) // 32, (4, 1))
    second = np.tile(np.arange(N) >= T_acc, (4, 1))
    _warp_image(ax, owner, second, f"tree node i (N <= {N})", "",
                f"tree_accept: one block of T = {T_acc} threads per request (colours: warps). "
                f"Thread t stages\nentries t, t + T of the four rows (black: the second "
                f"round); thread 0 alone walks the lists\nin shared memory; all threads "
                f"write the result rows",
                len(_WARP_COLOURS))
    ax.set_yticks(range(4), ["token_ids", "next_token", "next_sibling", "target_predict"],
                  fontsize=8)
    D, P, path = 576, 0, [0, 2, 3, 7]
    rows = 9
    blocks = np.tile(np.arange(D) // T_com, (rows, 1))
    img = np.ones((rows, D, 3)) * 0.95
    colours = np.array([[0.65, 0.81, 0.89], [0.7, 0.87, 0.54], [0.98, 0.6, 0.6],
                        [0.99, 0.75, 0.44], [0.79, 0.7, 0.84]])
    for i in range(1, len(path)):
        img[P + i] = colours[blocks[0] % len(colours)]
        img[P + path[i]] = np.minimum(img[P + path[i]], colours[blocks[0] % len(colours)])
    img[[P + i for i in range(1, len(path))] + [P + a for a in path[1:]], 100] = 0.0
    ax2.imshow(img, aspect="auto", interpolation="nearest")
    for i in range(1, len(path)):
        if path[i] != i:
            ax2.annotate("", xy=(-8, P + i), xytext=(-8, P + path[i]), annotation_clip=False,
                         arrowprops={"arrowstyle": "->", "connectionstyle": "arc3,rad=0.4",
                                     "lw": 1.5})
    for blk in range(-(-D // T_com)):
        ax2.text(blk * T_com + min(T_com, D - blk * T_com) / 2, rows - 0.6, f"block {blk}",
                 ha="center", fontsize=9)
    ax2.set_yticks(range(rows), [f"slot P + {i}" for i in range(rows)], fontsize=8)
    ax2.set_xlabel(f"cache column (D = {D}: Dc 512 + Dr 64)", fontsize=10)
    _title(ax2, f"commit_kv: grid (ceil(D / {T_com}), bs, layers), a thread per column of "
                  f"a request's layer. Accepted path {path}:\nrows P + {path[1:]} move to "
                  f"P + 1 .. P + {len(path) - 1}. Thread 100 (black) reads column 100 of "
                  f"every source,\nthen writes them, ascending. A warp moves 128 bytes of a "
                  f"row (float32)")
    _save(fig, out, "layout_accept_commit.png")


def accept_commit_fused_layout(out: str) -> None:
    """accept_commit: the (layer, word) items of DeepSeek-V3's 61 bf16 layers spread over the
    ``parts`` blocks of one request, from the kernel's block size (nothing restated)."""
    import math

    plt = _plt()
    ac = _kernel_module("accept_commit")
    T = _gpu_value(ac, "ACCEPT_COMMIT_THREADS")
    layers, words = 61, 576 * 2 // 8                # 576 bf16 values = 144 uint64 words
    parts = math.ceil(layers * words / T)
    item = np.arange(layers * words).reshape(layers, words)
    owner = item // T                               # block part of the request
    mine = item % T == 37                           # thread 37 of every block
    fig, ax = plt.subplots(figsize=(8, 5.2))
    _warp_image(ax, owner, mine, f"uint64 word w of a cache row (W = {words}: 576 bf16 "
                f"values)", "layer",
                f"accept_commit, one request: item = layer x {words} + w, block part = "
                f"item // {T} (T = {T}), thread = item % {T}: {parts} blocks, each staging the "
                f"tree rows and walking them before it moves its items (colours: blocks; "
                f"black: thread 37 of each block, its word of every accepted row)",
                len(_WARP_COLOURS))
    _save(fig, out, "layout_accept_commit_fused.png")


def thumbnails(out: str, tree) -> None:
    """Thumbnails for the examples that draw no figure: the five stages, the ancestor mask."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    stages = ["draft_topk", "build_tree", "verify_attn", "tree_accept", "commit_kv"]
    for i, st in enumerate(stages):
        ax.add_patch(plt.Rectangle((0.1, 4 - i - 0.35), 0.8, 0.7, color=_WARP_COLOURS[i]))
        ax.text(0.5, 4 - i, st, ha="center", va="center", fontsize=16, family="monospace")
        if i:
            ax.annotate("", xy=(0.5, 4 - i + 0.35), xytext=(0.5, 4 - i + 0.65),
                        arrowprops={"arrowstyle": "->", "lw": 1.5})
    ax.set(xlim=(0, 1), ylim=(-0.5, 4.5))
    ax.set_axis_off()
    _save(fig, out, "thumb_stages.png")

    n = int(tree.num_nodes[0])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.imshow(tree.visibility[0, :n, :n], cmap="Blues", interpolation="nearest")
    ax.set(xlabel="key node j", ylabel="query node i", title="visibility: j is an ancestor of i")
    _save(fig, out, "thumb_visibility.png")


def mma_fragment_figure(out: str) -> None:
    """Lane maps of mma.sync.m16n8k16 (A, B, C) and of the mma verify_attn kernel's warps,
    drawn from ``reference.mma_fragments`` and the kernel's constants (nothing restated)."""
    import numpy as np

    from ddtree_numba.reference import mma_fragments as mf

    plt = _plt()
    fig = plt.figure(figsize=(7.6, 10.4))       # A on top, B and C below: cells stay legible
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1])
    axes = [fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]),
            fig.add_subplot(grid[1, 1])]
    cmap = plt.get_cmap("tab20")
    panels = [
        ("A: 16 x 16, row-major (a0..a3)", (16, 16),
         [(mf.a_element(lane, reg, half), lane, reg) for lane in range(32) for reg in range(4)
          for half in range(2)]),
        ("B: 16 x 8, k x n (b0, b1)", (16, 8),
         [(mf.b_element(lane, reg, half), lane, reg) for lane in range(32) for reg in range(2)
          for half in range(2)]),
        ("C, D: 16 x 8, float32 (c0..c3)", (16, 8),
         [(mf.c_element(lane, i), lane, i) for lane in range(32) for i in range(4)]),
    ]
    for ax, (title, shape, cells) in zip(axes, panels, strict=True):
        colour = np.zeros((*shape, 3))
        for (r, c), lane, _ in cells:
            g, t = divmod(lane, 4)              # tab20: a dark and a light shade per group g
            colour[r, c] = cmap(2 * g + t % 2)[:3]
        ax.imshow(colour, interpolation="nearest")
        for (r, c), lane, reg in cells:
            ax.text(c, r, f"{lane}\n{reg}", ha="center", va="center", fontsize=7,
                    linespacing=0.9)
        ax.set_xticks(range(shape[1]))
        ax.set_yticks(range(shape[0]))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("column (k for A, n for B and C)" if shape[1] == 16 else "column",
                      fontsize=9)
        ax.set_ylabel("row (k for B)" if "B" in title else "row", fontsize=9)
        _title(ax, title, fontsize=10)
    fig.suptitle("mma.sync.m16n8k16: in each cell the lane (top) and the register (bottom)\n"
                 "that hold the element; colour: the lane's group g = lane // 4 (lighter: t = "
                 "lane % 4 odd)", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "mma_fragments.png"), dpi=110)
    plt.close(fig)


def generate(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    step = ddtree_step_figure(os.path.join(out, "ddtree_step.png"))
    performance_figures(out)
    verify_attn_layout(out)
    build_tree_layout(out)
    build_tree_corners_layout(out)
    build_tree_threshold_layout(out)
    build_tree_finish_layout(out)
    draft_topk_layout(out)
    accept_commit_layout(out)
    accept_commit_fused_layout(out)
    mma_fragment_figure(out)
    thumbnails(out, step["tree"])
