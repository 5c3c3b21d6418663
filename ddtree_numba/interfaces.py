"""The two interfaces of a greedy step: the :class:`Target` model and the :class:`Drafter`.

One definition serves both implementations of the step: :func:`ddtree_numba.reference.greedy_step`
(numpy arrays in and out) and :class:`ddtree_numba.GreedyStep` (device arrays, no host round
trip, capturable as one CUDA graph). Any object with these attributes and methods is a target
or a drafter (``typing.Protocol``: no base class to inherit); the library's own ones live in
:mod:`ddtree_numba.models`. The step imports no model.

One step, seen from these interfaces::

    target.allocate(bs=, N=, num_pages=, page_size=, max_pages=)   once, before the first step
    drafter.allocate(bs=, L=)                                        once
    logits = drafter.draft(root_token_ids, prefix_lens)             [bs, L, V] per step
    ... draft_topk, build_tree ...
    logits = target.forward(tree, block_table, prefix_lens)         [bs * N, V] per step
    ... argmax, tree_accept ...
    for cache in target.kv_caches(): commit_kv(cache, ...)           every layer's cache
                                       (GreedyStep: one accept_commit launch when
                                        target.kv_cache stacks the layers)

Arrays are numpy arrays for the reference step and device arrays for :class:`GreedyStep`; a
target or drafter written for one is used with that one (the toy MLA has one of each: the
plain numpy forward and the absorbed device forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .contracts import DraftTree


@runtime_checkable
class Target(Protocol):
    """The model being decoded: runs every tree node in one forward and owns its KV cache.

    Attributes
    ----------
    vocab : int
        Vocabulary size ``V`` (the logits' last axis).
    """

    vocab: int

    def allocate(self, *, bs: int, N: int, num_pages: int, page_size: int,
                 max_pages: int) -> None:
        """Allocate the static buffers of a step: activations for ``bs * N`` tree nodes and a
        zeroed paged cache of ``num_pages`` pages of ``page_size`` slots per layer, addressed
        through block tables ``max_pages`` wide."""

    def kv_caches(self) -> Sequence[Any]:
        """One ``[num_pages, page_size, D]`` cache per layer, committed along the accepted path
        after each step (views, not copies: ``commit_kv`` updates them in place). A target
        that also has ``kv_cache``, one ``[layers, num_pages, page_size, D]`` array whose
        layers are these views, gets every layer committed in one launch
        (``kernels.accept_commit``) by :class:`~ddtree_numba.GreedyStep`."""

    def forward(self, tree: DraftTree, block_table, prefix_lens) -> Any:
        """Logits ``[bs * N, V]`` (row ``b * N + j`` is node ``j`` of request ``b``; rows of
        padding nodes may hold anything) for every node of ``tree`` after each request's
        cached prefix of ``prefix_lens[b]`` slots. Writes node ``j``'s cache row of every layer
        at slot ``prefix_lens[b] + j``; node ``i`` attends to the prefix and to the nodes that
        ``tree.visibility_bits[b, i]`` shows, at RoPE position ``tree.positions[b, i]``."""


@runtime_checkable
class Drafter(Protocol):
    """The block drafter: the logits of the ``L`` positions after each request's root token.

    Attributes
    ----------
    vocab : int
        Vocabulary size ``V``; must equal the target's.
    """

    vocab: int

    def allocate(self, *, bs: int, L: int) -> None:
        """Allocate the static buffers for ``bs`` requests and ``L`` draft positions."""

    def draft(self, root_token_ids, prefix_lens) -> Any:
        """Logits ``float32|bfloat16[bs, L, V]``: position ``d`` predicts the token at
        ``prefix_lens[b] + 1 + d``, after the root token ``root_token_ids[b]`` at position
        ``prefix_lens[b]``. The step reads the returned array before the next call."""
