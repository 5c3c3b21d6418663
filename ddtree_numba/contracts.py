"""The containers that stages pass to each other: :class:`DraftTree` and :class:`AcceptResult`.

Both hold either numpy arrays (from :mod:`ddtree_numba.reference`) or device arrays (from
:mod:`ddtree_numba.kernels`); :meth:`to_host` turns the second into the first. Shapes and
padding follow the buffer contract (docs: contracts); symbols: ``bs`` requests, ``N = budget + 1``
nodes with node 0 the root, ``W = ceil(N / 32)`` bit words per visibility row.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .arrays import host_values
from .limits import ceil_words


def _to_host(a):
    return host_values(a)


@dataclass
class DraftTree:
    """A batch of draft trees, one per request, padded to ``N`` nodes.

    Attributes
    ----------
    token_ids : array
        ``int32[bs, N]``: the token of each node; node 0 holds the root (the previous step's
        bonus token). Padding ``-1``.
    parents : array
        ``int32[bs, N]``: parent node index, ``-1`` for the root and padding. ``parents[i] < i``.
    depths : array
        ``int32[bs, N]``: root 0, child = parent + 1. Padding ``-1``.
    log_weights : array
        ``float32[bs, N]``: cumulative draft log-probability of the path to the node (root 0).
        Padding ``-inf``.
    num_nodes : array
        ``int32[bs]``: valid nodes per request, root included (``1 <= num_nodes <= N``).
    next_token : array
        ``int32[bs, N]``: first child (smallest child index), ``-1`` if none. SGLang's
        ``retrive_next_token``.
    next_sibling : array
        ``int32[bs, N]``: next larger sibling index, ``-1`` if none. SGLang's
        ``retrive_next_sibling``.
    visibility : array
        ``bool[bs, N, N]``: ``visibility[b, i, j]`` iff node ``j`` is ``i`` or an ancestor of
        ``i``. Padding rows and columns ``False``.
    visibility_bits : array
        ``uint32[bs, N, W]``: bit ``j % 32`` of word ``j // 32`` of row ``i`` is
        ``visibility[b, i, j]``.
    positions : array
        ``int32[bs, N]``: RoPE position ``prefix_lens[b] + depths[b, i]`` (``depths`` when no
        prefix lengths were given). Padding ``-1``.
    """

    token_ids: object
    parents: object
    depths: object
    log_weights: object
    num_nodes: object
    next_token: object
    next_sibling: object
    visibility: object
    visibility_bits: object
    positions: object

    @property
    def batch_size(self) -> int:
        return int(self.parents.shape[0])

    @property
    def capacity(self) -> int:
        """``N``, the node capacity (budget + 1)."""
        return int(self.parents.shape[1])

    def to_host(self) -> DraftTree:
        """A copy with every field as a numpy array."""
        return DraftTree(**{f.name: _to_host(getattr(self, f.name)) for f in fields(self)})

    @staticmethod
    def allocate(bs: int, N: int) -> DraftTree:
        """Numpy buffers of the right shapes and dtypes, filled with the padding values."""
        W = ceil_words(N)
        return DraftTree(
            token_ids=np.full((bs, N), -1, np.int32),
            parents=np.full((bs, N), -1, np.int32),
            depths=np.full((bs, N), -1, np.int32),
            log_weights=np.full((bs, N), -np.inf, np.float32),
            num_nodes=np.zeros(bs, np.int32),
            next_token=np.full((bs, N), -1, np.int32),
            next_sibling=np.full((bs, N), -1, np.int32),
            visibility=np.zeros((bs, N, N), np.bool_),
            visibility_bits=np.zeros((bs, N, W), np.uint32),
            positions=np.full((bs, N), -1, np.int32),
        )


@dataclass
class AcceptResult:
    """The outcome of greedy verification, one row per request.

    Attributes
    ----------
    accept_nodes : array
        ``int32[bs, N]``: node indices of the accepted path, root first, then ``-1``.
    accept_len : array
        ``int32[bs]``: accepted draft nodes (root and bonus excluded); SGLang's
        ``accept_token_num``.
    accept_tokens : array
        ``int32[bs, N]``: the tokens this step commits: the accepted draft tokens, then the
        bonus token, then ``-1``.
    bonus_token : array
        ``int32[bs]``: the target's prediction at the last accepted node; the next step's root.
    """

    accept_nodes: object
    accept_len: object
    accept_tokens: object
    bonus_token: object

    def to_host(self) -> AcceptResult:
        """A copy with every field as a numpy array."""
        return AcceptResult(**{f.name: _to_host(getattr(self, f.name)) for f in fields(self)})

    @staticmethod
    def allocate(bs: int, N: int) -> AcceptResult:
        return AcceptResult(
            accept_nodes=np.full((bs, N), -1, np.int32),
            accept_len=np.zeros(bs, np.int32),
            accept_tokens=np.full((bs, N), -1, np.int32),
            bonus_token=np.full(bs, -1, np.int32),
        )
