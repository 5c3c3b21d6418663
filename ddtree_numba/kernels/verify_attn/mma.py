"""Variant ``"mma"`` of ``kernels.verify_attn``: tensor cores (``mma.sync``) for 16-bit caches.

GPU only, compute capability 8.0 and up (A100, H100/H200, RTX PRO 6000 Blackwell), bfloat16 or
float16 caches with ``Dc`` and ``Dr`` multiples of 16 (DeepSeek-V3 and Kimi-K2: 512 and 64).
The products run on the tensor cores through ``kernels/tensor_core.cu``; everything else is
numba. Read the fragment maps first (``ddtree_numba.reference.mma_fragments``: which lane holds
which element of A, B and C).

Launch: grid ``(splits, ceil(N H / 32), bs)``, 256 threads = 8 warps, ``shared_layout(Dc, Dr,
stages).total`` bytes of dynamic shared memory (91.75 KB for 576-wide rows and 2 stages: above
numba's 48 KB of static memory, so the launcher opts in with
``kernels._device.allow_dynamic_shared``; sm_120 allows 99 KB a block). A block owns ``BM =
32`` query rows of one request (``row = i H + h``: heads of one node, or of neighbouring
nodes, share the block) and one split of its slots (``splits.prefix_split_slots``: the split
size depends only on the request's own prefix length, so a row's result never depends on what
else shares the launch or on the GPU's SM count). All 32 rows read the same 576-wide rows.

Before the tiles: the block's 32 query rows are read once, every load in flight at once,
rounded to 16 bits and stored in the staging buffer that the first tiles leave free; each warp
takes the A fragments of its k-steps from there by ``ldmatrix`` (the first tile's copies are
already on their way). Per tile of ``BN = 32`` slots (the cache rows arrive by ``cp.async``
into one of ``stages`` shared buffers while earlier tiles are computed):

1. ``S = Q K^T`` (32 rows x 32 slots over the 576 dims, 36 k-steps of 16). Warp ``w`` works
   on row tile ``rt = w // 4`` (16 rows) and the k-steps ``kw, kw + 4, ...`` of its
   ``kw = w % 4``: it holds the A fragments of those 9 k-steps of its 16 rows in registers for
   the whole split (all 36 would not fit beside the output) and reads its k-steps of the tile
   once (two ``ldmatrix.x4`` per k-step: 32 slots x 16 dims, four ``mma``). The copies of the
   tile ``stages - 1`` ahead go out beside the first k-steps, three 16-byte chunks a thread
   per k-step, rather than queueing at once.
2. Reduce-scatter of the scores: the 4 partials of each row tile meet in shared memory, and
   each thread sums the 4 partials (in a fixed order: deterministic) of the 4 scores it owns:
   row ``r_own`` and slots ``8 nt + 2t, + 1`` for ``nt = nt_own, nt_own + 2``; the 8 lanes of
   a row differ in lane bits 0-2. Scale (into base 2: ``exp2`` is one instruction) and, only
   in tiles that hold tree slots or the split's end, mask. Online softmax per row (the row max
   by three shuffles) with a lazy reference max: it moves only when a score passes it by more
   than ``RESCALE_BELOW`` = 8 (base 2), so probabilities stay below 2^8 and the output is
   rescaled only on such jumps (the final ``out / l`` and ``m + log l`` are exact either way).
   The probabilities, rounded to 16 bits, go to a ``[32, BN + 8]`` shared tile, each row's
   rescale factor beside them.
3. ``O += P V``: every warp reads the probabilities of all 32 rows (``ldmatrix.x4``: the A
   fragments) and owns the output columns of 16-column groups ``w, w + 8, ...`` (64 columns:
   64 float32 accumulators a lane for the two row tiles). V is the first ``Dc`` columns of the
   same staged rows, read with ``ldmatrix.x4.trans``; each V fragment feeds four ``mma``. All
   V fragments of a k-step are loaded before the products, so their loads overlap.

Which thread touches which byte:

* staging: thread ``tid`` copies slot ``tid // 8`` of the tile, 16-byte chunks ``tid % 8,
  tid % 8 + 8, ...`` of its row (8 neighbouring threads: 128 contiguous bytes). Its slot's
  page and in-page offset advance a tile at a time without a division, and its block-table
  entry is read one tile before the copy that needs it (nothing consumes that load before the
  next tile's barrier, so it never stalls a warp). A slot past the split's end or with a
  block-table entry outside the cache is filled with zeros by ``cp.async`` itself (source size
  0: nothing is read);
* queries: warp ``w`` loads block rows ``4 w .. 4 w + 3``, lane ``l`` the pairs ``l, l + 32,
  ...`` of each row's latent and rope parts (256 contiguous bytes per pair of loads), and
  stores them packed into buffer ``stages - 1`` with the tiles' row stride;
* shared memory (``SharedLayout``): ``stages`` tiles of 32 rows, each ``D + 8`` values wide
  (16 bytes of padding per row, so the 8 rows an ``ldmatrix`` reads at once start in 8
  different bank groups); the partial scores as float32x4 at ``[rt, kw, nt, lane ^ 4 (nt %
  2)]`` (the swizzle makes both the writers' and the readers' 128-byte phases conflict-free);
  the probability tile (rows 80 bytes apart: 8 rows in 8 bank groups), the rescale factors and
  the final ``1 / l`` of the 32 rows;
* output: lane ``4 g + t`` of warp ``w`` puts rows ``g, g + 8, 16 + g, 24 + g`` (of the
  block), columns ``16 c + 2t, + 1, + 8, + 9`` of its groups ``c``, divided by ``l``, into
  a float32 ``[32, Dc + 4]`` staging area where the tiles were; then warp ``w`` writes rows
  ``4 w .. 4 w + 3`` of ``part_out``, lane ``l`` the columns ``l, l + 32, ...`` (128-byte
  stores). The first lane of each row's 8 writes the row's ``part_lse``;
* the merge, fused (in launches of at least ``FUSED_MERGE_ROW_BLOCKS_PER_SM`` row blocks an
  SM; smaller ones stop after their partials and a merge kernel follows): the row block's
  splits count their arrivals in ``arrivals[b, row block]``; the last to arrive reads every
  split's ``part_lse`` and ``part_out`` of its 32 rows and writes ``out`` and ``lse`` (thread
  ``r < 32`` the split weights of row ``r``, then warp ``w`` rows ``4 w .. 4 w + 3``, lane
  ``l`` the columns ``l, l + 32, ...``), in split order with the expressions of
  ``splits._merge_prefix_kernel``: the same bits as that kernel, whichever split arrives last.
  A row block that no split computes (only padding rows, or a request with no slot) is written
  as 0 and ``-inf`` by its split-0 block.

Barriers per tile: one after the tile has landed (every thread waited for its own copies; the
barrier makes all of them visible, and certifies that no warp still reads the buffer the next
copies will overwrite, nor the probabilities of the tile before), one after the partial
scores are written, one after the probabilities and rescale factors are written. Outside
the loop: one after the query rows are stored (before any warp reads its fragments), and two
at the end (every ``1 / l`` written and no warp reading tiles any more; the output staged),
then the merge's: one after every thread's fence (all partials of the block are visible to
the GPU before its arrival is counted), one after the flag that says whether this block came
last, and one after the split weights are written.

Rows a query cannot see: their scores become ``-inf`` by a select, and in tiles that hold tree
slots the V fragments are made finite (NaN and +-inf bit patterns become 0) before ``P V``,
since ``0 * NaN`` is NaN on the tensor cores too. Cache rows past ``P + num_nodes`` are never
read. Unchecked inputs (``check=False``) are clamped: ``num_nodes`` to ``[0, N]``,
``prefix_lens`` to ``[0, capacity]``, slots to the block table's capacity, pages to the cache.

Resources (``python -m ddtree_numba build-report``): one block of 8 warps per SM (255
registers on sm_90, 215 on sm_120, no spills; launch bounds allow 255; sm_90's most are live
in the fused merge, 64 values and their loads in flight; without the merge 219 and 229),
91.75 KB of dynamic shared memory with 2 stages. The SASS of the tile loop holds the 68 HMMA
and 30 LDSM (9 more LDSM before it take the query fragments), no CALL (the kernel's CALLs
are the float32 division's slow path, of ``1 / l`` and of the merge, after the loop) and no
local memory: the functions
``pv_step`` and ``stage_rows`` are called once per k-step and row tile rather than looped, so
every index of the accumulators stays a constant (a loop that sm_120's compiler left rolled
put them in local memory).

Precision: the cache is already 16-bit; the query rows are rounded to the cache's type when
loaded, and the probabilities when stored for ``P V`` (as FlashAttention and FlashMLA do);
products accumulate in float32, softmax in float32.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import cffi
from numba import cuda, float32, uint16, uint32, uint64
from numba.cuda import float32x4

from .. import tensor_core as tc
from .._device import SIMULATOR
from .._primitives import FULL_MASK
from .readable import NEG_INF
from .splits import (
    MAX_PREFIX_SPLITS,
    merged_lse,
    merged_value,
    prefix_split_slots,
    prefix_splits,
    split_max,
    split_weight,
)

MMA_THREADS = 256   # 8 warps
WARPS = MMA_THREADS // 32
KSPLIT = 4          # warps that share out the k-steps of one row tile's scores
ROW_TILES = WARPS // KSPLIT     # 16-row tiles per block (the M of one mma each)
BM = 16 * ROW_TILES             # query rows per block: 32
BN = 32             # slots per staged tile: the N of four score mma, the K of two P V mma
NT = BN // 8        # 8-slot n-tiles of the scores per tile
BLOCKS_PER_SM = 1   # launch bounds: up to 255 registers (215-255 taken; 128 would spill)
RESCALE_BELOW = 8.0     # the reference max of a row moves only when a score passes it by
                        # more than this (base 2): probabilities up to 2^8, rare rescales
P_STRIDE = BN + 8   # probability tile row stride in 16-bit values (80 bytes: the module
                    # docstring says why: an ldmatrix's 8 rows start in 8 bank groups)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_ffi = cffi.FFI()
if SIMULATOR:   # no vector element types on the simulator (the variant is GPU-only anyway)
    F32X4 = F32X2 = None
else:
    from numba.cuda.vector_types import vector_types

    F32X4 = vector_types["float32x4"]
    F32X2 = vector_types["float32x2"]


class SharedLayout(NamedTuple):
    """Byte offsets of the regions of the kernel's dynamic shared memory (one block)."""
    stages: int         # staged cache tiles in flight
    tile: int           # bytes of one staged tile: BN rows of D + 8 values
    partial: int        # partial scores: [row tile, k-warp, n-tile (NT), lane] float32x4
    probs: int          # probabilities: BM rows of P_STRIDE 16-bit values
    alpha: int          # per row: the rescale factor of this tile (float32)
    inverse: int        # per row: 1 / l at the end (float32)
    total: int          # bytes to launch with


