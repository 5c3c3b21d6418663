"""The dense operations with every matrix product on cuBLAS (through CuPy): the GPU backend of
the DeepSeek-V3 target.

:class:`CublasDenseOps` is :class:`~ddtree_numba.models.dense_ops.KernelDenseOps` (the small
numba kernels for embedding, RMSNorm, RoPE, the cache write, SiLU and the routed sums) with
``linear`` (and ``linear_batched``, the experts of a MoE layer) replaced by one cuBLAS call:
``cublasGemmStridedBatchedEx`` over the groups (heads) of a grouped product or over the experts,
float32 accumulation. Weights are float32, or bfloat16 (``uint16`` bits);
with bfloat16 weights the activations are rounded to bfloat16 first (a numba kernel, into a
scratch buffer), as a bfloat16 model's are, and the product is bf16 x bf16 -> float32 on the
tensor cores. Every call goes to the package's current stream (:func:`kernels.use_stream`),
allocates nothing after the first eager call of each size, and can be captured in the step's
CUDA graph.

Row-major to cuBLAS's column-major: ``out[t, g Dout + o] = sum_k x[t, g Din + k] w[g, k, o]``.
Read column-major, ``w[g]`` (row-major ``[Din, Dout]``) is ``W_g^T [Dout, Din]`` with leading
dimension ``Dout``, and ``x``'s group ``g`` is ``X_g^T [Din, T]`` with leading dimension ``G
Din``; so ``out_g^T [Dout, T] = W_g^T X_g^T`` is a no-transpose product with ``m = Dout``, ``n =
T``, ``k = Din``, ``ldc = G Dout``, batch strides ``Din Dout`` (weights), ``Din`` (inputs) and
``Dout`` (outputs).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..arrays import data_address
from ..kernels._device import launch, launch_stream
from ..kernels._primitives import bfloat16_bits
from .dense_ops import ROW_THREADS, KernelDenseOps

# cudaDataType and cuBLAS enums (library_types.h, cublas_api.h)
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N = 0
CUBLAS_POINTER_MODE_HOST = 0


@cuda.jit
def _round_to_bf16_kernel(x, out):
    """``out[t, c]`` = the bfloat16 bits of ``x[t, c]`` (to nearest, ties to even). One block
    per row."""
    t = cuda.blockIdx.x
    for c in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        out[t, c] = bfloat16_bits(x[t, c])


class CublasDenseOps(KernelDenseOps):
    """:class:`~ddtree_numba.models.dense_ops.KernelDenseOps` with ``linear`` on cuBLAS."""

    name = "cublas"

    def __init__(self):
        import cupy
        try:
            from cupy_backends.cuda.libs import cublas
        except ImportError:                                 # CuPy's older layout
            from cupy.cuda import cublas
        self._cupy, self._cublas = cupy, cublas
        self._one = np.ones(1, np.float32)                  # alpha, beta: host scalars
        self._zero = np.zeros(1, np.float32)
        self._bf16_scratch = {}                             # (T, width) -> uint16 buffer

    def _as_bf16(self, x):
        """``x`` rounded to bfloat16 bits, in a scratch buffer kept per shape (allocated on the
        first, eager, call: a captured graph replays into the same buffer)."""
        key = tuple(x.shape)
        if key not in self._bf16_scratch:
            self._bf16_scratch[key] = cuda.device_array(key, np.uint16)
        out = self._bf16_scratch[key]
        launch(_round_to_bf16_kernel, x.shape[0], ROW_THREADS, launch_stream())(x, out)
        return out

    def _inputs(self, x, w):
        """``(x, cuBLAS data type)``: ``x`` as is for float32 weights, rounded to bfloat16 bits
        for bfloat16 ones."""
        if w.dtype == np.uint16:
            return self._as_bf16(x.reshape(-1, x.shape[-1])), CUDA_R_16BF
        if w.dtype == np.float32:
            return x, CUDA_R_32F
        raise TypeError(f"w: expected float32 or bfloat16 bits (uint16), got {w.dtype}")

    def _gemm(self, m, n, k, w, lda, stride_w, x, data_type, ldb, stride_x, beta, out, ldc,
              stride_out, batch):
        """One ``cublasGemmStridedBatchedEx`` (column-major, no transposes) on the package's
        current stream: ``out_i = w_i x_i (+ out_i)``, float32 accumulation and output."""
        if m == 0 or n == 0 or batch == 0:
            return
        cp, cublas = self._cupy, self._cublas
        stream = int(launch_stream())
        # CuPy's wrappers point cuBLAS at CuPy's current stream: make that ours
        with cp.cuda.ExternalStream(stream) if stream else cp.cuda.Stream.null:
            handle = cp.cuda.device.get_cublas_handle()
            cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
            cublas.gemmStridedBatchedEx(
                handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, self._one.ctypes.data,
                data_address(w), data_type, lda, stride_w,
                data_address(x), data_type, ldb, stride_x,
                beta.ctypes.data, data_address(out), CUDA_R_32F, ldc, stride_out,
                batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)

    def linear(self, x, w, out, residual=None):
        """``out = x @ w (+ residual)``; ``w`` is ``[G, Din, Dout]``, float32 or bfloat16 bits:
        one product per group, batched (strides in the module docstring)."""
        groups, d_in, d_out = w.shape
        x, data_type = self._inputs(x, w)
        beta = self._zero
        if residual is not None:
            if data_address(residual) != data_address(out):
                out.copy_to_device(residual, stream=launch_stream())
            beta = self._one                                # out = x @ w + out
        self._gemm(d_out, x.shape[0], d_in, w, d_out, d_in * d_out, x, data_type,
                   groups * d_in, d_in, beta, out, groups * d_out, d_out, groups)

    def linear_batched(self, x, w, out):
        """``out[e] = x[e] @ w[e]`` for ``w [E, Din, Dout]``, ``out [E, T, Dout]``; a 2-D ``x``
        is shared by every ``e`` (batch stride 0: the experts of a MoE layer on one input)."""
        experts, d_in, d_out = w.shape
        T = out.shape[1]
        shared = x.ndim == 2
        x, data_type = self._inputs(x, w)
        self._gemm(d_out, T, d_in, w, d_out, d_in * d_out, x, data_type, d_in,
                   0 if shared else T * d_in, self._zero, out, d_out, T * d_out, experts)


def build_specs():
    """The rounding kernel (for the build report)."""
    from numba import types

    from ..kernels._specs import KernelSpec

    return [KernelSpec("cublas_ops", "round to bfloat16", _round_to_bf16_kernel,
                       (types.float32[:, ::1], types.uint16[:, ::1]), ROW_THREADS, True)]
