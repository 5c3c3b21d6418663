"""KV commit on the GPU: ``kernels.commit_kv``, bit-exact to the reference, in place.

Math (reference): row of slot ``P + i`` <- row of slot ``P + a_i`` for ``i = 1..k``.

Parallel plan. Requests and row columns are independent; the moves of one request are not
(on the path ``0 -> 2 -> 3`` move 1 reads slot ``P + 2`` that move 2 writes). Since ``a_i >= i``,
no move reads a slot written by an *earlier* move, so "read all sources, then write all" equals
the sequential ascending order. One thread per (request, column) does exactly that for its
column, in chunks of ``CHUNK = 8`` moves held in registers (reads of a chunk, then its writes, in
ascending order: still the sequential semantics). No two threads touch the same element, so
no barrier is needed between moves. A move's addresses (source and destination page and
offset: two block-table lookups and divisions by the page size) are the same for every
column, so the block first *plans* them (``plan_moves``: one thread a move, into shared
memory, ``PLAN_MOVES`` at a time), then one barrier, then the columns move, and a barrier
after every round's moves (before the plan is replaced). Rounds in ascending order keep the
sequential semantics: a later round's reads never see an earlier round's writes (``a_j >= j
> i``), and an earlier round read its sources before any later round writes.

Grid ``(ceil(D / COMMIT_THREADS), bs, layers)``, block ``(COMMIT_THREADS,)``: a stacked cache
``[layers, num_pages, page_size, D]`` (every layer of a target in one array) commits all its
layers in this one launch, the moves of each layer as above; a one-layer cache is a stack of
one. ``k <= L`` in practice, so a thread moves a handful of elements; a warp moves 128
contiguous bytes of a row (fp32).
bfloat16 / float16 caches move as ``uint16`` bits (a copy needs no arithmetic).
Addresses are bounds-checked (path node in ``[0, N)``, slot in ``[0, capacity)``, page in
``[0, num_pages)``), so unchecked device inputs cannot read or write out of bounds. Slots are
computed in int64, so nothing wraps around, and divided by the page size in 32 bits: only a
valid prefix plans moves, and it keeps every slot below ``MAX_POSITION < 2**31``. A row
whose prefix ``P`` is no valid start (``P < 0`` or ``P + N > MAX_POSITION``, which the value
checks reject) moves nothing and keeps its prefix: ``new_prefix_lens[b] = P``; any other row
returns ``P + k + 1`` with ``k`` clamped to ``[0, N - 1]``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, int32, int64, uint32

from ..limits import MAX_POSITION
from ..validation import check_commit_kv, require_new_lengths
from ._device import CACHE_KERNELS, SIMULATOR, as_device, device_empty, launch, launch_stream

COMMIT_THREADS = 32 if SIMULATOR else 128
CHUNK = 8       # moves in flight per thread: k <= L <= 15 in DDTree, so one or two chunks
# Moves planned at a time (a plan of 1 KB; k <= L <= 15 in DDTree: one round). A plan of all
# N - 1 possible moves (16.9 KB) took sm_120 from 9 blocks an SM to 5. The simulator plans 16
# so that its tests take several rounds.
PLAN_MOVES = 16 if SIMULATOR else 64


@cuda.jit(device=True, inline="always")
def plan_moves(paging, nodes, N, P, first, count, num_pages, page_size, plan, tid, threads):
    """All threads of a block: the addresses of one request's moves ``first + 1 .. first +
    count`` (``count`` at most the plan's width: ``PLAN_MOVES`` in ``commit_kv``,
    ``MAX_NODES`` in ``accept_commit``) into ``plan`` (shared ``int32[4, width]``): move
    ``i`` (slot ``P + a_i`` to slot ``P + i``, ``a_i = nodes[i]``), entry ``j = i - first -
    1``, reads row ``(plan[0, j], plan[1, j])`` (page, offset in the page) and writes row
    ``(plan[2, j], plan[3, j])``; ``plan[0, j] = -1``: no move (an address failed its check).
    ``paging = (pages, first_page, capacity)``: slot ``s`` (``0 <= s < capacity``) is on page
    ``pages[s // page_size - first_page]``. The caller's ``P`` is a valid prefix
    (``valid_prefix``): every slot is then below ``2**31``, as the 32-bit divisions need. A
    move is the same for every column, so its divisions (about twenty instructions each in 32
    bits; a 64-bit one is a call) are made once here and not by every column's thread; the
    caller's barrier publishes the plan."""
    pages, first_page, capacity = paging
    # A slot is below MAX_POSITION < 2**31 (the callers' valid_prefix), so its page and offset
    # come from 32-bit unsigned divisions (the sm_90 build lost two calls of
    # __cuda_sm20_div_s64 here); a page of more than 2**31 slots divides every slot as one of
    # 2**31 does (page 0, offset the slot itself).
    size = uint32(min(page_size, 0x80000000))
    for j in range(tid, count, threads):
        plan[0, j] = -1
        i = first + j + 1
        a = nodes[i]
        src = P + a
        dst = P + i
        if 0 <= a < N and 0 <= src < capacity and 0 <= dst < capacity:
            src_q = uint32(src) // size     # (numba types these uint64; LLVM narrows a
            dst_q = uint32(dst) // size     # division of two widened uint32 back to 32 bits)
            src_page = pages[int64(src_q) - first_page]
            dst_page = pages[int64(dst_q) - first_page]
            if 0 <= src_page < num_pages and 0 <= dst_page < num_pages:
                plan[0, j] = src_page
                plan[1, j] = uint32(src) - uint32(src_q * size)
                plan[2, j] = dst_page
                plan[3, j] = uint32(dst) - uint32(dst_q * size)


@cuda.jit(device=True, inline="always")
def _read(kv_cache, plan, k, col, vals, i, j):
    """Plan entry ``i``'s value into ``vals[j]``, if it moves."""
    if i < k and plan[0, i] >= 0:
        vals[j] = kv_cache[plan[0, i], plan[1, i], col]


@cuda.jit(device=True, inline="always")
def _write(kv_cache, plan, k, col, vals, i, j):
    """Write ``vals[j]`` to plan entry ``i``'s destination, if it moves."""
    if i < k and plan[0, i] >= 0:
        kv_cache[plan[2, i], plan[3, i], col] = vals[j]


@cuda.jit(device=True, inline="always")
def read_chunk(kv_cache, plan, k, col, vals, i0):
    """The sources of plan entries ``i0 .. i0 + CHUNK - 1`` (those below ``k`` that move), column
    ``col``, into ``vals``: all loads in flight at once. ``vals`` stays in registers: it is only
    ever indexed by the literal ``j`` of the calls below (spelled out rather than a loop, so
    that this holds whatever a compiler's unrolling heuristics decide; CUDA 13.0's NVVM left a
    loop here rolled for sm_120 and put the array on the stack)."""
    _read(kv_cache, plan, k, col, vals, i0, 0)
    _read(kv_cache, plan, k, col, vals, i0 + 1, 1)
    _read(kv_cache, plan, k, col, vals, i0 + 2, 2)
    _read(kv_cache, plan, k, col, vals, i0 + 3, 3)
    _read(kv_cache, plan, k, col, vals, i0 + 4, 4)
    _read(kv_cache, plan, k, col, vals, i0 + 5, 5)
    _read(kv_cache, plan, k, col, vals, i0 + 6, 6)
    _read(kv_cache, plan, k, col, vals, i0 + 7, 7)


@cuda.jit(device=True, inline="always")
def write_chunk(kv_cache, plan, k, col, vals, i0):
    """``read_chunk``'s values to their destinations, in ascending ``i`` (``a_i >= i``: no read
    of the chunk saw a write)."""
    _write(kv_cache, plan, k, col, vals, i0, 0)
    _write(kv_cache, plan, k, col, vals, i0 + 1, 1)
    _write(kv_cache, plan, k, col, vals, i0 + 2, 2)
    _write(kv_cache, plan, k, col, vals, i0 + 3, 3)
    _write(kv_cache, plan, k, col, vals, i0 + 4, 4)
    _write(kv_cache, plan, k, col, vals, i0 + 5, 5)
    _write(kv_cache, plan, k, col, vals, i0 + 6, 6)
    _write(kv_cache, plan, k, col, vals, i0 + 7, 7)


@cuda.jit(device=True, inline="always")
def commit_column(kv_cache, plan, k, col, vals, start):
    """The planned moves ``start .. k - 1`` (``plan_moves``) of one request for column ``col``
    of a ``[num_pages, page_size, D]`` cache, ``CHUNK`` at a time: a chunk's reads, then its
    writes (``vals``: a ``cuda.local.array(CHUNK)`` of the cache's type). No other thread
    touches this column of these rows."""
    for i0 in range(start, k, CHUNK):
        read_chunk(kv_cache, plan, k, col, vals, i0)
        write_chunk(kv_cache, plan, k, col, vals, i0)


@cuda.jit(device=True, inline="always")
def valid_prefix(P, N):
    """A prefix a step may start from: ``0 <= P`` and ``P + N <= MAX_POSITION`` (others commit
    nothing and keep their length)."""
    return P >= 0 and P <= MAX_POSITION - N


@cuda.jit(cache=CACHE_KERNELS)
def _commit_kv_kernel(kv_layers, block_table, prefix_lens, accept_nodes, accept_len,
                      new_prefix_lens):
    """Column ``col`` of layer ``blockIdx.z`` of request ``blockIdx.y``'s moved rows."""
    b, layer = cuda.blockIdx.y, cuda.blockIdx.z
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    N = accept_nodes.shape[1]
    P = int64(prefix_lens[b])                       # int64: P + a never wraps around
    k = min(max(accept_len[b], 0), N - 1)
    writer = col == 0 and layer == 0                # one thread a request writes its length
    # (a uniform return: every thread of the block has this b, so none waits at the
    # barriers below)
    if not valid_prefix(P, N):                      # not a valid prefix: commit nothing
        if writer:
            new_prefix_lens[b] = P
        return
    if writer:
        new_prefix_lens[b] = P + k + 1              # <= P + N <= MAX_POSITION
    plan = cuda.shared.array((4, PLAN_MOVES), int32)
    num_pages, page_size = kv_layers.shape[1], kv_layers.shape[2]
    paging = (block_table[b], int64(0), int64(block_table.shape[1]) * page_size)
    # the grid has a layer even for a stack of none, whose requests still get their lengths
    moves = layer < kv_layers.shape[0] and col < kv_layers.shape[3]
    vals = cuda.local.array(CHUNK, kv_layers.dtype)     # a chunk's values (registers)
    for first in range(0, k, PLAN_MOVES):           # (k is the same for the whole block)
        count = min(PLAN_MOVES, k - first)
        plan_moves(paging, accept_nodes[b], N, P, first, count, num_pages, page_size, plan,
                   cuda.threadIdx.x, COMMIT_THREADS)
        cuda.syncthreads()                          # the plan complete before any move
        if moves:                                   # kv_layers[layer]: [num_pages, ...], a view
            commit_column(kv_layers[layer], plan, count, col, vals, 0)
        cuda.syncthreads()                          # moves done before the plan is replaced


def commit_kv(kv_cache, block_table, prefix_lens, accept_nodes, accept_len, *, check=None,
              out=None):
    """Move the accepted rows into place (in place, one launch); return new prefix lengths.

    Parameters
    ----------
    kv_cache : device array
        ``float32|bfloat16|float16[num_pages, page_size, D]``, or every layer's cache in one
        array, ``[layers, num_pages, page_size, D]`` (all layers in the same launch), updated
        in place. A numpy cache is copied to the device, updated there and copied back (for
        tests and the simulator).
    block_table, prefix_lens, accept_nodes, accept_len : array
        As in :func:`ddtree_numba.reference.commit_kv`.
    check : bool, optional
        Run the value checks (paths, pages). Default: on for numpy inputs only.
    out : device array, optional
        ``int32[bs]`` for the new prefix lengths.

    Returns
    -------
    device array
        ``int32[bs]``: ``prefix_lens + accept_len + 1``.
    """
    sz = check_commit_kv(kv_cache, block_table, prefix_lens, accept_nodes, accept_len,
                         check=check)
    host_cache = kv_cache if isinstance(kv_cache, np.ndarray) else None
    cache = as_device(kv_cache)
    if cache.dtype.itemsize == 2:
        cache = cache.view(np.uint16)               # bf16 / f16: move the bits
    if cache.ndim == 3:
        cache = cache.reshape(1, *cache.shape)      # one layer: a stack of one
    args = [as_device(a) for a in (block_table, prefix_lens, accept_nodes, accept_len)]
    if out is None:
        new_prefix = device_empty((sz.bs,), np.int32)
    else:
        new_prefix = require_new_lengths("out", out, args[1], sz.bs)
    stream = launch_stream()
    if sz.bs:
        # (at least one block on x and z: a request's new length is written even when D = 0
        # or the stack holds no layers)
        grid = (max(math.ceil(sz.D / COMMIT_THREADS), 1), sz.bs, max(cache.shape[0], 1))
        launch(_commit_kv_kernel, grid, COMMIT_THREADS, stream)(cache, *args, new_prefix)
    if host_cache is not None:                      # numpy in: write the result back
        host_cache.view(np.uint16 if host_cache.dtype.itemsize == 2 else host_cache.dtype)[
            ...] = cache.copy_to_host(stream=stream).reshape(host_cache.shape)
    return new_prefix


def build_specs():
    """Specialisations launched by :func:`commit_kv` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    i1, i2 = types.int32[::1], types.int32[:, ::1]
    return [
        KernelSpec("commit_kv", f"{name} cache", _commit_kv_kernel,
                   (dtype[:, :, :, ::1], i2, i1, i2, i1, i1), COMMIT_THREADS, True)
        for name, dtype in (("float32", types.float32), ("16-bit", types.uint16))
    ]
