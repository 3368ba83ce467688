#!/usr/bin/env bash
# One device call (the lent H200): the draft benchmark's table on this tree and on an older tree
# in the same session, side by side, then the GPU test suite on this tree.
#
#   bash benchmarks/device_run.sh OUT [BASE_DIR]
#
# OUT: where the results go ($OUT on the device). BASE_DIR: an older checkout to compare with,
# e.g. `git archive 873b0e1 | tar -x -C .base` here, carried with the call; it runs its own
# bench_draft (tools/bench_draft.py before the package layout, benchmarks/bench_draft.py after).
# WEIGHTS (default native,bf16): this tree's weight formats, e.g. WEIGHTS=bf16 beside a tree
# older than issue 28; PYTEST=0: no cuda suite after the benchmark.
set -uo pipefail
out=${1:?usage: device_run.sh OUT [BASE_DIR]}
base=${2:-}
cases=1x1,1x3,8x1,32x1
flags=(--cases "$cases" --kernels torch,fused --no-plain --no-compile)
mkdir -p "$out/after" "$out/before"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
if [ -n "$base" ]; then
    # The older tree imports its own package: a folder holding only a link named draftgraph to it,
    # first on the path (this tree is installed only after).
    script=tools/bench_draft.py
    [ -f "$base/benchmarks/bench_draft.py" ] && script=benchmarks/bench_draft.py
    link=$(mktemp -d) && ln -s "$(cd "$base" && pwd)" "$link/draftgraph"
    echo "python $script ${flags[*]} --out \$OUT/before  (benchmarks/device_run.sh, in $base)" >"$out/before/log.txt"
    (cd "$base" && PYTHONPATH="$link" python3 "$script" "${flags[@]}" --out "$out/before" >>"$out/before/log.txt" 2>&1)
fi
# The package as users install it (offline: no dependencies fetched, no build isolation).
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 || cat "$out/install.txt"
echo "python benchmarks/bench_draft.py ${flags[*]} --weights ${WEIGHTS:-native,bf16} --out \$OUT/after  (benchmarks/device_run.sh)" >"$out/after/log.txt"
python3 benchmarks/bench_draft.py "${flags[@]}" --weights "${WEIGHTS:-native,bf16}" --out "$out/after" >>"$out/after/log.txt" 2>&1
# PYTEST=0: the benchmark only (the cuda suite has grown past what fits beside it in one 10-minute call).
if [ "${PYTEST:-1}" != 0 ]; then
    timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider >"$out/pytest_cuda.txt" 2>&1
    tail -3 "$out/pytest_cuda.txt"
fi
for side in before after; do
    [ -f "$out/$side/log.txt" ] || continue
    echo "== $side"; grep -A40 "^floor = " "$out/$side/log.txt" | grep -v "^{" | head -30
done
