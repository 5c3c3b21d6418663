"""What the build report compiles: one :class:`KernelSpec` per kernel specialisation launched.

Each kernel module lists its specialisations in ``build_specs()`` (kernel, argument types,
threads per block, and whether it is a fast path that must not touch local memory), so a new
kernel joins the report, and its test, by being listed there. ``tests/test_build_report.py``
fails for a ``@cuda.jit`` kernel that no module lists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    stage: str            # the public function that launches it
    variant: str          # which kernel / specialisation
    kernel: object        # the numba dispatcher
    signature: tuple      # numba argument types
    threads: int          # threads per block at launch
    fast: bool            # a GPU fast path: no spills and no stack allowed
    cuda_sources: tuple = ()    # CUDA C++ it links (name, text): compiled by NVRTC, LTO
    dynamic_shared: int = 0     # bytes of dynamic shared memory it launches with
