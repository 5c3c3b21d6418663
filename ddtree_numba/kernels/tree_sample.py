"""Tree verification under sampling on the GPU: ``kernels.tree_sample``, bit-exact to the
reference (``reference.tree_sample``: the walk, why it is lossless, and the order of its sums),
and ``kernels.tree_sample_logits``, the same walk straight from the target's logits.

One block per request (grid ``(bs,)``, ``SAMPLE_THREADS`` threads):

1. the walk, in thread 0: at node ``cur`` it adds the target probability of each child's
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
4. all threads write the ``AcceptResult`` rows (-1 fill; ``tree_accept.write_accept_rows``).

``tree_sample`` reads the probabilities ``target_probs[b, node, token]`` that
``kernels.sampling_probs`` wrote for every node. ``tree_sample_logits`` needs them only at the
nodes its walk visits (a few of the ``N``), so it computes them there: before each walk step
the whole block finds the visited row's distribution (``sampling_probs.row_distribution``,
the same passes over the logits, so the same numbers) and a child's probability is
``sampling_probs.probability`` of its logit. Its result is therefore bit for bit that of
``tree_sample(sampling_probs(logits))``, without the ``[bs, N, V]`` probabilities: at bs 64,
N 257, V 163 840 that tensor is 10.8 GB written and read, where the walk reads ~4 rows a
request.

Phase 2 reads a contiguous run of 64 values (256 bytes) a thread: one pass over the last row.
Unchecked inputs (``check=False``) never read out of bounds: links outside ``[1, N)`` end a
list, the walk follows at most ``N`` links, token ids outside ``[0, V)`` are taken as
probability 0 and never removed from the residual.
"""

from __future__ import annotations

from numba import cuda, float32, int32, uint32, uint64

from ..limits import MAX_NODES, MAX_VOCAB
from ..reference.tree_sample import SAMPLE_CHUNK
from ..validation import check_tree_sample, check_tree_sample_logits
from ._device import CACHE_KERNELS, as_device, kernel_for_block, launch, launch_stream
from .sampling_probs import PROB_THREADS, probability, row_distribution
from .tree_accept import checked_out, write_accept_rows

SAMPLE_THREADS = PROB_THREADS              # the logits variant's rows need sampling_probs' block
MAX_CHUNKS = MAX_VOCAB // SAMPLE_CHUNK     # 4096 (shared shapes must be plain constants)
# The distribution of a row given as probabilities: probability() is not called for it.
RAW = (int32(-1), float32(1.0), float32(0.0), uint32(0), uint32(0), float32(1.0))


@cuda.jit(device=True, inline="always")
def _prob(values, row, col, dist, from_logits):
    """Token ``col``'s probability in row ``row`` of ``values``: the value itself, or (from
    logits) its probability under the row's distribution ``dist``."""
    if from_logits:
        return probability(values[row, col], col, dist)
    return values[row, col]


@cuda.jit(device=True, inline="always")
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


@cuda.jit(device=True, inline="always")
def _accepted_child(token_ids, next_token, next_sibling, values, b, cur, u, dist,
                    from_logits, steps, N, V):
    """One walk step (thread 0): the child of ``cur`` that the uniform ``u`` accepts, or -1,
    and the number of links followed so far (``steps`` before; at most ``N`` in all)."""
    row = b * N + cur
    acc = float32(0)
    c = next_token[b, cur]
    while c > 0 and c < N and steps < N:
        t = token_ids[b, c]
        if t >= 0 and t < V:
            acc += _prob(values, row, t, dist, from_logits)
        if u < acc:
            return c, steps + 1                 # the accepted link counts too
        c = next_sibling[b, c]                  # rejected: the next sibling in list order
        steps += 1
    return int32(-1), steps


