"""Project the H200 timings in ``results/*.csv`` onto the RTX PRO 6000 Blackwell (sm_120).

A projection, not a measurement: each kernel is scaled by the resource that bounds it on the
H200, as measured (benchmarks/NOTES.md):

* ``latency``: one dependent chain on one warp or one block (build_tree's pops and its
  threshold select, the resident draft_topk's blocks) -> SM clock ratio;
* ``issue``: instruction issue over the whole GPU (draft_topk, verify_attn, its tensor-core
  variant at 22-29 % of the mma.sync ceiling: one block of 8 warps an SM on both chips)
  -> (SMs x clock);
* ``launch``: a few microseconds of graph launch and DRAM latency (tree_accept, commit_kv,
  accept_commit) -> unchanged.

Chip figures (datasheets; the H200 clock as read by Nsight Compute under load):
H200 SXM 132 SMs at 1.98 GHz, 4.8 TB/s HBM3e; RTX PRO 6000 Blackwell 188 SMs, 125 TFLOP/s FP32
peak (24 064 lanes x 2 x 2.6 GHz), 1.79 TB/s GDDR7.

Writes ``results/projection_sm120.md`` (included by the docs).
"""

from __future__ import annotations

import csv
import os

from ddtree_numba.kernels.draft_topk import filtered_pays

HERE = os.path.dirname(os.path.abspath(__file__))
H200 = {"sms": 132, "clock_ghz": 1.98, "bandwidth_tbs": 4.8}
RTX_PRO_6000 = {"sms": 188, "clock_ghz": 125e12 / (24064 * 2) / 1e9, "bandwidth_tbs": 1.792}

SCALE = {
    "latency": H200["clock_ghz"] / RTX_PRO_6000["clock_ghz"],
    "issue": (H200["sms"] * H200["clock_ghz"]) / (RTX_PRO_6000["sms"] * RTX_PRO_6000["clock_ghz"]),
    "launch": 1.0,
}


def rows(name):
    with open(os.path.join(HERE, "results", f"{name}.csv")) as f:
        return list(csv.DictReader(f))


def projection() -> list:
    """``(label, bound, date of the H200 run, H200 us, sm_120 bandwidth floor us, projected
    us)``; the projection is never below
    the time the RTX PRO 6000 needs to move the kernel's bytes once at its datasheet rate."""
    out = []
    for r in rows("build_tree"):
        if r["bs"] in ("1", "64"):
            bs, N = int(r["bs"]), int(r["budget"]) + 1
            nbytes = bs * N * N + bs * N * ((N + 31) // 32) * 4     # visibility + bits
            out.append((f"build_tree bs={bs} budget={r['budget']}", "latency",
                        float(r["gpu_us"]), nbytes, r["date"]))
    for r in rows("ddtree_part"):           # the newest per-stage figures at bs 1: the
        label = f"bs={r['bs']} V={r['V']} K={r['K']} {r['logits']} logits"   # resident
        layers = f"cache {r['layers']} x {r['cache']}"                     # draft_topk and
        nbytes = int(r["bs"]) * 15 * int(r["V"]) * (4 if r["logits"] == "float32" else 2)
        out.append((f"draft_topk resident {label} (DDTree part)", "latency",   # one block's
                    float(r["draft_topk_us"]), nbytes, r["date"]))            # chain each
        out.append((f"build_tree threshold bs={r['bs']} budget={r['budget']} (DDTree part, "
                    f"{r['logits']} logits)", "latency", float(r["build_tree_us"]), 0,
                    r["date"]))
        out.append((f"accept_commit bs={r['bs']} N={int(r['budget']) + 1} {layers} (DDTree "
                    "part)", "launch", float(r["accept_commit_us"]), 0, r["date"]))
    for r in rows("draft_topk"):
        # bs 1 with K <= 256 now takes the resident kernel (its rows above); these rows
        # predate it
        if r["bs"] == "64" and r["k"] == "256":
            bs = int(r["bs"])
            nbytes = bs * 15 * int(r["V"]) * (4 if r["dtype"] == "float32" else 2)
            # the kernel the default launches (filtered_pays, as draft_topk decides; every
            # row times the two-pass kernel as two_pass_us)
            parts = int(r.get("parts") or 1)
            variant = ("filtered" if filtered_pays(parts, int(r["V"]), int(r["k"]))
                       else "two_pass")
            us = float(r["gpu_us"] if r.get("variant", "two_pass") == variant
                       else r["two_pass_us"])
            out.append((f"draft_topk bs={bs} V={r['V']} K=256 {r['dtype']} {variant} "
                        f"({r.get('parts') or 1} blocks per row)", "issue", us, nbytes,
                        r["date"]))
    for r in rows("accept_commit"):
        if r["N"] != "1025":
            continue
        layers = int(r.get("layers") or 1)
        item = 4 if r.get("cache", "float32") == "float32" else 2
        moved = int(r["bs"]) * float(r["mean_accept_len"]) * layers * 576 * item * 2
        if layers == 1:
            out.append((f"tree_accept bs={r['bs']} N=1025", "launch",
                        float(r["tree_accept_us"]), 0, r["date"]))
        out.append((f"commit_kv x{layers} bs={r['bs']} N=1025 {r.get('cache', 'float32')}",
                    "launch", float(r["commit_kv_us"]), moved, r["date"]))
        if r.get("accept_commit_us"):
            out.append((f"accept_commit ({layers} layers) bs={r['bs']} N=1025", "launch",
                        float(r["accept_commit_us"]), moved, r["date"]))
    for r in rows("verify_attn"):
        if r["dtype"] == "float32":
            bs, T = int(r["bs"]), int(r["prefix"]) + int(r["N"])
            out.append((f"verify_attn bs={bs} N={r['N']} P={r['prefix']} H={r['H']}",
                        "issue", float(r["gpu_us"]), bs * T * 576 * 4, r["date"]))
    for r in rows("verify_attn_mma"):       # the tensor-core variant, bf16 cache: latency-
        bs, T = int(r["bs"]), int(r["prefix"]) + int(r["N"])    # and issue-bound (3-26 % of
        out.append((f"verify_attn mma bf16 bs={bs} N={r['N']} P={r['prefix']} H={r['H']}",
                    "issue", float(r["mma_us"]), bs * T * 576 * 2, r["date"]))  # tensor pipe)
    result = []
    for label, bound, us, nbytes, date in out:
        floor_us = nbytes / (RTX_PRO_6000["bandwidth_tbs"] * 1e12) * 1e6
        result.append((label, bound, date, us, floor_us, max(us * SCALE[bound], floor_us)))
    return result


def markdown() -> str:
    lines = ["| kernel and size | bound on the H200 | H200 run | H200 measured (us) | "
             "sm_120 bandwidth floor (us) | RTX PRO 6000 projected (us) |",
             "|---|---|---|---:|---:|---:|"]
    for label, bound, date, us, floor_us, projected in projection():
        lines.append(f"| {label} | {bound} | {date} | {us:,.1f} | {floor_us:,.1f} | "
                     f"{projected:,.1f} |")
    lines.append("")
    lines.append(f"Scale factors: latency x{SCALE['latency']:.2f} (clock "
                 f"{H200['clock_ghz']:.2f} -> {RTX_PRO_6000['clock_ghz']:.2f} GHz), issue "
                 f"x{SCALE['issue']:.2f} (SMs x clock), launch x1.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    path = os.path.join(HERE, "results", "projection_sm120.md")
    with open(path, "w") as f:
        f.write(markdown())
    print(markdown())
