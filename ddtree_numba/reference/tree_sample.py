"""Reference ``tree_sample``: verification under sampling (temperature > 0), by walking the tree
with samples from the target ("target-only" tree sampling).

``target_probs[b, i]`` is the target's sampling distribution after node ``i`` (temperature,
top-k and top-p already applied). Per request, with one uniform ``u`` per node and one more for
the bonus token::

    cur = 0, path = [0]
    loop: u = uniforms[cur], acc = 0
          for each child c of cur in list order (next_token[cur], then next_sibling ...):
              acc += target_probs[cur, token_ids[c]]          (float32, in list order)
              if u < acc: accept c: path.append(c), cur = c, next loop
          no child accepted: stop
    bonus = a sample of target_probs[cur] with the mass of the children rejected at cur
            removed, drawn by inverse CDF with bonus_uniforms[b] (see ``sample_residual``)

Why it is lossless: at ``cur`` the walk compares ``u`` with the cumulative target mass of the
children, so child ``c`` is accepted exactly when the inverse-CDF sample of ``target_probs[cur]``
with ``u`` (children first, in list order) is ``c``'s token: probability
``target_probs[cur, token(c)]``. When ``u`` falls past all children, the token is drawn from the
target restricted to the other tokens, renormalised: together, every token ``t`` comes out with
probability ``target_probs[cur, t]``, whatever the drafter proposed. So each emitted token has
the target's distribution given the tokens before it: the output is distributed as plain
sampling from the target. The draft probabilities are never needed.

This is SGLang's ``tree_speculative_sampling_target_only`` at thresholds 1 (its
``threshold_single`` and ``threshold_acc`` relax acceptance, which is no longer lossless), on its
``retrive_next_token`` / ``retrive_next_sibling`` lists, with one difference at a boundary:
SGLang accepts when ``u <= acc``, which for ``u = 0`` accepts a child of probability 0; here
``u < acc`` (the inverse CDF of ``u`` in ``[0, 1)``), so a token the target cannot emit is
never accepted. The two agree unless ``u`` equals a partial sum exactly. The walk's sums are
float32 in list order, as SGLang's; the bonus token's inverse CDF is defined here in a fixed
blocked order that the kernel reproduces bit for bit (:func:`sample_residual`).
"""

from __future__ import annotations

import numpy as np

from ..contracts import AcceptResult
from ..validation import check_tree_sample, check_tree_sample_logits
from .sampling_probs import sampling_probs

#: The bonus token's inverse CDF sums the vocabulary in chunks of this many values: each chunk
#: sequentially, then the chunk sums sequentially (the kernel gives one chunk to a thread).
SAMPLE_CHUNK = 64


def sample_residual(probs, removed, u) -> int:
    """The inverse-CDF sample of ``probs`` (``float32[V]``) without the tokens ``removed``.

    Float32 sums in a fixed order, which the kernel reproduces: each chunk of
    :data:`SAMPLE_CHUNK` tokens is summed sequentially, the chunk sums sequentially give the
    total, and with ``target = u * total`` the running sum of chunk sums finds the first chunk
    that passes ``target``; inside it the running sum continues token by token, and the first
    token with nonzero residual that passes ``target`` is the sample. Rounding can leave no
    token passing inside that chunk (the chunk's own sum rounds differently): its last token
    with nonzero residual is taken; or no chunk passing (``u * total`` rounded up to the total):
    the last token with nonzero residual is taken. If every token was removed (possible only
    by rounding of the walk), the sample is drawn the same way from ``probs`` itself.
    """
    residual = np.array(probs, np.float32)
    residual[list(removed)] = 0
    if _chunk_sums(residual).sum(dtype=np.float64) == 0:
        residual = np.array(probs, np.float32)
    sums = _chunk_sums(residual)
    total = np.float32(0)
    for s in sums:
        total = np.float32(total + s)
    target = np.float32(np.float32(u) * total)
    running = np.float32(0)
    for c, chunk_total in enumerate(sums):
        if np.float32(running + chunk_total) > target:       # the sample is in this chunk
            chunk = residual[c * SAMPLE_CHUNK: (c + 1) * SAMPLE_CHUNK]
            for k, value in enumerate(chunk):
                running = np.float32(running + value)
                if value > 0 and running > target:
                    return c * SAMPLE_CHUNK + k
            return c * SAMPLE_CHUNK + int(np.nonzero(chunk > 0)[0][-1])
        running = np.float32(running + chunk_total)
    return int(np.nonzero(residual > 0)[0][-1])


