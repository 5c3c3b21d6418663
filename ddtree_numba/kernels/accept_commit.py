"""Greedy accept and KV commit in one launch: ``kernels.accept_commit``, bit-exact to
``reference.tree_accept`` followed by ``reference.commit_kv`` on every layer's cache.

Separately, the two are two launches and a round trip of ``accept_nodes`` through memory;
the commit cannot start before the accept has finished anyway, and the accept kernel already
holds the path in shared memory. The moves, not the walk, are most of the work: ``k`` rows of
every layer, each row ``D`` elements. So the grid is ``(bs, parts)``, ``ACCEPT_COMMIT_THREADS``
threads a block, and every block of request ``b``:

0. issues the loads of the request's four rows (``tree_accept.load_rows``: registers), then,
   once ``P`` is in, the load of its entry of the window of ``b``'s block-table row that slots
   ``P .. P + N - 1`` fall on (``first_page = P // page_size`` on; entry ``tid``, a register
   too; entries from ``T`` on, which only pages of one or two slots make with ``T = 512``,
   are loaded after the walk), so that no move waits for a block-table load. The rows'
   loads need nothing, the window's need ``P``: the phase costs one DRAM latency before the
   walk, and the window's trip runs during the walk;
1. stores the rows in shared memory and walks them in thread 0 (``tree_accept.greedy_walk``:
   the same walk in every block of the request, from the same rows); then stores the window;
2. plans the moves as ``commit_kv`` does (``commit_kv.plan_moves``: each move's source and
   destination page and offset, computed once, by one thread a move, into shared memory, all
   of them at once; the divisions of these addresses, made by every column's thread, were
   most of this kernel's instructions once);
3. makes its share of the moves. The cache is read as words (``uint64`` where a row's bytes
   allow, else the element's bits: a move is a copy, not arithmetic), and the moves of one
   (layer, word) column are one *item*: item ``it = layer * W + w``. Thread ``tid`` of block
   ``part`` takes items ``part * T + tid``, then every ``parts * T`` further (the launcher
   picks ``parts = ceil(items / T)``: one item per thread, unless the grid's limit caps it),
   and moves each column as ``commit_kv`` does (``commit_kv.commit_column``: the reads of up
   to ``CHUNK = 8`` moves, then their writes, in ascending order). For its first item a thread
   issues the first chunk's reads, and while they are on their way, block ``part = 0`` writes
   its share of the ``AcceptResult`` rows (``tree_accept.write_accept_rows``) and
   ``new_prefix_lens[b]`` (``P + k + 1``); then the writes.

Two barriers after the walk's two (the rows staged, the path done): the window stored (the
plan reads it) and the plan complete (every move reads it); no two threads (of any block)
touch the same word of the cache. ``kv_cache`` is
one layer ``[num_pages, page_size, D]`` or all of them, ``[layers, num_pages, page_size, D]``
(the toy and DeepSeek-V3 targets keep theirs so). Unchecked inputs stay in bounds as in the
two kernels it joins (links outside ``[1, N)`` end a list, every cache address is checked, window
entries past the block-table row are ``-1``, a prefix that is no valid start commits nothing
and keeps its length: it plans no move).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, int32, int64

from ..arrays import data_address
from ..contracts import AcceptResult
from ..limits import MAX_NODES
from ..validation import check_accept_commit, require_new_lengths
from ._device import SIMULATOR, as_device, device_empty, kernel_for_block, launch, launch_stream
from .commit_kv import CHUNK, commit_column, plan_moves, read_chunk, valid_prefix, write_chunk
from .tree_accept import STAGE_ROUNDS, checked_out, greedy_walk, load_rows, write_accept_rows

# 512 threads: a thread stages STAGE_ROUNDS = 3 entries of each row, 1536 >= N
ACCEPT_COMMIT_THREADS = 32 if SIMULATOR else 512
assert SIMULATOR or STAGE_ROUNDS * ACCEPT_COMMIT_THREADS >= MAX_NODES
MAX_PARTS = 65535                                   # the grid's y limit


# Two blocks an SM: the cap is 64 registers (sm_120 took 65 uncapped once the moves' reads came
# before the AcceptResult rows; 60-64 capped, no spills)
@kernel_for_block(ACCEPT_COMMIT_THREADS, 2)
def _accept_commit_kernel(token_ids, next_token, next_sibling, target_predict, kv_words,
                          block_table, prefix_lens, accept_nodes, accept_len, accept_tokens,
                          bonus_token, new_prefix_lens):
    """Grid ``(bs, parts)``, block ``(ACCEPT_COMMIT_THREADS,)``: block ``(b, part)`` walks
    request ``b``'s tree (every part does, the same walk) and thread ``tid`` moves item
    ``part * T + tid`` (then every ``parts * T``-th after it), an item being one word
    column of one layer's accepted rows; part 0 also writes the ``AcceptResult`` rows.
    ``kv_words`` is ``[layers, num_pages, page_size, W]``: each cache row as ``W`` words."""
    b = cuda.blockIdx.x
    part = cuda.blockIdx.y                          # this block's share of the moves
    tid = cuda.threadIdx.x
    # blockDim.x, not the constant (_device.launch): with the constant this kernel took 78
    # registers on sm_120 (one block an SM, not two), and 16 B of spills when capped at 64
    threads = cuda.blockDim.x
    N = token_ids.shape[1]
    page_size = kv_words.shape[2]
    tok = cuda.shared.array(MAX_NODES, int32)
    path = cuda.shared.array(MAX_NODES, int32)
    result = cuda.shared.array(2, int32)            # [k, bonus]
    pages = cuda.shared.array(MAX_NODES, int32)     # pages[w] = block_table[b, first_page + w]

    P = int64(prefix_lens[b])                       # int64: P + a never wraps around
    # 0. the rows' loads, issued before anything waits for P
    held = load_rows(token_ids, next_token, next_sibling, target_predict, b, tid, threads, N)
    valid = valid_prefix(P, N)                      # else: commit nothing, keep P
    first_page = P // page_size
    # the window: <= N entries (P + N - 1 spans at most N slots); entry tid's load is issued
    # now and waited for after the walk, so that its DRAM trip overlaps the walk
    count = (P + N - 1) // page_size - first_page + 1 if valid else int64(0)
    t = first_page + tid
    page = block_table[b, t] if tid < count and t < block_table.shape[1] else int32(-1)
    greedy_walk(token_ids, next_token, next_sibling, target_predict, held, b, tid, threads, N,
                tok, path, result)                  # 1. (barriers: rows staged, path done)
    k = result[0]
    if tid < count:
        pages[tid] = page
    for w in range(tid + threads, count, threads):  # (512 threads: pages of 1 or 2 slots)
        t = first_page + w
        pages[w] = block_table[b, t] if t < block_table.shape[1] else -1
    # 2. the moves' rows, all of them at once (k <= N - 1 < MAX_NODES; 16 896 B: this
    # kernel's 512-thread blocks fit two an SM with it; its static shared memory, greedy_walk's
    # arrays included, is 46 472 B of the 49 152 numba allows: one more int32 row of
    # MAX_NODES would exceed it); none where the prefix is no valid start
    moved = k if valid else 0
    plan = cuda.shared.array((4, MAX_NODES), int32)
    cuda.syncthreads()                              # the window in place before the plan
    paging = (pages, first_page, int64(block_table.shape[1]) * page_size)
    plan_moves(paging, path, N, P, 0, moved, kv_words.shape[1], page_size, plan, tid, threads)
    cuda.syncthreads()                              # the plan complete before any move
    # 3. this thread's first item: its first CHUNK sources loaded, and while they are on
    # their way, block part 0's share of the AcceptResult rows; then the item's writes
    words = kv_words.shape[3]
    items = kv_words.shape[0] * words
    vals = cuda.local.array(CHUNK, kv_words.dtype)  # a chunk's values (registers)
    mine = part * threads + tid                     # this thread's first item
    # (its layer and word are worked out again after the AcceptResult rows: kept live across
    # them, they cost sm_120 16 B of spills under the two-blocks-an-SM cap of 64 registers)
    if mine < items:
        layer = mine // words
        col = mine - layer * words                  # the item's word of its layer's rows
        read_chunk(kv_words[layer], plan, moved, col, vals, 0)
    if part == 0:
        write_accept_rows(b, path, k, result[1], tok, tid, threads, N, accept_nodes,
                          accept_len, accept_tokens, bonus_token)
        if tid == 0:
            new_prefix_lens[b] = P + k + 1 if valid else P
    if mine < items:
        layer = mine // words
        col = mine - layer * words
        write_chunk(kv_words[layer], plan, moved, col, vals, 0)
        commit_column(kv_words[layer], plan, moved, col, vals, CHUNK)
    # further items (only where a grid of MAX_PARTS blocks a request is too few)
    for item in range(mine + cuda.gridDim.y * threads, items, cuda.gridDim.y * threads):
        layer = item // words
        commit_column(kv_words[layer], plan, moved, item - layer * words, vals, 0)


def as_words(cache):
    """``cache`` (``[layers, num_pages, page_size, D]``) viewed as ``uint64`` words when it is
    C-contiguous, 8-byte aligned and a row is a whole number of them; else as the unsigned
    integers of its own element size (16-bit caches are ``uint16`` bits, float32 ``uint32``)."""
    own = np.dtype(f"uint{8 * cache.dtype.itemsize}")
    row_bytes = cache.shape[cache.ndim - 1] * cache.dtype.itemsize   # no [-1]: the simulator
    if (cache.is_c_contiguous() and row_bytes % 8 == 0 and cache.size
            and data_address(cache) % 8 == 0):
        return cache.view(np.uint64)
    return cache.view(own)


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
    new_prefix = require_new_lengths("out[1]", out[1], prefix_lens, sz.bs)
    host_cache = kv_cache if isinstance(kv_cache, np.ndarray) else None
    cache = as_device(kv_cache)
    if cache.ndim == 3:
        cache = cache.reshape(1, *cache.shape)      # one layer
    words = as_words(cache)
    items = words.shape[0] * words.shape[3]         # (layer, word) columns, one per thread
    parts = min(max(math.ceil(items / ACCEPT_COMMIT_THREADS), 1), MAX_PARTS)
    args = [as_device(a) for a in (token_ids, next_token, next_sibling, target_predict)]
    stream = launch_stream()
    if sz.bs:
        launch(_accept_commit_kernel, (sz.bs, parts), ACCEPT_COMMIT_THREADS, stream)(
            *args, words, as_device(block_table), as_device(prefix_lens), res.accept_nodes,
            res.accept_len, res.accept_tokens, res.bonus_token, new_prefix)
    if host_cache is not None:                      # numpy in: write the result back
        host_cache.view(cache.dtype)[...] = cache.reshape(host_cache.shape).copy_to_host(
            stream=stream)
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
        for name, dtype in (("uint64 words", types.uint64), ("16-bit", types.uint16))
    ]
