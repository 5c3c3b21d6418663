"""Benchmark: verify_attn on 16-bit caches, the tensor-core variant ("mma") against the tiled
CUDA-core variant, torch bfloat16 eager, and an mma.sync ceiling measured in the same run.

Ceilings, measured in the same run: a numba kernel whose warps issue independent chains of
``mma.sync.m16n8k16`` (bf16 in, float32 accumulate) through the same wrapper, no memory
traffic: the most this instruction gives on this GPU (``mma_ceiling_tflops``); and a kernel
whose warps issue independent conflict-free ``ldmatrix.x4`` (``shared_tbps``: the shared-memory
bandwidth, all SMs). The kernel's tiling makes ``mma.shared_traffic`` bytes of shared-memory
loads and stores per tile, so ``shared_roofline_tflops = shared_tbps x FLOPs per byte`` of
them is the most any schedule of this tiling can reach (its cp.async copies are left out of
the bound: whether they cost the same pipe is not known; the header line also prints the
bound with them counted as stores). Configurations: the targets of the tensor-core work
(bs 1 N 16 P 1024 H 128; P >= 8192 with H N >= 1024; the per-GPU shapes of 8-way tensor
parallelism, Kimi-K2 H = 8 and DeepSeek-V3 H = 16). bfloat16 cache, Dc = 512, Dr = 64, 64-row
pages, shuffled. FLOPs as in bench_verify_attn: ``2 bs N H T (Dc + Dr + Dc)``, ``T = P + N``.

The merge: ``mma_us`` is what ``verify_attn`` launches; ``fused_merge_us`` the kernel that
merges its own splits, ``two_launch_us`` the kernel without that merge and the merge kernel
after it (both forms give the same bits; ``verify_attn`` picks by the launch's row blocks),
``merge_kernel_us`` the merge kernel alone.

Accuracy column: the largest error of the mma output against the float64 reference (from the
unrounded float32 queries), as a fraction of ``max |c|``, on the first request; the rounding
bound it must stay under is ``u * max|c|`` for the probabilities plus the effect of rounding
the queries (see tests/test_verify_attn_mma.py).
"""

from __future__ import annotations

import importlib
import sys

import cffi
import cupy as cp
import numpy as np
import torch
from bench_verify_attn import TorchOps, additive_masks, baseline, make_problem
from harness import Bench, print_table
from numba import cuda, float32, uint16, uint32

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.kernels import tensor_core as tc
from ddtree_numba.kernels._device import launch, sm_count
from ddtree_numba.kernels.verify_attn import mma

kva = importlib.import_module("ddtree_numba.kernels.verify_attn")
_ffi = cffi.FFI()
CHAINS, ITERS = 8, 512
ACC = 4 * CHAINS            # local-array sizes must be plain constants


@cuda.jit
def mma_chains(out, seed):
    # independent accumulators per warp: the tensor pipe never waits on a result
    acc = cuda.local.array(ACC, float32)
    for k in range(ACC):
        acc[k] = 0.0
    a = uint32(seed) + uint32(cuda.threadIdx.x)
    for _ in range(ITERS):
        for c in range(CHAINS):
            tc.mma_bf16_16816(_ffi.from_buffer(acc[4 * c:]), a, a, a, a, a, a)
    total = float32(0.0)
    for k in range(ACC):
        total += acc[k]
    out[cuda.grid(1)] = total


