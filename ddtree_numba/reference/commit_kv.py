"""Reference ``commit_kv``: compact the accepted path's cache rows behind the prefix.

For the accepted path ``a_0 = 0 < a_1 < ... < a_k`` of request ``b`` with prefix ``P``::

    row of slot P + i  <-  row of slot P + a_i        for i = 1..k   (i = 0 is a no-op)
    new prefix_lens[b] = P + k + 1                    (the root and the k accepted nodes)

What may run in parallel. Because the path strictly increases from ``a_0 = 0``, ``a_i >= i``,
and no move reads a slot that an *earlier* move writes (move ``j < i`` writes ``P + j``, and
``j < i <= a_i``). Hence doing the moves in ascending ``i`` gives the same cache as reading every
source row first and then writing them all. The moves are *not* independent of each other,
though: on the path ``0 -> 2 -> 3`` move 1 reads slot ``P + 2``, which move 2 overwrites, so
two threads doing moves 1 and 2 concurrently race. The columns of a row and the requests of a
batch are independent, so the kernel runs one thread per (request, column) and each thread
reads its column of all ``k`` source rows before writing any (the read-all-then-write order
that this reference uses).
"""

from __future__ import annotations

import numpy as np

from ..validation import check_commit_kv


def slot_address(block_table_row, page_size: int, slot):
    """``(page, offset)`` of a slot: ``(block_table[slot // page_size], slot % page_size)``."""
    return block_table_row[slot // page_size], slot % page_size


def store_node_rows(cache, block_table, prefix_lens, num_nodes, rows) -> None:
    """Numpy, in place: node ``j``'s row ``rows[b N + j]`` at slot ``P + j`` of ``cache``
    (``[num_pages, page_size, D]``, cast to its type) for the valid nodes of each request;
    ``rows`` is ``[bs N, D]`` (padding rows are not stored)."""
    bs = len(num_nodes)
    N = len(rows) // bs
    for b in range(bs):
        n, P = int(num_nodes[b]), int(prefix_lens[b])
        where = slot_address(block_table[b], cache.shape[1], P + np.arange(n))
        cache[where] = rows[b * N: b * N + n]


def commit_kv(kv_cache, block_table, prefix_lens, accept_nodes, accept_len) -> np.ndarray:
    """Move the accepted rows into place in ``kv_cache`` (in place); return new prefix lengths.

    Parameters
    ----------
    kv_cache : numpy.ndarray
        ``float32|bfloat16|float16[num_pages, page_size, D]``, or every layer's cache stacked,
        ``[layers, num_pages, page_size, D]`` (the same moves in each layer): modified in
        place.
    block_table : numpy.ndarray
        ``int32[bs, max_pages]``.
    prefix_lens : numpy.ndarray
        ``int32[bs]``: ``P`` before this step (not modified).
    accept_nodes : numpy.ndarray
        ``int32[bs, N]``: accepted path, root first (``AcceptResult.accept_nodes``).
    accept_len : numpy.ndarray
        ``int32[bs]``: ``k``, accepted draft nodes.

    Returns
    -------
    numpy.ndarray
        ``int32[bs]``: ``prefix_lens + accept_len + 1``.
    """
    sz = check_commit_kv(kv_cache, block_table, prefix_lens, accept_nodes, accept_len,
                         check=True)
    layers = kv_cache if kv_cache.ndim == 4 else kv_cache[None]     # [layers, pages, ps, D]
    for b in range(sz.bs):
        P, k = int(prefix_lens[b]), int(accept_len[b])
        src = P + accept_nodes[b, 1 : k + 1]                        # [k] slots read
        dst = P + np.arange(1, k + 1)                               # [k] slots written
        for cache in layers:                                        # views: writes land
            rows = cache[slot_address(block_table[b], sz.page_size, src)].copy()  # read first
            cache[slot_address(block_table[b], sz.page_size, dst)] = rows
    return (prefix_lens + accept_len + 1).astype(np.int32)
