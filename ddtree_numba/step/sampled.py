"""``SampledStep``: one DDTree step that samples (temperature > 0), on the device, eager or as one
CUDA graph; lossless in distribution for any drafter.

The greedy step with its last verification stages replaced::

    ... target.forward                          -> target logits     [bs N, V]
    kernels.sample_uniforms                     -> uniforms [bs, N], bonus uniforms [bs]
                                                   (Philox keyed by seed, request, position)
    kernels.tree_sample_logits                  -> AcceptResult      (the target-only walk,
                                                   with each visited node's distribution:
                                                   temperature, top-k, top-p per request)
    kernels.commit_kv, advance                  (as in the greedy step; a stacked cache
                                                   commits every layer in one launch)

The walk needs the distribution only at the nodes it visits (the accepted path: a few of the
``N``), so the step never writes the ``[bs, N, V]`` probabilities: ``tree_sample_logits``
computes them there, bit for bit what ``sampling_probs`` followed by ``tree_sample`` gives.

The drafter, the tree and the cache bookkeeping are the greedy step's: target-only sampling
needs no draft probabilities, so the drafter's top-K tree is verified as it is. A request with
temperature 0 gets a one-hot distribution at the target's argmax, and the walk then accepts
exactly what greedy verification accepts: a batch may mix greedy and sampled requests. The
uniforms are keyed by each request's prefix length, which lives on the device, so a captured
graph draws new uniforms at every replay, and a run is reproducible from its seed: ``start()``
again with the same roots draws the same uniforms and emits the same tokens (build the step
with another seed for another sample).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .. import kernels
from ..kernels.sample_uniforms import allocate_uniforms, sample_uniforms
from ..kernels.sampling_probs import sampling_probs
from ..limits import MAX_BATCH
from ..validation import check_sampling_params, require_int
from .greedy import GreedyStep


def _per_request(name, value, bs, dtype) -> np.ndarray:
    """A scalar or ``bs`` values as a ``dtype[bs]`` array, refusing values the cast would
    change (an int past int32, a float that float32 rounds to another side of a limit)."""
    a = np.asarray(value)
    if a.ndim == 0:
        a = np.full(bs, a)
    if a.shape != (bs,):
        raise ValueError(f"{name}: expected a number or {bs} values (one per request), got "
                         f"shape {list(a.shape)}")
    if dtype == np.int32 and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected ints, got {a.dtype}")
    if not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise TypeError(f"{name}: expected numbers, got {a.dtype}")
    with np.errstate(over="ignore"):            # an overflow is caught just below
        cast = a.astype(dtype)
    if dtype == np.int32:                       # an int past int32 would wrap around
        changed = np.array([x != y for x, y in zip(a.tolist(), cast.tolist(), strict=True)])
    else:                                       # a float the cast moves across 0, 1 or inf
        wide, narrow = a.astype(np.float64), cast.astype(np.float64)
        changed = (((wide > 0) != (narrow > 0)) | ((wide <= 1) != (narrow <= 1))
                   | (np.isfinite(wide) != np.isfinite(narrow)))
    if changed.any():
        b = int(np.flatnonzero(changed)[0])
        raise ValueError(f"{name}: expected a value that {np.dtype(dtype).name} holds, got "
                         f"{a[b]} in request {b}")
    return cast


class SampledStep(GreedyStep):
    """Static buffers and launches of sampled DDTree steps for a fixed batch.

    Parameters
    ----------
    target, drafter, bs, L, K, budget, max_steps, page_size, mode, ops
        As for :class:`~ddtree_numba.GreedyStep`.
    temperature : float or sequence of float
        Per request (or one for all), ``>= 0``; 0 (below 1e-5) decodes that request
        greedily.
    top_k : int or sequence of int
        Per request, ``>= 0``; 0 keeps every token.
    top_p : float or sequence of float
        Per request, in ``(0, 1]``; 1 keeps every token.
    seed : int
        In ``[0, 2^64)``: keys the uniforms (and the page shuffle).
    """

    def __init__(self, target, drafter, *, bs: int, L: int, K: int, budget: int,
                 max_steps: int, temperature=1.0, top_k=0, top_p=1.0, page_size: int = 16,
                 mode: str = "eager", ops=None, seed: int = 0):
        seed = require_int("seed", seed, low=0, high=2**64 - 1)
        bs = require_int("bs", bs, low=1, high=MAX_BATCH)
        t = _per_request("temperature", temperature, bs, np.float32)
        k = _per_request("top_k", top_k, bs, np.int32)
        p = _per_request("top_p", top_p, bs, np.float32)
        check_sampling_params(t, k, p, check=True)
        super().__init__(target, drafter, bs=bs, L=L, K=K, budget=budget, max_steps=max_steps,
                         page_size=page_size, mode=mode, ops=ops, seed=seed)
        self.seed = seed
        self.temperature, self.top_k, self.top_p = (cuda.to_device(a) for a in (t, k, p))
        self.uniforms, self.bonus_uniforms = allocate_uniforms(self.bs, self.N)

    def stages(self) -> list:
        """The greedy step's stages, with ``argmax`` and ``tree_accept`` replaced by
        ``sample_uniforms`` and ``tree_sample_logits`` (a fused ``accept_commit`` becomes
        ``tree_sample_logits`` then ``commit_kv``, one launch for the stacked cache)."""
        sample = ("tree_sample_logits", self._tree_sample_logits)
        replaced = {"argmax": [("sample_uniforms", self._sample_uniforms)],
                    "tree_accept": [sample],
                    "accept_commit": [sample, ("commit_kv", self._commit_kv)]}
        stages = []
        for name, launch in super().stages():
            stages += replaced.get(name, [(name, launch)])
        return stages

    def _sample_uniforms(self):
        sample_uniforms(self.seed, self.prefix_lens, self.N, check=False,
                        out=(self.uniforms, self.bonus_uniforms))

    def _tree_sample_logits(self):
        logits = self.target_logits.reshape(self.bs, self.N, self.target.vocab)
        kernels.tree_sample_logits(self.tree.token_ids, self.tree.next_token,
                                   self.tree.next_sibling, logits, self.temperature, self.top_k,
                                   self.top_p, self.uniforms, self.bonus_uniforms, check=False,
                                   out=self.accept)

    def last_step(self) -> dict:
        """As :meth:`GreedyStep.last_step`, plus the step's uniforms and the probabilities of
        every node (``sampling_probs`` of the step's logits, computed here: the step itself
        needs them only along the walk); ``target_predict`` is not computed by a sampled
        step."""
        out = super().last_step()
        out.pop("target_predict")
        logits = self.target_logits.reshape(self.bs, self.N, self.target.vocab)
        probs = sampling_probs(logits, self.temperature, self.top_k, self.top_p, check=False)
        out.update(probs=probs.copy_to_host(), uniforms=self.uniforms.copy_to_host(),
                   bonus_uniforms=self.bonus_uniforms.copy_to_host())
        return out
