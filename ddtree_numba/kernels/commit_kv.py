"""KV commit on the GPU: ``kernels.commit_kv``, bit-exact to the reference, in place.

Math (reference): row of slot ``P + i`` <- row of slot ``P + a_i`` for ``i = 1..k``.

Parallel plan. Requests and row columns are independent; the moves of one request are not
(on the path ``0 -> 2 -> 3`` move 1 reads slot ``P + 2`` that move 2 writes). Since ``a_i >= i``,
no move reads a slot written by an *earlier* move, so "read all sources, then write all" equals
the sequential ascending order. One thread per (request, column) does exactly that for its
column, in chunks of ``CHUNK = 16`` moves held in registers (reads of a chunk, then its writes, in
ascending order: still the sequential semantics). No two threads touch the same element, so
no barrier is needed.

Grid ``(ceil(D / COMMIT_THREADS), bs)``, block ``(COMMIT_THREADS,)``; ``k <= L`` in practice, so
a thread moves a handful of elements; a warp moves 128 contiguous bytes of a row (fp32).
bfloat16 / float16 caches move as ``uint16`` bits (a copy needs no arithmetic).
Addresses are bounds-checked (path node in ``[0, N)``, slot in ``[0, capacity)``, page in
``[0, num_pages)``), so unchecked device inputs cannot read or write out of bounds. Slots are
computed in int64, so nothing wraps around. A row whose prefix ``P`` is no valid start
(``P < 0`` or ``P + N > MAX_POSITION``, which the value checks reject) moves nothing and keeps
its prefix: ``new_prefix_lens[b] = P``; any other row returns ``P + k + 1`` with ``k``
clamped to ``[0, N - 1]``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, int32, int64

from ..limits import MAX_POSITION
from ..validation import check_commit_kv
from ._device import SIMULATOR, as_device, device_empty, launch, launch_stream

COMMIT_THREADS = 32 if SIMULATOR else 128
CHUNK = 16      # moves per register chunk: k <= L <= 15 in DDTree, so usually one chunk


@cuda.jit
def _commit_kv_kernel(kv_cache, block_table, prefix_lens, accept_nodes, accept_len,
                      new_prefix_lens):
    b = cuda.blockIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    num_pages, page_size, D = kv_cache.shape
    N = accept_nodes.shape[1]
    capacity = block_table.shape[1] * page_size
    P = int64(prefix_lens[b])                       # int64: P + a never wraps around
    k = min(max(accept_len[b], 0), N - 1)
    if P < 0 or P > MAX_POSITION - N:               # not a valid prefix: commit nothing
        if col == 0:
            new_prefix_lens[b] = P
        return
    if col == 0:
        new_prefix_lens[b] = P + k + 1              # <= P + N <= MAX_POSITION
    if col >= D:
        return
    vals = cuda.local.array(CHUNK, kv_cache.dtype)  # registers: the loops below unroll
    dst_page = cuda.local.array(CHUNK, int32)       # destination pages, looked up early
    for i0 in range(1, k + 1, CHUNK):
        for j in range(CHUNK):                      # 1. read up to CHUNK sources, and look
            i = i0 + j                              #    up their destinations meanwhile
            dst_page[j] = -1                        #    (-1: skip this move)
            if i <= k:
                a = accept_nodes[b, i]
                src = P + a
                dst = P + i
                if a >= 0 and a < N and 0 <= src < capacity and 0 <= dst < capacity:
                    page = block_table[b, src // page_size]
                    dst_page[j] = block_table[b, dst // page_size]
                    if page >= 0 and page < num_pages:
                        vals[j] = kv_cache[page, src % page_size, col]
                    else:
                        dst_page[j] = -1
        for j in range(CHUNK):                      # 2. ... then write them, ascending i
            page = dst_page[j]
            if page >= 0 and page < num_pages:
                kv_cache[page, (P + i0 + j) % page_size, col] = vals[j]


def commit_kv(kv_cache, block_table, prefix_lens, accept_nodes, accept_len, *, check=None,
              out=None):
    """Move the accepted rows into place (in place, one launch); return new prefix lengths.

    Parameters
    ----------
    kv_cache : device array
        ``float32|bfloat16|float16[num_pages, page_size, D]``, updated in place. A numpy cache
        is copied to the device, updated there and copied back (for tests and the simulator).
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
    args = [as_device(a) for a in (block_table, prefix_lens, accept_nodes, accept_len)]
    new_prefix = device_empty((sz.bs,), np.int32) if out is None else out
    stream = launch_stream()
    if sz.bs:
        grid = (math.ceil(sz.D / COMMIT_THREADS), sz.bs)
        launch(_commit_kv_kernel, grid, COMMIT_THREADS, stream)(cache, *args, new_prefix)
    if host_cache is not None:                      # numpy in: write the result back
        host_cache.view(np.uint16 if host_cache.dtype.itemsize == 2 else host_cache.dtype)[
            ...] = cache.copy_to_host(stream=stream)
    return new_prefix


def build_specs():
    """Specialisations launched by :func:`commit_kv` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    i1, i2 = types.int32[::1], types.int32[:, ::1]
    return [
        KernelSpec("commit_kv", f"{name} cache", _commit_kv_kernel,
                   (dtype[:, :, ::1], i2, i1, i2, i1, i1), COMMIT_THREADS, True)
        for name, dtype in (("float32", types.float32), ("16-bit", types.uint16))
    ]
