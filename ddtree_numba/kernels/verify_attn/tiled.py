"""Variant ``"tiled"`` of ``kernels.verify_attn``: the fast kernel (GPU only).

The ``N * H`` query rows of a request are flattened (``row = i * H + h``) and cut into tiles
of ``BM = 32`` rows; the slots ``[0, max_pages * page_size)`` (the block table's capacity:
known on the host without a synchronisation) are cut into ``splits`` equal ranges (a split
past ``P + num_nodes`` writes an empty partial)
(flash-decoding: enough blocks to fill the GPU even at bs = 1; the count minimises waves x tile
times, ``splits.choose_splits``). Grid ``(splits, ceil(N H / 32), bs)``, 256
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

Rows a query cannot see (the contract: they may hold anything, NaN included). A block reads
block-table entries and cache rows only for slots ``t < P + num_nodes`` (slot offsets are
clamped to the last one; slots past it are fetched as zeros, never loaded), so padding slots,
unused pages and table entries past them are never touched. Inside ``[P, P + num_nodes)`` a
tile holds tree slots that some of its 32 rows may not see: their values are staged for all
rows, and two places must keep them out of an invisible row's result:

* scores: a masked score is replaced by ``-inf`` with a select (``s if visible else -inf``),
  never computed from the raw dot product (a NaN score would also poison the row max);
* ``O += P C``: the row's ``p = 0``, but ``0 * NaN = NaN``. Selecting per product would cost
  the hot loop, so the latent values of a sub-tile that holds tree slots are made finite
  when staged (``_finite4``: NaN and +-inf become 0, by bit masks; a compare and select per
  value would run out of predicate registers and spill in the one-value-per-load variants).
  A row that sees such a slot sees NaN in its score anyway (its output is NaN, as in the
  reference); only a visible +-inf latent value with a finite score is read as 0.

Cost: 16 values per thread (5 integer operations each in the PTX, about 85 instructions with
the branch) in the sub-tiles that hold tree slots, behind a block-uniform branch; a sub-tile
costs about 1 250 instructions per thread (its 8 slots of both products). At most
``ceil(N / 8) + 1`` of a request's ``(P + N) / 8`` sub-tiles pay it: N = 16, P = 1024: 3 of
130, about 0.2 %; short prefixes pay more (N = 64, P = 100: 9 of 21, about 3 %). Prefix
sub-tiles are staged exactly as before. Registers on sm_90: 251 for the paired variants
(unchanged), 255 without spills for the one-value-per-load ones (252 before).

Each block writes an unnormalised partial ``(out / l, m + log l)`` of its split;
``ddtree_numba.kernels.verify_attn.splits`` chooses the splits and merges the partials.

Resources (``python -m ddtree_numba build-report``): 251-255 registers on sm_90 and sm_120, no
spills, 40 576 bytes of static shared memory (Q chunk 4.5 KiB, K chunk / ``P^T`` 18 KiB,
latent sub-tile 16 KiB, slot offsets 1 KiB): one block of 8 warps per SM. Measured on the H200: 25.6
TFLOP/s (float32 cache) and 26.9 (bfloat16) at long prefixes, 51-53 % of cuBLAS SGEMM (v4: 9.7,
19 %); what bounds it is two warps per scheduler against shared-memory latency and FMA chains.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, uint32, uint64

from ...limits import MAX_DC
from .._device import CACHE_KERNELS, SIMULATOR
from .._primitives import bits_to_float, float_to_bits, warp_max_f32, warp_sum_f32
from .readable import NEG_INF, _make_widen, _visible

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
else:           # the element type of float32x4 arrays (cuda.float32x4 itself builds values)
    from numba.cuda.vector_types import vector_types

    F32X4 = vector_types["float32x4"]
# Values are built as ``cuda.float32x4(...)``, never through a global ``float32x4``: numba's
# on-disk cache keys a kernel by a pickle of its closure, which takes in the globals of the
# device functions it holds, and the ``float32x4`` class pickles by value under an identity
# drawn in each process, so no process would load another's compilation of these kernels
# (the module ``cuda`` pickles by name). ``F32X4`` is such an object too: only the kernel's
# own body uses it (its globals are not in the key), never a device function the kernel's
# closure holds. tests/test_kernel_cache.py checks the keys.


@cuda.jit(device=True, inline="always")
def _unpack_bf16x2(word):
    """Two bfloat16 values packed in a uint32 (little endian: element 2e in the low half)."""
    word = uint32(word)
    return (bits_to_float(word << uint32(16)),
            bits_to_float(word & uint32(0xFFFF0000)))


@cuda.jit(device=True, inline="always")
def _finite(x):
    """``x``, or 0 if it is not finite (exponent all ones: NaN, +-inf), by bit masks alone."""
    bits = float_to_bits(x)
    # adding one to the exponent carries into bit 31 only when the exponent is all ones
    top = ((bits & uint32(0x7F800000)) + uint32(0x00800000)) >> uint32(31)   # 1: not finite
    return bits_to_float(bits & (top - uint32(1)))


@cuda.jit(device=True, inline="always")
def _finite4(v):
    """``v`` with every value that is not finite (NaN, +-inf) replaced by 0."""
    return cuda.float32x4(_finite(v.x), _finite(v.y), _finite(v.z), _finite(v.w))


@cuda.jit(device=True, inline="always")
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


@cuda.jit(device=True, inline="always")
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


@cuda.jit(device=True, inline="always")
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


@cuda.jit(device=True, inline="always")
def _softmax_row(soft, m, l, alpha, r, row, H, NH, n, bits, b, t0, t_end, P, lane, sm_scale):
    """All 32 lanes of the warp, with the same ``r`` (full-mask shuffles). Steps 2 and 3
    for row ``r`` of this warp's quad (``row`` is its flat query row): mask
    and scale its 4 scores of this lane (slots ``t0 + lane + 32 k``), then the online softmax
    update of its running max ``m[r]`` and sum ``l[r]``; ``alpha[r]`` gets the factor that
    rescales the row's earlier output. Every call passes a literal ``r``, so ``soft``, ``m``,
    ``l`` and ``alpha`` stay in registers whatever the compiler's unrolling decides (a loop over
    ``r`` that CUDA 13.0's NVVM left rolled for sm_120 put them on the stack)."""
    node = row // H
    row_valid = row < NH and node < n
    tile_max = NEG_INF
    for k in range(4):
        t = t0 + lane + 32 * k
        ok = row_valid and t < t_end and (t < P or _visible(bits, b, node, t - P))
        sk = soft[4 * r + k] * sm_scale if ok else NEG_INF     # a select: NaN never mixes in
        soft[4 * r + k] = sk
        tile_max = max(tile_max, sk)
    tile_max = warp_max_f32(tile_max)               # the row's max over the warp's 128 slots
    m_new = max(m[r], tile_max)
    rescale = float32(1.0)
    if m_new > NEG_INF:
        rescale = math.exp(m[r] - m_new) if m[r] > NEG_INF else float32(0.0)
    tile_sum = float32(0.0)
    for k in range(4):
        p = math.exp(soft[4 * r + k] - m_new) if m_new > NEG_INF else float32(0.0)
        soft[4 * r + k] = p
        tile_sum += p
    tile_sum = warp_sum_f32(tile_sum)               # the row's sum over the warp's 128 slots
    l[r] = l[r] * rescale + tile_sum
    m[r] = m_new
    alpha[r] = rescale


