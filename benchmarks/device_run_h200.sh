#!/usr/bin/env bash
# The device calls (an H200) that issues 26 and 28 still owe the README's card.
#
#   bash benchmarks/device_run_h200.sh OUT [BASE_DIR]
#
# Steps (STEPS, a comma list, picks some; default all that apply, in this order):
# before   : BASE_DIR's own bench_draft, bf16 weights, fused kernels, the four cases: issue 26's
#            "before" in the same session as the "after" (BASE_DIR: an older tree carried with the
#            call, e.g. `git archive 046b506 | tar -x -C .base`, the tree before issue 26);
# table    : bench_draft, native and bf16 weights side by side, the four cases (issue 28's table;
#            the propose split, host µs and the [B, C, D] call: issue 26's "after");
# profile  : bench_draft --profile, native, B = 1, 8, 32: the chain's kernels by name, each step alone;
# barrier  : probe_grid_barrier.py: a grid barrier against a launch, a persistent GEMV chain against
#            a kernel a phase (whether the B=1 body as one kernel is worth building; ~1 min);
# suite    : the whole cuda suite (two workers; 170-230 s on a fresh machine, so last).
# RUN=N (default 1) names a repeat of before and table (OUT/before_N, OUT/draft_N): the lent hosts
# have slow spells that double a case's host time, so issue 26's table alternates the two trees
# over calls on one warm machine and compares the quietest run of each: OUT is new each call, so
# run `python benchmarks/compare_host.py --before .../before*/ --after .../draft*/` on the fetched
# folders of all the calls.
# At 2109df7 on a fresh H100 the first three took 223 s and the suite 202 s; the steps' limits add
# up to 840 s, past one call's 600, so the safe form is two calls on one warm machine (it idles
# out 30 s after a call): `STEPS=before,table,profile,barrier ... OUT .base`, then
# `STEPS=suite ... OUT`. Each step's output is OUT/<step>.txt; the summary lines are printed. On
# another card the numbers are that card's: say which in the results' file names.
set -uo pipefail
out=${1:?usage: device_run_h200.sh OUT [BASE_DIR]}
base=${2:-}
steps=,${STEPS:-before,table,profile,barrier,suite},
source "$(dirname "$0")/device_steps.sh" "$out"
out=$(cd "$out" && pwd)  # the before step runs in BASE_DIR
cases=1x1,1x3,8x1,32x1
run=${RUN:-1}
sfx=$([[ $run == 1 ]] || echo "_$run")
if [[ $steps == *,before,* && -n $base ]]; then
    # The older tree imports its own package: a folder holding only a link named draftgraph to it,
    # first on the path (this tree is installed, and would be found otherwise).
    link=$(mktemp -d) && ln -s "$(cd "$base" && pwd)" "$link/draftgraph"
    mkdir -p "$out/before$sfx"
    (cd "$base" && export PYTHONPATH="$link" && step "before$sfx" 150 python3 benchmarks/bench_draft.py --kernels fused \
        --cases "$cases" --no-compile --no-plain --out "$out/before$sfx")
    grep -A12 "^floor = " "$out/before$sfx.txt"
fi
if [[ $steps == *,table,* ]]; then
    step "table$sfx" 170 python3 benchmarks/bench_draft.py --weights native,bf16 --kernels fused --cases "$cases" \
        --no-compile --no-plain --out "$out/draft$sfx"
    grep -A12 "^floor = " "$out/table$sfx.txt"
fi
if [[ -d $out/before$sfx && -d $out/draft$sfx ]]; then  # issue 26's table from this call's runs
    python3 benchmarks/compare_host.py --before "$out"/before*/ --after "$out"/draft*/ | tee "$out/compare_host.txt"
fi
if [[ $steps == *,profile,* ]]; then
    step profile 150 python3 benchmarks/bench_draft.py --weights native --kernels fused --cases 1x1,8x1,32x1 \
        --no-compile --no-plain --profile
    grep -E "kernels=fused: kernels" "$out/profile.txt"
fi
if [[ $steps == *,barrier,* ]]; then
    step barrier 120 python3 benchmarks/probe_grid_barrier.py
    cat "$out/barrier.txt"
fi
if [[ $steps == *,suite,* ]]; then
    step pytest_cuda 250 python3 -m pytest -q -rs -m cuda -n 2 -p no:cacheprovider -p no:warnings tests
    tail -3 "$out/pytest_cuda.txt"
fi
