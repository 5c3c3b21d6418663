"""00: numba-cuda on a GPU or on its CPU simulator
===============================================


``import ddtree_numba`` chooses between the real GPU and numba's CUDA simulator *before* numba is
imported: the GPU when a CUDA driver and device are present, else the simulator (it says so once
on stderr). ``DDTREE_BACKEND=gpu`` or ``simulator`` (or numba's own ``NUMBA_ENABLE_CUDASIM=1``)
chooses explicitly. The same kernels run either way. The simulator runs each CUDA thread as a
Python thread: slow, tiny sizes only, no warp intrinsics and no bfloat16, so every kernel keeps a
simulator-runnable variant and the fast variants are checked on a GPU (a few warp-level kernels
are also tested on the simulator, on warp intrinsics that ``tests/simulated_warp.py`` emulates).
"""

# %%
# Import ddtree_numba first (it picks the backend), then numba.
import ddtree_numba  # noqa: I001  (before numba: it chooses numba's CUDA target)

import numpy as np
from numba import cuda

from ddtree_numba import kernels as K

print(f"ddtree_numba {ddtree_numba.__version__}: kernels run "
      f"{'on the GPU' if not K.SIMULATOR else 'on the CUDA simulator'}")


def report(name: str, ok: bool) -> None:
    """Say whether a check matches the reference; stop the example if it does not."""
    print(f"{name}: {'matches the reference' if ok else 'DIFFERS FROM THE REFERENCE'}")
    if not ok:
        raise SystemExit(1)


# %%
# A first kernel: add one to every element, one thread per element.


@cuda.jit
def add_one(x):
    i = cuda.grid(1)              # global thread index = blockIdx.x * blockDim.x + threadIdx.x
    if i < x.size:                # the last block may have threads past the end
        x[i] += 1


x = np.arange(100, dtype=np.float32)
d = cuda.to_device(x)
add_one[4, 32](d)                 # 4 blocks x 32 threads cover 100 elements
report("add_one", bool((d.copy_to_host() == x + 1).all()))

# sphinx_gallery_thumbnail_path = "_generated/thumb_stages.png"
