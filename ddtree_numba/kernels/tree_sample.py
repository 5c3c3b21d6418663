"""Tree verification under sampling on the GPU: ``kernels.tree_sample``, bit-exact to the
reference (``reference.tree_sample``: the walk, why it is lossless, and the order of its sums).

One block per request (grid ``(bs,)``, ``SAMPLE_THREADS`` threads):

1. thread 0 walks the tree: at node ``cur`` it adds the target probability of each child's
   token, in list order, in float32, and accepts the first child whose running sum exceeds
   ``uniforms[b, cur]``; the walk stops at a node none of whose children is accepted (so
   *every* child of the last node was rejected: the bonus token's residual removes them all).
   The path goes to shared memory.
2. all threads: chunk ``c`` (tokens ``[64 c, 64 c + 64)``) of the last node's row is summed by
   thread ``c % SAMPLE_THREADS``, sequentially, skipping the tokens of the last node's
   children (adding 0 leaves a float32 sum unchanged, so skipping them is the reference's
   zeroing); each chunk sum goes to shared memory ``chunk_sum[c]``.
3. thread 0 adds the chunk sums in order (the total), then walks them again to find the chunk
   where the running sum passes ``bonus_uniforms[b] * total`` and walks that chunk's tokens.
4. all threads write the ``AcceptResult`` rows (-1 fill).

Every thread reads a contiguous run of 64 floats (256 bytes) of the row: one pass over the
vocabulary, ``V * 4`` bytes per request. Unchecked inputs (``check=False``) never read out of
bounds: links outside ``[1, N)`` end a list, the walk follows at most ``N`` links, token ids
outside ``[0, V)`` are taken as probability 0 and never removed from the residual.
"""

from __future__ import annotations

from numba import cuda, float32, int32, uint64

from ..limits import MAX_NODES, MAX_VOCAB
from ..reference.tree_sample import SAMPLE_CHUNK
from ..validation import check_tree_sample
from ._device import SIMULATOR, as_device, launch, launch_stream
from .tree_accept import checked_out

SAMPLE_THREADS = 32 if SIMULATOR else 256
MAX_CHUNKS = MAX_VOCAB // SAMPLE_CHUNK     # 4096 (shared shapes must be plain constants)


@cuda.jit(device=True, inline=True)
def removed_mask(token_ids, next_token, next_sibling, b, cur, lo, N, use_removed):
    """Bit ``i``: token ``lo + i`` is a child of node ``cur`` (taken out of the residual)."""
    removed = uint64(0)
    if not use_removed:
        return removed
    c = next_token[b, cur]
    steps = 0
    while c > 0 and c < N and steps < N:
        t = token_ids[b, c] - lo
        if t >= 0 and t < SAMPLE_CHUNK:
            removed |= uint64(1) << uint64(t)
        c = next_sibling[b, c]
        steps += 1
    return removed


