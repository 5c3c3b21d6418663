"""Device helpers both variants of ``verify_attn`` use: the mask bit and the element widening."""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32

from .._primitives import bits_to_float

NEG_INF = float32(-np.inf)


def _make_widen(kind: str):
    """Device function turning one stored cache element into float32, per storage type
    (bfloat16 arrives as its uint16 bits)."""
    if kind == "bfloat16":

        @cuda.jit(device=True, inline=True)
        def widen(raw):
            return bits_to_float(uint32(raw) << uint32(16))

    else:  # float32 and float16 (numba widens float16 with float32())

        @cuda.jit(device=True, inline=True)
        def widen(raw):
            return float32(raw)

    return widen


@cuda.jit(device=True, inline=True)
def _visible(bits, b, i, j):
    """Bit ``j`` of row ``i`` of the packed ancestor mask."""
    return (bits[b, i, j // 32] >> uint32(j % 32)) & uint32(1) != 0
