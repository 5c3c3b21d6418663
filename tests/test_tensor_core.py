"""The fragment model (reference.mma_fragments) and the tensor-core wrappers against it (GPU)."""

import ml_dtypes
import numpy as np
import pytest

from ddtree_numba.reference import mma_fragments as mf

bfloat16 = ml_dtypes.bfloat16


def test_every_element_has_exactly_one_home():
    """A: 16 x 16 in 32 lanes x 4 registers x 2 halves; B: 16 x 8 in 32 x 2 x 2; C: 16 x 8 in
    32 x 4; ldmatrix.x4: 4 matrices of 8 x 8 in 32 x 4 x 2, plain and transposed."""
    def homes(element, regs, halves):
        return [element(lane, r, h) for lane in range(32) for r in range(regs)
                for h in range(halves)]

    assert sorted(homes(mf.a_element, 4, 2)) == [(r, c) for r in range(16) for c in range(16)]
    assert sorted(homes(mf.b_element, 2, 2)) == [(k, n) for k in range(16) for n in range(8)]
    assert sorted(mf.c_element(lane, i) for lane in range(32) for i in range(4)) == [
        (r, c) for r in range(16) for c in range(8)]
    for trans in (False, True):
        found = [mf.ldmatrix_element(lane, r, h, trans) for lane in range(32) for r in range(4)
                 for h in range(2)]
        assert sorted(found) == [(m, r, c) for m in range(4) for r in range(8) for c in range(8)]


def test_accumulators_of_two_tiles_are_the_a_fragment_of_their_union():
    """The C-to-A identity that lets P feed P V from registers."""
    for lane in range(32):
        for reg in range(4):
            side = reg // 2                 # registers 0, 1: the left tile; 2, 3: the right
            index = 2 * (reg % 2)           # values 0, 1 (row g) or 2, 3 (row g + 8)
            for half in range(2):
                row, col = mf.c_element(lane, index + half)
                assert mf.a_element(lane, reg, half) == (row, col + 8 * side), (lane, reg)


def test_model_product_equals_numpy():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16)).astype(bfloat16)
    b = rng.standard_normal((16, 8)).astype(bfloat16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = mf.mma_m16n8k16(mf.pack_a(a.view(np.uint16)), mf.pack_b(b.view(np.uint16)),
                        mf.pack_c(c))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(mf.unpack_c(d), want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------
# The wrappers on the GPU
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def probes():
    pytest.importorskip("cffi")
    from ddtree_numba.kernels import SIMULATOR

    if SIMULATOR:
        pytest.skip("the simulator cannot link CUDA C++")
    import cffi
    from numba import cuda, float32, uint16, uint32

    from ddtree_numba.kernels import tensor_core as tc

    ffi = cffi.FFI()

    @cuda.jit
    def one_mma(a, b, c, use_f16):
        lane = cuda.threadIdx.x
        acc = cuda.local.array(4, float32)
        for k in range(4):
            acc[k] = c[lane, k]
        if use_f16:
            tc.mma_f16_16816(ffi.from_buffer(acc), a[lane, 0], a[lane, 1], a[lane, 2],
                             a[lane, 3], b[lane, 0], b[lane, 1])
        else:
            tc.mma_bf16_16816(ffi.from_buffer(acc), a[lane, 0], a[lane, 1], a[lane, 2],
                              a[lane, 3], b[lane, 0], b[lane, 1])
        for k in range(4):
            c[lane, k] = acc[k]

    @cuda.jit
    def load_matrices(values, regs, trans):
        # four 8 x 8 matrices stored one after another, rows of 8 values (16 bytes)
        lane = cuda.threadIdx.x
        shared = cuda.shared.array(256, uint16)
        for k in range(8):
            shared[8 * lane + k] = values[8 * lane + k]
        cuda.syncthreads()
        frag = cuda.local.array(4, uint32)
        address = tc.shared_address(ffi.from_buffer(shared)) + uint32(16 * lane)  # row l % 8
        if trans:                                                               # of matrix l // 8
            tc.ldmatrix_x4_trans(ffi.from_buffer(frag), address)
        else:
            tc.ldmatrix_x4(ffi.from_buffer(frag), address)
        for k in range(4):
            regs[lane, k] = frag[k]

    @cuda.jit
    def pack_pairs(x, out, use_f16):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = (tc.pack_f16x2(x[2 * i], x[2 * i + 1]) if use_f16
                      else tc.pack_bf16x2(x[2 * i], x[2 * i + 1]))

    return one_mma, load_matrices, pack_pairs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, np.float16])
def test_one_mma_through_the_wrapper_equals_the_model(probes, dtype):
    one_mma = probes[0]
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16)).astype(dtype)
    b = rng.standard_normal((16, 8)).astype(dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a_regs, b_regs = mf.pack_a(a.view(np.uint16)), mf.pack_b(b.view(np.uint16))
    c_vals = mf.pack_c(c)
    got = c_vals.copy()
    one_mma[1, 32](a_regs, b_regs, got, dtype == np.float16)
    name = "float16" if dtype == np.float16 else "bfloat16"
    want = mf.mma_m16n8k16(a_regs, b_regs, c_vals, name)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)       # float32 sums, any order
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(mf.unpack_c(got), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_lanes_match_the_model(probes, trans):
    load_matrices = probes[1]
    values = np.arange(256, dtype=np.uint16)          # matrix m, row r, col c holds 64m+8r+c
    regs = np.zeros((32, 4), np.uint32)
    load_matrices[1, 32](values, regs, trans)
    for lane in range(32):
        for reg in range(4):
            for half in range(2):
                m, r, c = mf.ldmatrix_element(lane, reg, half, trans)
                assert (int(regs[lane, reg]) >> (16 * half)) & 0xFFFF == 64 * m + 8 * r + c


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, np.float16])
def test_pack_rounds_to_nearest_even(probes, dtype):
    pack_pairs = probes[2]
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 100,
                        np.array([1 + 2**-8, 1 + 3 * 2**-9, -0.0, np.inf, 1e-40, 65519.0],
                                 np.float32)])
    out = np.zeros(x.size // 2, np.uint32)
    pack_pairs[(out.size + 127) // 128, 128](x, out, dtype == np.float16)
    want = x.astype(dtype).view(np.uint16)
    np.testing.assert_array_equal((out & 0xFFFF).astype(np.uint16), want[0::2])
    np.testing.assert_array_equal((out >> 16).astype(np.uint16), want[1::2])
