"""Compare the kernels of two checkouts as the compiler sees them: PTX, registers, SASS.

    python tools/kernel_diff.py OLD NEW [--cc 12.0] [--match TEXT ...] [--keep DIR]

``OLD`` and ``NEW`` are each a directory that holds a ``ddtree_numba`` package (relative to the
current directory: ``.`` is the working tree when run from the repository's root) or else a git
revision of the repository this tool is in (``e1ca0a4``, ``HEAD~2``). Every kernel
specialisation of the build report (``build_specs()`` of the kernel modules) whose
``"stage variant"`` contains one of the ``--match`` texts is compiled in both checkouts for
``sm_XY`` on this machine, no GPU needed, and the tool prints, old -> new:

* compile seconds (numba's front end, NVVM and nvJitLink together; one CPU core each);
* registers, spill bytes (stores plus loads), stack frame and static shared memory (ptxas'
  report);
* SASS instructions (``nvdisasm``) and the opcodes whose counts changed;
* whether the PTX is the same once numba's per-compilation names are normalised
  (:func:`normalize_ptx`), and otherwise how many lines differ and which PTX instructions
  changed in number.

A change meant to leave the generated code alone (a refactor, a split into device functions)
should print ``PTX same``; one meant to improve it shows where, opcode by opcode, before any GPU
time is spent. ``--keep DIR`` writes each kernel's normalised PTX and SASS under ``DIR/old`` and
``DIR/new`` for ``diff -u``. Bad arguments print one line and exit 2; a checkout that fails to
compile exits 1 after its error.

The two checkouts compile in two processes side by side, each with its own ``ddtree_numba`` on
``sys.path``. The compiling and linking is this checkout's ``build_report.compile_kernel``
(loaded from its file, so that an old checkout is built the same way), with the kernel
specialisations the compared checkout lists.
"""

from __future__ import annotations

import collections
import difflib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_REPORT = REPO / "ddtree_numba" / "build_report.py"
CLI = REPO / "ddtree_numba" / "_cli.py"

# numba names every compiled function with a per-process counter (``...kernelB2v1B102cw5...``:
# ``v1`` is the counter) and numbers shared arrays with another (``_cudapy_smem_3``); two builds
# of the same source differ only there. Each is renumbered in the order the PTX first names it,
# so that equal code compares equal and a read of another array still differs. NVVM's header
# comments name the compiler build.
PTX_NAMES = ((re.compile(r"B\d+v\d+B"), "B{}B"),
             (re.compile(r"_cudapy_smem_\d+"), "_cudapy_smem_{}"))
SASS_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")


def normalize_ptx(ptx: str) -> list:
    """The PTX's lines without comments, numba's per-compilation names renumbered from 0 in
    the order they first appear (:data:`PTX_NAMES`)."""
    renamed = [{} for _ in PTX_NAMES]        # per kind of name: old name -> new one

    def rename(names, form):
        return lambda match: names.setdefault(match.group(0), form.format(len(names)))

    lines = []
    for line in ptx.splitlines():
        if line.lstrip().startswith("//"):
            continue
        for (pattern, form), names in zip(PTX_NAMES, renamed, strict=True):
            line = pattern.sub(rename(names, form), line)
        lines.append(line.rstrip())
    return lines


def ptx_opcodes(lines: list) -> list:
    """The opcode, modifiers included (``setp.lt.s32``), of every PTX instruction; directives,
    labels, braces and parameter lists are not instructions, and a guard (``@%p1``) is left
    out."""
    ops = []
    for line in lines:
        words = line.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if not words or not words[0][0].isalpha() or words[0].endswith(":"):
            continue
        ops.append(words[0].rstrip(";"))
    return ops


def normalize_sass(sass: str) -> list:
    """nvdisasm's instruction lines without their addresses (an inserted instruction would
    otherwise make every later line differ)."""
    return [SASS_ADDRESS.sub("", line).strip() for line in sass.splitlines()
            if SASS_ADDRESS.search(line)]


