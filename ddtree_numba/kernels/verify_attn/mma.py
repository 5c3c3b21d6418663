"""Variant ``"mma"`` of ``kernels.verify_attn``: tensor cores (``mma.sync``) for 16-bit caches.

GPU only, compute capability 8.0 and up (A100, H100/H200, RTX PRO 6000 Blackwell), bfloat16 or
float16 caches with ``Dc`` and ``Dr`` multiples of 16 (DeepSeek-V3 and Kimi-K2: 512 and 64).
The products run on the tensor cores through ``kernels/tensor_core.cu``; everything else is
numba. Read the fragment maps first (``ddtree_numba.reference.mma_fragments``: which lane holds
which element of A, B and C).

Launch: grid ``(splits, ceil(N H / 16), bs)``, 128 threads = 4 warps. A block owns ``BM = 16``
query rows of one request (``row = i H + h``: heads of one node, or of neighbouring nodes,
share the block) and one split of its slots (``splits.prefix_split_slots``: the split size
depends only on the request's own prefix length, so a row's result never depends on what
else shares the launch or on the GPU's SM count). All 16 rows read the same 576-wide cache rows.

Per tile of ``BN = 16`` slots (the cache rows arrive by ``cp.async`` into one of two shared
buffers while the tile before is being computed: a two-stage pipeline):

1. ``S = Q K^T`` (16 rows x 16 slots over the 576 dims, 36 k-steps of 16). The k-steps are
   dealt to the warps round-robin (warp ``w`` takes ``w, w + 4, ...``), so each warp holds
   the A fragments of *its* k-steps of the 16 query rows in registers for the whole split
   (9 k-steps x 4 registers: all 36 would not fit beside the output) and reads each cache
   element of the tile exactly once (``ldmatrix.x4``: 16 slots x 16 dims per instruction,
   two ``mma`` per read).
2. The four warps' partial scores meet in shared memory and every warp sums the same four in
   the same order (warp 0 first: deterministic), for the 8 scores its lanes hold in the C
   layout (rows ``g`` and ``g + 8``, columns ``2t, 2t + 1, 2t + 8, 2t + 9``). Scale (into base
   2: ``exp2`` is one instruction) and, only in tiles that hold tree slots or the split's end,
   mask. Online softmax per row: the row max is a max over the lane's 4 values and two shuffles
   within its quad of lanes, the row sum stays per lane until the end; the output is rescaled
   only when some row max of the warp grew (a warp vote), which after the first tiles of a
   long prefix is rare.
3. ``O += P V``: the probabilities, rounded to 16 bits, are packed straight from the score
   registers into A fragments (the C-to-A identity, ``mma_fragments.c_to_a``). V is the first
   ``Dc`` columns of the same staged rows, read with ``ldmatrix.x4.trans``. Warp ``w`` owns the
   output columns of 16-column groups ``w, w + 4, ...`` (128 columns: 64 float32 accumulators
   per lane) of all 16 rows.

Which thread touches which byte:

* staging: thread ``tid`` copies slot ``tid // 8`` of the tile, 16-byte chunks ``tid % 8,
  tid % 8 + 8, ...`` of its row (8 neighbouring threads: 128 contiguous bytes). A slot past
  the split's end or with a block-table entry outside the cache is filled with zeros by
  ``cp.async`` itself (source size 0: nothing is read);
* shared memory: ``kv`` = two tiles of 16 rows, each ``D + 8`` values wide (16 bytes of padding
  per row, so the 8 rows an ``ldmatrix`` reads at once start in 8 different bank groups);
  ``partial`` = each lane's 8 partial scores as two float32x4 at ``2 (32 w + lane)`` and ``+ 1``
  (left and right tile; swapped when bit 2 of the lane is set, so that the 8 lanes of one
  128-byte phase of a vector store or load hit 8 different 16-byte bank groups);
* output: lane ``4 g + t`` of warp ``w`` writes rows ``g`` and ``g + 8``, columns ``16 c + 2t,
  + 1, + 8, + 9`` of its groups ``c`` of ``part_out``; warp 0's lanes ``t = 0`` write the rows'
  ``part_lse``. ``splits.merge`` combines the splits.

Barriers per tile: one after the tile has landed (every thread waited for its own copies; the
barrier makes all of them visible, and certifies that no warp still reads the buffer the next
copies will overwrite), one after the partial scores are written.

Rows a query cannot see: their scores become ``-inf`` by a select, and in tiles that hold tree
slots the V fragments are made finite (NaN and +-inf bit patterns become 0) before ``P V``,
since ``0 * NaN`` is NaN on the tensor cores too. Cache rows past ``P + num_nodes`` are never
read. Unchecked inputs (``check=False``) are clamped: ``num_nodes`` to ``[0, N]``,
``prefix_lens`` to ``[0, capacity]``, slots to the block table's capacity, pages to the cache.

Resources (``python -m ddtree_numba build-report``): launch bounds of 3 blocks per SM cap the
registers at 168, without spills on sm_90 and sm_120; 41 472 bytes of static shared memory
(two tiles of 18.7 KB, 4 KB of partial scores). The SASS of the tile loop holds the 34 HMMA and
17 LDSM, no CALL (the few CALLs of the kernel are outside the tile loop: the float32 division
slow path of ``1 / l`` after it, and on sm_120 a 64-bit division and remainder before it) and
no local memory.

Precision: the cache is already 16-bit; the query rows are rounded to the cache's type when
loaded, and the probabilities when packed for ``P V`` (as FlashAttention and FlashMLA do);
products accumulate in float32, softmax in float32.
"""

