"""Reference greedy DDTree step: every stage composed around a target-model callback.

::

    draft logits [bs, L, V] --draft_topk--> top_log_probs, top_token_ids [bs, L, K]
        --build_tree--> DraftTree (N = budget + 1 nodes, node 0 = last step's bonus token)
        --target_forward--> target_predict [bs, N]  (also writes tree KV rows at slots P + j)
        --tree_accept--> AcceptResult (accepted path, k draft tokens + 1 bonus token)
        --commit_kv--> accepted rows moved to slots P + 1 .. P + k; prefix_lens += k + 1

Each step commits ``k + 1`` tokens for one target forward: the accepted draft tokens and the
bonus token, which becomes the root of the next step's tree (its KV row is written by that
step's forward, at slot ``P + k + 1``, the next root slot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..contracts import AcceptResult, DraftTree
from .build_tree import build_tree
from .commit_kv import commit_kv
from .draft_topk import draft_topk
from .tree_accept import tree_accept

#: ``target_forward(tree, kv_cache, block_table, prefix_lens) -> target_predict int32[bs, N]``.
TargetForward = Callable[[DraftTree, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass
class StepOutput:
    """What one greedy step produced (numpy arrays)."""

    tree: DraftTree
    target_predict: np.ndarray
    accept: AcceptResult
    prefix_lens: np.ndarray


def greedy_step(draft_logits, root_token_ids, target_forward: TargetForward, kv_cache,
                block_table, prefix_lens, *, k: int, budget: int) -> StepOutput:
    """Run one greedy DDTree step on numpy arrays.

    Parameters
    ----------
    draft_logits : numpy.ndarray
        ``float32|bfloat16[bs, L, V]``: the block drafter's logits for the next ``L`` positions.
    root_token_ids : numpy.ndarray
        ``int32[bs]``: the last committed (bonus) token of each request.
    target_forward : callable
        ``(tree, kv_cache, block_table, prefix_lens) -> int32[bs, N]``: runs the target on every
        tree node (writing node ``j``'s KV row at slot ``P + j``) and returns its argmax.
    kv_cache, block_table, prefix_lens : numpy.ndarray
        The paged latent cache (updated in place), its block table and committed lengths.
        ``kv_cache`` is one cache ``[num_pages, page_size, D]`` or one per layer,
        ``[layers, num_pages, page_size, D]``, all committed along the same path.
    k : int
        Tokens kept per draft depth.
    budget : int
        Draft nodes per tree.

    Returns
    -------
    StepOutput
        The tree, the target's predictions, the accepted path and the new prefix lengths.
    """
    top_log_probs, top_token_ids = draft_topk(draft_logits, k)
    tree = build_tree(top_log_probs, top_token_ids, root_token_ids, budget,
                      prefix_lens=prefix_lens)
    target_predict = np.asarray(target_forward(tree, kv_cache, block_table, prefix_lens))
    accept = tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, target_predict)
    caches = kv_cache if np.ndim(kv_cache) == 4 else [kv_cache]
    for cache in caches:
        new_prefix_lens = commit_kv(cache, block_table, prefix_lens, accept.accept_nodes,
                                    accept.accept_len)
    return StepOutput(tree, target_predict, accept, new_prefix_lens)
