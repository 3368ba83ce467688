"""Random DAGs of the basic ops, for property tests of planning and aliasing."""

from __future__ import annotations

import random

import torch
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec

F32 = torch.float32


def random_graph(seed: int, num_nodes: int = 12, width: int = 8) -> tuple[Graph, dict[str, torch.Tensor]]:
    """A random valid graph over [B, width]-ish values, and its weights (seeded)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b = GraphBuilder(f"random{seed}")
    weights: dict[str, torch.Tensor] = {}
    pool = [b.input("x0", TensorSpec((B, width), F32))]
    if rng.random() < 0.5:
        pool.append(b.input("x1", TensorSpec((B, width), F32)))
    used: set[str] = set()

    def weight(name, shape):
        weights[name] = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
        return b.weight(name, TensorSpec(shape, F32))

    for i in range(num_nodes):
        flat = [v for v in pool if len(v.spec.shape) == 2]
        x = rng.choice(flat[-4:] if rng.random() < 0.7 else flat)
        kind = rng.choice(["linear", "add", "mul", "rms_norm", "softmax", "reshape", "linear"])
        dim = x.spec.shape[1]
        if kind == "linear":
            out_dim = rng.choice([4, 8, 16])
            y = b.op("linear", [x, weight(f"w{i}", (out_dim, dim))], name=f"n{i}")
        elif kind in ("add", "mul"):
            same = [v for v in flat if v.spec == x.spec]
            y = b.op(kind, [x, rng.choice(same)], name=f"n{i}")
        elif kind == "rms_norm":
            y = b.op("rms_norm", [x, weight(f"g{i}", (dim,))], name=f"n{i}", attrs={"eps": 1e-6})
        elif kind == "softmax":
            y = b.op("softmax", [x], name=f"n{i}")
        else:
            if dim % 2:
                continue
            r = b.op("reshape", [x], name=f"n{i}v", attrs={"shape": [B, 2, dim // 2]})
            used.add(x.name)
            y = b.op("reshape", [r], name=f"n{i}", attrs={"shape": [B, dim]})
            used.add(r.name)
        used.update(v for v in b.graph.nodes[y.producer].inputs)
        pool.append(y)
    # Every value nobody reads becomes a graph output (nothing dangles).
    sinks = [v for v in pool if v.name not in used and v.producer is not None]
    b.output(*sinks)
    return b.build(), weights


def random_inputs(graph: Graph, batch: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return {n: torch.randn(*graph.values[n].spec.concrete(batch), generator=gen) for n in graph.inputs}
