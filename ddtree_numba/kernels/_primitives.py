"""Device helpers shared by several kernels: float bits, orderable keys, a warp max.

*Orderable keys.* ``orderable_key(bits)`` maps the bits of a float32 to a uint32 whose unsigned
order is the float order: negative floats have all bits flipped (so a more negative value gets a
smaller key), non-negative floats get the sign bit set (so they sit above every negative).
``-0.0`` is made ``+0.0`` first, so the two compare equal as they do in numpy. Key ``0`` is
below every real float's key (it would be the bits ``0xFFFFFFFF``, a NaN) and serves as "none".

*Warp max.* ``warp_max_u32`` is one ``redux.sync.max.u32`` instruction (sm_80 and later): every
lane of the warp gets the maximum of the 32 values. The shuffle tree it replaces takes five
dependent ``shfl.xor`` + ``max`` steps.

Simulator: the bit casts have numpy versions; the warp max does not exist there (kernels that
need it have a simulator-runnable variant instead).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, uint32

from ._device import SIMULATOR

SIGN = uint32(0x80000000)
ALL_BITS = uint32(0xFFFFFFFF)

if SIMULATOR:

    def bits_to_float(bits):
        return np.array([bits], np.uint32).view(np.float32)[0]

    def float_to_bits(x):
        return np.array([x], np.float32).view(np.uint32)[0]

    def warp_max_u32(value):  # pragma: no cover - never reached under the simulator
        raise NotImplementedError("warp_max_u32 needs a GPU (redux.sync)")

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @cuda.jit(device=True, inline=True)
    def bits_to_float(bits):
        return cuda.libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True, inline=True)
    def float_to_bits(x):
        return uint32(cuda.libdevice.float_as_int(x))

    @intrinsic
    def warp_max_u32(typingctx, value):
        """Max of ``value`` over the full warp, returned to every lane (``redux.sync``)."""
        if value != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]),
                               "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r",
                               side_effect=True)
            return builder.call(asm, args)

        return types.uint32(types.uint32), codegen


@cuda.jit(device=True, inline=True)
def orderable_key(bits):
    """float32 bits -> uint32 key, unsigned order = float order (-0.0 == +0.0)."""
    if bits == SIGN:                        # -0.0 -> +0.0
        bits = uint32(0)
    if bits & SIGN:
        return uint32(~bits & ALL_BITS)     # negative: flip everything
    return uint32(bits | SIGN)              # non-negative: set the sign bit


@cuda.jit(device=True, inline=True)
def bits_of_key(key):
    """Inverse of :func:`orderable_key` (``+0.0`` for the key of ``-0.0``)."""
    if key & SIGN:
        return uint32(key ^ SIGN)
    return uint32(~key & ALL_BITS)


@cuda.jit(device=True, inline=True)
def key_of_float(x):
    return orderable_key(float_to_bits(x))


@cuda.jit(device=True, inline=True)
def float_of_key(key):
    return bits_to_float(bits_of_key(key))
