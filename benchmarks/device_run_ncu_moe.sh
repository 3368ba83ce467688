#!/usr/bin/env bash
# (GPU) What the B > 1 kernels wait on, instruction by instruction: ncu's source counters of the
# MXFP4 MoE's tensor-core kernels (w13, w2) and of one step's FP8 GEMVs, in the captured native chain
# at V4-Flash shapes (ab_chain.py, the defaults), each launch profiled alone (docs/KERNELS.md,
# "What is left", items 1 and 2: the next measurement before any more variants).
#
#   bash benchmarks/device_run_ncu_moe.sh OUT [CASES]     # CASES: default 32x1,8x1
#
# For each case, two ncu runs (the MoE's first w13 and w2 launches; the first six FP8 GEMV
# launches: one step's), then OUT/ncu_bB.txt (speed of light, occupancy, warp states, and
# ncu_sass.py's summary: samples by stall reason, the hottest instructions, the opcode mix) and
# OUT/sass_bB.csv.gz (the SASS source page, for a second look here). Not yet run: expected ~1 min an
# ncu run (the weights are made each time), 4 runs in all; each is cut at 200 s, so if a case runs
# long, give one case a call (`... OUT 32x1`, then `... OUT 8x1`).
set -uo pipefail
out=${1:?usage: device_run_ncu_moe.sh OUT [CASES]}
cases=${2:-32x1,8x1}
source "$(dirname "$0")/device_steps.sh" "$out"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
if [[ -z $ncu ]]; then
    echo "no ncu on this machine (PATH, /usr/local/cuda*/bin)"
    exit 1
fi
scratch=$(mktemp -d)  # the reports and logs stay here: at most 8 files come back from OUT
for case in ${cases//,/ }; do
    b=${case%x*}
    : >"$scratch/sass_b$b.csv"
    for kernels in "_w13_mma_kernel|_w2_mma_kernel:2" "_fp8_gemv_kernel:6"; do
        name=${kernels%:*} count=${kernels##*:} tag=$(echo "${name%%|*}" | tr -dc 'a-z0-9')
        echo "== B=$b $name (first $count launches)"
        timeout 200 "$ncu" --graph-profiling node --clock-control none --kernel-name "regex:$name" \
            --launch-count "$count" --section SpeedOfLight --section Occupancy --section WarpStateStats \
            --section SourceCounters -f -o "$scratch/b${b}_$tag" \
            python3 benchmarks/ab_chain.py --cases "$case" --rounds 1 base: >"$scratch/b${b}_$tag.log" 2>&1
        echo "   exit $?"
        tail -n 3 "$scratch/b${b}_$tag.log"
        "$ncu" --import "$scratch/b${b}_$tag.ncu-rep" --page details >>"$out/ncu_b$b.txt" 2>&1
        "$ncu" --import "$scratch/b${b}_$tag.ncu-rep" --page source --print-source sass --csv \
            >>"$scratch/sass_b$b.csv" 2>>"$out/ncu_b$b.txt"
    done
    python3 benchmarks/ncu_sass.py "$scratch/sass_b$b.csv" --top 30 | tee -a "$out/ncu_b$b.txt" | head -n 40
    gzip -c "$scratch/sass_b$b.csv" >"$out/sass_b$b.csv.gz"
done
