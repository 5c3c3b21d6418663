"""Where the DeepSeek-V3 target's forward spends its time: every operation of one forward, each
captured alone and replayed (device time, no L2 flush, as in a decoding loop), at one token a
request (plain decoding, T = 1) and over a tree (budget 64, T = 65), bs 1.

The model is ``bench_deepseek_step``'s (Moonlight-16B-A3B's layer sizes, bfloat16 weights and
cache) with two layers: layer 0 dense, layer 1 MoE; every layer after the first dense ones is
like layer 1. Per operation: its call (the dense-operations backend's method, the router,
``verify_attn``), its shapes, device microseconds, the bytes of weights it reads and the
bandwidth that makes. The floor of a forward that must read its weights once is those bytes
over the copy bandwidth, measured in the same run (a device-to-device copy of 1 GiB).

Writes ``$OUT/deepseek_ops.csv``. Usage: ``python3 profile_deepseek_ops.py``.
"""

from __future__ import annotations

import time

import cupy as cp
import numpy as np
from bench_deepseek_step import make_step, random_model
from harness import Bench, copy_bandwidth_gbs, print_table

from ddtree_numba.models.deepseek_v3.target import DeepseekV3Target

LAYERS = 2


class RecordingOps:
    """Forwards every call to ``inner`` and keeps ``(name, call)`` for each, to replay."""

    def __init__(self, inner):
        self.inner, self.calls, self.recording = inner, [], False
        self.name = inner.name

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args, **kwargs):
            if self.recording:
                self.calls.append((name, args, lambda: method(*args, **kwargs)))
            return method(*args, **kwargs)

        return call


def weight_bytes(name, args) -> int:
    """Bytes of weights an operation reads (0 for the element-wise ones): a matrix product's
    ``w``, all of it for a grouped or dense batched product, the chosen experts' for a gathered
    one."""
    if name in ("linear", "linear_batched"):
        return args[1].nbytes
    if name == "linear_gathered":
        w, experts = args[1], args[2]
        pairs = experts.shape[0] * experts.shape[1]
        return min(pairs, w.shape[0]) * (w.nbytes // w.shape[0])
    return 0


def shapes(args) -> str:
    return " ".join("x".join(map(str, a.shape)) for a in args if hasattr(a, "shape"))


def main():
    bench = Bench("deepseek_ops")
    t0 = time.perf_counter()
    config, tensors = random_model(LAYERS)
    target = DeepseekV3Target(config, tensors, cache_dtype="bfloat16", weight_dtype="bfloat16")
    del tensors
    print(f"model: {LAYERS} layers at Moonlight-16B-A3B's sizes, loaded in "
          f"{time.perf_counter() - t0:.0f} s")
    copy_gbs = copy_bandwidth_gbs(bench, 1 << 30)              # read + write
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s")
    ops = RecordingOps(target.ops)
    target.ops = ops
    for budget in (0, 64):
        step = make_step(target, np.zeros((1, 2), np.int32), bs=1, budget=budget, steps=6,
                         mode="eager")
        step.start(np.array([7], np.int32))
        step()                                  # compile and warm up
        calls = []

        def recording_attend(layer, *args):
            calls.append(("verify_attn", (), lambda: DeepseekV3Target.attend(target, layer,
                                                                              *args)))
            return DeepseekV3Target.attend(target, layer, *args)

        target_forward = dict(step.stages())["target_forward"]
        ops.calls, ops.recording = calls, True
        target.attend = recording_attend
        target_forward()
        ops.recording = False
        del target.attend
        cp.cuda.Device().synchronize()
        forward = bench.time_device(target_forward, reps=20, flush=False)["ms"] * 1e3
        total, total_bytes = 0.0, 0
        T = step.tree.token_ids.size
        for index, (name, args, replay) in enumerate(calls):
            us = bench.time_device(replay, reps=20, flush=False)["ms"] * 1e3
            nbytes = weight_bytes(name, args)
            total, total_bytes = total + us, total_bytes + nbytes
            bench.add(T=T, index=index, op=name, shapes=shapes(args), us=us,
                      weight_mb=nbytes / 1e6, gb_per_s=nbytes / us / 1e3 if nbytes else None)
        bench.add(T=T, index=len(calls), op="forward (one graph)", us=forward,
                  weight_mb=total_bytes / 1e6, gb_per_s=total_bytes / forward / 1e3,
                  floor_us=total_bytes / copy_gbs / 1e3, sum_of_ops_us=total)
    print_table(bench.rows, ["T", "index", "op", "shapes", "us", "weight_mb", "gb_per_s",
                             "floor_us", "sum_of_ops_us"],
                f"DeepSeek-V3 forward per operation ({LAYERS} layers, Moonlight's sizes, bf16) "
                f"on {bench.gpu}; copy {copy_gbs:.0f} GB/s")
    print("wrote", bench.write_csv())


if __name__ == "__main__":
    main()
