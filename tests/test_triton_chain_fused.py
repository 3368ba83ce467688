"""The whole chain on the fused impls, as the executor lays out their inputs: none falls back.

Each fused impl (``draftgraph.ops.triton._impls``) runs its kernels only for the inputs they
take (contiguous rows, dtypes, sizes) and calls its op's torch form otherwise. A layout change
upstream can send a node to its torch form silently: the drafts stay right and only a GPU profile
shows the extra launches (at e901c32, the positions' column of the metadata block sent
``drop_nonfinite`` to its four torch launches at every B > 1). Here every step of the small
config's chain at batch 1 and 3 (bucket 4) is bound to its fused impl under the interpreter,
every torch form those impls can call is made to record its call, and none may be called; the
drafts must equal the torch ops'. CPU only: the layouts are the executor's, not the device's.
"""

from __future__ import annotations

import pytest
import torch

# Before anything imports triton: without CUDA it sets the interpreter up (tests/triton_modules.py).
from triton_modules import INTERPRET, load_kernel_modules

MODULES = ["_common", "fp8_round", "gemv", "moe_grouped", "fp8_linear", "moe_mxfp4", "moe", "mhc", "head", "attention",
           "gate", "nonfinite"]  # fmt: skip
K = load_kernel_modules(MODULES)

from proposer_fixtures import SMALL, hidden, make_proposer  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the interpreter run checks the executor's layouts")


def torch_forms(monkeypatch) -> list[str]:
    """Every ``_<op>_impl`` the fused modules import (their ops' torch forms), recording its calls."""
    calls = []
    for name in MODULES:
        module = K[name]
        for attr, real in list(vars(module).items()):
            if attr.startswith("_") and attr.endswith("_impl") and not attr.startswith("__") and callable(real):
                monkeypatch.setattr(module, attr, lambda *a, attr=attr, real=real: calls.append(attr) or real(*a))
    return calls


def drafts(batch: int, fused: bool) -> list[list[int]]:
    prop = make_proposer(SMALL, seed=3, buckets=(1, 4))
    gen = torch.Generator().manual_seed(2)
    states = [prop.alloc_state() for _ in range(batch)]
    bound = set()
    if fused:
        from draftgraph.ops.triton import _impls

        impls = _impls()
        for step in prop._executor(4 if batch > 1 else 1, 2, False).steps:
            if step.node.op in impls:
                step.impl = impls[step.node.op]
                bound.add(step.node.op)
        assert {"embed_combiner", "swa_attention", "moe", "hc_pre_norm", "hc_post", "lm_head", "draft_argmax",
                "drop_nonfinite", "mark_dropped"} <= bound, bound  # fmt: skip
    hiddens = [hidden(SMALL, gen) for _ in range(batch)]
    return prop.propose_batch([5, 9, 11][:batch], hiddens, [0, 3, 6][:batch], 2, states)


@pytest.mark.parametrize("batch", [1, 3])
def test_every_fused_impl_takes_the_chains_inputs(batch, monkeypatch):
    want = drafts(batch, fused=False)
    calls = torch_forms(monkeypatch)
    got = drafts(batch, fused=True)
    assert calls == [], f"fused impls fell back to their torch forms: {calls}"
    assert got == want
