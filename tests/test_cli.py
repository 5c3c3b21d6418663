"""The command line as a new user meets it: every error is one line naming the option, exit
status 2, before any work; ``--version``; the demo and the fixtures write only where told."""

import json
import os

import pytest
from scripts import run

from ddtree_numba import __main__ as cli
from ddtree_numba import __version__
from ddtree_numba.limits import MAX_BUDGET, MAX_K

BAD = [
    (["demo", "--bs", "-1"], "--bs: expected an int in [1, 65535], got -1"),
    (["demo", "--bs", "0"], "--bs: expected an int in [1, 65535], got 0"),
    (["demo", "--steps", "0"], "--steps: expected an int in [1, "),
    (["demo", "--depth", "0"], "--depth: expected an int in [1, 64], got 0"),
    (["demo", "--topk", "0"], f"--topk: expected an int in [1, {MAX_K}], got 0"),
    (["demo", "--topk", "100000"], f"--topk: expected an int in [1, {MAX_K}], got 100000"),
    (["demo", "--budget", "5000"], f"--budget: expected an int in [0, {MAX_BUDGET}], got 5000"),
    (["demo", "--accuracy", "1.5"], "--accuracy: expected a probability in [0, 1], got 1.5"),
    (["demo", "--seed", "-1"], "--seed: expected an int in [0, 4294967295], got -1"),
    (["demo", "--bs", "two"], "--bs: expected an int in [1, 65535], got two"),
    (["demo", "--plot", "/missing/dir/x.png"], "--plot: cannot write /missing/dir/x.png: "
                                               "folder /missing/dir does not exist"),
    (["demo", "--plot", "tree.jpg"], "--plot: expected a file name ending in .png, .svg, .pdf"),
    (["demo", "--temperature", "-1"], "--temperature: expected a finite number >= 0, got -1"),
    (["demo", "--temperature", "inf"], "--temperature: expected a finite number >= 0, got inf"),
    (["demo", "--top-p", "0"], "--top-p: expected a number in (0, 1], got 0"),
    (["demo", "--top-k", "-1"], "--top-k: expected an int in [0, 262144], got -1"),
    (["demo", "--temperature", "1", "--plot", "t.png"], "--plot: the tree plot is drawn by the "
                                                        "greedy demo"),
    (["demo", "--top-p", "0.9"], "--top-p: applies when sampling; add --temperature T > 0"),
    (["demo", "--top-k", "5"], "--top-k: applies when sampling; add --temperature T > 0"),
    (["fixtures", "out", "--cases", "-1"], "--cases: expected an int in [1, 1000], got -1"),
    (["fixtures", "out", "--seed", "-1"], "--seed: expected an int in [0, 4294967295], got -1"),
    (["build-report", "--json", "--markdown"], "--markdown: not allowed with argument --json"),
    (["build-report", "--cc", "7.5"], "--cc: expected one of 12.0, 9.0, 8.9, 8.0, got 7.5"),
    (["demo", "--model", "missing"], "--model: expected a checkpoint folder (config.json and "
                                     "safetensors files; make-model writes one), got 'missing'"),
    (["demo", "--cache", "bfloat16"], "--cache: applies to --model"),
    (["demo", "--cache", "int8"], "--cache: invalid choice: 'int8' (choose from 'float32', "
                                  "'bfloat16')"),
    (["make-model", "out", "--preset", "huge"], "--preset: invalid choice: 'huge'"),
    (["make-model", "out", "--shards", "0"], "--shards: expected an int in [1, 99], got 0"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_option_is_one_line_exit_2(args, message, tmp_path):
    done = run(["-m", "ddtree_numba", *args], cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr            # one line, no usage block
    assert done.stderr.startswith(f"python -m ddtree_numba {args[0]}: error: {message}"), \
        done.stderr
    assert done.stdout == ""
    assert os.listdir(tmp_path) == []                            # nothing written


CHECK_BEFORE_NUMBA = """
import sys
from ddtree_numba.__main__ import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print(code, 'numba' in sys.modules)
"""


@pytest.mark.parametrize("args", [["demo", "--budget", "5000"], ["demo", "--topk", "65"],
                                  ["demo", "--plot", "/missing/x.png"],
                                  ["fixtures", "--cases", "0", "out"]])
def test_options_are_checked_before_numba_is_imported(args):
    done = run(["-c", CHECK_BEFORE_NUMBA, *args], DDTREE_BACKEND="simulator")
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr


def test_topk_above_the_demos_vocabulary_is_refused_before_running():
    done = run(["-m", "ddtree_numba", "demo", "--topk", "65"], DDTREE_BACKEND="simulator")
    assert done.returncode == 2
    assert done.stderr.strip() == ("python -m ddtree_numba demo: error: --topk: expected an int "
                                   "in [1, 64] (the demo's vocabulary on the simulator is 64), "
                                   "got 65")


def test_version():
    done = run(["-m", "ddtree_numba", "--version"])
    assert (done.returncode, done.stdout) == (0, f"ddtree_numba {__version__}\n")
    assert __version__ == "0.1.0"


def test_an_unexpected_error_is_one_line_and_traceback_shows_it(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("numba said\nsomething long")

    monkeypatch.setitem(cli.COMMANDS, "demo", broken)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err == ("python -m ddtree_numba demo: error: RuntimeError: numba said something "
                   "long (--traceback shows where)\n")
    with pytest.raises(RuntimeError):
        cli.main(["--traceback", "demo"])
    monkeypatch.setenv("DDTREE_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        cli.main(["demo"])


def test_run_demo_refuses_zero_instead_of_running_the_defaults():
    from ddtree_numba.step.demo import run_demo

    for name in ("bs", "steps", "L", "k"):
        with pytest.raises(ValueError):
            run_demo(**{name: 0}, out=lambda *_: None)


def test_demo_runs_and_writes_only_the_plot(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    plot = tmp_path / "tree.svg"
    # the simulator even on a GPU machine: the GPU demo is tested in test_greedy_step, and its
    # GPU sizes would cost a minute of compiling here
    done = run(["-m", "ddtree_numba", "demo", "--bs", "1", "--steps", "2", "--plot", str(plot)],
               cwd=work, DDTREE_BACKEND="simulator")
    assert done.returncode == 0, done.stderr
    assert "output == plain greedy decoding: True" in done.stdout
    assert plot.stat().st_size > 1000
    assert os.listdir(work) == []


# --- make-model and demo --model ---------------------------------------------------------
def test_make_model_then_demo_model_decodes_it_losslessly(tmp_path):
    """The first hour with a DeepSeek-V3 checkpoint: write a tiny random one, decode it; the
    progress bars go to stderr, one finished line each (not a terminal)."""
    model = tmp_path / "model"
    done = run(["-m", "ddtree_numba", "make-model", str(model), "--shards", "3"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote a random tiny deepseek_v3 checkpoint to {model}: "
                                  f"91 tensors in 3 shards")
    assert done.stderr.strip().splitlines()[-1] == "writing tensors [####################] 91/91"
    done = run(["-m", "ddtree_numba", "demo", "--model", str(model), "--steps", "2",
                "--cache", "bfloat16"], DDTREE_BACKEND="simulator")
    assert done.returncode == 0, done.stderr
    assert "output == the reference's plain greedy decoding: True" in done.stdout
    assert "bfloat16 cache" in done.stdout
    bars = [line.split(" [")[0] for line in done.stderr.splitlines() if " [" in line]
    assert bars == ["loading weights", "reference greedy decoding", "decoding"]
    again = run(["-m", "ddtree_numba", "make-model", str(model)])      # nothing overwritten
    assert again.returncode == 2
    assert again.stderr.count("\n") == 1 and "already holds a checkpoint" in again.stderr


@pytest.mark.parametrize("option", [["--temperature", "1"], ["--plot", "t.png"]])
def test_demo_model_refuses_what_it_does_not_do(tmp_path, option):
    from ddtree_numba.models.deepseek_v3.make_model import make_model

    make_model(str(tmp_path / "m"))
    done = run(["-m", "ddtree_numba", "demo", "--model", str(tmp_path / "m"), *option],
               cwd=tmp_path, DDTREE_BACKEND="simulator")
    assert done.returncode == 2
    assert done.stderr.startswith(f"python -m ddtree_numba demo: error: {option[0]}: the "
                                  f"--model demo decodes greedily"), done.stderr
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_demo_model_topk_above_the_models_vocabulary(tmp_path):
    from ddtree_numba.models.deepseek_v3.make_model import make_model

    make_model(str(tmp_path / "m"))
    done = run(["-m", "ddtree_numba", "demo", "--model", str(tmp_path / "m"), "--topk", "300"],
               DDTREE_BACKEND="simulator")
    assert done.returncode == 2
    assert "--topk: expected an int in [1, 256] (the model's vocabulary is 256), got 300" in \
        done.stderr


# --- fixtures ---------------------------------------------------------------------------

def test_fixtures_into_a_file_is_one_line(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    done = run(["-m", "ddtree_numba", "fixtures", str(target)])
    assert done.returncode == 2
    assert done.stderr == (f"python -m ddtree_numba fixtures: error: outdir: {target} exists "
                           "and is not a folder\n")


def test_fixtures_into_a_missing_parent_is_one_line(tmp_path):
    done = run(["-m", "ddtree_numba", "fixtures", str(tmp_path / "no" / "such")])
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "does not exist" in done.stderr


def test_fixtures_rewrite_leaves_no_stale_file_and_keeps_other_files(tmp_path):
    from ddtree_numba.fixtures import write_fixtures

    out = tmp_path / "fx"
    write_fixtures(out, cases=2)
    (out / "README.txt").write_text("mine")
    manifest = write_fixtures(out, cases=1)
    listed = {entry["file"] for entry in manifest["files"]}
    assert all(name.endswith("_0.kdtr") for name in listed)
    assert set(os.listdir(out)) == listed | {"manifest.json", "README.txt"}
    assert json.loads((out / "manifest.json").read_text())["files"] == manifest["files"]


def test_fixtures_refuse_kdtr_files_no_manifest_lists(tmp_path):
    out = tmp_path / "fx"
    out.mkdir()
    (out / "someone_elses.kdtr").write_bytes(b"KDTR")
    done = run(["-m", "ddtree_numba", "fixtures", str(out)])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "holds .kdtr files that no manifest.json lists (someone_elses.kdtr)" in done.stderr
    assert os.listdir(out) == ["someone_elses.kdtr"]


def test_fixtures_command_writes_and_reports(tmp_path):
    done = run(["-m", "ddtree_numba", "fixtures", str(tmp_path / "fx")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote 7 fixtures and manifest.json to ")


# --- build-report -----------------------------------------------------------------------

PROBLEM_ROWS = [
    {"cc": "9.0", "stage": "verify_attn", "variant": "tiled float32", "fast": True,
     "threads": 256, "registers": 255, "shared": 9216, "problems": ["spills 8 B stores / 8 B "
                                                                     "loads"]},
    {"cc": "9.0", "stage": "build_tree", "variant": "finish", "fast": True, "threads": 128,
     "registers": 40, "shared": 0, "problems": []},
]


def test_strict_report_names_each_problem_row_on_stderr(monkeypatch, capsys):
    from ddtree_numba import build_report

    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")        # the command sets it; restore it
    monkeypatch.setattr(build_report, "build_report", lambda ccs, progress=None: PROBLEM_ROWS)
    monkeypatch.setattr(build_report, "toolchain", lambda: "nvJitLink 13.5")
    assert cli.main(["build-report", "--cc", "9.0", "--json", "--strict"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == PROBLEM_ROWS                  # stdout stays clean JSON
    assert err.splitlines() == [
        "python -m ddtree_numba build-report: problem: cc 9.0, stage verify_attn, variant "
        "tiled float32 (fast path): spills 8 B stores / 8 B loads [255 registers, 256 threads, "
        "9216 B smem]",
        "python -m ddtree_numba build-report: 1 problem(s) (--strict), compiled with "
        "nvJitLink 13.5: exit status 1"]
    assert cli.main(["build-report", "--cc", "9.0"]) == 0   # not strict: a table, exit 0
    assert "problems: 1\n  cc 9.0, stage verify_attn" in capsys.readouterr().out
