"""Run each fast kernel once at a representative size, for Nsight Compute (ncu) to profile.

    ncu --clock-control none --kernel-name regex:select_warp --launch-count 1 \\
        --section WarpStateStats --section SourceCounters python3 profile_kernels.py
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref


def main():
    rng = np.random.default_rng(0)
    bs, L, Kk, budget = 1, 15, 256, 256
    x = (rng.standard_normal((bs, L, Kk + 16)) * 3).astype(np.float32)
    lp, ids = ref.draft_topk(x, Kk)
    roots = np.zeros(bs, np.int32)
    for _ in range(2):                      # the first call compiles
        tree = K.build_tree(K.as_device(lp), K.as_device(ids), K.as_device(roots), budget)
    cuda.synchronize()
    assert (tree.parents.copy_to_host() == ref.build_tree(lp, ids, roots, budget).parents).all()
    logits = K.as_device((rng.standard_normal((1, 15, 163840)) * 3).astype(np.float32))
    for _ in range(2):
        K.draft_topk(logits, 256)
    cuda.synchronize()




def topk_batch(bf16: bool = False, bs: int = 64, k: int = 256):
    """draft_topk at bs ``bs``, L 15, V 163 840 (ncu: regex:whole_row_kernel; at bs 64 the
    default is the one-pass kernel); ``--bf16``: bfloat16 logits."""
    import torch

    x = torch.randn((bs, 15, 163_840), device="cuda") * 3
    logits = x.to(torch.bfloat16) if bf16 else K.as_device(x)
    for _ in range(2):                      # the first call compiles
        K.draft_topk(logits, k)
    cuda.synchronize()


def attention(bf16: bool = False, N: int = 16, P: int = 1024):
    """One verify_attn launch at bs=1, N=16, prefix 1024, H=128 (ncu: regex:tiled);
    ``--bf16``: the cache stored as bfloat16 (the mma variant: regex:mma_kernel);
    ``--nodes N --prefix P`` another shape."""
    rng = np.random.default_rng(1)
    bs, H = 1, 128
    x = rng.standard_normal((bs, 15, 64)).astype(np.float32) * 3
    lp, ids = ref.draft_topk(x, 8)
    prefix = np.full(bs, P, np.int32)
    tree = ref.build_tree(lp, ids, np.zeros(bs, np.int32), N - 1, prefix_lens=prefix)
    pages = (P + N + 63) // 64
    table = rng.permutation(pages).astype(np.int32).reshape(bs, pages)
    cache = rng.standard_normal((pages, 64, 576)).astype(np.float32)
    if bf16:
        from ddtree_numba.arrays import BFLOAT16

        cache = cache.astype(BFLOAT16)
    ql = rng.standard_normal((bs, N, H, 512)).astype(np.float32)
    qr = rng.standard_normal((bs, N, H, 64)).astype(np.float32)
    args = [K.as_device(a) for a in (ql, qr, cache, table, prefix, tree.visibility_bits,
                                     tree.num_nodes)]
    if bf16:                                # verify_attn takes the bf16 bits as a host array
        args[2] = cache
    for _ in range(2):
        K.verify_attn(*args, sm_scale=ref.deepseek_sm_scale())
    cuda.synchronize()


if __name__ == "__main__":
    import sys

    def option(name, default):
        return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default

    if "--topk-batch" in sys.argv:
        topk_batch("--bf16" in sys.argv, option("--bs", 64), option("--k", 256))
    elif "--attention" in sys.argv:
        attention("--bf16" in sys.argv, option("--nodes", 16), option("--prefix", 1024))
    else:
        main()
