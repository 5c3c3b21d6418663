"""A bigram toy target (a :class:`~ddtree_numba.interfaces.Target` on numpy arrays) and a
noisy drafter's logits, for the KDTR fixtures and the reference step's tests.

* :class:`BigramTarget`: the "model" predicts ``next_of[token]`` after any token, a fixed random
  permutation of the vocabulary, so plain greedy decoding is ``t, next_of[t], ...``. Its
  forward also writes one cache row per tree node (an embedding of the node's token and
  position), so :func:`commit_kv` has real rows to move and the test can check them.
* :func:`noisy_drafter_logits`: logits for the next ``L`` positions that put a bonus of
  ``confidence`` on the target's own continuation of the root, plus Gaussian noise. A higher
  ``confidence`` means a drafter that agrees with the target more often.

The greedy step's demo and tests use the toy MLA decoder (:mod:`ddtree_numba.models.toy_mla`); this
bigram toy stays for the KDTR fixtures and the reference step's tests, where a target whose
greedy output is known in closed form keeps the expected values obvious.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contracts import DraftTree
from ..reference.commit_kv import slot_address


@dataclass
class BigramTarget:
    vocab: int
    row_width: int
    seed: int = 0

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        self.next_of = rng.permutation(self.vocab).astype(np.int32)          # [V]
        self.embedding = rng.standard_normal((self.vocab, self.row_width)).astype(np.float32)

    def cache_row(self, token: int, position: int) -> np.ndarray:
        """The cache row this toy writes for ``token`` at ``position``: ``[row_width]``."""
        return self.embedding[token] + np.float32(position)

    # -- the Target interface (numpy) --------------------------------------------------------
    def allocate(self, *, bs: int, N: int, num_pages: int, page_size: int,
                 max_pages: int) -> None:
        """A zeroed one-layer cache ``float32[num_pages, page_size, row_width]``."""
        self.kv_cache = np.zeros((num_pages, page_size, self.row_width), np.float32)

    def kv_caches(self) -> list:
        return [self.kv_cache]

    def forward(self, tree: DraftTree, block_table, prefix_lens) -> np.ndarray:
        """Write node j's row at slot ``P + j``; return logits ``float32[bs * N, V]``: 1 at
        ``next_of[token]``, 0 elsewhere (and on padding rows)."""
        tree = tree.to_host()
        bs, N = tree.token_ids.shape
        logits = np.zeros((bs * N, self.vocab), np.float32)
        page_size = self.kv_cache.shape[1]
        for b in range(bs):
            n = int(tree.num_nodes[b])
            tokens = tree.token_ids[b, :n]                                   # [n]
            logits[b * N + np.arange(n), self.next_of[tokens]] = 1.0
            slots = int(prefix_lens[b]) + np.arange(n)                       # [n]
            rows = self.embedding[tokens] + tree.positions[b, :n, None].astype(np.float32)
            self.kv_cache[slot_address(block_table[b], page_size, slots)] = rows
        return logits

    def greedy(self, token: int, steps: int) -> list:
        """Plain greedy decoding: the ``steps`` tokens after ``token``."""
        out = []
        for _ in range(steps):
            token = int(self.next_of[token])
            out.append(token)
        return out


def noisy_drafter_logits(target: BigramTarget, roots, L: int, *, confidence: float, rng):
    """``float32[bs, L, V]``: noise plus ``confidence`` on the target's continuation."""
    roots = np.asarray(roots)
    logits = rng.standard_normal((len(roots), L, target.vocab)).astype(np.float32)
    for b, token in enumerate(roots):
        for d, t in enumerate(target.greedy(int(token), L)):
            logits[b, d, t] += np.float32(confidence)
    return logits
