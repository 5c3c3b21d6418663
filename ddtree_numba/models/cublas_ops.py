"""The dense operations with every matrix product on cuBLAS: the GPU backend of the DeepSeek-V3
target.

:class:`CublasDenseOps` is :class:`~ddtree_numba.models.dense_ops.KernelDenseOps` (the small
numba kernels for embedding, RMSNorm, RoPE, the cache write, SiLU and the routed sums) with
``linear`` (and ``linear_batched``, every expert of a MoE layer) replaced by one cuBLAS call:
``cublasGemmStridedBatchedEx`` over the groups (heads) of a grouped product or over the experts,
float32 accumulation; and ``linear_gathered`` (each token's chosen experts only) by one
``cublasGemmBatchedEx``, whose arrays of matrix addresses a small kernel writes on the device
from the router's choice, so that the call's shape stays fixed while the experts it reads change
from step to step (a CUDA graph replays it as it is). Weights are float32, or bfloat16
(``uint16`` bits); with bfloat16 weights the activations are rounded to bfloat16 first (a
numba kernel, into a scratch buffer), as a bfloat16 model's are, and the product is bf16 x bf16
-> float32 on the tensor cores. Every call goes to the package's current stream
(``kernels.use_stream``), allocates nothing after the first eager call of each size, and can
be captured in the step's CUDA graph.

Row-major to cuBLAS's column-major: ``out[t, g Dout + o] = sum_k x[t, g Din + k] w[g, k, o]``.
Read column-major, ``w[g]`` (row-major ``[Din, Dout]``) is ``W_g^T [Dout, Din]`` with leading
dimension ``Dout``, and ``x``'s group ``g`` is ``X_g^T [Din, T]`` with leading dimension ``G
Din``; so ``out_g^T [Dout, T] = W_g^T X_g^T`` is a no-transpose product with ``m = Dout``, ``n =
T``, ``k = Din``, ``ldc = G Dout``, batch strides ``Din Dout`` (weights), ``Din`` (inputs) and
``Dout`` (outputs).
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import numpy as np
from numba import cuda, uint64

from ..arrays import data_address
from ..kernels._device import CACHE_KERNELS, launch, launch_stream
from ..kernels._primitives import bfloat16_bits
from .dense_ops import ROW_THREADS, KernelDenseOps

# cudaDataType and cuBLAS enums (library_types.h, cublas_api.h)
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N = 0
CUBLAS_POINTER_MODE_HOST = 0
WORKSPACE_BYTES = 32 << 20      # cuBLAS's workspace, ours: nothing allocated during a capture


@functools.cache
def _cublas():
    """libcublas through ctypes, found by ``cuda.pathfinder`` (the ``nvidia-cublas`` wheel of
    the ``gpu`` extra, or the system's). Not CuPy's wrappers: they refuse to call cuBLAS while
    a stream is being captured, which is how the step becomes one CUDA graph."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    # pathfinder has opened the library: wrap its handle (the path is None when the system's
    # loader found it by name)
    loaded = load_nvidia_dynamic_lib("cublas")
    lib = ctypes.CDLL(loaded.abs_path or "libcublas.so", handle=loaded._handle_uint)
    i32, i64, p = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    signatures = {
        "cublasCreate_v2": [ctypes.POINTER(p)],
        "cublasDestroy_v2": [p],
        "cublasSetPointerMode_v2": [p, i32],
        "cublasSetWorkspace_v2": [p, p, ctypes.c_size_t],
        "cublasSetStream_v2": [p, p],
        "cublasGemmStridedBatchedEx": [p, i32, i32, i32, i32, i32,      # handle, ops, m n k
                                       p, p, i32, i32, i64,              # alpha, A, type, ld, s
                                       p, i32, i32, i64,                 # B, type, ld, stride
                                       p, p, i32, i32, i64,              # beta, C, ...
                                       i32, i32, i32],                   # batch, compute, algo
        "cublasGemmBatchedEx": [p, i32, i32, i32, i32, i32,             # handle, ops, m n k
                                p, p, i32, i32,                          # alpha, A[], type, ld
                                p, i32, i32,                             # B[], type, ld
                                p, p, i32, i32,                          # beta, C[], type, ld
                                i32, i32, i32],                          # batch, compute, algo
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, i32
    return lib


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: cuBLAS status {status}")


@cuda.jit(cache=CACHE_KERNELS)
def _round_to_bf16_kernel(x, out):
    """``out[t, c]`` = the bfloat16 bits of ``x[t, c]`` (to nearest, ties to even). One block
    per row."""
    t = cuda.blockIdx.x
    for c in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        out[t, c] = bfloat16_bits(x[t, c])


ADDRESS_THREADS = 128     # _pair_addresses_kernel: one thread per (token, expert) pair


@cuda.jit(cache=CACHE_KERNELS)
def _pair_addresses_kernel(experts, w_base, w_bytes, x_base, x_bytes, x_per_pair, out_base,
                           out_bytes, addresses):
    """The three address arrays of ``linear_gathered``'s batched product, one entry per pair
    ``p = t k + s`` (one thread each)::

        addresses[0, p] = w_base   + experts[t, s] * w_bytes      the expert's [Din, Dout] matrix
        addresses[1, p] = x_base   + (p or t)      * x_bytes      the input row
        addresses[2, p] = out_base + p             * out_bytes    the output row
    """
    p = cuda.grid(1)
    k = experts.shape[1]
    if p >= experts.shape[0] * k:
        return
    row = p if x_per_pair else p // k
    addresses[0, p] = w_base + uint64(experts[p // k, p % k]) * w_bytes
    addresses[1, p] = x_base + uint64(row) * x_bytes
    addresses[2, p] = out_base + uint64(p) * out_bytes


class CublasDenseOps(KernelDenseOps):
    """:class:`~ddtree_numba.models.dense_ops.KernelDenseOps` with ``linear`` on cuBLAS."""

    name = "cublas"

    def __init__(self):
        cuda.current_context()                          # cuBLAS joins numba's (primary) context
        self._lib = lib = _cublas()
        self._handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(self._handle)), "cublasCreate")
        weakref.finalize(self, lib.cublasDestroy_v2, self._handle)
        _check(lib.cublasSetPointerMode_v2(self._handle, CUBLAS_POINTER_MODE_HOST),
               "cublasSetPointerMode")
        self._workspace = cuda.device_array(WORKSPACE_BYTES, np.uint8)   # set with the stream
        self._one = np.ones(1, np.float32)                  # alpha, beta: host scalars, read
        self._zero = np.zeros(1, np.float32)                # when a call is made or captured
        # (T, width) -> uint16 buffer. One per shape: graphs of the same shape share it, so
        # they must replay one after another on one stream (as a step's do)
        self._bf16_scratch = {}
        self._addresses = {}                # pairs -> uint64[3, pairs], likewise shared
        self._stream_handle = -1            # the stream the handle is set to (-1: none yet)

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

    def _set_stream(self):
        """Point the handle at the package's current stream (0: the legacy default stream,
        NULL for cuBLAS) when it changed. cublasSetStream also resets the handle's workspace
        to cuBLAS's own pool, so ours is set again after it."""
        stream = launch_stream()
        handle = int(stream) if stream != 0 else None
        if handle == self._stream_handle:
            return
        _check(self._lib.cublasSetStream_v2(self._handle, handle), "cublasSetStream")
        _check(self._lib.cublasSetWorkspace_v2(self._handle, data_address(self._workspace),
                                               WORKSPACE_BYTES), "cublasSetWorkspace")
        self._stream_handle = handle

    def _gemm(self, m, n, k, w, lda, stride_w, x, data_type, ldb, stride_x, beta, out, ldc,
              stride_out, batch):
        """One ``cublasGemmStridedBatchedEx`` (column-major, no transposes) on the package's
        current stream: ``out_i = w_i x_i (+ out_i)``, float32 accumulation and output."""
        if m == 0 or n == 0 or batch == 0:
            return
        self._set_stream()
        _check(self._lib.cublasGemmStridedBatchedEx(
            self._handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, self._one.ctypes.data,
            data_address(w), data_type, lda, stride_w,
            data_address(x), data_type, ldb, stride_x,
            beta.ctypes.data, data_address(out), CUDA_R_32F, ldc, stride_out,
            batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmStridedBatchedEx")

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

    def linear_gathered(self, x, w, experts, out):
        """``out[t k + s] = x_row @ w[experts[t, s]]`` for ``w [E, Din, Dout]``, ``experts
        int32[T, k]``, ``out float32[T k, Dout]``; ``x`` is ``[T, Din]`` (a token's row for
        each of its pairs) or ``[T k, Din]``. One ``cublasGemmBatchedEx`` of ``T k``
        matrix-vector products (column-major: ``out_p^T [Dout, 1] = W_e^T [Dout, Din] x^T
        [Din, 1]``), reading only the chosen experts' weights."""
        _, d_in, d_out = w.shape
        pairs = out.shape[0]
        if pairs == 0 or d_out == 0:
            return
        per_pair = x.shape[0] == pairs
        x, data_type = self._inputs(x, w)
        if pairs not in self._addresses:
            self._addresses[pairs] = cuda.device_array((3, pairs), np.uint64)
        addresses = self._addresses[pairs]
        # a matrix's and a row's bytes: the leading strides (every operand is C-contiguous)
        launch(_pair_addresses_kernel, (pairs + ADDRESS_THREADS - 1) // ADDRESS_THREADS,
               ADDRESS_THREADS, launch_stream())(
            experts, np.uint64(data_address(w)), np.uint64(w.strides[0]),
            np.uint64(data_address(x)), np.uint64(x.strides[0]), per_pair,
            np.uint64(data_address(out)), np.uint64(out.strides[0]), addresses)
        base = data_address(addresses)
        self._set_stream()
        _check(self._lib.cublasGemmBatchedEx(
            self._handle, CUBLAS_OP_N, CUBLAS_OP_N, d_out, 1, d_in, self._one.ctypes.data,
            base, data_type, d_out, base + 8 * pairs, data_type, d_in,
            self._zero.ctypes.data, base + 16 * pairs, CUDA_R_32F, d_out,
            pairs, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmBatchedEx")


def build_specs():
    """The rounding and address kernels (for the build report)."""
    from numba import types

    from ..kernels._specs import KernelSpec

    u8 = types.uint64
    return [KernelSpec("cublas_ops", "round to bfloat16", _round_to_bf16_kernel,
                       (types.float32[:, ::1], types.uint16[:, ::1]), ROW_THREADS, True),
            KernelSpec("cublas_ops", "pair addresses", _pair_addresses_kernel,
                       (types.int32[:, ::1], u8, u8, u8, u8, types.boolean, u8, u8,
                        types.uint64[:, ::1]), ADDRESS_THREADS, True)]
