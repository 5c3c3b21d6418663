"""00: numba-cuda on a GPU or on its CPU simulator
===============================================


Every example starts the same way: decide between the real GPU and numba's CUDA simulator
*before* numba is imported (``NUMBA_ENABLE_CUDASIM=1`` selects the simulator), then use the
same kernels either way. The simulator runs each CUDA thread as a Python thread: slow, tiny
sizes only, no warp intrinsics and no bfloat16, so every kernel keeps a simulator-runnable
variant and the fast variants are checked on a GPU.
"""

# %%
# Choose the backend, then import numba and the kernels.
from _common import BACKEND, report  # noqa: I001  (must run before numba is imported)

import numpy as np
from numba import cuda

from ddtree_numba import kernels as K

print(f"backend: {BACKEND}; kernels run {'on the GPU' if not K.SIMULATOR else 'simulated'}")

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