def mma_ceiling_tflops(bench: Bench) -> float:
    blocks, threads = sm_count() * 16, 128
    out = cuda.device_array(blocks * threads, np.float32)
    seed = 0x3F803F80                                   # bf16 pairs of 1.0
    t = bench.time_device(lambda: launch(mma_chains, blocks, threads)(out, seed), reps=10)
    flops = blocks * (threads // 32) * ITERS * CHAINS * 4096
    return flops / (t["ms"] * 1e-3) / 1e12


LD_BYTES = 16384            # the shared tile the ldmatrix stream reads ...
LD_VALUES = LD_BYTES // 2   # ... in 16-bit values (array sizes must be plain constants)
LD_UNROLL = 8               # independent ldmatrix.x4 per round


@cuda.jit
def ldmatrix_stream(out, seed, rounds, advance):
    # Each warp reads a 512-byte block of the tile per ldmatrix.x4 (lane l gives the row
    # address 16 l: each 8-lane phase reads 128 contiguous bytes, no bank conflict), LD_UNROLL
    # blocks in flight per round; warp w starts at block w % 8 so that the warps of a block
    # spread over the tile. An earlier draft whose rounds repeated the same addresses executed
    # only about half its ldmatrix (Nsight Compute's count), so every round here moves on by
    # ``advance`` bytes (a runtime value, a multiple of 512), wrapped to the tile by a mask
    # that keeps every block inside it. One XOR per load keeps it alive: few instructions
    # besides the loads, so the shared-memory pipe, not instruction issue, sets the rate.
    tile = cuda.shared.array(LD_VALUES, uint16, alignment=16)   # ldmatrix rows: 16 bytes
    tid = cuda.threadIdx.x
    for k in range(tid, LD_VALUES, cuda.blockDim.x):
        tile[k] = uint16(k) ^ uint16(seed)
    cuda.syncthreads()                  # the tile is written
    base = tc.shared_address(_ffi.from_buffer(tile)) + uint32(16 * (tid % 32))
    frag = cuda.local.array(4, uint32)
    acc = uint32(0)
    offset = uint32(512 * (tid // 32 % 8))
    for _ in range(rounds):
        for u in range(LD_UNROLL):      # 8 blocks of 512 bytes from ``offset``, mod 16 KB
            at = (offset + uint32(512 * u)) & uint32(LD_BYTES - 512)   # a block in the tile
            tc.ldmatrix_x4(_ffi.from_buffer(frag), base + at)
            acc ^= frag[0]
        offset += uint32(advance)
    out[cuda.grid(1)] = acc


def shared_tbps(bench: Bench) -> float:
    """Shared-memory bandwidth of the whole GPU, TB/s, as ldmatrix.x4 streams reach it (4
    wavefronts of 128 bytes each, as the kernel's reads of its staged tiles)."""
    blocks, threads, rounds = sm_count() * 8, 256, 128
    out = cuda.device_array(blocks * threads, np.uint32)
    t = bench.time_device(lambda: launch(ldmatrix_stream, blocks, threads)(
        out, 0x1234, rounds, 4096 + 512), reps=10)
    nbytes = blocks * (threads // 32) * rounds * LD_UNROLL * 512
    return nbytes / (t["ms"] * 1e-3) / 1e12


def merge_forms(d_args, sm_scale, workspace, out, bench):
    """The two forms of the mma variant's merge, timed beside each other (``verify_attn``
    picks one by the launch's row blocks, ``FUSED_MERGE_ROW_BLOCKS_PER_SM``): the kernel that
    merges its own splits, and the kernel without that merge followed by the merge kernel
    (``splits._merge_prefix_kernel``). Returns the microseconds of each and of the merge
    kernel alone (its partials read from DRAM: L2 is flushed before each replay)."""
    from ddtree_numba.kernels.verify_attn import splits

    ql, qr, cache, table, prefix, bits, nodes = (K.as_device(a) for a in d_args)
    cache = cache.view(np.uint16)
    part_out, part_lse, arrivals = workspace
    stages = kva._mma_stages(512, 64)
    nbytes = mma.shared_layout(512, 64, stages).total
    args = (ql, qr, cache, table, prefix, bits, nodes, np.float32(sm_scale), part_out,
            part_lse, cache.reshape(cache.size), *out, arrivals)
    bs, N, H = out[1].shape
    grid = (splits.max_prefix_splits(N), -(-N * H // mma.BM), bs)
    capacity = table.shape[1] * cache.shape[1]
    kernels = {}
    for fused in (True, False):
        kernels[fused] = mma.kernel("bfloat16", 512, 64, stages, fused)
        kva.allow_dynamic_shared(kernels[fused], args, nbytes)

    def merge():
        launch(splits._merge_prefix_kernel, (N * H, bs), 128)(
            part_out, part_lse, prefix, nodes, capacity, *out)

    def fused():
        launch(kernels[True], grid, mma.MMA_THREADS, None, nbytes)(*args)

    def two():
        launch(kernels[False], grid, mma.MMA_THREADS, None, nbytes)(*args)
        merge()

    return tuple(bench.time_device(f, reps=5)["ms"] * 1e3 for f in (fused, two, merge))


def main():
    bench = Bench("verify_attn_mma")
    ceiling = mma_ceiling_tflops(bench)
    smem = shared_tbps(bench)
    traffic = mma.shared_traffic(512, 64)
    flops_per_tile = 2 * mma.BM * mma.BN * (512 + 64 + 512)
    copies = traffic["copies in (cp.async, apart)"]
    per_byte = flops_per_tile / (sum(traffic.values()) - copies)     # loads and stores
    roofline = smem * per_byte          # the bound: the pipe must serve the loads and stores
    with_copies = smem * flops_per_tile / sum(traffic.values())     # if copies cost as much
    print(f"mma.sync ceiling {ceiling:.1f} TFLOP/s; shared memory {smem:.1f} TB/s x "
          f"{per_byte:.2f} FLOP/B of the tiling's loads and stores = roofline "
          f"{roofline:.1f} TFLOP/s ({100 * roofline / ceiling:.1f} % of the mma ceiling); "
          f"{with_copies:.1f} if the cp.async copies cost the pipe as stores do", flush=True)
    print("shared-memory bytes per tile:", traffic, flush=True)
    rng = np.random.default_rng(0)
    sm_scale = ref.deepseek_sm_scale()
    configs = [(1, 16, 1024, 128), (1, 64, 8192, 128), (1, 16, 8192, 128),
               (8, 64, 8192, 64), (1, 16, 4096, 8), (1, 16, 4096, 16),
               (8, 64, 8192, 8), (8, 64, 8192, 16), (1, 256, 32768, 128)]
    for bs, N, P, H in configs:
        ql, qr, cache, cache_t, table, prefix, tree = make_problem(rng, bs, N, P, H, "bfloat16")
        T = P + N
        flops = 2 * bs * N * H * T * (512 + 64 + 512)
        d_args = [K.as_device(ql), K.as_device(qr), cache_t, K.as_device(table),
                  K.as_device(prefix), K.as_device(tree.visibility_bits),
                  K.as_device(tree.num_nodes)]
        out = (K.as_device(cp.empty((bs, N, H, 512), cp.float32)),
               K.as_device(cp.empty((bs, N, H), cp.float32)))
        reps = 5 if flops > 2e11 else 20
        ws_mma = K.allocate_workspace(bs, N, H, 512, 0, variant="mma")
        ws_tiled = kva.allocate_workspace(bs, N, H, 512, table.shape[1] * 64)
        row = dict(bs=bs, N=N, prefix=P, H=H)
        for variant, ws in (("mma", ws_mma), ("tiled", ws_tiled)):
            def launch(variant=variant, ws=ws):
                K.verify_attn(*d_args, sm_scale=sm_scale, out=out, workspace=ws,
                              variant=variant, check=False)
            t = bench.time_device(launch, reps=reps)
            row[f"{variant}_us"] = t["ms"] * 1e3
            row[f"{variant}_tflops"] = flops / (t["ms"] * 1e-3) / 1e12
        row["fused_merge_us"], row["two_launch_us"], row["merge_kernel_us"] = merge_forms(
            d_args, sm_scale, ws_mma, out, bench)
        row["pct_of_mma_ceiling"] = 100 * row["mma_tflops"] / ceiling
        row["pct_of_shared_roofline"] = 100 * row["mma_tflops"] / roofline
        if N * H * T * 2 <= 2 << 30:
            slots = np.arange(T)
            pages, offs = table[:, slots // 64], slots % 64
            masks_t = [torch.as_tensor(m).cuda().bfloat16()
                       for m in additive_masks(tree, bs, N, P)]
            rows_t = [cache_t[torch.as_tensor(pages[b]).cuda(), torch.as_tensor(offs).cuda()]
                      for b in range(bs)]
            qlt, qrt = torch.as_tensor(ql).bfloat16(), torch.as_tensor(qr).bfloat16()

            def torch_way():
                for b in range(bs):
                    baseline(TorchOps, qlt[b], qrt[b], rows_t[b], masks_t[b], sm_scale, N, H)

            with torch.cuda.stream(torch.cuda.ExternalStream(bench.stream.ptr)):
                row["torch_bf16_us"] = bench.time_eager_events(torch_way, reps=3)["ms"] * 1e3
            row["speedup_vs_torch"] = row["torch_bf16_us"] / row["mma_us"]
        if bs * N * H * T <= 2**27:                     # float64 reference of request 0
            K.verify_attn(*d_args, sm_scale=sm_scale, out=out, workspace=ws_mma,
                          variant="mma")
            got = out[0].copy_to_host()
            host = [cp.asnumpy(ql[:1]), cp.asnumpy(qr[:1]),
                    cache_t.float().cpu().numpy(), table[:1], prefix[:1],
                    tree.visibility_bits[:1], tree.num_nodes[:1]]
            want, _ = ref.verify_attn(*host, sm_scale=sm_scale)
            row["max_err_over_max_c"] = float(np.abs(got[:1] - want).max()
                                              / np.abs(host[2][..., :512]).max())
        bench.add(**row, mma_ceiling_tflops=ceiling, shared_tbps=smem,
                  shared_roofline_tflops=roofline)
        bench.write_csv()
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    print_table(bench.rows, ["bs", "N", "prefix", "H", "mma_us", "fused_merge_us", "two_launch_us",
                             "merge_kernel_us", "mma_tflops",
                             "pct_of_mma_ceiling", "pct_of_shared_roofline", "tiled_us",
                             "torch_bf16_us", "speedup_vs_torch", "max_err_over_max_c"],
                f"verify_attn (mma, bf16 cache) on {bench.gpu}, {bench.date}; mma.sync "
                f"ceiling {ceiling:.1f} TFLOP/s, shared-memory roofline of the tiling "
                f"{roofline:.1f} TFLOP/s ({smem:.1f} TB/s)")


if __name__ == "__main__":
    main(*sys.argv[1:2])
