"""Every example runs clean on the simulator and says that it matches the reference."""

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
SCRIPTS = sorted(f for f in os.listdir(EXAMPLES) if f[:2].isdigit() and f.endswith(".py"))


def test_examples_are_numbered_from_00():
    assert [s[:2] for s in SCRIPTS] == [f"{i:02d}" for i in range(len(SCRIPTS))]


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_and_checks_itself(script, tmp_path):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": os.environ.get("NUMBA_ENABLE_CUDASIM", "1"),
           "DDTREE_EXAMPLE_OUT": str(tmp_path), "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, script], cwd=EXAMPLES, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "matches the reference" in done.stdout
    assert "DIFFERS" not in done.stdout
    if script.startswith("02"):
        assert (tmp_path / "tree.png").stat().st_size > 10_000
    if script.startswith("06"):
        assert (tmp_path / "accepted_path.png").stat().st_size > 10_000
        assert "speculative output == plain greedy decoding: matches the reference" in done.stdout
