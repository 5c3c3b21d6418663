"""Tree-masked MLA-absorb attention on the GPU: ``kernels.verify_attn``.

Math (see ``reference.verify_attn``), for request ``b``, tree node ``i``, head ``h``::

    s[t]     = sm_scale * (q_latent[b, i, h] . c[t] + q_rope[b, i, h] . r[t])
    visible  = t < P  or  (t = P + j and bit j of visibility_bits[b, i])
    out      = sum_t softmax(s)[t] * c[t]              # [Dc], still in latent space
    lse      = log sum_t exp(s[t])

where ``[c | r] = kv_cache[block_table[b, t // page_size], t % page_size]`` (one 576-wide row
shared by all heads). Rows ``i >= num_nodes[b]`` are padding: ``out = 0``, ``lse = -inf``.
A row never depends on a cache row it cannot see: other branches' tree slots, padding slots,
slots past ``P + num_nodes[b]`` and unused pages may hold anything, NaN included. The kernels
never read a block-table entry or cache row past slot ``P + num_nodes[b] - 1`` (with
``check`` on, the launcher validates the pages of slots ``[0, P + N)`` on the host).

Buffers (``P = prefix_lens[b]``, ``W = ceil(N / 32)``; everything on the current stream):

=================== ================================ ===========================================
buffer              type and shape                   role
=================== ================================ ===========================================
``q_latent``        ``float32[bs, N, H, Dc]``        ``q_nope`` times ``W_UK`` (absorbed)
``q_rope``          ``float32[bs, N, H, Dr]``        rotary part of the queries
``kv_cache``        ``f32|bf16|f16[pages, ps, D]``   one row per slot: ``Dc`` latent, ``Dr`` rope
``block_table``     ``int32[bs, max_pages]``         slot ``t`` on page ``block_table[b, t // ps]``
``prefix_lens``     ``int32[bs]``                    ``P``: the root sits at slot ``P``
``visibility_bits`` ``uint32[bs, N, W]``             bit ``j`` of row ``i``: ``j`` on ``i``'s path
``num_nodes``       ``int32[bs]``                    valid nodes; rows past it are padding
``out_latent``      ``float32[bs, N, H, Dc]``        output (``out=``), still in latent space
``lse``             ``float32[bs, N, H]``            output (``out=``), natural log
``part_out``        ``float32[splits, bs, N H, Dc]`` tiled, mma (``workspace=``): ``out / l``
``part_lse``        ``float32[splits, bs, N H]``     tiled, mma (``workspace=``): ``m + log l``
``arrivals``        ``uint32[bs, ceil(N H / 32)]``   mma (``workspace=``): finished splits, 0
                                                     between launches
=================== ================================ ===========================================

FLOPs counted by the benchmark: ``2 * bs * N * H * T * (Dc + Dr + Dc)`` for ``T = P + N`` slots
(the score dot product over ``Dc + Dr`` and the weighted sum over ``Dc``; masked slots counted).
Bytes: the cache holds ``T * (Dc + Dr) * itemsize`` per request (2.4 MB in float32 at P = 1024),
read once from DRAM; the tiled variant then reads it ``ceil(N H / 32)`` times from L2 (each
block stages its slots twice: 576 values per row for the scores, 512 for the weighted sum),
plus its 32 query rows (``32 * (Dc + Dr) * 4`` bytes) once per slot tile. At bs = 1, N = 16,
H = 128, P = 1024 that is 4.6 GFLOP against ~2.4 MB of DRAM traffic: compute-bound by far.

Three variants, one module each; read them in this order:

* ``readable`` (``ddtree_numba.kernels.verify_attn.readable``; one idea per step, runs on
  the simulator): one thread per query row, the four steps of flash attention written out
  once. Every cache row is read once per query row: simple and slow.
* ``tiled`` (``ddtree_numba.kernels.verify_attn.tiled``; fast, GPU only): 32 query rows
  per block share each staged cache row; register-tiled products, online softmax by warp,
  flash-decoding over slot splits.
* ``mma`` (``ddtree_numba.kernels.verify_attn.mma``; GPU only, compute capability 8.0+,
  bfloat16 / float16 caches with ``Dc``, ``Dr`` multiples of 16; the default where it runs):
  the products on the tensor cores (``mma.sync`` through ``kernels/tensor_core.cu``), 32 query
  rows and 8 warps per block, 32-slot cache tiles staged by ``cp.async`` into dynamic shared
  memory (91.75 KB, two stages). Query rows and probabilities are rounded to the cache's
  16-bit type (the tolerance is stated in ``tests/test_verify_attn_mma.py``); splits are
  fixed by each request's own prefix length, so a row's bits do not depend on the rest of
  the launch. In launches of many row blocks the kernel merges its own splits (the last
  block of a row block to finish); in small ones a merge kernel follows; the same bits.
* ``ddtree_numba.kernels.verify_attn.splits``: how many slot splits the tiled and mma
  variants launch and the kernels that merge their partials by log-sum-exp.

The mask bit and the element widening are defined in ``readable`` and reused by ``tiled``.
This module holds the launcher ``verify_attn``, ``allocate_workspace`` and the build report's
list of specialisations.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from ...arrays import host_view, storage_kind
from ...limits import MAX_DC, MAX_NODES
from ...validation import check_verify_attn
from .. import tensor_core
from .._device import (
    SIMULATOR,
    allow_dynamic_shared,
    as_device,
    device_empty,
    launch,
    launch_stream,
    resolve_variant,
    sm_count,
)
from . import mma, readable, tiled
from .readable import READABLE_THREADS
from .splits import _merge_kernel, _merge_prefix_kernel, max_prefix_splits, plan_splits
from .tiled import BM, TILED_THREADS

VARIANTS = ("readable", "tiled", "mma")


def _kernel(variant: str, kind: str):
    """The ``variant`` kernel for storage ``kind`` (each module compiles it once)."""
    return (readable if variant == "readable" else tiled).kernel(kind)


def _compute_capability() -> tuple:
    return tuple(cuda.get_current_device().compute_capability)


def _mma_unsupported(kind: str, Dc: int, Dr: int, N: int = 1):
    """Why the mma variant cannot run here (None when it can)."""
    if SIMULATOR:
        return "the CUDA simulator cannot link the tensor-core wrappers"
    if not mma.supported(kind, Dc, Dr):
        return (f"it needs a bfloat16 or float16 cache with Dc and Dr multiples of 16, got a "
                f"{kind} cache with Dc = {Dc}, Dr = {Dr}")
    if N > MAX_NODES:
        return f"it handles up to {MAX_NODES} tree slots (its split merge), got N = {N}"
    if _compute_capability() < tensor_core.MIN_CC:
        return (f"it needs compute capability {tensor_core.MIN_CC[0]}.{tensor_core.MIN_CC[1]} "
                f"or newer, this GPU has {'.'.join(map(str, _compute_capability()))}")
    if _mma_stages(Dc, Dr) < 2:
        return (f"two staged tiles of {Dc + Dr} values do not fit this GPU's shared memory "
                f"({mma.shared_layout(Dc, Dr, 2).total} bytes needed)")
    return None


MMA_STAGES = 2      # cp.async pipeline depth of the mma variant, where shared memory allows
# The mma kernel merges its own splits (the last block of a row block to finish merges it)
# when the launch has at least this many row blocks per SM; fewer, and the merges, one block
# each, would run on few SMs after the products while the rest idle, so a merge kernel of one
# block per row follows instead. Both give the same bits. Measured on the H200 (132 SMs,
# benchmarks/bench_verify_attn_mma.py): fused 2-6 % faster from 128 row blocks up (bs 8, N 64,
# H 8; bs 1, N 64, H 128 and up), slower at 64 and below (bs 1, N 16, P 1024, H 128: 109.8
# against 102.8 us; H 8, P 4096: 67.0 against 48.3 us).
FUSED_MERGE_ROW_BLOCKS_PER_SM = 0.5


@functools.cache
def _stages_for(device_id: int, Dc: int, Dr: int) -> int:
    limit = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    fitting = [s for s in range(2, MMA_STAGES + 1) if mma.shared_layout(Dc, Dr, s).total <= limit]
    return max(fitting, default=0)


def _mma_stages(Dc: int, Dr: int) -> int:
    """Staged tiles of the mma variant on this GPU: ``MMA_STAGES`` (91.75 KB of shared memory
    for 576-wide rows, within sm_120's 99 KB and the H200's 227 KB), fewer where it does not
    fit, 0 where not even two do."""
    return _stages_for(cuda.get_current_device().id, Dc, Dr)


def choose_variant(variant, kind: str, Dc: int, Dr: int, N: int = 1) -> str:
    """The variant to launch: ``"mma"`` for 16-bit caches on GPUs with bf16 ``mma.sync``,
    ``"tiled"`` on other GPUs and caches, ``"readable"`` on the simulator."""
    if variant is None:
        if SIMULATOR:
            return "readable"
        return "tiled" if _mma_unsupported(kind, Dc, Dr, N) else "mma"
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    if variant == "mma":
        why = _mma_unsupported(kind, Dc, Dr, N)
        if why:
            raise ValueError(f"variant: 'mma' cannot run: {why}")
        return variant
    return resolve_variant(variant, readable="readable", fast="tiled")


def allocate_workspace(bs: int, N: int, H: int, Dc: int, max_slots: int, splits=None, *,
                       variant: str = "tiled"):
    """Device buffers for the split partials of the ``"tiled"`` or ``"mma"`` variant: pass them
    as ``workspace=`` when the call is captured in a CUDA graph (buffers allocated inside a
    captured call would be freed while the graph still uses them). One workspace serves one
    launch at a time (launches on one stream may share it).

    ``"tiled"``: ``(part_out, part_lse)``; ``max_slots`` and ``splits`` give its split count.
    ``"mma"``: ``(part_out, part_lse, arrivals)``, its split count from ``N`` alone
    (``splits.max_prefix_splits``); ``arrivals`` ``uint32[bs, ceil(N H / 32)]`` counts the
    splits of each row block that have finished (the last one merges them). It starts at
    zero and every launch leaves it at zero."""
    if variant == "mma":
        n_splits = max_prefix_splits(N)
        row_blocks = -(-N * H // mma.BM)
        arrivals = cuda.to_device(np.zeros((bs, row_blocks), np.uint32))
        return (device_empty((n_splits, bs, N * H, Dc), np.float32),
                device_empty((n_splits, bs, N * H), np.float32), arrivals)
    if variant == "tiled":
        n_splits, _ = plan_splits(bs, N, H, max_slots, splits)
        return (device_empty((n_splits, bs, N * H, Dc), np.float32),
                device_empty((n_splits, bs, N * H), np.float32))
    raise ValueError(f"variant: expected 'tiled' or 'mma', got {variant!r}")


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
        ``"mma"`` (the GPU default for 16-bit caches on compute capability 8.0+ with ``Dc``
        and ``Dr`` multiples of 16), ``"tiled"`` (the GPU default otherwise) or
        ``"readable"`` (the simulator default); see
        :func:`~ddtree_numba.kernels.verify_attn.choose_variant`.
    splits : int, optional
        Slot splits of the tiled variant (default: enough blocks to fill the GPU).
    out : tuple, optional
        Preallocated ``(out_latent, lse)`` device arrays.
    workspace : tuple, optional
        Split partials of the tiled or mma variant
        (:func:`~ddtree_numba.kernels.allocate_workspace`, with its ``variant``); required
        for CUDA graph capture, allocated per call otherwise.

    Returns
    -------
    tuple
        ``out_latent`` ``float32[bs, N, H, Dc]`` and ``lse`` ``float32[bs, N, H]`` on device.
    """
    sz = check_verify_attn(q_latent, q_rope, kv_cache, block_table, prefix_lens,
                           visibility_bits, num_nodes, sm_scale, check=check)
    if sz.Dc > MAX_DC:
        raise ValueError(f"q_latent: expected Dc <= {MAX_DC}, got Dc = {sz.Dc}")
    kind = storage_kind(kv_cache)
    variant = choose_variant(variant, kind, sz.Dc, sz.Dr, sz.N)
    if SIMULATOR and kind == "bfloat16":        # no bf16 on the simulator: widen exactly
        kv_cache = host_view(kv_cache).astype(np.float32)
        kind = "float32"
    ql, qr = as_device(q_latent), as_device(q_rope)
    cache = as_device(kv_cache)
    if kind == "bfloat16" or variant == "mma":  # 16-bit values travel as their bits
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
    if variant == "mma":
        return _launch_mma(sz, kind, args, cache, workspace, out_latent, lse, stream)
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