from __future__ import annotations

import functools
import math

import cffi
from numba import cuda, float32, uint16, uint32, uint64
from numba.cuda import float32x4

from .. import tensor_core as tc
from .._device import SIMULATOR
from .readable import NEG_INF
from .splits import prefix_split_slots

MMA_THREADS = 128   # 4 warps
WARPS = MMA_THREADS // 32
BLOCKS_PER_SM = 3   # launch bounds: at most 168 registers, so 3 blocks (12 warps) fit an sm_90
                    # SM (on sm_120 shared memory allows 2 whatever the registers)
BM = 16             # query rows per block: the M of one mma
BN = 16             # slots per staged tile: the N of two score mma, the K of the P V mma
PARTIALS = WARPS * 32 * 2   # float32x4 partial scores: per warp, per lane, left and right
FULL_MASK = 0xFFFFFFFF
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_ffi = cffi.FFI()
if SIMULATOR:   # no vector element type on the simulator (the variant is GPU-only anyway)
    F32X4 = None
else:
    from numba.cuda.vector_types import vector_types

    F32X4 = vector_types["float32x4"]


def supported(kind: str, Dc: int, Dr: int) -> bool:
    """Whether the mma variant handles a ``kind`` cache of ``Dc + Dr`` wide rows."""
    return kind in ("bfloat16", "float16") and Dc % 16 == 0 and Dr % 16 == 0 and Dc > 0


