#!/usr/bin/env bash
# One batched GPU session: the test suite on the device, then every benchmark.
# Logs and CSVs go to $OUT (the device tool brings them back). Usage, from the repo root:
#   bash benchmarks/run_gpu.sh [all|tests|tests-a|tests-b|tests-c|bench|profile|attn|attn-mma|
#                               attn-profile|attn-mma-stalls|small|step|sampling|phases|
#                               targets|targets-tree|ab]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then   # numpy < 2.5 for numba-cuda 0.30 (see README)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    site=/tmp/site:
else
    site=
fi
export PYTHONPATH=$site$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv | tee "$OUT/gpu.txt"
python3 -m ddtree_numba info | tee -a "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = tests-a ] || [ "$what" = tests-b ] \
    || [ "$what" = tests-c ] || [ "$what" = all ]
then
    # The whole suite (about 2 000 tests) with 16 workers on a 16-core host. Most of its time
    # is numba compiling kernels: conftest.py turns numba's on-disk kernel cache on in a fresh
    # directory, so that a kernel one worker compiled loads in the others, and starts the tests
    # measured longest first, each followed by a short one (tests/gpu_test_seconds.tsv).
    # suite_timeline.py writes a line a test as it finishes: $OUT/suite_timeline.tsv, summed
    # up by `python benchmarks/suite_timeline.py FILE`. On 2026-12-06 a fresh H100 ran the whole
    # suite in 438 s, 1 945 passed and 85 skipped (benchmarks/NOTES.md, "Run 4"). `tests` runs
    # it as one command (TESTS_LIMIT seconds, an hour by default; 580 where the device tool
    # allows 600 s a command); tests-a, tests-b and tests-c split it into three, the files of
    # whole steps and examples first (xdist hands out one test at a time as workers finish:
    # conftest.py).
    first_a="tests/test_examples.py tests/test_greedy_step.py"
    first_c="tests/test_sampled_step.py tests/test_tree_sample_lossless.py
             tests/test_deepseek_v3.py tests/test_verify_attn.py tests/test_build_tree.py"
    first="$first_a $first_c"
    rest=$(ls tests/test_*.py | grep -v -x -F "$(tr -s ' \n' '\n' <<< "$first")")
    case $what in
        tests-a) files=$first_a ;;
        tests-b) files=$rest ;;
        tests-c) files=$first_c ;;
        *) files="$first $rest" ;;
    esac
    case $what in tests-a|tests-b|tests-c) limit=585 ;; *) limit=${TESTS_LIMIT:-3600} ;; esac
    # shellcheck disable=SC2086  # the file lists are meant to split into arguments
    DDTREE_GPU=1 SUITE_TIMELINE="$OUT/suite_timeline.tsv" PYTHONPATH=$PYTHONPATH:$PWD/benchmarks \
        timeout $limit python3 -m pytest -n 16 -q -p no:cacheprovider -p suite_timeline \
        -W ignore::pytest.PytestWarning -rfE --tb=long $files 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -15
fi
if [ "$what" = profile ] || [ "$what" = all ]; then
    for kernel in select_warp topk_kernel; do
        (cd benchmarks && timeout 120 ncu --clock-control none --kernel-name "regex:$kernel" \
            --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
            --section SourceCounters --metrics gpc__cycles_elapsed.avg.per_second \
            python3 profile_kernels.py) > "$OUT/ncu_$kernel.txt" 2>&1
        grep -E "Duration|cycles_elapsed|Stall|stall|Warp Cycles|Elapsed Cycles" \
            "$OUT/ncu_$kernel.txt" | head -30
    done
fi
if [ "$what" = phases ]; then    # clock marks: each phase of a block (phase_clock.py)
    (cd benchmarks && OUT="$OUT" timeout 300 python3 phase_clock.py) 2>&1 | grep -v Warn | tail -40
