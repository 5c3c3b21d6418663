"""Running the package as a user would: a fresh interpreter, a clean environment."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWITCHES = ("NUMBA_ENABLE_CUDASIM", "DDTREE_BACKEND", "DDTREE_GPU", "DDTREE_TRACEBACK")


def clean_env(**extra) -> dict:
    """The caller's environment without any backend switch (``import ddtree_numba`` chooses),
    this checkout first on the path, matplotlib headless; then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    env["MPLBACKEND"] = "Agg"
    return {**env, **extra}


def run(args, *, cwd=None, timeout=300, **env) -> subprocess.CompletedProcess:
    """``python ARGS...`` in a fresh interpreter with :func:`clean_env` (``env`` added)."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def run_real_target(args, *, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """:func:`run` on numba's real CUDA target even where CI has no GPU
    (``NUMBA_ENABLE_CUDASIM=0``): compiling PTX and linking for an ``sm_XY`` needs no device."""
    return run(args, cwd=cwd, timeout=timeout, NUMBA_ENABLE_CUDASIM="0")
