"""The draft head as the executor binds it (the seed's ``circuit_draft()``), and its weights.

``prepare_weights`` turns a loaded checkpoint into the tensors the graph names:
the routed experts are stacked once into ``experts.stacked.{w1,w2,w3}`` [E, ...]
and the per-expert names stay as views of the stack (no copy), so an nn.Module
runner that wants ``experts.{e}.w1.weight`` sees the very same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.config import V4Config


def prepare_weights(
    config: V4Config, tensors: Mapping[str, torch.Tensor], device: torch.device, prefix: str = "mtp.0."
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> graph weights on ``device`` (experts stacked, per-expert views kept)."""
    out = {name: t.to(device) for name, t in tensors.items()}
    for w in ("w1", "w2", "w3"):
        names = [f"{prefix}ffn.experts.{e}.{w}.weight" for e in range(config.n_routed_experts)]
        stacked_name = f"{prefix}ffn.experts.stacked.{w}"
        if stacked_name in out:  # already stacked (e.g. a benchmark made it so): keep views in step
            for e, n in enumerate(names):
                out[n] = out[stacked_name][e]
            continue
        if not all(n in out for n in names):
            continue
        stacked = torch.stack([out[n] for n in names]).contiguous()  # [E, out, in]
        out[f"{prefix}ffn.experts.stacked.{w}"] = stacked
        for e, n in enumerate(names):
            out[n] = stacked[e]
    return out


@dataclass(frozen=True)
class DraftBinding:
    """What ``circuit_draft()`` returns: the draft head as the executor binds it.

    Attributes
    ----------
    graph : the K-draft chain as declared (the body one ``body`` node: its subgraph, or its runner);
        the executors run it after ``runtime.passes``.
    weights : name -> tensor, every ``@name`` of the graph.
    body_inputs : the body's interface, in order (streams, positions, kv_start, block_table).
    body_output : streams [B, C, D].
    runner : the bound body runner's name ("builtin" for the op subgraph).
    workspace_bytes : the body runner's declared scratch at the largest bucket.
    arena_bytes : the passed chain's planned arena at the largest bucket.
    """

    graph: Graph
    weights: Mapping[str, torch.Tensor]
    body_inputs: Mapping[str, TensorSpec]
    body_output: TensorSpec
    runner: str
    workspace_bytes: int
    arena_bytes: int
