"""sm_120 readiness: compile every kernel for a target GPU on a CPU-only machine and report.

For each kernel specialisation the library launches (the ``build_specs()`` of every module
under ``kernels/``) and each compute capability asked for, the kernel is compiled to PTX by
numba-cuda (``cuda.compile_ptx(..., cc=...)``, no GPU needed) and linked by nvJitLink for
``-arch=sm_XY`` with ``-verbose``, which returns ptxas' resource report. From registers,
shared memory and threads per block, the occupancy limit follows from the target's per-SM
limits below.

ptxas on sm_90 counts 1 KiB more shared memory than on the other targets for a kernel that uses
any; the report keeps its figure and still adds the per-block reserve, which errs on the safe
side by 1 KiB.

Per-SM limits: the CUDA C++ Programming Guide, "Technical Specifications per Compute
Capability", as encoded in NVIDIA CCCL's ``cuda/__device/arch_traits.h``. All four targets have
64 K 32-bit registers per SM, at most 255 per thread, allocated per warp in units of 256, and a
48 KiB limit on static shared memory per block (numba has no opt-in for more). A kernel that
launches with dynamic shared memory (``KernelSpec.dynamic_shared``, opted in above 48 KiB by
``kernels._device.allow_dynamic_shared``) is reported with it added to its static memory.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
import pkgutil
import re
from dataclasses import asdict, dataclass, replace

STATIC_SMEM_PER_BLOCK = 48 * 1024
REGISTERS_PER_SM = 64 * 1024
REGISTER_UNIT = 256           # registers are allocated per warp in multiples of this


@dataclass(frozen=True)
class ArchLimits:
    cc: tuple
    example: str
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int
    reserved_smem_per_block: int


ARCH_LIMITS = {
    (12, 0): ArchLimits((12, 0), "RTX PRO 6000 Blackwell", 1536, 32, 100 * 1024, 1024),
    (9, 0): ArchLimits((9, 0), "H100 / H200", 2048, 32, 228 * 1024, 1024),
    (8, 9): ArchLimits((8, 9), "L40S / RTX 4090", 1536, 24, 100 * 1024, 1024),
    (8, 0): ArchLimits((8, 0), "A100", 2048, 32, 164 * 1024, 1024),
}


@dataclass
class Resources:
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    cubin_bytes: int


def parse_cc(text: str) -> tuple:
    """``"12.0"`` -> ``(12, 0)``; a ValueError names the known targets otherwise."""
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise ValueError(f"--cc: expected MAJOR.MINOR such as 12.0, got {text!r}") from None
    if (major, minor) not in ARCH_LIMITS:
        known = ", ".join(f"{a}.{b}" for a, b in ARCH_LIMITS)
        raise ValueError(f"--cc: expected one of {known}, got {text}")
    return major, minor


def _package_modules() -> list:
    """Every module of the package, subpackages included (the command line excepted: it
    defines no kernels)."""
    import ddtree_numba

    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(ddtree_numba.__path__, prefix="ddtree_numba.")
            if not info.name.endswith("__main__")]


def _kernel_modules() -> list:
    """The modules that declare kernels: those that define ``build_specs()``. A new kernel
    module joins the report by defining it; :func:`unlisted_kernels` catches a kernel that no
    module lists."""
    return [m for m in _package_modules() if callable(getattr(m, "build_specs", None))]


def kernel_specs() -> list:
    """Every specialisation listed by a kernel module's ``build_specs()``."""
    specs = []
    for module in _kernel_modules():
        specs += module.build_specs()
    return specs


def unlisted_kernels(specs) -> list:
    """Module-level ``@cuda.jit`` kernels that no spec lists (they would escape the report)."""
    from numba.cuda.dispatcher import CUDADispatcher

    listed = {id(s.kernel) for s in specs}
    missing = []
    for module in _package_modules():
        for name, value in vars(module).items():
            is_kernel = isinstance(value, CUDADispatcher) and not value.targetoptions.get("device")
            if is_kernel and id(value) not in listed:
                missing.append(f"{module.__name__}.{name}")
    return missing


