"""Paged-cache helpers: build a block table the way an engine's allocator might.

Logical slot ``t`` of request ``b`` lives at
``kv_cache[block_table[b, t // page_size], t % page_size]`` (see the buffer contracts).
"""

from __future__ import annotations

import numpy as np


def shuffled_block_table(rng, prefix_lens, N: int, page_size: int, *, spare_pages: int = 0):
    """A block table whose requests own disjoint, randomly placed pages.

    Request ``b`` gets ``ceil((prefix_lens[b] + N) / page_size)`` pages (its prefix and a tree of
    ``N`` nodes); entries past them repeat the request's first page (valid, never read).

    Returns
    -------
    tuple
        ``(block_table int32[bs, max_pages], num_pages)``, ``num_pages`` including
        ``spare_pages`` unused ones.
    """
    need = [(int(p) + N + page_size - 1) // page_size for p in prefix_lens]
    num_pages = sum(need) + spare_pages
    order = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((len(need), max(need)), np.int32)
    start = 0
    for b, pages in enumerate(need):
        table[b, :pages] = order[start : start + pages]
        table[b, pages:] = order[start]
        start += pages
    return table, num_pages
