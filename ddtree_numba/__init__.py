"""ddtree_numba: readable numba.cuda kernels and numpy references for greedy DDTree steps.

``ddtree_numba.reference`` defines each stage in numpy; ``ddtree_numba.kernels`` implements the
same functions on the GPU (or numba's CUDA simulator); :class:`GreedyStep` runs a whole greedy
step on the device. See ``DESIGN.md`` for the buffer contract.
"""

from .contracts import AcceptResult, DraftTree
from .kdtr import KdtrError, load_kdtr, save_kdtr

__version__ = "0.1.0"
__all__ = ["AcceptResult", "DraftTree", "GreedyStep", "KdtrError", "__version__", "load_kdtr",
           "save_kdtr"]


def __getattr__(name):
    # GreedyStep imports numba: loaded on first use, so that importing the package does not
    # fix numba's target (GPU or simulator) before the caller chose it
    if name == "GreedyStep":
        from .step import GreedyStep

        return GreedyStep
    raise AttributeError(f"module 'ddtree_numba' has no attribute {name!r}")
