"""The uniforms of a sampled step on the GPU: ``kernels.sample_uniforms``, bit-exact to the
reference (``reference.sample_uniforms``: Philox4x32-10, its keys and counters).

One thread per uniform: grid ``ceil(bs (N + 1) / 128)`` blocks of 128 threads; thread ``t``
computes, for request ``b = t // (N + 1)`` and ``i = t % (N + 1)``, node ``i``'s uniform
(``i < N``, into ``uniforms[b, i]``) or the bonus uniform (``i = N``, into ``bonus[b]``). Ten
Philox rounds are ~40 integer instructions: the launch costs what any tiny launch costs.

numba types arithmetic on ``uint32`` scalars as 64-bit, so the words are held in ``uint64``
and masked to 32 bits after each product and sum; every constant is a ``numpy.uint64`` (a
plain Python int would be typed int64, and numba turns ``uint64 op int64`` into float64).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from ..reference.sample_uniforms import (
    PHILOX_M0,
    PHILOX_M1,
    PHILOX_ROUNDS,
    PHILOX_W0,
    PHILOX_W1,
    STREAM_BONUS,
    STREAM_NODE,
)
from ..validation import check_sample_uniforms, require_array
from ._device import CACHE_KERNELS, as_device, device_empty, launch, launch_stream

UNIFORM_THREADS = 128
_M0, _M1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
_W0, _W1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
_MASK, _SHIFT32, _SHIFT8 = np.uint64(0xFFFFFFFF), np.uint64(32), np.uint64(8)
_NODE, _BONUS, _ZERO = np.uint64(STREAM_NODE), np.uint64(STREAM_BONUS), np.uint64(0)
_UNIT = float32(2.0**-24)


@cuda.jit(device=True, inline="always")
def philox_uniform(c0, c1, c2, c3, k0, k1):
    """Word 0 of Philox4x32-10 of counter ``(c0, c1, c2, c3)`` under key ``(k0, k1)`` (32-bit
    values in uint64), as a float32 uniform in ``[0, 1)``: its top 24 bits times 2^-24."""
    for r in range(PHILOX_ROUNDS):
        if r > 0:                               # the key schedule: bumped between rounds
            k0 = (k0 + _W0) & _MASK
            k1 = (k1 + _W1) & _MASK
        p0 = _M0 * c0                           # 32 x 32 -> 64-bit products
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _MASK,
                          (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _MASK)
    return float32(c0 >> _SHIFT8) * _UNIT


@cuda.jit(cache=CACHE_KERNELS)
def _uniforms_kernel(prefix_lens, key0, key1, uniforms, bonus):
    t = cuda.grid(1)
    bs, N = uniforms.shape
    if t >= bs * (N + 1):
        return
    b, i = t // (N + 1), t % (N + 1)
    request = np.uint64(b)
    position = np.uint64(prefix_lens[b]) & _MASK    # the int32's bits, as the reference
    if i < N:
        uniforms[b, i] = philox_uniform(np.uint64(i), request, position, _NODE, key0, key1)
    else:
        bonus[b] = philox_uniform(_ZERO, request, position, _BONUS, key0, key1)


def allocate_uniforms(bs: int, N: int) -> tuple:
    """Device buffers for :func:`sample_uniforms`'s ``out=`` (``float32[bs, N]``,
    ``float32[bs]``): allocate them once when the step is captured in a CUDA graph."""
    return device_empty((bs, N), np.float32), device_empty((bs,), np.float32)


def sample_uniforms(seed, prefix_lens, N: int, *, check=None, out=None) -> tuple:
    """The uniforms of one sampled step on the GPU (one launch, no synchronisation).

    Parameters
    ----------
    seed, prefix_lens, N
        As in :func:`ddtree_numba.reference.sample_uniforms`; ``prefix_lens`` may be a device
        array (the step passes its own, so a captured graph draws new uniforms each replay).
    check : bool, optional
        Value checks (``prefix_lens >= 0``); default: on for numpy inputs only.
    out : tuple, optional
        ``(uniforms, bonus)`` from :func:`allocate_uniforms`.

    Returns
    -------
    tuple
        Two device arrays, ``float32[bs, N]`` and ``float32[bs]``, bit-exact to the reference.
    """
    sz = check_sample_uniforms(seed, prefix_lens, N, check=check)
    if out is None:
        out = allocate_uniforms(sz.bs, sz.N)
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"out: expected a tuple (uniforms, bonus) from allocate_uniforms, got "
                        f"{type(out).__name__}")
    uniforms, bonus = out
    sizes = {"bs": sz.bs, "N": sz.N}
    require_array("out[0]", uniforms, (np.float32,), ("bs", "N"), sizes)
    require_array("out[1]", bonus, (np.float32,), ("bs",), sizes)
    threads = sz.bs * (sz.N + 1)
    if threads:
        launch(_uniforms_kernel, math.ceil(threads / UNIFORM_THREADS), UNIFORM_THREADS,
               launch_stream())(as_device(prefix_lens), np.uint64(sz.seed & 0xFFFFFFFF),
                                np.uint64(sz.seed >> 32), uniforms, bonus)
    return uniforms, bonus


def build_specs():
    """Specialisations launched by :func:`sample_uniforms` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    sig = (types.int32[::1], types.uint64, types.uint64, types.float32[:, ::1],
           types.float32[::1])
    return [KernelSpec("sample_uniforms", "philox", _uniforms_kernel, sig, UNIFORM_THREADS,
                       True)]
