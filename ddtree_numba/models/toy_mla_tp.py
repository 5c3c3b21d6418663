"""Tensor parallelism of the toy MLA target, as a single-process reference: ``tp`` ranks
simulated in numpy, each collective a sum (or a concatenation) in rank order.

How the step shards over ``tp`` GPUs (Megatron-style, as SGLang and vLLM run DeepSeek-V3 and
Kimi-K2, with MLA's latent cache)::

    replicated on every rank   the embedding lookup, x (the residual stream), the RMSNorms,
                               W_kv_a and the latent cache rows it makes ([Dc + Dr] per token
                               and layer: MLA has one row for all heads, so every rank keeps
                               the whole cache), the draft tree, the accept result
    split by heads             W_q's columns, W_UK, W_UV, W_o's rows: rank r owns heads
                               [r H/tp, (r+1) H/tp) and runs verify_attn on them alone
    split by FFN columns       W_gate and W_up's columns, W_down's rows
    split by vocabulary        lm_head's columns: rank r computes logits [r V/tp, (r+1) V/tp)

    per layer:   x += all_reduce_r(attention_r)     [T, D] summed over the ranks
                 x += all_reduce_r(mlp_r)           [T, D]
    at the end:  logits = all_gather_r(logits_r)    [T, V/tp] from each rank

so a step moves ``2 layers`` all-reduces of ``T D`` values and one all-gather of ``T V``
values (``T = bs N`` tree nodes). :class:`TensorParallelToyMLA` computes exactly that on one
machine and counts the values each collective moves; ``tests/test_tensor_parallel.py`` checks
that it equals the unsharded :class:`~ddtree_numba.models.toy_mla.ToyMLA` (the cache rows bit
for bit: they are computed from replicated values; the logits within float64 rounding: the
ranks' shares are summed in another order than one matrix product sums them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .toy_mla import ToyMLA, rms_norm


@dataclass
class CollectiveTraffic:
    """Values moved by the collectives of the forwards run so far (per rank's input)."""

    all_reduce: int = 0         # values each rank contributes to all-reduces
    all_gather: int = 0         # values each rank contributes to all-gathers
    calls: dict = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0})


class TensorParallelToyMLA:
    """The toy target split over ``tp`` simulated ranks (``tp`` divides the heads, the FFN
    width and the vocabulary)."""

    def __init__(self, model: ToyMLA, tp: int):
        if not isinstance(model, ToyMLA):
            raise TypeError(f"model: expected a ToyMLA, got {type(model).__name__}")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp: expected a positive int, got {tp!r}")
        c = model.config
        for name, size in (("heads", c.heads), ("ffn", c.ffn), ("vocab", c.vocab)):
            if size % tp:
                raise ValueError(f"tp: expected a divisor of the model's {name} ({size}), "
                                 f"got {tp}")
        self.model, self.tp = model, tp
        self.traffic = CollectiveTraffic()

    def heads(self, rank: int) -> slice:
        share = self.model.config.heads // self.tp
        return slice(rank * share, (rank + 1) * share)

    def ffn_columns(self, rank: int) -> slice:
        share = self.model.config.ffn // self.tp
        return slice(rank * share, (rank + 1) * share)

    def vocab_columns(self, rank: int) -> slice:
        share = self.model.config.vocab // self.tp
        return slice(rank * share, (rank + 1) * share)

    def all_reduce(self, shares: list) -> np.ndarray:
        """The sum of the ranks' arrays, in rank order (what every rank holds afterwards)."""
        self.traffic.all_reduce += shares[0].size
        self.traffic.calls["all_reduce"] += 1
        total = shares[0]
        for share in shares[1:]:
            total = total + share
        return total

    def all_gather(self, shares: list) -> np.ndarray:
        """The ranks' arrays side by side along the last axis, in rank order."""
        self.traffic.all_gather += shares[0].size
        self.traffic.calls["all_gather"] += 1
        return np.concatenate(shares, axis=-1)

    def forward_rows(self, tokens, positions, visible, prefix_rows):
        """:meth:`~ddtree_numba.models.toy_mla.ToyMLA.forward_rows`, sharded: the same
        arguments and results."""
        m, c = self.model, self.model.config
        n, P = len(tokens), prefix_rows.shape[1]
        mask = np.concatenate([np.ones((n, P), bool), np.asarray(visible, bool)], axis=1)
        x = m.embed[np.asarray(tokens)].astype(np.float64)                  # replicated
        new_rows = np.empty((c.layers, n, c.row_width), np.float32)
        for layer, w in enumerate(m.layers):
            h = rms_norm(x, w.attn_norm)                                    # replicated
            new_rows[layer] = m.cache_rows(w, h, positions)                 # replicated
            rows = np.concatenate([prefix_rows[layer], new_rows[layer]]).astype(np.float64)
            x = x + self.all_reduce([m.attention(w, h, positions, rows, mask, self.heads(r))
                                     for r in range(self.tp)])
            h = rms_norm(x, w.ffn_norm)
            x = x + self.all_reduce([m.mlp(w, h, self.ffn_columns(r)) for r in range(self.tp)])
        h = rms_norm(x, m.final_norm)
        logits = self.all_gather([h @ m.lm_head[:, self.vocab_columns(r)]
                                  for r in range(self.tp)])
        return logits, new_rows
