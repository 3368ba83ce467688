#!/bin/bash
# the compiled front, launch and commit (this tree) against d76d4d0 (unpacked in .devscratch/base),
# three rounds alternating on one host; the host-path and cuda suites; the launch paths
cd "$(dirname "$0")/../../.."  # the repository root
python -c "import sys; from runtime import native_build as nb; print(sys.version.split()[0], [(m, nb.load(m) is not None, nb.why_not(m)) for m in ('decode_pass', 'cache_rows', 'graph_launch')])"
python -m pytest -q tests/test_decode_pass.py tests/test_decode_pass_compiled.py tests/test_kv_cache.py tests/test_held_rows.py tests/test_host_fast_paths.py tests/test_graph_launch.py 2>&1 | tail -1 | tee $OUT/pytest_host.txt
python -m pytest -q -m cuda 2>&1 | tail -3 | tee $OUT/pytest_cuda.txt
python benchmarks/h200/scripts/launch_paths.py 2>&1 | tee $OUT/launch_paths.txt
A="--device cuda --iters 300 --positions 200,3000 --cases 1x1,1x3,8x1,32x1,32x3"
for r in 1 2 3; do
  for tree in . .devscratch/base; do
    echo "== round $r tree $tree hiddens tensor" | tee -a $OUT/bench_host.txt
    python $tree/tools/bench_host.py $A --hiddens tensor 2>&1 | tee -a $OUT/bench_host.txt
  done
done
echo "== tree . hiddens list" | tee -a $OUT/bench_host.txt
python tools/bench_host.py $A --hiddens list 2>&1 | tee -a $OUT/bench_host.txt
