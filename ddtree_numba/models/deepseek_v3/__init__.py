"""The DeepSeek-V3 architecture (DeepSeek-V3, Kimi-K2, Moonlight) from Hugging Face checkpoints.

* :mod:`~ddtree_numba.models.deepseek_v3.config`: the sizes, from ``config.json``, unknown
  fields and unsupported values refused by name;
* :mod:`~ddtree_numba.models.deepseek_v3.checkpoint`: safetensors checkpoints (one file or
  sharded), read lazily, block-float8 weights dequantised;
* :mod:`~ddtree_numba.models.deepseek_v3.reference`: the plain-form forward in numpy float64,
  the definition (checked against ``transformers`` on fixtures it wrote).
"""

from .checkpoint import Checkpoint
from .config import DeepseekV3Config

__all__ = ["Checkpoint", "DeepseekV3Config"]
