"""Reference greedy DDTree step: every stage composed around a target and a drafter.

::

    drafter.draft(roots, P) -> draft logits [bs, L, V] --draft_topk--> top_log_probs,
        top_token_ids [bs, L, K] --build_tree--> DraftTree (N = budget + 1 nodes, node 0 = the
        last step's bonus token) --target.forward--> logits [bs * N, V] (also writes the tree's
        KV rows at slots P + j) --argmax--> target_predict [bs, N] --tree_accept-->
        AcceptResult (accepted path, k draft tokens + 1 bonus token) --commit_kv (every layer's
        cache)--> accepted rows moved to slots P + 1 .. P + k; prefix_lens += k + 1

Each step commits ``k + 1`` tokens for one target forward: the accepted draft tokens and the
bonus token, which becomes the root of the next step's tree (its KV row is written by that
step's forward, at slot ``P + k + 1``, the next root slot).

The target and the drafter are the same :class:`~ddtree_numba.interfaces.Target` and
:class:`~ddtree_numba.interfaces.Drafter` interfaces that :class:`~ddtree_numba.GreedyStep` runs,
here with numpy arrays (e.g. :class:`~ddtree_numba.models.toy_mla.ToyMLA`, whose plain forward
defines the toy target, and :class:`~ddtree_numba.models.toy_drafter.FixedDrafter`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contracts import AcceptResult, DraftTree
from ..interfaces import Drafter, Target
from .build_tree import build_tree
from .commit_kv import commit_kv
from .draft_topk import draft_topk
from .tree_accept import tree_accept


@dataclass
class StepOutput:
    """What one greedy step produced (numpy arrays)."""

    draft_logits: np.ndarray
    tree: DraftTree
    target_predict: np.ndarray
    accept: AcceptResult
    prefix_lens: np.ndarray


def argmax_per_node(logits, num_nodes) -> np.ndarray:
    """``int32[bs, N]``: the argmax of each node's logits row (smallest index on ties), ``-1``
    on padding nodes; ``logits`` is ``[bs * N, V]``."""
    bs = len(num_nodes)
    logits = np.asarray(logits)
    best = np.argmax(logits, axis=1).astype(np.int32).reshape(bs, -1)
    valid = np.arange(best.shape[1])[None, :] < np.asarray(num_nodes)[:, None]
    return np.where(valid, best, np.int32(-1))


def greedy_step(target: Target, drafter: Drafter, root_token_ids, block_table, prefix_lens, *,
                k: int, budget: int) -> StepOutput:
    """Run one greedy DDTree step on numpy arrays.

    Parameters
    ----------
    target : Target
        Allocated by the caller (``target.allocate(...)``); its caches are committed in place.
    drafter : Drafter
        Allocated by the caller; ``drafter.draft`` returns ``float32|bfloat16[bs, L, V]``.
    root_token_ids : numpy.ndarray
        ``int32[bs]``: the last committed (bonus) token of each request.
    block_table, prefix_lens : numpy.ndarray
        The paged cache's block table ``int32[bs, max_pages]`` and the committed lengths
        ``int32[bs]``.
    k : int
        Tokens kept per draft depth.
    budget : int
        Draft nodes per tree.

    Returns
    -------
    StepOutput
        The drafter's logits, the tree, the target's predictions, the accepted path and the
        new prefix lengths.
    """
    prefix_lens = np.asarray(prefix_lens)
    draft_logits, tree = draft_tree(drafter, root_token_ids, prefix_lens, k=k, budget=budget)
    logits = target.forward(tree, block_table, prefix_lens)
    target_predict = argmax_per_node(logits, tree.num_nodes)
    accept = tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, target_predict)
    new_prefix_lens = commit_step(target, block_table, prefix_lens, accept)
    return StepOutput(draft_logits, tree, target_predict, accept, new_prefix_lens)


def draft_tree(drafter: Drafter, root_token_ids, prefix_lens, *, k: int, budget: int) -> tuple:
    """The stages before the target, shared by the greedy and the sampled step: the drafter's
    logits ``[bs, L, V]`` and the best-first tree built from their per-depth top ``k``."""
    root_token_ids = np.asarray(root_token_ids)
    prefix_lens = np.asarray(prefix_lens)
    draft_logits = np.asarray(drafter.draft(root_token_ids, prefix_lens))
    top_log_probs, top_token_ids = draft_topk(draft_logits, k)
    tree = build_tree(top_log_probs, top_token_ids, root_token_ids, budget,
                      prefix_lens=prefix_lens)
    return draft_logits, tree


def commit_step(target: Target, block_table, prefix_lens, accept: AcceptResult) -> np.ndarray:
    """The stages after verification, shared by the greedy and the sampled step: every layer's
    accepted rows moved behind the prefix; returns the new prefix lengths ``P + k + 1``."""
    for cache in target.kv_caches():
        commit_kv(cache, block_table, prefix_lens, accept.accept_nodes, accept.accept_len)
    return (prefix_lens + accept.accept_len + 1).astype(np.int32)
