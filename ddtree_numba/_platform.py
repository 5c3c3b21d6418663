"""Pick numba's real CUDA target or its CPU simulator *before* numba is imported."""

from __future__ import annotations

import ctypes
import os


def gpu_present() -> bool:
    """True when the CUDA driver loads and reports at least one device."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0


def choose_backend() -> str:
    """Set ``NUMBA_ENABLE_CUDASIM`` when the user did not: the GPU if present, else simulate.

    Returns ``"gpu"`` or ``"simulator"``. Has effect only before numba is first imported.
    """
    if "NUMBA_ENABLE_CUDASIM" not in os.environ:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if gpu_present() else "1"
    return "simulator" if os.environ["NUMBA_ENABLE_CUDASIM"] == "1" else "gpu"
