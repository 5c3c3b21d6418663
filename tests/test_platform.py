"""``import ddtree_numba`` chooses numba's CUDA target by itself (in a fresh interpreter each)."""

import pytest
from scripts import run

from ddtree_numba._platform import SIMULATOR_NOTICE, gpu_present

PROBE = "import ddtree_numba.kernels as K; print('simulator' if K.SIMULATOR else 'gpu')"


def python(code, **env):
    done = run(["-c", code], **env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


@pytest.mark.skipif(gpu_present(), reason="checks the no-GPU fall-back")
def test_no_gpu_falls_back_to_the_simulator_and_says_so_once():
    out, err = python(PROBE + "; import ddtree_numba.step, ddtree_numba.models.dense_ops")
    assert out == "simulator"
    assert err.count(SIMULATOR_NOTICE) == 1 and err.strip() == SIMULATOR_NOTICE


def test_explicit_choice_is_silent():
    assert python(PROBE, DDTREE_BACKEND="simulator") == ("simulator", "")
    assert python(PROBE, NUMBA_ENABLE_CUDASIM="1") == ("simulator", "")   # conftest's way


def test_numba_switch_wins_over_a_conflicting_ddtree_backend():
    out, err = python(PROBE, NUMBA_ENABLE_CUDASIM="1", DDTREE_BACKEND="gpu")
    assert out == "simulator"
    assert "BackendWarning" in err and "NUMBA_ENABLE_CUDASIM=1" in err


def test_unknown_ddtree_backend_warns_and_chooses_automatically():
    out, err = python(PROBE, DDTREE_BACKEND="cpu")
    assert "BackendWarning: DDTREE_BACKEND: expected one of gpu, simulator, auto, got 'cpu'" in err
    assert out == ("gpu" if gpu_present() else "simulator")


@pytest.mark.skipif(gpu_present(), reason="checks the no-GPU case")
def test_numba_cuda_imported_first_without_a_gpu_is_a_clear_warning():
    out, err = python("import numba.cuda\n" + PROBE)
    assert out == "gpu"          # numba's choice stands; the warning says what will happen
    assert "BackendWarning" in err and "no CUDA GPU was found" in err
    assert "Import ddtree_numba before numba" in err


def test_numba_cuda_imported_first_with_a_conflicting_request_warns():
    out, err = python("import numba.cuda\n" + PROBE, NUMBA_ENABLE_CUDASIM="1",
                      DDTREE_BACKEND="gpu")
    assert out == "simulator"
    assert "DDTREE_BACKEND=gpu has no effect: numba.cuda was imported before" in err


def test_numba_core_imported_first_still_follows_the_choice():
    """numba itself (not numba.cuda) imported first: numba-cuda's config still reads the env."""
    out, _ = python("import numba\n" + PROBE, DDTREE_BACKEND="simulator")
    assert out == "simulator"