@cuda.jit
def _tree_sample_kernel(token_ids, next_token, next_sibling, target_probs, uniforms,
                        bonus_uniforms, accept_nodes, accept_len, accept_tokens, bonus_token):
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    N = token_ids.shape[1]
    V = target_probs.shape[2]
    path = cuda.shared.array(MAX_NODES, int32)
    chunk_sum = cuda.shared.array(MAX_CHUNKS, float32)
    state = cuda.shared.array(2, int32)             # [k, last node], then [k, bonus]
    totals = cuda.shared.array(1, float32)

    if tid == 0:                                    # 1. the walk
        cur = 0
        k = 0
        path[0] = 0
        steps = 0                                   # links followed; < N in a valid tree
        while k < N - 1:
            u = uniforms[b, cur]
            acc = float32(0)
            c = next_token[b, cur]
            accepted = False
            while c > 0 and c < N and steps < N:
                t = token_ids[b, c]
                if t >= 0 and t < V:
                    acc += target_probs[b, cur, t]
                if u < acc:
                    accepted = True
                    break
                c = next_sibling[b, c]              # rejected: the next sibling in list order
                steps += 1
            if not accepted:
                break
            k += 1
            path[k] = c
            cur = c
            steps += 1
        state[0] = k
        state[1] = cur
    cuda.syncthreads()                              # path and last node known to all

    k = state[0]
    cur = state[1]
    chunks = (V + SAMPLE_CHUNK - 1) // SAMPLE_CHUNK
    # 2. chunk sums of the residual; if rounding in the walk removed all of the mass, again
    #    without removing anything (the reference's fallback)
    for use_removed in (True, False):
        for ch in range(tid, chunks, threads):
            lo = ch * SAMPLE_CHUNK
            removed = removed_mask(token_ids, next_token, next_sibling, b, cur, lo, N,
                                   use_removed)
            s = float32(0)
            for i in range(min(SAMPLE_CHUNK, V - lo)):
                if (removed >> uint64(i)) & uint64(1) == 0:
                    s += target_probs[b, cur, lo + i]
            chunk_sum[ch] = s
        cuda.syncthreads()                          # every chunk sum written
        if tid == 0:
            total = float32(0)
            for ch in range(chunks):
                total += chunk_sum[ch]
            totals[0] = total
        cuda.syncthreads()                          # the total known to all
        if totals[0] > 0:
            break

    if tid == 0:                                    # 3. inverse CDF, in the reference's order
        target = bonus_uniforms[b] * totals[0]
        running = float32(0)
        found = -1                                  # the chunk the sample lies in
        for ch in range(chunks):
            if running + chunk_sum[ch] > target:
                found = ch
                break
            running += chunk_sum[ch]
        crossed = found >= 0
        if not crossed:                             # u * total rounded up to the total: the
            found = chunks - 1                      # last token with mass (in the last chunk
            while found > 0 and chunk_sum[found] == 0:      # with mass)
                found -= 1
        lo = found * SAMPLE_CHUNK
        removed = removed_mask(token_ids, next_token, next_sibling, b, cur, lo, N,
                               use_removed)
        bonus = -1
        last = lo                                   # last token with mass seen in the chunk
        for i in range(min(SAMPLE_CHUNK, V - lo)):
            p = target_probs[b, cur, lo + i]
            if (removed >> uint64(i)) & uint64(1) == 0 and p > 0:
                running += p
                last = lo + i
                if crossed and running > target:
                    bonus = lo + i
                    break
        state[1] = bonus if bonus >= 0 else last
    cuda.syncthreads()                              # bonus known to all

    bonus = state[1]
    if tid == 0:
        accept_len[b] = k
        bonus_token[b] = bonus
    for i in range(tid, N, threads):                # 4. coalesced rows, -1 fill
        accept_nodes[b, i] = path[i] if i <= k else -1
        if i < k:
            accept_tokens[b, i] = token_ids[b, path[i + 1]]
        elif i == k:
            accept_tokens[b, i] = bonus
        else:
            accept_tokens[b, i] = -1


def tree_sample(token_ids, next_token, next_sibling, target_probs, uniforms, bonus_uniforms,
                *, check=None, out=None):
    """Verification by sampling the target along the tree, on the GPU (one launch, no sync).

    Parameters
    ----------
    token_ids, next_token, next_sibling, target_probs, uniforms, bonus_uniforms : array
        As in :func:`ddtree_numba.reference.tree_sample` (numpy or device); ``N <= 1056``,
        ``V <= 262144``.
    check : bool, optional
        Value checks (a tree, probability rows, uniforms in [0, 1)). Default: on for numpy
        inputs only.
    out : AcceptResult, optional
        Preallocated device buffers (:func:`ddtree_numba.kernels.allocate_accept`).

    Returns
    -------
    AcceptResult
        Device arrays, bit-exact to the reference.
    """
    sz = check_tree_sample(token_ids, next_token, next_sibling, target_probs, uniforms,
                           bonus_uniforms, check=check)
    if sz.N > MAX_NODES:
        raise ValueError(f"token_ids: expected N <= {MAX_NODES} nodes, got N = {sz.N}")
    V = target_probs.shape[2]
    if V > MAX_VOCAB:
        raise ValueError(f"target_probs: expected V <= {MAX_VOCAB}, got V = {V}")
    args = [as_device(a) for a in (token_ids, next_token, next_sibling, target_probs, uniforms,
                                   bonus_uniforms)]
    res = checked_out(out, sz.bs, sz.N)
    if sz.bs:
        launch(_tree_sample_kernel, sz.bs, SAMPLE_THREADS, launch_stream())(
            *args, res.accept_nodes, res.accept_len, res.accept_tokens, res.bonus_token)
    return res


def build_specs():
    """Specialisations launched by :func:`tree_sample` (for the build report)."""
    from numba import types

    from ._specs import KernelSpec

    i1, i2, f1 = types.int32[::1], types.int32[:, ::1], types.float32[::1]
    sig = (i2, i2, i2, types.float32[:, :, ::1], types.float32[:, ::1], f1, i2, i1, i2, i1)
    return [KernelSpec("tree_sample", "walk and sample", _tree_sample_kernel, sig,
                       SAMPLE_THREADS, True)]
