"""What kind of array is this: the one module that looks at host and device arrays.

Every other module asks here instead of testing types, dtype strings or item sizes itself:

* :func:`array_info`: shape, logical dtype, host or device, contiguity, for numpy arrays and any
  CUDA Array Interface array (numba, CuPy, torch) and numba's simulator arrays, without a copy;
* :func:`storage_kind`: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for a cache or logits
  array, whoever allocated it;
* :func:`host_values`: the values as numpy (a device-to-host copy for device arrays);
* :func:`host_view`: the numpy array behind a numpy or simulator array, without a copy;
* :func:`data_address`: where its first element is (to tell views of one buffer apart);
* :func:`array_source`: who made it (``"numpy"``, ``"torch"``, ``"simulator"`` or ``"cuda"``,
  any other CUDA Array Interface array), which is how
  :func:`ddtree_numba.kernels.as_device` picks its conversion.

The host-side bfloat16 dtype comes from ``ml_dtypes`` (:data:`BFLOAT16`).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
INT32 = np.dtype(np.int32)
UINT32 = np.dtype(np.uint32)
FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BOOL = np.dtype(np.bool_)

#: The element types a KV cache may have, by name (``cache_dtype`` options of the models).
CACHE_DTYPES = {"float32": FLOAT32, "bfloat16": BFLOAT16, "float16": FLOAT16}


@dataclass(frozen=True)
class ArrayInfo:
    """Shape and logical dtype of a host or device array, read without copying it."""

    shape: tuple
    dtype: np.dtype
    on_device: bool
    c_contiguous: bool


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch")


def _is_simulator_array(a) -> bool:
    return type(a).__name__ == "FakeCUDAArray"


def array_source(a) -> str:
    """``"numpy"``, ``"torch"`` (a tensor, on either device), ``"simulator"`` (numba's CUDA
    simulator array), ``"cuda"`` (any other CUDA Array Interface array: numba, CuPy) or
    ``"unknown"``."""
    if isinstance(a, np.ndarray):
        return "numpy"
    if _is_torch(a):
        return "torch"
    if _is_simulator_array(a):
        return "simulator"
    if hasattr(a, "__cuda_array_interface__"):
        return "cuda"
    return "unknown"


def _torch_dtype_to_numpy(dtype) -> np.dtype:
    name = str(dtype).replace("torch.", "")
    if name == "bfloat16":
        return BFLOAT16
    if name == "bool":
        return BOOL
    return np.dtype(name)


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(int(extent), 1)
    return tuple(reversed(strides))


def array_info(name: str, a) -> ArrayInfo:
    """Return :class:`ArrayInfo` for ``a`` or raise ``TypeError`` naming ``name``."""
    if isinstance(a, np.ndarray):
        return ArrayInfo(tuple(a.shape), a.dtype, False, bool(a.flags.c_contiguous))
    if _is_torch(a) and hasattr(a, "is_cuda"):
        if not a.is_cuda:
            raise TypeError(f"{name}: expected a numpy array or a CUDA tensor, got a CPU tensor")
        return ArrayInfo(
            tuple(a.shape), _torch_dtype_to_numpy(a.dtype), True, bool(a.is_contiguous())
        )
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        # numba and CuPy arrays carry their numpy dtype; the typestr of a bfloat16 array is
        # "<V2" (raw 2-byte records), which would not say bfloat16
        dtype = a.dtype if isinstance(getattr(a, "dtype", None), np.dtype) else (
            np.dtype(cai["typestr"]))
        strides = cai.get("strides")
        contiguous = strides is None or tuple(strides) == _c_strides(shape, dtype.itemsize)
        return ArrayInfo(shape, dtype, True, contiguous)
    # numba's simulator arrays carry no CUDA array interface but behave like numpy arrays.
    if _is_simulator_array(a):
        host = a._ary                               # the numpy array it wraps (no copy)
        return ArrayInfo(tuple(host.shape), host.dtype, True, bool(host.flags.c_contiguous))
    raise TypeError(
        f"{name}: expected a numpy array or a CUDA device array, got {type(a).__name__}"
    )


def dtype_name(dtype: np.dtype) -> str:
    """``"bfloat16"`` for ml_dtypes' bfloat16, numpy's name otherwise; a byte order other than
    the machine's is spelled out (``"big-endian float32"``: not the float32 a kernel reads)."""
    dtype = np.dtype(dtype)
    name = "bfloat16" if dtype == BFLOAT16 else dtype.name
    if not dtype.isnative:
        name = f"{'big' if dtype.byteorder == '>' else 'little'}-endian {name}"
    return name


def describe(info: ArrayInfo) -> str:
    """``float32[2, 3, 4]``: how error messages show an array."""
    return f"{dtype_name(info.dtype)}[{', '.join(str(s) for s in info.shape)}]"


def storage_kind(a) -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"``: how the elements of ``a`` are stored.

    Works for numpy (ml_dtypes bfloat16), torch (``torch.bfloat16``) and CUDA Array Interface
    arrays; anything else that is not 16-bit counts as ``"float32"`` (the launchers have
    checked the dtype before asking).
    """
    info = array_info("array", a)
    if info.dtype == BFLOAT16:
        return "bfloat16"
    if info.dtype == FLOAT16:
        return "float16"
    return "float32"


def host_values(a) -> np.ndarray:
    """The values of ``a`` as a numpy array (a device-to-host copy for device arrays)."""
    if isinstance(a, np.ndarray):
        return a
    if _is_torch(a):
        import torch

        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).cpu().numpy().view(BFLOAT16)
        return a.cpu().numpy()
    if hasattr(a, "copy_to_host"):
        if getattr(a, "dtype", None) == BFLOAT16 and not _is_simulator_array(a):
            return a.view(np.uint16).copy_to_host().view(BFLOAT16)   # no bf16 buffer protocol
        return a.copy_to_host()
    if hasattr(a, "get"):  # CuPy
        return a.get()
    from numba import cuda

    return cuda.as_cuda_array(a).copy_to_host()


def host_view(a) -> np.ndarray:
    """``a`` itself for a numpy array; the numpy array behind a simulator device array (no
    copy: writes go through). Anything else is a ``TypeError``: this is for the numpy twins
    of device operations, which run in place."""
    if isinstance(a, np.ndarray):
        return a
    if _is_simulator_array(a):
        return a._ary
    raise TypeError(f"expected a numpy array or a CUDA simulator device array, got "
                    f"{type(a).__name__}")


def data_address(a) -> int:
    """The address of ``a``'s first element: from the CUDA Array Interface, or for numpy and
    simulator arrays (whose attributes are the numpy array's) from the array interface."""
    interface = getattr(a, "__cuda_array_interface__", None)
    if interface is None:
        interface = a.__array_interface__
    return interface["data"][0]
