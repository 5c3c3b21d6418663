"""Pick numba's real CUDA target or its CPU simulator *before* numba is imported.

``import ddtree_numba`` calls :func:`choose_backend` (any submodule import goes through the
package ``__init__``), so a program that imports the package before numba runs on the GPU when
a CUDA driver and device are present, else on numba's CUDA simulator. In order of precedence:

1. numba's CUDA target already imported (``numba.cuda`` before ``ddtree_numba``): its choice
   stands; a :class:`BackendWarning` says so when it conflicts with ``DDTREE_BACKEND`` or when it
   is the GPU target and no GPU is present (kernels would fail with ``CudaSupportError``);
2. ``NUMBA_ENABLE_CUDASIM`` set by the user (or by the test suite's ``conftest.py``): numba's own
   switch wins, silently (a warning only if ``DDTREE_BACKEND`` asks for the other one);
3. ``DDTREE_BACKEND=gpu`` or ``simulator``: that one;
4. otherwise (``DDTREE_BACKEND`` unset or ``auto``): the GPU if present, else the simulator.
   The automatic fall-back to the simulator is announced once on stderr
   (:data:`SIMULATOR_NOTICE`) when the library first loads its kernels.

The choice is written to ``NUMBA_ENABLE_CUDASIM``, which child processes inherit.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import warnings

ENV = "DDTREE_BACKEND"
CHOICES = ("gpu", "simulator", "auto")
SIMULATOR_NOTICE = ("ddtree_numba: no CUDA GPU found; using numba's CUDA simulator (slow, tiny "
                    "sizes). Set DDTREE_BACKEND=gpu|simulator to choose.")

#: Python's garbage-collector thresholds while kernels compile (:func:`collect_less_often`);
#: the default is ``(700, 10, 10)``.
COMPILE_GC_THRESHOLDS = (50_000, 10, 5)

_auto_simulator = False         # the simulator was chosen automatically: announce it once
_announced = False


class BackendWarning(RuntimeWarning):
    """numba's CUDA target was fixed before ``ddtree_numba`` could choose it, or conflicts with
    ``DDTREE_BACKEND``."""


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


def requested_backend() -> str:
    """``DDTREE_BACKEND``: ``"gpu"``, ``"simulator"`` or ``"auto"`` (unset or empty)."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}: expected one of {', '.join(CHOICES)}, got "
                         f"{os.environ[ENV]!r}")
    return value


#: The on-disk kernel cache's switch (``kernels._device.CACHE_KERNELS``).
KERNEL_CACHE_ENV = "DDTREE_KERNEL_CACHE"


def kernel_cache_requested(default: bool = False) -> bool:
    """``DDTREE_KERNEL_CACHE``: off when empty, ``0``, ``false``, ``no`` or ``off``, on for any
    other value, ``default`` when unset."""
    value = os.environ.get(KERNEL_CACHE_ENV)
    if value is None:
        return default
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _name(simulate) -> str:
    return "simulator" if simulate else "gpu"


def _numba_cuda_choice():
    """The target ``numba.cuda`` chose when it was imported (``"gpu"``/``"simulator"``), or None
    if it is not imported yet. (numba reads ``NUMBA_ENABLE_CUDASIM`` into ``numba.config`` at
    ``import numba``; ``numba.cuda`` picks its target from that when it is imported.)"""
    if "numba.cuda" not in sys.modules:
        return None
    return "simulator" if "numba.cuda.simulator_init" in sys.modules else "gpu"


def _apply(simulate: bool) -> None:
    """Write the choice where numba reads it: the environment, and numba's config if numba
    (but not numba.cuda) is already imported."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if simulate else "0"
    config = sys.modules.get("numba.core.config")
    if config is not None and hasattr(config, "reload_config"):
        config.reload_config()


def _warn(message: str) -> None:
    warnings.warn(message, BackendWarning, stacklevel=3)


def choose_backend() -> str:
    """Choose the GPU or the simulator (see the module docstring); return ``"gpu"`` or
    ``"simulator"``. Idempotent: a second call returns the first call's choice."""
    global _auto_simulator
    try:
        requested = requested_backend()
    except ValueError as error:
        _warn(f"{error}; choosing automatically")
        requested = "auto"
    fixed = _numba_cuda_choice()
    if fixed is not None:
        if requested != "auto" and requested != fixed:
            _warn(f"{ENV}={requested} has no effect: numba.cuda was imported before "
                  f"ddtree_numba and already chose the {fixed}. Set {ENV} (or "
                  f"NUMBA_ENABLE_CUDASIM) before numba is imported.")
        elif fixed == "gpu" and "NUMBA_ENABLE_CUDASIM" not in os.environ and not gpu_present():
            _warn("numba.cuda was imported before ddtree_numba and chose its GPU target, but "
                  "no CUDA GPU was found: kernels will fail with CudaSupportError. Import "
                  "ddtree_numba before numba, or set DDTREE_BACKEND=simulator (or "
                  "NUMBA_ENABLE_CUDASIM=1) before starting Python.")
        return fixed
    user = os.environ.get("NUMBA_ENABLE_CUDASIM")
    if user is not None and user.strip() != "":
        chosen = _name(user.strip() not in ("0", ""))
        if requested != "auto" and requested != chosen:
            _warn(f"{ENV}={requested} conflicts with NUMBA_ENABLE_CUDASIM={user}; numba's "
                  f"switch wins: using the {chosen}. Unset one of them.")
        return chosen
    if requested == "auto":
        requested = "gpu" if gpu_present() else "simulator"
        _auto_simulator = requested == "simulator"
    _apply(requested == "simulator")
    return requested


def announce_simulator() -> None:
    """Print :data:`SIMULATOR_NOTICE` on stderr, once per process, if the simulator was chosen
    automatically (called when the library loads its kernels on the simulator)."""
    global _announced
    if _auto_simulator and not _announced:
        _announced = True
        print(SIMULATOR_NOTICE, file=sys.stderr)


def collect_less_often() -> None:
    """Let Python's cyclic garbage collector run less often in this process, for compiling.

    numba inlines every device helper into its kernel by copying the helper's IR, and a large
    kernel makes tens of millions of short-lived objects while it compiles (draft_topk's
    one-pass kernel about 20 million). With the default thresholds the collector keeps walking
    the growing heap in full collections. Four of draft_topk's largest kernels compiled one
    after another for sm_120 took 203 s with the default, 155 s with
    :data:`COMPILE_GC_THRESHOLDS`, at the same peak memory (1.6 GB; a 2-core CPU, CPython
    3.11). Fewer full collections are faster still but hold more garbage: ``(100_000, 50,
    100)`` took 145 s and its heap grew with every kernel (1.9 GB). The library calls this
    only in processes of its own (the command line and the build report's workers); the test
    suite and the benchmarks call it too. A program that compiles the kernels can do the same
    with ``gc.set_threshold(50_000, 10, 5)``.
    """
    gc.set_threshold(*COMPILE_GC_THRESHOLDS)
