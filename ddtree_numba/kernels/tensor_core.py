"""Tensor-core instructions for numba kernels: declarations of ``tensor_core.cu``'s wrappers.

numba-cuda has no tensor-core intrinsics and no inline PTX. Its foreign-function interface does
the job: ``cuda.declare_device(name, signature, link=cuda.CUSource(source), abi="c")`` makes a
CUDA C++ device function callable from a numba kernel; NVRTC compiles the source when the
kernel is linked, and link-time optimisation inlines the wrapper, leaving its one instruction.
``tensor_core.cu`` (beside this file, the only CUDA C++ in the package) holds the wrappers,
each with its PTX fragment layout in a comment; ``ddtree_numba.reference.mma_fragments`` is
the numpy model of those layouts.

Calling convention in a kernel (GPU only: the simulator cannot link CUDA C++)::

    acc = cuda.local.array(4, float32)          # C and D of one m16n8k16 product
    mma_bf16_16816(ffi.from_buffer(acc), a0, a1, a2, a3, b0, b1)    # acc += A B
    frag = cuda.local.array(4, uint32)
    ldmatrix_x4(ffi.from_buffer(frag), shared_base + byte_offset)   # 4 fragments of 8 x 8

``ffi`` is a ``cffi.FFI()`` (``from_buffer`` hands the local array's address to the wrapper;
once inlined, the array lives in registers). ``shared_base = shared_address(ffi.from_buffer(
shared_array))`` (a ``uint16`` array) is the 32-bit shared-window address that ``ldmatrix``
and ``cp.async`` take.

Requires compute capability 8.0 or newer (``mma.sync`` on bf16, ``cp.async``, ``ldmatrix``
x4): every GPU from A100 on, the H200 (9.0) and the RTX PRO 6000 Blackwell (12.0), where
warp-level ``mma.sync`` is the only tensor-core instruction.
"""

from __future__ import annotations

from importlib import resources

from numba import cuda, types

from ._device import SIMULATOR

#: Compute capability from which the wrappers compile (``mma.sync`` bf16, ``cp.async``).
MIN_CC = (8, 0)

SOURCE_NAME = "tensor_core.cu"


def source() -> str:
    """The CUDA C++ text of the wrappers (``ddtree_numba/kernels/tensor_core.cu``)."""
    return resources.files(__package__).joinpath(SOURCE_NAME).read_text()


_U32, _F32, _U16_POINTER = types.uint32, types.float32, types.CPointer(types.uint16)
_MMA = types.void(types.CPointer(_F32), _U32, _U32, _U32, _U32, _U32, _U32)
_LDMATRIX = types.void(types.CPointer(_U32), _U32)
_LINK = None if SIMULATOR else cuda.CUSource(source(), name=SOURCE_NAME)   # one source, linked once


def _declare(name, signature):
    """The wrapper ``name`` of ``tensor_core.cu`` as a numba device function (None on the
    simulator, which cannot link CUDA C++: kernels that use these are GPU-only)."""
    if SIMULATOR:
        return None
    return cuda.declare_device(name, signature, link=_LINK, abi="c")


mma_bf16_16816 = _declare("mma_bf16_16816", _MMA)
mma_f16_16816 = _declare("mma_f16_16816", _MMA)
ldmatrix_x4 = _declare("ldmatrix_x4", _LDMATRIX)
ldmatrix_x4_trans = _declare("ldmatrix_x4_trans", _LDMATRIX)
shared_address = _declare("shared_address", _U32(_U16_POINTER))
cp_async_16 = _declare("cp_async_16", types.void(_U32, _U16_POINTER, types.uint64, _U32))
cp_async_commit = _declare("cp_async_commit", types.void())
cp_async_wait_all = _declare("cp_async_wait_all", types.void())
cp_async_wait_pending = _declare("cp_async_wait_pending", types.void(_U32))
pack_bf16x2 = _declare("pack_bf16x2", _U32(_F32, _F32))
pack_f16x2 = _declare("pack_f16x2", _U32(_F32, _F32))
