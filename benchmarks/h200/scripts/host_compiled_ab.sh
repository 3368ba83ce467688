#!/bin/bash
# one device round: the compiled pass against the Python pass (bench_host), then the cuda suite
# (run at 379d92f, before bench_host had --rows: its rows were in lockstep then; now add --rows lockstep for the same)
cd "$(dirname "$0")/../../.."  # the repository root
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import sys; from runtime import decode_pass, native_build; print(sys.version.split()[0], decode_pass.native_loop(), native_build.why_not('decode_pass'))"
for r in 1 2; do
  for v in 1 0; do
    echo "== round $r DRAFTGRAPH_NATIVE=$v" | tee -a $OUT/bench_host.txt
    DRAFTGRAPH_NATIVE=$v python tools/bench_host.py --device cuda --iters 300 --cases 1x1,8x1,32x1,32x3 --hiddens tensor 2>&1 | tee -a $OUT/bench_host.txt
  done
done
python -m pytest -q tests/test_decode_pass.py tests/test_decode_pass_compiled.py 2>&1 | tail -2 | tee $OUT/pytest_pass.txt
python -m pytest -q -m cuda 2>&1 | tail -4 | tee $OUT/pytest_cuda.txt
