"""Host time of one graph launch, several ways, on a captured small-config chain (B=32, K=3).

    python benchmarks/h200/scripts/launch_paths.py

What a C launcher could save: cuda-python's cudaGraphLaunch (runtime.raw_launch, what a
propose uses), cuda-python's driver cuGraphLaunch, ctypes on libcuda's cuGraphLaunch (the
driver's own cost plus ctypes' ~0.5 us), and torch's CUDAGraph.replay(). Each launch is timed
alone with perf_counter (a synchronize every 8, outside the timing, so the queue stays short);
the median and the 10th percentile of 400, in two rounds alternating the ways.
"""

import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from runtime import raw_launch  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.proposer import DeepseekV4MtpProposer  # noqa: E402
from runtime.synthetic_weights import random_mtp_weights  # noqa: E402


def main() -> None:
    from cuda.bindings import driver

    cfg = V4Config.small()
    prop = DeepseekV4MtpProposer(cfg, random_mtp_weights(cfg, seed=0), device="cuda", executor="captured")
    b, k = 32, 3
    states = [prop.alloc_state() for _ in range(b)]
    hiddens = torch.randn(b, cfg.hc_mult, cfg.hidden_size, device="cuda").bfloat16()
    for _ in range(3):
        prop.propose_batch(list(range(b)), hiddens, [200] * b, k, states)
    executor = prop._plans[(b, k, False)].executor
    index = torch.cuda.current_device()
    exec_handle = executor._exec
    libcuda = ctypes.CDLL("libcuda.so.1")
    launch_c = libcuda.cuGraphLaunch
    launch_c.argtypes, launch_c.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    raw_stream = torch._C._cuda_getCurrentRawStream
    exec_ptr = int(exec_handle)
    driver_exec = driver.CUgraphExec(init_value=exec_ptr)
    ways = {
        "raw_launch (cuda-python cudaGraphLaunch)": lambda: raw_launch.launch(exec_handle, index),
        "cuda-python driver cuGraphLaunch": lambda: driver.cuGraphLaunch(driver_exec, raw_stream(index)),
        "ctypes libcuda cuGraphLaunch": lambda: launch_c(exec_ptr, raw_stream(index)),
        "raw_launch.launcher (graph_launch.c where built)": raw_launch.launcher(exec_handle, index),
        "torch CUDAGraph.replay()": executor.cuda_graph.replay,
        "executor.replay() (as a propose)": executor.replay,
    }
    results = {name: [] for name in ways}
    for _ in range(2):
        for name, fn in ways.items():
            for i in range(400):
                if i % 8 == 0:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                results[name].append(time.perf_counter() - t)
            torch.cuda.synchronize()
    print(f"{'launch':45s} {'median us':>10s} {'p10 us':>8s}")
    for name, times in results.items():
        times.sort()
        print(f"{name:45s} {statistics.median(times) * 1e6:10.2f} {times[len(times) // 10] * 1e6:8.2f}")


if __name__ == "__main__":
    main()