@cuda.jit(device=True, inline="always")
def _finish_row(m, l, alpha, r, row, NH, lane, part_lse, split, b):
    """Row ``r`` of this warp's quad at the end of the split: ``alpha[r] = 1 / l`` (0 for a
    row that saw nothing) and, from lane 0, the partial log-sum-exp ``m + log l``."""
    alpha[r] = float32(1.0) / l[r] if l[r] > 0 else float32(0.0)
    if lane == 0 and row < NH:
        part_lse[split, b, row] = m[r] + math.log(l[r]) if l[r] > 0 else NEG_INF


def _make_tiled_kernel(kind: str):
    # Even widths: the cache is read two values per load, "bfloat16x2" viewed as uint32 and
    # "float32x2" as uint64 words (half the loads and address arithmetic)
    packed = kind == "bfloat16x2"
    pairs = kind == "float32x2"
    widen1 = _make_widen("bfloat16" if packed else kind)   # one element, unpacked

    # Global reads go through flat 1-D views with unsigned offsets: the row offset of each slot
    # of the tile is computed once (slot_off), so a read is one add and one load (a 3-D signed
    # index costs numba ~20 instructions: 64-bit multiplies and negative-index wraparound).
    @cuda.jit(device=True, inline="always")
    def fetch4(flat, row_off, ok, d, width):
        """Values ``d .. d + 3`` of one cache row (0 past ``width`` or if not ``ok``), *in
        flight*: a float32x4 of the values, or for packed bf16 (``d``, ``width`` even) the two
        raw 32-bit words as bit patterns in ``.x`` and ``.y``. Nothing here reads a loaded
        value, so the load's latency is paid only where :func:`widen4` stages it."""
        if pairs:                       # splitting a 64-bit word costs no instruction
            half = row_off + (uint64(d) >> uint64(1))
            w0 = flat[half] if ok and d < width else uint64(0)
            w1 = flat[half + uint64(1)] if ok and d + 2 < width else uint64(0)
            return cuda.float32x4(bits_to_float(uint32(w0 & uint64(0xFFFFFFFF))),
                                  bits_to_float(uint32(w0 >> uint64(32))),
                                  bits_to_float(uint32(w1 & uint64(0xFFFFFFFF))),
                                  bits_to_float(uint32(w1 >> uint64(32))))
        if packed:
            half = row_off + (uint64(d) >> uint64(1))
            w0 = flat[half] if ok and d < width else uint32(0)
            w1 = flat[half + uint64(1)] if ok and d + 2 < width else uint32(0)
            return cuda.float32x4(bits_to_float(w0), bits_to_float(w1), float32(0.0), float32(0.0))
        v = cuda.local.array(4, float32)
        for e in range(4):
            v[e] = widen1(flat[row_off + uint64(d + e)]) if ok and d + e < width else float32(0.0)
        return cuda.float32x4(v[0], v[1], v[2], v[3])

    @cuda.jit(device=True, inline="always")
    def widen4(v):
        """The 4 float32 values of a :func:`fetch4` result (packed bf16: split the words)."""
        if packed:
            lo0, hi0 = _unpack_bf16x2(float_to_bits(v.x))
            lo1, hi1 = _unpack_bf16x2(float_to_bits(v.y))
            return cuda.float32x4(lo0, hi0, lo1, hi1)
        return v

    @cuda.jit(device=True, inline="always")
    def fetch_q4(ql_flat, qr_flat, off_l, off_r, ok, d, Dc, D):
        """Dims ``d .. d + 3`` of one query row ``[q_latent | q_rope]`` as a float32x4."""
        v = cuda.local.array(4, float32)
        for e in range(4):
            dd = d + e
            x = float32(0.0)
            if ok and dd < D:
                x = ql_flat[off_l + uint64(dd)] if dd < Dc else qr_flat[off_r + uint64(dd - Dc)]
            v[e] = x
        return cuda.float32x4(v[0], v[1], v[2], v[3])

    @cuda.jit(device=True, inline="always")
    def fetch_c(flat, slot_off, t_valid, sub, Dc, tid, c_next):
        """Global -> registers: this thread's 4 vectors of the latent sub-tile at slots
        ``sub ..``: slot ``sub + tid // 128 + 2 j``, columns ``4 (tid % 128) ..`` (128 =
        ``COL4``, the vectors of a latent row; 2 = ``TILED_THREADS // COL4``, the rows the
        block stages at once)."""
        for j in range(4):
            ss = sub + tid // 128 + 2 * j
            c_next[j] = fetch4(flat, slot_off[ss], ss < t_valid, 4 * (tid % 128), Dc)

    @cuda.jit(cache=CACHE_KERNELS)
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
        soft_row = row0 + 16 * (warp // 4) + warp % 4     # its row r is soft_row + 4 r

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
            cuda.syncthreads()                  # the previous tile is done with slot_off and
                                                # with P^T (in k_s)
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
                k_s[(32 * (warp % 4) + lane_b + 8 * k) * ROW4 + quad] = cuda.float32x4(
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
            _softmax_row(soft, m, l, alpha, 0, soft_row, H, NH, n, bits, b, t0, t_end, P, lane,
                         sm_scale)
            _softmax_row(soft, m, l, alpha, 1, soft_row + 4, H, NH, n, bits, b, t0, t_end, P,
                         lane, sm_scale)
            _softmax_row(soft, m, l, alpha, 2, soft_row + 8, H, NH, n, bits, b, t0, t_end, P,
                         lane, sm_scale)
            _softmax_row(soft, m, l, alpha, 3, soft_row + 12, H, NH, n, bits, b, t0, t_end, P,
                         lane, sm_scale)
            for k in range(4):                  # each lane rewrites the vectors it read
                k_s[(lane + 32 * k) * ROW4 + warp] = cuda.float32x4(soft[k], soft[4 + k],
                                                                    soft[8 + k], soft[12 + k])
            if lane == 0:
                alpha_s[warp] = cuda.float32x4(alpha[0], alpha[1], alpha[2], alpha[3])
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
                if t0 + sub + VSLOTS > P:       # tree slots: rows some node may not see
                    for j in range(4):          # stage latent rows sub .. sub + 7, finite
                        c_s[(tid // 128 + 2 * j) * COL4 + tid % 128] = _finite4(
                            widen4(c_next[j]))
                else:                           # prefix slots: every valid row sees them
                    for j in range(4):          # stage latent rows sub .. sub + 7
                        c_s[(tid // 128 + 2 * j) * COL4 + tid % 128] = widen4(c_next[j])
                cuda.syncthreads()              # latent rows staged before the products
                if sub + VSLOTS < tile_slots:   # the next sub-tile is fetched meanwhile
                    fetch_c(flat, slot_off, t_valid, sub + VSLOTS, Dc, tid, c_next)
                p_sub = p_mine[sub * ROW4:]
                _unrolled8(_weighted_slot, p_sub, c_mine, acc)  # slots past t_end have p = 0
        # partial result of this split: output / l and its log-sum-exp m + log l
        cuda.syncthreads()                      # the last tile is done with alpha_s
        _finish_row(m, l, alpha, 0, soft_row, NH, lane, part_lse, split, b)
        _finish_row(m, l, alpha, 1, soft_row + 4, NH, lane, part_lse, split, b)
        _finish_row(m, l, alpha, 2, soft_row + 8, NH, lane, part_lse, split, b)
        _finish_row(m, l, alpha, 3, soft_row + 12, NH, lane, part_lse, split, b)
        if lane == 0:
            alpha_s[warp] = cuda.float32x4(alpha[0], alpha[1], alpha[2], alpha[3])
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


#: ``kernel(kind)``: the tiled kernel for one storage kind, made (and compiled) once per kind.
kernel = functools.cache(_make_tiled_kernel)
