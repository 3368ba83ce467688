"""``draftgraph capture-dump``: the captured CUDA graph of the K-draft chain, as DOT, plus a table
of kernel nodes per IR op.

The graph is captured with ``keep_graph=True``; cuda-python's ``cudaGraphDebugDotPrint``
writes the DOT of ``raw_cuda_graph()`` and ``cudaGraphGetNodes`` walks its nodes. Kernels
are attributed to IR ops by capture order: each op is also captured on its own into a
throwaway graph (the same kernels, since no op branches on data), and so is the staging
prologue (the copy from pinned memory and the hidden gather); the last line prints their sum
beside the whole graph's count, which it must equal. The first line also gives the nodes on
the critical path: ops that fork work onto a side stream (``draftgraph.ops.overlap``) shorten it; and how
many kernel nodes were captured at high priority (the urgent side lane's).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch
from draftgraph.runtime.errors import describe
from draftgraph.tools.cli import UsageError

EXAMPLES = """examples:
  draftgraph capture-dump --out chain.dot
  draftgraph capture-dump --out chain.dot --batch 8 --num-drafts 3
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("capture-dump", help="dump the captured CUDA graph (DOT) and kernels per IR op (GPU)",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="DOT file to write")
    p.add_argument("--batch", "-b", type=int, default=1)
    p.add_argument("--num-drafts", "-k", type=int, default=1)
    p.add_argument("--mode", choices=("streams", "collapsed"), default="streams")
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint folder (default: the embedded one)")
    p.add_argument("--kernels", choices=("auto", "torch", "compiled"), default="auto",
                   help="op implementations: fused where registered (auto), torch ops, or torch ops compiled")
    return p


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:  # cuda-python < 12.6 layout
        from cuda import cudart
    return cudart


def _check(result):
    err, *rest = result
    cudart = _cudart()
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


def graph_nodes(cuda_graph: torch.cuda.CUDAGraph) -> list:
    cudart = _cudart()
    raw = cudart.cudaGraph_t(init_value=int(cuda_graph.raw_cuda_graph()))
    _, count = _check(cudart.cudaGraphGetNodes(raw, 0))
    nodes, _ = _check(cudart.cudaGraphGetNodes(raw, count))
    return nodes


def graph_edges(cuda_graph: torch.cuda.CUDAGraph) -> list[tuple[int, int]]:
    """(from, to) node handles of every dependency edge.

    cuda-python 12 returns (err, from, to, count), 13 also the edge data before the count:
    the count is the last item either way.
    """
    cudart = _cudart()
    raw = cudart.cudaGraph_t(init_value=int(cuda_graph.raw_cuda_graph()))
    count = cudart.cudaGraphGetEdges(raw, 0)[-1]
    result = cudart.cudaGraphGetEdges(raw, count)
    _check((result[0], None))
    return [(int(a), int(b)) for a, b in zip(result[1], result[2])]


def critical_path(cuda_graph: torch.cuda.CUDAGraph) -> int:
    """Nodes on the longest dependency chain: what a replay waits for, launch after launch.

    A graph captured on one stream is one chain (every node on it); ops that fork work onto
    a side stream (``draftgraph.ops.overlap``) take that work off it.
    """
    import networkx as nx

    dag = nx.DiGraph()
    dag.add_nodes_from(int(node) for node in graph_nodes(cuda_graph))
    dag.add_edges_from(graph_edges(cuda_graph))
    return nx.dag_longest_path_length(dag) + 1 if dag.number_of_nodes() else 0


def node_types(cuda_graph: torch.cuda.CUDAGraph) -> Counter:
    cudart = _cudart()
    types = Counter()
    for node in graph_nodes(cuda_graph):
        kind = _check(cudart.cudaGraphNodeGetType(node))
        name = getattr(kind, "name", str(kind))  # e.g. cudaGraphNodeTypeKernel
        types[name.replace("cudaGraphNodeType", "")] += 1
    return types


def kernel_priorities(cuda_graph: torch.cuda.CUDAGraph) -> Counter:
    """Kernel nodes by the priority they were captured at (their stream's; lower is more urgent)."""
    cudart = _cudart()
    attr_ids = getattr(cudart, "cudaLaunchAttributeID", None) or cudart.cudaKernelNodeAttrID
    priority = getattr(attr_ids, "cudaLaunchAttributePriority", None) or attr_ids.cudaKernelNodeAttributePriority
    counts: Counter = Counter()
    for node in graph_nodes(cuda_graph):
        if _check(cudart.cudaGraphNodeGetType(node)) != cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel:
            continue
        counts[int(_check(cudart.cudaGraphKernelNodeGetAttribute(node, priority)).priority)] += 1
    return counts


