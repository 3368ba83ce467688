#!/usr/bin/env bash
# One device call (the lent H200, under 10 minutes): the native-format kernels and chain,
# each step under its own time limit so that a slow one leaves the others their results.
#
#   bash benchmarks/device_run_native.sh OUT
#
# 1. the cuda tests of the FP8 / MXFP4 kernels and the native chain (issue 28's correctness);
# 2. bench_kernels --weights native --tune: the FP8 GEMV and MXFP4 MoE tiles, per op against its floor;
# 3. bench_draft on the tiles step 2 chose, native and bf16 weights side by side, the four cases
#    (issue 28's table);
# (The decode loop has its own call: benchmarks/device_run_decode.sh.)
# Each step's output is OUT/<step>.txt; the last lines of each are printed.
# A shorter call for a change to the MoE kernels (about 6 minutes): the MoE's and the chain's tests,
# the batch-1 MoE tiles tuned, the chain at B=1 and 8:
#   TESTS=moe TUNE_JOBS=moe:1 CASES=1x1,1x3,8x1 bash benchmarks/device_run_native.sh OUT
# TESTS may also be a pytest -k expression over the three files (e.g. "moe or native or fp8_gemv"),
# OPS the ops bench_kernels times with TUNE_JOBS (default moe), TUNE_S its tuning budget (default 40 s),
# PYTEST_S the tests' time limit (default 150 s), PHASES the batches of the per-launch times (default 1;
# e.g. 1,8,32: the attention's GEMVs and the MoE's launches apart at B > 1, not yet run on a GPU).
set -uo pipefail
out=${1:?usage: device_run_native.sh OUT}
source "$(dirname "$0")/device_steps.sh" "$out"
if [ "${TESTS:-all}" != all ]; then
    k=$TESTS
    [ "$k" = moe ] && k="moe or e2m1 or native"
    step pytest_native "${PYTEST_S:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider -p no:warnings \
        tests/test_triton_fp8_mxfp4.py -k "$k" tests/test_triton_moe_shard.py tests/test_native_proposer.py
else
    step pytest_native 200 python3 -m pytest -q -m cuda -p no:cacheprovider -p no:warnings \
        tests/test_triton_fp8_mxfp4.py tests/test_triton_moe_shard.py tests/test_native_proposer.py \
        tests/test_fp8_head.py tests/test_triton_nonfinite.py
fi
tail -2 "$out/pytest_native.txt"
if [ -n "${TUNE_JOBS:-}" ]; then
    step bench_kernels $((${TUNE_S:-40} + 40)) python3 benchmarks/bench_kernels.py --weights native --tune \
        --tune-jobs "$TUNE_JOBS" --budget-s "${TUNE_S:-40}" --ops "${OPS:-moe}" --out "$out/kernels"
else
    step bench_kernels 180 python3 benchmarks/bench_kernels.py --weights native --tune --budget-s 110 \
        --ops linear,moe,swa_attention --phase-batches "${PHASES:-1}" --out "$out/kernels"
fi
grep "tune ->" "$out/kernels/bench_kernels.log"
grep -E "^(linear|moe|swa_attention) +v4-flash" "$out/bench_kernels.txt"
tuned=()  # the tiles step 2 chose, if it finished
[ -f "$out/kernels/bench_kernels.json" ] && tuned=(--kernel-configs "$out/kernels/bench_kernels.json")
step bench_draft 170 python3 benchmarks/bench_draft.py --weights native,bf16 --kernels fused \
    --cases "${CASES:-1x1,1x3,8x1,32x1}" --no-compile --no-plain --out "$out/draft" "${tuned[@]}"
grep -A12 "^floor = " "$out/bench_draft.txt"