def _nvrtc_ltoir(name: str, text: str, cc) -> bytes:
    """LTO-IR of CUDA C++ source by NVRTC (cuda.bindings: no driver needed, unlike numba's
    own NVRTC wrapper), for the link-time optimisation that inlines it into a kernel."""
    from cuda.bindings import nvrtc

    def check(result):
        error, *values = result
        if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {error.name} compiling {name}")
        return values

    (program,) = check(nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], []))
    options = [f"--gpu-architecture=sm_{cc[0]}{cc[1]}".encode(), b"-dlto", b"-rdc=true"]
    (error,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(program))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
        raise RuntimeError(f"NVRTC: {name}: {log.decode(errors='replace').strip()}")
    (size,) = check(nvrtc.nvrtcGetLTOIRSize(program))
    ltoir = b" " * size
    check(nvrtc.nvrtcGetLTOIR(program, ltoir))
    return ltoir


@dataclass(frozen=True)
class Build:
    """One kernel compiled and linked for one target (:func:`compile_kernel`)."""
    ptx: str | None     # numba's PTX; None for a kernel that links CUDA C++ (built from LTO-IR)
    log: str            # ptxas' ``-verbose`` report, through nvJitLink
    cubin: bytes


def compile_kernel(kernel, signature, cc, cuda_sources=()) -> Build:
    """Compile one kernel for ``sm_XY`` and link it, no GPU needed: a :class:`Build` (its
    ``ptx`` is ``None`` for a kernel that links CUDA C++).

    Plain numba kernels: PTX by numba-cuda, linked by nvJitLink. Kernels that call CUDA C++
    (``cuda_sources``, the tensor-core wrappers): LTO-IR of the kernel by numba-cuda and of the
    sources by NVRTC, linked by nvJitLink with ``-lto``, which inlines the wrappers as a launch
    on the GPU does.
    """
    from cuda.bindings import nvjitlink
    from numba import cuda

    # -no-cache: nvJitLink keeps linked code in the driver's compute cache (~/.nv) and, on a
    # hit, returns a log without ptxas' report. On a machine with a GPU the tests' own launches
    # and an earlier report fill that cache.
    options = [f"-arch=sm_{cc[0]}{cc[1]}", "-verbose", "-no-cache"]
    max_registers = getattr(kernel, "targetoptions", {}).get("max_registers")
    if max_registers:                       # what numba passes to the linker at launch
        options.append(f"-maxrregcount={max_registers}")
    bounds = getattr(kernel, "targetoptions", {}).get("launch_bounds")   # as at launch
    if cuda_sources:
        code, _ = cuda.compile(kernel.py_func, signature, device=False, output="ltoir", cc=cc,
                               abi="numba", launch_bounds=bounds)
        inputs = [(nvjitlink.InputType.LTOIR, code, "kernel")]
        inputs += [(nvjitlink.InputType.LTOIR, _nvrtc_ltoir(name, text, cc), name)
                   for name, text in cuda_sources]
        options.append("-lto")
        ptx = None
    else:
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=cc, launch_bounds=bounds)
        inputs = [(nvjitlink.InputType.PTX, ptx.encode(), "kernel")]
    handle = nvjitlink.create(len(options), options)
    try:
        for kind, data, name in inputs:
            nvjitlink.add_data(handle, kind, data, len(data), name)
        try:
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as error:    # ptxas' own words are in the error log
            message = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, message)
            raise RuntimeError(message.decode(errors="replace").strip() or str(error)) from None
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    return Build(ptx, log.decode(errors="replace"), bytes(cubin))


