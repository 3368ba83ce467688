"""tools/profile_step on the GPU: the kernel table of a replay and each step's time alone."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from proposer_fixtures import SMALL

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_op_table_times_every_step_alone_and_leaves_the_replay_unchanged():
    from profile_step import kernel_table, op_table

    prop = DeepseekV4MtpProposer(SMALL, random_mtp_weights(SMALL, seed=8), device="cuda", executor="captured",
                                 kernels="torch")
    hidden = torch.randn(SMALL.hc_mult, SMALL.hidden_size, device="cuda").bfloat16()
    state = prop.alloc_state()
    first = prop.propose(5, hidden, 30, 1, state)
    executor = prop._executor(1, 1, False)
    rows = op_table(executor, replays=5)
    assert [r[0] for r in rows] == [s.node.name for s in executor.eager.steps]
    assert all(us > 0 for _, _, us in rows)
    assert {"swa_attention", "moe", "lm_head", "draft_argmax"} <= {op for _, op, _ in rows}
    kernels, busy = kernel_table(executor, 1, replays=3)
    assert busy > 0 and sum(n for _, n, _ in kernels) >= len(rows)  # at least a kernel per step
    prop.after_verify(0, state)
    assert prop.propose(5, hidden, 30, 1, state) == first  # the captured chain still replays the same drafts
