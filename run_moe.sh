# this session's last device call (not committed): the fp16 MXFP4 decode's cuda tests and timings
set -uo pipefail
out=$1
source benchmarks/device_steps.sh "$out"
step pytest 100 python3 -m pytest -q -m cuda -x -p no:cacheprovider -p no:warnings \
    tests/test_triton_fp8_mxfp4.py -k "moe or native" tests/test_native_proposer.py
tail -3 "$out/pytest.txt"
step kernels 45 python3 benchmarks/bench_kernels.py --weights native --ops moe --out "$out/kernels"
grep -E "^moe +v4-flash|phase moe" "$out/kernels.txt" "$out/kernels/bench_kernels.log" | head -12
step draft 45 python3 benchmarks/bench_draft.py --weights native --kernels fused --cases 1x1,8x1 --no-compile \
    --no-plain --out "$out/draft"
grep -A6 "^floor = " "$out/draft.txt"
step draft_rows_off 30 python3 benchmarks/bench_draft.py --weights native --kernels fused --cases 8x1 --no-compile \
    --no-plain --out "$out/draft_rows_off" --kernel-configs rows_off.json
grep -A4 "^floor = " "$out/draft_rows_off.txt"
