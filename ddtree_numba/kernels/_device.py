"""Device-array plumbing shared by the kernel launchers.

* :data:`SIMULATOR` says whether numba runs kernels on its CPU simulator
  (``NUMBA_ENABLE_CUDASIM=1``): no warp intrinsics, no bfloat16 there, so launchers pick the
  simulator-runnable variant.
* :func:`as_device` accepts numpy arrays and any CUDA Array Interface array (numba, CuPy,
  torch) without copying device data; bfloat16 travels as its raw ``uint16`` bits.
* :func:`launch` configures a launch of the library's kernels without numba's low-occupancy
  warning (small grids are by design here).
* :func:`shared_layout` places several arrays in one dynamic shared block (seen through one
  array of each type), so that a kernel's phases can reuse the same bytes as other types.
* :func:`allow_dynamic_shared` opts a kernel into more than 48 KB of dynamic shared memory
  (numba-cuda has no API for it; the driver attribute on the compiled function does it).
* :func:`launch_stream` gives the stream launches go to (the default stream, or the one a
  caller set with :func:`use_stream`, e.g. a CuPy stream during CUDA-graph capture).
* :data:`CACHE_KERNELS` (``DDTREE_KERNEL_CACHE=1``) keeps compiled kernels in numba's on-disk
  cache, so that other processes and later runs load them instead of compiling them again.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import numpy as np
from numba import config, cuda

from .._platform import announce_simulator, kernel_cache_requested
from ..arrays import BFLOAT16, array_source

SIMULATOR: bool = bool(config.ENABLE_CUDASIM)

if SIMULATOR:
    announce_simulator()        # once per process, only if chosen automatically

    # The simulator runs each CUDA thread as a Python thread and each syncthreads() as a
    # barrier; with CPython's default 5 ms GIL switch interval a block-wide barrier costs
    # milliseconds. A 50 us interval makes barrier-heavy kernels ~8x faster to simulate.
    sys.setswitchinterval(min(sys.getswitchinterval(), 5e-5))

    def _serialise_shared_allocations():
        """numba-cuda 0.30's simulator allocates ``cuda.shared.array`` with an unlocked
        check-then-set keyed by source line: two threads of a block can each get their own
        array and never see each other's writes. Take a lock around it (the same class of
        race as NVIDIA/numba-cuda#690 fixed for ``swapped_cuda_module``)."""
        from numba.cuda.simulator.kernelapi import FakeCUDAShared

        if getattr(FakeCUDAShared.array, "_ddtree_locked", False):
            return
        from numba.core import types
        from numba.np import numpy_support

        unlocked = FakeCUDAShared.array
        lock = threading.Lock()

        def locked_array(self, shape, dtype):
            if shape == 0:                      # dynamic shared memory: not keyed by line
                return unlocked(self, shape, dtype)
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            caller = sys._getframe(1)           # same key as the original: caller's line
            key = (caller.f_code.co_filename, caller.f_lineno)
            with lock:
                found = self._allocations.get(key)
                if found is None:
                    found = self._allocations[key] = np.empty(shape, dtype)
            return found

        locked_array._ddtree_locked = True
        FakeCUDAShared.array = locked_array

    _serialise_shared_allocations()

#: ``DDTREE_KERNEL_CACHE=1``: every kernel of the library is compiled with ``cache=True`` and
#: kept in numba's on-disk cache (in ``NUMBA_CACHE_DIR`` when set, else in ``__pycache__`` beside
#: its source), so that another process, or a later run, loads it instead of compiling it again
#: (one to four minutes for a whole step); a kernel that another process is compiling is waited
#: for, then loaded. The GPU test run turns it on with a fresh directory, so that its workers and
#: the examples they start compile each kernel once between them. numba takes a cached kernel
#: as fresh while the file that defines it is unchanged: what the kernel takes from other
#: modules (device functions, constants such as ``limits.MAX_NODES``) and its ``jit`` options
#: are not checked, so after editing the package, empty the directory. The tensor-core kernels
#: are not cached (numba cannot store a kernel that links CUDA C++). A kernel's cache key
#: includes its closure, pickled with the globals of the device functions it holds: none of
#: them may be an object that pickles with an identity of its process (an ``@intrinsic`` made
#: by numba's decorator, a vector class such as ``float32x4``), or no other process would
#: ever load that kernel (``_primitives.intrinsic``; ``tests/test_kernel_cache.py`` checks it).
CACHE_KERNELS: bool = not SIMULATOR and kernel_cache_requested()


