"""Benchmark: the step's argmax and the toy drafter at Kimi-K2's and Moonlight's vocabulary
(V 163 840), each row a whole vocabulary wide: device time of one graph replay (no L2 flush,
as ``bench_deepseek_step``'s stages), and each result checked against its twin (numpy's
argmax, ``HostDraftOps``). Writes ``$OUT/wide_rows.csv``. Usage: ``python3 bench_wide_rows.py``.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from harness import Bench, print_table

from ddtree_numba.kernels import as_device
from ddtree_numba.models.toy_drafter import HostDraftOps, KernelDraftOps
from ddtree_numba.step.ops import KernelStepOps

V = 163840


def main():
    bench = Bench("wide_rows")
    rng = np.random.default_rng(0)
    for bs, N in ((1, 65), (1, 257), (8, 65)):
        logits = rng.standard_normal((bs * N, V)).astype(np.float32)
        d_logits = as_device(cp.asarray(logits))
        num_nodes = as_device(cp.full(bs, N, cp.int32))
        predict = as_device(cp.zeros((bs, N), cp.int32))
        cp.cuda.Device().synchronize()      # CuPy filled them on its stream, the bench's differs
        ops = KernelStepOps()
        t = bench.time_device(lambda: ops.argmax(d_logits, num_nodes, predict), reps=30,
                              flush=False)
        exact = bool((predict.copy_to_host().reshape(-1) == logits.argmax(1)).all())
        bench.add(kernel="argmax", rows=bs * N, us=t["ms"] * 1e3,
                  gb_per_s=logits.nbytes / t["ms"] / 1e6, exact=exact)
    for bs, L in ((1, 8), (8, 8)):
        continuation = rng.integers(0, V, (bs, 400)).astype(np.int32)
        prefix = rng.integers(0, 300, bs).astype(np.int32)
        out = as_device(cp.zeros((bs, L, V), cp.float32))
        d_cont, d_prefix = as_device(cp.asarray(continuation)), as_device(cp.asarray(prefix))
        cp.cuda.Device().synchronize()
        ops = KernelDraftOps()
        t = bench.time_device(lambda: ops.draft(d_cont, d_prefix, 7, 0.8, 6.0, 1.0, out),
                              reps=30, flush=False)
        want = np.empty((bs, L, V), np.float32)
        HostDraftOps().draft(continuation, prefix, 7, 0.8, 6.0, 1.0, want)
        exact = bool(np.array_equal(out.copy_to_host(), want))
        bench.add(kernel="toy drafter", rows=bs * L, us=t["ms"] * 1e3,
                  gb_per_s=want.nbytes / t["ms"] / 1e6, exact=exact)
    print_table(bench.rows, ["kernel", "rows", "us", "gb_per_s", "exact"],
                f"argmax and toy drafter at V {V} on {bench.gpu}")
    print("wrote", bench.write_csv())


if __name__ == "__main__":
    main()
