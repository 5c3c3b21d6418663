"""Command line: ``python -m ddtree_numba demo`` (the main job; ``--model DIR`` for a
DeepSeek-V3-architecture checkpoint), ``info``, ``build-report``, ``make-model``, ``fixtures``.

Every error is one line on stderr, ``python -m ddtree_numba COMMAND: error: ...``, with exit
status 2: option values are checked by argparse (bounds from :mod:`ddtree_numba.limits`) before
anything runs, output paths before any work, and any other exception escaping a command is
reported the same way. ``--traceback`` (or ``DDTREE_TRACEBACK=1``) shows the full traceback
instead, for developers.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from ._cli import Parser
from ._platform import choose_backend, collect_less_often
from .limits import MAX_BATCH, MAX_BUDGET, MAX_DEPTH, MAX_K, MAX_VOCAB

PROG = "python -m ddtree_numba"
MAX_SEED = 2**32 - 1
MAX_STEPS = 100_000
MAX_CASES = 1000
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


class CommandError(Exception):
    """A problem with what the user asked for: reported as one line, exit status 2."""


def int_in(low: int, high: int):
    """argparse ``type=``: an int in ``[low, high]``."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an int in [{low}, {high}], got {text}")
        return value
    return parse


def float_in(accepts, expected: str):
    """argparse ``type=``: a float for which ``accepts(value)`` holds, else the error
    ``expected <expected>, got <text>``."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value
    return parse


probability = float_in(lambda v: 0.0 <= v <= 1.0, "a probability in [0, 1]")
non_negative = float_in(lambda v: 0.0 <= v < float("inf"), "a finite number >= 0")
top_p_value = float_in(lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")


def output_file(suffixes):
    """argparse ``type=``: a path with one of ``suffixes`` in an existing, writable folder."""
    def parse(text):
        path = os.path.abspath(os.path.expanduser(text))
        if not path.lower().endswith(suffixes):
            raise argparse.ArgumentTypeError(
                f"expected a file name ending in {', '.join(suffixes)}, got {text}")
        _check_writable_parent(path, text)
        if os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"{text} is a folder, expected a file name")
        return text
    return parse


def output_dir(text):
    """argparse ``type=``: a folder (existing or to be created) in a writable parent."""
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write into {text} (permission denied)")
    else:
        _check_writable_parent(path, text)
    return text


def _check_writable_parent(path, text):
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: folder {parent} is not "
                                         "writable")


def _info() -> int:
    backend = choose_backend()
    import numba
    import numpy as np
    from numba import cuda

    print(f"ddtree_numba {__version__}, backend: {backend}")
    print(f"numba {numba.__version__}, numba-cuda "
          f"{getattr(cuda, '__version__', None) or _dist_version('numba-cuda')}, "
          f"numpy {np.__version__}")
    if backend == "gpu":
        dev = cuda.get_current_device()
        print(f"GPU: {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, "
              f"compute capability {dev.compute_capability}")
    else:
        print("no GPU used: kernels run on numba's CUDA simulator (tiny sizes, slow)")
    return 0


def _build_report(args) -> int:
    import json

    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"      # compile for real; no GPU is needed for it
    from .build_report import (
        build_report,
        format_problems,
        format_side_by_side,
        format_table,
        toolchain,
    )

    tty = sys.stderr.isatty()

    def progress(done, total, cc, spec):     # on stderr: stdout stays clean for --json
        line = f"compiled {done}/{total}: {spec.stage}.{spec.variant} for sm_{cc[0]}{cc[1]}"
        if tty:                               # one line, rewritten in place
            print(f"\r{line}\033[K", end="\n" if done == total else "", file=sys.stderr,
                  flush=True)
        else:                                 # a log: one line per kernel
            print(line, file=sys.stderr, flush=True)

    rows = build_report(args.cc or [(12, 0)], progress=progress)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_side_by_side(rows) if args.markdown else format_table(rows))
    problems = format_problems(rows)
    if args.strict and problems:
        for line in problems:
            print(f"{PROG} build-report: problem: {line}", file=sys.stderr)
        print(f"{PROG} build-report: {len(problems)} problem(s) (--strict), compiled with "
              f"{toolchain()}: exit status 1", file=sys.stderr)
        return 1
    return 0


def _demo(args) -> int:
    if args.model is not None:
        return _model_demo(args)
    if args.cache is not None:
        raise CommandError("--cache: applies to --model (the toy demo's cache is float32)")
    if args.temperature > 0 and args.plot:
        raise CommandError("--plot: the tree plot is drawn by the greedy demo; leave out "
                           "--temperature (or set it to 0)")
    if args.temperature == 0 and (args.top_k != 0 or args.top_p != 1.0):
        option = "--top-k" if args.top_k != 0 else "--top-p"
        raise CommandError(f"{option}: applies when sampling; add --temperature T > 0")
    from .models.toy_mla import ToyMLAConfig

    backend = choose_backend()
    vocab = (ToyMLAConfig.tiny() if backend == "simulator" else ToyMLAConfig.gpu()).vocab
    if args.topk is not None and args.topk > min(MAX_K, vocab):
        raise CommandError(f"--topk: expected an int in [1, {min(MAX_K, vocab)}] (the demo's "
                           f"vocabulary on the {backend} is {vocab}), got {args.topk}")
    from .step.demo import run_demo

    print(f"ddtree_numba demo on the {backend}\n")
    run_demo(bs=args.bs, steps=args.steps, L=args.depth, k=args.topk, budget=args.budget,
             accuracy=args.accuracy, seed=args.seed, plot=args.plot,
             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return 0


def _model_demo(args) -> int:
    for option, value, default in (("--temperature", args.temperature, 0.0),
                                   ("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0),
                                   ("--plot", args.plot, None)):
        if value != default:
            raise CommandError(f"{option}: the --model demo decodes greedily and draws no "
                               f"plot; leave out {option}")
    from .models.deepseek_v3 import DeepseekV3Config

    if not os.path.isdir(args.model):
        raise CommandError(f"--model: expected a checkpoint folder (config.json and safetensors "
                           f"files; make-model writes one), got {args.model!r}")
    try:
        config = DeepseekV3Config.from_json(args.model)
    except (ValueError, OSError) as error:
        raise CommandError(f"--model: {error}") from None
    if args.topk is not None and args.topk > min(MAX_K, config.vocab_size):
        raise CommandError(f"--topk: expected an int in [1, {min(MAX_K, config.vocab_size)}] "
                           f"(the model's vocabulary is {config.vocab_size}), got {args.topk}")
    backend = choose_backend()
    from .step.demo import run_model_demo

    print(f"ddtree_numba demo on the {backend}\n")
    run_model_demo(args.model, bs=args.bs, steps=args.steps, L=args.depth, k=args.topk,
                   budget=args.budget, accuracy=args.accuracy, seed=args.seed,
                   cache_dtype=args.cache or "float32")
    return 0


def _make_model(args) -> int:
    from .models.deepseek_v3.make_model import make_model
    from .progress import Progress

    bar = Progress("writing tensors", 0)
    try:
        checkpoint = make_model(args.outdir, preset=args.preset, seed=args.seed,
                                shards=args.shards, progress=bar.update)
    except ValueError as error:             # refused before anything is written
        raise CommandError(str(error)) from None
    finally:
        if bar.total:                       # started: end its line before any error message
            bar.close()
    c = checkpoint.config
    print(f"wrote a random {args.preset} {c.model_type} checkpoint to {args.outdir}: "
          f"{len(checkpoint)} tensors in {len(set(checkpoint.files.values()))} shards; try "
          f"python -m ddtree_numba demo --model {args.outdir}")
    return 0


def _fixtures(args) -> int:
    from .fixtures import FixturesError, write_fixtures

    try:
        manifest = write_fixtures(args.outdir, seed=args.seed, cases=args.cases)
    except FixturesError as error:
        raise CommandError(str(error)) from None
    print(f"wrote {len(manifest['files'])} fixtures and manifest.json to {args.outdir}")
    return 0


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _parse_cc(text):
    from .build_report import parse_cc

    try:
        return parse_cc(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--cc: ")) from None


def make_parser() -> Parser:
    parser = Parser(prog=PROG, description="Readable numba.cuda kernels for greedy DDTree "
                    "speculative decoding: the demo, the environment, sm_120 readiness, golden "
                    "fixtures.")
    parser.add_argument("--version", action="version", version=f"ddtree_numba {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of an "
                        "unexpected error (also DDTREE_TRACEBACK=1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    demo = sub.add_parser("demo", help="DDTree decoding of a toy MLA model (greedy, or sampled "
                          "with --temperature), checked "
                          "against the references and plain greedy decoding (the main job)")
    demo.add_argument("--bs", type=int_in(1, MAX_BATCH),
                      help="requests (default: 2 simulated, 4 on a GPU)")
    demo.add_argument("--steps", type=int_in(1, MAX_STEPS),
                      help="greedy steps (default: 6 / 12)")
    demo.add_argument("--depth", type=int_in(1, MAX_DEPTH),
                      help="L, draft positions per step (default: 4 / 8)")
    demo.add_argument("--topk", type=int_in(1, MAX_K), help="K, tokens kept per depth "
                      "(default: 3 / 8; at most the demo's vocabulary: 64 / 4096)")
    demo.add_argument("--budget", type=int_in(0, MAX_BUDGET),
                      help="B, draft nodes per tree (default: 12 / 64)")
    demo.add_argument("--accuracy", type=probability, default=0.8,
                      help="how often the toy drafter's top guess is the target's token")
    demo.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    demo.add_argument("--temperature", type=non_negative, default=0.0,
                      help="sample at this temperature (default 0: greedy decoding)")
    demo.add_argument("--top-k", type=int_in(0, MAX_VOCAB), default=0,
                      help="when sampling, keep the K most likely target tokens (default 0: "
                      "all; not --topk, the drafter's K)")
    demo.add_argument("--top-p", type=top_p_value, default=1.0,
                      help="when sampling, keep the most likely target tokens holding this "
                      "much probability (default 1: all)")
    demo.add_argument("--plot", metavar="PATH", type=output_file(PLOT_SUFFIXES),
                      help="save the tree of the step with the longest accepted path, the path "
                      "highlighted (.png, .svg or .pdf)")
    demo.add_argument("--model", metavar="DIR", help="decode a local DeepSeek-V3-architecture "
                      "checkpoint (Hugging Face config.json + safetensors; make-model writes "
                      "one) instead of the toy target: greedy, on the CUDA simulator for now")
    demo.add_argument("--cache", choices=("float32", "bfloat16"),
                      help="with --model: the KV cache's type (default float32)")
    sub.add_parser("info", help="numba-cuda version, GPU or simulator")
    report = sub.add_parser("build-report", help="compile every kernel for a target GPU (no "
                            "GPU needed) and report registers, spills, shared memory, occupancy")
    report.add_argument("--cc", action="append", type=_parse_cc, help="compute capability, "
                        "e.g. 12.0 (default), 9.0, 8.9, 8.0; repeat for several")
    form = report.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    form.add_argument("--markdown", action="store_true",
                      help="print a Markdown table with the targets side by side")
    report.add_argument("--strict", action="store_true", help="exit 1 if a kernel does not "
                        "fit, naming each problem on stderr")
    make = sub.add_parser("make-model", help="write a small random DeepSeek-V3-architecture "
                          "checkpoint (config.json, sharded bfloat16 safetensors) for demo "
                          "--model")
    make.add_argument("outdir", type=output_dir, help="folder to write (created if missing; "
                      "refused if it already holds a checkpoint)")
    make.add_argument("--preset", choices=("tiny", "small"), default="tiny",
                      help="tiny: runs on the CUDA simulator in seconds (default); small: "
                      "576-wide cache rows, 21 M parameters")
    make.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    make.add_argument("--shards", type=int_in(1, 99), default=2,
                      help="safetensors files (default 2)")
    fixtures = sub.add_parser("fixtures", help="write golden KDTR fixtures of every stage "
                              "(inputs and expected outputs from the references)")
    fixtures.add_argument("outdir", type=output_dir, help="folder to write (created if "
                          "missing); the previous fixtures its manifest.json lists are "
                          "replaced, other files are kept")
    fixtures.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    fixtures.add_argument("--cases", type=int_in(1, MAX_CASES), default=1,
                          help="cases per stage")
    return parser


COMMANDS = {"demo": _demo, "info": _info, "build-report": _build_report,
            "make-model": _make_model, "fixtures": _fixtures}


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    collect_less_often()            # the commands compile kernels: see its docstring
    command = COMMANDS[args.command]
    try:
        return command(args) if args.command != "info" else command()
    except CommandError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if args.traceback or os.environ.get("DDTREE_TRACEBACK", "") not in ("", "0"):
            raise
        text = " ".join(str(error).split()) or "(no message)"
        print(f"{PROG} {args.command}: error: {type(error).__name__}: {text} (--traceback "
              "shows where)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
