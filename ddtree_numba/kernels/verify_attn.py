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
``splits`` contiguous ranges (flash-decoding: enough blocks to fill the GPU even at bs = 1; the
count minimises the partial last wave, ``choose_splits``). Grid ``(splits, ceil(N H / 32),
bs)``, 256 threads = 8 warps, and warp ``w`` owns query rows ``4 w .. 4 w + 3`` in every phase.
For each tile of ``BN = 64`` slots:

1. ``S = Q K^T`` over 576 dims in chunks of 32: a 32 x 32 chunk of queries and a 64 x 32 chunk
   of cache rows are staged in shared memory (each cache element is read once per block and
   reused by its 32 query rows: heads and nodes), while the *next* chunk is already being
   fetched into registers (a software pipeline: global latency hides behind the products).
   Each thread accumulates a 4 x 2 block of scores (its warp's 4 rows, slots ``lane`` and
   ``lane + 32``): per dim, 4 broadcast reads of Q and 2 conflict-free reads of K feed 8 FMAs.
2. mask and scale: prefix slots always visible, tree slot ``P + j`` iff bit ``j`` of the row's
   node. A row's 64 scores live in one warp, so its max and sum are 5-shuffle reductions;
3. online softmax: ``m, l`` per row, in registers of the row's warp;
4. ``O += P C``, 8 slots at a time with their 512 latent columns staged in shared memory;
   each thread keeps a 4 x 16 block of the output in registers (its warp's rows, columns
   ``lane + 32 c``): per slot, 4 broadcast reads of P and 16 conflict-free reads of C feed 64
   FMAs (register tiling; loops unrolled so every accumulator index is a constant).

Index arithmetic is kept out of the hot loops: shared memory is read through per-thread views
(``k_s[lane:]``, ``c_s[:, lane:]``, ...) with constant indices, so each read is a base plus an
immediate offset, and global reads go through flat 1-D views with unsigned offsets (the row
offset of every slot of a tile is computed once). numba's signed 64-bit index math (multiplies
and negative-index wraparound) had cost 4 to 5 extra instructions per FMA.

Storage: bfloat16 caches are read as *packed pairs* (the cache viewed as ``uint32``: one load
brings two values, split by two shifts) when ``Dc`` and ``Dr`` are even, else as 16-bit values;
float16 and float32 one element per load. All arithmetic is float32.

Each block writes an unnormalised partial ``(out / l, m + log l)``; the merge kernel combines
the splits of a row by log-sum-exp (``_merge_partials``, the only place the merge is
written).

