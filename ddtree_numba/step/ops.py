"""The step's own small device operations: the argmax of the target's logits and the
bookkeeping that advances every request after a step, each as a numba.cuda kernel and a numpy
twin that does the same arithmetic in place.

:class:`KernelStepOps` launches the kernels on the current stream (every output preallocated,
so a whole step can be captured in a CUDA graph); :class:`HostStepOps` works on numpy arrays
and on the CUDA simulator's device arrays, in place (the simulator runs one Python thread per
CUDA thread, which makes even these small launches slow; the end-to-end tests and the demo on
the simulator use the twins here and the real kernels for every DDTree stage).
``default_step_ops()`` picks one; ``tests/test_ops.py`` checks each kernel against its twin.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32

from ..arrays import host_view
from ..kernels._device import CACHE_KERNELS, SIMULATOR, launch, launch_stream
from ..reference.greedy_step import argmax_per_node

# argmax: threads per block, one block per row of logits. A row is a whole vocabulary (163 840
# columns for Kimi-K2 and Moonlight), and at bs 1 a step has fewer rows than the GPU has SMs:
# the whole block's loads in flight are what bound it (128 threads took 152 us for 65 rows of
# 163 840 on the H200, 40 MB). The simulator runs a Python thread per CUDA thread: fewer there.
ROW_THREADS = 128 if SIMULATOR else 1024
ADVANCE_THREADS = 32


@cuda.jit(cache=CACHE_KERNELS)
def _argmax_kernel(logits, num_nodes, predict):
    """``predict[b, j] = argmax(logits[b N + j])`` (first index on ties), ``-1`` on padding.

    One block per row: each thread scans columns ``tid, tid + ROW_THREADS, ...`` keeping its
    first maximum, then a tree reduction in shared memory keeps the larger value, and on equal
    values the smaller index.
    """
    t, tid = cuda.blockIdx.x, cuda.threadIdx.x
    n_cap = predict.shape[1]
    b, j = t // n_cap, t % n_cap
    if j >= num_nodes[b]:
        if tid == 0:
            predict[b, j] = -1
        return                      # uniform per block: no barrier is skipped by half a block
    best_value = cuda.shared.array(ROW_THREADS, float32)
    best_index = cuda.shared.array(ROW_THREADS, int32)
    value, index = float32(-math.inf), int32(-1)
    for col in range(tid, logits.shape[1], ROW_THREADS):
        if logits[t, col] > value or index < 0:
            value, index = logits[t, col], int32(col)
    best_value[tid], best_index[tid] = value, index
    cuda.syncthreads()              # every thread's candidate is in shared memory
    stride = ROW_THREADS // 2
    while stride > 0:
        if tid < stride:
            other_v, other_i = best_value[tid + stride], best_index[tid + stride]
            if other_i >= 0 and (other_v > best_value[tid] or (
                    other_v == best_value[tid] and other_i < best_index[tid])):
                best_value[tid], best_index[tid] = other_v, other_i
        cuda.syncthreads()          # this level is complete before the next reads it
        stride //= 2
    if tid == 0:
        predict[b, j] = best_index[0]


@cuda.jit(cache=CACHE_KERNELS)
def _advance_kernel(accept_tokens, accept_len, bonus_token, new_prefix_lens, prefix_lens,
                    root_token_ids, emitted, emitted_count):
    """After a step, per request ``b`` (one thread each): append the ``k + 1`` committed tokens
    to ``emitted[b]``, then make the committed lengths and the bonus token the next step's
    ``prefix_lens`` and root. (``commit_kv`` writes ``new_prefix_lens`` to a buffer of its own:
    its threads read ``prefix_lens`` while others would be writing it.)"""
    b = cuda.grid(1)
    if b >= prefix_lens.shape[0]:
        return
    base, k = emitted_count[b], accept_len[b]
    for i in range(k + 1):
        emitted[b, base + i] = accept_tokens[b, i]
    emitted_count[b] = base + k + 1
    prefix_lens[b] = new_prefix_lens[b]
    root_token_ids[b] = bonus_token[b]


class KernelStepOps:
    """argmax and advance as numba.cuda launches on the current stream (no allocation)."""

    name = "kernels"

    def argmax(self, logits, num_nodes, predict):
        """``predict[b, j] = argmax(logits[b N + j])`` (smallest index on ties), ``-1`` on
        padding rows ``j >= num_nodes[b]``."""
        launch(_argmax_kernel, logits.shape[0], ROW_THREADS, launch_stream())(logits, num_nodes,
                                                                     predict)

    def advance(self, accept, new_prefix_lens, prefix_lens, root_token_ids, emitted,
                emitted_count):
        """Append each request's committed tokens to ``emitted``; make ``new_prefix_lens`` and
        the bonus tokens the next step's ``prefix_lens`` and roots."""
        bs = prefix_lens.shape[0]
        launch(_advance_kernel, math.ceil(bs / ADVANCE_THREADS), ADVANCE_THREADS, launch_stream())(
            accept.accept_tokens, accept.accept_len, accept.bonus_token, new_prefix_lens,
            prefix_lens, root_token_ids, emitted, emitted_count)


class HostStepOps:
    """The same two operations in numpy, in place (the twins the kernels are tested
    against)."""

    name = "numpy"

    def argmax(self, logits, num_nodes, predict):
        host_view(predict)[:] = argmax_per_node(host_view(logits), host_view(num_nodes))

    def advance(self, accept, new_prefix_lens, prefix_lens, root_token_ids, emitted,
                emitted_count):
        tokens, k = host_view(accept.accept_tokens), host_view(accept.accept_len)
        out, count = host_view(emitted), host_view(emitted_count)
        for b in range(len(k)):
            out[b, count[b]: count[b] + k[b] + 1] = tokens[b, : k[b] + 1]
        count += k + 1
        host_view(prefix_lens)[:] = host_view(new_prefix_lens)
        host_view(root_token_ids)[:] = host_view(accept.bonus_token)


def default_step_ops():
    """:class:`HostStepOps` on the simulator, :class:`KernelStepOps` on a GPU."""
    return HostStepOps() if SIMULATOR else KernelStepOps()


def build_specs():
    """Specialisations of the step's kernels (for the build report)."""
    from numba import types

    from ..kernels._specs import KernelSpec

    i1, i2, f2 = types.int32[::1], types.int32[:, ::1], types.float32[:, ::1]
    return [
        KernelSpec("step", "argmax", _argmax_kernel, (f2, i1, i2), ROW_THREADS, True),
        KernelSpec("step", "advance", _advance_kernel, (i2, i1, i1, i1, i1, i1, i2, i1),
                   ADVANCE_THREADS, True),
    ]
