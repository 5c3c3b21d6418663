"""Every example runs standalone (copied alone into an empty folder, as the gallery's downloads
are) on the simulator, says that it matches the reference, and writes no file."""

import os
import shutil

import pytest
from scripts import ROOT, run

EXAMPLES = os.path.join(ROOT, "examples")
SCRIPTS = sorted(f for f in os.listdir(EXAMPLES) if f[:2].isdigit() and f.endswith(".py"))


def test_examples_are_numbered_from_00():
    assert [s[:2] for s in SCRIPTS] == [f"{i:02d}" for i in range(len(SCRIPTS))]


def test_examples_folder_holds_only_examples():
    """No shared helper module: a downloaded example must not need a sibling file."""
    extra = [f for f in os.listdir(EXAMPLES) if f.endswith(".py") and f not in SCRIPTS]
    assert extra == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_standalone_and_checks_itself(script, tmp_path):
    shutil.copy(os.path.join(EXAMPLES, script), tmp_path)
    # the session's backend (conftest: DDTREE_GPU), as a user would pin it
    done = run([script], cwd=tmp_path, timeout=600,
               NUMBA_ENABLE_CUDASIM=os.environ.get("NUMBA_ENABLE_CUDASIM", "1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "matches the reference" in done.stdout
    assert "DIFFERS" not in done.stdout
    assert sorted(os.listdir(tmp_path)) == [script]          # wrote nothing where it ran
    if script.startswith("06"):
        assert "speculative output == plain greedy decoding: matches the reference" in done.stdout
