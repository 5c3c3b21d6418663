"""Block-wide helpers of kernels._primitives: one tree reduction for every operator."""

import numpy as np
import pytest
from numba import cuda, float32, uint32

from ddtree_numba.kernels._primitives import block_max, block_sum, make_block_reduce

T = 128                     # a block of 128 threads, as device_ops' row kernels launch


def tree_sum(values):
    """The reduction's own order: level by level, red[i] += red[i + half]."""
    red = values.copy()
    half = red.size // 2
    while half:
        red[:half] = red[:half] + red[half : 2 * half]
        half //= 2
    return red[0]


@cuda.jit
def _sum_and_max(values, keys, out_sum, out_max):
    red_f = cuda.shared.array(T, float32)
    red_u = cuda.shared.array(T, uint32)
    tid = cuda.threadIdx.x
    total = block_sum(red_f, values[tid], tid, T)
    top = block_max(red_u, keys[tid], tid, T)
    out_sum[tid] = total                    # every thread gets the result
    out_max[tid] = top


def test_block_sum_and_max_every_thread_gets_the_result():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(T).astype(np.float32)
    keys = rng.integers(0, 2**32, T, dtype=np.uint64).astype(np.uint32)
    out_sum = np.zeros(T, np.float32)
    out_max = np.zeros(T, np.uint32)
    _sum_and_max[1, T](values, keys, out_sum, out_max)
    assert (out_sum == tree_sum(values)).all()      # bit-exact: the order is fixed
    assert (out_max == keys.max()).all()


@cuda.jit(device=True, inline=True)
def _min(a, b):
    return min(a, b)


_block_min = make_block_reduce(_min)


@cuda.jit
def _min_kernel(values, out):
    red = cuda.shared.array(32, float32)
    out[cuda.threadIdx.x] = _block_min(red, values[cuda.threadIdx.x], cuda.threadIdx.x, 32)


@pytest.mark.parametrize("seed", range(2))
def test_make_block_reduce_takes_any_operator(seed):
    values = np.random.default_rng(seed).standard_normal(32).astype(np.float32)
    out = np.zeros(32, np.float32)
    _min_kernel[1, 32](values, out)
    assert (out == values.min()).all()
