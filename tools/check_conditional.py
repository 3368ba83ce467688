"""One-run diagnosis of CUDA graph conditional nodes (runtime.graph_conditional) on a GPU host.

    python tools/check_conditional.py

Prints the versions that matter, then PASS or FAIL for each step with the exception
text (and the innermost frames), and goes on after a failure where the next step can
still say something: an IF node graph (the first node, so the kernel is loaded mid-capture),
NVRTC compile and kernel load on their own, a WHILE node graph,
pool routing of body temporaries, an IF inside a WHILE, count_conditional_nodes. Exits 1
when any step failed.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import graph_conditional as gc  # noqa: E402

failures: list[str] = []


def step(name: str):
    def run(check):
        try:
            detail = check()
        except Exception as exc:  # report and go on: one run should show every failure
            failures.append(name)
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            for line in traceback.format_exception(type(exc), exc, exc.__traceback__)[-4:]:
                print("     " + line.rstrip().replace("\n", "\n     "))
        else:
            print(f"PASS {name}" + (f": {detail}" if detail else ""))
        return check

    return run


def _int32(value: int = 0) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int32, device="cuda")


def _expect(got, want, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: expected {want}, got {got}")


def versions() -> None:
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    try:
        import cuda.bindings

        print(f"cuda-bindings {cuda.bindings.__version__}")
        from cuda.bindings import driver

        print(f"driver supports CUDA {driver.cuDriverGetVersion()[1]}")
    except Exception as exc:
        print(f"cuda-bindings: {type(exc).__name__}: {exc}")
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        print(f"NVRTC {major}.{minor}")
        from cuda import pathfinder

        print(f"libnvrtc: {pathfinder.load_nvidia_dynamic_lib('nvrtc').abs_path}")
    except Exception as exc:
        print(f"NVRTC: {type(exc).__name__}: {exc}")
    if torch.cuda.is_available():
        print(f"device {torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    print(f"is_available: {gc.is_available()} ({gc._unavailable_reason() or 'ok'})")


def main() -> int:
    versions()
    if not torch.cuda.is_available():
        print("FAIL cuda: torch sees no CUDA device")
        return 1
    device = torch.cuda.current_device()

    # First, so the kernel is compiled and loaded mid-capture, as in real use; if this step
    # fails and the two after it pass, loading during a capture is the problem.
    @step("IF node, the first one (kernel loaded mid-capture): flag 1, 0, 1 -> counter 1, 1, 2")
    def _():
        pool = torch.cuda.graph_pool_handle()
        counter, around, flag = _int32(), _int32(), _int32()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            around.add_(1)
            with gc.if_node(flag, pool):
                counter.add_(1)
            around.add_(1)
        seen = []
        for value in (1, 0, 1):
            flag.fill_(value)
            graph.replay()
            torch.cuda.synchronize()
            seen.append(int(counter.item()))
        _expect(seen, [1, 1, 2], "counter after each replay")
        _expect(int(around.item()), 6, "work around the node")

    @step("compile the set-conditional kernel (NVRTC)")
    def _():
        major, minor = torch.cuda.get_device_capability(device)
        image, option = gc._compile_set_kernel(major * 10 + minor)
        return f"{option}, {len(image)} bytes"

    @step("load the kernel (cuModuleLoadData)")
    def _():
        return f"CUfunction {gc._set_kernel(device)}"

    @step("WHILE node: limits 5, 1 and a clear flag -> 5, 1, 0 trips")
    def _():
        pool = torch.cuda.graph_pool_handle()
        counter, limit, flag = _int32(), _int32(), _int32()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            with gc.while_node(flag, pool):
                counter.add_(1)
                torch.lt(counter, limit, out=flag)
        trips = []
        for start, bound in ((1, 5), (1, 1), (0, 5)):
            counter.zero_()
            limit.fill_(bound)
            flag.fill_(start)
            graph.replay()
            torch.cuda.synchronize()
            trips.append(int(counter.item()))
        _expect(trips, [5, 1, 0], "trips")

    @step("pool routing: body temporaries stay in the graph pool")
    def _():
        pool = torch.cuda.graph_pool_handle()
        a = torch.randn(1 << 16, device="cuda")
        b = torch.randn_like(a)
        out = torch.zeros_like(a)
        flag = _int32(1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            with gc.if_node(flag, pool):
                out.copy_(a * 2 + b)
        clutter = [torch.full_like(a, 1e6) for _ in range(8)]
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        for _ in range(100):
            graph.replay()
        torch.cuda.synchronize()
        _expect(torch.cuda.memory_allocated(), allocated, "memory_allocated after 100 replays")
        _expect(all(bool((t == 1e6).all()) for t in clutter), True, "tensors allocated after capture untouched")
        torch.testing.assert_close(out, a * 2 + b)

    @step("IF inside WHILE: 5 trips, 3 odd")
    def _():
        pool = torch.cuda.graph_pool_handle()
        counter, limit, flag, odd, odd_flag = _int32(), _int32(5), _int32(1), _int32(), _int32()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            with gc.while_node(flag, pool):
                counter.add_(1)
                torch.remainder(counter, 2, out=odd_flag)
                with gc.if_node(odd_flag, pool):
                    odd.add_(1)
                torch.lt(counter, limit, out=flag)
        graph.replay()
        torch.cuda.synchronize()
        _expect((int(counter.item()), int(odd.item())), (5, 3), "(trips, odd trips)")

    @step("count_conditional_nodes on a kept graph")
    def _():
        pool = torch.cuda.graph_pool_handle()
        flag, work = _int32(), _int32()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=pool):
            with gc.if_node(flag, pool):
                work.add_(1)
            with gc.while_node(flag, pool):
                flag.zero_()
        _expect(gc.count_conditional_nodes(graph), 2, "conditional nodes")

    @step("errors: no capture and a wrong flag raise ConditionalError, stream unchanged")
    def _():
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.current_stream()
        for flag in (_int32(1), torch.zeros(1, dtype=torch.int64, device="cuda")):
            try:
                with gc.if_node(flag, pool):
                    pass
            except gc.ConditionalError:
                pass
            else:
                raise AssertionError("no ConditionalError")
            _expect(torch.cuda.current_stream(), before, "current stream")

    print(f"{'FAILED: ' + ', '.join(failures) if failures else 'all steps passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
