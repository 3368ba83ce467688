#!/bin/bash
# the cuda suite and the decode-pass tests on the current tree, then the host bench (compiled vs Python loops)
cd "$(dirname "$0")/../../.."  # the repository root
python -c "import sys; from runtime import decode_pass, native_build; print(sys.version.split()[0], decode_pass.native_loop(), native_build.why_not('decode_pass'))"
python -m pytest -q tests/test_decode_pass.py tests/test_decode_pass_compiled.py tests/test_kv_cache.py 2>&1 | tail -1 | tee $OUT/pytest_pass.txt
python -m pytest -q -m cuda 2>&1 | tail -3 | tee $OUT/pytest_cuda.txt
B="python tools/bench_host.py --device cuda --iters 300 --hiddens tensor --positions 200,3000"
for r in 1 2; do
  for v in 1 0; do
    echo "== round $r DRAFTGRAPH_NATIVE=$v rows staggered" | tee -a $OUT/bench_host.txt
    DRAFTGRAPH_NATIVE=$v $B --cases 1x1,1x3,8x1,32x1,32x3 --rows staggered 2>&1 | tee -a $OUT/bench_host.txt
  done
done