def shared_layout(Dc: int, Dr: int, stages: int) -> SharedLayout:
    """Where each region lives in the dynamic shared memory of ``kernel(kind, Dc, Dr,
    stages)``; ``total`` is the launch's dynamic size (91.75 KB for 512 + 64 wide rows and 2
    stages, 128.25 KB with 3)."""
    tile = BN * (Dc + Dr + 8) * 2
    partial = stages * tile
    probs = partial + ROW_TILES * KSPLIT * NT * 32 * 16
    alpha = probs + BM * P_STRIDE * 2
    inverse = alpha + BM * 4
    return SharedLayout(stages, tile, partial, probs, alpha, inverse, inverse + BM * 4)


def shared_traffic(Dc: int, Dr: int) -> dict:
    """Bytes of shared-memory bandwidth one block spends per full tile of the loop, by region,
    counted from the instructions the tile executes (8 warps): a request costs one 128-byte
    wavefront per bank pass, so an ``ldmatrix.x4`` costs 4 (512 bytes), a warp's float32x4
    store 4, a float2 load 2, a 4-byte load 1, and a 2-way bank conflict doubles its store.

    The loads and stores (every region but the first) are what the shared-memory pipe must
    serve whatever the schedule: with ``2 BM BN (D + Dc)`` FLOPs per tile they bound the
    kernel at ``FLOPs / bytes`` times the pipe's bandwidth (the benchmark's roofline). The
    ``cp.async`` copies also write the tile into shared memory, but through the L1 fill path;
    whether they take the same bandwidth is not known from the instruction count (Nsight
    Compute charges a warp's copy about 1.4 wavefronts, not 4), so they are listed apart.
    For 576-wide rows: 164 864 bytes of loads and stores and 36 864 of copies per 2.23 MFLOP.
    """
    D = Dc + Dr
    wave = 128
    ldsm = 4 * wave                     # one ldmatrix.x4: 4 matrices of 8 rows x 16 bytes
    k_steps = D // 16                   # the score k-steps; each row tile's warps do all of
    groups = Dc // 16                   # them once. P V: 16-column groups, each read by one
    pv_steps = BN // 16                 # warp per k-step of 16 slots
    return {
        "copies in (cp.async, apart)": BN * D * 2,
        "K fragments (scores)": ROW_TILES * k_steps * 2 * ldsm,     # two x4 per k-step
        "partial scores, written and read":                         # NT float32x4 stores,
            WARPS * (NT * 4 + KSPLIT * 2 * 2) * wave,               # 2 float2 loads per k-warp
        "probabilities, written and read":                          # two 4-byte stores a lane
            WARPS * (2 * 2 * wave + pv_steps * 2 * ldsm),           # (rows r, r + 8 share
                                                                    # banks: 2 passes each)
        "rescale factors": WARPS * 5 * wave,                        # 1 store, 4 loads
        "V fragments (P V)": groups * pv_steps * ldsm,
    }


