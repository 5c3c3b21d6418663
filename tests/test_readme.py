"""The README's Python snippets run as written, as plain scripts, on a machine without a GPU.

Each ```python block is written to a file and run in a fresh interpreter from an empty folder,
with no ``NUMBA_ENABLE_CUDASIM`` / ``DDTREE_BACKEND`` in the environment: ``import ddtree_numba``
must pick the backend itself (the simulator here) and say so once on stderr.
"""

import os
import re

import pytest
from scripts import ROOT, run

from ddtree_numba._platform import SIMULATOR_NOTICE, gpu_present

with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    SNIPPETS = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)


def test_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_a_plain_script(index, tmp_path):
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(SNIPPETS[index])
    # on a GPU machine the snippets run on the simulator too (what they promise is the CPU
    # path; compiling them for the GPU in a fresh process each would cost a minute)
    switch = {"DDTREE_BACKEND": "simulator"} if gpu_present() else {}
    done = run([str(script)], cwd=tmp_path, **switch)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    if not gpu_present():
        assert done.stderr.count(SIMULATOR_NOTICE) == 1, done.stderr
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [script.name]   # wrote nothing


def test_no_file_points_to_a_design_document_users_do_not_have():
    """The buffer contract lives in the docs (docs/contracts.md); no design file is shipped."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_build", "auto_examples"))
                   and d != "__pycache__"]
        for name in files:
            if name.endswith((".py", ".md", ".rst", ".toml", ".txt", ".h", ".sh", ".cfg")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    if "DESIGN" + ".md" in f.read():
                        found.append(os.path.relpath(path, ROOT))
    assert found == []
