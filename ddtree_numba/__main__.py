"""Command line: ``python -m ddtree_numba demo`` (the main job), ``info``, ``build-report``,
``fixtures``."""

from __future__ import annotations

import argparse
import sys

from ._platform import choose_backend


def _info() -> int:
    backend = choose_backend()
    import numba
    import numpy as np
    from numba import cuda

    print(f"ddtree_numba backend: {backend}")
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
    import os

    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"      # compile for real; no GPU is needed for it
    from .build_report import build_report, format_side_by_side, format_table, parse_cc

    try:
        ccs = [parse_cc(text) for text in (args.cc or ["12.0"])]
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    rows = build_report(ccs)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_side_by_side(rows) if args.markdown else format_table(rows))
    return 1 if args.strict and any(row["problems"] for row in rows) else 0


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree_numba")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="greedy DDTree decoding of a toy MLA model, checked "
                          "against the references and plain greedy decoding (the main job)")
    demo.add_argument("--bs", type=int, help="requests (default: 2 simulated, 4 on a GPU)")
    demo.add_argument("--steps", type=int, help="greedy steps (default: 6 / 12)")
    demo.add_argument("--depth", type=int, help="L, draft positions per step (default: 4 / 8)")
    demo.add_argument("--topk", type=int, help="K, tokens kept per depth (default: 3 / 8)")
    demo.add_argument("--budget", type=int, help="B, draft nodes per tree (default: 12 / 64)")
    demo.add_argument("--accuracy", type=float, default=0.8,
                      help="how often the toy drafter's top guess is the target's token")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--plot", metavar="PATH", help="save the tree of the step with the "
                      "longest accepted path, the path highlighted (PNG or SVG)")
    sub.add_parser("info", help="numba-cuda version, GPU or simulator")
    report = sub.add_parser("build-report", help="compile every kernel for a target GPU (no "
                            "GPU needed) and report registers, spills, shared memory, occupancy")
    report.add_argument("--cc", action="append", help="compute capability, e.g. 12.0 (default), "
                        "9.0, 8.9, 8.0; repeat for several")
    report.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    report.add_argument("--markdown", action="store_true",
                        help="print a Markdown table with the targets side by side")
    report.add_argument("--strict", action="store_true", help="exit 1 if a kernel does not fit")
    fixtures = sub.add_parser("fixtures", help="write golden KDTR fixtures of every stage "
                              "(inputs and expected outputs from the references)")
    fixtures.add_argument("outdir")
    fixtures.add_argument("--seed", type=int, default=0)
    fixtures.add_argument("--cases", type=int, default=1, help="cases per stage")
    args = parser.parse_args(argv)
    if args.command == "fixtures":
        from .fixtures import write_fixtures

        manifest = write_fixtures(args.outdir, seed=args.seed, cases=args.cases)
        print(f"wrote {len(manifest['files'])} fixtures and manifest.json to {args.outdir}")
        return 0
    if args.command == "info":
        return _info()
    if args.command == "build-report":
        return _build_report(args)
    backend = choose_backend()
    from .step.demo import run_demo

    print(f"ddtree_numba demo on the {backend}\n")
    run_demo(bs=args.bs, steps=args.steps, L=args.depth, k=args.topk, budget=args.budget,
             accuracy=args.accuracy, seed=args.seed, plot=args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
