"""Tree-masked MLA-absorb attention on the GPU: ``kernels.verify_attn``.

Math (see ``reference.verify_attn``), for request ``b``, tree node ``i``, head ``h``::

    s[t]     = sm_scale * (q_latent[b, i, h] . c[t] + q_rope[b, i, h] . r[t])
    visible  = t < P  or  (t = P + j and bit j of visibility_bits[b, i])
    out      = sum_t softmax(s)[t] * c[t]              # [Dc], still in latent space
    lse      = log sum_t exp(s[t])

where ``[c | r] = kv_cache[block_table[b, t // page_size], t % page_size]`` (one 576-wide row
shared by all heads). Rows ``i >= num_nodes[b]`` are padding: ``out = 0``, ``lse = -inf``.

FLOPs counted by the benchmark: ``2 * bs * N * H * T * (Dc + Dr + Dc)`` for ``T = P + N`` slots
(the score dot product over ``Dc + Dr`` and the weighted sum over ``Dc``; masked slots counted).
Bytes: the cache holds ``T * (Dc + Dr) * itemsize`` per request (2.4 MB in float32 at P = 1024),
read once from DRAM; the tiled variant then reads it ``ceil(N H / 32)`` times from L2 (each
block stages its slots twice: 576 values per row for the scores, 512 for the weighted sum),
plus its 32 query rows (``32 * (Dc + Dr) * 4`` bytes) once per slot tile. At bs = 1, N = 16,
H = 128, P = 1024 that is 4.6 GFLOP against ~2.4 MB of DRAM traffic: compute-bound by far.

Variant ``"readable"`` (one idea per step; runs on the simulator). One thread per query row
``(b, i, h)`` (blocks of 32), no shared memory and no barrier; the thread accumulates its
output row directly in ``out``. For every slot: 1. mask (skip invisible tree slots), 2. score
(the 576-wide dot product), 3. online softmax (rescale the running sum and output when the max
grows), 4. weighted sum of the slot's latent row. Every cache row is read once per query row:
simple and slow (the tiled variant reads it once per 32 rows).

Variant ``"tiled"`` (fast; GPU). The ``N * H`` query rows of a request are flattened
(``row = i * H + h``) and cut into tiles of ``BM = 32`` rows; the slots ``[0, P + N)`` are cut into
``splits`` equal ranges (flash-decoding: enough blocks to fill the GPU even at bs = 1; the count
minimises waves x tile times, ``choose_splits``). Grid ``(splits, ceil(N H / 32), bs)``, 256
threads = 8 warps. For each tile of ``BN = 128`` slots:

1. ``S = Q K^T`` over 576 dims in chunks of 32: a 32 x 32 chunk of queries and a 128 x 32 chunk
   of cache rows are staged in shared memory (each cache element is read once per block and
   reused by its 32 query rows: heads and nodes), while the *next* chunk is already being
   fetched into registers (a software pipeline: global latency hides behind the products).
   Each thread accumulates a 4 x 4 block of scores: per 4 dims, 4 vectors of Q and 4 of K
   feed 64 FMAs.
2. The raw scores go to shared memory as ``P^T`` (in the K buffer, free by then), one
   float32x4 per slot and *row quad*. Mask and scale: prefix slots always visible, tree slot
   ``P + j`` iff bit ``j`` of the row's node. Warp ``w`` owns quad ``w`` (4 rows x 128 slots),
   so a row's max and sum are 5-shuffle warp reductions;
3. online softmax: ``m, l`` per row in registers of its warp, the rescale factor of each row
   published in shared memory for the threads that hold its outputs;
4. ``O += P C``, 8 slots at a time with their 512 latent columns staged in shared memory (the
   next 8 in flight meanwhile); each thread keeps 4 rows x 16 columns of the output in
   registers: per slot, 1 vector of P and 4 of C feed 64 FMAs.

Why these shapes (measured on the H200, ``benchmarks/NOTES.md``): an SM issues 4 warp-FMAs per
cycle but its shared memory returns one 128-byte wavefront (one 32-bit register per lane) per
cycle, so the FMAs that use a read must take at least as long as the read. All staged tiles
are float32x4; a 128-bit read costs 4 wavefronts, or 2 when lanes ``n`` and ``n ^ 1`` (or
``n ^ 2``) read the same address. The lane is split into ``lane_a`` (bits 0, 2) and ``lane_b``
(bits 1, 3, 4) so that every read of both products pairs up: the 4 x 4 score tile then reads 8
vectors (16 wavefronts) per 64 warp-FMAs (16 cycles of the SM's FMA rate: balanced),
the 4 x 16 output tile 5 vectors (10 wavefronts) per 64 FMAs. Rows of Q, K and ``P^T`` are 9
vectors apart, so the rows a warp reads at once start in different banks; row quads
interleave rows (quad ``q`` holds rows ``16 (q // 4) + (q % 4) + 4 r``) for the same reason.

Index arithmetic is kept out of the hot loops: shared memory is read through per-thread views
(``k_s[(...) * ROW4:]``, ``c_s[col4:]``) with constant indices, so each read is a base plus an
immediate offset (numba keeps 128-bit shared loads only for views sliced along the first axis,
hence 1-D buffers), global reads go through flat 1-D views with unsigned offsets (the row
offset of every slot of a tile is computed once), and the 8-step inner loops
(``_score_group``, ``_weighted_slot``) are spelled out by ``_unrolled8``: numba has no
``#pragma unroll``. The hot loops compile
to 1.14 (scores) and 1.09 (weighted sum) instructions per FMA in the sm_90 SASS.

Storage: with even ``Dc`` and ``Dr`` the cache is read as value pairs, bfloat16 viewed as
``uint32`` and float32 as ``uint64`` words (half the loads and address arithmetic); the words
stay packed while in flight and are widened only when staged, so no instruction waits for a
prefetch before the products that hide it. Odd widths and float16: one element per load. All
arithmetic is float32.

Each block writes an unnormalised partial ``(out / l, m + log l)``; the merge kernel combines
the splits of a row by log-sum-exp (``_merge_partials``, the only place the merge is
written).

Resources (``python -m ddtree_numba build-report``): 251-254 registers on sm_90 and sm_120, no
spills, 40 576 bytes of static shared memory (Q chunk 4.5 KiB, K chunk / ``P^T`` 18 KiB,
latent sub-tile 16 KiB, slot offsets 1 KiB): one block of 8 warps per SM. Measured on the H200: 25.6
TFLOP/s (float32 cache) and 26.9 (bfloat16) at long prefixes, 51-53 % of cuBLAS SGEMM (v4: 9.7,
19 %); what bounds it is two warps per scheduler against shared-memory latency and FMA chains.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32, uint64
from numba.cuda import float32x4

from ..arrays import storage_kind
from ..limits import MAX_DC
from ..validation import check_verify_attn
from ._device import SIMULATOR, as_device, device_empty, launch, launch_stream, resolve_variant
from ._primitives import bits_to_float, float_to_bits

NEG_INF = float32(-np.inf)
FULL_MASK = 0xFFFFFFFF
READABLE_THREADS = 32
TILED_THREADS = 256     # 8 warps
BM = 32                 # query rows per block
QUADS = BM // 4         # row quads: 4 rows of P^T in one float32x4
BN = 128                # slots per tile
DCHUNK = 32             # dims per staged chunk of the score product
GROUPS = DCHUNK // 4    # float32x4 vectors per chunk row
ROW4 = GROUPS + 1       # Q / K / P^T row stride in vectors (36 words: conflict-free reads)
VSLOTS = 8              # slots per staged latent sub-tile of the weighted sum (16 KB)
COL4 = MAX_DC // 4      # float32x4 vectors per latent row
K_VECS = BN * ROW4      # K chunk (and then P^T), in vectors (shared shapes are literals)
Q_VECS = BM * ROW4      # Q chunk, in vectors
C_VECS = VSLOTS * COL4  # latent sub-tile, in vectors
ACC = 64                # 4 rows x 16 columns of O per thread (local-array sizes are literals)
SCORES = 16             # 4 rows x 4 slots of S per thread
if SIMULATOR:   # the simulator has no vector element type: the tiled variant needs a GPU
    F32X4 = None
else:           # the element type of float32x4 arrays (float32x4 itself builds values)
    from numba.cuda.vector_types import vector_types

    F32X4 = vector_types["float32x4"]


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
def _unpack_bf16x2(word):
    """Two bfloat16 values packed in a uint32 (little endian: element 2e in the low half)."""
    word = uint32(word)
    return (bits_to_float(word << uint32(16)),
            bits_to_float(word & uint32(0xFFFF0000)))


@cuda.jit(device=True, inline=True)
def _visible(bits, b, i, j):
    """Bit ``j`` of row ``i`` of the packed ancestor mask."""
    return (bits[b, i, j // 32] >> uint32(j % 32)) & uint32(1) != 0


# ------------------------------------------------------------------------------------------
# Variant "readable"
# ------------------------------------------------------------------------------------------
def _make_readable_kernel(kind: str):
    widen = _make_widen(kind)

    @cuda.jit
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


# ------------------------------------------------------------------------------------------
# Variant "tiled" (flash-decoding over slot splits) and the merge
# ------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def _unrolled8(step, a, b, acc):
    """``step(a, b, i, acc)`` for ``i = 0 .. 7``, each ``i`` a literal. numba has no
    ``#pragma unroll``, and NVVM keeps an 8-trip loop of this size rolled (index math and a
    load-use stall every trip), so the two hot loops are spelled out here once."""
    step(a, b, 0, acc)
    step(a, b, 1, acc)
    step(a, b, 2, acc)
    step(a, b, 3, acc)
    step(a, b, 4, acc)
    step(a, b, 5, acc)
    step(a, b, 6, acc)
    step(a, b, 7, acc)


@cuda.jit(device=True, inline=True)
def _score_group(q_mine, k_mine, g, score):
    """Dims ``4 g .. 4 g + 3`` of the staged chunk into this thread's 4 x 4 scores: four K
    vectors (slots ``8 k``) and four Q vectors (rows ``4 r``) of its views feed 64 FMAs into
    ``score[4 r + k]``. ``g`` is a literal at every call: every offset is a constant."""
    for k in range(4):
        kv = k_mine[8 * k * ROW4 + g]
        for r in range(4):
            qv = q_mine[4 * r * ROW4 + g]
            acc = score[4 * r + k]          # one FMA per product (a single expression would
            acc += qv.x * kv.x              # sum the 4 products first: 5 instructions, not 4)
            acc += qv.y * kv.y
            acc += qv.z * kv.z
            acc += qv.w * kv.w
            score[4 * r + k] = acc


@cuda.jit(device=True, inline=True)
def _weighted_slot(p_sub, c_mine, ss, acc):
    """Slot ``ss`` of the staged sub-tile into this thread's 4 x 16 outputs: one P vector (the
    4 rows of its quad) and four C vectors (its 16 columns) feed 64 FMAs;
    ``acc[16 r + 4 j + e]`` is row ``r``, column ``e`` of vector ``j``."""
    pv = p_sub[ss * ROW4]
    for j in range(4):
        cv = c_mine[ss * COL4 + 8 * j]
        acc[4 * j] += pv.x * cv.x
        acc[4 * j + 1] += pv.x * cv.y
        acc[4 * j + 2] += pv.x * cv.z
        acc[4 * j + 3] += pv.x * cv.w
        acc[16 + 4 * j] += pv.y * cv.x
        acc[16 + 4 * j + 1] += pv.y * cv.y
        acc[16 + 4 * j + 2] += pv.y * cv.z
        acc[16 + 4 * j + 3] += pv.y * cv.w
        acc[32 + 4 * j] += pv.z * cv.x
        acc[32 + 4 * j + 1] += pv.z * cv.y
        acc[32 + 4 * j + 2] += pv.z * cv.z
        acc[32 + 4 * j + 3] += pv.z * cv.w
        acc[48 + 4 * j] += pv.w * cv.x
        acc[48 + 4 * j + 1] += pv.w * cv.y
        acc[48 + 4 * j + 2] += pv.w * cv.z
        acc[48 + 4 * j + 3] += pv.w * cv.w


def _make_tiled_kernel(kind: str):
    # Even widths: the cache is read two values per load, "bfloat16x2" viewed as uint32 and
    # "float32x2" as uint64 words (half the loads and address arithmetic)
    packed = kind == "bfloat16x2"
    pairs = kind == "float32x2"
    widen1 = _make_widen("bfloat16" if packed else kind)   # one element, unpacked

    # Global reads go through flat 1-D views with unsigned offsets: the row offset of each slot
    # of the tile is computed once (slot_off), so a read is one add and one load (a 3-D signed
    # index costs numba ~20 instructions: 64-bit multiplies and negative-index wraparound).
    @cuda.jit(device=True, inline=True)
    def fetch4(flat, row_off, ok, d, width):
        """Values ``d .. d + 3`` of one cache row (0 past ``width`` or if not ``ok``), *in
        flight*: a float32x4 of the values, or for packed bf16 (``d``, ``width`` even) the two
        raw 32-bit words as bit patterns in ``.x`` and ``.y``. Nothing here reads a loaded
        value, so the load's latency is paid only where :func:`widen4` stages it."""
        if pairs:                       # splitting a 64-bit word costs no instruction
            half = row_off + (uint64(d) >> uint64(1))
            w0 = flat[half] if ok and d < width else uint64(0)
            w1 = flat[half + uint64(1)] if ok and d + 2 < width else uint64(0)
            return float32x4(bits_to_float(uint32(w0 & uint64(0xFFFFFFFF))),
                             bits_to_float(uint32(w0 >> uint64(32))),
                             bits_to_float(uint32(w1 & uint64(0xFFFFFFFF))),
                             bits_to_float(uint32(w1 >> uint64(32))))
        if packed:
            half = row_off + (uint64(d) >> uint64(1))
            w0 = flat[half] if ok and d < width else uint32(0)
            w1 = flat[half + uint64(1)] if ok and d + 2 < width else uint32(0)
            return float32x4(bits_to_float(w0), bits_to_float(w1), float32(0.0), float32(0.0))
        v = cuda.local.array(4, float32)
        for e in range(4):
            v[e] = widen1(flat[row_off + uint64(d + e)]) if ok and d + e < width else float32(0.0)
        return float32x4(v[0], v[1], v[2], v[3])

    @cuda.jit(device=True, inline=True)
    def widen4(v):
        """The 4 float32 values of a :func:`fetch4` result (packed bf16: split the words)."""
        if packed:
            lo0, hi0 = _unpack_bf16x2(float_to_bits(v.x))
            lo1, hi1 = _unpack_bf16x2(float_to_bits(v.y))
            return float32x4(lo0, hi0, lo1, hi1)
        return v

    @cuda.jit(device=True, inline=True)
    def fetch_q4(ql_flat, qr_flat, off_l, off_r, ok, d, Dc, D):
        """Dims ``d .. d + 3`` of one query row ``[q_latent | q_rope]`` as a float32x4."""
        v = cuda.local.array(4, float32)
        for e in range(4):
            dd = d + e
            x = float32(0.0)
            if ok and dd < D:
                x = ql_flat[off_l + uint64(dd)] if dd < Dc else qr_flat[off_r + uint64(dd - Dc)]
            v[e] = x
        return float32x4(v[0], v[1], v[2], v[3])

    @cuda.jit(device=True, inline=True)
    def fetch_c(flat, slot_off, t_valid, sub, Dc, tid, c_next):
        """Global -> registers: this thread's 4 vectors of the latent sub-tile at slots
        ``sub ..``: slot ``sub + tid // 128 + 2 j``, columns ``4 (tid % 128) ..``."""
        for j in range(4):
            ss = sub + tid // 128 + 2 * j
            c_next[j] = fetch4(flat, slot_off[ss], ss < t_valid, 4 * (tid % 128), Dc)

    @cuda.jit
    def tiled_kernel(q_latent, q_rope, cache, block_table, prefix_lens, bits, num_nodes,
                     sm_scale, slots_per_split, part_out, part_lse, ql_flat, qr_flat, flat):
        """Partials for rows ``[BM * y, BM * y + BM)`` over one split of the slots;
        ``ql_flat, qr_flat, flat`` are 1-D views of ``q_latent, q_rope, cache``."""
        split = cuda.blockIdx.x
        row0 = cuda.blockIdx.y * BM
        b = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        H = q_latent.shape[2]
        Dc = q_latent.shape[3]
        Dr = q_rope.shape[3]
        D = Dc + Dr
        NH = q_latent.shape[1] * H
        page_size = cache.shape[1]
        n = num_nodes[b]
        P = prefix_lens[b]
        t_begin = split * slots_per_split
        t_end = min(P + n, t_begin + slots_per_split)       # slots any valid row can see

        # Shared memory, all float32x4 (one 128-bit access moves 4 values). Rows of the Q, K
        # and P^T tiles are 9 vectors (36 words) apart: the 4 or 8 rows a warp reads at once
        # then start in different groups of 4 banks (no conflict). P^T and C are 1-D: numba
        # keeps a view's shared-memory address space (and 128-bit loads) only for slices
        # along the first axis.
        q_s = cuda.shared.array(Q_VECS, F32X4, alignment=16)  # Q[row, 4g..] at row ROW4 + g
        k_s = cuda.shared.array(K_VECS, F32X4, alignment=16)  # K[t, 4g..] at t ROW4 + g, then
        #                                                       P^T[t, quad] at t ROW4 + quad
        c_s = cuda.shared.array(C_VECS, F32X4, alignment=16)  # C[ss, 4 c4..] at ss COL4 + c4
        alpha_s = cuda.shared.array(QUADS, F32X4, alignment=16)  # per-row factor
        slot_off = cuda.shared.array(BN, uint64)  # flat offset of each slot's cache row

        # Rows of the block are handled in "quads" of 4 (one float32x4 of P^T): quad q holds
        # rows 16 (q // 4) + (q % 4) + 4 r, r < 4 (interleaved, so that a warp's Q reads hit
        # different banks).
        #
        # Shared memory returns one 32-bit register per lane per cycle, so a 128-bit read costs
        # 4 cycles (wavefronts) per warp, but 2 when lanes n and n ^ 1, or n and n ^ 2, read
        # the same address (the return is packed). Each phase splits the lane into two
        # coordinates: `a` (0..3) from lane bits 0 and 2, `b` (0..7) from bits 1, 3 and 4.
        # Reads that depend on `b` only are shared by lanes n, n ^ 1; reads that depend on
        # `a` only by lanes n, n ^ 2: every 128-bit read of the two products costs 2 cycles.
        lane_a = (lane & 1) | ((lane >> 1) & 2)
        lane_b = ((lane >> 1) & 1) | ((lane >> 2) & 6)
        # Each thread owns one row quad in both products, quad = 4 (warp // 4) + a (rows
        # 16 (warp // 4) + a + 4 r): warps 0-3 hold rows 0-15, warps 4-7 rows 16-31.
        quad = 4 * (warp // 4) + lane_a
        # Score phase: warp w computes its 16 rows x slots 32 (w % 4) .. + 31; lane (a, b) a
        # 4 x 4 tile: its quad x slots 32 (w % 4) + b + 8 k.
        q_mine = q_s[(16 * (warp // 4) + lane_a) * ROW4:]  # [4 r ROW4 + g]: row r of quad
        k_mine = k_s[(32 * (warp % 4) + lane_b) * ROW4:]   # [8 k ROW4 + g]: slot k of mine
        # Output phase: O[4 rows of quad, 16 columns], columns 4 c4 .. 4 c4 + 3 for
        # c4 = 32 (warp % 4) + b + 8 j, j < 4 (a warp reads 8 consecutive vectors).
        col4 = 32 * (warp % 4) + lane_b
        c_mine = c_s[col4:]                    # c_mine[ss COL4 + 8 j]: C[ss, vector j of mine]
        p_mine = k_s[quad:]                    # p_mine[t ROW4]: P^T[t, quad]
        # Softmax: warp w owns quad w (its 4 rows' max and sum), lane holds slots lane + 32 k.
        soft_rows = cuda.local.array(4, np.int64)
        for r in range(4):
            soft_rows[r] = row0 + 16 * (warp // 4) + warp % 4 + 4 * r

        # registers (loops over these are unrolled: constant indices, no local memory)
        acc = cuda.local.array(ACC, float32)    # O[row r of quad, col 4 c4_j + e] at 16r+4j+e
        score = cuda.local.array(SCORES, float32)   # S[row r of quad, slot k] at 4 r + k
        soft = cuda.local.array(SCORES, float32)    # softmax: row r, slot lane + 32 k at 4 r + k
        m = cuda.local.array(4, float32)        # softmax: running max per row of quad `warp`
        l = cuda.local.array(4, float32)        # softmax: running sum per row
        alpha = cuda.local.array(4, float32)
        for r in range(4):
            m[r] = NEG_INF
            l[r] = 0.0
        for i in range(ACC):
            acc[i] = 0.0
        # the Q vector this thread stages: row tid // 8, dims 4 (tid % 8) .. of each chunk
        q_row = row0 + tid // 8
        q_ok = q_row < NH
        flat_row = uint64(b * NH + min(q_row, NH - 1))
        q_off_l = flat_row * uint64(Dc)
        q_off_r = flat_row * uint64(Dr)
        stage_row = tid // 8                    # K rows tid // 8 + 32 j, j < 4
        stage_dim = 4 * (tid % 8)
        k_off = cuda.local.array(4, uint64)     # their flat offsets in the cache
        k_ok = cuda.local.array(4, np.bool_)    # slot exists
        k_next = cuda.local.array(4, F32X4)     # the next K chunk, in flight
        c_next = cuda.local.array(4, F32X4)     # the next latent sub-tile, in flight
        row_width = uint64(flat.shape[0] // (cache.shape[0] * page_size))  # per flat row

        for t0 in range(t_begin, t_end, BN):
            t_valid = t_end - t0                # slots of this tile that exist
            cuda.syncthreads()                  # the previous tile is done with slot_off and P
            if tid < BN:                        # 0. where each slot of the tile lives
                t = min(t0 + tid, t_end - 1)
                page = block_table[b, t // page_size]
                slot_off[tid] = uint64(page * page_size + t % page_size) * row_width
            cuda.syncthreads()                  # slot offsets written before the fetches
            for k in range(SCORES):
                score[k] = 0.0
            # 1. S = Q K^T over D dims, 32 at a time. Software pipeline: chunk c + 1 is fetched
            # into registers while chunk c is multiplied, so global latency hides behind math.
            for j in range(4):
                k_off[j] = slot_off[stage_row + 32 * j]
                k_ok[j] = stage_row + 32 * j < t_valid
                k_next[j] = fetch4(flat, k_off[j], k_ok[j], stage_dim, D)
            q_next = fetch_q4(ql_flat, qr_flat, q_off_l, q_off_r, q_ok, stage_dim, Dc, D)
            for d0 in range(0, D, DCHUNK):
                cuda.syncthreads()              # everyone is done with the previous chunk
                q_s[stage_row * ROW4 + tid % 8] = q_next
                for j in range(4):
                    k_s[(stage_row + 32 * j) * ROW4 + tid % 8] = widen4(k_next[j])
                cuda.syncthreads()              # chunk staged before the products
                d1 = d0 + DCHUNK + stage_dim    # prefetch the next chunk, if there is one (dims
                if d0 + DCHUNK < D:             # past D read as 0: no stale values staged)
                    for j in range(4):
                        k_next[j] = fetch4(flat, k_off[j], k_ok[j], d1, D)
                    q_next = fetch_q4(ql_flat, qr_flat, q_off_l, q_off_r, q_ok, d1, Dc, D)
                _unrolled8(_score_group, q_mine, k_mine, score)  # the chunk's 8 dim groups
            fetch_c(flat, slot_off, t_valid, 0, Dc, tid, c_next)  # in flight during softmax
            cuda.syncthreads()                  # every warp is done with the last K chunk,
            #                                     whose buffer now receives P^T
            # raw dot products to P^T: one vector = 4 rows of a quad at one slot
            for k in range(4):
                k_s[(32 * (warp % 4) + lane_b + 8 * k) * ROW4 + quad] = float32x4(
                    score[k], score[4 + k], score[8 + k], score[12 + k])
            cuda.syncthreads()                  # the whole score tile is in P^T
            # 2. mask and scale; 3. online softmax. Warp w holds quad w: 4 rows x 128 slots
            # (4 per lane), so a row's max and sum are warp reductions (5 shuffles each).
            for k in range(4):
                v = k_s[(lane + 32 * k) * ROW4 + warp]
                soft[k] = v.x
                soft[4 + k] = v.y
                soft[8 + k] = v.z
                soft[12 + k] = v.w
            for r in range(4):
                row = soft_rows[r]
                node = row // H
                row_valid = row < NH and node < n
                tile_max = NEG_INF
                for k in range(4):
                    t = t0 + lane + 32 * k
                    ok = row_valid and t < t_end and (t < P or _visible(bits, b, node, t - P))
                    sk = soft[4 * r + k] * sm_scale if ok else NEG_INF
                    soft[4 * r + k] = sk
                    tile_max = max(tile_max, sk)
                for offset in (16, 8, 4, 2, 1):
                    tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, offset))
                m_new = max(m[r], tile_max)
                rescale = float32(1.0)
                if m_new > NEG_INF:
                    rescale = math.exp(m[r] - m_new) if m[r] > NEG_INF else float32(0.0)
                tile_sum = float32(0.0)
                for k in range(4):
                    p = math.exp(soft[4 * r + k] - m_new) if m_new > NEG_INF else float32(0.0)
                    soft[4 * r + k] = p
                    tile_sum += p
                for offset in (16, 8, 4, 2, 1):
                    tile_sum += cuda.shfl_xor_sync(FULL_MASK, tile_sum, offset)
                l[r] = l[r] * rescale + tile_sum
                m[r] = m_new
                alpha[r] = rescale
            for k in range(4):                  # each lane rewrites the vectors it read
                k_s[(lane + 32 * k) * ROW4 + warp] = float32x4(soft[k], soft[4 + k],
                                                               soft[8 + k], soft[12 + k])
            if lane == 0:
                alpha_s[warp] = float32x4(alpha[0], alpha[1], alpha[2], alpha[3])
            cuda.syncthreads()                  # probabilities and factors published
            # 4. O += P C, 8 slots at a time; each thread updates 4 rows x 16 columns: per slot
            # one vector of P (its quad) and 4 vectors of C feed 64 FMAs
            a = alpha_s[quad]
            for j in range(16):
                acc[j] *= a.x
                acc[16 + j] *= a.y
                acc[32 + j] *= a.z
                acc[48 + j] *= a.w
            tile_slots = min(BN, t_valid)       # a partial tile has fewer sub-tiles
            for sub in range(0, tile_slots, VSLOTS):
                cuda.syncthreads()              # c_s free: the previous sub-tile is consumed
                for j in range(4):              # stage latent rows sub .. sub + 7
                    c_s[(tid // 128 + 2 * j) * COL4 + tid % 128] = widen4(c_next[j])
                cuda.syncthreads()              # latent rows staged before the products
                if sub + VSLOTS < tile_slots:   # the next sub-tile is fetched meanwhile
                    fetch_c(flat, slot_off, t_valid, sub + VSLOTS, Dc, tid, c_next)
                p_sub = p_mine[sub * ROW4:]
                _unrolled8(_weighted_slot, p_sub, c_mine, acc)  # slots past t_end have p = 0
        # partial result of this split: output / l and its log-sum-exp m + log l
        cuda.syncthreads()                      # the last tile is done with alpha_s
        for r in range(4):
            alpha[r] = float32(1.0) / l[r] if l[r] > 0 else float32(0.0)
            if lane == 0 and soft_rows[r] < NH:
                part_lse[split, b, soft_rows[r]] = m[r] + math.log(l[r]) if l[r] > 0 else NEG_INF
        if lane == 0:
            alpha_s[warp] = float32x4(alpha[0], alpha[1], alpha[2], alpha[3])
        cuda.syncthreads()                      # 1 / l of every row published
        inv = alpha_s[quad]
        for r in range(4):
            row = row0 + 16 * (warp // 4) + lane_a + 4 * r
            inv_l = inv.x if r == 0 else (inv.y if r == 1 else (inv.z if r == 2 else inv.w))
            if row < NH:
                for j in range(4):
                    for e in range(4):
                        d = 4 * (col4 + 8 * j) + e
                        if d < Dc:
                            part_out[split, b, row, d] = acc[16 * r + 4 * j + e] * inv_l

    return tiled_kernel


@cuda.jit(device=True, inline=True)
def _merge_partials(part_out, part_lse, splits, b, row, d):
    """Combine split partials of one output element by log-sum-exp.

    ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse) * out_s`` (splits that saw
    no visible slot have ``lse_s = -inf`` and weigh 0).
    """
    M = NEG_INF
    for s in range(splits):
        M = max(M, part_lse[s, b, row])
    total = float32(0.0)
    value = float32(0.0)
    if M > NEG_INF:
        for s in range(splits):
            w = math.exp(part_lse[s, b, row] - M)
            total += w
            value += w * part_out[s, b, row, d]
        return value / total, M + math.log(total)
    return float32(0.0), NEG_INF


@cuda.jit
def _merge_kernel(part_out, part_lse, num_nodes, out, lse):
    """Grid ``(N * H, bs)``, 128 threads: one query row per block, columns strided."""
    row = cuda.blockIdx.x
    b = cuda.blockIdx.y
    H = out.shape[2]
    Dc = out.shape[3]
    i = row // H
    h = row % H
    for d in range(cuda.threadIdx.x, Dc, cuda.blockDim.x):
        if i >= num_nodes[b]:                   # padding row
            value = float32(0.0)
            row_lse = NEG_INF
        else:
            value, row_lse = _merge_partials(part_out, part_lse, part_lse.shape[0], b, row, d)
        out[b, i, h, d] = value
        if d == 0:
            lse[b, i, h] = row_lse


# ------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------
_KERNELS: dict = {}


def _kernel(variant: str, kind: str):
    key = (variant, kind)
    if key not in _KERNELS:
        make = _make_readable_kernel if variant == "readable" else _make_tiled_kernel
        _KERNELS[key] = make(kind)
    return _KERNELS[key]


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (132 on the H200; 132 on the simulator)."""
    if SIMULATOR:
        return 132
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _split_cost(slots: int) -> float:
    """Time of one block over ``slots`` slots, in tile times: every tile computes all BN
    scores (576 of the 1088 FLOPs per slot and row), the weighted sum only the slots present."""
    full, rest = divmod(slots, BN)
    score_share = (MAX_DC + 64) / (2 * MAX_DC + 64)
    return full + (score_share + (1 - score_share) * rest / BN if rest else 0.0)


def choose_splits(bs: int, row_tiles: int, slots: int, sms: int = 132, max_waves: int = 4) -> int:
    """Slot splits for ``bs * row_tiles`` row tiles on ``sms`` SMs (one block per SM fits).

    A split of ``per_split = ceil(slots / s)`` slots (rounded up to a sub-tile) costs
    :func:`_split_cost` tile times, and the launch ``waves`` of them with
    ``waves = ceil(blocks / sms)``: pick the split count that minimises that (a partial last
    wave idles SMs, a partial tile computes all its scores), the fewest splits on ties, at most
    ``max_waves`` waves.
    """
    tiles = max(bs * row_tiles, 1)
    best = None
    for s in range(1, max(1, min(-(-slots // BN), -(-max_waves * sms // tiles))) + 1):
        per_split, n = _split_slots(slots, s)
        cost = -(-tiles * n // sms) * _split_cost(per_split)
        if best is None or cost < best[0] - 1e-9:    # ties: the fewer splits
            best = (cost, n)
    return best[1]


def _split_slots(slots: int, splits: int) -> tuple:
    """``(slots_per_split, splits)`` covering ``slots``: equal shares, whole sub-tiles."""
    per_split = -(-slots // max(splits, 1))
    per_split = -(-per_split // VSLOTS) * VSLOTS
    return per_split, -(-slots // per_split)


def plan_splits(bs: int, N: int, H: int, max_slots: int, splits=None) -> tuple:
    """``(splits, slots_per_split)`` of the tiled variant for a slot capacity ``max_slots``.

    Only the capacity of the block table is known on the host without a synchronisation, so
    the splits cover ``[0, max_pages * page_size)``; splits past a request's ``P + N`` return
    at once with an empty partial.
    """
    row_tiles = -(-N * H // BM)
    n = choose_splits(bs, row_tiles, max_slots, sm_count()) if splits is None else int(splits)
    per_split, n = _split_slots(max_slots, n)
    return n, per_split


def allocate_workspace(bs: int, N: int, H: int, Dc: int, max_slots: int, splits=None):
    """Device buffers for the split partials of the tiled variant: pass them as
    ``workspace=`` when the call is captured in a CUDA graph (buffers allocated inside a
    captured call would be freed while the graph still uses them)."""
    n_splits, _ = plan_splits(bs, N, H, max_slots, splits)
    return (device_empty((n_splits, bs, N * H, Dc), np.float32),
            device_empty((n_splits, bs, N * H), np.float32))


def verify_attn(q_latent, q_rope, kv_cache, block_table, prefix_lens, visibility_bits,
                num_nodes, *, sm_scale, check=None, variant=None, splits=None, out=None,
                workspace=None):
    """Masked MLA-absorb attention of every tree node over its prefix and ancestors (GPU).

    Parameters
    ----------
    q_latent, q_rope, kv_cache, block_table, prefix_lens, visibility_bits, num_nodes : array
        As in :func:`ddtree_numba.reference.verify_attn` (numpy or device arrays);
        ``Dc <= 512``.
    sm_scale : float
        The model's softmax scale (required; see ``reference.deepseek_sm_scale``).
    check : bool, optional
        Value checks (pages, visibility rows). Default: on for numpy inputs only.
    variant : str, optional
        ``"tiled"`` (GPU default) or ``"readable"`` (simulator default).
    splits : int, optional
        Slot splits of the tiled variant (default: enough blocks to fill the GPU).
    out : tuple, optional
        Preallocated ``(out_latent, lse)`` device arrays.
    workspace : tuple, optional
        Split partials of the tiled variant
        (:func:`~ddtree_numba.kernels.allocate_workspace`); required for CUDA
        graph capture, allocated per call otherwise.

    Returns
    -------
    tuple
        ``out_latent`` ``float32[bs, N, H, Dc]`` and ``lse`` ``float32[bs, N, H]`` on device.
    """
    sz = check_verify_attn(q_latent, q_rope, kv_cache, block_table, prefix_lens,
                           visibility_bits, num_nodes, sm_scale, check=check)
    if sz.Dc > MAX_DC:
        raise ValueError(f"q_latent: expected Dc <= {MAX_DC}, got Dc = {sz.Dc}")
    variant = resolve_variant(variant, readable="readable", fast="tiled")
    kind = storage_kind(kv_cache)
    if SIMULATOR and kind == "bfloat16":        # no bf16 on the simulator: widen exactly
        kv_cache = np.asarray(kv_cache).astype(np.float32)
        kind = "float32"
    ql, qr = as_device(q_latent), as_device(q_rope)
    cache = as_device(kv_cache)
    if kind == "bfloat16":
        cache = cache.view(np.uint16)
    if variant == "tiled" and sz.Dc % 2 == 0 and sz.Dr % 2 == 0:   # value pairs: one load
        if kind == "bfloat16":
            cache, kind = cache.view(np.uint32), "bfloat16x2"
        elif kind == "float32":
            cache, kind = cache.view(np.uint64), "float32x2"
    table, prefix = as_device(block_table), as_device(prefix_lens)
    bits, nodes = as_device(visibility_bits), as_device(num_nodes)
    if out is None:
        out_latent = device_empty((sz.bs, sz.N, sz.H, sz.Dc), np.float32)
        lse = device_empty((sz.bs, sz.N, sz.H), np.float32)
    else:
        out_latent, lse = out
    if sz.bs == 0:
        return out_latent, lse
    stream = launch_stream()
    args = (ql, qr, cache, table, prefix, bits, nodes, np.float32(sm_scale))
    if variant == "readable":
        rows = sz.bs * sz.N * sz.H
        launch(_kernel("readable", kind), (rows + READABLE_THREADS - 1) // READABLE_THREADS,
               READABLE_THREADS, stream)(*args, out_latent, lse)
        return out_latent, lse
    n_splits, per_split = plan_splits(sz.bs, sz.N, sz.H, sz.max_pages * sz.page_size, splits)
    if workspace is None:
        workspace = allocate_workspace(sz.bs, sz.N, sz.H, sz.Dc,
                                       sz.max_pages * sz.page_size, splits)
    part_out, part_lse = workspace
    want = (n_splits, sz.bs, sz.N * sz.H, sz.Dc)
    if tuple(part_out.shape) != want or tuple(part_lse.shape) != want[:3]:
        raise ValueError(f"workspace: expected float32{list(want)} and float32{list(want[:3])} "
                         f"(allocate_workspace), got {list(part_out.shape)} and "
                         f"{list(part_lse.shape)}")
    row_tiles = -(-sz.N * sz.H // BM)
    flats = (ql.reshape(ql.size), qr.reshape(qr.size), cache.reshape(cache.size))
    launch(_kernel("tiled", kind), (n_splits, row_tiles, sz.bs), TILED_THREADS, stream)(
        *args, per_split, part_out, part_lse, *flats)
    launch(_merge_kernel, (sz.N * sz.H, sz.bs), 128, stream)(
        part_out, part_lse, nodes, out_latent, lse)
    return out_latent, lse


def build_specs():
    """Specialisations launched by :func:`verify_attn` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    f4 = types.float32[:, :, :, ::1]
    i1, i2 = types.int32[::1], types.int32[:, ::1]
    bits = types.uint32[:, :, ::1]
    specs = []
    for kind, dtype in (("float32", types.float32), ("bfloat16", types.uint16)):
        common = (f4, f4, dtype[:, :, ::1], i2, i1, bits, i1, types.float32)
        specs.append(KernelSpec("verify_attn", f"readable {kind}", _kernel("readable", kind),
                                (*common, f4, types.float32[:, :, ::1]), READABLE_THREADS,
                                False))
        specs.append(KernelSpec("verify_attn", f"tiled {kind}", _kernel("tiled", kind),
                                (*common, types.int64, f4, types.float32[:, :, ::1],
                                 types.float32[::1], types.float32[::1], dtype[::1]),
                                TILED_THREADS, True))
    packed = (f4, f4, types.uint32[:, :, ::1], i2, i1, bits, i1, types.float32, types.int64, f4,
              types.float32[:, :, ::1], types.float32[::1], types.float32[::1],
              types.uint32[::1])
    specs.append(KernelSpec("verify_attn", "tiled bfloat16x2", _kernel("tiled", "bfloat16x2"),
                            packed, TILED_THREADS, True))
    pairs = (*packed[:2], types.uint64[:, :, ::1], *packed[3:-1], types.uint64[::1])
    specs.append(KernelSpec("verify_attn", "tiled float32x2", _kernel("tiled", "float32x2"),
                            pairs, TILED_THREADS, True))
    specs.append(KernelSpec("verify_attn", "merge", _merge_kernel,
                            (f4, types.float32[:, :, ::1], i1, f4, types.float32[:, :, ::1]),
                            128, True))
    return specs
