"""Variant ``"readable"`` of ``kernels.verify_attn``: one thread per query row, one idea per step.

Runs on the simulator (the CPU test suite's variant) and on the GPU, where it is the
definition the tiled variant is checked against at sizes too large for the float64 reference.

Launch: a 1-D grid of ``ceil(bs N H / 32)`` blocks of ``READABLE_THREADS = 32`` threads; thread
``row = (b N + i) H + h`` owns query row ``(b, i, h)``. No shared memory, no barrier, no warp
intrinsic: threads never talk to each other.

What a thread touches:

* reads ``num_nodes[b]``, ``prefix_lens[b]``; a padding row (``i >= num_nodes[b]``) then writes
  ``Dc`` zeros to ``out[b, i, h]`` and ``-inf`` to ``lse[b, i, h]`` and stops;
* for each slot ``t < P + num_nodes[b]``: 1. mask: tree slot ``P + j`` only if bit ``j`` of
  ``visibility_bits[b, i]`` (one word read); an invisible slot is skipped before anything else
  is read, so neither its block-table entry nor its cache row is ever touched (they may hold
  anything); 2. score: ``block_table[b, t // page_size]``, then the 576-wide dot product of
  ``q_latent[b, i, h] | q_rope[b, i, h]`` with the cache row; 3. online softmax: rescale the
  running sum and output when the max grows; 4. weighted sum: the slot's 512 latent values are
  read again and accumulated into ``out[b, i, h]`` in place (global memory is the accumulator);
* finally divides ``out[b, i, h]`` by the sum and writes ``lse[b, i, h]``.

Every cache row is read once per query row (``N H`` times per request; the tiled variant reads it
once per 32 rows). bfloat16 caches are read as their ``uint16`` bits and widened with a shift.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32

from .._device import CACHE_KERNELS
from .._primitives import bits_to_float

READABLE_THREADS = 32
# The two device helpers below are the tiled variant's too (it imports them from here). They
# live in this module, beside the kernel that calls them, also for numba's CUDA simulator: it
# swaps each module's ``cuda`` global on every call into a module no running thread is in,
# which made calls from here into a separate helpers module 9x slower to simulate.
NEG_INF = float32(-np.inf)


def _make_widen(kind: str):
    """Device function turning one stored cache element into float32, per storage type
    (bfloat16 arrives as its uint16 bits)."""
    if kind == "bfloat16":

        @cuda.jit(device=True, inline="always")
        def widen(raw):
            return bits_to_float(uint32(raw) << uint32(16))

    else:  # float32 and float16 (numba widens float16 with float32())

        @cuda.jit(device=True, inline="always")
        def widen(raw):
            return float32(raw)

    return widen


@cuda.jit(device=True, inline="always")
def _visible(bits, b, i, j):
    """Bit ``j`` of row ``i`` of the packed ancestor mask."""
    return (bits[b, i, j // 32] >> uint32(j % 32)) & uint32(1) != 0



def _make_readable_kernel(kind: str):
    widen = _make_widen(kind)

    @cuda.jit(cache=CACHE_KERNELS)
    def readable_kernel(q_latent, q_rope, cache, block_table, prefix_lens, bits, num_nodes,
                        sm_scale, out, lse):
        # one thread per query row: row = (b * N + i) * H + h
        row = cuda.grid(1)
        bs, N, H, Dc = q_latent.shape
        Dr = q_rope.shape[3]
        if row >= bs * N * H:
            return
        h = row % H
        i = (row // H) % N
        b = row // (H * N)
        page_size = cache.shape[1]
        o = out[b, i, h]                        # [Dc]: this thread's output row
        for d in range(Dc):
            o[d] = 0.0
        n = num_nodes[b]
        if i >= n:                              # padding row: out 0, lse -inf
            lse[b, i, h] = NEG_INF
            return
        P = prefix_lens[b]
        m = NEG_INF                             # running max of the scores
        l = float32(0.0)                        # running sum of exp(score - m)
        for t in range(P + n):
            # 1. mask: prefix slots always, tree slot P + j only if j is an ancestor of i
            if t >= P and not _visible(bits, b, i, t - P):
                continue
            page = block_table[b, t // page_size]
            slot = t % page_size
            # 2. score: latent part and rope part of the 576-wide row
            s = float32(0.0)
            for d in range(Dc):
                s += q_latent[b, i, h, d] * widen(cache[page, slot, d])
            for d in range(Dr):
                s += q_rope[b, i, h, d] * widen(cache[page, slot, Dc + d])
            s *= sm_scale
            # 3. online softmax: a larger max rescales what was accumulated so far
            m_new = max(m, s)
            rescale = math.exp(m - m_new) if m > NEG_INF else float32(0.0)
            p = math.exp(s - m_new)
            l = l * rescale + p
            m = m_new
            # 4. weighted sum of this slot's latent row (the output stays in latent space)
            for d in range(Dc):
                o[d] = o[d] * rescale + p * widen(cache[page, slot, d])
        for d in range(Dc):
            o[d] /= l
        lse[b, i, h] = m + math.log(l)

    return readable_kernel


#: ``kernel(kind)``: the readable kernel for one storage kind, made (and compiled) once per kind.
kernel = functools.cache(_make_readable_kernel)
