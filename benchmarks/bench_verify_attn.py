"""Benchmark: kernels.verify_attn (tiled) against CuPy float32 and torch bfloat16 eager.

Configurations (``--full``): bs in {1, 8}, N in {16, 64, 256}, prefix in {1024, 8192, 32768},
H in {64, 128}, float32 and bfloat16 caches (about 8 minutes on an H200; the default is the nine
configurations the targets are stated for), Dc = 512, Dr = 64, 64-row pages, DeepSeek-V3's
sm_scale. FLOPs: ``2 * bs * N * H * T * (Dc + Dr + Dc)`` with ``T = prefix + N`` slots. The
ceiling is cuBLAS SGEMM through CuPy (8192^3, float32) measured in the same run.

Baselines, per request (the way one writes it without a fused kernel): gather the request's
slots into a contiguous ``[T, 576]`` matrix, ``S = Q K^T`` as one matmul, add the tree mask,
softmax, ``O = P C``; CuPy in float32, torch in bfloat16 (eager). They are skipped where the
score matrix of a request would exceed 2 GiB.
"""

from __future__ import annotations

import importlib
import statistics
import sys

import cupy as cp
import numpy as np
import torch
from harness import Bench, print_table

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref

kva = importlib.import_module("ddtree_numba.kernels.verify_attn")   # the module


