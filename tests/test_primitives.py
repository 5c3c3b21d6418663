"""Block-wide helpers of kernels._primitives: one tree reduction for every operator; the block
scan and the bitonic sort (shared memory on the simulator; warp shuffles on a GPU) with the
block sizes and lengths the kernels call them with. On the simulator the GPU versions run too,
on emulated shuffles (``simulated_warp``)."""

import numpy as np
import pytest
from numba import cuda, float32, int32, uint32, uint64

from ddtree_numba import kernels as K
from ddtree_numba.kernels._primitives import (
    _bitonic_sort_gpu,
    _warp_shuffle_scan_open,
    bitonic_sort_desc,
    block_inclusive_scan_open,
    block_max,
    block_sum,
    make_block_reduce,
)

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


@cuda.jit(device=True, inline="always")
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


SCAN_CAP = 1024
SORT_CAP = 4096


def make_scan_kernel(scan):
    """A kernel that runs the open ``scan`` twice in a row on one row of ``T`` int32 each
    time, its own barrier closing each (scratch is written again right after it)."""

    @cuda.jit
    def scan_kernel(values, inclusive, totals):
        scratch = cuda.shared.array(SCAN_CAP, int32)
        tid = cuda.threadIdx.x
        T = cuda.blockDim.x
        for rep in range(2):
            inc, total = scan(scratch, values[rep, tid], tid, T)
            cuda.syncthreads()
            inclusive[rep, tid] = inc
            totals[rep, tid] = total

    return scan_kernel


def make_sort_kernel(sort):
    """A kernel that sorts ``keys[0:n]`` descending with ``sort`` in shared memory."""

    @cuda.jit
    def sort_kernel(keys, n):
        buffer = cuda.shared.array(SORT_CAP, uint64)
        tid = cuda.threadIdx.x
        for i in range(tid, n, cuda.blockDim.x):
            buffer[i] = keys[i]
        cuda.syncthreads()
        sort(buffer, n, tid, cuda.blockDim.x)
        for i in range(tid, n, cuda.blockDim.x):
            keys[i] = buffer[i]

    return sort_kernel


def check_scan(kernel, T, zeros_from):
    """Two random int32 rows against numpy's cumulative sum (in the second, zeros from
    thread ``zeros_from`` on, as counts of parents with no child); every thread gets the
    total."""
    values = np.random.default_rng(T).integers(-5, 1000, (2, T)).astype(np.int32)
    values[1, zeros_from:] = 0
    inclusive = np.zeros((2, T), np.int32)
    totals = np.zeros((2, T), np.int32)
    kernel[1, T](values, inclusive, totals)
    np.testing.assert_array_equal(inclusive, np.cumsum(values, axis=1))
    np.testing.assert_array_equal(totals, np.repeat(values.sum(1, keepdims=True), T, axis=1))


def check_sort(kernel, n, T):
    """Random uint64 keys with the top bit (the int64 round trip of the shuffles), ties and
    zeros (the kernels' "no key") against numpy's sort."""
    rng = np.random.default_rng(n + T)
    keys = rng.integers(0, 2**64, n, dtype=np.uint64)
    keys[: n // 4] = keys[n // 4: n // 2]
    keys[n - n // 8:] = 0
    want = np.sort(keys)[::-1]
    kernel[1, T](keys, n)
    np.testing.assert_array_equal(keys, want)


_scan_kernel = make_scan_kernel(block_inclusive_scan_open)
_sort_kernel = make_sort_kernel(bitonic_sort_desc)


@pytest.mark.parametrize("T", [32, 64] if K.SIMULATOR else [32, 64, 256, 512, 1024])
def test_block_inclusive_scan_every_block_size(T):
    """The open scan, the caller's barrier closing it."""
    check_scan(_scan_kernel, T, T // 2)


@pytest.mark.parametrize("n,T", [(1, 32), (16, 32), (64, 32)] if K.SIMULATOR else
                         [(1, 32), (16, 32), (32, 32), (64, 32), (128, 32), (256, 32),
                          (8, 512), (256, 512), (512, 512), (1024, 512), (2048, 512),
                          (4096, 512), (1024, 1024), (2048, 1024), (4096, 1024),
                          (128, 1024), (256, 96)])
def test_bitonic_sort_desc_every_length(n, T):
    """Lengths up to the block (registers and shuffles on a GPU), twice the block (two
    registers a thread), up to four times it (four registers) and past it or with a block
    that is not a power of two (shared memory)."""
    check_sort(_sort_kernel, n, T)


# -- the GPU versions on the simulator, through emulated warp shuffles -----------------------

@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated shuffles")
@pytest.mark.parametrize("T", [32, 96])
def test_warp_shuffle_scan_on_emulated_shuffles(T):
    from simulated_warp import emulated_shuffles

    with emulated_shuffles():
        check_scan(make_scan_kernel(_warp_shuffle_scan_open), T, T // 3)
        check_scan(make_scan_kernel(_warp_shuffle_scan_open), T, T // 5)


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated shuffles")
@pytest.mark.parametrize("n,T", [(1, 32), (8, 32), (32, 32), (64, 32), (64, 64), (128, 64),
                                 (256, 64), (512, 64), (128, 96)])
def test_gpu_bitonic_sort_on_emulated_shuffles(n, T):
    """Registers and shuffles up to the block's length (the steps of stride 32 and more through
    shared memory at n = 64), two registers a thread at twice it (128 at T 64: strides of 32
    through shared memory, of T in registers; 64 at T 32: no shared step), four up to four
    times it (256: strides of T and 2 T in registers), the shared-memory network past it or
    where T is not a power of two."""
    from simulated_warp import emulated_shuffles

    with emulated_shuffles():
        check_sort(make_sort_kernel(_bitonic_sort_gpu), n, T)
