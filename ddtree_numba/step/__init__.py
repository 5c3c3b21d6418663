"""The whole DDTree step on the device, greedy or sampled.

* :class:`GreedyStep` (:mod:`ddtree_numba.step.greedy`): static buffers and the launches of one
  step, eager or as one CUDA graph;
* :class:`SampledStep` (:mod:`ddtree_numba.step.sampled`): the same step verifying by
  sampling from the target (temperature, top-k, top-p per request), lossless in distribution;
* :mod:`ddtree_numba.step.ops`: the step's own small operations (argmax of the target's
  logits, advancing each request), kernels and numpy twins;
* :mod:`ddtree_numba.step.demo`: the main job, ``python -m ddtree_numba demo``.

The step talks to models only through :class:`~ddtree_numba.interfaces.Target` and
:class:`~ddtree_numba.interfaces.Drafter`; the models live in :mod:`ddtree_numba.models`.
"""

from .greedy import MODES, GreedyStep
from .sampled import SampledStep

__all__ = ["MODES", "GreedyStep", "SampledStep"]