def _make_mma_kernel(kind: str, Dc: int, Dr: int):
    D = Dc + Dr
    KSTEPS = D // 16                    # k-steps of 16 dims in a score
    KQ = -(-KSTEPS // WARPS)            # k-steps per warp (round-robin; some warps one fewer)
    Q_REGS = 4 * KQ                     # A-fragment registers of the query rows, per lane
    GROUPS = Dc // 16                   # 16-column groups of the output (two n-tiles each)
    GQ = -(-GROUPS // WARPS)            # groups per warp
    O_VALUES = 8 * GQ                   # float32 accumulators of the output, per lane
    ROW = D + 8                         # staged row stride in 16-bit values (+16 bytes)
    TILE = BN * ROW                     # one staged tile, in 16-bit values
    KV_VALUES = 2 * TILE                # both buffers (shared shapes must be plain constants)
    CHUNKS = D // 8                     # 16-byte chunks per cache row
    CHUNK_STEPS = -(-CHUNKS // 8)       # chunks per staging thread
    ROW_BYTES = 2 * D
    mma = tc.mma_bf16_16816 if kind == "bfloat16" else tc.mma_f16_16816
    pack = tc.pack_bf16x2 if kind == "bfloat16" else tc.pack_f16x2
    EXPONENT = uint32(0x7F80 if kind == "bfloat16" else 0x7C00)   # all ones: NaN or +-inf

    @cuda.jit(device=True, inline=True)
    def finite_pair(word):
        """Both 16-bit values of ``word`` with NaN and +-inf replaced by 0."""
        low = uint32(0) if word & EXPONENT == EXPONENT else uint32(0x0000FFFF)
        high = uint32(0) if (word >> uint32(16)) & EXPONENT == EXPONENT else uint32(0xFFFF0000)
        return word & (low | high)

    @cuda.jit(device=True, inline=True)
    def query_pair(q_latent, q_rope, b, i, h, d, valid):
        """Query values ``d, d + 1`` of node ``i``, head ``h``, rounded to 16 bits, packed."""
        if not valid:
            return uint32(0)
        if d < Dc:
            return pack(q_latent[b, i, h, d], q_latent[b, i, h, d + 1])
        return pack(q_rope[b, i, h, d - Dc], q_rope[b, i, h, d - Dc + 1])

    @cuda.jit(device=True, inline=True)
    def summed_scores(partial, lane, half):
        """This lane's 4 scores of the left (``half`` 0) or right tile: the four warps'
        partials for the same lane and half (the same elements), warp 0 first."""
        h = half ^ ((lane >> 2) & 1)            # the swizzle of the writes (see there)
        a = partial[(0 * 32 + lane) * 2 + h]
        b = partial[(1 * 32 + lane) * 2 + h]
        c = partial[(2 * 32 + lane) * 2 + h]
        d = partial[(3 * 32 + lane) * 2 + h]
        return (((a.x + b.x) + c.x) + d.x, ((a.y + b.y) + c.y) + d.y,
                ((a.z + b.z) + c.z) + d.z, ((a.w + b.w) + c.w) + d.w)

    @cuda.jit(device=True, inline=True)
    def masked(s, scale2, bits, b, i, slot, P, hi):
        """``scale2 * s`` if row ``i`` sees ``slot``, else ``-inf`` (a select: a NaN score of
        an invisible slot never reaches the row)."""
        visible = slot < hi
        if visible and slot >= P:
            j = uint32(slot - P)
            visible = (bits[b, i, j // uint32(32)] >> (j % uint32(32))) & uint32(1) != 0
        return s * scale2 if visible else NEG_INF

    @cuda.jit(device=True, inline=True)
    def softmax_step(m, l, s0, s1, s2, s3):
        """One row's online-softmax update from the 4 scores of this lane (the quad holds the
        row's 16), in base 2 (scores are pre-multiplied by ``log2 e``):
        ``(m, l, rescale, p0..p3)``; ``l`` stays a per-lane partial sum."""
        mx = max(max(s0, s1), max(s2, s3))
        mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 1))
        mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 2))
        m_new = max(m, mx)
        if m_new == NEG_INF:                    # nothing visible yet: all stays 0
            return m, l, float32(1.0), float32(0.0), float32(0.0), float32(0.0), float32(0.0)
        rescale = math.exp2(m - m_new)          # exp2(-inf) = 0 on the first visible slot
        p0 = math.exp2(s0 - m_new)
        p1 = math.exp2(s1 - m_new)
        p2 = math.exp2(s2 - m_new)
        p3 = math.exp2(s3 - m_new)
        return m_new, l * rescale + ((p0 + p1) + (p2 + p3)), rescale, p0, p1, p2, p3

    @cuda.jit(device=True, inline=True)
    def stage(kv_base, buf, cache_flat, block_table, b, tile_start, hi, page_size, num_pages,
              tid):
        """Issue the copies of one tile (16 slots) into buffer ``buf``; slots at or past
        ``hi`` and pages outside the cache become zero rows without being read."""
        slot = tile_start + tid // 8
        nbytes = uint32(0)
        offset = uint64(0)
        if slot < hi:                           # (unsigned 32-bit division: no 64-bit call)
            page = block_table[b, uint32(slot) // uint32(page_size)]
            if 0 <= page < num_pages:
                nbytes = uint32(16)
                offset = (uint64(page) * uint64(page_size) + uint64(uint32(slot)
                          % uint32(page_size))) * uint64(ROW_BYTES)
        first = tid % 8                         # chunks first, first + 8, ... of the row
        dst = kv_base + uint32(2 * (buf * TILE + (tid // 8) * ROW) + 16 * first)
        offset += uint64(16 * first)
        src = _ffi.from_buffer(cache_flat)
        for u in range(CHUNK_STEPS):
            if CHUNKS % 8 == 0 or first + 8 * u < CHUNKS:     # (folds away when even)
                tc.cp_async_16(dst + uint32(128 * u), src, offset + uint64(128 * u), nbytes)
        tc.cp_async_commit()

    @cuda.jit(launch_bounds=(MMA_THREADS, BLOCKS_PER_SM))
    def mma_kernel(q_latent, q_rope, cache, block_table, prefix_lens, bits, num_nodes, sm_scale,
                   part_out, part_lse, cache_flat):
        kv = cuda.shared.array(KV_VALUES, uint16, alignment=16)  # two staged tiles (16 B:
        #                                                          cp.async and ldmatrix rows)
        partial = cuda.shared.array(PARTIALS, F32X4, alignment=16)   # [warp, lane, half]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4                           # C layout: rows g and g + 8 ...
        t = lane % 4                            # ... columns 2t, 2t + 1, 2t + 8, 2t + 9
        split = cuda.blockIdx.x
        row0 = cuda.blockIdx.y * BM
        b = cuda.blockIdx.z
        N = q_latent.shape[1]
        H = q_latent.shape[2]
        rows = N * H
        num_pages = cache.shape[0]
        page_size = cache.shape[1]
        capacity = block_table.shape[1] * page_size
        n = min(max(num_nodes[b], 0), N)        # clamped: unchecked inputs stay in bounds
        P = min(max(prefix_lens[b], 0), capacity)
        end = min(P + n, capacity)
        per_split = prefix_split_slots(P)
        lo = split * per_split                  # this block's slots: [lo, hi)
        hi = min(lo + per_split, end)
        if lo >= hi or row0 >= n * H:           # no slot here, or only padding rows:
            return                              # the merge reads neither

        # The A fragments of this warp's k-steps of the 16 query rows, for the whole split.
        rg = row0 + g                           # flat rows of this lane: rg and rg + 8
        rg8 = rg + 8
        ig = uint32(min(rg, rows - 1)) // uint32(H)     # their nodes and heads (clamped:
        hg = uint32(min(rg, rows - 1)) % uint32(H)      # rows past N H load zeros and are
        ig8 = uint32(min(rg8, rows - 1)) // uint32(H)   # never written)
        hg8 = uint32(min(rg8, rows - 1)) % uint32(H)
        ok_g = rg < rows
        ok_g8 = rg8 < rows
        qa = cuda.local.array(Q_REGS, uint32)
        for kk in range(KQ):
            d = 16 * (warp + WARPS * kk) + 2 * t
            ok = d < D
            qa[4 * kk + 0] = query_pair(q_latent, q_rope, b, ig, hg, d, ok and ok_g)
            qa[4 * kk + 1] = query_pair(q_latent, q_rope, b, ig8, hg8, d, ok and ok_g8)
            qa[4 * kk + 2] = query_pair(q_latent, q_rope, b, ig, hg, d + 8, ok and ok_g)
            qa[4 * kk + 3] = query_pair(q_latent, q_rope, b, ig8, hg8, d + 8, ok and ok_g8)

        # ldmatrix addresses (bytes from a tile's start) that this lane provides:
        # scores: row lane % 8 of matrix lane // 8 = slots 0-7 | 8-15, dims +0 | +8 of a k-step
        k_lane = 2 * ((lane % 8 + 8 * (lane // 16)) * ROW + 8 * ((lane // 8) % 2))
        # P V (.trans): matrix lane // 8 = slots 0-7 | 8-15, columns +0 | +8 of a group
        v_lane = 2 * ((lane % 8 + 8 * ((lane // 8) % 2)) * ROW + 8 * (lane // 16))
        kv_base = tc.shared_address(_ffi.from_buffer(kv))
        scale2 = sm_scale * float32(LOG2E)      # scores in base 2: exp2 is one instruction

        o = cuda.local.array(O_VALUES, float32)
        for k in range(O_VALUES):
            o[k] = 0.0
        s_left = cuda.local.array(4, float32)   # scores of slots 0-7 of the tile (C layout)
        s_right = cuda.local.array(4, float32)  # scores of slots 8-15
        frag = cuda.local.array(4, uint32)      # one ldmatrix.x4
        m_g = NEG_INF                           # running max of rows rg, rg8
        m_g8 = NEG_INF
        l_g = float32(0.0)                      # running sums, this lane's columns only
        l_g8 = float32(0.0)

        tiles = (hi - lo + BN - 1) // BN
        stage(kv_base, 0, cache_flat, block_table, b, lo, hi, page_size, num_pages, tid)
        for j in range(tiles):
            buf = j % 2
            tile_start = lo + BN * j
            tc.cp_async_wait_all()              # this thread's copies of tile j have landed
            cuda.syncthreads()                  # everyone's have; nobody reads tile j - 1
            if j + 1 < tiles:                   # its buffer now takes tile j + 1
                stage(kv_base, 1 - buf, cache_flat, block_table, b, tile_start + BN, hi,
                      page_size, num_pages, tid)
            tile = kv_base + uint32(2 * buf * TILE)

            # 1. partial scores of this warp's k-steps: 16 rows x 16 slots
            for k in range(4):
                s_left[k] = 0.0
                s_right[k] = 0.0
            for kk in range(KQ):
                ks = warp + WARPS * kk
                if KSTEPS % WARPS == 0 or ks < KSTEPS:      # (folds away when even)
                    tc.ldmatrix_x4(_ffi.from_buffer(frag), tile + uint32(k_lane + 32 * ks))
                    mma(_ffi.from_buffer(s_left), qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2],
                        qa[4 * kk + 3], frag[0], frag[1])
                    mma(_ffi.from_buffer(s_right), qa[4 * kk], qa[4 * kk + 1],
                        qa[4 * kk + 2], qa[4 * kk + 3], frag[2], frag[3])
            # this lane's 8 partial scores, in its own C-layout order: conflict-free vectors
            # lane L's two vectors sit at 2 (32 w + L) and + 1, swapped when bit 2 of L is
            # set: the 8 lanes of one 128-byte phase then fill 8 different 16-byte banks
            swap = (lane >> 2) & 1
            partial[(warp * 32 + lane) * 2 + swap] = float32x4(s_left[0], s_left[1],
                                                               s_left[2], s_left[3])
            partial[(warp * 32 + lane) * 2 + (1 - swap)] = float32x4(s_right[0], s_right[1],
                                                                     s_right[2], s_right[3])
            cuda.syncthreads()                  # all four warps' partials are written

            # 2. full scores (base 2), mask, online softmax (rows rg: x, rg8: y)
            x0, x1, y0, y1 = summed_scores(partial, lane, 0)   # slots c, c+1 (left tile)
            x2, x3, y2, y3 = summed_scores(partial, lane, 1)   # slots c+8, c+9 (right)
            if tile_start + BN <= P and tile_start + BN <= hi:
                x0 *= scale2                    # an interior prefix tile: every row sees
                x1 *= scale2                    # every slot, nothing to mask
                x2 *= scale2
                x3 *= scale2
                y0 *= scale2
                y1 *= scale2
                y2 *= scale2
                y3 *= scale2
            else:                               # tree slots or the split's end
                c = tile_start + 2 * t          # the slots of this lane: c, c+1, c+8, c+9
                x0 = masked(x0, scale2, bits, b, ig, c, P, hi)
                x1 = masked(x1, scale2, bits, b, ig, c + 1, P, hi)
                x2 = masked(x2, scale2, bits, b, ig, c + 8, P, hi)
                x3 = masked(x3, scale2, bits, b, ig, c + 9, P, hi)
                y0 = masked(y0, scale2, bits, b, ig8, c, P, hi)
                y1 = masked(y1, scale2, bits, b, ig8, c + 1, P, hi)
                y2 = masked(y2, scale2, bits, b, ig8, c + 8, P, hi)
                y3 = masked(y3, scale2, bits, b, ig8, c + 9, P, hi)
            m_g, l_g, r_g, x0, x1, x2, x3 = softmax_step(m_g, l_g, x0, x1, x2, x3)
            m_g8, l_g8, r_g8, y0, y1, y2, y3 = softmax_step(m_g8, l_g8, y0, y1, y2, y3)
            if cuda.any_sync(FULL_MASK, r_g != 1.0 or r_g8 != 1.0):  # a row max grew:
                for k in range(0, O_VALUES, 4):  # values 0, 1 are row rg, 2, 3 row rg8
                    o[k] *= r_g
                    o[k + 1] *= r_g
                    o[k + 2] *= r_g8
                    o[k + 3] *= r_g8
            # the probabilities as the A fragment of P (16 rows x 16 slots): C-to-A identity
            pa0 = pack(x0, x1)
            pa1 = pack(y0, y1)
            pa2 = pack(x2, x3)
            pa3 = pack(y2, y3)

            # 3. O += P V over this warp's column groups
            tree = tile_start + BN > P          # the tile holds tree slots (block-uniform)
            for gq in range(GQ):
                group = warp + WARPS * gq
                if GROUPS % WARPS == 0 or group < GROUPS:
                    tc.ldmatrix_x4_trans(_ffi.from_buffer(frag),
                                         tile + uint32(v_lane + 32 * group))
                    if tree:                    # invisible rows may hold NaN: 0 * NaN = NaN
                        for k in range(4):
                            frag[k] = finite_pair(frag[k])
                    mma(_ffi.from_buffer(o[8 * gq:]), pa0, pa1, pa2, pa3, frag[0], frag[1])
                    mma(_ffi.from_buffer(o[8 * gq + 4:]), pa0, pa1, pa2, pa3, frag[2], frag[3])

        # The split's partial: out / l and m + log l per row (l summed over the quad's lanes).
        l_g += cuda.shfl_xor_sync(FULL_MASK, l_g, 1)
        l_g += cuda.shfl_xor_sync(FULL_MASK, l_g, 2)
        l_g8 += cuda.shfl_xor_sync(FULL_MASK, l_g8, 1)
        l_g8 += cuda.shfl_xor_sync(FULL_MASK, l_g8, 2)
        inv_g = float32(1.0) / l_g if l_g > 0 else float32(0.0)
        inv_g8 = float32(1.0) / l_g8 if l_g8 > 0 else float32(0.0)
        for gq in range(GQ):
            group = warp + WARPS * gq
            if group < GROUPS:
                col = 16 * group + 2 * t
                if rg < rows:
                    part_out[split, b, rg, col] = o[8 * gq] * inv_g
                    part_out[split, b, rg, col + 1] = o[8 * gq + 1] * inv_g
                    part_out[split, b, rg, col + 8] = o[8 * gq + 4] * inv_g
                    part_out[split, b, rg, col + 9] = o[8 * gq + 5] * inv_g
                if rg8 < rows:
                    part_out[split, b, rg8, col] = o[8 * gq + 2] * inv_g8
                    part_out[split, b, rg8, col + 1] = o[8 * gq + 3] * inv_g8
                    part_out[split, b, rg8, col + 8] = o[8 * gq + 6] * inv_g8
                    part_out[split, b, rg8, col + 9] = o[8 * gq + 7] * inv_g8
        if warp == 0 and t == 0:                # natural log: (m + log2 l) ln 2
            if rg < rows:
                part_lse[split, b, rg] = (m_g + math.log2(l_g)) * LN2 if l_g > 0 else NEG_INF
            if rg8 < rows:
                part_lse[split, b, rg8] = ((m_g8 + math.log2(l_g8)) * LN2 if l_g8 > 0
                                           else NEG_INF)

    return mma_kernel


#: ``kernel(kind, Dc, Dr)``: the mma kernel for one storage kind and row width, made once.
kernel = functools.cache(_make_mma_kernel)
