"""Greedy accept and KV commit in one launch: ``kernels.accept_commit``, bit-exact to
``reference.tree_accept`` followed by ``reference.commit_kv`` on every layer's cache.

Separately, the two are two launches and a round trip of ``accept_nodes`` through memory;
the commit cannot start before the accept has finished anyway, and the accept kernel already
holds the path in shared memory. So one block per request (grid ``(bs,)``,
``ACCEPT_COMMIT_THREADS`` threads):

1. stage the request's four rows and walk them in thread 0 (``tree_accept.greedy_walk``);
2. write the ``AcceptResult`` rows (``tree_accept.write_accept_rows``);
3. move the accepted rows into place in every layer: thread ``tid`` takes the columns ``tid,
   tid + T, ...`` of each layer's rows and moves them as ``commit_kv`` does
   (``commit_kv.commit_column``: the reads of up to eight moves, then their writes, in
   ascending order), reading the path from shared memory; ``new_prefix_lens[b] = P + k + 1``.

No barrier is needed in phase 3: no two threads touch the same element, and the path was
complete before phase 2. ``kv_cache`` is one layer ``[num_pages, page_size, D]`` or all of
them, ``[layers, num_pages, page_size, D]`` (the toy and DeepSeek-V3 targets keep theirs so);
16-bit caches move as ``uint16`` bits. Unchecked inputs stay in bounds as in the two kernels
it joins (links outside ``[1, N)`` end a list, every cache address is checked, a prefix that
is no valid start commits nothing and keeps its length).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64

from ..contracts import AcceptResult
from ..limits import MAX_NODES
from ..validation import check_accept_commit, require_array
from ._device import SIMULATOR, as_device, device_empty, kernel_for_block, launch, launch_stream
from .commit_kv import commit_column, valid_prefix
from .tree_accept import checked_out, greedy_walk, write_accept_rows

# tree_accept's 1024 threads would cap a thread at 64 registers, and the moves then spill: 512
# stage N <= 1056 entries in three rounds of loads instead of two.
ACCEPT_COMMIT_THREADS = 32 if SIMULATOR else 512


@kernel_for_block(ACCEPT_COMMIT_THREADS)           # registers capped so the block fits
def _accept_commit_kernel(token_ids, next_token, next_sibling, target_predict, kv_cache,
                          block_table, prefix_lens, accept_nodes, accept_len, accept_tokens,
                          bonus_token, new_prefix_lens):
    """``kv_cache`` is ``[layers, num_pages, page_size, D]``."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    N = token_ids.shape[1]
    tok = cuda.shared.array(MAX_NODES, int32)
    path = cuda.shared.array(MAX_NODES, int32)
    result = cuda.shared.array(2, int32)            # [k, bonus]
    greedy_walk(token_ids, next_token, next_sibling, target_predict, b, tid, threads, N, tok,
                path, result)                       # 1. (ends with a barrier: path complete)
    k = result[0]
    write_accept_rows(b, path, k, result[1], tok, tid, threads, N,   # 2.
                      accept_nodes, accept_len, accept_tokens, bonus_token)
    P = int64(prefix_lens[b])                       # int64: P + a never wraps around
    if not valid_prefix(P, N):                      # not a valid prefix: commit nothing
        if tid == 0:
            new_prefix_lens[b] = P
        return
    if tid == 0:
        new_prefix_lens[b] = P + k + 1
    for layer in range(kv_cache.shape[0]):          # 3. the moves, every layer
        for col in range(tid, kv_cache.shape[3], threads):
            commit_column(kv_cache[layer], block_table, path, N, b, P, k, col)


def accept_commit(token_ids, next_token, next_sibling, target_predict, kv_cache, block_table,
                  prefix_lens, *, check=None, out=None) -> tuple:
    """:func:`~ddtree_numba.kernels.tree_accept` then
    :func:`~ddtree_numba.kernels.commit_kv` on every layer, in one launch (no sync).

    Parameters
    ----------
    token_ids, next_token, next_sibling, target_predict : array
        ``int32[bs, N]`` each, as for ``tree_accept``; ``N <= 1056``.
    kv_cache : device array
        ``float32|bfloat16|float16``, ``[num_pages, page_size, D]`` or ``[layers, num_pages,
        page_size, D]``, updated in place (a numpy cache is copied to the device and back).
    block_table, prefix_lens : array
        As for ``commit_kv``.
    check : bool, optional
        The value checks of both (a tree; valid pages for slots ``P .. P + N - 1``). Default:
        on for numpy inputs only.
    out : tuple, optional
        ``(AcceptResult, new_prefix_lens)``: :func:`allocate_accept` buffers and ``int32[bs]``.

    Returns
    -------
    tuple
        ``(AcceptResult, new_prefix_lens)``, device arrays, bit-exact to the references.
    """
    sz = check_accept_commit(token_ids, next_token, next_sibling, target_predict, kv_cache,
                             block_table, prefix_lens, check=check)
    if sz.N > MAX_NODES:
        raise ValueError(f"token_ids: expected N <= {MAX_NODES} nodes, got N = {sz.N}")
    if out is None:
        out = (None, device_empty((sz.bs,), np.int32))
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"out: expected a tuple (AcceptResult, new_prefix_lens), got "
                        f"{type(out).__name__}")
    res: AcceptResult = checked_out(out[0], sz.bs, sz.N)
    new_prefix = out[1]
    require_array("out[1]", new_prefix, (np.int32,), ("bs",), {"bs": sz.bs})
    host_cache = kv_cache if isinstance(kv_cache, np.ndarray) else None
    cache = as_device(kv_cache)
    if cache.dtype.itemsize == 2:
        cache = cache.view(np.uint16)               # bf16 / f16: move the bits
    if cache.ndim == 3:
        cache = cache.reshape(1, *cache.shape)      # one layer
    args = [as_device(a) for a in (token_ids, next_token, next_sibling, target_predict)]
    stream = launch_stream()
    if sz.bs:
        launch(_accept_commit_kernel, sz.bs, ACCEPT_COMMIT_THREADS, stream)(
            *args, cache, as_device(block_table), as_device(prefix_lens), res.accept_nodes,
            res.accept_len, res.accept_tokens, res.bonus_token, new_prefix)
    if host_cache is not None:                      # numpy in: write the result back
        host_cache.view(np.uint16 if host_cache.dtype.itemsize == 2 else host_cache.dtype)[
            ...] = cache.reshape(host_cache.shape).copy_to_host(stream=stream)
    return res, new_prefix


def build_specs():
    """Specialisations launched by :func:`accept_commit` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    i1, i2 = types.int32[::1], types.int32[:, ::1]
    return [
        KernelSpec("accept_commit", f"{name} cache", _accept_commit_kernel,
                   (i2, i2, i2, i2, dtype[:, :, :, ::1], i2, i1, i2, i1, i2, i1, i1),
                   ACCEPT_COMMIT_THREADS, True)
        for name, dtype in (("float32", types.float32), ("16-bit", types.uint16))
    ]
