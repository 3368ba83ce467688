"""Graph replays through cuda-python: ``cudaGraphLaunch`` on the captured graph's exec handle.

Why: ``CUDAGraph.replay()`` does more than the launch. Before it, it runs the RNG prologue
of every generator registered with the graph (a lock, and device-side seed and offset
updates); after it, a driver version query; in torch >= 2.12 also a Python check that the
graph's pool is alive. A propose's host time is tens of microseconds, so each of these
counts. A draft chain draws no random numbers (greedy drafting), and for such a graph the
launch alone is the whole replay. :class:`draftgraph.runtime.execution.captured.CapturedExecutor` takes this path
only after its first replay (through torch) left the device's default generator where it
was, so a graph that did consume random numbers keeps torch's replay.

A launch here took 4.06 us on the H200 host, ``CUDAGraph.replay()`` 4.69
(``benchmarks/h200/launch_paths_514f961.txt``); a compiled ``cuGraphLaunch`` saved 0.9 us more,
not worth a C extension beside this module (issue 26 removed it).

It launches an exec handle of its own (:class:`NodePriorityExec`), instantiated with
``cudaGraphInstantiateFlagUseNodePriority``: kernel nodes keep the priority of the stream they
were captured on (:mod:`draftgraph.ops.overlap`'s urgent lane), where torch's exec runs every node at the
priority of the launch stream.
"""

from __future__ import annotations

import torch
from draftgraph.runtime.execution.raw_copy import _cudart, _raw_stream

is_enabled = _cudart is not None and _raw_stream is not None  # a switch for benchmarks and tests


class RawLaunchError(RuntimeError):
    """cudaGraphLaunch returned an error."""


def exec_handle(cuda_graph: torch.cuda.CUDAGraph):
    """The graph's ``cudaGraphExec_t`` for :func:`launch`, or None where this path is unavailable."""
    raw = getattr(cuda_graph, "raw_cuda_graph_exec", None)  # torch >= 2.9
    if not is_enabled or raw is None:
        return None
    try:
        return _cudart.cudaGraphExec_t(init_value=int(raw()))
    except Exception:  # not instantiated, or a torch without the accessor's backing
        return None


class NodePriorityExec:
    """A ``cudaGraphExec_t`` of a kept graph that runs kernel nodes at their captured priorities.

    Owned here: ``close()`` (or the collector) destroys it. The graph it came from may be
    reset before or after; an exec does not refer to its graph.
    """

    def __init__(self, handle) -> None:
        self.handle = handle

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None and _cudart is not None:
            _cudart.cudaGraphExecDestroy(handle)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the context may be gone with the exec
            pass


def node_priority_exec(cuda_graph: torch.cuda.CUDAGraph) -> NodePriorityExec | None:
    """Instantiate a graph captured with ``keep_graph=True`` to use node priorities; None where unavailable."""
    raw = getattr(cuda_graph, "raw_cuda_graph", None)
    if not is_enabled or raw is None:
        return None
    try:
        graph = _cudart.cudaGraph_t(init_value=int(raw()))
    except Exception:  # not kept (keep_graph=False), or reset
        return None
    flags = _cudart.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagUseNodePriority
    err, handle = _cudart.cudaGraphInstantiateWithFlags(graph, int(flags))
    if err != _cudart.cudaError_t.cudaSuccess:
        raise RawLaunchError(f"cudaGraphInstantiateWithFlags(UseNodePriority) failed: {err.name}")
    return NodePriorityExec(handle)


def draws_no_random_numbers(cuda_graph: torch.cuda.CUDAGraph, device_index: int) -> bool:
    """Replay once through torch; True when that left the default generator's offset unchanged.

    A graph with RNG ops advances it by the graph's whole increment at every replay.
    """
    generator = torch.cuda.default_generators[device_index]
    before = generator.get_offset()
    cuda_graph.replay()
    return generator.get_offset() == before


def launch(handle, device_index: int) -> None:
    """Launch the graph on the current stream of ``device_index`` (the calling thread's device)."""
    (err,) = _cudart.cudaGraphLaunch(handle, _raw_stream(device_index))
    if err != _cudart.cudaError_t.cudaSuccess:
        raise RawLaunchError(f"cudaGraphLaunch failed: {err.name}")


def launcher(handle, device_index: int):
    """A zero-argument :func:`launch` of ``handle`` on the current stream of ``device_index``.

    The caller checks that ``device_index`` is the current device, as for :func:`launch`.
    """
    graph_launch, stream, success = _cudart.cudaGraphLaunch, _raw_stream, _cudart.cudaError_t.cudaSuccess

    def launch_one() -> None:
        (err,) = graph_launch(handle, stream(device_index))
        if err != success:
            raise RawLaunchError(f"cudaGraphLaunch failed: {err.name}")

    return launch_one
