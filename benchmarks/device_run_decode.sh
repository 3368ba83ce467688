#!/usr/bin/env bash
# One device call (the lent H200, a few minutes): the decode loop on the GPU (issue 27).
#
#   bash benchmarks/device_run_decode.sh OUT [BASE_DIR]
#
# 1. the cuda tests of the decode loop, of the verify's two kernels (ops/triton/acceptance.py), of
#    HiddenRows and of the staging copies: captured loop == eager loop == greedy, nothing captured or
#    compiled after warm-up, the kernels captured and replayed over new inputs, a captured chain
#    gathering rows by index, a stage waiting for the last copy only (not the graph after it);
# 2. bench_decode at K=3, B=1 and 16: tokens/s, eager vs captured, speculative vs greedy, the time
#    split by phase (the host gap a step: benchmarks/bench_loop_host.py on the CPU);
# 3. profile_decode at K=3: the device's own timeline of the captured loops (busy, idle, each graph's
#    span and kernels, the host gap from a wait to the next launch); then with --events (no
#    profiler): the idle before each graph;
# 4. KS (default "1 2"): bench_decode, captured only, at those K too (what K the loop should run);
# 5. BASE_DIR (an older checkout, `git archive REV | tar -x -C .base` here, carried with the call):
#    its bench_decode, captured only, at K=3, on the same machine: the before of a host-path change.
# Each step's output is OUT/<step>.txt; the last lines of each are printed.
set -uo pipefail
out=$(mkdir -p "${1:?usage: device_run_decode.sh OUT [BASE_DIR]}" && cd "$1" && pwd)  # absolute: step 5 runs in BASE_DIR
base=${2:-}
source "$(dirname "$0")/device_steps.sh" "$out"
step pytest_decode 150 python3 -m pytest -q -m cuda -p no:cacheprovider -p no:warnings \
    tests/test_triton_acceptance.py tests/test_hidden_rows.py tests/test_decode_cuda.py tests/test_raw_copy_cuda.py
tail -2 "$out/pytest_decode.txt"
step bench_decode 150 python3 benchmarks/bench_decode.py --batches 1,16 --max-tokens 128 --repeat 3 -k 3
tail -6 "$out/bench_decode.txt"
step profile_decode 120 python3 benchmarks/profile_decode.py --batches 1,16 --max-tokens 128 -k 3
tail -12 "$out/profile_decode.txt"
step profile_events 90 python3 benchmarks/profile_decode.py --batches 1,16 --max-tokens 128 -k 3 --events
grep -v "^#" "$out/profile_events.txt" | tail -16
for k in ${KS-1 2}; do
    step "bench_decode_k$k" 90 python3 benchmarks/bench_decode.py --batches 1,16 --max-tokens 128 --repeat 3 \
        -k "$k" --executors captured
    grep captured "$out/bench_decode_k$k.txt"
done
if [ -n "$base" ]; then
    # The older tree imports its own package: a folder holding only a link named draftgraph to it.
    link=$(mktemp -d) && ln -s "$(cd "$base" && pwd)" "$link/draftgraph"
    (cd "$base" && step bench_decode_base 90 env PYTHONPATH="$link" python3 benchmarks/bench_decode.py \
        --batches 1,16 --max-tokens 128 --repeat 3 -k 3 --executors captured)
    grep captured "$out/bench_decode_base.txt"
fi
