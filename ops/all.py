"""Importing this module registers every built-in op (and, on CUDA, the fused Triton kernels)."""

import os

import torch

from ops import attention, basic, body_runner, combine, draft_gate, embed, lm_head, mhc, moe, sampling  # noqa: F401

# Fused kernels are chosen at bind time on CUDA (EagerExecutor.select_impl); the torch ops stay the
# reference and the CPU path. DRAFTGRAPH_FUSED=0 keeps the torch ops on CUDA too (baselines, bisection).
if torch.cuda.is_available() and os.environ.get("DRAFTGRAPH_FUSED", "1") != "0":
    from ops.triton import register_all

    register_all()
