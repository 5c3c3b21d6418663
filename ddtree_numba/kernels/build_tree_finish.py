"""``build_tree``'s finish: each row's token, RoPE position and ancestor masks.

Row ``i`` of a tree (node ``i``) sees itself and every node on its path to the root, at most
``MAX_DEPTH + 1`` nodes: one walk up the parents finds them. The finish writes that set twice,
as packed bits (``visibility_bits[b, i, w]``: bit ``a % 32`` of word ``a // 32`` for each node
``a`` on the path) and as the bool mask (``visibility[b, i, a]``), and the row's token and
position. Rows past the tree's ``n`` nodes are padding: no bits, token and position ``-1``.

One launch after any select, grid ``(ceil(N / rows_per_block), bs)``: a block takes
``rows_per_block`` (at most ``FINISH_ROWS``) consecutive rows ``i0 .. i0 + rows - 1`` of one
request and reads that request's parents once into shared memory, every load in flight before
the first is stored (``FINISH_STAGE`` registers a thread: one trip to memory, where a loop that
stored each parent before loading the next made ``ceil(n / FINISH_THREADS)`` of them).
``finish_rows`` picks ``rows_per_block``: ``FINISH_ROWS``, halved while the grid would give
fewer than ``FINISH_FILL`` blocks an SM. At bs 1 (132 SMs, an H100 or H200) a tree of 257
nodes is then 257 blocks of
one row each instead of 9 of 32 rows: every block's chain (the parents, one walk, a row's
writes) is as long as before, but a thread writes one word of the bool mask instead of eight,
and the rows are spread over all SMs.

**Row bits in shared memory.** Row ``r`` of the block is ``row_words = ceil(N / 64)``
``uint64`` words at ``bits[r * row_words]``, bit ``a % 64`` of word ``a // 64`` set for node
``a``. A thread walks a row alone (``walk_rows``); after a barrier the block writes its rows
(``write_rows``): the packed words a warp per row, and the bool mask as ``uint64`` words, eight
columns a store. The block's rows are one contiguous run of bytes of the flat ``[bs, N, N]``
mask, which the launcher passes twice: ``mask_bytes`` (``uint8[bs N N]``) and ``mask_words``
(``uint64``, word ``q`` = bytes ``head + 8 q .. head + 8 q + 7``, ``head`` the bytes before
the first 8-byte aligned address); the at most seven bytes at each end of a run go one by one.

Why a launch of its own, when the threshold and levels selects hold the whole tree in shared
memory already: folded into their block (at budget 256 one pass of all rows, the row bits in
the array the select no longer needs) it was *slower* on the H200 (77.6 us against 70.1 at
bs 1, 83.6 against 80.9 at bs 8, and a tie at bs 64, 99.2 against 100.1): one block issues the
mask's ~40 instructions a word alone, where this kernel spreads the rows over many SMs
(``benchmarks/NOTES.md``).
"""

from __future__ import annotations

import math
import operator

import numpy as np
from numba import cuda, int32, int64, uint8, uint32, uint64

from ..arrays import data_address
from ..limits import MAX_NODES
from ._device import CACHE_KERNELS, SIMULATOR, as_device, launch, launch_stream, sm_count

