"""Warp intrinsics for numba's CUDA simulator, which has none (tests only).

Inside ``with emulated_shuffles():`` a simulated kernel can call ``cuda.shfl_sync``,
``cuda.shfl_xor_sync``, ``cuda.shfl_up_sync``, ``cuda.ballot_sync`` and ``cuda.syncwarp``,
and :func:`warp_max_u32` stands in for the ``redux.sync`` of ``kernels._primitives``, so that
kernels written for the GPU's warps (the build_tree warp select, the warp-shuffle scan and sort)
run in CI too, not only on a GPU.

The simulator runs every CUDA thread of a block as a Python thread. A shuffle here is an
exchange among the lanes of one warp (32 consecutive thread ids): each lane writes its value to
its warp's slot array, waits for the warp's other lanes (a ``threading.Barrier``), reads the
slot of its source lane, and waits again so that no lane overwrites a slot before all have read
it. As on the GPU with a full mask:

* ``shfl_sync(mask, value, src)``: the value of lane ``src``;
* ``shfl_xor_sync(mask, value, delta)``: the value of lane ``lane ^ delta``;
* ``shfl_up_sync(mask, value, delta)``: the value of lane ``lane - delta``, or the lane's own
  value where ``lane < delta``;
* ``ballot_sync(mask, predicate)``: bit ``i`` set where lane ``i``'s predicate holds;
  ``syncwarp(mask)``: the exchange's barriers alone; ``warp_max_u32(value)``: the largest value
  of the warp, to every lane;
* every lane of the warp must take part. A lane that skipped one would leave the others
  waiting; the barrier's timeout then fails the test rather than hanging it.
"""

from __future__ import annotations

import contextlib
import importlib
import threading

import numpy as np

WARP = 32
TIMEOUT_S = 120

_lock = threading.Lock()


def _exchange(value, source_lane):
    """``value`` of lane ``source_lane(lane)`` (the lane's own where that is out of range)."""
    return _gather(value, lambda slots, lane, lanes: slots[source_lane(lane)]
                   if 0 <= source_lane(lane) < lanes else value)


def _gather(value, pick):
    """Every lane writes ``value``; each gets ``pick(slots, lane, lanes)`` of the warp's."""
    thread = threading.current_thread()
    manager = thread._manager               # the simulator's runner of this block (one a block)
    dims = manager._block_dim
    threads = dims[0] * dims[1] * dims[2]
    warp, lane = divmod(thread.thread_id, WARP)
    lanes = min(WARP, threads - warp * WARP)                    # a last warp may be partial
    with _lock:                             # the block's warps: warp -> (slots, barrier)
        warps = manager.__dict__.setdefault("_emulated_warps", {})
        if warp not in warps:
            warps[warp] = ([None] * lanes, threading.Barrier(lanes, timeout=TIMEOUT_S))
        slots, barrier = warps[warp]
    slots[lane] = value
    barrier.wait()                                              # every lane's value written
    result = pick(slots, lane, lanes)
    barrier.wait()                                              # every lane read the slots
    return result


def _shfl_sync(self, mask, value, src):
    return _exchange(value, lambda lane: src)


def _ballot_sync(self, mask, predicate):
    return np.uint32(_gather(bool(predicate), lambda slots, lane, lanes: sum(
        1 << i for i in range(lanes) if slots[i])))


def _syncwarp(self, mask=0xFFFFFFFF):
    _gather(None, lambda slots, lane, lanes: None)


def warp_max_u32(value):
    """The warp's largest uint32, to every lane (``redux.sync.max.u32``)."""
    return np.uint32(_gather(int(value), lambda slots, lane, lanes: max(slots[:lanes])))


def _shfl_xor_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane ^ delta)


def _shfl_up_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane - delta if lane >= delta else lane)


@contextlib.contextmanager
def emulated_shuffles():
    """Give the simulator's ``cuda`` module the warp intrinsics for the ``with`` block."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    added = {"shfl_sync": _shfl_sync, "shfl_xor_sync": _shfl_xor_sync,
             "shfl_up_sync": _shfl_up_sync, "ballot_sync": _ballot_sync, "syncwarp": _syncwarp}
    for name, function in added.items():
        setattr(FakeCUDAModule, name, function)
    try:
        yield
    finally:
        for name in added:
            delattr(FakeCUDAModule, name)


def take_gpu_variant(monkeypatch, module_name: str) -> None:
    """Where ``module_name`` has a launcher, let it launch the GPU variant asked for on the
    simulator (its ``resolve_variant`` refuses it there) and, where the module uses the
    ``redux.sync`` max, use the emulated one. Together with :func:`emulated_shuffles`."""
    module = importlib.import_module(module_name)           # the module, not a same-named name
    if hasattr(module, "resolve_variant"):
        monkeypatch.setattr(module, "resolve_variant", lambda variant, **_: variant)
    if hasattr(module, "warp_max_u32"):
        monkeypatch.setattr(module, "warp_max_u32", warp_max_u32)

