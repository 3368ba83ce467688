#!/usr/bin/env bash
# One device call (an H200, under 10 minutes): what issues 26 and 28 still owe the README's card.
#
#   bash benchmarks/device_run_h200.sh OUT
#
# 1. bench_draft: native and bf16 weights side by side, the four cases (issue 28's table; the
#    propose split, host µs and the [B, C, D] call: issue 26's table);
# 2. bench_draft --profile, native, B = 1, 8, 32: the chain's kernels by name and each step alone;
# 3. the whole cuda suite (two workers; 170-230 s on a fresh machine lately, so last: the limit of
#    a call cuts it, not the tables).
# Each step's output is OUT/<step>.txt; the summary lines are printed. On another card the numbers
# are that card's: say which in the results' file names.
set -uo pipefail
out=${1:?usage: device_run_h200.sh OUT}
source "$(dirname "$0")/device_steps.sh" "$out"
step bench_draft 170 python3 benchmarks/bench_draft.py --weights native,bf16 --kernels fused \
    --cases 1x1,1x3,8x1,32x1 --no-compile --no-plain --out "$out/draft"
grep -A12 "^floor = " "$out/bench_draft.txt"
step profile 150 python3 benchmarks/bench_draft.py --weights native --kernels fused --cases 1x1,8x1,32x1 \
    --no-compile --no-plain --profile
grep -E "kernels=fused: kernels" "$out/profile.txt"
step pytest_cuda 250 python3 -m pytest -q -m cuda -n 2 -p no:cacheprovider -p no:warnings tests
tail -3 "$out/pytest_cuda.txt"
