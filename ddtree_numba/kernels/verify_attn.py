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

Variant ``"readable"`` (one idea per step; runs on the simulator). Grid ``(H, N, bs)``, one
block of 32 threads per query row ``(b, i, h)``; thread ``x`` owns latent columns
``x, x + 32, ...``. For every slot: 1. score (each thread a partial dot product, a block
reduction in shared memory), 2. mask (skip invisible tree slots), 3. online softmax (rescale the
running sum and output when the max grows), 4. weighted sum of the slot's latent row.

Variant ``"tiled"`` (fast; GPU). The ``N * H`` query rows of a request are flattened
(``row = i * H + h``) and cut into tiles of ``BM = 16`` rows; the slots ``[0, P + N)`` are cut into
``splits`` contiguous ranges (flash-decoding: enough blocks to fill the GPU even at bs = 1).
Grid ``(splits, ceil(N H / BM), bs)``, 256 threads, 16 per query row. For each tile of
``BN = 32`` slots:

1. ``S = Q K^T`` over 576 dims in chunks of 32: a 16 x 32 chunk of queries and a 32 x 32 chunk
   of cache rows are staged in shared memory (each cache element is read once per block and
   reused by the 16 query rows: heads and nodes of the tile), each thread accumulates 2 scores
   (row ``r = tid // 16``, slots ``tid % 16 + 16 k``);
2. mask and scale: prefix slots always visible, tree slot ``P + j`` iff bit ``j`` of the row's
   node; the row's 16 threads (adjacent lanes) reduce max and sum with 4 shuffles;
3. online softmax: ``m, l`` per row, in registers of the row's 16 threads;
4. ``O += P C``, 8 slots at a time with their 512 latent columns staged in shared memory;
   each thread keeps its row's 32 output columns ``tid % 16 + 16 k`` in registers (the loop
   over ``k`` is unrolled, so the accumulator indices are constants: no local memory).

Registers: numba's NVVM emits heavier code for sm_80 / 8.9 / 9.0 than for sm_120 (this kernel:
~230 registers on sm_90, 96 on sm_120; ``python -m ddtree_numba build-report``). With 32 query
rows and 512 threads it could not launch on sm_90, and capped at 128 registers it spilled; 16
rows x 256 threads fits without spills on both (one block per SM on sm_90, two on sm_120).

Each block writes an unnormalised partial ``(out / l, m + log l)``; the merge kernel combines
the splits of a row by log-sum-exp (``_merge_partials``, the only place the merge is
written). bfloat16 / float16 caches are read as 16-bit values and widened to float32 on load;
all arithmetic is float32.

Shared memory of the tiled variant: Q chunk 2 KB, K chunk 4.2 KB, P tile 2 KB, latent
sub-tile 16 KB: 24.1 KB per block.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..validation import BFLOAT16, FLOAT16, check_verify_attn
from ._device import SIMULATOR, as_device, device_empty, launch_stream, resolve_variant
from ._primitives import bits_to_float

