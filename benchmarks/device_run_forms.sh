#!/usr/bin/env bash
# One device call (under 10 minutes): the FP8 GEMV variants owed a GPU since the batch-1 forms
# (fp8_linear's note "batch 1 forms") and the 2-warp dot tiles, each step under its own limit.
#
#   bash benchmarks/device_run_forms.sh OUT
#
# 1. the cuda tests of fp8_gemv and the MoE (the forms' tests among them);
# 2. the chain at B=1, in one process, forms 0 / 2 / 2 with the next tile ahead / 2 on 4 x 512 tiles;
# 3. the chain at B=8 and 32: the dot tiles on 4 warps (config_for's) against 2, and at 2-16 rows
#    against 64-row tiles on 4 warps (wgmma: no warp converts another's rows);
# 4. each variant alone at the chain's shapes past a cold L2 (probe_fp8_gemv.py);
# 5. what reading 33.6 MB costs a plain kernel, a copy and the bf16 GEMV (probe_l2_prefetch.py floor).
# Each step's output is OUT/<step>.txt; the summary lines are printed. What pays goes into the
# defaults (BATCH1_FORM, BATCH1_TILE_AHEAD, BATCH1_CONFIG, DEFAULT, LARGE_BATCH_CONFIG), then the
# whole cuda suite runs on the new defaults.
set -uo pipefail
out=${1:?usage: device_run_forms.sh OUT}
source "$(dirname "$0")/device_steps.sh" "$out"
step pytest_forms 100 python3 -m pytest -q -m cuda -p no:cacheprovider -p no:warnings \
    tests/test_triton_fp8_mxfp4.py -k "fp8_gemv or moe_mxfp4"
tail -2 "$out/pytest_forms.txt"
step ab_batch1 140 python3 benchmarks/ab_chain.py --cases 1x1 --rounds 2 base: f2:fp8_linear.BATCH1_FORM=2 \
    "f2 ahead:fp8_linear.BATCH1_FORM=2+fp8_linear.BATCH1_TILE_AHEAD=1" \
    "f2 4x512:fp8_linear.BATCH1_FORM=2+fp8_linear.BATCH1_CONFIG=4,512,1,6,fma"
grep " mean " "$out/ab_batch1.txt"
step ab_dot 150 python3 benchmarks/ab_chain.py --cases 8x1,32x1 --rounds 2 base: \
    "dot w2:fp8_linear.DEFAULT=32,128,2,6+fp8_linear.LARGE_BATCH_CONFIG=32,128,2,6" \
    "dot 64 wgmma:fp8_linear.DEFAULT=64,128,4,3"
grep " mean " "$out/ab_dot.txt"
step probe_fp8_gemv 120 python3 benchmarks/probe_fp8_gemv.py
cat "$out/probe_fp8_gemv.txt"
step probe_floor 60 python3 benchmarks/probe_l2_prefetch.py floor
cat "$out/probe_floor.txt"