def changed_lines(old: list, new: list) -> tuple:
    """``(removed, added)`` line counts of a diff from ``old`` to ``new``."""
    removed = added = 0
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return removed, added


def slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_")


# --- the worker: one checkout, in its own process -----------------------------------------------

def load_module(path: Path):
    """One of this checkout's modules, loaded from its file under its own name
    (``kernel_diff_<stem>``): ``import ddtree_numba`` inside it finds the compared checkout on
    ``sys.path``, and the main process never imports the package."""
    spec = importlib.util.spec_from_file_location(f"kernel_diff_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def build_rows(cc: tuple, matches: list, keep: str | None) -> dict:
    """Compile every matching specialisation of the ``ddtree_numba`` on ``sys.path``."""
    build_report = load_module(BUILD_REPORT)
    try:        # fewer full collections while compiling (docs/sm120.md); old checkouts lack it
        from ddtree_numba._platform import collect_less_often

        collect_less_often()
    except ImportError:
        pass
    rows = {}
    for spec in build_report.kernel_specs():
        key = f"{spec.stage} {spec.variant}"
        if matches and not any(m in key for m in matches):
            continue
        start = time.perf_counter()
        sources = getattr(spec, "cuda_sources", ())     # (specs before 2026-12-01 lack it)
        build = build_report.compile_kernel(spec.kernel, spec.signature, cc, sources)
        seconds = time.perf_counter() - start
        resources = build_report.parse_ptxas_log(build.log, len(build.cubin))
        sass = build_report.sass_text(build.cubin)     # None: no nvdisasm to read it
        ptx = normalize_ptx(build.ptx) if build.ptx is not None else None
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            if ptx is not None:
                (Path(keep) / f"{slug(key)}.ptx").write_text("\n".join(ptx) + "\n")
            if sass is not None:
                (Path(keep) / f"{slug(key)}.sass").write_text(
                    "\n".join(normalize_sass(sass)) + "\n")
        rows[key] = {"seconds": seconds, "registers": resources.registers,
                     "spill": resources.spill_stores + resources.spill_loads,
                     "stack": resources.stack, "shared": resources.shared,
                     "opcodes": None if sass is None else
                     dict(collections.Counter(build_report.sass_opcodes(sass))),
                     "ptx": ptx}
    return rows


def worker(argv) -> int:
    out, cc, keep, *matches = argv
    cc = tuple(int(x) for x in cc.split("."))
    rows = build_rows(cc, matches, keep or None)
    Path(out).write_text(json.dumps(rows))
    return 0


# --- the comparison ---------------------------------------------------------------------------

def opcode_changes(old: dict, new: dict, most: int = 12) -> str:
    """``"ISETP +2, SEL -1"``: the opcodes whose counts changed, largest change first."""
    deltas = {op: new.get(op, 0) - old.get(op, 0) for op in set(old) | set(new)}
    changed = sorted((op for op in deltas if deltas[op]), key=lambda op: (-abs(deltas[op]), op))
    text = ", ".join(f"{op} {deltas[op]:+d}" for op in changed[:most])
    return text + (f", and {len(changed) - most} more" if len(changed) > most else "")


def compare(old_rows: dict, new_rows: dict) -> list:
    """The report's lines: one per kernel in either checkout, then what changed in its PTX
    instructions and SASS opcodes, when anything did."""
    def pair(a, b):
        return f"{a}" if a == b else f"{a} -> {b}"

    lines = []
    for key in dict.fromkeys([*old_rows, *new_rows]):
        if key not in old_rows or key not in new_rows:
            lines.append(f"{key}: only in {'new' if key in new_rows else 'old'}")
            continue
        a, b = old_rows[key], new_rows[key]
        details = []
        if a["ptx"] is None or b["ptx"] is None:
            ptx = "PTX not compared (links CUDA C++)"
        else:
            removed, added = changed_lines(a["ptx"], b["ptx"])
            ptx = "PTX same" if not removed + added else f"PTX -{removed} +{added} lines"
            if removed + added:
                # one more instruction renumbers PTX's virtual registers from there on, so
                # the line count overstates a change: the instruction counts say what it is
                counts = [collections.Counter(ptx_opcodes(x["ptx"])) for x in (a, b)]
                details.append(f"    PTX instructions: "
                               f"{opcode_changes(*counts) or 'the same counts'}")
        if a["opcodes"] is None or b["opcodes"] is None:
            sass = "SASS not read (no nvdisasm)"
        else:
            sass = f"SASS {pair(sum(a['opcodes'].values()), sum(b['opcodes'].values()))}"
            changes = opcode_changes(a["opcodes"], b["opcodes"])
            if changes:
                details.append(f"    SASS opcodes: {changes}")
        parts = [f"compile {a['seconds']:.1f} -> {b['seconds']:.1f} s",
                 f"registers {pair(a['registers'], b['registers'])}", sass, ptx]
        for name in ("spill", "stack", "shared"):
            if a[name] or b[name]:
                parts.append(f"{name} {pair(a[name], b[name])} B")
        lines.append(f"{key}: " + ", ".join(parts))
        lines += details
    return lines


def checkout(source: str, into: Path) -> Path:
    """A directory holding the ``ddtree_numba`` of ``source`` (a directory or a revision)."""
    if Path(source).is_dir():
        if not (Path(source) / "ddtree_numba" / "__init__.py").is_file():
            raise ValueError(f"{source}: expected a directory holding ddtree_numba/ or a git "
                             f"revision, got a directory without ddtree_numba/__init__.py")
        return Path(source).resolve()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", source, "ddtree_numba"],
                             capture_output=True)
    if archive.returncode:
        raise ValueError(f"{source}: expected a directory holding ddtree_numba/ or a git "
                         f"revision, got neither ({archive.stderr.decode().strip()})")
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def parse_args(argv):
    parser = load_module(CLI).Parser(prog="kernel_diff", description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="a directory holding ddtree_numba/ or a git revision")
    parser.add_argument("new", help="likewise, e.g. . for the working tree")
    parser.add_argument("--cc", default="12.0", help="target compute capability (12.0)")
    parser.add_argument("--match", action="append", default=[],
                        help="compare the specialisations whose 'stage variant' holds this "
                             "text (repeatable; default: every one, which takes long)")
    parser.add_argument("--keep", help="write normalised PTX and SASS under KEEP/old, KEEP/new")
    args = parser.parse_args(argv)
    try:
        load_module(BUILD_REPORT).parse_cc(args.cc)     # one of the targets the report knows
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trees = [checkout(source, Path(tmp) / side)
                     for source, side in ((args.old, "old"), (args.new, "new"))]
        except ValueError as error:
            print(f"kernel_diff: {error}", file=sys.stderr)
            return 2
        processes = []
        for tree, side in zip(trees, ("old", "new"), strict=True):
            # (the workers run in the temporary directory: a relative --keep is made absolute)
            keep = str(Path(args.keep).resolve() / side) if args.keep else ""
            path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, "PYTHONPATH": path, "DDTREE_BACKEND": "gpu",
                   "NUMBA_ENABLE_CUDASIM": "0"}
            command = [sys.executable, __file__, "--worker", f"{tmp}/{side}.json", args.cc,
                       keep, *args.match]
            processes.append(subprocess.Popen(command, cwd=tmp, env=env))
        # a failure in either worker stops the other at once (polled: the one that fails may
        # be either); both end before their directory goes
        while (not any(p.poll() for p in processes)          # None: running; 0: done
               and any(p.poll() is None for p in processes)):
            time.sleep(0.2)
        failed = any(p.poll() for p in processes)
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        if failed:
            print("kernel_diff: a checkout failed to compile (its error is above)",
                  file=sys.stderr)
            return 1
        old, new = (json.loads(Path(f"{tmp}/{side}.json").read_text()) for side in ("old", "new"))
    if not old and not new:
        print(f"kernel_diff: no specialisation matches {args.match}", file=sys.stderr)
        return 2
    print(f"sm_{args.cc.replace('.', '')}: {args.old} -> {args.new}")
    print("\n".join(compare(old, new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
