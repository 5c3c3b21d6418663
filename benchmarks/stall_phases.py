"""Where a kernel's warps wait, by phase of its hot loop: Nsight Compute's per-instruction stall
samples summed between the loop's barriers.

Nsight Compute samples, every few cycles, what each warp is doing and why it cannot issue, and
attributes the sample to the instruction the warp is at. Summed over a whole kernel that gives
the "Warp State Statistics" section; per instruction it shows *which* load a warp waits for.
This script sums the samples by phase: the instructions before the hot loop (the loop that
holds most tensor-core products, ``HMMA``, or else the largest loop), each stretch of the
loop between two ``BAR.SYNC``, and the instructions after it. A phase that takes a large share
of the samples but runs once per block (a prologue) is the first thing to look at. Phases are
cut by address: code that the compiler moved out of the loop's line (a rarely taken branch,
placed after the kernel's end) counts as "after the loop"; the instruction list at the end
shows where the samples really sit.

Usage (on the GPU machine; ``verify_attn``'s tensor-core kernel as the example)::

    cd benchmarks
    ncu --clock-control none --kernel-name regex:mma_kernel --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o /tmp/attn \\
        python3 profile_kernels.py --attention --bf16 --nodes 64 --prefix 8192
    ncu -i /tmp/attn.ncu-rep --page source --csv --print-source sass > attn_source.csv
    python3 stall_phases.py attn_source.csv

(``bash benchmarks/run_gpu.sh attn-mma-stalls`` does all three.) The CSV has one row per SASS
instruction: its address, its text, the samples (``Warp Stall Sampling (All Samples)``) and
one column per stall reason (``stall_long_sb``: waiting for a global or local load;
``stall_short_sb``: for shared memory or a special function; ``stall_mio``: the shared-memory
instruction queue is full; ``stall_wait``: a fixed-latency dependency; ``stall_barrier``: at
``__syncthreads``; ``stall_math``: the pipe is busy; ``stall_selected``: issuing).
"""

from __future__ import annotations

import csv
import io
import re
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_source_csv(path: str) -> list:
    """The instruction rows of ``ncu --page source --csv --print-source sass`` output (its
    first line names the kernel; the header follows)."""
    with open(path) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def hot_loop(rows: list) -> tuple:
    """``(first, last)`` row indices of the loop that holds the most HMMA (or the most
    instructions when none has any): a backward branch and its target."""
    index = {int(r["Address"], 16): i for i, r in enumerate(rows)}
    best, best_key = None, None
    for i, r in enumerate(rows):
        match = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", r["Source"])
        if not match:
            continue
        target = index.get(int(match.group(1), 16))
        if target is None or target >= i:
            continue
        hmma = sum("HMMA" in rows[k]["Source"] for k in range(target, i + 1))
        key = (hmma, i - target)
        if best_key is None or key > best_key:
            best, best_key = (target, i), key
    if best is None:
        raise ValueError("stall_phases: no loop (backward branch) in this kernel's SASS")
    return best


def phases(rows: list) -> list:
    """``(name, first, last)`` for the code before the hot loop, each stretch of the loop
    that starts at one of its barriers (the stretch before the first barrier is named after
    the loop's head), and the code after it."""
    first, last = hot_loop(rows)
    bars = [k for k in range(first, last + 1) if "BAR.SYNC" in rows[k]["Source"]]
    cuts = [first] + [b for b in bars if b > first] + [last + 1]
    out = [("before the loop", 0, first - 1)]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        name = f"loop, barrier {bars.index(a) + 1} on" if a in bars else "loop, to barrier 1"
        out.append((name, a, b - 1))
    out.append(("after the loop", last + 1, len(rows) - 1))
    return out


def summary(rows: list, top: int = 12) -> str:
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(number(r[SAMPLES]) for r in rows) or 1.0
    lines = [f"{total:,.0f} stall samples; by reason (% of all):"]
    by_reason = Counter({k[6:]: sum(number(r[k]) for r in rows) for k in reasons})
    lines.append("  " + ", ".join(f"{k} {100 * v / total:.1f}" for k, v in
                                  by_reason.most_common() if v > 0))
    lines += ["", f"{'phase':<28} {'% samples':>9} {'warp instructions':>18}  top reasons"]
    for name, a, b in phases(rows):
        part = rows[a:b + 1]
        samples = sum(number(r[SAMPLES]) for r in part)
        executed = sum(number(r["Instructions Executed"]) for r in part)
        why = Counter({k[6:]: sum(number(r[k]) for r in part) for k in reasons})
        lines.append(f"{name:<28} {100 * samples / total:9.1f} {executed:18,.0f}  "
                     + ", ".join(f"{k} {100 * v / total:.1f}" for k, v in why.most_common(3)
                                 if v > 0))
    lines += ["", f"the {top} instructions with the most samples:"]
    for r in sorted(rows, key=lambda r: -number(r[SAMPLES]))[:top]:
        why = sorted(((number(r[k]), k[6:]) for k in reasons), reverse=True)[:2]
        lines.append(f"  {r['Address'][-5:]} {100 * number(r[SAMPLES]) / total:5.2f} %  "
                     f"{r['Source'].strip()[:58]:<58}  "
                     + " ".join(f"{k}:{v:.0f}" for v, k in why if v > 0)
                     + f"  (executed {number(r['Instructions Executed']):,.0f})")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python stall_phases.py SOURCE_CSV  (ncu --page source --csv "
              "--print-source sass)", file=sys.stderr)
        sys.exit(2)
    try:
        print(summary(read_source_csv(sys.argv[1])))
    except (OSError, StopIteration, ValueError, KeyError) as error:
        print(f"stall_phases: cannot read {sys.argv[1]}: {error}", file=sys.stderr)
        sys.exit(2)
