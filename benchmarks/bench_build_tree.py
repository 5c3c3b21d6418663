"""Benchmark: kernels.build_tree against the CPU paths published DDTree ports use.

Configurations: bs in {1, 8, 64}, budget in {64, 128, 256, 1024}, L = 15, K = min(budget, 1024).
Inputs are the top-K of random drafter logits (scaled so the drafter is fairly confident).

* ``gpu``: the kernel (select + finish launches, the default select), device
  time of a graph replay; ``corners_select_us``, ``warp_select_us``, ``levels_select_us``,
  ``threshold_select_us``: the select phase alone of each variant (each checked exact, with
  the finish; the threshold select runs its fall-back in its own block). ``finish_us``: the
  whole call less its default select; ``finish_alone_us``: the finish launch alone, at the
  rows a block that ``finish_rows`` picks (``finish_rows``) and at 32 (``finish32_alone_us``,
  the grid before that choice), both checked exact.
* ``numpy_ref``: reference.build_tree, plus the copies a CPU path needs (top-K device -> host,
  the tree's arrays host -> device), wall clock.
* ``python_heap``: a per-request Python heap, the way published DDTree ports build the tree on
  the CPU (Python floats, heapq, a visibility mask per request), plus the same copies.

``--targets``: only the four configurations that have a target (``TARGETS_US``), on the same
inputs as the full run, with two selects (the default and the ``"warp"`` pops, the kernel the
targets were set against) and the columns ``target_us`` and ``meets_target``: it compiles 6 of
the full run's 16 selects, which should fit one device command on a fresh machine
(``run_gpu.sh targets-tree``; not yet run on a GPU when written).
``--quick``: one repetition of the host paths.
"""

from __future__ import annotations

import dataclasses
import heapq
import importlib
import sys

import cupy as cp
import numpy as np
from harness import Bench, print_table

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.kernels._device import sm_count
from ddtree_numba.kernels.build_tree_finish import finish_rows

kbt = importlib.import_module("ddtree_numba.kernels.build_tree")   # the module, not the function


def python_heap_tree(lp: np.ndarray, ids: np.ndarray, roots: np.ndarray, budget: int):
    """Per-request CPU tree build: parents, tokens, depths and the ancestor mask."""
    bs, L, Kk = lp.shape
    N = budget + 1
    parents = np.full((bs, N), -1, np.int32)
    tokens = np.full((bs, N), -1, np.int32)
    depths = np.full((bs, N), -1, np.int32)
    mask = np.zeros((bs, N, N), np.bool_)
    for b in range(bs):
        rows = lp[b].tolist()
        heap = [(-rows[0][0], 0, 0, 0)]                   # (-score, parent, depth, rank)
        scores, par, dep, tok = [0.0], [-1], [0], [int(roots[b])]
        while heap and len(par) <= budget:
            neg, p, d, r = heapq.heappop(heap)
            c = len(par)
            par.append(p)
            dep.append(d + 1)
            tok.append(int(ids[b, d, r]))
            scores.append(-neg)
            if r + 1 < Kk:
                heapq.heappush(heap, (-(scores[p] + rows[d][r + 1]), p, d, r + 1))
            if d + 1 < L:
                heapq.heappush(heap, (-(scores[c] + rows[d + 1][0]), c, d + 1, 0))
        n = len(par)
        parents[b, :n], tokens[b, :n], depths[b, :n] = par, tok, dep
        mask[b, 0, 0] = True
        for i in range(1, n):
            mask[b, i] = mask[b, par[i]]
            mask[b, i, i] = True
    return parents, tokens, depths, mask


def same_tree(got, want) -> bool:
    """Every field of a device tree equals the reference's, bit for bit."""
    got = got.to_host()
    return all(np.array_equal(getattr(got, f.name), getattr(want, f.name))
               for f in dataclasses.fields(want))


# (budget, bs) -> the tree build's target, us (H200, graph replay after an L2 flush)
TARGETS_US = {(64, 1): 10.0, (256, 1): 20.0, (256, 64): 40.0, (1024, 64): 80.0}