Resources (``python -m ddtree_numba build-report``): ~164 registers on sm_120 and ~240 on
sm_90 (numba's NVVM emits heavier code there), no spills, 37.6 KB of static shared memory
(Q chunk 4 KB, K chunk 8.4 KB, P tile 8 KB, latent sub-tile 16 KB, slot offsets 0.5 KB): one
block of 8 warps per SM. Measured on the H200 (``benchmarks/NOTES.md``): 9.7 TFLOP/s at long
prefixes, 19 % of cuBLAS SGEMM; 5x the previous version, whose 16 x 2 score tiles and 3-D
indexing cost 21 instructions per FMA.
"""

from __future__ import annotations

import math

import numpy as np
from numba import boolean, cuda, float32, uint32, uint64

from ..validation import BFLOAT16, FLOAT16, check_verify_attn
from ._device import SIMULATOR, as_device, device_empty, launch_stream, resolve_variant
from ._primitives import bits_to_float

NEG_INF = float32(-np.inf)
FULL_MASK = 0xFFFFFFFF
READABLE_THREADS = 32
BN = 64                 # slots per tile (2 per lane of a warp)
DCHUNK = 32             # dims per staged chunk of the score product
KPAD = DCHUNK + 1       # K chunk row stride: k_s[lane, dd] and k_s[lane + 32, dd] hit 32 banks
VSLOTS = 8              # slots per staged latent sub-tile of the weighted sum (16 KB)
TILED_THREADS = 256     # 8 warps
ROWS_PER_WARP = 4       # query rows owned by each warp, in the score and the output phase
BM = 8 * ROWS_PER_WARP  # query rows per block (32)
COLS = 16               # output columns per thread: lane + 32 c, c < 16 (Dc <= 512)
HALF_CHUNK = DCHUNK // 2  # bf16 pairs per K chunk row
HALF_DC = 256             # bf16 pairs per latent row (MAX_DC / 2)
ACC = 64                # ROWS_PER_WARP * COLS accumulators (local-array sizes must be literals)
SCORES = 8              # ROWS_PER_WARP * 2 scores
CREG = 16               # 2 * VSLOTS latent values per thread per sub-tile
MAX_DC = 512


def _make_loader(kind: str):
    """Device function reading one cache element as float32, per storage type."""
    if kind == "bfloat16":

        @cuda.jit(device=True, inline=True)
        def load(cache, page, slot, d):
            return bits_to_float(uint32(cache[page, slot, d]) << uint32(16))

    else:  # float32 and float16 (numba widens float16 with float32())

        @cuda.jit(device=True, inline=True)
        def load(cache, page, slot, d):
            return float32(cache[page, slot, d])

    return load


def _make_flat_loader(kind: str):
    """Device function reading element ``i`` (unsigned: no wraparound code) of a flat cache."""
    if kind == "bfloat16":

        @cuda.jit(device=True, inline=True)
        def load_flat(flat, i):
            return bits_to_float(uint32(flat[i]) << uint32(16))

    else:

        @cuda.jit(device=True, inline=True)
        def load_flat(flat, i):
            return float32(flat[i])

    return load_flat


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
    load = _make_loader(kind)

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
                s += q_latent[b, i, h, d] * load(cache, page, slot, d)
            for d in range(Dr):
                s += q_rope[b, i, h, d] * load(cache, page, slot, Dc + d)
            s *= sm_scale
            # 3. online softmax: a larger max rescales what was accumulated so far
            m_new = max(m, s)
            rescale = math.exp(m - m_new) if m > NEG_INF else float32(0.0)
            p = math.exp(s - m_new)
            l = l * rescale + p
            m = m_new
            # 4. weighted sum of this slot's latent row (the output stays in latent space)
            for d in range(Dc):
                o[d] = o[d] * rescale + p * load(cache, page, slot, d)
        for d in range(Dc):
            o[d] /= l
        lse[b, i, h] = m + math.log(l)

    return readable_kernel


# ------------------------------------------------------------------------------------------
# Variant "tiled" (flash-decoding over slot splits) and the merge
# ------------------------------------------------------------------------------------------
def _make_tiled_kernel(kind: str):
    # "bfloat16x2": the cache viewed as uint32, two bfloat16 values per load (even widths)
    packed = kind == "bfloat16x2"
    load = _make_flat_loader("bfloat16" if packed else kind)

    # Global reads go through flat 1-D views with unsigned offsets: the row offset of each slot
    # of the tile is computed once (slot_off), so a read is one add and one load (a 3-D signed
    # index costs numba ~20 instructions: 64-bit multiplies and negative-index wraparound).
    @cuda.jit(device=True, inline=True)
    def fetch_k(flat, slot_off, t_valid, d0, D, warp, lane, kreg):
        """Global -> registers: this thread's share of the K chunk ``[64 slots x 32 dims]``
        at dims ``d0 ..``. Unpacked: slots ``warp + 8 j`` (j < 8), dim ``lane``; packed: slots
        ``(tid // 16) + 16 j`` (j < 4), the bf16 pair ``2 (lane % 16)``."""
        if packed:
            pair = 2 * (lane % 16)
            for j in range(4):
                ss = (warp * 2 + lane // 16) + 16 * j
                lo = hi = float32(0.0)
                if ss < t_valid and d0 + pair < D:
                    lo, hi = _unpack_bf16x2(flat[slot_off[ss] + uint64((d0 + pair) // 2)])
                kreg[2 * j] = lo
                kreg[2 * j + 1] = hi
        else:
            for j in range(8):
                ss = warp + 8 * j
                v = float32(0.0)
                if ss < t_valid and d0 + lane < D:
                    v = load(flat, slot_off[ss] + uint64(d0 + lane))
                kreg[j] = v

    @cuda.jit(device=True, inline=True)
    def store_k(k_s, warp, lane, kreg):
        """Registers -> shared memory, the layout :func:`fetch_k` read."""
        if packed:
            pair = 2 * (lane % 16)
            for j in range(4):
                ss = (warp * 2 + lane // 16) + 16 * j
                k_s[ss, pair] = kreg[2 * j]
                k_s[ss, pair + 1] = kreg[2 * j + 1]
        else:
            for j in range(8):
                k_s[warp + 8 * j, lane] = kreg[j]

    @cuda.jit(device=True, inline=True)
    def fetch_c(flat, slot_off, t_valid, sub, Dc, tid, creg):
        """Global -> registers: this thread's share of the latent sub-tile ``[8 slots x 512]``
        at slots ``sub ..``. Unpacked: slot ``j // 2``, column ``tid + 256 (j % 2)``; packed:
        slot ``j``, the bf16 pair ``2 tid``."""
        if packed:
            for j in range(VSLOTS):
                ss = sub + j
                lo = hi = float32(0.0)
                if ss < t_valid and 2 * tid < Dc:
                    lo, hi = _unpack_bf16x2(flat[slot_off[ss] + uint64(tid)])
                creg[2 * j] = lo
                creg[2 * j + 1] = hi
        else:
            for j in range(2 * VSLOTS):
                ss = sub + j // 2
                cc = tid + TILED_THREADS * (j % 2)
                v = float32(0.0)
                if ss < t_valid and cc < Dc:
                    v = load(flat, slot_off[ss] + uint64(cc))
                creg[j] = v

    @cuda.jit(device=True, inline=True)
    def store_c(c_s, tid, creg):
        if packed:
            for j in range(VSLOTS):
                c_s[j, 2 * tid] = creg[2 * j]
                c_s[j, 2 * tid + 1] = creg[2 * j + 1]
        else:
            for j in range(2 * VSLOTS):
                c_s[j // 2, tid + TILED_THREADS * (j % 2)] = creg[j]

    @cuda.jit(device=True, inline=True)
    def fetch_q(ql_flat, qr_flat, q_off_l, q_off_r, q_ok, d, Dc, D, qreg):
        """Global -> registers: dim ``d`` of this thread's 4 query rows (latent, then rope)."""
        for j in range(4):
            v = float32(0.0)
            if q_ok[j] and d < D:
                v = ql_flat[q_off_l[j] + uint64(d)] if d < Dc else (
                    qr_flat[q_off_r[j] + uint64(d - Dc)])
            qreg[j] = v

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

        q_s = cuda.shared.array((BM, DCHUNK), float32)      # Q chunk [32 rows x 32 dims]
        k_s = cuda.shared.array((BN, KPAD), float32)        # K chunk [64 slots x 32 dims]
        p_s = cuda.shared.array((BM, BN), float32)          # P tile  [32 rows x 64 slots]
        c_s = cuda.shared.array((VSLOTS, MAX_DC), float32)  # C sub-tile [8 slots x 512]
        slot_off = cuda.shared.array(BN, uint64)  # flat offset of each slot's row in the cache:
        #                                           looked up once per tile, not per element
        # Per-thread views: the hot loops index them with constants only (after unrolling),
        # so every shared-memory read is base + immediate offset, with no index arithmetic
        # (numba's 64-bit index math and negative-index wraparound otherwise cost several
        # instructions per read).
        k_mine = k_s[lane:]                     # k_mine[0 | 32, dd] = K[lane | lane + 32, dd]
        q_mine = q_s[warp * ROWS_PER_WARP:]     # q_mine[r, dd] = Q[4 warp + r, dd]
        p_mine = p_s[warp * ROWS_PER_WARP:]     # p_mine[r, t] = P[4 warp + r, t]
        c_mine = c_s[:, lane:]                  # c_mine[ss, 32 c] = C[ss, lane + 32 c]
        # registers (every loop over these is unrolled: constant indices, no local memory)
        acc = cuda.local.array(ACC, float32)            # O[r, lane + 32 c] at r * COLS + c
        score = cuda.local.array(SCORES, float32)       # S[r, lane + 32 k] at 2 r + k
        m = cuda.local.array(ROWS_PER_WARP, float32)    # running max per row
        l = cuda.local.array(ROWS_PER_WARP, float32)    # running sum per row
        kreg = cuda.local.array(8, float32)             # next K chunk, in flight
        qreg = cuda.local.array(4, float32)             # next Q chunk, in flight
        creg = cuda.local.array(CREG, float32)          # next latent sub-tile, in flight
        for r in range(ROWS_PER_WARP):
            m[r] = NEG_INF
            l[r] = 0.0
            for c in range(COLS):
                acc[r * COLS + c] = 0.0
        # the Q rows this thread stages (rows warp + 8 j, dim lane of each chunk): their flat
        # offsets in q_latent [bs, N, H, Dc] and q_rope [bs, N, H, Dr] (row = node H + head)
        q_off_l = cuda.local.array(4, uint64)
        q_off_r = cuda.local.array(4, uint64)
        q_ok = cuda.local.array(4, boolean)
        for j in range(4):
            qrow = row0 + warp + 8 * j
            q_ok[j] = qrow < NH
            flat_row = uint64(b * NH + min(qrow, NH - 1))
            q_off_l[j] = flat_row * uint64(Dc)
            q_off_r[j] = flat_row * uint64(Dr)
        row_width = uint64(flat.shape[0] // (cache.shape[0] * page_size))  # per flat row

        for t0 in range(t_begin, t_end, BN):
            t_valid = t_end - t0                # slots of this tile that exist
            cuda.syncthreads()                  # the previous tile is done with slot tables
            if tid < BN:                        # 0. where each slot of the tile lives
                t = min(t0 + tid, t_end - 1)
                page = block_table[b, t // page_size]
                slot_off[tid] = uint64(page * page_size + t % page_size) * row_width
            cuda.syncthreads()                  # slot offsets written before the fetches
            for k in range(SCORES):
                score[k] = 0.0
            # 1. S = Q K^T over D dims, 32 at a time. Software pipeline: chunk c + 1 is fetched
            # into registers while chunk c is multiplied, so global latency hides behind math.
            fetch_k(flat, slot_off, t_valid, 0, D, warp, lane, kreg)
            fetch_q(ql_flat, qr_flat, q_off_l, q_off_r, q_ok, lane, Dc, D, qreg)
            for d0 in range(0, D, DCHUNK):
                cuda.syncthreads()              # everyone is done with the previous chunk
                store_k(k_s, warp, lane, kreg)
                for j in range(4):
                    q_s[warp + 8 * j, lane] = qreg[j]
                cuda.syncthreads()              # chunk staged before the products
                d1 = d0 + DCHUNK                # prefetch the next chunk (if any)
                if d1 < D:
                    fetch_k(flat, slot_off, t_valid, d1, D, warp, lane, kreg)
                    fetch_q(ql_flat, qr_flat, q_off_l, q_off_r, q_ok, d1 + lane, Dc, D, qreg)
                # each thread: 4 rows (its warp's) x 2 slots (lane, lane + 32); q reads are
                # warp broadcasts, k reads hit 32 banks (row stride 33)
                for dd in range(DCHUNK):        # constant indices into per-thread views
                    k0 = k_mine[0, dd]
                    k1 = k_mine[32, dd]
                    for r in range(ROWS_PER_WARP):
                        q = q_mine[r, dd]
                        score[2 * r] += q * k0
                        score[2 * r + 1] += q * k1
            # 2. mask and scale; 3. online softmax. A row's 64 scores live in one warp
            # (2 per lane), so its max and sum are warp reductions (5 shuffles each).
            for r in range(ROWS_PER_WARP):
                row = row0 + warp * ROWS_PER_WARP + r
                node = row // H
                row_valid = row < NH and node < n
                tile_max = NEG_INF
                for k in range(2):
                    t = t0 + lane + 32 * k
                    ok = row_valid and t < t_end and (t < P or _visible(bits, b, node, t - P))
                    sk = score[2 * r + k] * sm_scale if ok else NEG_INF
                    score[2 * r + k] = sk
                    tile_max = max(tile_max, sk)
                for offset in (16, 8, 4, 2, 1):
                    tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, offset))
                m_new = max(m[r], tile_max)
                rescale = float32(1.0)
                if m_new > NEG_INF:
                    rescale = math.exp(m[r] - m_new) if m[r] > NEG_INF else float32(0.0)
                tile_sum = float32(0.0)
                for k in range(2):
                    p = math.exp(score[2 * r + k] - m_new) if m_new > NEG_INF else float32(0.0)
                    p_s[warp * ROWS_PER_WARP + r, lane + 32 * k] = p
                    tile_sum += p
                for offset in (16, 8, 4, 2, 1):
                    tile_sum += cuda.shfl_xor_sync(FULL_MASK, tile_sum, offset)
                l[r] = l[r] * rescale + tile_sum
                m[r] = m_new
                for c in range(COLS):
                    acc[r * COLS + c] *= rescale
            # 4. O += P C, 8 slots at a time (the next 8 fetched while these are used); each
            # thread updates a 4 x 16 block of O (rows of its warp, columns lane + 32 c): per
            # slot 4 broadcast reads of P and 16 conflict-free reads of C feed 64 FMAs
            for sub in range(0, BN, VSLOTS):
                fetch_c(flat, slot_off, t_valid, sub, Dc, tid, creg)
                cuda.syncthreads()              # p_s written / c_s free before staging
                store_c(c_s, tid, creg)
                cuda.syncthreads()              # latent rows staged before the products
                p_sub = p_mine[:, sub:]
                for ss in range(VSLOTS):        # slots past t_end have p = 0
                    for r in range(ROWS_PER_WARP):
                        p = p_sub[r, ss]
                        for c in range(COLS):
                            acc[r * COLS + c] += p * c_mine[ss, 32 * c]
        # partial result of this split: normalised output and its log-sum-exp
        for r in range(ROWS_PER_WARP):
            row = row0 + warp * ROWS_PER_WARP + r
            if row < NH:
                for c in range(COLS):
                    d = lane + 32 * c
                    if d < Dc:
                        part_out[split, b, row, d] = acc[r * COLS + c] / l[r] if l[r] > 0 else 0.0
                if lane == 0:
                    part_lse[split, b, row] = m[r] + math.log(l[r]) if l[r] > 0 else NEG_INF

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


def _storage_kind(kv_cache) -> str:
    dtype = getattr(kv_cache, "dtype", None)
    if isinstance(kv_cache, np.ndarray):
        return "bfloat16" if dtype == BFLOAT16 else ("float16" if dtype == FLOAT16 else "float32")
    name = str(dtype)
    return "bfloat16" if "bfloat16" in name else ("float16" if "float16" in name else "float32")


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (132 on the H200; 132 on the simulator)."""
    if SIMULATOR:
        return 132
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def choose_splits(bs: int, row_tiles: int, slots: int, sms: int = 132, max_waves: int = 4) -> int:
    """Slot splits for ``bs * row_tiles`` row tiles on ``sms`` SMs (one block per SM fits).

    A split's blocks take time proportional to its share of the slots, so the step time goes
    as ``waves / splits`` with ``waves = ceil(blocks / sms)``: pick the number of splits that
    minimises it (a partial last wave wastes the idle SMs), the smallest on ties, with at
    least one tile of BN slots per split and at most ``max_waves`` waves.
    """
    tiles = max(bs * row_tiles, 1)
    most = max(1, min(-(-slots // BN), -(-max_waves * sms // tiles)))
    return min(range(1, most + 1), key=lambda s: (-(-tiles * s // sms)) / s)


def plan_splits(bs: int, N: int, H: int, max_slots: int, splits=None) -> tuple:
    """``(splits, slots_per_split)`` of the tiled variant for a slot capacity ``max_slots``.

    Only the capacity of the block table is known on the host without a synchronisation, so
    the splits cover ``[0, max_pages * page_size)``; splits past a request's ``P + N`` return
    at once with an empty partial.
    """
    row_tiles = -(-N * H // BM)
    n = choose_splits(bs, row_tiles, max_slots, sm_count()) if splits is None else int(splits)
    per_split = -(-max_slots // max(n, 1))
    per_split = -(-per_split // BN) * BN            # whole tiles per split
    return -(-max_slots // per_split), per_split


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
    kind = _storage_kind(kv_cache)
    if SIMULATOR and kind == "bfloat16":        # no bf16 on the simulator: widen exactly
        kv_cache = np.asarray(kv_cache).astype(np.float32)
        kind = "float32"
    ql, qr = as_device(q_latent), as_device(q_rope)
    cache = as_device(kv_cache)
    if kind == "bfloat16":
        cache = cache.view(np.uint16)
        if variant == "tiled" and sz.Dc % 2 == 0 and sz.Dr % 2 == 0:
            cache = cache.view(np.uint32)       # bf16 pairs: one 32-bit load per 2 values
            kind = "bfloat16x2"
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
        _kernel("readable", kind)[(rows + READABLE_THREADS - 1) // READABLE_THREADS,
                                  READABLE_THREADS, stream](*args, out_latent, lse)
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
    _kernel("tiled", kind)[(n_splits, row_tiles, sz.bs), TILED_THREADS, stream](
        *args, per_split, part_out, part_lse, *flats)
    _merge_kernel[(sz.N * sz.H, sz.bs), 128, stream](
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
    specs.append(KernelSpec("verify_attn", "merge", _merge_kernel,
                            (f4, types.float32[:, :, ::1], i1, f4, types.float32[:, :, ::1]),
                            128, True))
    return specs