def _launch_mma(sz, kind, args, cache, workspace, out_latent, lse, stream):
    """The mma variant (``splits.max_prefix_splits(N)`` splits per request), which merges its
    own splits where the launch has enough row blocks (``FUSED_MERGE_ROW_BLOCKS_PER_SM``), and
    is followed by the merge kernel where it has not."""
    if workspace is None:
        workspace = allocate_workspace(sz.bs, sz.N, sz.H, sz.Dc, 0, variant="mma")
    n_splits = max_prefix_splits(sz.N)
    row_tiles = -(-sz.N * sz.H // mma.BM)
    want = ((n_splits, sz.bs, sz.N * sz.H, sz.Dc), (n_splits, sz.bs, sz.N * sz.H),
            (sz.bs, row_tiles))
    parts = tuple(workspace) if isinstance(workspace, (tuple, list)) else (workspace,)
    got = [tuple(getattr(w, "shape", ())) for w in parts]
    if got != list(want) or str(parts[2].dtype) != "uint32":
        raise ValueError(f"workspace: expected float32{list(want[0])}, float32{list(want[1])} "
                         f"and uint32{list(want[2])} (allocate_workspace(..., variant='mma')), "
                         f"got arrays of shapes {got}")
    part_out, part_lse, arrivals = parts
    if cache.__cuda_array_interface__["data"][0] % 16:
        raise ValueError("kv_cache: the mma variant copies 16-byte chunks: expected a cache "
                         "whose data starts at a multiple of 16 bytes")
    stages = _mma_stages(sz.Dc, sz.Dr)
    fused = sz.bs * row_tiles >= FUSED_MERGE_ROW_BLOCKS_PER_SM * sm_count()
    kernel = mma.kernel(kind, sz.Dc, sz.Dr, stages, fused)
    kernel_args = (*args, part_out, part_lse, cache.reshape(cache.size), out_latent, lse,
                   arrivals)
    nbytes = mma.shared_layout(sz.Dc, sz.Dr, stages).total
    allow_dynamic_shared(kernel, kernel_args, nbytes)
    launch(kernel, (n_splits, row_tiles, sz.bs), mma.MMA_THREADS, stream, nbytes)(*kernel_args)
    if not fused:
        _, _, _, _, prefix, _, nodes, _ = args
        launch(_merge_prefix_kernel, (sz.N * sz.H, sz.bs), 128, stream)(
            part_out, part_lse, prefix, nodes, sz.max_pages * sz.page_size, out_latent, lse)
    return out_latent, lse


def build_specs():
    """Specialisations launched by :func:`verify_attn` (for the build report)."""
    from numba import types

    from .._specs import KernelSpec

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
    sources = ((tensor_core.SOURCE_NAME, tensor_core.source()),)
    u16 = types.uint16
    for kind, fused in (("bfloat16", True), ("float16", True), ("bfloat16", False)):
        # DeepSeek-V3 / Kimi-K2 rows: Dc 512, Dr 64
        specs.append(KernelSpec("verify_attn", f"mma {kind}" + ("" if fused else ", merge apart"),
                                mma.kernel(kind, 512, 64, MMA_STAGES, fused),
                                (f4, f4, u16[:, :, ::1], i2, i1, bits, i1, types.float32, f4,
                                 types.float32[:, :, ::1], u16[::1], f4,
                                 types.float32[:, :, ::1], types.uint32[:, ::1]),
                                mma.MMA_THREADS, True, sources,
                                mma.shared_layout(512, 64, MMA_STAGES).total))
    specs.append(KernelSpec("verify_attn", "merge by prefix", _merge_prefix_kernel,
                            (f4, types.float32[:, :, ::1], i1, i1, types.int64, f4,
                             types.float32[:, :, ::1]), 128, True))
    specs.append(KernelSpec("verify_attn", "merge", _merge_kernel,
                            (f4, types.float32[:, :, ::1], i1, f4, types.float32[:, :, ::1]),
                            128, True))
    return specs
