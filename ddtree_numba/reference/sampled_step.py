"""Reference sampled DDTree step: the greedy step (``reference.greedy_step``) with its
verification replaced by sampling from the target.

::

    ... target.forward -> logits [bs * N, V] --sampling_probs (temperature, top-k, top-p per
        request)--> probs [bs, N, V] --tree_sample, with sample_uniforms(seed, prefix_lens)-->
        AcceptResult --commit_kv--> prefix_lens += k + 1

What :class:`~ddtree_numba.step.sampled.SampledStep` runs on the device, stage for stage, on
numpy arrays: the uniforms are the same bits, the probabilities agree within float32 rounding
(``reference.sampling_probs``), so the two accept the same paths unless a uniform falls
within rounding of a partial sum of the walk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contracts import AcceptResult, DraftTree
from ..interfaces import Drafter, Target
from .greedy_step import commit_step, draft_tree
from .sample_uniforms import sample_uniforms
from .sampling_probs import sampling_probs
from .tree_sample import tree_sample


@dataclass
class SampledOutput:
    """What one sampled step produced (numpy arrays)."""

    draft_logits: np.ndarray
    tree: DraftTree
    probs: np.ndarray
    uniforms: np.ndarray
    bonus_uniforms: np.ndarray
    accept: AcceptResult
    prefix_lens: np.ndarray


def sampled_step(target: Target, drafter: Drafter, root_token_ids, block_table, prefix_lens, *,
                 k: int, budget: int, temperature, top_k, top_p, seed: int) -> SampledOutput:
    """Run one sampled DDTree step on numpy arrays.

    Parameters
    ----------
    target, drafter, root_token_ids, block_table, prefix_lens, k, budget
        As for :func:`~ddtree_numba.reference.greedy_step`.
    temperature, top_k, top_p : numpy.ndarray
        Per request: ``float32[bs]``, ``int32[bs]``, ``float32[bs]``
        (:func:`~ddtree_numba.reference.sampling_probs`).
    seed : int
        The run's key (:func:`~ddtree_numba.reference.sample_uniforms`).
    """
    prefix_lens = np.asarray(prefix_lens)
    draft_logits, tree = draft_tree(drafter, root_token_ids, prefix_lens, k=k, budget=budget)
    bs, N = tree.token_ids.shape
    logits = np.array(target.forward(tree, block_table, prefix_lens), np.float32)
    logits = logits.reshape(bs, N, -1)
    logits[np.arange(N)[None, :] >= tree.num_nodes[:, None]] = 0    # padding rows: unread
    probs = sampling_probs(logits, temperature, top_k, top_p)
    uniforms, bonus = sample_uniforms(seed, prefix_lens, N)
    accept = tree_sample(tree.token_ids, tree.next_token, tree.next_sibling, probs, uniforms,
                         bonus)
    new_prefix_lens = commit_step(target, block_table, prefix_lens, accept)
    return SampledOutput(draft_logits, tree, probs, uniforms, bonus, accept, new_prefix_lens)
