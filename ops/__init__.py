"""Op definitions: each module registers its ops (shape/dtype rule, aliasing declarations,
workspace, the torch implementation) in the IR's one registry when it is imported.

Importing this package registers every built-in op and, on CUDA, the fused Triton kernels
(``draftgraph.ops.triton``), which are chosen at bind time; the torch ops stay the reference and the CPU
path. ``DRAFTGRAPH_FUSED=0`` keeps the torch ops on CUDA too (baselines, bisection).
"""

import os

import torch

from . import attention, basic, body, collectives, combiner, draft_gate, embed, lm_head, mhc, moe, nonfinite, sampling  # noqa: F401

if torch.cuda.is_available() and os.environ.get("DRAFTGRAPH_FUSED", "1") != "0":
    from .triton import register_all

    register_all()