FINISH_ROWS = 32                    # tree rows a block of the finish kernel takes, at most
FINISH_THREADS = 32 if SIMULATOR else 128   # the simulator runs one Python thread per thread
FINISH_STAGE = -(-MAX_NODES // FINISH_THREADS)  # parents a thread stages (9 on a GPU)
FINISH_FILL = 2                     # blocks an SM below which finish_rows halves the rows
# thread t < rows of a block writes row i0 + t's token and position: a block has a thread a row
assert FINISH_ROWS <= FINISH_THREADS
ROW_WORDS_MAX = -(-MAX_NODES // 64)         # uint64 words of the widest row (17)
FINISH_WORDS = FINISH_ROWS * ROW_WORDS_MAX  # the finish kernel's row bits (4 352 B)
LOW = uint64(0xFFFFFFFF)


@cuda.jit(device=True, inline="always")
def row_words_of(N):
    """``ceil(N / 64)``: the ``uint64`` words of one row's bits in shared memory."""
    return (uint32(N) + uint32(63)) >> uint32(6)


@cuda.jit(device=True, inline="always")
def token_and_position(b, i, n, depth, rank, top_token_ids, root_token_ids, prefix_lens,
                       has_prefix):
    """Row ``i``'s token (the root's, else ``top_token_ids[b, depth - 1, rank]``) and position
    (``depth``, plus ``prefix_lens[b]`` when ``has_prefix``); both ``-1`` past the ``n``
    nodes. Only loads: the caller stores them once they have arrived."""
    if i == 0:
        token = root_token_ids[b]
    elif i < n:
        token = top_token_ids[b, depth - 1, rank]
    else:
        token = int32(-1)
    position = int32(depth + (prefix_lens[b] if has_prefix else 0)) if i < n else int32(-1)
    return token, position


@cuda.jit(device=True, inline="always")
def walk_rows(bits, row_words, i0, rows, n, node_parent, tid, threads):
    """The bits of rows ``i0 .. i0 + rows - 1``: thread ``t`` takes the block's rows ``t, t +
    threads, ...`` (it alone writes their words), zeroes the row's ``row_words`` words, then
    sets the bit of each node on the path ``i, parent(i), ..., 0`` (``node_parent``: the
    parent of each of the ``n`` nodes, ``-1`` for the root). No barrier."""
    for r in range(tid, rows, threads):
        base = uint32(r) * row_words
        for w in range(row_words):
            bits[base + w] = uint64(0)
        a = int32(i0 + r)
        if a < n:
            while a >= 0:                   # i, parent(i), ..., root (0 -> -1)
                bits[base + uint32(a >> 6)] |= uint64(1) << uint64(a & 63)
                a = int32(node_parent[a])


@cuda.jit(device=True, inline="always")
def _spread_nibble(nibble):
    """Bit ``k`` of a 4-bit value to bit ``8 k``: four bytes of 0 or 1, little-endian. The
    product holds copies of the nibble shifted by 0, 7, 14 and 21 bits (they do not overlap,
    so nothing carries); the mask keeps bit ``k`` of the copy shifted by ``7 k``."""
    return (nibble * uint32(0x00204081)) & uint32(0x01010101)


@cuda.jit(device=True, inline="always")
def _mask_bit(bits, row_words, r, c):
    """Column ``c`` of the block's row ``r``: 1 if its bit is set, else 0 (``uint32``)."""
    word = bits[uint32(r * row_words + (c >> uint32(6)))]
    return uint32((word >> uint64(c & uint32(63))) & uint64(1))


@cuda.jit(device=True, inline="always")
def _mask_word(bits, row_words, r, c, N):
    """Eight bytes of the bool mask as one little-endian ``uint64``: columns ``c .. c + 7`` of
    the block's row ``r``, running on into the next rows past column ``N - 1``. Byte ``k`` is 1
    where the column's bit is set, else 0."""
    if N >= uint32(8):                      # uniform: at most two rows in a word
        # the k_in columns c .. c + k_in - 1 of row r: bits s .. s + k_in - 1 of its word w,
        # and of word w + 1 where they cross a word's end (then w + 1 is inside the row)
        k_in = min(N - c, uint32(8))
        w = r * row_words + (c >> uint32(6))
        s = c & uint32(63)
        window = bits[w] >> uint64(s)
        if s + k_in > uint32(64):
            window |= bits[w + uint32(1)] << uint64(uint32(64) - s)
        eight = uint32(window & ((uint64(1) << uint64(k_in)) - uint64(1)))
        if k_in < uint32(8):                # the rest: the first columns of row r + 1
            rest = uint32(bits[(r + uint32(1)) * row_words] & uint64(0xFF))
            eight |= (rest << k_in) & uint32(0xFF)
        return ((uint64(_spread_nibble(eight >> uint32(4))) << uint64(32))
                | uint64(_spread_nibble(eight & uint32(0xF))))
    # N < 8 (a word can span three rows where N <= 6): column by column
    word = uint64(0)
    rr = r
    cc = c
    for k in range(8):
        while cc >= N:
            cc = uint32(cc - N)
            rr = uint32(rr + uint32(1))
        word |= uint64(_mask_bit(bits, row_words, rr, cc)) << uint64(8 * k)
        cc = uint32(cc + uint32(1))
    return word


@cuda.jit(device=True, inline="always")
def _mask_byte(bits, row_words, local, N):
    """Byte ``local`` of the block's share of the bool mask (row ``local // N``)."""
    r = uint32(local) // N
    c = uint32(local) - r * N
    return uint8(_mask_bit(bits, row_words, r, c))


@cuda.jit(device=True, inline="always")
def write_rows(b, i0, rows, bits, row_words, tid, threads, visibility_bits, mask_bytes,
               mask_words, head):
    """Rows ``i0 .. i0 + rows - 1`` of request ``b``'s packed bits and bool mask, from the
    block's row bits (:func:`walk_rows`), by a block of ``threads`` threads (a multiple of 32).
    No barrier."""
    N = visibility_bits.shape[1]
    W = visibility_bits.shape[2]
    lane = tid % 32
    warps = threads // 32
    # 1. packed uint32 words: a warp per row, a lane per word (word w is half of uint64 w // 2)
    for r in range(tid // 32, rows, warps):
        base = uint32(r) * row_words
        for w in range(lane, W, 32):
            half = bits[base + uint32(w >> 1)] >> uint64(32 * (w & 1))
            visibility_bits[b, i0 + r, w] = uint32(half & LOW)

    # 2. the bool mask. The block's rows are bytes [first, end) of the flat mask; the words
    #    inside that run are q_lo .. q_hi - 1, the bytes before and after them (at most
    #    seven each) are written one by one
    first = (int64(b) * N + i0) * N                 # flat byte of (b, i0, 0)
    end = first + rows * N
    q_lo = (first - head + 7) // 8                  # the first word at or after first
    q_hi = max(q_lo, (end - head) // 8)             # one past the last word before end
    n_u = uint32(N)
    if q_hi > q_lo:                                 # uniform: the same in every thread
        # thread t takes words q_lo + t, q_lo + t + threads, ...: 8 * threads bytes apart,
        # i.e. dr rows and dc columns further each step (one division, here); the word's
        # index is unsigned (numba wraps a signed index that could be negative)
        local = uint32(head + 8 * (q_lo + tid) - first)   # its first word's byte in the run
        r = local // n_u
        c = local - r * n_u
        dr = uint32(8 * threads) // n_u
        dc = uint32(8 * threads) - dr * n_u
        for q in range(uint64(q_lo + tid), uint64(q_hi), uint64(threads)):
            mask_words[q] = _mask_word(bits, row_words, r, c, n_u)
            r += dr
            c += dc
            if c >= n_u:
                c -= n_u
                r += uint32(1)
        lead_end = head + 8 * q_lo                  # bytes [first, lead_end) and
        tail = head + 8 * q_hi                      # [tail, end)
    else:                                           # a run too short for a word
        lead_end = end
        tail = end
    for g in range(first + tid, lead_end, threads):
        mask_bytes[g] = _mask_byte(bits, row_words, g - first, n_u)
    for g in range(tail + tid, end, threads):
        mask_bytes[g] = _mask_byte(bits, row_words, g - first, n_u)


@cuda.jit(cache=CACHE_KERNELS)
def _finish_kernel(top_token_ids, root_token_ids, prefix_lens, has_prefix, parents, depths,
                   ranks, num_nodes, rows_per_block, token_ids, positions, visibility_bits,
                   mask_bytes, mask_words, head):
    """Grid ``(ceil(N / rows_per_block), bs)``, block ``(FINISH_THREADS,)`` (128 on a GPU, 32
    simulated): rows ``i0 .. i0 + rows - 1`` (``rows_per_block``, fewer in the last block; at
    most ``FINISH_ROWS``, the row bits' room) of request ``b``, after the select wrote its
    node table. One pass of :func:`walk_rows` and :func:`write_rows`, the parents read once
    into shared memory.

    The loops are row by row or word by word, with one division each at their entry, and
    stride by the constant ``FINISH_THREADS``, so no index is divided inside a loop (bar the
    at most 14 edge bytes, a 32-bit division each). A 64-bit integer division costs about 70
    instructions: the first version divided a flat index by ``N`` per mask byte and spent
    332 us on the masks of bs 64, budget 1 024; the next stored one byte a thread and a step,
    133 us there.
    """
    b = cuda.blockIdx.y
    i0 = cuda.blockIdx.x * rows_per_block
    tid = cuda.threadIdx.x
    N = parents.shape[1]
    n = min(num_nodes[b], N)                        # (the select's count: <= N already)
    # (FINISH_ROWS: the row bits' room; the launcher passes at most that, and a larger count
    # would leave rows unwritten here, never write past `bits`)
    rows = min(rows_per_block, FINISH_ROWS, N - i0)
    parent_s = cuda.shared.array(MAX_NODES, int32)
    bits = cuda.shared.array(FINISH_WORDS, uint64)

    # 1. the request's parents, once: thread t loads entries t, t + FINISH_THREADS, ... (a
    #    warp reads 128 contiguous bytes a load) into registers, all loads issued before the
    #    first store waits for its value; thread t < rows loads row i0 + t's depth and rank
    #    beside them. The loads test i < N, not i < n, so that they need not wait for n
    staged = cuda.local.array(FINISH_STAGE, int32)
    for q in range(FINISH_STAGE):                   # (constant trip count: unrolled)
        i = tid + q * FINISH_THREADS
        staged[q] = parents[b, uint64(i)] if i < N else int32(-1)   # (unsigned: no wrap)
    mine = tid < rows                               # this thread writes row i0 + tid's token
    depth = depths[b, i0 + tid] if mine else int32(0)
    rank = ranks[b, i0 + tid] if mine else int32(0)
    for q in range(FINISH_STAGE):
        i = tid + q * FINISH_THREADS
        if i < n:
            parent_s[i] = staged[q]
    # 2. the row's token and RoPE position: their loads (the token's needs the depth and
    #    rank) go out now and are stored at the end, so that no barrier waits for them
    token, position = int32(-1), int32(-1)
    if mine:
        token, position = token_and_position(b, i0 + tid, n, depth, rank, top_token_ids,
                                             root_token_ids, prefix_lens, has_prefix)
    cuda.syncthreads()                              # parent_s complete before the walks

    row_words = row_words_of(N)
    walk_rows(bits, row_words, i0, rows, n, parent_s, tid, FINISH_THREADS)   # 3. the bits
    cuda.syncthreads()                              # every row's words complete
    write_rows(b, i0, rows, bits, row_words, tid, FINISH_THREADS, visibility_bits,  # 4. out
               mask_bytes, mask_words, head)
    if mine:
        token_ids[b, i0 + tid] = token
        positions[b, i0 + tid] = position


def mask_views(visibility):
    """The bool mask ``visibility`` (C-contiguous ``[bs, N, N]``) flat, twice: as bytes and as
    the ``uint64`` words from its first 8-byte aligned address on; and ``head``, the bytes
    before that address (0 for a buffer of ``allocate_tree``)."""
    mask = as_device(visibility)
    flat = mask.reshape(mask.size).view(np.uint8)
    head = (-data_address(flat)) % 8
    n_words = max(0, (flat.size - head) // 8)
    return flat, flat[head:head + 8 * n_words].view(np.uint64), head


def finish_outputs(tree):
    """The arguments a kernel that writes a tree's rows takes after the inputs: ``token_ids,
    positions, visibility_bits, mask_bytes, mask_words, head``."""
    mask_bytes, mask_words, head = mask_views(tree.visibility)
    return (tree.token_ids, tree.positions, tree.visibility_bits, mask_bytes, mask_words,
            head)


def finish_rows(bs: int, N: int, sms: int) -> int:
    """Rows a block of the finish kernel takes for ``bs`` trees of ``N`` nodes on ``sms``
    SMs: ``FINISH_ROWS``, halved while the grid would have fewer than ``FINISH_FILL * sms``
    blocks (at least one row). With 132 SMs (H100, H200): bs 1, N 257: 1 row (257 blocks);
    bs 8, N 257: 8; bs 64: 32."""
    rows = FINISH_ROWS
    while rows > 1 and bs * -(-N // rows) < FINISH_FILL * sms:
        rows //= 2
    return rows


def launch_finish(top_token_ids, root_token_ids, prefix, has_prefix, tree, ranks,
                  rows_per_block: int | None = None) -> None:
    """Launch the finish kernel alone (validated device inputs; used by ``build_tree`` after
    the selects and by the benchmarks). ``rows_per_block`` (``1 .. FINISH_ROWS``) defaults to
    :func:`finish_rows`'s choice on a GPU (``FINISH_ROWS`` on the simulator); any value gives
    the same tree."""
    bs, N = tree.parents.shape
    if rows_per_block is None:
        # (the simulator runs each block's threads as Python threads: there a block a row
        # made the build_tree tests half as slow again; every count is tested explicitly)
        rows = FINISH_ROWS if SIMULATOR else finish_rows(bs, N, sm_count())
    else:
        rows = operator.index(rows_per_block)   # (an int: TypeError for 2.5, not 2)
    if not 1 <= rows <= FINISH_ROWS:
        raise ValueError(f"rows_per_block: expected 1 .. {FINISH_ROWS}, got {rows}")
    grid = (math.ceil(N / rows), bs)
    launch(_finish_kernel, grid, FINISH_THREADS, launch_stream())(
        top_token_ids, root_token_ids, prefix, has_prefix, tree.parents, tree.depths, ranks,
        tree.num_nodes, rows, *finish_outputs(tree))