def format_sass_notes(rows) -> list:
    """One line per kernel that links CUDA C++: what its SASS holds (``sass_counts``)."""
    lines = []
    for r in rows:
        sass = r.get("sass")
        if sass:
            lines.append(f"{r['cc']} {r['stage']} {r['variant']}: {sass['HMMA']} HMMA, "
                         f"{sass['LDSM']} LDSM, {sass['CALL']} CALL ({sass['CALL_runtime']} into "
                         f"the math runtime), {sass['local']} local-"
                         f"memory accesses in {sass['instructions']} instructions")
        elif "sass" in r:
            lines.append(f"{r['cc']} {r['stage']} {r['variant']}: no nvdisasm to read the SASS "
                         f"(pip install nvidia-cuda-nvdisasm)")
    return lines


def sass_text(cubin: bytes) -> str | None:
    """A cubin's SASS by ``nvdisasm -c`` (the ``nvidia-cuda-nvdisasm`` wheel or a CUDA
    toolkit); ``None`` when no nvdisasm is found."""
    import shutil
    import subprocess
    import tempfile

    tool = shutil.which("nvdisasm")
    if tool is None:
        try:
            from cuda import pathfinder

            tool = pathfinder.find_nvidia_binary_utility("nvdisasm")
        except Exception:
            tool = None
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


# An instruction line of nvdisasm's output: its address comment, an optional predicate
# (``@P0``, ``@!UP1``), then the opcode, whose modifiers (``.64``, ``.U32``) are left out.
SASS_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_opcodes(sass: str) -> list:
    """The opcode of every instruction of nvdisasm's text, in order."""
    return SASS_OPCODE.findall(sass)


def sass_counts(cubin: bytes) -> dict:
    """Instruction counts of a cubin's SASS (:func:`sass_text`): tensor-core products
    (``HMMA``), shared-matrix loads (``LDSM``), calls (``CALL``; ``CALL_runtime`` of them into
    the CUDA math runtime's helpers), local-memory accesses (``LDL``/``STL``) and all
    instructions. ``None`` when no nvdisasm is found."""
    sass = sass_text(cubin)
    if sass is None:
        return None
    ops = sass_opcodes(sass)
    # calls into the CUDA math runtime (e.g. the float32 division's slow path, taken only for
    # denormal or huge operands) as opposed to calls into functions that LTO left out of line
    runtime = re.findall(r"\bCALL\S*\s+`\(\$__internal_\d+_\$__cuda_", sass)
    return {"instructions": len(ops), "HMMA": sum(o == "HMMA" for o in ops),
            "LDSM": sum(o == "LDSM" for o in ops), "CALL": sum(o.startswith("CALL") for o in ops),
            "CALL_runtime": len(runtime), "local": sum(o in ("LDL", "STL") for o in ops)}


