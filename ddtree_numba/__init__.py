"""ddtree_numba: readable numba.cuda kernels and numpy references for greedy DDTree steps.

``ddtree_numba.reference`` defines each stage in numpy; ``ddtree_numba.kernels`` implements the
same functions on the GPU (or numba's CUDA simulator). See ``DESIGN.md`` for the buffer contract.
"""

from .contracts import AcceptResult, DraftTree
from .kdtr import KdtrError, load_kdtr, save_kdtr

__version__ = "0.1.0"
__all__ = ["AcceptResult", "DraftTree", "KdtrError", "__version__", "load_kdtr", "save_kdtr"]
