"""Targets and drafters that the step runs: each implements
:class:`~ddtree_numba.interfaces.Target` or :class:`~ddtree_numba.interfaces.Drafter`.

* :mod:`~ddtree_numba.models.toy_mla`: a tiny DeepSeek-style MLA decoder with seeded weights,
  its plain-form numpy forward (the definition, and a numpy ``Target``);
* :mod:`~ddtree_numba.models.toy_mla_device`: the same model's absorbed-form forward on the
  device (a device ``Target``, using ``kernels.verify_attn``);
* :mod:`~ddtree_numba.models.dense_ops`: the dense layers it needs, kernels and numpy twins;
* :mod:`~ddtree_numba.models.toy_drafter`: the toy block drafter (a noisy view of the target's
  own continuation) and a drafter that replays given logits;
* :mod:`~ddtree_numba.models.bigram`: a bigram toy target whose greedy output is known in
  closed form (fixtures, reference tests).

Submodules are imported on use: the numpy models do not need numba's CUDA target.
"""
