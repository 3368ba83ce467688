"""The ``kernels`` option: torch ops, torch ops compiled per op, fused (draftgraph.runtime.execution.kernel_choice)."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.errors import InputError
from proposer_fixtures import SMALL, hidden, make_proposer


def test_unknown_kernels_is_a_typed_error():
    with pytest.raises(InputError, match="kernels: expected 'auto' or 'torch' or 'compiled', got 'triton'"):
        make_proposer(kernels="triton")


def test_compiled_ops_draft_what_the_torch_ops_draft():
    """Inductor reorders fp32 math, so probabilities agree to rounding, drafts exactly."""
    gen = torch.Generator().manual_seed(3)
    hiddens = [hidden(SMALL, gen) for _ in range(2)]
    drafts, probs = {}, {}
    for kernels in ("torch", "compiled"):
        prop = make_proposer(kernels=kernels, buckets=(2,))
        states = [prop.alloc_state() for _ in range(2)]
        conf: list = []
        drafts[kernels] = prop.propose_batch([5, 9], hiddens, [40, 17], 3, states, out_conf=conf)
        probs[kernels] = torch.tensor(conf)
        # A second step reads the cache rows the first one wrote (the mutated state).
        for s in states:
            prop.after_verify(1, s)
        drafts[kernels] += prop.propose_batch([7, 8], hiddens, [42, 19], 2, states)
    assert drafts["compiled"] == drafts["torch"]
    torch.testing.assert_close(probs["compiled"], probs["torch"], rtol=2e-2, atol=1e-4)
