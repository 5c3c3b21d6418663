"""Reference ``tree_accept``: greedy verification by walking first-child / next-sibling lists.

``target_predict[b, i]`` is the target model's argmax after node ``i`` (its prediction of the
token that follows the path root..i). Per request::

    cur = 0, path = [0]
    loop: scan the children of cur in list order (next_token[cur], then next_sibling ...);
          the first child c with token_ids[c] == target_predict[cur] is accepted:
          path.append(c), cur = c; if none matches, stop
    bonus = target_predict[cur]

This is SGLang's ``verify_tree_greedy`` on its ``retrive_next_token`` / ``retrive_next_sibling``
buffers, so an engine's buffers work unchanged. Each walk visits every node at most once
(validation rejects lists that link a node twice), so it ends within ``N`` steps.
"""

from __future__ import annotations

from ..contracts import AcceptResult
from ..validation import check_tree_accept


def tree_accept(token_ids, next_token, next_sibling, target_predict) -> AcceptResult:
    """Accept the longest path of each tree that the target's greedy predictions agree with.

    Parameters
    ----------
    token_ids : numpy.ndarray
        ``int32[bs, N]``: node tokens (``DraftTree.token_ids``).
    next_token : numpy.ndarray
        ``int32[bs, N]``: first child of each node or ``-1``.
    next_sibling : numpy.ndarray
        ``int32[bs, N]``: next sibling of each node or ``-1``.
    target_predict : numpy.ndarray
        ``int32[bs, N]``: the target's argmax token after each node.

    Returns
    -------
    AcceptResult
        Numpy arrays; see :class:`ddtree_numba.AcceptResult`.
    """
    sz = check_tree_accept(token_ids, next_token, next_sibling, target_predict, check=True)
    result = AcceptResult.allocate(sz.bs, sz.N)
    for b in range(sz.bs):
        cur, path = 0, [0]
        while True:
            want = target_predict[b, cur]
            child = next_token[b, cur]
            while child != -1 and token_ids[b, child] != want:
                child = next_sibling[b, child]         # try the next sibling in list order
            if child == -1:
                break
            path.append(int(child))
            cur = child
        k = len(path) - 1
        result.accept_nodes[b, : k + 1] = path
        result.accept_len[b] = k
        result.bonus_token[b] = target_predict[b, cur]
        result.accept_tokens[b, :k] = token_ids[b, path[1:]]
        result.accept_tokens[b, k] = target_predict[b, cur]
    return result
