"""Greedy tree accept on the GPU: ``kernels.tree_accept``, bit-exact to the reference.

The walk is inherently sequential (follow the matching child, level by level), but short: at
most ``L`` levels, each a scan of one sibling list. What makes it slow on a GPU is latency, one
dependent global load per link followed. So each request gets one block that

1. stages the request's four ``int32[N]`` input rows (tokens, first child, next sibling,
   target prediction) into shared memory with coalesced loads by all threads (4 N reads per
   request). Thread ``t`` loads entries ``t``, ``t + T`` and ``t + 2 T`` (``T`` threads; at
   ``T = 1024`` the third is past ``N`` and loads nothing, ``accept_commit``'s 512 threads
   need it): all twelve loads are issued (``load_rows``) before the first is stored, so the
   staging costs one DRAM latency, not one per round of a load-then-store loop;
2. walks the lists from the root in thread 0, in shared memory: a sibling tried is one 8-byte
   load (``link``: its token and its next sibling side by side), issued at a clamped index
   while the link's range test runs beside it
3. writes ``accept_nodes`` / ``accept_tokens`` rows with all threads    (2 N writes)

Shared memory, ``MAX_NODES`` (1 056) entries each; thread ``t`` stores entries ``t``,
``t + T``, ``t + 2 T`` of the first four, thread 0 writes ``path`` and ``result``::

    tok      int32    4.2 KB   node tokens (the walk's matches and the write-out)   kernel
    first    int32    4.2 KB   first child                                          greedy_walk
    link     uint64   8.4 KB   (next sibling << 32) | token: one load a sibling     greedy_walk
    pred     int32    4.2 KB   the target's prediction at each node                 greedy_walk
    path     int32    4.2 KB   the accepted nodes, root first                       kernel
    result   int32[2]          k (accepted draft nodes) and the bonus token         kernel
                     -------
                     25.4 KB   (the last column: where it is declared)

Grid ``(bs,)``, block ``(ACCEPT_THREADS,)``; ``N <= 1056`` (the static shared-memory rows).
Links outside ``[1, N)`` end a list, the walk follows at most ``N`` links and accepts at most
``N - 1`` nodes (the longest root path of an ``N``-node tree), so unchecked device inputs
(a self-loop, a cycle, any link value) can give a wrong answer but never an out-of-bounds
access, a hang or ``accept_len > N - 1``; ``path[k]`` stays below ``N <= MAX_NODES``.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint32, uint64

from ..contracts import AcceptResult
from ..limits import MAX_NODES
from ..validation import check_tree_accept, require_buffer
from ._device import CACHE_KERNELS, SIMULATOR, as_device, device_empty, launch, launch_stream

# 1024 threads: a walk's block stages its rows in one round of loads (with 128 the staging was
# nine DRAM latencies: 11.3 us at bs 64, N 1025); accept_commit shares the staging with 512
ACCEPT_THREADS = 32 if SIMULATOR else 1024
#: Entries of each row a thread stages from registers (``load_rows``, which spells out
#: three); a block of ``T`` threads stages ``STAGE_ROUNDS * T`` of them so, and loads the rest
#: one round at a time (only on the simulator, whose blocks are 32 threads).
STAGE_ROUNDS = 3
assert SIMULATOR or STAGE_ROUNDS * ACCEPT_THREADS >= MAX_NODES


@cuda.jit(device=True, inline="always")
def write_accept_rows(b, path, k, bonus, tokens, tid, threads, N, accept_nodes, accept_len,
                      accept_tokens, bonus_token):
    """All threads: request ``b``'s ``AcceptResult`` from the accepted path ``path[0..k]`` and
    the bonus token; ``tokens[i]`` is node ``i``'s token (a shared or a global row). Coalesced
    rows, -1 past the path (``tree_sample`` writes its result the same way)."""
    if tid == 0:
        accept_len[b] = k
        bonus_token[b] = bonus
    nodes_row = accept_nodes[b]                     # the rows' addresses, once
    tokens_row = accept_tokens[b]
    for i in range(tid, N, threads):
        node = int32(-1)                            # past the path: -1 in both rows
        token = int32(-1)
        if i <= k:                                  # (a few threads: k <= L in practice)
            node = path[i]
            # row i: the token of the node accepted after path[i] (the bonus after the last)
            token = bonus if i == k else tokens[path[i + 1]]
        nodes_row[i] = node
        tokens_row[i] = token


@cuda.jit(device=True, inline="always")
def _load_entry(token_ids, next_token, next_sibling, target_predict, b, i, N):
    """Node ``i``'s four entries (zeros past ``N``): the loads are issued here and waited for
    only where the values are stored."""
    if i < N:
        return token_ids[b, i], next_token[b, i], next_sibling[b, i], target_predict[b, i]
    return int32(0), int32(0), int32(0), int32(0)


@cuda.jit(device=True, inline="always")
def load_rows(token_ids, next_token, next_sibling, target_predict, b, tid, threads, N):
    """Phase 1's loads: entries ``tid + q * threads`` (``q < STAGE_ROUNDS``) of request ``b``'s
    four rows, held in registers for ``greedy_walk`` (spelled out, not a loop, so that
    they stay registers whatever a compiler's unrolling heuristics decide)."""
    return (_load_entry(token_ids, next_token, next_sibling, target_predict, b, tid, N),
            _load_entry(token_ids, next_token, next_sibling, target_predict, b,
                        tid + threads, N),
            _load_entry(token_ids, next_token, next_sibling, target_predict, b,
                        tid + 2 * threads, N))


@cuda.jit(device=True, inline="always")
def _link(token, sibling):
    """A node's walk entry: its next sibling in the high 32 bits, its token in the low."""
    return (uint64(uint32(sibling)) << uint64(32)) | uint64(uint32(token))


@cuda.jit(device=True, inline="always")
def _store_entry(entry, i, N, tok, first, link, pred):
    if i < N:
        token, child, sibling, predicted = entry
        tok[i] = token
        first[i] = child
        link[i] = _link(token, sibling)
        pred[i] = predicted


@cuda.jit(device=True, inline="always")
def greedy_walk(token_ids, next_token, next_sibling, target_predict, held, b, tid, threads,
                N, tok, path, result):
    """Phases 1 and 2 (all threads call it, ``held`` from ``load_rows``): stage request
    ``b``'s rows into shared memory and walk them in thread 0. Afterwards every thread sees
    the path ``path[0..k]``, ``result[0] = k`` and ``result[1]`` the bonus token, and ``tok``
    holds the node tokens."""
    first = cuda.shared.array(MAX_NODES, int32)
    link = cuda.shared.array(MAX_NODES, uint64)     # (next sibling << 32) | token
    pred = cuda.shared.array(MAX_NODES, int32)
    _store_entry(held[0], tid, N, tok, first, link, pred)         # 1. stage the rows
    _store_entry(held[1], tid + threads, N, tok, first, link, pred)
    _store_entry(held[2], tid + 2 * threads, N, tok, first, link, pred)
    for i in range(tid + STAGE_ROUNDS * threads, N, threads):     # small blocks only
        token = token_ids[b, i]
        tok[i] = token
        first[i] = next_token[b, i]
        link[i] = _link(token, next_sibling[b, i])
        pred[i] = target_predict[b, i]
    cuda.syncthreads()                              # rows staged before the walk reads them

    if tid == 0:                                    # 2. the walk
        cur = 0
        k = 0
        path[0] = 0
        # links followed, < N in a valid tree; 32-bit (int32 N, steps, an unsigned index:
        # numba's int64 arithmetic and the wrap it adds to a signed index are the walk's
        # critical path otherwise)
        steps = int32(0)
        n_links = int32(N)
        last = uint32(N - 1)
        while k < N - 1:                            # a valid tree's longest path: N - 1
            want = pred[cur]
            c = first[cur]
            while steps < n_links:                  # cur's children, in list order
                # c in [1, N) as one unsigned compare (c <= 0 wraps past N - 1; c - 1 in
                # int64, as numba computes it anyway: int32 would overflow at -2**31 on the
                # simulator); the entry is loaded at a clamped index while the test runs
                inside = uint32(int64(c) - 1) < last
                entry = link[uint32(c) if inside else uint32(0)]
                if not inside or int32(entry & uint64(0xFFFFFFFF)) == want:
                    break                           # out of the list, or the match
                c = int32(entry >> uint64(32))      # the next sibling
                steps = int32(steps + 1)
            if uint32(int64(c) - 1) >= last or steps >= n_links:    # no child: stop
                break
            k += 1
            path[k] = c
            cur = c
            steps = int32(steps + 1)
        result[0] = k
        result[1] = pred[cur]
    cuda.syncthreads()                              # path complete before anyone reads it


@cuda.jit(cache=CACHE_KERNELS)
def _tree_accept_kernel(token_ids, next_token, next_sibling, target_predict, accept_nodes,
                        accept_len, accept_tokens, bonus_token):
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = ACCEPT_THREADS                        # a constant step (_device.launch)
    N = token_ids.shape[1]
    tok = cuda.shared.array(MAX_NODES, int32)
    path = cuda.shared.array(MAX_NODES, int32)
    result = cuda.shared.array(2, int32)            # [k, bonus]
    held = load_rows(token_ids, next_token, next_sibling, target_predict, b, tid, threads, N)
    greedy_walk(token_ids, next_token, next_sibling, target_predict, held, b, tid, threads, N,
                tok, path, result)                  # 1. and 2.
    write_accept_rows(b, path, result[0], result[1], tok, tid, threads, N,  # 3. write-out
                      accept_nodes, accept_len, accept_tokens, bonus_token)


def allocate_accept(bs: int, N: int) -> AcceptResult:
    return AcceptResult(
        accept_nodes=device_empty((bs, N), np.int32),
        accept_len=device_empty((bs,), np.int32),
        accept_tokens=device_empty((bs, N), np.int32),
        bonus_token=device_empty((bs,), np.int32),
    )


def checked_out(out, bs: int, N: int) -> AcceptResult:
    """``out`` if its four buffers are ``int32`` of the shapes a launch writes (a smaller one
    would be written out of bounds), else a ``ValueError`` naming the buffer; a new
    :func:`allocate_accept` when ``out`` is None."""
    if out is None:
        return allocate_accept(bs, N)
    for name, want in (("accept_nodes", (bs, N)), ("accept_len", (bs,)),
                       ("accept_tokens", (bs, N)), ("bonus_token", (bs,))):
        require_buffer(f"out.{name}", getattr(out, name), np.int32, want, "allocate_accept")
    return out


def tree_accept(token_ids, next_token, next_sibling, target_predict, *, check=None,
                out=None) -> AcceptResult:
    """Greedy verification of a batch of trees on the GPU (one launch, no sync).

    Parameters
    ----------
    token_ids, next_token, next_sibling, target_predict : array
        ``int32[bs, N]`` each (numpy or device), as in
        :func:`ddtree_numba.reference.tree_accept`; ``N <= 1056``.
    check : bool, optional
        Run the value checks (links form a tree). Default: on for numpy inputs only.
    out : AcceptResult, optional
        Preallocated device buffers (:func:`ddtree_numba.kernels.allocate_accept`).

    Returns
    -------
    AcceptResult
        Device arrays.
    """
    sz = check_tree_accept(token_ids, next_token, next_sibling, target_predict, check=check)
    if sz.N > MAX_NODES:
        raise ValueError(f"token_ids: expected N <= {MAX_NODES} nodes, got N = {sz.N}")
    args = [as_device(a) for a in (token_ids, next_token, next_sibling, target_predict)]
    res = checked_out(out, sz.bs, sz.N)
    if sz.bs:
        launch(_tree_accept_kernel, sz.bs, ACCEPT_THREADS, launch_stream())(
            *args, res.accept_nodes, res.accept_len, res.accept_tokens, res.bonus_token)
    return res


def build_specs():
    """Specialisations launched by :func:`tree_accept` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    i1, i2 = types.int32[::1], types.int32[:, ::1]
    sig = (i2, i2, i2, i2, i2, i1, i2, i1)
    return [KernelSpec("tree_accept", "walk", _tree_accept_kernel, sig, ACCEPT_THREADS, True)]
