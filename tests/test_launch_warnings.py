"""The library's own launches do not trigger numba's low-occupancy warning; the user's do.

numba-cuda warns when a launch is *configured* (``kernel[grid, block, stream]``), which needs
no GPU: the check runs on numba's real CUDA target in a subprocess, on any machine.
"""

from scripts import run

CHECK = r"""
import re
import warnings
import ddtree_numba.kernels._device as device
from numba import config, cuda
from ddtree_numba.step.ops import _advance_kernel

@cuda.jit
def users_kernel(x):
    pass

def performance_warnings(configure):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configure()
    # numba may highlight its messages with ANSI codes (it does on the H200 machine): strip them
    return [re.sub(r"\x1b\[[0-9;]*m", "", str(w.message)) for w in caught
            if w.category.__name__ == "NumbaPerformanceWarning"]

assert not device.SIMULATOR
flag = config.CUDA_LOW_OCCUPANCY_WARNINGS
assert flag
ours = performance_warnings(lambda: device.launch(_advance_kernel, 1, 32, 0))
theirs = performance_warnings(lambda: users_kernel[1, 1, 0])
# another grid: numba caches configured launches (lru_cache on configure), so the same
# (kernel, grid, block, stream) would reuse the quiet configuration made above
raw = performance_warnings(lambda: _advance_kernel[2, 32, 0])
assert config.CUDA_LOW_OCCUPANCY_WARNINGS == flag           # restored
print(len(ours), len(theirs), len(raw))
print(theirs[0])
"""


def test_library_launches_are_quiet_and_user_launches_still_warn():
    done = run(["-c", CHECK], NUMBA_ENABLE_CUDASIM="0")
    assert done.returncode == 0, done.stderr
    counts, message = done.stdout.splitlines()
    assert counts == "0 1 1"
    assert message == ("Grid size 1 will likely result in GPU under-utilization due to low "
                       "occupancy.")
