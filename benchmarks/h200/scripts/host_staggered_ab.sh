#!/bin/bash
# the compiled pass + ensure against the Python loops (DRAFTGRAPH_NATIVE=0), rows staggered and lockstep
cd "$(dirname "$0")/../../.."  # the repository root
python -c "import sys; from runtime import decode_pass, native_build; print(sys.version.split()[0], decode_pass.native_loop(), native_build.why_not('decode_pass'))"
B="python tools/bench_host.py --device cuda --iters 300 --hiddens tensor"
for r in 1 2; do
  for v in 1 0; do
    echo "== round $r DRAFTGRAPH_NATIVE=$v rows staggered" | tee -a $OUT/bench_host.txt
    DRAFTGRAPH_NATIVE=$v $B --cases 1x1,1x3,8x1,32x1,32x3 --positions 3000 --rows staggered 2>&1 | tee -a $OUT/bench_host.txt
  done
done
echo "== DRAFTGRAPH_NATIVE=1 rows staggered, position 200" | tee -a $OUT/bench_host.txt
$B --cases 1x1,1x3,8x1,32x1,32x3 --positions 200 --rows staggered 2>&1 | tee -a $OUT/bench_host.txt
echo "== DRAFTGRAPH_NATIVE=1 rows lockstep" | tee -a $OUT/bench_host.txt
$B --cases 1x1,8x1,32x1,32x3 --positions 3000 --rows lockstep 2>&1 | tee -a $OUT/bench_host.txt
