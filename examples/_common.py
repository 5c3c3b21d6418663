"""Shared set-up for the examples: pick the GPU or the simulator before numba is imported,
and choose sizes to match (tiny on the simulator, realistic on a GPU)."""

from __future__ import annotations

from ddtree_numba._platform import choose_backend

BACKEND = choose_backend()
ON_GPU = BACKEND == "gpu"


def pick(simulator, gpu):
    """``gpu`` on a GPU, ``simulator`` on the CUDA simulator."""
    return gpu if ON_GPU else simulator


def report(name: str, ok: bool) -> None:
    print(f"{name}: {'matches the reference' if ok else 'DIFFERS FROM THE REFERENCE'}")
    if not ok:
        raise SystemExit(1)
