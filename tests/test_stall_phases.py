"""benchmarks/stall_phases.py: Nsight Compute's stall samples summed by phase of the hot loop."""

import csv
import importlib.util
import io
import os

import pytest
from scripts import ROOT, run

SCRIPT = os.path.join(ROOT, "benchmarks", "stall_phases.py")
_spec = importlib.util.spec_from_file_location("stall_phases", SCRIPT)
stall_phases = importlib.util.module_from_spec(_spec)     # a script, not a package module
_spec.loader.exec_module(stall_phases)

REASONS = ["stall_long_sb", "stall_barrier", "stall_short_sb"]


def source_csv(tmp_path, program):
    """An ``ncu --page source --csv`` file: a kernel-name line, the header, one row per
    ``(source, samples, executed, reason)`` instruction, 16 bytes apart from 0x1000."""
    out = io.StringIO()
    out.write('"Kernel Name","k"\n')
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(["Address", "Source", stall_phases.SAMPLES, "Instructions Executed"]
                    + REASONS + [r + " (Not Issued)" for r in REASONS])
    for n, (text, samples, executed, reason) in enumerate(program):
        stalls = [samples if r == reason else 0 for r in REASONS]
        writer.writerow([hex(0x1000 + 16 * n), text, samples, executed] + stalls + stalls)
    path = tmp_path / "source.csv"
    path.write_text(out.getvalue())
    return str(path)


PROGRAM = [
    ("LDG.E R1, [R2]", 30, 8, "stall_long_sb"),              # 0x1000 before the loop
    ("IADD3 R3, R3, 0x1, RZ", 0, 80, None),                 # 0x1010 loop head
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 10, 80, "stall_barrier"),   # 0x1020 barrier 1
    ("HMMA.16816.F32.BF16 R4, R8, R12, R4", 40, 80, "stall_short_sb"),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 20, 80, "stall_barrier"),   # 0x1040 barrier 2
    ("@P0 BRA 0x1010", 0, 80, None),                        # 0x1050 back to the head
    ("EXIT", 0, 8, None),                                   # 0x1060 after the loop
]


def test_samples_are_summed_by_phase_of_the_hot_loop(tmp_path):
    rows = stall_phases.read_source_csv(source_csv(tmp_path, PROGRAM))
    assert stall_phases.hot_loop(rows) == (1, 5)
    assert stall_phases.phases(rows) == [("before the loop", 0, 0), ("loop, to barrier 1", 1, 1),
                                         ("loop, barrier 1 on", 2, 3),
                                         ("loop, barrier 2 on", 4, 5),
                                         ("after the loop", 6, 6)]
    text = stall_phases.summary(rows, top=2)
    by_reason = text.splitlines()[1]
    assert all(part in by_reason for part in ("short_sb 40.0", "long_sb 30.0", "barrier 30.0"))
    phase_lines = {line.split("  ")[0].strip(): line for line in text.splitlines()
                   if line.startswith(("before", "loop", "after"))}
    assert phase_lines["loop, barrier 1 on"].split()[4] == "50.0"     # 10 + 40 of 100
    assert phase_lines["before the loop"].split()[3] == "30.0"


def test_a_kernel_without_a_loop_or_a_bad_file_is_one_line_and_exit_2(tmp_path):
    rows = stall_phases.read_source_csv(source_csv(tmp_path, PROGRAM[:1] + PROGRAM[-1:]))
    with pytest.raises(ValueError, match="no loop"):
        stall_phases.hot_loop(rows)
    bad = tmp_path / "bad.csv"
    bad.write_text("not a source page\n")
    done = run([SCRIPT, str(bad)])
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("stall_phases: cannot read")