def parse_ptxas_log(log: str, cubin_bytes: int = 0) -> Resources:
    """Read registers, spills, stack and shared memory from ptxas' ``-verbose`` output."""
    def number(pattern):
        found = re.findall(pattern, log)
        if not found:
            raise ValueError(f"ptxas report without {pattern!r}:\n{log}")
        return int(found[-1])

    return Resources(
        registers=number(r"[Uu]sed (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack=number(r"(\d+) bytes stack frame"),
        shared=int(re.findall(r"(\d+) bytes smem", log)[-1]) if "bytes smem" in log else 0,
        cubin_bytes=cubin_bytes,
    )


def occupancy(res: Resources, threads: int, limits: ArchLimits) -> dict:
    """Resident blocks per SM and the resource that limits them."""
    warps = -(-threads // 32)
    regs_per_warp = -(-res.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by = {
        "threads": limits.max_threads_per_sm // (warps * 32),
        "blocks": limits.max_blocks_per_sm,
        "registers": REGISTERS_PER_SM // max(regs_per_warp * warps, 1),
        "shared": limits.smem_per_sm // (res.shared + limits.reserved_smem_per_block),
    }
    limiter = min(by, key=by.get)
    blocks = by[limiter]
    return {"blocks_per_sm": blocks, "limiter": limiter,
            "occupancy": blocks * warps / (limits.max_threads_per_sm // 32)}


def check_resources(spec, res: Resources, limits: ArchLimits) -> list:
    """What keeps a specialisation from fitting the target (empty list: it fits)."""
    problems = []
    if spec.fast and (res.spill_stores or res.spill_loads):
        problems.append(f"spills {res.spill_stores} B stores / {res.spill_loads} B loads")
    if spec.fast and res.stack:
        problems.append(f"uses a {res.stack} B stack frame (local memory)")
    if res.shared > STATIC_SMEM_PER_BLOCK:
        problems.append(f"static shared memory {res.shared} B > {STATIC_SMEM_PER_BLOCK} B")
    total = res.shared + spec.dynamic_shared    # what a block launches with
    if total + limits.reserved_smem_per_block > limits.smem_per_sm:
        problems.append(f"shared memory {total} B does not fit one SM")
    if spec.threads > 1024 or occupancy(res, spec.threads, limits)["blocks_per_sm"] < 1:
        problems.append(f"{spec.threads} threads x {res.registers} registers cannot launch")
    return problems


def report_row(spec, cc) -> dict:
    """Compile one specialisation for one target; a failure to compile or link is a problem."""
    row = {"cc": f"{cc[0]}.{cc[1]}", "stage": spec.stage, "variant": spec.variant,
           "fast": spec.fast, "threads": spec.threads}
    limits = ARCH_LIMITS[cc]
    try:
        build = compile_kernel(spec.kernel, spec.signature, cc, spec.cuda_sources)
        res = parse_ptxas_log(build.log, len(build.cubin))
    except Exception as error:  # ptxas refuses e.g. more than 48 KiB of static shared memory
        message = " ".join(str(error).split())
        if len(message) > 600:                  # kernels' mangled names are long: both ends
            message = message[:300] + " ... " + message[-300:]
        return {**row, "problems": [f"does not build for sm_{cc[0]}{cc[1]}: {message}"]}
    if spec.cuda_sources:       # tensor-core kernels: HMMA present, no CALL into the wrappers
        row["sass"] = sass_counts(build.cubin)
    problems = check_resources(spec, res, limits)
    # the report's shared memory and occupancy: static plus what the launch adds dynamically
    res = replace(res, shared=res.shared + spec.dynamic_shared)
    return {**row, **asdict(res), **occupancy(res, spec.threads, limits),
            "dynamic_shared": spec.dynamic_shared, "problems": problems}


def _report_job(job) -> dict:
    """One (specialisation index, target) of :func:`build_report`, in a worker process."""
    index, cc = job
    return report_row(kernel_specs()[index], cc)


def build_report(ccs=((12, 0),), *, progress=None, jobs=None) -> list:
    """One row per (specialisation, target): resources, occupancy and problems.

    ``progress(done, total, cc, spec)``, if given, is called after each compilation (the
    command line prints it on stderr). ``jobs`` worker processes compile in parallel (default:
    one per CPU; each compilation is independent and single-threaded, so 16 cores compile a
    report about 10x faster than one); ``jobs=1`` compiles in this process. Rows come back in
    the same order either way: targets, then the specs in module order.
    """
    specs = kernel_specs()
    work = [(i, cc) for cc in dict.fromkeys(ccs) for i in range(len(specs))]   # a target
    jobs = min(jobs or os.cpu_count() or 1, len(work))                          # once
    rows = [None] * len(work)
    if jobs <= 1:
        for n, job in enumerate(work):
            rows[n] = _report_job(job)
            if progress is not None:
                progress(n + 1, len(work), job[1], specs[job[0]])
    else:
        # fork: the workers inherit the imported package and numba's choice of target; the
        # report compiles only (NVVM, nvJitLink) and never creates a CUDA context to inherit
        context = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {pool.submit(_report_job, job): n for n, job in enumerate(work)}
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                n = futures[future]
                rows[n] = future.result()
                if progress is not None:
                    progress(done, len(work), work[n][1], specs[work[n][0]])
    for name in unlisted_kernels(specs):
        rows.append({"cc": "-", "stage": name, "variant": "-",
                     "problems": ["kernel has no build spec"]})
    return rows


def format_problems(rows) -> list:
    """One line per problem: ``cc 12.0, stage build_tree, variant select warp (fast): ...``."""
    def context(r):
        if "registers" not in r:
            return ""
        return f" [{r['registers']} registers, {r['threads']} threads, {r['shared']} B smem]"

    return [f"cc {r['cc']}, stage {r['stage']}, variant {r['variant']}"
            f"{' (fast path)' if r.get('fast') else ''}: {p}{context(r)}"
            for r in rows for p in r["problems"]]


def toolchain() -> str:
    """The versions that decide ptxas' figures (they differ between machines)."""
    from importlib.metadata import PackageNotFoundError, version

    from cuda.bindings import nvjitlink

    parts = ["nvJitLink {}.{}".format(*nvjitlink.version())]
    try:                                    # NVVM (PTX) may come from a system toolkit
        from numba.cuda.cuda_paths import get_cuda_paths

        nvvm = get_cuda_paths()["nvvm"]
        parts.append(f"NVVM {nvvm.info} (found by {nvvm.by})")
    except Exception:                       # pragma: no cover - informational only
        pass
    for dist in ("numba-cuda", "nvidia-nvjitlink", "nvidia-nvvm", "nvidia-nvjitlink-cu12",
                 "nvidia-cuda-nvcc-cu12"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return ", ".join(parts)


def format_table(rows) -> str:
    columns = ["cc", "stage", "variant", "registers", "spill_stores", "spill_loads", "stack",
               "shared", "threads", "blocks_per_sm", "occupancy", "limiter"]
    heads = ["cc", "kernel", "variant", "regs", "spill st", "spill ld", "stack", "smem B",
             "threads", "blocks/SM", "occupancy", "limited by"]

    def cell(row, c):
        v = row.get(c, "")
        return f"{v:.0%}" if c == "occupancy" and v != "" else str(v)

    table = [heads] + [[cell(r, c) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in table]
    lines += [f"sass: {line}" for line in format_sass_notes(rows)]
    problems = format_problems(rows)
    lines.append("problems: " + ("none" if not problems else f"{len(problems)}"))
    lines += [f"  {line}" for line in problems]
    return "\n".join(lines)


def format_side_by_side(rows) -> str:
    """Markdown: one line per kernel specialisation, one column group per target."""
    ccs = list(dict.fromkeys(r["cc"] for r in rows if r["cc"] != "-"))
    head = "| kernel | variant | " + " | ".join(
        f"{cc}: regs, smem, blocks/SM (occupancy), spills" for cc in ccs) + " |"
    lines = [head, "|---|---|" + "---|" * len(ccs)]
    keys = list(dict.fromkeys((r["stage"], r["variant"]) for r in rows if r["cc"] != "-"))
    for stage, variant in keys:
        cells = []
        for cc in ccs:
            r = next(x for x in rows if (x["cc"], x["stage"], x["variant"]) == (cc, stage,
                                                                                 variant))
            if "registers" not in r:
                cells.append("does not build")
                continue
            spill = r["spill_stores"] + r["spill_loads"]
            cells.append(f"{r['registers']}, {r['shared'] / 1024:.1f} KB, "
                         f"{r['blocks_per_sm']} ({r['occupancy']:.0%}), "
                         f"{'none' if not spill else f'{spill} B'}")
        lines.append(f"| {stage} | {variant} | " + " | ".join(cells) + " |")
    notes = format_sass_notes(rows)
    if notes:
        lines += ["", "SASS of the kernels that link CUDA C++ (nvdisasm):", ""]
        lines += [f"- {line}" for line in notes]
    return "\n".join(lines) + "\n"