fi
if [ "$what" = attn-profile ]; then   # the tiled verify_attn at bs 1, N 16, P 1024, H 128
    (cd benchmarks && timeout 240 ncu --clock-control none --kernel-name regex:tiled \
        --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section InstructionStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --metrics smsp__inst_executed_pipe_fma.sum,smsp__inst_executed.sum,\
sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed_op_shared_ld.sum,\
'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python3 profile_kernels.py --attention ${PROFILE_ARGS:-}) > "$OUT/ncu_verify_attn.txt" 2>&1
    grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|\
Stall|Warp Cycles Per Issued|pipe_fma|inst_executed|bank_conflicts|wavefronts|Executed Ipc|Est. Local|stalled" \
        "$OUT/ncu_verify_attn.txt" | grep -v " 0$" | head -60
fi
if [ "$what" = attn-mma-stalls ]; then   # where the tensor-core kernel's warps wait, by phase
    (cd benchmarks && timeout 240 ncu --clock-control none --kernel-name regex:mma_kernel \
        --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats \
        --section SpeedOfLight --section Occupancy -o /tmp/attn_mma \
        python3 profile_kernels.py --attention --bf16 --nodes 64 --prefix 8192 \
        && ncu -i /tmp/attn_mma.ncu-rep --page source --csv --print-source sass \
            > /tmp/attn_mma_source.csv && python3 stall_phases.py /tmp/attn_mma_source.csv) \
        > "$OUT/ncu_attn_mma_stalls.txt" 2>&1
    head -24 "$OUT/ncu_attn_mma_stalls.txt"
fi
if [ "$what" = attn ] || [ "$what" = all ]; then
    (cd benchmarks && OUT="$OUT" timeout 400 python3 bench_verify_attn.py) 2>&1 \
        | tee "$OUT/bench_verify_attn.log" | grep -v "^{" | tail -80
fi
if [ "$what" = attn-mma ] || [ "$what" = all ]; then   # the tensor-core variant, bf16 cache
    (cd benchmarks && OUT="$OUT" timeout 300 python3 bench_verify_attn_mma.py) 2>&1 \
        | tee "$OUT/bench_verify_attn_mma.log" | grep -v "^{" | tail -14
fi
if [ "$what" = step ] || [ "$what" = all ]; then
    DDTREE_GPU=1 timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests/test_greedy_step.py \
        tests/test_toy_mla.py tests/test_ops.py 2>&1 | tee "$OUT/gpu_tests_step.log" | tail -8
    timeout 240 python3 -m ddtree_numba demo --plot "$OUT/demo_tree.png" 2>&1 \
        | tee "$OUT/demo_gpu.log" | tail -12
    (cd benchmarks && OUT="$OUT" timeout 400 python3 bench_step.py) 2>&1 \
        | tee "$OUT/bench_step.log" | grep -v "^{" | tail -20
    (cd benchmarks && OUT="$OUT" timeout 300 python3 decode_identity.py) 2>&1 \
        | tee "$OUT/decode_identity.log" | tail -10
fi
if [ "$what" = sampling ] || [ "$what" = all ]; then
    (cd benchmarks && OUT="$OUT" timeout 420 python3 bench_sampling.py) 2>&1 \
        | tee "$OUT/bench_sampling.log" | grep -v "^{" | tail -20
fi
if [ "$what" = targets ]; then   # the DDTree stages' target tables but build_tree's
    # (build_tree's is targets-tree: on a fresh machine the whole of bench_build_tree.py and the
    # benchmarks below do not fit one 600 s command; on 2026-12-06 an H100 took 240 s for
    # bench_small_kernels.py, and bench_ddtree_part.py ran into its 120 s cap of then)
    (cd benchmarks && OUT="$OUT" timeout 330 python3 bench_small_kernels.py --targets) 2>&1 \
        | tee "$OUT/bench_small_kernels.log" | grep -v "^{" | tail -24
    (cd benchmarks && OUT="$OUT" timeout 200 python3 bench_ddtree_part.py --quick) 2>&1 \
        | tee "$OUT/bench_ddtree_part.log" | grep -v "^{" | tail -6
fi
if [ "$what" = targets-tree ]; then   # build_tree's target table: four configurations, the
    # default select and the warp pops, the Python heap (bench_build_tree.py --targets)
    (cd benchmarks && OUT="$OUT" timeout 585 python3 bench_build_tree.py --targets) 2>&1 \
        | tee "$OUT/bench_build_tree_targets.log" | grep -v "^{" | tail -10
fi
if [ "$what" = ab ]; then   # a baseline tree's package, then this tree's, in one command
    # Usage: AB_BASE=<tree> bash benchmarks/run_gpu.sh ab [draft_topk [BS]|accept_commit|build_tree]
    # draft_topk: the --targets rows at bs BS (64 by default: the one-pass kernel; 1: the
    # resident one); accept_commit: bench_small_kernels' accept_commit table; build_tree:
    # bench_build_tree.py --quick (every select). The baseline is a copy of the package at an earlier commit, made
    # before the device run and carried to it:
    #   mkdir -p .ab/base && git archive <commit> ddtree_numba | tar -x -C .ab/base
    #   run(command="AB_BASE=.ab/base bash benchmarks/run_gpu.sh ab", carry=[".whl", ".ab"])
    # Both runs use this tree's benchmark scripts (the package's public calls are the same),
    # in one device command, so that the two tables come from the same machine and lease.
    script=bench_small_kernels.py
    case ${2:-draft_topk} in
        draft_topk) args="--targets --draft-topk-only --bs ${3:-64}" ;;
        accept_commit) args="--accept-commit-only" ;;
        build_tree) script=bench_build_tree.py args="--quick" ;;
        *) echo "run_gpu.sh ab: expected draft_topk, accept_commit or build_tree, got $2" >&2
           exit 2 ;;
    esac
    for tree in "${AB_BASE:?AB_BASE: the baseline tree, see above}" "$PWD"; do
        name=$([ "$tree" = "$PWD" ] && echo this || echo base)
        root=$(cd "$tree" && pwd) || exit 1
        mkdir -p "$OUT/$name"
        # shellcheck disable=SC2086  # $args is meant to split into arguments
        (cd benchmarks && PYTHONPATH=$site$root OUT="$OUT/$name" \
            timeout 270 python3 $script $args) 2>&1 \
            | tee "$OUT/$name/${script%.py}.log" | grep -v "^{" | tail -16
    done
fi
if [ "$what" = small ]; then
    (cd benchmarks && OUT="$OUT" timeout 240 python3 bench_small_kernels.py) 2>&1 \
        | tee "$OUT/bench_small_kernels.log" | grep -v "^{" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    (cd benchmarks && OUT="$OUT" timeout 900 python3 bench_build_tree.py) 2>&1 \
        | tee "$OUT/bench_build_tree.log" | grep -v "^{" | tail -14
    (cd benchmarks && OUT="$OUT" timeout 240 python3 bench_small_kernels.py) 2>&1 \
        | tee "$OUT/bench_small_kernels.log" | grep -v "^{" | tail -40
fi