def supported(kind: str, Dc: int, Dr: int) -> bool:
    """Whether the mma variant handles a ``kind`` cache of ``Dc + Dr`` wide rows."""
    return kind in ("bfloat16", "float16") and Dc % 16 == 0 and Dr % 16 == 0 and Dc > 0


def _make_mma_kernel(kind: str, Dc: int, Dr: int, stages: int, fused_merge: bool = True):
    D = Dc + Dr
    KSTEPS = D // 16                    # k-steps of 16 dims in a score
    KQ = -(-KSTEPS // KSPLIT)           # k-steps per warp (round-robin; some warps one fewer)
    Q_REGS = 4 * KQ                     # A-fragment registers of the query rows, per lane
    GROUPS = Dc // 16                   # 16-column groups of the output (two n-tiles each)
    GQ = -(-GROUPS // WARPS)            # groups per warp
    O_VALUES = ROW_TILES * GQ * 8       # float32 accumulators of the output, per lane
    ROW = D + 8                         # staged row stride in 16-bit values (+16 bytes)
    CHUNKS = D // 8                     # 16-byte chunks per cache row
    CHUNK_STEPS = -(-CHUNKS // 8)       # chunks per staging thread (8 threads per row)
    ROW_BYTES = 2 * D
    STAGES = stages
    LAYOUT = shared_layout(Dc, Dr, stages)
    TILE_BYTES = LAYOUT.tile
    PART4 = LAYOUT.partial // 16        # the regions, as indices of the aliased views
    PART2 = LAYOUT.partial // 8
    PROB32 = LAYOUT.probs // 4
    PROBS = LAYOUT.probs
    ALPHA = LAYOUT.alpha // 4
    INVERSE = LAYOUT.inverse // 4
    P_WORDS = P_STRIDE // 2             # 32-bit words per probability row
    RESCALE = float32(RESCALE_BELOW)
    ACC = 4 * NT                        # score accumulators per lane (local sizes: constants)
    V_REGS = 4 * GQ                     # V fragment registers of one P V k-step, per lane
    COPIES_PER_STEP = 3                 # copy chunks issued beside each score k-step
    assert CHUNK_STEPS <= COPIES_PER_STEP * KQ  # the k-steps carry every chunk (both are
                                                # ceil(D / 64): 16-byte chunks, 8 threads a row)
    ROW_WORDS = ROW // 2                # 32-bit words per staged row
    LAT_STEPS = -(-Dc // 64)            # query pairs per lane and row: latent part ...
    ROPE_STEPS = -(-Dr // 64)           # ... and rope part (a warp reads a row at a time)
    Q_LOADS = (BM // WARPS) * 2 * (LAT_STEPS + ROPE_STEPS)  # query values a lane loads
    Q_ROWS = BM // WARPS                # query rows each warp brings into shared memory
    Q_BUF = (STAGES - 1) * TILE_BYTES   # the buffer that is free until the loop starts
    OUT_STRIDE = Dc + 4                 # float32 row stride of the output staged at the end
    assert BM * OUT_STRIDE * 4 <= STAGES * TILE_BYTES   # it fits where the tiles were
    # the fused merge, where the partial scores were (float32 indices): the split weights
    # of the block's rows [BM, MAX_PREFIX_SPLITS], each row's largest lse and weight sum,
    # and the flag that says this block arrived last
    MERGE_W = LAYOUT.partial // 4
    MERGE_M = MERGE_W + BM * MAX_PREFIX_SPLITS
    MERGE_T = MERGE_M + BM
    LAST = MERGE_T + BM
    COLS_PER_LANE = -(-Dc // 32)        # output columns a lane merges per row
    MERGE_VALUES = Q_ROWS * COLS_PER_LANE   # values a lane merges (local sizes: constants)
    assert 4 * (LAST + 1) <= LAYOUT.probs
    mma = tc.mma_bf16_16816 if kind == "bfloat16" else tc.mma_f16_16816
    pack = tc.pack_bf16x2 if kind == "bfloat16" else tc.pack_f16x2
    EXPONENT = uint32(0x7F80 if kind == "bfloat16" else 0x7C00)   # all ones: NaN or +-inf

    @cuda.jit(device=True, inline="always")
    def finite_pair(word):
        """Both 16-bit values of ``word`` with NaN and +-inf replaced by 0."""
        low = uint32(0) if word & EXPONENT == EXPONENT else uint32(0x0000FFFF)
        high = uint32(0) if (word >> uint32(16)) & EXPONENT == EXPONENT else uint32(0xFFFF0000)
        return word & (low | high)

    @cuda.jit(device=True, inline="always")
    def masked(s, scale2, bits, b, i, slot, P, hi):
        """``scale2 * s`` if row ``i`` sees ``slot``, else ``-inf`` (a select: a NaN score of
        an invisible slot never reaches the row)."""
        visible = slot < hi
        if visible and slot >= P:
            j = uint32(slot - P)
            visible = (bits[b, i, j // uint32(32)] >> (j % uint32(32))) & uint32(1) != 0
        return s * scale2 if visible else NEG_INF

    @cuda.jit(device=True, inline="always")
    def table_entry(block_table, b, page_index):
        """The block-table entry of page ``page_index`` of request ``b`` (clamped to the
        table: the slots a tile ahead may lie past it). Read one tile before the copy that
        needs it and used only there (``copy_plan`` checks the slot): nothing consumes the load
        before the next tile's barrier, so its latency hides behind a tile of products."""
        return block_table[b, min(page_index, uint32(block_table.shape[1] - 1))]

    @cuda.jit(device=True, inline="always")
    def next_slot(slot, page_index, in_page, pages_per_tile, rest_per_tile, page_size):
        """``(slot, slot // page_size, slot % page_size)`` advanced by one tile (``BN``
        slots), without a division: ``BN = pages_per_tile page_size + rest_per_tile``."""
        in_page += rest_per_tile
        page_index += pages_per_tile
        if in_page >= page_size:
            in_page -= page_size
            page_index += uint32(1)
        return slot + BN, page_index, in_page

    @cuda.jit(device=True, inline="always")
    def copy_plan(kv_base, buf, live, page, in_page, page_size, num_pages, tid):
        """This thread's share of one tile's copy into buffer ``buf``: row ``tid // 8`` of
        the tile, from offset ``in_page`` of cache ``page``; 16-byte chunks ``tid % 8, + 8,
        ...`` (8 neighbouring threads: 128 contiguous bytes). Returns the first chunk's
        shared address and byte offset in the cache and the bytes to read: 0 (zeros
        written, nothing read) when the slot is not ``live`` (past the split's end) or
        ``page`` is outside the cache."""
        nbytes = uint32(0)
        offset = uint64(0)
        if live and 0 <= page < num_pages:
            nbytes = uint32(16)
            offset = (uint64(page) * uint64(page_size) + uint64(in_page)) * uint64(ROW_BYTES)
        first = tid % 8
        dst = kv_base + uint32(buf * TILE_BYTES + 2 * (tid // 8) * ROW + 16 * first)
        return dst, offset + uint64(16 * first), nbytes

    @cuda.jit(device=True, inline="always")
    def copy_chunk(dst, src, offset, nbytes, u, tid):
        """Chunk ``u`` of this thread's share (``copy_plan``): 16 bytes, 128 bytes on."""
        if CHUNKS % 8 == 0 or tid % 8 + 8 * u < CHUNKS:     # (folds away when even)
            tc.cp_async_16(dst + uint32(128 * u), src, offset + uint64(128 * u), nbytes)

    @cuda.jit(device=True, inline="always")
    def stage(kv_base, buf, cache_flat, live, page, in_page, page_size, num_pages, tid):
        """Issue this thread's copies of one tile into buffer ``buf`` at once (``copy_plan``;
        the loop spreads them over the score k-steps instead)."""
        dst, offset, nbytes = copy_plan(kv_base, buf, live, page, in_page, page_size,
                                        num_pages, tid)
        src = _ffi.from_buffer(cache_flat)
        for u in range(CHUNK_STEPS):
            copy_chunk(dst, src, offset, nbytes, u, tid)

    @cuda.jit(device=True, inline="always")
    def pv_step(o, pa0, pa1, vf, probs, v_rows, warp, tree):
        """All 32 lanes of the warp, converged (ldmatrix and mma.sync are warp-wide;
        ``warp`` and ``tree`` the same in every lane). ``O += P V`` over one k-step of 16
        slots: the probabilities of both row tiles at
        ``probs`` (this lane's ldmatrix address), the V rows at ``v_rows`` (likewise), this
        warp's column groups ``warp, warp + WARPS, ...``. Every fragment of the k-step is
        loaded first (``vf[4 q:]``: group ``q``), then the products: the loads overlap each
        other, and no branch sits between a load and the product that waits for it. Written
        as a function called once per k-step (not a loop over them): every index of ``o``
        stays a constant, so ``o`` stays in registers on every target."""
        tc.ldmatrix_x4(_ffi.from_buffer(pa0), probs)
        tc.ldmatrix_x4(_ffi.from_buffer(pa1), probs + uint32(2 * 16 * P_STRIDE))
        for q in range(GQ):
            if GROUPS % WARPS == 0 or warp + WARPS * q < GROUPS:
                tc.ldmatrix_x4_trans(_ffi.from_buffer(vf[4 * q:]),
                                     v_rows + uint32(32 * (warp + WARPS * q)))
        if tree:                                # invisible rows may hold NaN: 0 * NaN = NaN
            for k in range(V_REGS):
                vf[k] = finite_pair(vf[k])
        for q in range(GQ):
            if GROUPS % WARPS == 0 or warp + WARPS * q < GROUPS:
                v = 4 * q
                mma(_ffi.from_buffer(o[8 * q:]), pa0[0], pa0[1], pa0[2], pa0[3], vf[v],
                    vf[v + 1])
                mma(_ffi.from_buffer(o[8 * q + 4:]), pa0[0], pa0[1], pa0[2], pa0[3], vf[v + 2],
                    vf[v + 3])
                mma(_ffi.from_buffer(o[GQ * 8 + 8 * q:]), pa1[0], pa1[1], pa1[2], pa1[3],
                    vf[v], vf[v + 1])
                mma(_ffi.from_buffer(o[GQ * 8 + 8 * q + 4:]), pa1[0], pa1[1], pa1[2], pa1[3],
                    vf[v + 2], vf[v + 3])

    @cuda.jit(device=True, inline="always")
    def stage_rows(smem_f32, o, base, rb, warp, t):
        """This lane's outputs of one row tile (``o[base:]``: block rows ``rb`` and ``rb +
        8``), divided by their rows' ``l``, into the float32 output staged in shared memory
        (rows ``OUT_STRIDE`` apart, where the tiles were). Called once per row tile, not in
        a loop: the indices of ``o`` stay constants (registers)."""
        inv = smem_f32[INVERSE + rb]
        inv8 = smem_f32[INVERSE + rb + 8]
        for q in range(GQ):
            group = warp + WARPS * q
            if GROUPS % WARPS == 0 or group < GROUPS:
                at = rb * OUT_STRIDE + 16 * group + 2 * t
                k = base + 8 * q
                smem_f32[at] = o[k] * inv
                smem_f32[at + 1] = o[k + 1] * inv
                smem_f32[at + 8] = o[k + 4] * inv
                smem_f32[at + 9] = o[k + 5] * inv
                at += 8 * OUT_STRIDE
                smem_f32[at] = o[k + 2] * inv8
                smem_f32[at + 1] = o[k + 3] * inv8
                smem_f32[at + 8] = o[k + 6] * inv8
                smem_f32[at + 9] = o[k + 7] * inv8

    @cuda.jit(device=True, inline="always")
    def write_empty_rows(out, lse, b, row0, rows, H, warp, lane):
        """Rows of a row block that no split computes (padding rows, or a request with no
        slot): 0 and ``-inf``, what the merge of no split gives. Warp ``w`` writes rows
        ``Q_ROWS w ..``, lane ``l`` the columns ``l, l + 32, ...``."""
        for rr in range(Q_ROWS):
            row = row0 + Q_ROWS * warp + rr
            if row < rows:
                i = uint32(row) // uint32(H)
                h = uint32(row) % uint32(H)
                for d in range(lane, Dc, 32):
                    out[b, i, h, d] = float32(0.0)
                if lane == 0:
                    lse[b, i, h] = NEG_INF

    @cuda.jit(device=True, inline="always")
    def merge_rows(smem_f32, part_out, part_lse, out, lse, splits, b, row0, rows, n, H, tid,
                   warp, lane):
        """Every thread of the block (it has a barrier). The splits of the block's rows
        combined by log-sum-exp, in split order: the
        expressions and the order of ``splits._merge_prefix_kernel`` (the same bits).
        Thread ``r < BM`` computes row ``r``'s split weights, their largest lse and their sum
        into shared memory. After the barrier warp ``w`` merges rows ``Q_ROWS w ..``, lane
        ``l`` the columns ``l, l + 32, ...`` of each: split by split, all ``Q_ROWS x
        COLS_PER_LANE`` values of a split are loaded before they are added (64 loads in
        flight a thread; one at a time, the kernel took 164 us where it now takes 110 at
        bs 1, N 16, P 1024, H 128), rows past the launch's clamped to its last (loaded,
        never written)."""
        if tid < BM and row0 + tid < rows:
            row = row0 + tid
            M = split_max(part_lse, splits, b, row)
            total = float32(0.0)
            for s in range(splits):             # in split order, as the merge kernel sums
                w = split_weight(part_lse[s, b, row], M)
                smem_f32[MERGE_W + MAX_PREFIX_SPLITS * tid + s] = w
                total += w
            smem_f32[MERGE_M + tid] = M
            smem_f32[MERGE_T + tid] = total
        cuda.syncthreads()                      # every row's weights are written
        r0 = Q_ROWS * warp
        value = cuda.local.array(MERGE_VALUES, float32)
        for k in range(MERGE_VALUES):
            value[k] = 0.0
        for s in range(splits):
            for rr in range(Q_ROWS):
                w = smem_f32[MERGE_W + MAX_PREFIX_SPLITS * (r0 + rr) + s]
                row = min(row0 + r0 + rr, rows - 1)
                for u in range(COLS_PER_LANE):
                    d = min(lane + 32 * u, Dc - 1)
                    value[COLS_PER_LANE * rr + u] += w * part_out[s, b, row, d]
        for rr in range(Q_ROWS):
            row = row0 + r0 + rr
            if row < rows:
                i = uint32(row) // uint32(H)
                h = uint32(row) % uint32(H)
                total = smem_f32[MERGE_T + r0 + rr]
                for u in range(COLS_PER_LANE):
                    d = lane + 32 * u
                    if Dc % 32 == 0 or d < Dc:
                        out[b, i, h, d] = (merged_value(value[COLS_PER_LANE * rr + u], total)
                                           if i < n else float32(0.0))     # (padding row)
                if lane == 0:
                    lse[b, i, h] = (merged_lse(smem_f32[MERGE_M + r0 + rr], total) if i < n
                                    else NEG_INF)

    # Not in the on-disk kernel cache (DDTREE_KERNEL_CACHE): numba cannot store a kernel that
    # links CUDA C++ (the mma.sync wrappers), so each process compiles it.
    @cuda.jit(launch_bounds=(MMA_THREADS, BLOCKS_PER_SM))
    def mma_kernel(q_latent, q_rope, cache, block_table, prefix_lens, bits, num_nodes, sm_scale,
                   part_out, part_lse, cache_flat, out, lse, arrivals):
        # One dynamic shared block (LAYOUT), seen through aliased views of several types.
        smem = cuda.shared.array(0, uint16, alignment=16)
        smem_f32x4 = cuda.shared.array(0, F32X4)
        smem_f32x2 = cuda.shared.array(0, F32X2)
        smem_u32 = cuda.shared.array(0, uint32)
        smem_f32 = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4                           # C layout: rows g and g + 8 ...
        t = lane % 4                            # ... columns 2t, 2t + 1, 2t + 8, 2t + 9
        rt = warp // KSPLIT                     # scores: this warp's row tile ...
        kw = warp % KSPLIT                      # ... and its share of the k-steps
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
        if lo >= hi or row0 >= n * H or split >= MAX_PREFIX_SPLITS:    # no slot here, or
            if fused_merge and split == 0:      # only padding rows: if no split computes this
                write_empty_rows(out, lse, b, row0, rows, H, warp, lane)   # row block, its
            return                              # first writes it (or the merge kernel does)

        # Softmax: this thread owns row r_own of the block (of its warp's row tile) and the
        # slots 8 nt + 2t, + 1 of each tile for nt = nt_own and nt_own + 2; the 8 lanes of a
        # row differ in bits 0-2 of the lane.
        gs = lane // 16
        h_own = (lane // 8) % 2
        nt_own = (lane // 4) % 2
        g_own = 2 * kw + gs
        r_own = 16 * rt + g_own + 8 * h_own
        i_own = uint32(min(row0 + r_own, rows - 1)) // uint32(H)
        # its partial scores of n-tile nt from k-warp p sit in float2 PART2 + 2 (((rt KSPLIT
        # + p) NT + nt) 32 + ((4 g_own + t) ^ 4 (nt % 2))) + h_own: the c0, c1 (h 0) or c2,
        # c3 of the lane 4 g_own + t that computed them, undoing the writers' swizzle
        part_read = PART2 + 2 * ((rt * KSPLIT * NT + nt_own) * 32
                                 + ((4 * g_own + t) ^ (4 * nt_own))) + h_own

        # ldmatrix addresses (bytes from a tile's start) that this lane provides:
        # scores: row lane % 8 of matrix m = lane // 8: slots 8 (m // 2) .., dims 8 (m % 2)
        # .. of a k-step (slots 16-31: the same address + 16 rows)
        k_lane = 2 * ((lane % 8 + 8 * (lane // 16)) * ROW + 8 * ((lane // 8) % 2))
        # P V (.trans): matrix lane // 8 = slots 0-7 | 8-15, columns +0 | +8 of a group
        v_lane = 2 * ((lane % 8 + 8 * ((lane // 8) % 2)) * ROW + 8 * (lane // 16))
        # probabilities (A of P V): matrix lane // 8 = rows 0-7 | 8-15, slots 0-7 | 8-15 ...
        p_lane = 2 * ((lane % 16) * P_STRIDE + 8 * (lane // 16))   # ... (a0, a1, a2, a3)
        # queries (A of the scores): matrix lane // 8 = rows 0-7 | 8-15, dims +0 | +8 ...
        q_lane = 2 * ((16 * rt + lane % 16) * ROW + 8 * (lane // 16))   # ... (a0 .. a3)
        kv_base = tc.shared_address(_ffi.from_buffer(smem))
        scale2 = sm_scale * float32(LOG2E)      # scores in base 2: exp2 is one instruction

        o = cuda.local.array(O_VALUES, float32)
        for k in range(O_VALUES):
            o[k] = 0.0
        acc = cuda.local.array(ACC, float32)    # partial scores, n-tile nt at 4 nt (C)
        frag = cuda.local.array(4, uint32)      # one ldmatrix.x4 of K: slots 0-15 ...
        frag2 = cuda.local.array(4, uint32)     # ... and 16-31
        vf = cuda.local.array(V_REGS, uint32)   # V fragments of one P V k-step
        pa0 = cuda.local.array(4, uint32)       # probabilities of row tile 0 (A fragment)
        pa1 = cuda.local.array(4, uint32)       # ... row tile 1
        m_own = NEG_INF                         # running max of row r_own (base 2)
        l_own = float32(0.0)                    # running sum, this lane's slots only

        # Staging: thread tid copies row tid // 8 of each tile: slot st_slot, on page
        # st_page of the request at offset st_in_page (advanced a tile at a time), whose
        # block-table entry st_entry is read one tile before its copy is issued.
        tiles = (hi - lo + BN - 1) // BN
        page_size32 = uint32(page_size)
        pages_per_tile = uint32(BN) // page_size32      # the kernel's only divisions by
        rest_per_tile = uint32(BN) % page_size32        # the page size
        st_slot = lo + tid // 8
        st_page = uint32(st_slot) // page_size32
        st_in_page = uint32(st_slot) % page_size32
        for s in range(STAGES - 1):             # prologue: tiles 0 .. STAGES - 2 in flight
            if s < tiles:
                entry = table_entry(block_table, b, st_page)
                stage(kv_base, s, cache_flat, st_slot < hi, entry, st_in_page, page_size,
                      num_pages, tid)
            tc.cp_async_commit()                # (empty groups keep the count uniform)
            st_slot, st_page, st_in_page = next_slot(st_slot, st_page, st_in_page,
                                                     pages_per_tile, rest_per_tile,
                                                     page_size32)
        st_entry = table_entry(block_table, b, st_page)

        # The queries, while the first tiles land: warp w brings block rows Q_ROWS w ..
        # Q_ROWS w + Q_ROWS - 1 into buffer STAGES - 1 (free until the loop's first barrier),
        # rounded to 16 bits; lane l loads the pairs l, l + 32, ... of each row's latent and
        # rope parts (a warp reads 256 contiguous bytes per pair of loads); rows past N H are
        # zeros and never written.
        # Then each warp takes the A fragments of its k-steps of its row tile, for the whole
        # split, by ldmatrix.
        qv = cuda.local.array(Q_LOADS, float32)
        for rr in range(Q_ROWS):                # every load first (no branch between them:
            flat = min(row0 + Q_ROWS * warp + rr, rows - 1)     # clamped rows and dims,
            i_r = uint32(flat) // uint32(H)     # selected away below), so they all fly at
            h_r = uint32(flat) % uint32(H)      # once ...
            at = 2 * (LAT_STEPS + ROPE_STEPS) * rr
            for u in range(LAT_STEPS):
                d = min(2 * (lane + 32 * u), Dc - 2)
                qv[at + 2 * u] = q_latent[b, i_r, h_r, d]
                qv[at + 2 * u + 1] = q_latent[b, i_r, h_r, d + 1]
            for u in range(ROPE_STEPS):
                d = min(2 * (lane + 32 * u), Dr - 2)
                qv[at + 2 * (LAT_STEPS + u)] = q_rope[b, i_r, h_r, d]
                qv[at + 2 * (LAT_STEPS + u) + 1] = q_rope[b, i_r, h_r, d + 1]
        for rr in range(Q_ROWS):                # ... then packed and stored
            r = Q_ROWS * warp + rr
            valid = row0 + r < rows
            at = 2 * (LAT_STEPS + ROPE_STEPS) * rr
            for u in range(LAT_STEPS):
                w = lane + 32 * u
                if Dc % 64 == 0 or 2 * w < Dc:
                    word = pack(qv[at + 2 * u], qv[at + 2 * u + 1])
                    smem_u32[Q_BUF // 4 + r * ROW_WORDS + w] = word if valid else uint32(0)
            for u in range(ROPE_STEPS):
                w = lane + 32 * u
                if Dr % 64 == 0 or 2 * w < Dr:
                    word = pack(qv[at + 2 * (LAT_STEPS + u)], qv[at + 2 * (LAT_STEPS + u) + 1])
                    smem_u32[Q_BUF // 4 + r * ROW_WORDS + Dc // 2 + w] = (
                        word if valid else uint32(0))
        cuda.syncthreads()                      # the block's query rows are staged
        qa = cuda.local.array(Q_REGS, uint32)
        for kk in range(KQ):
            ks = kw + KSPLIT * kk
            if KSTEPS % KSPLIT == 0 or ks < KSTEPS:
                tc.ldmatrix_x4(_ffi.from_buffer(qa[4 * kk:]),
                               kv_base + uint32(Q_BUF + q_lane + 32 * ks))
            else:
                for k in range(4):
                    qa[4 * kk + k] = uint32(0)

        src = _ffi.from_buffer(cache_flat)
        for j in range(tiles):
            tile_start = lo + BN * j
            tc.cp_async_wait_pending(STAGES - 2)    # this thread's copies of tile j landed
            cuda.syncthreads()                  # everyone's have; nobody reads tile j - 1
            ahead = j + STAGES - 1              # its buffer now takes tile j + STAGES - 1,
            copying = ahead < tiles             # copied chunk by chunk between the k-steps
            c_dst, c_offset, c_bytes = copy_plan(kv_base, ahead % STAGES, st_slot < hi,
                                                 st_entry, st_in_page, page_size, num_pages,
                                                 tid)
            st_slot, st_page, st_in_page = next_slot(st_slot, st_page, st_in_page,
                                                     pages_per_tile, rest_per_tile,
                                                     page_size32)
            st_entry = table_entry(block_table, b, st_page)
            tile = kv_base + uint32(TILE_BYTES * (j % STAGES))

            # 1. partial scores of this warp's k-steps: its 16 rows x 32 slots; chunks 3 kk ..
            # 3 kk + 2 of this thread's copy of tile j + STAGES - 1 go out beside k-step kk
            # (the copies spread over the products rather than queueing at once)
            for k in range(ACC):
                acc[k] = 0.0
            for kk in range(KQ):
                for u in range(COPIES_PER_STEP * kk, COPIES_PER_STEP * (kk + 1)):
                    if copying and u < CHUNK_STEPS:
                        copy_chunk(c_dst, src, c_offset, c_bytes, u, tid)
                ks = kw + KSPLIT * kk
                if KSTEPS % KSPLIT == 0 or ks < KSTEPS:      # (folds away when even)
                    k_step = tile + uint32(k_lane + 32 * ks)
                    tc.ldmatrix_x4(_ffi.from_buffer(frag), k_step)                # slots 0-15
                    tc.ldmatrix_x4(_ffi.from_buffer(frag2), k_step + uint32(32 * ROW))  # 16-31
                    mma(_ffi.from_buffer(acc[0:]), qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2],
                        qa[4 * kk + 3], frag[0], frag[1])
                    mma(_ffi.from_buffer(acc[4:]), qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2],
                        qa[4 * kk + 3], frag[2], frag[3])
                    mma(_ffi.from_buffer(acc[8:]), qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2],
                        qa[4 * kk + 3], frag2[0], frag2[1])
                    mma(_ffi.from_buffer(acc[12:]), qa[4 * kk], qa[4 * kk + 1],
                        qa[4 * kk + 2], qa[4 * kk + 3], frag2[2], frag2[3])
            tc.cp_async_commit()                # (empty groups keep the count uniform)
            # lane L's float32x4 of n-tile nt goes to [rt, kw, nt, L ^ 4 (nt % 2)]: each
            # 8-lane phase of a store fills 128 contiguous bytes, and the readers' phases too
            part = PART4 + (rt * KSPLIT + kw) * NT * 32
            for nt in range(NT):
                smem_f32x4[part + 32 * nt + (lane ^ (4 * (nt % 2)))] = float32x4(
                    acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3])
            cuda.syncthreads()                  # all partial scores are written

            # 2. this thread's four scores (slots c, c + 1 and c + 16, c + 17): the 4 k-warps
            # summed in a fixed order, base 2, masked only in tiles that hold tree slots or
            # the split's end
            x0 = float32(0.0)
            y0 = float32(0.0)
            x1 = float32(0.0)
            y1 = float32(0.0)
            for p in range(KSPLIT):
                v = smem_f32x2[part_read + 2 * 32 * (NT * p)]
                w = smem_f32x2[part_read + 2 * 32 * (NT * p + 2)]
                x0 += v.x
                y0 += v.y
                x1 += w.x
                y1 += w.y
            if tile_start + BN <= P and tile_start + BN <= hi:
                x0 *= scale2                    # an interior prefix tile: nothing to mask
                y0 *= scale2
                x1 *= scale2
                y1 *= scale2
            else:
                c = tile_start + 8 * nt_own + 2 * t
                x0 = masked(x0, scale2, bits, b, i_own, c, P, hi)
                y0 = masked(y0, scale2, bits, b, i_own, c + 1, P, hi)
                x1 = masked(x1, scale2, bits, b, i_own, c + 16, P, hi)
                y1 = masked(y1, scale2, bits, b, i_own, c + 17, P, hi)
            # online softmax of the row: its max over the 8 lanes that hold its 32 slots
            mx = max(max(x0, y0), max(x1, y1))
            mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 1))
            mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 2))
            mx = max(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 4))
            alpha = float32(1.0)
            p0 = float32(0.0)
            p1 = float32(0.0)
            p2 = float32(0.0)
            p3 = float32(0.0)
            if mx > NEG_INF or m_own > NEG_INF:     # (else nothing visible yet: all stays 0)
                if mx > m_own + RESCALE:        # the row max outgrew the reference max:
                    alpha = math.exp2(m_own - mx)   # move it (alpha = 0 on the first visible
                    l_own *= alpha                  # tile, where m_own is -inf)
                    m_own = mx
                p0 = math.exp2(x0 - m_own)      # at most 2^RESCALE_BELOW: no overflow
                p1 = math.exp2(y0 - m_own)
                p2 = math.exp2(x1 - m_own)
                p3 = math.exp2(y1 - m_own)
                l_own += (p0 + p1) + (p2 + p3)
            # the probabilities, rounded to 16 bits, into the [BM, P_STRIDE] tile; the row's
            # rescale factor beside them (written by the row's first lane)
            smem_u32[PROB32 + r_own * P_WORDS + 4 * nt_own + t] = pack(p0, p1)
            smem_u32[PROB32 + r_own * P_WORDS + 4 * nt_own + t + 8] = pack(p2, p3)
            if lane % 8 == 0:
                smem_f32[ALPHA + r_own] = alpha
            cuda.syncthreads()                  # probabilities and factors are written

            # 3. O += P V: all 32 rows, this warp's column groups
            a_0 = smem_f32[ALPHA + g]           # the factors of this lane's C rows:
            a_1 = smem_f32[ALPHA + g + 8]       # g, g + 8 of row tile 0 ...
            a_2 = smem_f32[ALPHA + g + 16]      # ... and of row tile 1
            a_3 = smem_f32[ALPHA + g + 24]
            if cuda.any_sync(FULL_MASK, a_0 != 1.0 or a_1 != 1.0 or a_2 != 1.0 or a_3 != 1.0):
                for k in range(0, GQ * 8, 4):   # values 0, 1 are row g, 2, 3 row g + 8
                    o[k] *= a_0
                    o[k + 1] *= a_0
                    o[k + 2] *= a_1
                    o[k + 3] *= a_1
                    o[GQ * 8 + k] *= a_2
                    o[GQ * 8 + k + 1] *= a_2
                    o[GQ * 8 + k + 2] *= a_3
                    o[GQ * 8 + k + 3] *= a_3
            tree = tile_start + BN > P          # the tile holds tree slots (block-uniform)
            pv_step(o, pa0, pa1, vf, kv_base + uint32(PROBS + p_lane),
                    tile + uint32(v_lane), warp, tree)              # slots 0-15
            pv_step(o, pa0, pa1, vf, kv_base + uint32(PROBS + p_lane + 32),
                    tile + uint32(v_lane + 2 * 16 * ROW), warp, tree)   # slots 16-31

        # The split's partial: out / l and m + log l per row (l summed over the row's lanes).
        l_own += cuda.shfl_xor_sync(FULL_MASK, l_own, 1)
        l_own += cuda.shfl_xor_sync(FULL_MASK, l_own, 2)
        l_own += cuda.shfl_xor_sync(FULL_MASK, l_own, 4)
        if lane % 8 == 0:
            smem_f32[INVERSE + r_own] = float32(1.0) / l_own if l_own > 0 else float32(0.0)
            if row0 + r_own < rows:             # natural log: (m + log2 l) ln 2
                part_lse[split, b, row0 + r_own] = ((m_own + math.log2(l_own)) * LN2
                                                    if l_own > 0 else NEG_INF)
        tc.cp_async_wait_all()                  # (none can be left: a safeguard)
        cuda.syncthreads()                      # every row's 1 / l is written, and no warp
        stage_rows(smem_f32, o, 0, g, warp, t)  # reads the tiles any more: the output is
        stage_rows(smem_f32, o, GQ * 8, 16 + g, warp, t)    # staged where they were ...
        cuda.syncthreads()                      # ... all of it
        # ... and written row by row: warp w the rows it brought in, lane l the columns
        # l, l + 32, ... (128 contiguous bytes per store instruction)
        for rr in range(Q_ROWS):
            r = Q_ROWS * warp + rr
            if row0 + r < rows:
                for u in range(Dc // 32):
                    part_out[split, b, row0 + r, lane + 32 * u] = smem_f32[
                        r * OUT_STRIDE + lane + 32 * u]
                if Dc % 32 != 0 and lane + 32 * (Dc // 32) < Dc:
                    part_out[split, b, row0 + r, lane + 32 * (Dc // 32)] = smem_f32[
                        r * OUT_STRIDE + lane + 32 * (Dc // 32)]

        if not fused_merge:                     # (small launches: the merge kernel
            return                              # follows this one, see verify_attn)
        # The merge, fused: the last of the row block's `splits` blocks to get here merges
        # them. Each thread's fence orders its partial stores before the barrier; the
        # barrier, before thread 0's count of arrivals (atomic.inc wraps to 0 after the
        # last, so the counters are all 0 again for the next launch, with no reset).
        cuda.threadfence()                      # this thread's partials are visible GPU-wide
        cuda.syncthreads()                      # ... and so every thread's of this block
        # the request's splits 0 .. splits - 1 (the bound keeps a direct launch with a larger
        # workspace inside the weights' rows; blocks past it returned above, uncounted)
        splits = prefix_splits(P, end, min(MAX_PREFIX_SPLITS, part_lse.shape[0]))
        if tid == 0:
            arrived = cuda.atomic.inc(arrivals, (b, cuda.blockIdx.y), uint32(splits - 1))
            # what the other splits wrote before they counted is visible after this fence
            cuda.threadfence()
            smem_u32[LAST] = uint32(1) if arrived == uint32(splits - 1) else uint32(0)
        cuda.syncthreads()                      # the flag is set before any thread reads it
        if smem_u32[LAST] == 0:                 # (block-uniform) another split merges
            return
        cuda.threadfence()                      # (and in every thread, before its reads)
        merge_rows(smem_f32, part_out, part_lse, out, lse, splits, b, row0, rows, n, H, tid,
                   warp, lane)

    return mma_kernel


#: ``kernel(kind, Dc, Dr, stages, fused_merge=True)``: the mma kernel for one storage kind, row
#: width and pipeline depth, made once. With ``fused_merge=False`` it stops after writing its
#: partials, for ``splits._merge_prefix_kernel`` to merge (``verify_attn`` launches that form
#: where the launch has few row blocks: ``FUSED_MERGE_ROW_BLOCKS_PER_SM``).
kernel = functools.cache(_make_mma_kernel)
