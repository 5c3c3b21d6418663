"""Benchmark: one greedy DDTree step (``GreedyStep``) on the toy MLA target, eager vs graph.

Per configuration (cache float32 or bfloat16, bs in {1, 8}, budget in {64, 256}; L = 15 as in
the DDTree paper, K = 8; the GPU toy: 2 layers, 4 heads, Dc 512, Dr 64, hidden 512, vocab
4096). A float32 cache runs ``verify_attn``'s tiled variant, a bfloat16 cache the tensor-core
variant ``mma`` (column ``attention``):

* ``host_us``: wall time of the ``step()`` call on the host (it only enqueues work), median
  over steps; eager launches every kernel from Python, graph mode replays one CUDA graph.
* ``device_us``: CUDA events around each step on its stream, median: the step's time on the
  GPU (in eager mode this includes any gap where the GPU waited for the host's launches).
* ``launches``: kernels per step (counted at numba's launch configuration in an eager step).
* per stage (graph mode): each stage captured alone and replayed between events (no L2 flush:
  a decoding loop runs steps back to back), median; ``verify_attn_all_layers`` is the part of
  ``target_forward`` spent in attention (the rest is the toy's untuned dense layers).

Each step advances real state: the drafter sees the target's greedy continuation (decoded on
the GPU first, budget 0) and agrees with it 80 % of the time, so trees and accepted paths are
realistic. Writes ``$OUT/bench_step.csv``.
"""

from __future__ import annotations

import statistics
import sys
import time

import cupy as cp
import numpy as np
from harness import Bench, print_table

from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
from ddtree_numba.step.demo import DemoSizes, build_step

L, TOPK, STEPS = 15, 8, 20


def device_greedy(model, starts, length: int) -> np.ndarray:
    """``int32[bs, 1 + length]``: start tokens and the target's plain greedy continuation,
    decoded on the GPU by a budget-0 GreedyStep (one token per step; the drafter is unused)."""
    bs = len(starts)
    sizes = DemoSizes(bs=bs, steps=length, L=1, K=1, budget=0, config=model.config)
    step = build_step(model, np.zeros((bs, 2), np.int32), sizes, mode="graph", accuracy=0.0,
                      seed=0)
    step.start(starts)
    for _ in range(length):
        step()
    return np.concatenate([starts[:, None], np.array(step.tokens(), np.int32)], axis=1)


def count_launches(step) -> int:
    """Kernel launches in one (eager) step, counted at numba's launch configuration."""
    from numba.cuda.dispatcher import CUDADispatcher

    count, configure = [0], CUDADispatcher.__getitem__

    def counting(self, args):
        count[0] += 1
        return configure(self, args)

    CUDADispatcher.__getitem__ = counting
    try:
        step()
    finally:
        CUDADispatcher.__getitem__ = configure
    return count[0]


def time_steps(step, starts, reps: int):
    """Host and device time of ``reps`` consecutive steps (after 2 warm-up steps)."""
    step.start(starts)
    stream = step._stream if step.mode == "graph" else cp.cuda.Stream.null
    for _ in range(2):
        step()
    step.synchronize()
    host, device = [], []
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
    for start, end in events:
        start.record(stream)
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        end.record(stream)
    step.synchronize()
    device = [cp.cuda.get_elapsed_time(s, e) for s, e in events]
    return 1e6 * statistics.median(host), 1e3 * statistics.median(device)


def stage_times(bench, step, *, reps: int = 30,
                attention_name: str = "verify_attn_all_layers") -> dict:
    """Device microseconds of each stage, captured alone and replayed (graph mode buffers),
    and under ``attention_name`` the part of target_forward spent in ``verify_attn``."""
    times = {}
    for name, launch in step.stages():
        if name == "advance":
            continue            # appends tokens: replaying it would overrun the token buffer
        times[name] = 1e3 * bench.time_device(launch, reps=reps, flush=False)["ms"]

    def attention():
        for layer in range(len(step.target.kv_caches())):
            step.target.attend(layer, step.tree, step.block_table, step.prefix_lens)

    times[attention_name] = 1e3 * bench.time_device(attention, reps=reps, flush=False)["ms"]
    return times


def main(quick: bool = False, caches=("float32", "bfloat16")):
    bench = Bench("bench_step")
    config = ToyMLAConfig.gpu()
    rng = np.random.default_rng(0)
    bs_max = 8
    starts_all = rng.integers(0, config.vocab, bs_max).astype(np.int32)
    configs = [(cache, bs, budget) for cache in caches for bs in (1, 8)
               for budget in (64, 256)]
    if quick:
        configs = configs[:1]
    continuations = {}
    for cache, bs, budget in configs:
        model = ToyMLA(config, cache_dtype=cache)
        if cache not in continuations:
            t0 = time.perf_counter()
            continuations[cache] = device_greedy(model, starts_all, (STEPS + 3) * (L + 1))
            print(f"plain greedy continuations, {cache} cache (GPU, budget 0): "
                  f"{time.perf_counter() - t0:.1f} s")
        sizes = DemoSizes(bs=bs, steps=STEPS + 3, L=L, K=TOPK, budget=budget, config=config)
        starts, continuation = starts_all[:bs], continuations[cache][:bs]
        row = {"cache": cache, "bs": bs, "budget": budget, "L": L, "K": TOPK}
        for mode in ("eager", "graph"):
            step = build_step(model, continuation, sizes, mode=mode, accuracy=0.8, seed=0)
            host_us, device_us = time_steps(step, starts, STEPS)
            accepted = (np.array([len(t) for t in step.tokens()]) / step.steps_done - 1).mean()
            row[f"{mode}_host_us"], row[f"{mode}_device_us"] = host_us, device_us
            row["mean_accept_len"] = float(accepted)
            if mode == "eager":
                row["launches"] = count_launches(step)
                row["attention"] = step.target.variant
            if mode == "graph":
                # stages replayed on the graph-mode step's buffers (state left after the run)
                for name, us in stage_times(bench, step).items():
                    row[f"{name}_us"] = us
        bench.add(**row)
        bench.write_csv()                       # incrementally: a timeout keeps what was done
        print_table([row], list(row), f"{cache} cache, bs {bs}, budget {budget}")
    cols = ["cache", "attention", "bs", "budget", "launches", "mean_accept_len",
            "eager_host_us", "eager_device_us", "graph_host_us", "graph_device_us"]
    print_table(bench.rows, cols, f"greedy step on {bench.gpu}, L {L}, K {TOPK} "
                "(host: enqueue time of step(); device: events around the step)")
    stages = [k for k in bench.rows[0] if k.endswith("_us") and not k.startswith(("eager",
                                                                                  "graph"))]
    print_table(bench.rows, ["cache", "bs", "budget", *stages],
                "per stage, device us (graph replay)")
    print("wrote", bench.write_csv())


if __name__ == "__main__":
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--cache=")]
    main(quick="--quick" in sys.argv, caches=only or ("float32", "bfloat16"))