@contextlib.contextmanager
def _exclusive(path: str, wait_s: float | None = None):
    """Hold an exclusive ``flock`` on the file ``path`` (made if missing) for the ``with``
    block, across processes; a process that dies releases it with its file. ``wait_s``: how
    long to wait for it, then go on without it (``None``: as long as it takes). On a file
    system without locks, go on without it."""
    import fcntl
    import time

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as lock:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while deadline is None or time.monotonic() < deadline:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:         # another process holds it: wait
                time.sleep(0.05)
            except OSError:                 # a file system without locks: go on without
                break
        yield                               # released when the file closes


def _serialise_cache_saves():
    """numba's cache is not safe for processes that save different compilations of one kernel at
    once: each reads the kernel's index, picks the first free data-file number (both pick 1),
    and writes index and data; the last index and the last data file win, and may belong to
    different compilations, so a later load could get the other one's code. Here a save holds
    an exclusive ``flock`` on ``<index>.lock`` around that read-modify-write, and writes the data
    file before the index that names it. So a load (which takes no lock: both files are
    replaced whole) finds, under a name the index gives, that entry's code."""
    import itertools

    from numba.cuda.core.caching import IndexDataCacheFile

    if getattr(IndexDataCacheFile.save, "_ddtree_locked", False):
        return

    def locked_save(self, key, data):
        with _exclusive(self._index_path + ".lock"):
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:                        # a new entry: the first free number
                taken = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1))
                            if n not in taken)
            self._save_data(name, data)
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

    locked_save._ddtree_locked = True
    IndexDataCacheFile.save = locked_save


#: With the cache on, how long a process waits for another that compiles the same kernel before
#: it compiles the kernel itself (the largest take about two minutes on a loaded host).
COMPILE_WAIT_S = 600.0


def _compiling(folder: str, entry: str):
    """The lock of one cache entry (``folder/compiling-<hash of entry>.lock``), waited for at
    most :data:`COMPILE_WAIT_S` seconds."""
    import hashlib

    name = hashlib.sha256(entry.encode()).hexdigest()[:24]
    return _exclusive(os.path.join(folder, f"compiling-{name}.lock"), COMPILE_WAIT_S)


def _compile_once_across_processes():
    """With the cache on, processes that need the same kernel at the same time would each
    compile it (the GPU test run's workers, ranks started together). The first holds the lock
    of the kernel's cache entry (its function, argument types, closure and target:
    :func:`_compiling`) while it compiles and stores the kernel; the others wait for the lock,
    then load what it stored. One whose compilation fails releases the lock, and the next
    tries for itself."""
    from numba.cuda.dispatcher import CUDADispatcher

    if getattr(CUDADispatcher.compile, "_ddtree_once", False):
        return
    compile_here = CUDADispatcher.compile

    def compile_once(self, sig):
        folder = getattr(self._cache, "cache_path", None)     # None: not cached (NullCache)
        if folder is None or (isinstance(sig, tuple) and sig in self.overloads):
            return compile_here(self, sig)
        entry = repr(self._cache._index_key(sig, self.targetctx.codegen()))
        with _compiling(folder, entry):
            return compile_here(self, sig)  # a load from the cache if another stored it

    compile_once._ddtree_once = True
    CUDADispatcher.compile = compile_once


if CACHE_KERNELS:
    _serialise_cache_saves()
    _compile_once_across_processes()

_stream_stack: list = []


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (132 on the H200); the simulator pretends
    to be an H200, so that launch-shape choices made from it are the GPU's."""
    if SIMULATOR:
        return 132
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def kernel_for_block(threads: int, blocks_per_sm: int = 1, *, cache: bool | None = None):
    """``@cuda.jit`` of a kernel always launched with ``threads`` threads a block, compiled so
    that ``blocks_per_sm`` such blocks fit an SM (``launch_bounds``: at most ``65536 /
    (threads * blocks_per_sm)`` registers a thread, where ptxas would otherwise take more and
    the launch would fail, or fewer blocks would run at once), kept in the on-disk cache when
    ``cache`` (default :data:`CACHE_KERNELS`). The simulator has no registers and no such
    option: plain ``@cuda.jit`` there."""
    if SIMULATOR:
        return cuda.jit
    cache = CACHE_KERNELS if cache is None else cache
    if blocks_per_sm == 1:
        return cuda.jit(launch_bounds=threads, cache=cache)
    return cuda.jit(launch_bounds=(threads, blocks_per_sm), cache=cache)