NEG_INF = float32(-np.inf)
FULL_MASK = 0xFFFFFFFF
READABLE_THREADS = 32
BN = 32                 # slots per tile
DCHUNK = 32             # dims per staged chunk of the score product
KPAD = DCHUNK + 1       # K chunk row stride: reading k_s[g + 8 k, dd] hits 32 banks
VSLOTS = 8              # slots per staged latent sub-tile of the weighted sum (16 KB)
TILED_THREADS = 256
ROW_THREADS = 16                    # threads sharing a query row (adjacent lanes)
BM = TILED_THREADS // ROW_THREADS   # query rows per block (16)
SCORES = BN // ROW_THREADS          # scores per thread per slot tile (2)
ACC = 512 // ROW_THREADS            # output columns per thread (32), for Dc <= 512
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
        h = cuda.blockIdx.x
        i = cuda.blockIdx.y
        b = cuda.blockIdx.z
        x = cuda.threadIdx.x
        Dc = q_latent.shape[3]
        Dr = q_rope.shape[3]
        page_size = cache.shape[1]
        red = cuda.shared.array(READABLE_THREADS, float32)
        acc = cuda.local.array(16, float32)     # columns x, x + 32, ... (Dc <= 512)
        n = num_nodes[b]
        if i >= n:                              # padding row
            for k in range(16):
                if x + 32 * k < Dc:
                    out[b, i, h, x + 32 * k] = 0.0
            if x == 0:
                lse[b, i, h] = NEG_INF
            return
        P = prefix_lens[b]
        for k in range(16):
            acc[k] = 0.0
        m = NEG_INF                             # running max of the scores
        l = float32(0.0)                        # running sum of exp(score - m)
        for t in range(P + n):
            # 2. mask: prefix slots always, tree slot P + j only if j is an ancestor of i
            if t >= P and not _visible(bits, b, i, t - P):
                continue
            page = block_table[b, t // page_size]
            slot = t % page_size
            # 1. score: partial dot products, then a block reduction
            part = float32(0.0)
            for d in range(x, Dc, 32):
                part += q_latent[b, i, h, d] * load(cache, page, slot, d)
            for d in range(x, Dr, 32):
                part += q_rope[b, i, h, d] * load(cache, page, slot, Dc + d)
            red[x] = part
            cuda.syncthreads()                  # all partials stored
            half = 16
            while half > 0:
                if x < half:
                    red[x] += red[x + half]
                cuda.syncthreads()              # this level summed before the next
                half //= 2
            s = red[0] * sm_scale
            cuda.syncthreads()                  # everyone read the total before reuse
            # 3. online softmax: a larger max rescales what was accumulated so far
            m_new = max(m, s)
            rescale = math.exp(m - m_new) if m > NEG_INF else float32(0.0)
            p = math.exp(s - m_new)
            l = l * rescale + p
            m = m_new
            # 4. weighted sum of this slot's latent row
            for k in range(16):
                d = x + 32 * k
                if d < Dc:
                    acc[k] = acc[k] * rescale + p * load(cache, page, slot, d)
        for k in range(16):
            d = x + 32 * k
            if d < Dc:
                out[b, i, h, d] = acc[k] / l
        if x == 0:
            lse[b, i, h] = m + math.log(l)

    return readable_kernel


# ------------------------------------------------------------------------------------------
# Variant "tiled" (flash-decoding over slot splits) and the merge
# ------------------------------------------------------------------------------------------
def _make_tiled_kernel(kind: str):
    load = _make_loader(kind)

    @cuda.jit
    def tiled_kernel(q_latent, q_rope, cache, block_table, prefix_lens, bits, num_nodes,
                     sm_scale, slots_per_split, part_out, part_lse):
        """Partials for rows ``[BM * y, BM * y + BM)`` over one split of the slots."""
        split = cuda.blockIdx.x
        row0 = cuda.blockIdx.y * BM
        b = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        r = tid // ROW_THREADS                  # this thread's query row within the tile
        g = tid % ROW_THREADS                   # its column group (scores and outputs)
        H = q_latent.shape[2]
        Dc = q_latent.shape[3]
        Dr = q_rope.shape[3]
        D = Dc + Dr
        NH = q_latent.shape[1] * H
        page_size = cache.shape[1]
        n = num_nodes[b]
        P = prefix_lens[b]
        T = P + n                               # slots any valid row can see
        t_begin = split * slots_per_split
        t_end = min(T, t_begin + slots_per_split)

        q_s = cuda.shared.array((BM, DCHUNK), float32)
        k_s = cuda.shared.array((BN, KPAD), float32)   # padded row: no bank conflicts
        p_s = cuda.shared.array((BM, BN), float32)
        c_s = cuda.shared.array((VSLOTS, MAX_DC), float32)
        slot_page = cuda.shared.array(BN, int32)  # page and row of each slot of the tile:
        slot_row = cuda.shared.array(BN, int32)   # looked up once per tile, not per element
        acc = cuda.local.array(ACC, float32)    # out[row, g + 16 k] (registers: unrolled)
        score = cuda.local.array(SCORES, float32)

        row = row0 + r                          # flattened (node, head) of this thread
        node = row // H
        row_valid = row < NH and node < n
        for k in range(ACC):
            acc[k] = 0.0
        m = NEG_INF
        l = float32(0.0)

        for t0 in range(t_begin, t_end, BN):
            if tid < BN:                        # 0. where each slot of the tile lives
                t = min(t0 + tid, t_end - 1)
                slot_page[tid] = block_table[b, t // page_size]
                slot_row[tid] = t % page_size
            cuda.syncthreads()                  # slot table written before the staging reads it
            # 1. S = Q K^T over D dims, 32 at a time through shared memory
            for k in range(SCORES):
                score[k] = 0.0
            for d0 in range(0, D, DCHUNK):
                for e in range(tid, BM * DCHUNK, TILED_THREADS):   # stage Q[32 x 32]
                    rr = e // DCHUNK
                    dd = e % DCHUNK
                    qrow = row0 + rr
                    d = d0 + dd
                    v = float32(0.0)
                    if qrow < NH and d < D:
                        qi = qrow // H
                        qh = qrow % H
                        v = q_latent[b, qi, qh, d] if d < Dc else q_rope[b, qi, qh, d - Dc]
                    q_s[rr, dd] = v
                for e in range(tid, BN * DCHUNK, TILED_THREADS):   # stage K[32 x 32]
                    ss = e // DCHUNK
                    dd = e % DCHUNK
                    t = t0 + ss
                    v = float32(0.0)
                    if t < t_end and d0 + dd < D:
                        v = load(cache, slot_page[ss], slot_row[ss], d0 + dd)
                    k_s[ss, dd] = v
                cuda.syncthreads()              # chunks staged before the products
                for dd in range(DCHUNK):        # zeros past D were staged: no bound check
                    q = q_s[r, dd]
                    for k in range(SCORES):
                        score[k] += q * k_s[g + ROW_THREADS * k, dd]
                cuda.syncthreads()              # products done before the next staging
            # 2. mask and scale; row max over the row's 16 threads (adjacent lanes)
            tile_max = NEG_INF
            for k in range(SCORES):
                t = t0 + g + ROW_THREADS * k
                ok = row_valid and t < t_end and (t < P or _visible(bits, b, node, t - P))
                score[k] = score[k] * sm_scale if ok else NEG_INF
                tile_max = max(tile_max, score[k])
            for offset in (1, 2, 4, 8):
                tile_max = max(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, offset))
            # 3. online softmax
            m_new = max(m, tile_max)
            rescale = float32(1.0)
            if m_new > NEG_INF:
                rescale = math.exp(m - m_new) if m > NEG_INF else float32(0.0)
            tile_sum = float32(0.0)
            for k in range(SCORES):
                p = math.exp(score[k] - m_new) if m_new > NEG_INF else float32(0.0)
                p_s[r, g + ROW_THREADS * k] = p
                tile_sum += p
            for offset in (1, 2, 4, 8):
                tile_sum += cuda.shfl_xor_sync(FULL_MASK, tile_sum, offset)
            l = l * rescale + tile_sum
            m = m_new
            for k in range(ACC):
                acc[k] *= rescale
            # 4. O += P C, 8 slots at a time with all their latent columns staged
            for sub in range(0, BN, VSLOTS):
                cuda.syncthreads()              # p_s written / c_s free before staging
                for e in range(tid, VSLOTS * MAX_DC, TILED_THREADS):
                    ss = e // MAX_DC
                    cc = e % MAX_DC
                    t = t0 + sub + ss
                    v = float32(0.0)
                    if t < t_end and cc < Dc:
                        v = load(cache, slot_page[sub + ss], slot_row[sub + ss], cc)
                    c_s[ss, cc] = v
                cuda.syncthreads()              # latent rows staged before the products
                for ss in range(VSLOTS):        # slots past t_end have p = 0
                    p = p_s[r, sub + ss]
                    for k in range(ACC):        # acc[k] is column g + 16 k (constant index)
                        acc[k] += p * c_s[ss, g + ROW_THREADS * k]
            cuda.syncthreads()                  # c_s / p_s reads done before the next tile
        # partial result of this split: normalised output and its log-sum-exp
        if row < NH:
            for k in range(ACC):
                d = g + ROW_THREADS * k
                if d < Dc:
                    part_out[split, b, row, d] = acc[k] / l if l > 0 else 0.0
            if g == 0:
                part_lse[split, b, row] = m + math.log(l) if l > 0 else NEG_INF

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


def choose_splits(bs: int, row_tiles: int, slots: int, target_blocks: int = 264) -> int:
    """Slot splits so that ``bs * row_tiles * splits`` blocks fill the GPU (2 per SM on 132
    SMs), each split keeping at least one tile of BN slots."""
    want = max(1, -(-target_blocks // max(bs * row_tiles, 1)))
    return max(1, min(want, -(-slots // BN)))


def plan_splits(bs: int, N: int, H: int, max_slots: int, splits=None) -> tuple:
    """``(splits, slots_per_split)`` of the tiled variant for a slot capacity ``max_slots``.

    Only the capacity of the block table is known on the host without a synchronisation, so
    the splits cover ``[0, max_pages * page_size)``; splits past a request's ``P + N`` return
    at once with an empty partial.
    """
    row_tiles = -(-N * H // BM)
    n = choose_splits(bs, row_tiles, max_slots) if splits is None else int(splits)
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
        _kernel("readable", kind)[(sz.H, sz.N, sz.bs), READABLE_THREADS, stream](
            *args, out_latent, lse)
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
    _kernel("tiled", kind)[(n_splits, row_tiles, sz.bs), TILED_THREADS, stream](
        *args, per_split, part_out, part_lse)
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
                                (*common, types.int64, f4, types.float32[:, :, ::1]),
                                TILED_THREADS, True))
    specs.append(KernelSpec("verify_attn", "merge", _merge_kernel,
                            (f4, types.float32[:, :, ::1], i1, f4, types.float32[:, :, ::1]),
                            128, True))
    return specs
