#!/bin/bash
# host noise: the process pinned to one core of the GPU's NUMA node against unpinned
# (run at 379d92f, before bench_host had --rows: its rows were in lockstep then; now add --rows lockstep for the same)
cd "$(dirname "$0")/../../.."  # the repository root
nproc; python -c "import os; print(sorted(os.sched_getaffinity(0)))"
lscpu | grep -iE "model name|numa|mhz|socket|thread" ; nvidia-smi topo -m 2>&1 | head -8
cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null
CPU=$(python - <<'PY'
import os
cpus = sorted(os.sched_getaffinity(0))
print(cpus[len(cpus)//2])
PY
)
echo "pin to cpu $CPU"
for r in 1 2; do
  for pin in no yes; do
    echo "== round $r pinned=$pin" | tee -a $OUT/bench_host_pin.txt
    if [ $pin = yes ]; then P="taskset -c $CPU"; else P=""; fi
    $P python tools/bench_host.py --device cuda --iters 300 --cases 1x1,8x1,32x1,32x3 --positions 3000 --hiddens tensor 2>&1 | tee -a $OUT/bench_host_pin.txt
  done
done
