"""Figures and tables generated at every docs build (offline; nothing committed can go stale).

* ``ddtree_step.png``: one greedy step of the tiny toy MLA model through the numpy references,
  the draft tree with the accepted path highlighted.
* ``perf_*.png`` and ``perf_*.md``: plots and tables from the committed benchmark CSVs
  (``benchmarks/results``), each labelled with the GPU and the date of the run.
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
    draw_tree(step.tree, 0, path, accepted=step.accept.accept_nodes[0, : n + 1],
              title=f"one greedy step: budget {budget}, K {k}, L {L}; the accepted path "
                    f"(orange) commits {n} draft tokens + the bonus")
    return {"accepted": n, "tokens": step.accept.accept_tokens[0, : n + 1].tolist()}


def _rows(name: str) -> list:
    path = os.path.join(RESULTS, f"{name}.csv")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


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
        lines.append(f"*{rows[0]['gpu']}, {rows[0]['date']}.*")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


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
        ax.legend(fontsize=7)
        fig.savefig(os.path.join(out, "perf_build_tree.png"), dpi=110, bbox_inches="tight")
        plt.close(fig)
        _table(rows, ["bs", "budget", "gpu_us", "ns_per_pop", "python_heap_us",
                      "speedup_vs_heap"],
               ["bs", "budget", "kernel us", "ns per pop", "Python heap us", "speed-up"],
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
        ax.legend(fontsize=7)
        fig.savefig(os.path.join(out, "perf_verify_attn.png"), dpi=110, bbox_inches="tight")
        plt.close(fig)
        _table(rows, ["bs", "N", "prefix", "H", "dtype", "gpu_us", "tflops", "pct_of_sgemm",
                      "cupy_fp32_us", "torch_bf16_us"],
               ["bs", "N", "prefix", "H", "cache", "kernel us", "TFLOP/s", "% of SGEMM",
                "CuPy f32 us", "torch bf16 us"], os.path.join(out, "perf_verify_attn.md"))

    rows = _rows("bench_step")
    if rows:
        x = np.arange(len(rows))
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        labels = [f"bs {r['bs']}\nB {r['budget']}" for r in rows]
        for ax, key, title in ((axes[0], "host_us", "host time per step"),
                               (axes[1], "device_us", "device time per step")):
            ax.bar(x - 0.2, [float(r[f"eager_{key}"]) for r in rows], 0.4, label="eager")
            ax.bar(x + 0.2, [float(r[f"graph_{key}"]) for r in rows], 0.4, label="CUDA graph")
            ax.set_xticks(x, labels, fontsize=7)
            ax.set(yscale="log", ylabel="microseconds", title=title)
            ax.legend(fontsize=7)
        fig.suptitle(f"GreedyStep, toy MLA target ({rows[0]['gpu']}, {rows[0]['date']})",
                     fontsize=9)
        fig.savefig(os.path.join(out, "perf_step.png"), dpi=110, bbox_inches="tight")
        plt.close(fig)
        stages = [c for c in rows[0] if c.endswith("_us") and not c.startswith(("eager",
                                                                               "graph"))]
        _table(rows, ["bs", "budget", "launches", "mean_accept_len", "eager_host_us",
                      "graph_host_us", "eager_device_us", "graph_device_us"],
               ["bs", "budget", "launches", "accepted per step", "eager host us",
                "graph host us", "eager device us", "graph device us"],
               os.path.join(out, "perf_step.md"))
        _table(rows, ["bs", "budget", *stages], ["bs", "budget", *[s[:-3] for s in stages]],
               os.path.join(out, "perf_step_stages.md"))

    rows = _rows("draft_topk")
    if rows:
        _table(rows, ["bs", "V", "k", "dtype", "gpu_us", "read_gbs", "pct_of_copy_bw",
                      "torch_us", "speedup_vs_torch"],
               ["bs", "V", "K", "logits", "kernel us", "GB/s", "% of copy BW", "torch us",
                "speed-up"], os.path.join(out, "perf_draft_topk.md"))
    rows = _rows("accept_commit")
    if rows:
        _table(rows, ["bs", "N", "mean_accept_len", "tree_accept_us", "commit_kv_us"],
               ["bs", "N", "accepted", "tree_accept us", "commit_kv us"],
               os.path.join(out, "perf_accept_commit.md"))


def generate(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    ddtree_step_figure(os.path.join(out, "ddtree_step.png"))
    performance_figures(out)
