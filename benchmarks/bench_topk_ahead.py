"""Benchmark: the one-pass draft_topk with one and with two tiles in flight a warp, one run.

bs 64, L 15, V 163 840, K 256 (the issue's bs 64 target rows), float32 and bfloat16 logits:
the default launch (``AHEAD_TILES``: two for bfloat16's whole rows, one for float32) and the
same launch with the other count, each a graph replay after an L2 flush (median), with the
copy bandwidth measured in the same run. Both give the same bits (a warp filters the same tiles
in the same order): checked, and ids checked against ``reference.draft_topk`` on two rows.
Writes ``$OUT/topk_ahead.csv``.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
import torch
from harness import Bench, copy_bandwidth_gbs, print_table

import ddtree_numba.kernels.draft_topk_filtered as filtered
from ddtree_numba import kernels as K
from ddtree_numba import reference as ref


def main():
    bench = Bench("topk_ahead")
    copy_gbs = copy_bandwidth_gbs(bench)
    bs, L, V, k = 64, 15, 163_840, 256
    made = filtered.filtered_kernels
    for dtype in (torch.float32, torch.bfloat16):
        bf16 = dtype == torch.bfloat16
        x_t = (torch.randn((bs, L, V), device="cuda") * 3).to(dtype)
        logits = x_t if bf16 else K.as_device(x_t)
        out = (K.as_device(cp.empty((bs, L, k), cp.float32)),
               K.as_device(cp.empty((bs, L, k), cp.int32)))
        results = {}
        for ahead in (1, 2):
            filtered.filtered_kernels = lambda b, g=True, a=None, ahead=ahead: made(b, g, ahead)

            def launch():
                K.draft_topk(logits, k, out=out, variant="filtered")

            t = bench.time_device(launch, reps=20)
            launch()
            cp.cuda.Device().synchronize()
            results[ahead] = (t, out[0].copy_to_host(), out[1].copy_to_host())
        filtered.filtered_kernels = made
        same = (np.array_equal(results[1][2], results[2][2])
                and np.array_equal(results[1][1].view(np.uint32), results[2][1].view(np.uint32)))
        host = x_t[0, :2].float().cpu().numpy()[None]          # two rows, as float32
        exact = np.array_equal(results[2][2][0, :2], ref.draft_topk(host, k)[1][0])
        gbytes = bs * L * V * x_t.element_size() / 1e9
        for ahead in (1, 2):
            us = results[ahead][0]["ms"] * 1e3
            bench.add(dtype="bfloat16" if bf16 else "float32", ahead_tiles=ahead,
                      default=ahead == filtered.AHEAD_TILES[bf16], device_us=us,
                      pct_of_copy=100 * gbytes / (us * 1e-6) / copy_gbs, copy_gbs=copy_gbs,
                      same_bits=same, ids_exact=exact)
    path = bench.write_csv()
    print_table(bench.rows, ["dtype", "ahead_tiles", "default", "device_us", "pct_of_copy",
                             "copy_gbs", "same_bits", "ids_exact"],
                f"draft_topk one pass, bs {bs}, V {V}, K {k}, on {bench.gpu}, {bench.date}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
