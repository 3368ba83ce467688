"""CapturedExecutor: one CUDA graph per (batch bucket, K) replaying the eager steps.

The executor captures exactly the steps of an :class:`EagerExecutor` (same ops,
same arena, same static input buffers), so a replay equals an eager run bit for
bit. Capture follows the usual recipe: warm up on a side stream (module loads,
cuBLAS handles and workspaces happen outside the capture), then capture on that
stream into a graph that draws its temporaries from a memory pool shared by
every capture of the proposer. Nothing host-built is frozen into the graph: the
inputs are static device buffers written before each replay (one staging copy)
and read by the graph at replay time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch
from draftgraph.runtime.errors import CaptureError, InputError, describe
from draftgraph.runtime.execution import launch as raw_launch
from draftgraph.runtime.execution.eager import EagerExecutor, run_if_flag_set
from draftgraph.runtime.execution.raw_copy import current_device as _current_device
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.passes import DEFAULT_PASSES, Pass


class CapturedExecutor:
    """Capture ``graph`` at ``batch`` once; ``run()`` replays it.

    Parameters
    ----------
    static_inputs : name -> device tensor, optional
        The buffers the graph reads its inputs from (e.g. a ChainStaging's views);
        when given, ``run`` expects these very tensors (no copy). Otherwise the
        executor allocates its own and ``run`` copies into them.
    pool : a ``torch.cuda.graph_pool_handle()`` shared between captures.
    keep_graph : keep the cudaGraph_t (for ``debug_dump`` / ``raw_cuda_graph``).
    prologue : a function of no arguments captured before the steps (the staging copy
        from pinned memory, see ``ChainStaging.in_graph_copy``); None: nothing.
    epilogue : a function of the outputs captured after the steps (the drafts written to
        pinned memory, see ``ChainStaging.in_graph_read``); None: nothing.
    passes : the rewrites the graph runs after, as for :class:`EagerExecutor`.
    overlap : let ops fork work onto a side stream (``draftgraph.ops.overlap``): captured, it becomes a
        parallel branch of the graph.
    """

    num_captures = 0  # CUDA graphs captured in this process (each one a warm-up, a capture, an instantiate)

    def __init__(
        self,
        graph: Graph,
        batch: int,
        weights: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor] | None = None,
        *,
        device: torch.device | str = "cuda",
        runners: Mapping | None = None,
        static_inputs: Mapping[str, torch.Tensor] | None = None,
        pool=None,
        keep_graph: bool = False,
        warmup_runs: int = 2,
        kernels: str = "auto",
        prologue: Callable[[], None] | None = None,
        epilogue: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        overlap: bool = True,
        passes: Sequence[Pass] = DEFAULT_PASSES,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise CaptureError(describe("CapturedExecutor device", "a CUDA device", device, "use EagerExecutor"))
        self.eager = EagerExecutor(graph, batch, weights, state, device=device, runners=runners, kernels=kernels,
                                   overlap=overlap, passes=passes)
        self.graph_ir, self.batch, self.device = self.eager.graph, batch, device
        self.plan = self.eager.plan
        if static_inputs is None:
            static_inputs = {
                n: torch.zeros(self.graph_ir.values[n].spec.concrete(batch), dtype=self.graph_ir.values[n].spec.dtype,
                               device=device)
                for n in self.graph_ir.inputs
            }
        self.static_inputs = dict(static_inputs)
        self.eager.check_inputs(self.static_inputs)
        self.pool, self.keep_graph, self.warmup_runs = pool, keep_graph, warmup_runs
        self.prologue, self.epilogue = prologue, epilogue
        self.copies_staging = prologue is not None  # the proposer then stages without a copy
        self.cuda_graph: torch.cuda.CUDAGraph | None = None
        self.outputs: dict[str, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.tracer = None
        self.is_released = False
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        # How a replay launches (runtime/execution/launch.py): through torch until the first replay has
        # shown that the graph draws no random numbers, then its exec handle through _launch
        # (raw_launch.launcher: cudaGraphLaunch through cuda-python).
        self._replayed, self._exec = False, None
        self._own_exec: raw_launch.NodePriorityExec | None = None
        self._launch = None  # raw_launch.launcher of _exec, set with it
        self._static_mapping: Mapping[str, torch.Tensor] | None = None  # the inputs a run found to be the buffers

    @property
    def arena(self) -> torch.Tensor:
        return self.eager.arena

    def capture(self) -> None:
        """Warm up on a side stream, then capture every step into one CUDA graph."""
        start = time.perf_counter()
        CapturedExecutor.num_captures += 1
        self._drop_exec()  # a handle of an earlier capture's graph must never launch
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                self._run_steps()
        torch.cuda.current_stream(self.device).wait_stream(side)
        # Kept for the raw launch too: its own exec is instantiated from the graph (node priorities).
        # Not a gated graph (conditional nodes): the gated-chain GPU tests failed on that path
        # (H200, 3d9146f); it keeps torch's exec.
        keep = self.keep_graph or (raw_launch.is_enabled and not self.is_gated)
        graph = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
        tracer, self.eager.tracer = self.eager.tracer, None  # host hooks must not run inside a capture
        if self.is_gated and self.pool is None:  # a conditional node's body allocates from the capture's pool
            self.pool = torch.cuda.graph_pool_handle()
        self.eager.run_gated = self._capture_gated  # a gated segment becomes a conditional node
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=side):
                self.outputs = self._run_steps()
        except Exception as exc:
            raise CaptureError(f"capturing {self.graph_ir.name} at B={self.batch} failed: {exc}") from exc
        finally:
            self.eager.tracer = tracer
            self.eager.run_gated = run_if_flag_set
        if keep:
            graph.instantiate()
        torch.cuda.synchronize(self.device)
        self.cuda_graph = graph
        self.capture_seconds = time.perf_counter() - start

    @property
    def is_gated(self) -> bool:
        """Whether the graph has confidence gates (captured as CUDA conditional IF nodes)."""
        return any(flag is not None for flag, _ in self.eager.segments)

    def _capture_gated(self, flag: torch.Tensor, body) -> None:
        """Capture ``body`` into an IF node that runs it when ``flag`` is nonzero at replay time.

        Without conditional nodes (CUDA < 12.4, no cuda-python or NVRTC) the body is captured
        unconditionally: every step runs, and cut_drafts still cuts the same drafts.
        """
        from draftgraph.runtime.execution import conditional as graph_conditional

        if not graph_conditional.is_available():  # same drafts (cut_drafts masks them), no time saved
            body()
            return
        with graph_conditional.if_node(flag, self.pool):
            body()

    def _run_steps(self) -> dict[str, torch.Tensor]:
        if self.prologue is not None:
            self.prologue()
        outputs = self.eager.run(self.static_inputs, check=False)
        if self.epilogue is not None:
            self.epilogue(outputs)
        return outputs

    def run(self, inputs: Mapping[str, torch.Tensor], check: bool = True) -> dict[str, torch.Tensor]:
        """Copy inputs into the static buffers (unless they are those buffers), replay, return outputs."""
        # A propose's run: the staging's own buffers again, unchecked, untraced, launched directly.
        if (inputs is self._static_mapping and not check and self._launch is not None and self.tracer is None
                and raw_launch.is_enabled and _current_device() == self._device_index):
            self._launch()
            return self.outputs
        if self.is_released:
            raise CaptureError(f"{self.graph_ir.name} B={self.batch}: this captured graph was dropped (stale)")
        if check:
            self.eager.check_inputs(inputs)
        # A read-only mapping of the static buffers themselves (a ChainStaging's chain_inputs, handed
        # over on every propose) is checked once and remembered: later runs with it skip the loop.
        if inputs is not self._static_mapping:
            is_static = True
            for name in self.graph_ir.inputs:
                given, static = inputs[name], self.static_inputs[name]
                if given is not static and given.data_ptr() != static.data_ptr():
                    if given.shape != static.shape:
                        raise InputError(describe(f"input %{name}", list(static.shape), list(given.shape)))
                    static.copy_(given, non_blocking=True)
                    is_static = False
            if is_static and isinstance(inputs, MappingProxyType):
                self._static_mapping = inputs
        if self.cuda_graph is None:
            self.capture()
        start = time.perf_counter_ns()
        self.replay()
        if self.tracer is not None:
            self.tracer.slice(f"replay {self.graph_ir.name} B={self.batch}", start, time.perf_counter_ns() - start)
        return self.outputs

    def warm(self, inputs: Mapping[str, torch.Tensor] | None = None) -> None:
        """Capture now if not yet (a capture runs the steps twice first, compiling their kernels);
        the graph reads its static inputs, so ``inputs`` (the eager executor's argument) is unused."""
        if self.cuda_graph is None:
            self.capture()

    def replay(self) -> None:
        """Launch the captured graph as ``run`` does, on the inputs already staged (what benchmarks time)."""
        if self.cuda_graph is None:
            raise CaptureError(f"{self.graph_ir.name} B={self.batch}: nothing captured to replay (run it first)")
        if self._launch is not None and raw_launch.is_enabled and _current_device() == self._device_index:
            self._launch()
        elif not self._replayed:
            self._first_replay()
        else:
            self.cuda_graph.replay()

    def _first_replay(self) -> None:
        """Replay through torch; from then on launch directly when that replay drew no random numbers.

        The direct launch runs an exec of its own that keeps the kernel nodes' captured
        priorities (``raw_launch.node_priority_exec``: the urgent side lane's Sinkhorn ahead of
        GEMM tiles); torch's exec where that one cannot be made.
        """
        index, self._replayed = self._device_index, True
        if raw_launch.is_enabled and torch.cuda.current_device() == index:
            handle = raw_launch.exec_handle(self.cuda_graph)
            if raw_launch.draws_no_random_numbers(self.cuda_graph, index):
                self._own_exec = raw_launch.node_priority_exec(self.cuda_graph)
                self._exec = self._own_exec.handle if self._own_exec is not None else handle
                self._launch = raw_launch.launcher(self._exec, index) if self._exec is not None else None
        else:
            self.cuda_graph.replay()

    def _drop_exec(self) -> None:
        self._replayed, self._exec, self._launch = False, None, None
        if self._own_exec is not None:
            self._own_exec.close()
            self._own_exec = None

    def poison(self, byte: int = 0xFF) -> None:
        self.eager.poison(byte)

    def release(self) -> None:
        """Drop the CUDA graph; any later run raises CaptureError (a stale graph is never replayed)."""
        if self.cuda_graph is not None:
            self.cuda_graph.reset()
        self.cuda_graph = None
        self._drop_exec()
        self.outputs = {}
        self.is_released = True
