"""The toy MLA target's dense layers, in two interchangeable backends.

Embedding, RMSNorm, grouped matrix products, RoPE, the cache-row write and SiLU: what
:class:`~ddtree_numba.models.toy_mla_device.DeviceToyMLA` runs around ``kernels.verify_attn``.

:class:`KernelDenseOps` launches small numba.cuda kernels (one per operation, every output
preallocated, so a whole step can be captured in a CUDA graph). :class:`HostDenseOps` does the
same arithmetic in numpy on numpy arrays or the simulator's device arrays, in place: numba's
CUDA simulator runs one Python thread per CUDA thread, which makes even a small matrix product
take a second, so the demo and the end-to-end tests on the simulator use the twins here and the
package's real kernels for every DDTree stage and for attention. ``default_dense_ops()``
picks one; ``tests/test_ops.py`` checks every kernel against its numpy twin.

These are plumbing, not DDTree stages: written plainly (a 16 x 16 shared-memory tile for the
matrix product, one block per row for the reductions) and not tuned.

Every operation works on row-major 2-D buffers of ``T = bs * N`` rows (one per tree node,
padding rows included; their results are never read).
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
from numba import cuda, float32, float64
from numba.types import float16

from ..arrays import host_view, storage_kind
from ..kernels._device import CACHE_KERNELS, SIMULATOR, launch, launch_stream
from ..kernels._primitives import bfloat16_bits, block_sum
from ..reference.commit_kv import store_node_rows

TILE = 16            # linear: a TILE x TILE block computes a TILE x TILE output tile
TILE_PAD = 17        # TILE + 1 (shared-array shapes must be literal constants)
ROW_THREADS = 128    # per-row kernels: threads per block (one block per row)


def rope_inv_freq(rope_dim: int, theta: float) -> np.ndarray:
    """``float64[Dr / 2]``: the rotation frequency ``theta ** (-2 i / Dr)`` of pair ``i``."""
    return theta ** (-2.0 * np.arange(rope_dim // 2) / rope_dim)


# -- kernels ---------------------------------------------------------------------------------

@cuda.jit(cache=CACHE_KERNELS)
def _embed_kernel(tokens, table, out):
    """``out[t] = table[tokens[t]]`` (zeros for a padding token ``-1``). One block per row."""
    t = cuda.blockIdx.x
    token = tokens[t]
    for col in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[t, col] = table[token, col] if token >= 0 else float32(0)


@cuda.jit(cache=CACHE_KERNELS)
def _rms_norm_kernel(x, weight, out, eps):
    """``out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight``. One block per row."""
    t, tid = cuda.blockIdx.x, cuda.threadIdx.x
    red = cuda.shared.array(ROW_THREADS, float32)
    width = x.shape[1]
    partial = float32(0)
    for col in range(tid, width, ROW_THREADS):
        partial += x[t, col] * x[t, col]
    total = block_sum(red, partial, tid, ROW_THREADS)      # every thread gets the block sum
    inv = float32(1) / math.sqrt(total / float32(width) + eps)
    for col in range(tid, width, ROW_THREADS):
        out[t, col] = x[t, col] * inv * weight[col]


@cuda.jit(cache=CACHE_KERNELS)
def _linear_kernel(x, w, out, residual, has_residual):
    """Grouped matrix product, group ``g`` on columns ``[g Din, (g + 1) Din)`` of ``x``::

        out[t, g Dout + o] = sum_k x[t, g Din + k] w[g, k, o]  (+ residual[t, g Dout + o])

    Grid ``(ceil(Dout / TILE), ceil(T / TILE), G)``, block ``(TILE, TILE)``: thread ``(tx, ty)``
    computes output row ``row = blockIdx.y TILE + ty``, column ``col = blockIdx.x TILE + tx``.
    """
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    col = cuda.blockIdx.x * TILE + tx
    row = cuda.blockIdx.y * TILE + ty
    g = cuda.blockIdx.z
    d_in, d_out = w.shape[1], w.shape[2]
    x_tile = cuda.shared.array((TILE, TILE), float32)
    w_tile = cuda.shared.array((TILE, TILE_PAD), float32)      # +1: no bank conflicts
    acc = float32(0)
    for k0 in range(0, d_in, TILE):
        # stage x[row, k0 + tx] and w[k0 + ty, col] of this group (zeros past the edges)
        k = k0 + tx
        x_tile[ty, tx] = x[row, g * d_in + k] if row < x.shape[0] and k < d_in else float32(0)
        k = k0 + ty
        w_tile[ty, tx] = w[g, k, col] if col < d_out and k < d_in else float32(0)
        cuda.syncthreads()              # both tiles are staged
        for kk in range(TILE):
            acc += x_tile[ty, kk] * w_tile[kk, tx]
        cuda.syncthreads()              # everyone is done with the tiles before restaging
    if row < out.shape[0] and col < d_out:
        if has_residual:
            acc += residual[row, g * d_out + col]
        out[row, g * d_out + col] = acc


@cuda.jit(device=True, inline="always")
def _rotated_pair(src, col, position, inv_freq_p):
    """RoPE on one pair: dims ``(col, col + 1)`` of the row ``src`` rotated by ``position *
    inv_freq_p`` (angle, cos and sin in float64, as the reference), returned as two values."""
    angle = float64(position) * inv_freq_p
    cos, sin = float32(math.cos(angle)), float32(math.sin(angle))
    even, odd = src[col], src[col + 1]
    return even * cos - odd * sin, even * sin + odd * cos


@cuda.jit(cache=CACHE_KERNELS)
def _rope_kernel(x, positions, inv_freq):
    """In place: RoPE on every ``Dr``-wide group (one per head) of row ``t`` of ``x [T, G Dr]``.

    One block per row; pair ``p`` of the row is dims ``(2 p, 2 p + 1)``, pair ``p % (Dr / 2)``
    of its head.
    """
    t = cuda.blockIdx.x
    row = x[t]
    pairs = inv_freq.shape[0]                       # Dr / 2
    for p in range(cuda.threadIdx.x, x.shape[1] // 2, cuda.blockDim.x):
        row[2 * p], row[2 * p + 1] = _rotated_pair(row, 2 * p, positions[t], inv_freq[p % pairs])


#: How a float32 value is stored in a cache of each kind: ``bfloat16`` caches reach the kernel
#: as ``uint16`` arrays of bits (numba's bfloat16 arithmetic needs sm_80 and has no simulator
#: twin; the rounding is integer arithmetic, the same on both), ``float16`` by a cast.
CACHE_KINDS = ("float32", "bfloat16", "float16")


def _make_kv_write_kernel(kind: str):
    if kind == "bfloat16":
        stored = bfloat16_bits
    elif kind == "float16":
        @cuda.jit(device=True, inline="always")
        def stored(x):
            return float16(x)
    else:
        @cuda.jit(device=True, inline="always")
        def stored(x):
            return x

    @cuda.jit(cache=CACHE_KERNELS)
    def kv_write_kernel(kv, kv_norm, inv_freq, positions, num_nodes, prefix_lens, block_table,
                        cache, eps):
        """Normalise and rotate node ``j``'s new row and store it at slot ``P + j`` of ``cache``.

        One block per row ``t = b N + j`` of ``kv [T, Dc + Dr]``: the latent ``kv[t, :Dc]``
        gets RMSNorm (block reduction), the rope key ``kv[t, Dc:]`` gets RoPE at
        ``positions[b, j]``; both are computed in float32 and rounded once, when stored.
        Slot ``s = P + j`` lives at ``cache[block_table[b, s // page_size], s % page_size]``.
        """
        t, tid = cuda.blockIdx.x, cuda.threadIdx.x
        n_cap = positions.shape[1]
        b, j = t // n_cap, t % n_cap
        if j >= num_nodes[b]:
            return                      # a padding row writes no cache row (uniform per block)
        red = cuda.shared.array(ROW_THREADS, float32)
        latent = kv_norm.shape[0]
        slot = prefix_lens[b] + j
        page_size = cache.shape[1]
        dst = cache[block_table[b, slot // page_size], slot % page_size]     # [Dc + Dr] row
        src = kv[t]
        partial = float32(0)
        for col in range(tid, latent, ROW_THREADS):
            partial += src[col] * src[col]
        total = block_sum(red, partial, tid, ROW_THREADS)      # every thread gets the block sum
        inv = float32(1) / math.sqrt(total / float32(latent) + eps)
        for col in range(tid, latent, ROW_THREADS):
            dst[col] = stored(src[col] * inv * kv_norm[col])
        for p in range(tid, inv_freq.shape[0], ROW_THREADS):
            even, odd = _rotated_pair(src, latent + 2 * p, positions[b, j], inv_freq[p])
            dst[latent + 2 * p] = stored(even)
            dst[latent + 2 * p + 1] = stored(odd)

    return kv_write_kernel


#: ``kv_write_kernel(kind)``: the cache-row write for one cache kind, compiled once.
kv_write_kernel = functools.cache(_make_kv_write_kernel)


@cuda.jit(cache=CACHE_KERNELS)
def _silu_mul_kernel(gate_up, out):
    """``out[t, f] = silu(gate_up[t, f]) * gate_up[t, F + f]``. Grid ``(T, ceil(F /
    blockDim))``: thread ``tid`` of block ``(t, c)`` owns column ``f = c blockDim + tid`` of row
    ``t`` (a row of an MLP is thousands of columns wide: one block per row would leave most of
    the GPU idle at the few rows of decoding)."""
    t = cuda.blockIdx.x
    f = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if f < out.shape[1]:
        g = gate_up[t, f]
        out[t, f] = g / (float32(1) + math.exp(-g)) * gate_up[t, out.shape[1] + f]


@cuda.jit(cache=CACHE_KERNELS)
def _add_routed_kernel(y, weights, out):
    """``out[t] += sum_e weights[t, e] * y[e, t]``, the experts in index order, those with a zero
    weight adding nothing (not even ``0 * inf``). Grid ``(T, ceil(D / blockDim))``: thread
    ``tid`` of block ``(t, c)`` owns column ``col = c blockDim + tid`` of row ``t``. Every thread
    of a block reads the same ``weights[t, e]`` (one broadcast load), and its ``y`` loads do
    not depend on the weight, so they can all be in flight at once."""
    t = cuda.blockIdx.x
    col = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if col >= out.shape[1]:
        return
    acc = float32(0)
    for e in range(y.shape[0]):
        w = weights[t, e]
        term = w * y[e, t, col]
        if w != float32(0):
            acc += term
    out[t, col] += acc


@cuda.jit(cache=CACHE_KERNELS)
def _linear_gathered_kernel(x, w, experts, out):
    """One product per (token, chosen expert) pair ``p = t k + s``::

        out[p, o] = sum_i x[row, i] w[experts[t, s], i, o]    row = p if x has a row per pair,
                                                                    else t (shared by its k pairs)

    Grid ``(T k, ceil(Dout / blockDim))``: block ``(p, c)`` computes columns ``c blockDim + tid``
    of pair ``p``'s output row (a matrix-vector product; consecutive threads read consecutive
    columns of the expert's ``w`` row ``i``)."""
    p = cuda.blockIdx.x
    col = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if col >= out.shape[1]:
        return
    k = experts.shape[1]
    row = p if x.shape[0] == out.shape[0] else p // k
    e = experts[p // k, p % k]
    acc = float32(0)
    for i in range(w.shape[1]):
        acc += x[row, i] * w[e, i, col]
    out[p, col] = acc


@cuda.jit(cache=CACHE_KERNELS)
def _add_gathered_kernel(y, experts, weights, out):
    """``out[t] += sum_s weights[t, experts[t, s]] * y[t k + s]``, the slots in order (experts
    in increasing index: ``add_routed``'s order), zero weights adding nothing. Grid ``(T,
    ceil(D / blockDim))``: thread ``tid`` of block ``(t, c)`` owns column ``c blockDim + tid`` of
    row ``t``, as in ``_add_routed_kernel``."""
    t = cuda.blockIdx.x
    col = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if col >= out.shape[1]:
        return
    k = experts.shape[1]
    acc = float32(0)
    for s in range(k):
        w = weights[t, experts[t, s]]
        term = w * y[t * k + s, col]
        if w != float32(0):
            acc += term
    out[t, col] += acc


# -- the two backends ------------------------------------------------------------------------

def _require_float32_weights(w) -> None:
    """The numba products read ``w`` as numbers: bfloat16 bits (``uint16``) would be read as
    integers, so only the cuBLAS backend takes them."""
    if w.dtype != np.float32:
        raise TypeError(f"w: expected float32 weights (bfloat16 ones need CublasDenseOps), "
                        f"got {w.dtype}")


def _row_chunks(out) -> tuple:
    """The grid of a kernel that gives each block ``ROW_THREADS`` columns of one row of
    ``out [T, width]``: ``(T, ceil(width / ROW_THREADS))`` (at least one chunk)."""
    return out.shape[0], max(1, (out.shape[1] + ROW_THREADS - 1) // ROW_THREADS)


class KernelDenseOps:
    """The dense operations as numba.cuda launches on the current stream (no allocation)."""

    name = "kernels"

    def embed(self, tokens, table, out):
        launch(_embed_kernel, out.shape[0], ROW_THREADS, launch_stream())(tokens, table, out)

    def rms_norm(self, x, weight, out, eps):
        launch(_rms_norm_kernel, x.shape[0], ROW_THREADS, launch_stream())(x, weight, out,
                                                                  np.float32(eps))

    def linear(self, x, w, out, residual=None):
        """``out = x @ w (+ residual)``; ``w`` is ``[G, Din, Dout]`` (grouped per head)."""
        _require_float32_weights(w)
        groups, _, d_out = w.shape
        grid = ((d_out + TILE - 1) // TILE, (x.shape[0] + TILE - 1) // TILE, groups)
        launch(_linear_kernel, grid, (TILE, TILE), launch_stream())(
            x, w, out, out if residual is None else residual, residual is not None)

    def rope(self, x, positions, inv_freq):
        launch(_rope_kernel, x.shape[0], ROW_THREADS, launch_stream())(x, positions, inv_freq)

    def kv_write(self, kv, kv_norm, inv_freq, positions, num_nodes, prefix_lens, block_table,
                 cache, eps):
        """Store each node's normalised, rotated row in ``cache`` (float32, bfloat16 or
        float16), rounded once to the cache's type."""
        kind = storage_kind(cache)
        if kind == "bfloat16":
            cache = cache.view(np.uint16)
        launch(kv_write_kernel(kind), kv.shape[0], ROW_THREADS, launch_stream())(
            kv, kv_norm, inv_freq, positions, num_nodes, prefix_lens, block_table, cache,
            np.float32(eps))

    def silu_mul(self, gate_up, out):
        launch(_silu_mul_kernel, _row_chunks(out), ROW_THREADS, launch_stream())(gate_up, out)

    def linear_batched(self, x, w, out):
        """``out[e] = x[e] @ w[e]`` for ``w [E, Din, Dout]``, ``out [E, T, Dout]``; a 2-D ``x``
        ``[T, Din]`` is every ``x[e]`` (the experts of a MoE layer on the same tokens)."""
        for e in range(w.shape[0]):
            self.linear(x if x.ndim == 2 else x[e], w[e:e + 1], out[e])

    def add_routed(self, y, weights, out):
        """``out[t] += sum_e weights[t, e] * y[e, t]`` (zero weights skipped)."""
        launch(_add_routed_kernel, _row_chunks(out), ROW_THREADS, launch_stream())(
            y, weights, out)

    def route(self, logits, bias, config, weights, experts):
        """DeepSeek-V3's MoE router: ``weights [T, E]`` and ``experts [T, k]`` from the router
        logits (:func:`~ddtree_numba.models.deepseek_v3.routing.route_kernel`)."""
        from .deepseek_v3.routing import route_kernel

        route_kernel(logits, bias, config, weights, experts)

    def linear_gathered(self, x, w, experts, out):
        """``out[t k + s] = x_row @ w[experts[t, s]]`` for ``w [E, Din, Dout]`` (float32),
        ``experts int32[T, k]``, ``out [T k, Dout]``; ``x`` is ``[T, Din]`` (a token's row
        for each of its pairs) or ``[T k, Din]`` (a row per pair)."""
        _require_float32_weights(w)
        if out.shape[0] and out.shape[1]:
            launch(_linear_gathered_kernel, _row_chunks(out), ROW_THREADS, launch_stream())(
                x, w, experts, out)

    def add_gathered(self, y, experts, weights, out):
        """``out[t] += sum_s weights[t, experts[t, s]] * y[t k + s]`` (zero weights
        skipped)."""
        launch(_add_gathered_kernel, _row_chunks(out), ROW_THREADS, launch_stream())(
            y, experts, weights, out)


class HostDenseOps:
    """The same operations in numpy float32, in place on numpy arrays or on the simulator's
    device arrays (the twins that the kernels are tested against)."""

    name = "numpy"

    def embed(self, tokens, table, out):
        tokens, o = host_view(tokens), host_view(out)
        o[:] = np.where(tokens[:, None] >= 0, host_view(table)[np.maximum(tokens, 0)], 0)

    def rms_norm(self, x, weight, out, eps):
        x = host_view(x)
        inv = np.float32(1) / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + np.float32(eps))
        host_view(out)[:] = x * inv * host_view(weight)

    def linear(self, x, w, out, residual=None):
        (x, w), o = _product_operands(x, w), host_view(out)
        groups, d_in, d_out = w.shape
        y = np.einsum("tgk,gko->tgo", x.reshape(len(x), groups, d_in), w).reshape(len(x), -1)
        o[:] = y if residual is None else y + host_view(residual)

    def rope(self, x, positions, inv_freq):
        x = host_view(x)
        pairs = x.reshape(len(x), -1, len(inv_freq), 2)                 # [T, G, Dr/2, 2]
        _rotate_host(pairs, host_view(positions), host_view(inv_freq))

    def kv_write(self, kv, kv_norm, inv_freq, positions, num_nodes, prefix_lens, block_table,
                 cache, eps):
        kv, pos, latent = host_view(kv), host_view(positions), len(host_view(kv_norm))
        rows = np.empty_like(kv)                                        # [T, Dc + Dr]
        c = kv[:, :latent]
        rows[:, :latent] = c / np.sqrt(np.mean(c * c, axis=1, keepdims=True)
                                       + np.float32(eps)) * host_view(kv_norm)
        rows[:, latent:] = kv[:, latent:]
        _rotate_host(rows[:, latent:].reshape(len(kv), 1, -1, 2), pos.reshape(-1),
                     host_view(inv_freq))
        store_node_rows(host_view(cache), host_view(block_table), host_view(prefix_lens),
                        host_view(num_nodes), rows)

    def silu_mul(self, gate_up, out):
        gu, o = host_view(gate_up), host_view(out)
        g, u = gu[:, : o.shape[1]], gu[:, o.shape[1]:]
        o[:] = g / (np.float32(1) + np.exp(-g)) * u

    def linear_batched(self, x, w, out):
        (x, w), o = _product_operands(x, w), host_view(out)
        o[:] = np.matmul(x, w)              # [T, Din] broadcast, or [E, T, Din], @ [E, Din, Dout]

    def add_routed(self, y, weights, out):
        y, w, o = host_view(y), host_view(weights), host_view(out)
        acc = np.zeros_like(o)
        for e in range(len(y)):             # the kernel's order: experts by index
            rows = w[:, e] != 0
            acc[rows] += w[rows, e, None] * y[e, rows]
        o += acc

    def route(self, logits, bias, config, weights, experts):
        from .deepseek_v3.routing import route_host

        route_host(host_view(logits), host_view(bias), config, host_view(weights),
                   host_view(experts))

    def linear_gathered(self, x, w, experts, out):
        (x, w), ex, o = _product_operands(x, w), host_view(experts), host_view(out)
        rows = x if len(x) == len(o) else np.repeat(x, ex.shape[1], axis=0)    # [T k, Din]
        for p, e in enumerate(ex.reshape(-1)):
            o[p] = rows[p] @ w[e]

    def add_gathered(self, y, experts, weights, out):
        y, ex, w, o = host_view(y), host_view(experts), host_view(weights), host_view(out)
        T, k = ex.shape
        acc = np.zeros_like(o)
        for s in range(k):                  # the kernel's order: the slots, experts ascending
            ws = w[np.arange(T), ex[:, s]]
            rows = ws != 0
            acc[rows] += ws[rows, None] * y[s::k][rows]
        o += acc


def _product_operands(x, w):
    """``(x, w)`` of a product as float32 numpy arrays; with bfloat16 weights (``uint16``
    bits) the inputs rounded to bfloat16 too, as cuBLAS gets them."""
    x, w = host_view(x), host_view(w)
    if w.dtype == np.uint16:
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        w = w.view(ml_dtypes.bfloat16).astype(np.float32)
    return x, w


def _rotate_host(pairs, positions, inv_freq):
    """In place: rotate ``pairs [T, G, Dr/2, 2]`` by ``positions[t] * inv_freq`` (float64)."""
    angle = positions.astype(np.float64)[:, None, None] * inv_freq        # [T, 1, Dr/2]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    even, odd = pairs[..., 0].copy(), pairs[..., 1].copy()
    pairs[..., 0] = even * cos - odd * sin
    pairs[..., 1] = even * sin + odd * cos


def default_dense_ops():
    """:class:`HostDenseOps` on the simulator (fast enough for the demo),
    :class:`KernelDenseOps` on a GPU."""
    return HostDenseOps() if SIMULATOR else KernelDenseOps()


def build_specs():
    """Specialisations of the dense kernels (for the build report)."""
    from numba import types

    from ..kernels._specs import KernelSpec

    f1, f2, f3 = types.float32[::1], types.float32[:, ::1], types.float32[:, :, ::1]
    i1, i2 = types.int32[::1], types.int32[:, ::1]
    d1 = types.float64[::1]
    return [
        KernelSpec("dense_ops", "embed", _embed_kernel, (i1, f2, f2), ROW_THREADS, True),
        KernelSpec("dense_ops", "rms_norm", _rms_norm_kernel, (f2, f1, f2, types.float32),
                   ROW_THREADS, True),
        KernelSpec("dense_ops", "linear", _linear_kernel, (f2, f3, f2, f2, types.boolean),
                   TILE * TILE, True),
        KernelSpec("dense_ops", "rope", _rope_kernel, (f2, i1, d1), ROW_THREADS, True),
        *(KernelSpec("dense_ops", f"kv_write {kind}", kv_write_kernel(kind),
                     (f2, f1, d1, i2, i1, i1, i2, cache[:, :, ::1], types.float32),
                     ROW_THREADS, True)
          for kind, cache in (("float32", types.float32), ("bfloat16", types.uint16),
                              ("float16", types.float16))),
        KernelSpec("dense_ops", "silu_mul", _silu_mul_kernel, (f2, f2), ROW_THREADS, True),
        KernelSpec("dense_ops", "add_routed", _add_routed_kernel, (f3, f2, f2), ROW_THREADS,
                   True),
        KernelSpec("dense_ops", "linear_gathered", _linear_gathered_kernel, (f2, f3, i2, f2),
                   ROW_THREADS, True),
        KernelSpec("dense_ops", "add_gathered", _add_gathered_kernel, (f2, i2, f2, f2),
                   ROW_THREADS, True),
    ]