def _chunk_sums(values) -> np.ndarray:
    """``float32[ceil(V / SAMPLE_CHUNK)]``: each chunk summed sequentially in float32."""
    sums = np.zeros(-(-len(values) // SAMPLE_CHUNK), np.float32)
    for c in range(len(sums)):
        for value in values[c * SAMPLE_CHUNK: (c + 1) * SAMPLE_CHUNK]:
            sums[c] = np.float32(sums[c] + value)
    return sums


def tree_sample(token_ids, next_token, next_sibling, target_probs, uniforms,
                bonus_uniforms) -> AcceptResult:
    """Accept a path of each tree by sampling the target along it (lossless for any drafter).

    Parameters
    ----------
    token_ids, next_token, next_sibling : numpy.ndarray
        ``int32[bs, N]``: the tree's lists, as for :func:`~ddtree_numba.reference.tree_accept`.
    target_probs : numpy.ndarray
        ``float32[bs, N, V]``: the target's sampling distribution after each node (rows of
        padding nodes are never read).
    uniforms : numpy.ndarray
        ``float32[bs, N]`` in ``[0, 1)``: node ``i``'s uniform decides which child of ``i`` is
        accepted.
    bonus_uniforms : numpy.ndarray
        ``float32[bs]`` in ``[0, 1)``: draws the bonus token.

    Returns
    -------
    AcceptResult
        As greedy :func:`~ddtree_numba.reference.tree_accept`: the accepted path, its length,
        the committed tokens and the bonus token.
    """
    sz = check_tree_sample(token_ids, next_token, next_sibling, target_probs, uniforms,
                           bonus_uniforms, check=True)
    result = AcceptResult.allocate(sz.bs, sz.N)
    for b in range(sz.bs):
        cur, path = 0, [0]
        while True:
            u, acc, rejected = uniforms[b, cur], np.float32(0), []
            child = next_token[b, cur]
            while child != -1:
                acc = np.float32(acc + target_probs[b, cur, token_ids[b, child]])
                if u < acc:
                    break
                rejected.append(int(token_ids[b, child]))
                child = next_sibling[b, child]
            if child == -1:
                break
            path.append(int(child))
            cur = child
        bonus = sample_residual(target_probs[b, cur], rejected, bonus_uniforms[b])
        k = len(path) - 1
        result.accept_nodes[b, : k + 1] = path
        result.accept_len[b] = k
        result.bonus_token[b] = bonus
        result.accept_tokens[b, :k] = token_ids[b, path[1:]]
        result.accept_tokens[b, k] = bonus
    return result


def tree_sample_logits(token_ids, next_token, next_sibling, logits, temperature, top_k, top_p,
                       uniforms, bonus_uniforms) -> AcceptResult:
    """:func:`tree_sample` on :func:`~ddtree_numba.reference.sampling_probs` of ``logits``:
    the definition of the kernel that fuses the two (and computes the distribution only at the
    nodes its walk visits). ``logits`` ``float32[bs, N, V]`` and the per-request
    ``temperature``, ``top_k``, ``top_p`` as for ``sampling_probs``; the rest as for
    :func:`tree_sample`."""
    check_tree_sample_logits(token_ids, next_token, next_sibling, logits, temperature, top_k,
                             top_p, uniforms, bonus_uniforms, check=True)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return tree_sample(token_ids, next_token, next_sibling, probs, uniforms, bonus_uniforms)
