"""ddtree_numba: readable numba.cuda kernels and numpy references for DDTree steps.

``ddtree_numba.reference`` defines each stage in numpy; ``ddtree_numba.kernels`` implements the
same functions on the GPU (or numba's CUDA simulator); :class:`GreedyStep` runs a whole greedy
step on the device, :class:`SampledStep` one that samples (temperature > 0). The buffer contract
(names, shapes, rules) is in the docs: contracts.

Importing the package chooses numba's target before numba is imported: the GPU when a CUDA
driver and device are present, else numba's CUDA simulator (``DDTREE_BACKEND=gpu|simulator``
or ``NUMBA_ENABLE_CUDASIM`` choose explicitly; see :mod:`ddtree_numba._platform`).
"""

from ._platform import choose_backend

choose_backend()                # sets NUMBA_ENABLE_CUDASIM before anything imports numba

from .contracts import AcceptResult, DraftTree  # noqa: E402
from .kdtr import KdtrError, load_kdtr, save_kdtr  # noqa: E402

__version__ = "0.1.0"
__all__ = ["AcceptResult", "DraftTree", "GreedyStep", "KdtrError", "SampledStep", "__version__",
           "load_kdtr", "save_kdtr"]


def __getattr__(name):
    # the steps import numba: loaded on first use, so that importing the package stays cheap
    # and the command line can still pick numba's target (build-report compiles for real)
    if name in ("GreedyStep", "SampledStep"):
        from . import step

        return getattr(step, name)
    raise AttributeError(f"module 'ddtree_numba' has no attribute {name!r}")