def main(quick: bool = False, targets: bool = False):
    bench = Bench("build_tree_targets" if targets else "build_tree")
    rng = np.random.default_rng(0)
    L = 15
    for budget in (64, 128, 256, 1024):
        Kk = min(budget, 1024)
        default = "threshold" if budget >= kbt.THRESHOLD_FROM_BUDGET else "corners"
        variants = (("warp", default) if targets
                    else ("warp", "corners", "levels", "threshold"))
        for bs in (1, 8, 64):
            # every configuration draws its inputs, so --targets times the full run's inputs
            x = (rng.standard_normal((bs, L, Kk + 16)) * 3).astype(np.float32)
            roots = rng.integers(0, 1000, bs).astype(np.int32)
            prefix = rng.integers(0, 4096, bs).astype(np.int32)
            if targets and (budget, bs) not in TARGETS_US:
                continue
            lp, ids = ref.draft_topk(x, Kk)
            # numba views of CuPy arrays, made before capture (a CuPy array passed to a
            # numba launch is synchronised on its stream, which a capture forbids)
            d_lp, d_ids = K.as_device(cp.asarray(lp)), K.as_device(cp.asarray(ids))
            d_roots, d_prefix = K.as_device(cp.asarray(roots)), K.as_device(cp.asarray(prefix))
            out = K.allocate_tree(bs, budget + 1)
            scratch = K.as_device(cp.empty((bs, budget + 1), cp.int32))

            def launch():
                K.build_tree(d_lp, d_ids, d_roots, budget, prefix_lens=d_prefix, out=out,
                             scratch=scratch)

            gpu = bench.time_device(launch, reps=30)
            selects = {variant: bench.time_device(
                lambda variant=variant: kbt.launch_select(variant, d_lp, budget, out, scratch),
                reps=30) for variant in variants}
            # each select, then the finish, against the reference: every field
            want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
            exact_by_variant = {}
            for variant in selects:
                kbt.launch_select(variant, d_lp, budget, out, scratch)
                kbt.launch_finish(d_ids, d_roots, d_prefix, True, out, scratch)
                cp.cuda.Device().synchronize()
                exact_by_variant[variant] = same_tree(out, want)
            # the finish alone: at the rows a block finish_rows picks, and at 32 rows (each
            # writes the whole tree again over the last select's node table)
            rows = finish_rows(bs, budget + 1, sm_count())
            finish_alone, finish_exact = {}, True
            for r in dict.fromkeys((rows, 32)):
                def finish(r=r):
                    kbt.launch_finish(d_ids, d_roots, d_prefix, True, out, scratch,
                                      rows_per_block=r)
                finish_alone[r] = bench.time_device(finish, reps=30)
                finish()
                cp.cuda.Device().synchronize()
                finish_exact = finish_exact and same_tree(out, want)
            host = bench.time_host(launch, reps=10, sync=False)     # the default variant
            cp.cuda.Device().synchronize()
            exact = same_tree(out, want)

            def numpy_path():
                t = ref.build_tree(d_lp.copy_to_host(), d_ids.copy_to_host(),
                                   d_roots.copy_to_host(), budget,
                                   prefix_lens=d_prefix.copy_to_host())
                for a in (t.token_ids, t.parents, t.visibility, t.visibility_bits, t.positions):
                    cp.asarray(a)

            def heap_path():
                res = python_heap_tree(d_lp.copy_to_host(), d_ids.copy_to_host(),
                                       d_roots.copy_to_host(), budget)
                for a in res:
                    cp.asarray(a)

            reps = 1 if (quick or bs * budget >= 64 * 256) else 3
            np_t = bench.time_host(numpy_path, reps=reps)
            heap_t = bench.time_host(heap_path, reps=reps)
            pops = float(want.num_nodes.max() - 1)
            # the selects timed, us (.get gives None for those --targets leaves out)
            us = {variant: t["ms"] * 1e3 for variant, t in selects.items()}
            row = dict(bs=bs, budget=budget, L=L, K=Kk, gpu_us=gpu["ms"] * 1e3)
            if targets:
                row.update(target_us=TARGETS_US[budget, bs],
                           meets_target=gpu["ms"] * 1e3 <= TARGETS_US[budget, bs])
            row.update(
                corners_select_us=us.get("corners"), warp_select_us=us["warp"],
                default_select=default, finish_us=gpu["ms"] * 1e3 - us[default],
                finish_rows=rows, finish_alone_us=finish_alone[rows]["ms"] * 1e3,
                finish32_alone_us=finish_alone[32]["ms"] * 1e3, finish_exact=finish_exact,
                corners_exact=exact_by_variant.get("corners"),
                levels_select_us=us.get("levels"), levels_exact=exact_by_variant.get("levels"),
                warp_exact=exact_by_variant["warp"], threshold_select_us=us.get("threshold"),
                threshold_exact=exact_by_variant.get("threshold"),
                corners_ns_per_pop=(us["corners"] * 1e3 / max(pops, 1) if "corners" in us
                                    else None),
                warp_ns_per_pop=us["warp"] * 1e3 / max(pops, 1),
                gpu_us_min=gpu["ms_min"] * 1e3, host_launch_us=host["ms"] * 1e3,
                numpy_ref_us=np_t["ms"] * 1e3, python_heap_us=heap_t["ms"] * 1e3,
                speedup_vs_heap=heap_t["ms"] / gpu["ms"], bit_exact=exact,
                mean_nodes=float(want.num_nodes.mean()))
            bench.add(**row)
    path = bench.write_csv()
    print_table(bench.rows, ["bs", "budget", "K", "gpu_us",
                             *(["target_us", "meets_target"] if targets else []),
                             "corners_select_us",
                             "warp_select_us", "levels_select_us", "threshold_select_us",
                             "corners_exact", "warp_exact", "levels_exact", "threshold_exact",
                             "default_select", "finish_us", "finish_rows", "finish_alone_us",
                             "finish32_alone_us", "finish_exact", "corners_ns_per_pop",
                             "host_launch_us", "numpy_ref_us", "python_heap_us",
                             "speedup_vs_heap", "bit_exact"],
                f"build_tree on {bench.gpu}, {bench.date} (device time: graph replay median)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv, targets="--targets" in sys.argv)
