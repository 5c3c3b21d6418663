"""Numpy model of the tensor-core fragments: which lane and register hold which element.

One warp-level ``mma.sync.m16n8k16`` multiplies a 16 x 16 tile ``A`` by a 16 x 8 tile ``B`` and
adds a 16 x 8 float32 tile ``C``. No thread holds a whole tile: each of the 32 lanes holds a
fixed *fragment* of each operand, in 32-bit registers of two 16-bit values (the lower column or
k index in the low half). With ``g = lane // 4`` (0..7) and ``t = lane % 4`` (0..3)
(PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type")::

    A (row-major, 4 registers)    a0 = A[g, 2t:2t+2]     a1 = A[g+8, 2t:2t+2]
                                  a2 = A[g, 2t+8:2t+10]  a3 = A[g+8, 2t+8:2t+10]
    B (k x n, 2 registers)        b0 = B[2t:2t+2, g]     b1 = B[2t+8:2t+10, g]
    C, D (float32, 4 values)      c0, c1 = C[g, 2t:2t+2] c2, c3 = C[g+8, 2t:2t+2]

``ldmatrix.x4`` fills such registers from shared memory: lane ``l`` gives the address of row
``l % 8`` of 8 x 8 matrix ``l // 8``; register ``j`` of lane ``4 g + t`` then holds row ``g``,
columns ``2t, 2t+1`` of matrix ``j`` (``.trans``: rows ``2t, 2t+1`` of column ``g``).

This module is the reference for those maps: the index functions below are the definition,
:func:`mma_m16n8k16` multiplies through them, and the tests check the GPU's registers (through
``kernels/tensor_core.cu``) against them. The docs' lane-map figures are drawn from here.
Note the identity FlashAttention relies on: the ``C`` fragment of two adjacent 16 x 8 tiles,
rounded to 16 bits and packed in pairs, *is* the ``A`` fragment of the 16 x 16 tile they form,
so a softmax output feeds the next product without leaving registers (:func:`c_to_a`).
"""

from __future__ import annotations

import numpy as np

LANES = 32


def a_element(lane: int, reg: int, half: int) -> tuple:
    """``(row, col)`` of ``A`` (16 x 16) in half ``half`` (0 low, 1 high) of register
    ``reg`` (0..3) of ``lane``."""
    g, t = divmod(lane, 4)
    return g + 8 * (reg % 2), 2 * t + half + 8 * (reg // 2)


def b_element(lane: int, reg: int, half: int) -> tuple:
    """``(k, n)`` of ``B`` (16 x 8) in half ``half`` of register ``reg`` (0..1) of ``lane``."""
    g, t = divmod(lane, 4)
    return 2 * t + half + 8 * reg, g


def c_element(lane: int, index: int) -> tuple:
    """``(row, col)`` of ``C`` / ``D`` (16 x 8, float32) in value ``index`` (0..3) of ``lane``."""
    g, t = divmod(lane, 4)
    return g + 8 * (index // 2), 2 * t + index % 2


def ldmatrix_element(lane: int, reg: int, half: int, trans: bool = False) -> tuple:
    """``(matrix, row, col)`` of the four 8 x 8 matrices read by ``ldmatrix.x4`` that land in
    half ``half`` of register ``reg`` (= matrix) of ``lane``; ``trans``: ``.trans``."""
    g, t = divmod(lane, 4)
    if trans:
        return reg, 2 * t + half, g
    return reg, g, 2 * t + half


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Pack 16-bit patterns in pairs: ``lo`` in the low half of each uint32."""
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << np.uint32(16))


def _pack_registers(bits: np.ndarray, element, regs: int) -> np.ndarray:
    """``uint32[32, regs]``: each lane's registers, ``element(lane, reg, half)`` naming the
    16-bit pattern of ``bits`` in each half."""
    out = np.zeros((LANES, regs), np.uint32)
    for lane in range(LANES):
        for reg in range(regs):
            lo, hi = (bits[element(lane, reg, half)] for half in (0, 1))
            out[lane, reg] = _pack(np.uint16(lo), np.uint16(hi))
    return out


def pack_a(a_bits: np.ndarray) -> np.ndarray:
    """``uint32[32, 4]``: every lane's ``A`` registers from ``A`` as 16-bit patterns [16, 16]."""
    return _pack_registers(a_bits, a_element, 4)


def pack_b(b_bits: np.ndarray) -> np.ndarray:
    """``uint32[32, 2]``: every lane's ``B`` registers from ``B`` as 16-bit patterns [16, 8]."""
    return _pack_registers(b_bits, b_element, 2)


def pack_c(c: np.ndarray) -> np.ndarray:
    """``float32[32, 4]``: every lane's accumulator values from ``C`` [16, 8]."""
    return np.array([[c[c_element(lane, i)] for i in range(4)] for lane in range(LANES)],
                    np.float32)


def unpack_c(values: np.ndarray) -> np.ndarray:
    """``C`` [16, 8] from every lane's 4 accumulator values ``[32, 4]``."""
    c = np.zeros((16, 8), values.dtype)
    for lane in range(LANES):
        for i in range(4):
            c[c_element(lane, i)] = values[lane, i]
    return c


def c_to_a(c_left: np.ndarray, c_right: np.ndarray) -> list:
    """Which accumulator values of two adjacent 16 x 8 tiles (``[32, 4]`` each, columns 0-7
    and 8-15) form each ``A`` register of the 16 x 16 tile: per lane ``[(lo, hi)] * 4``.

    ``a0 = (c_left[0], c_left[1])``, ``a1 = (c_left[2], c_left[3])``,
    ``a2 = (c_right[0], c_right[1])``, ``a3 = (c_right[2], c_right[3])``: the registers never
    cross lanes, which is why a softmax can feed ``P V`` straight from its accumulators.
    """
    return [[(c_left[lane, 0], c_left[lane, 1]), (c_left[lane, 2], c_left[lane, 3]),
             (c_right[lane, 0], c_right[lane, 1]), (c_right[lane, 2], c_right[lane, 3])]
            for lane in range(LANES)]


def _unpack_values(regs: np.ndarray, element, shape, to_float) -> np.ndarray:
    out = np.zeros(shape, np.float64)
    for lane in range(LANES):
        for reg in range(regs.shape[1]):
            word = int(regs[lane, reg])
            for half in (0, 1):
                out[element(lane, reg, half)] = to_float((word >> (16 * half)) & 0xFFFF)
    return out


def mma_m16n8k16(a_regs: np.ndarray, b_regs: np.ndarray, c_values: np.ndarray,
                 dtype: str = "bfloat16") -> np.ndarray:
    """What the warp's accumulators hold after one ``mma.sync.m16n8k16`` (float32 ``[32, 4]``).

    The operands are every lane's registers (``pack_a``, ``pack_b``, ``pack_c``); the product is
    formed in float64 from the 16-bit values and rounded once to float32 (the hardware adds in
    float32 in an order of its own: agreement is to float32 rounding, not to the bit).
    """
    import ml_dtypes

    storage = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16

    def to_float(bits):
        return float(np.array([bits], np.uint16).view(storage)[0])

    a = _unpack_values(a_regs, a_element, (16, 16), to_float)
    b = _unpack_values(b_regs, b_element, (16, 8), to_float)
    c = unpack_c(c_values.astype(np.float64))
    return pack_c((a @ b + c).astype(np.float32))
