"""The fused kernels' modules as the Triton tests load them: interpreted on a CPU, compiled on a GPU.

Imported by every Triton test file before anything imports triton. Without CUDA it sets
``TRITON_INTERPRET=1``, which must precede ``import triton``: triton's own ``tl.sum`` etc. are
made interpreted or compiled then. If triton was imported earlier without it, the importing
test module is skipped, with the hint.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = not HAS_CUDA
if INTERPRET:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if INTERPRET and type(triton.language.standard.sum).__name__ == "JITFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1",
                allow_module_level=True)


def _is_compiled(module) -> bool:
    return any(type(v).__name__ == "JITFunction" for v in vars(module).values())


def load_kernel_modules(names: Sequence[str]) -> dict:
    """``draftgraph.ops.triton.<name>`` for each name (give them in dependency order).

    Under the interpreter, if any of them was imported earlier without it (it holds compiled
    kernels), all are reloaded in the order given, so each binds the reloaded modules it imports;
    and the interpreter's fp32 -> bf16 cast is made to round as the GPU does.
    """
    mods = {}
    for name in names:
        full = f"draftgraph.ops.triton.{name}"
        mods[name] = sys.modules.get(full) or importlib.import_module(full)
    if INTERPRET:
        if any(_is_compiled(m) for m in mods.values()):
            mods = {name: importlib.reload(m) for name, m in mods.items()}
        importlib.import_module("draftgraph.ops.triton._common").patch_interpreter_rounding()
    return mods


def counting_carves(kernels: dict, monkeypatch, modules: Sequence[str] = ("moe", "moe_mxfp4")) -> list[int]:
    """Patch those kernel modules' ``carve``: every carve must fit the workspace it is handed;
    returns the list the carved bytes are appended to (the workspace rules' tightness tests)."""
    carved, real, common = [], kernels["_common"].carve, kernels["_common"]

    def carve(workspace, device, parts):
        need = common.scratch_bytes(parts)
        assert workspace is not None and workspace.numel() >= need, (need, None if workspace is None else workspace)
        carved.append(need)
        return real(workspace, device, parts)

    for module in modules:
        monkeypatch.setattr(kernels[module], "carve", carve)
    return carved
