#!/usr/bin/env bash
# One device call on two GPUs (kind nvidia-h200-x2): the sharded draft step's GPU test, then
# bench_sharded at V4-Flash shapes on W=2 and, next to it, W=1 (issue 29).
#
#   bash benchmarks/device_run_sharded.sh OUT
#
# NVLink multicast stays off (the device machines' rule): NCCL_NVLS_ENABLE=0 and the others below.
set -uo pipefail
out=${1:?usage: device_run_sharded.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 || cat "$out/install.txt"
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_sharded_cuda.py >"$out/pytest_sharded_cuda.txt" 2>&1
tail -3 "$out/pytest_sharded_cuda.txt"
for world in 2 1; do
    timeout 200 torchrun --standalone --nproc-per-node "$world" benchmarks/bench_sharded.py --out "$out" \
        >"$out/bench_sharded_w$world.txt" 2>&1
    tail -6 "$out/bench_sharded_w$world.txt"
done