def as_device(a, *, bf16_as_bits: bool = True):
    """A numba device array viewing ``a`` (copied to the device if ``a`` is a numpy array).

    A bfloat16 *numpy* array comes back as a ``uint16`` device array of the same shape holding
    its bits, or with ``bf16_as_bits=False`` as a bfloat16 device array (what
    ``arrays.storage_kind`` reads as a bfloat16 cache); a torch bfloat16 tensor as ``uint16``.
    Other device arrays are viewed as they are (on a GPU a numba bfloat16 array's view has
    the raw dtype ``V2``): launchers that pass 16-bit values to a kernel take
    ``.view(np.uint16)`` themselves.
    Which conversion applies is decided by :func:`ddtree_numba.arrays.array_source`.
    """
    source = array_source(a)
    if source == "numpy":
        host = np.ascontiguousarray(a)
        if 0 in host.strides and host.size > 0:
            # ``w[None]``: numpy calls an array whose length-1 axis has stride 0 contiguous and
            # keeps it, numba takes a stride-0 axis for a broadcast one. Its device array would
            # then be non-contiguous (layout "A" in every kernel it meets), and numba finds the
            # contiguous core of a broadcast array by visiting every element in Python: about
            # 2 s for a 1M-element weight, at the copy and at every later view of it. A copy
            # has the ordinary strides.
            host = host.copy()
        if host.dtype == BFLOAT16 and (bf16_as_bits or not SIMULATOR):
            # numba copies through the buffer protocol, which has no bfloat16: copy the bits
            bits = cuda.to_device(host.view(np.uint16), stream=launch_stream())
            return bits if bf16_as_bits else bits.view(BFLOAT16)
        return cuda.to_device(host, stream=launch_stream())
    if source == "torch":
        import torch

        if a.dtype == torch.bfloat16:
            return cuda.as_cuda_array(a.view(torch.int16)).view(np.uint16)
        return cuda.as_cuda_array(a)
    if source == "simulator":
        return a
    if source == "cuda":
        return cuda.as_cuda_array(a)
    raise TypeError(f"expected a numpy array or a CUDA device array, got {type(a).__name__}")


def device_empty(shape, dtype):
    """Uninitialised device array on the launch stream (every kernel writes all of its output)."""
    return cuda.device_array(shape, dtype=dtype, stream=launch_stream())


def launch_stream():
    """The stream kernels launch on: the innermost :func:`use_stream`, else the default (0)."""
    return _stream_stack[-1] if _stream_stack else 0


def launch(kernel, griddim, blockdim, stream=None, shared_bytes=0):
    """``kernel[griddim, blockdim, stream, shared_bytes]`` (``stream`` defaults to
    :func:`launch_stream`; ``shared_bytes`` of dynamic shared memory, see
    :func:`allow_dynamic_shared` above 48 KB),
    without numba's ``NumbaPerformanceWarning: Grid size N will likely result in GPU
    under-utilization``: the library's small grids (one block per request, a few per tile) are
    by design, and numba-cuda would warn on every step's launches.

    numba-cuda checks ``config.CUDA_LOW_OCCUPANCY_WARNINGS`` when a launch is configured
    (``_LaunchConfiguration.__init__``), so the flag is off only while this configures the
    library's own kernel; the user's kernels still warn. Not thread-safe (a launch configured
    at the same moment by another thread may miss its warning), cheap: two attribute writes,
    ~0.1 us per launch, where ``warnings.catch_warnings`` costs ~1-2 us and resets every
    module's once-only warning registry.

    Most DDTree stage kernels (``draft_topk``, ``build_tree``'s finish and levels select,
    ``tree_accept``, ``commit_kv``, ``tree_sample``) stride their loops by the block size their
    module names as a constant (``FINISH_THREADS``, ``TOPK_THREADS``, ...), which their
    launchers always use, not by ``cuda.blockDim.x``. (The threshold select and
    ``accept_commit`` keep ``blockDim.x``: with the constant LLVM unrolled their loops into
    more registers than their blocks afford; the levels select, run by the threshold select
    as its fall-back, takes the threshold select's ``blockDim.x`` as its step;
    ``verify_attn``'s merge kernels and the model's dense kernels run one such loop a
    block.) Numba sets up ``range(tid, n, step)`` by computing its trip count, a division by
    ``step``. By a constant that is a shift; by
    ``blockDim.x`` it is a signed division at every loop entry, a call of about 70
    instructions when an operand is 64-bit (a shape). The finish kernel of ``build_tree``
    runs 32 such loops a block: with ``blockDim.x`` they cost it 3.4 of its 12.6 us at
    budget 64 on the H200.
    """
    stream = launch_stream() if stream is None else stream
    saved = getattr(config, "CUDA_LOW_OCCUPANCY_WARNINGS", 0)
    config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    try:
        return kernel[griddim, blockdim, stream, shared_bytes]
    finally:
        config.CUDA_LOW_OCCUPANCY_WARNINGS = saved


