#!/usr/bin/env bash
# One device call (the lent H200, a few minutes): the decode loop on the GPU (issue 27).
#
#   bash benchmarks/device_run_decode.sh OUT
#
# 1. the cuda tests of the decode loop, of the verify's two kernels (ops/triton/acceptance.py) and of
#    HiddenRows: captured loop == eager loop == greedy, nothing captured or compiled after warm-up,
#    the kernels captured and replayed over new inputs, a captured chain gathering rows by index;
# 2. bench_decode at K=3, B=1 and 16: tokens/s, eager vs captured, speculative vs greedy, the time
#    split by phase (the host gap a step: benchmarks/bench_loop_host.py on the CPU).
# Each step's output is OUT/<step>.txt; the last lines of each are printed.
set -uo pipefail
out=${1:?usage: device_run_decode.sh OUT}
source "$(dirname "$0")/device_steps.sh" "$out"
step pytest_decode 150 python3 -m pytest -q -m cuda -p no:cacheprovider -p no:warnings \
    tests/test_triton_acceptance.py tests/test_hidden_rows.py tests/test_decode_cuda.py
tail -2 "$out/pytest_decode.txt"
step bench_decode 150 python3 benchmarks/bench_decode.py --batches 1,16 --max-tokens 128 --repeat 3 -k 3
tail -6 "$out/bench_decode.txt"