def sgemm_tflops(bench: Bench, n: int = 8192) -> float:
    a = cp.random.standard_normal((n, n), dtype=cp.float32)
    b = cp.random.standard_normal((n, n), dtype=cp.float32)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(6):
        with bench.stream:
            start.record(bench.stream)
            a @ b
            end.record(bench.stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return 2 * n**3 / (statistics.median(times[1:]) * 1e-3) / 1e12


def make_problem(rng, bs, N, prefix_len, H, dtype):
    page = 64
    prefix = np.full(bs, prefix_len, np.int32)
    pages = (prefix_len + N + page - 1) // page
    table = rng.permutation(bs * pages).astype(np.int32).reshape(bs, pages)
    cache = cp.random.standard_normal((bs * pages, page, 576), dtype=cp.float32)
    if dtype == "bfloat16":
        cache_t = torch.as_tensor(cache, device="cuda").to(torch.bfloat16)
    else:
        cache_t = torch.as_tensor(cache, device="cuda")
    x = rng.standard_normal((bs, 15, 64)).astype(np.float32) * 3
    lp, ids = ref.draft_topk(x, 8)
    tree = ref.build_tree(lp, ids, np.zeros(bs, np.int32), N - 1, prefix_lens=prefix)
    ql = cp.random.standard_normal((bs, N, H, 512), dtype=cp.float32)
    qr = cp.random.standard_normal((bs, N, H, 64), dtype=cp.float32)
    return ql, qr, cache, cache_t, table, prefix, tree


def additive_masks(tree, bs, N, P) -> list:
    """Per request, the tree mask over its ``P + N`` slots as ``0`` / ``-inf`` float32 [N, T]
    (prefix slots visible to every node, tree slot ``P + j`` to the nodes under ``j``)."""
    masks = []
    for b in range(bs):
        vis = ref.unpack_bits(tree.visibility_bits[b], N)             # [N, N]
        m = np.concatenate([np.ones((N, P), bool), vis], axis=1)
        masks.append(np.where(m, 0.0, -np.inf).astype(np.float32))
    return masks


def baseline(xp_matmul, ql, qr, rows, mask, sm_scale, N, H):
    """One request: rows [T, 576], mask [N, T] -> out [N, H, 512]."""
    q = xp_matmul.cat_q(ql, qr).reshape(N * H, 576)
    s = (q @ rows.T) * sm_scale                               # [N H, T]
    s = s.reshape(N, H, -1) + mask[:, None, :]
    p = xp_matmul.softmax(s)
    return p @ rows[:, :512]                                   # [N, H, 512]


class CupyOps:
    @staticmethod
    def cat_q(ql, qr):
        return cp.concatenate([ql, qr], axis=-1)

    @staticmethod
    def softmax(s):
        e = cp.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


class TorchOps:
    @staticmethod
    def cat_q(ql, qr):
        return torch.cat([ql, qr], dim=-1)

    @staticmethod
    def softmax(s):
        return torch.softmax(s, dim=-1)


def main(full: bool = False):
    bench = Bench("verify_attn")
    ceiling = sgemm_tflops(bench)
    rng = np.random.default_rng(0)
    sm_scale = ref.deepseek_sm_scale()
    if full:
        configs = [(bs, N, P, H, dt) for dt in ("float32", "bfloat16") for H in (64, 128)
                   for bs in (1, 8) for N in (16, 64, 256) for P in (1024, 8192, 32768)]
    else:  # the configurations the targets are stated for (about 2 minutes on an H200)
        configs = [(1, 16, 1024, 128, "float32"), (1, 16, 1024, 64, "float32"),
                   (1, 64, 8192, 128, "float32"), (8, 64, 8192, 64, "float32"),
                   (1, 256, 32768, 128, "float32"), (8, 16, 32768, 128, "float32"),
                   (1, 16, 1024, 128, "bfloat16"), (1, 64, 8192, 128, "bfloat16"),
                   (8, 64, 8192, 64, "bfloat16")]
    for bs, N, P, H, dtype in configs:
        ql, qr, cache, cache_t, table, prefix, tree = make_problem(rng, bs, N, P, H, dtype)
        T = P + N
        flops = 2 * bs * N * H * T * (512 + 64 + 512)
        d_args = [K.as_device(ql), K.as_device(qr),
                  cache_t if dtype == "bfloat16" else K.as_device(cache),   # bf16: the tensor
                  K.as_device(table), K.as_device(prefix), K.as_device(tree.visibility_bits),
                  K.as_device(tree.num_nodes)]
        out = (K.as_device(cp.empty((bs, N, H, 512), cp.float32)),
               K.as_device(cp.empty((bs, N, H), cp.float32)))
        reps = 5 if flops > 2e11 else 15
        workspace = kva.allocate_workspace(bs, N, H, 512, table.shape[1] * 64)

        def launch():
            K.verify_attn(*d_args, sm_scale=sm_scale, out=out, workspace=workspace,
                          variant="tiled")

        gpu = bench.time_device(launch, reps=reps)
        row = dict(bs=bs, N=N, prefix=P, H=H, dtype=dtype, gpu_us=gpu["ms"] * 1e3,
                   tflops=flops / (gpu["ms"] * 1e-3) / 1e12, sgemm_tflops=ceiling)
        row["pct_of_sgemm"] = 100 * row["tflops"] / ceiling
        if N * H * T * 4 <= 2 << 30:
            slots = np.arange(T)
            pages = table[:, slots // 64]                               # [bs, T]
            offs = slots % 64
            masks = additive_masks(tree, bs, N, P)
            cache_f = cache if dtype == "float32" else cp.asarray(cache_t.float())
            rows_c = [cache_f[cp.asarray(pages[b]), cp.asarray(offs)] for b in range(bs)]
            masks_c = [cp.asarray(m) for m in masks]

            def cupy_way():
                for b in range(bs):
                    baseline(CupyOps, ql[b], qr[b], rows_c[b], masks_c[b], sm_scale, N, H)

            qlt, qrt = torch.as_tensor(ql).bfloat16(), torch.as_tensor(qr).bfloat16()
            rows_t = [torch.as_tensor(r).bfloat16() for r in rows_c]
            masks_t = [torch.as_tensor(m).bfloat16() for m in masks_c]

            def torch_way():
                for b in range(bs):
                    baseline(TorchOps, qlt[b], qrt[b], rows_t[b], masks_t[b], sm_scale, N, H)

            row["cupy_fp32_us"] = bench.time_eager_events(cupy_way, reps=3)["ms"] * 1e3
            with torch.cuda.stream(torch.cuda.ExternalStream(bench.stream.ptr)):
                row["torch_bf16_us"] = bench.time_eager_events(torch_way, reps=3)["ms"] * 1e3
        bench.add(**row)
        bench.write_csv()                       # after every row: partial runs keep results
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
               if k not in ("bench", "gpu", "date")}, flush=True)
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    bench.write_csv()
    print_table(bench.rows, ["bs", "N", "prefix", "H", "dtype", "gpu_us", "tflops",
                             "pct_of_sgemm", "cupy_fp32_us", "torch_bf16_us"],
                f"verify_attn (tiled) on {bench.gpu}, {bench.date}; SGEMM ceiling "
                f"{ceiling:.1f} TFLOP/s")


if __name__ == "__main__":
    main(full="--full" in sys.argv)