def recapture(executor, keep_graph: bool = True):
    """A CapturedExecutor over the same graph, inputs and weights, keeping its cudaGraph_t."""
    from draftgraph.runtime.execution.captured import CapturedExecutor

    eager = executor.eager if hasattr(executor, "eager") else executor
    weights = {n: eager.bound[n] for n, v in eager.graph.values.items() if v.kind.value == "weight"}
    state = {n: eager.bound[n] for n, v in eager.graph.values.items() if v.kind.value == "state"}
    statics = getattr(executor, "static_inputs", None)
    kept = CapturedExecutor(eager.graph, eager.batch, weights, state, device=eager.device, static_inputs=statics,
                            keep_graph=keep_graph, runners={k: v for k, v in eager.runners.items()},
                            kernels=eager.kernels, prologue=getattr(executor, "prologue", None),
                            epilogue=getattr(executor, "epilogue", None), overlap=eager.side is not None)
    kept.capture()
    return kept


def count_kernel_nodes(executor) -> int:
    kept = recapture(executor)
    return node_types(kept.cuda_graph).get("Kernel", 0)


def kernels_per_op(kept) -> list[tuple[str, str, int]]:
    """(node, op, kernel nodes) for every step, by capturing each step on its own."""
    eager, inputs = kept.eager, kept.static_inputs
    rows = []
    side = torch.cuda.Stream()
    if kept.prologue is not None:  # the staging copy and the hidden gather (ChainStaging.in_graph_copy)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=side):
            kept.prologue()
        rows.append(("prologue", "(staging)", node_types(graph).get("Kernel", 0)))
    for step in eager.steps:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager._run_step(step, inputs)  # warm (handles, workspaces) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph, stream=side):
            eager._run_step(step, inputs)
        rows.append((step.node.name, step.node.op, node_types(graph).get("Kernel", 0)))
    if kept.epilogue is not None:  # the drafts written to pinned memory (ChainStaging.in_graph_read)
        outputs = {name: eager.bound[name] for name in eager.graph.outputs}
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=side):
            kept.epilogue(outputs)
        rows.append(("epilogue", "(drafts to host)", node_types(graph).get("Kernel", 0)))
    return rows


def run(args) -> int:
    from draftgraph.tools.arg_checks import check_batch, check_num_drafts, check_output_file

    check_output_file("--out", args.out)
    check_num_drafts(args.num_drafts)
    check_batch(args.batch)
    if not torch.cuda.is_available():
        raise UsageError(describe("capture-dump", "a CUDA GPU (it captures the chain and reads the graph's nodes)",
                                  "none visible (torch.cuda.is_available() is False)",
                                  "run it on a machine with a GPU; `draftgraph dump` prints the graph anywhere"))
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
    from draftgraph.tools.common import default_checkpoint

    path = args.checkpoint or default_checkpoint()
    prop = DeepseekV4MtpProposer.from_checkpoint(path, device="cuda", mode=args.mode, executor="captured",
                                                 buckets=(args.batch,), kernels=args.kernels)
    executor = prop._executor(args.batch, args.num_drafts, False)
    kept = recapture(executor)
    cudart = _cudart()
    raw = cudart.cudaGraph_t(init_value=int(kept.cuda_graph.raw_cuda_graph()))
    _check((cudart.cudaGraphDebugDotPrint(raw, str(args.out).encode(), 0)[0], None))
    types = node_types(kept.cuda_graph)
    per_op = kernels_per_op(kept)
    by_op: Counter = Counter()
    for _, op, n in per_op:
        by_op[op] += n
    total = sum(by_op.values())
    urgent = sum(n for level, n in kernel_priorities(kept.cuda_graph).items() if level < 0)
    print(f"wrote {args.out}: {sum(types.values())} nodes ({', '.join(f'{k} {v}' for k, v in types.most_common())}),"
          f" {critical_path(kept.cuda_graph)} on the critical path; {urgent} kernels at high priority")
    print(f"{'op':<18} {'kernels':>8} {'per step':>9}")
    for op, n in by_op.most_common():
        print(f"{op:<18} {n:>8} {n / args.num_drafts:>9.1f}")
    print(f"{'total':<18} {total:>8} {total / args.num_drafts:>9.1f}   (whole graph: {types.get('Kernel', 0)})")
    return 0
