"""The ``torch_module`` runner: an independent nn.Module V4 block, optionally torch.compile'd.

It shares no code with the op subgraph (see v4_block_module.py), so agreement
between the two within bf16 tolerance is real evidence that both follow the spec.
"""

from __future__ import annotations

import torch
from draftgraph.runtime.model.v4_block_module import V4Block


class TorchModuleRunner:
    name = "torch_module"

    def __init__(self, compile: bool = False, prefix: str = "mtp.0.") -> None:
        self.compile = compile
        self.prefix = prefix
        self.block: V4Block | None = None
        self._forward = None

    def bind(self, config, weights, device) -> None:
        block = V4Block(config, hash_routed=False)
        block.load_block(dict(weights), self.prefix)
        self.block = block.to(device).eval()
        stacked = [weights.get(f"{self.prefix}ffn.experts.stacked.{w}") for w in ("w1", "w2", "w3")]
        # Sparse, capture-safe MoE (reads k experts per row) on bf16 stacks; block-scaled ones are
        # not stacked here: the module's own dequantised experts serve (V4Block.load_block).
        if all(isinstance(t, torch.Tensor) for t in stacked):
            self.block.ffn.stacked = tuple(stacked)
        forward = self.block.decode
        self._forward = torch.compile(forward, mode="max-autotune-no-cudagraphs") if self.compile else forward

    def workspace_bytes(self, batch: int) -> int:
        return 0

    @torch.no_grad()
    def __call__(self, streams, positions, kv_cache, kv_start, block_table, workspace) -> torch.Tensor:
        return self._forward(streams, positions, kv_cache, block_table, kv_start)


class CompiledTorchModuleRunner(TorchModuleRunner):
    name = "torch_module_compiled"

    def __init__(self) -> None:
        super().__init__(compile=True)