@cuda.jit(device=True, inline="always")
def _residual_sample(token_ids, next_token, next_sibling, values, b, cur, dist, from_logits,
                     u, chunk_sum, totals, state, tid, threads, N, V):
    """Phases 2 and 3 (all threads call it): the inverse-CDF sample of the last node's row with
    its children removed, in the reference's order; every thread gets the token."""
    row = b * N + cur
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
                    s += _prob(values, row, lo + i, dist, from_logits)
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
        target = u * totals[0]
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
        # use_removed: the pass whose total was used (the loop above ended on it; False
        # where the fall-back without removal ran)
        removed = removed_mask(token_ids, next_token, next_sibling, b, cur, lo, N,
                               use_removed)
        bonus = -1
        last = lo                                   # last token with mass seen in the chunk
        for i in range(min(SAMPLE_CHUNK, V - lo)):
            p = _prob(values, row, lo + i, dist, from_logits)
            if (removed >> uint64(i)) & uint64(1) == 0 and p > 0:
                running += p
                last = lo + i
                if crossed and running > target:
                    bonus = lo + i
                    break
        state[1] = bonus if bonus >= 0 else last
    cuda.syncthreads()                              # bonus known to all
    return state[1]


@cuda.jit(cache=CACHE_KERNELS)
def _tree_sample_kernel(token_ids, next_token, next_sibling, target_probs, uniforms,
                        bonus_uniforms, accept_nodes, accept_len, accept_tokens, bonus_token):
    """``target_probs`` is ``[bs N, V]``: row ``b N + node``."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = SAMPLE_THREADS                        # a constant step (_device.launch)
    N = token_ids.shape[1]
    V = target_probs.shape[1]
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
            c, steps = _accepted_child(token_ids, next_token, next_sibling, target_probs, b,
                                       cur, uniforms[b, cur], RAW, False, steps, N, V)
            if c < 0:
                break
            k += 1
            path[k] = c
            cur = c
        state[0] = k
        state[1] = cur
    cuda.syncthreads()                              # path and last node known to all

    k = state[0]
    bonus = _residual_sample(token_ids, next_token, next_sibling, target_probs, b, state[1],
                             RAW, False, bonus_uniforms[b], chunk_sum, totals, state, tid,
                             threads, N, V)
    write_accept_rows(b, path, k, bonus, token_ids[b], tid, threads, N, accept_nodes,
                      accept_len, accept_tokens, bonus_token)


@kernel_for_block(PROB_THREADS)             # registers capped so the block fits
def _tree_sample_logits_kernel(token_ids, next_token, next_sibling, logits, temperature, top_k,
                               top_p, uniforms, bonus_uniforms, accept_nodes, accept_len,
                               accept_tokens, bonus_token):
    """``logits`` is ``[bs N, V]``: row ``b N + node``. Launched with ``PROB_THREADS``."""
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    threads = PROB_THREADS                          # a constant step (_device.launch)
    N = token_ids.shape[1]
    V = logits.shape[1]
    red = cuda.shared.array(PROB_THREADS, float32)
    red_i = cuda.shared.array(PROB_THREADS, int32)
    path = cuda.shared.array(MAX_NODES, int32)
    chunk_sum = cuda.shared.array(MAX_CHUNKS, float32)
    state = cuda.shared.array(2, int32)             # [k, cur] during the walk, then [k, bonus]
    walk = cuda.shared.array(2, int32)              # [links followed, walk over]
    totals = cuda.shared.array(1, float32)
    T, top, p = temperature[b], top_k[b], top_p[b]

    if tid == 0:
        path[0] = 0
        state[0] = 0
        state[1] = 0
        walk[0] = 0
        walk[1] = 0
    cuda.syncthreads()                              # the walk's state set before anyone reads
    while True:                                     # 1. the walk, one visited row at a time
        k, cur = state[0], state[1]
        # the block finds row cur's distribution; its reductions end with barriers, so every
        # thread has read state before thread 0 overwrites it below
        dist = row_distribution(logits, b * N + cur, T, top, p, red, red_i, tid, V)
        if tid == 0:
            c = int32(-1)
            if k < N - 1:
                c, steps = _accepted_child(token_ids, next_token, next_sibling, logits, b, cur,
                                           uniforms[b, cur], dist, True, walk[0], N, V)
                walk[0] = steps
            if c < 0:
                walk[1] = 1                         # stop: cur is the last node
            else:
                path[k + 1] = c
                state[0] = k + 1
                state[1] = c
        cuda.syncthreads()                          # the step's result known to all
        if walk[1] != 0:                            # (the same for every thread)
            break
    # dist is still the last node's: its residual gives the bonus token
    k = state[0]
    bonus = _residual_sample(token_ids, next_token, next_sibling, logits, b, state[1], dist,
                             True, bonus_uniforms[b], chunk_sum, totals, state, tid, threads,
                             N, V)
    write_accept_rows(b, path, k, bonus, token_ids[b], tid, threads, N, accept_nodes,
                      accept_len, accept_tokens, bonus_token)


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
    res = checked_out(out, sz.bs, sz.N)
    if sz.bs:
        lists = [as_device(a) for a in (token_ids, next_token, next_sibling)]
        rows = as_device(target_probs).reshape(sz.bs * sz.N, V)
        launch(_tree_sample_kernel, sz.bs, SAMPLE_THREADS, launch_stream())(
            *lists, rows, as_device(uniforms), as_device(bonus_uniforms), res.accept_nodes,
            res.accept_len, res.accept_tokens, res.bonus_token)
    return res


def tree_sample_logits(token_ids, next_token, next_sibling, logits, temperature, top_k, top_p,
                       uniforms, bonus_uniforms, *, check=None, out=None):
    """:func:`tree_sample` of :func:`~ddtree_numba.kernels.sampling_probs`, in one launch that
    computes the probabilities only at the nodes its walk visits (no ``[bs, N, V]`` buffer).

    Parameters
    ----------
    token_ids, next_token, next_sibling, uniforms, bonus_uniforms : array
        As for :func:`tree_sample`.
    logits, temperature, top_k, top_p : array
        As for :func:`~ddtree_numba.kernels.sampling_probs`: ``float32[bs, N, V]`` and the
        per-request parameters.
    check : bool, optional
        The value checks of both (the tree and uniforms; the logits and parameters). Default:
        on for numpy inputs only.
    out : AcceptResult, optional
        Preallocated device buffers (:func:`ddtree_numba.kernels.allocate_accept`).

    Returns
    -------
    AcceptResult
        Device arrays, bit for bit those of ``tree_sample(token_ids, next_token,
        next_sibling, sampling_probs(logits, temperature, top_k, top_p), uniforms,
        bonus_uniforms)`` on this device; the same as
        :func:`ddtree_numba.reference.tree_sample_logits` except where float32 rounding moves
        a kept set or a partial sum across a uniform (see ``sampling_probs``).
    """
    sz = check_tree_sample_logits(token_ids, next_token, next_sibling, logits, temperature,
                                  top_k, top_p, uniforms, bonus_uniforms, check=check)
    if sz.N > MAX_NODES:
        raise ValueError(f"token_ids: expected N <= {MAX_NODES} nodes, got N = {sz.N}")
    if sz.V > MAX_VOCAB:
        raise ValueError(f"logits: expected V <= {MAX_VOCAB}, got V = {sz.V}")
    res = checked_out(out, sz.bs, sz.N)
    if sz.bs:
        lists = [as_device(a) for a in (token_ids, next_token, next_sibling)]
        rows = as_device(logits).reshape(sz.bs * sz.N, sz.V)
        launch(_tree_sample_logits_kernel, sz.bs, PROB_THREADS, launch_stream())(
            *lists, rows, *(as_device(a) for a in (temperature, top_k, top_p, uniforms,
                                                   bonus_uniforms)),
            res.accept_nodes, res.accept_len, res.accept_tokens, res.bonus_token)
    return res


def build_specs():
    """Specialisations launched by :func:`tree_sample` and :func:`tree_sample_logits` (for the
    build report)."""
    from numba import types

    from ._specs import KernelSpec

    i1, i2, f1 = types.int32[::1], types.int32[:, ::1], types.float32[::1]
    f2 = types.float32[:, ::1]
    sig = (i2, i2, i2, f2, f2, f1, i2, i1, i2, i1)
    sig_logits = (i2, i2, i2, f2, f1, i1, f1, f2, f1, i2, i1, i2, i1)
    return [KernelSpec("tree_sample", "walk and sample", _tree_sample_kernel, sig,
                       SAMPLE_THREADS, True),
            KernelSpec("tree_sample_logits", "walk, sample, distribution of visited rows",
                       _tree_sample_logits_kernel, sig_logits, PROB_THREADS, True)]