def shared_layout(*arrays):
    """Where arrays laid one after another in one dynamic shared block start: ``arrays`` are
    ``(numpy dtype, count)`` pairs, widest type first (so that each array starts aligned to
    its type); returns each one's offset *in elements of its own type*, and the block's bytes.
    A kernel sees the block as one ``cuda.shared.array(0, dtype)`` per type (they all alias
    its first byte) and slices them: ``base[offset:offset + count]``."""
    offsets = []
    end = 0
    for dtype, count in arrays:
        size = np.dtype(dtype).itemsize
        if end % size:
            raise ValueError(f"arrays: a {np.dtype(dtype)} array after a narrower type would "
                             f"start unaligned (byte {end}); list the widest types first")
        offsets.append(end // size)
        end += size * int(count)
    return tuple(offsets), end


STATIC_SHARED_LIMIT = 48 * 1024     # what a launch gets without opting in
_dynamic_shared_allowed: dict = {}  # id(compiled function) -> (function, bytes allowed)


def allow_dynamic_shared(kernel, args, nbytes: int) -> None:
    """Let ``kernel``'s specialisation for ``args`` launch with ``nbytes`` of dynamic shared
    memory (at most the device's ``MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``: 227 KB on the H200,
    99 KB on sm_120).

    Above 48 KB a launch must opt in: the driver attribute
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` of the compiled function. numba-cuda
    does not expose it, so this compiles (or finds) the specialisation the launch will use,
    ``kernel.compile(argument types)``, and sets the attribute on its handle with
    ``cuda.bindings.driver.cuKernelSetAttribute`` (numba-cuda sets its shared-memory
    carve-out the same way). Once per function and size: later calls cost one ``typeof`` of
    each argument. Call it before a CUDA graph is captured (the step's eager warm-up does).
    """
    if nbytes <= STATIC_SHARED_LIMIT or SIMULATOR:
        return
    from cuda.bindings import driver

    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    function = compiled.library.get_cufunc()
    known = _dynamic_shared_allowed.get(id(function))
    if known is not None and known[0] is function and known[1] >= nbytes:
        return
    device = cuda.get_current_device()
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (error,) = driver.cuKernelSetAttribute(attribute, int(nbytes), function.handle, device.id)
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"could not allow {nbytes} bytes of dynamic shared memory for "
                           f"{kernel.__name__} on {device.name}: {error!r}")
    _dynamic_shared_allowed[id(function)] = (function, int(nbytes))


@contextlib.contextmanager
def use_stream(stream):
    """Launch every kernel of this package on ``stream`` inside the ``with`` block.

    ``stream`` is a numba stream, or anything with a CUDA stream handle (``.ptr`` of a CuPy
    stream, ``.cuda_stream`` of a torch stream), wrapped with ``cuda.external_stream``.
    """
    if not SIMULATOR and not isinstance(stream, cuda.cudadrv.driver.Stream):
        handle = getattr(stream, "ptr", None) or getattr(stream, "cuda_stream", None)
        stream = cuda.external_stream(handle)
    _stream_stack.append(stream)
    try:
        yield stream
    finally:
        _stream_stack.pop()


def resolve_variant(variant, *, readable: str, fast: str, anywhere: tuple = (),
                    gpu_only: tuple = ()) -> str:
    """The kernel variant to launch: ``fast`` on a GPU and ``readable`` on the simulator by
    default; asking for ``fast`` on the simulator (no warp intrinsics there) is an error.
    ``anywhere``: other variants, which run on both and are taken only when asked for;
    ``gpu_only``: other variants that, like ``fast``, need a GPU."""
    if variant is None:
        return readable if SIMULATOR else fast
    known = (readable, fast, *gpu_only, *anywhere)
    if variant not in known:
        raise ValueError(f"variant: expected one of {known}, got {variant!r}")
    if SIMULATOR and (variant == fast or variant in gpu_only):
        raise ValueError(f"variant: {variant!r} needs warp intrinsics, which the CUDA "
                         f"simulator lacks; use {readable!r}")
    return variant
