"""GPU: every V4 op captures into a CUDA graph, and replay with new data equals eager bit for bit.

Capture fails on any host sync (.item(), data-dependent shapes), so this is the
executable check of the implementation contract. Also compares GPU eager with
the CPU run of the same op (the CUDA-only lm_head path included).
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.ir.op_registry import get_op
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from v4_op_cases import CASES, gen, rel_err, run_op

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

V4_OPS = sorted(CASES)


def _poison(outputs):
    for out in outputs:
        out.fill_(float("nan") if out.is_floating_point() else -7)


@pytest.mark.parametrize("name", V4_OPS)
def test_captured_replay_equals_eager(name):
    op, dev = get_op(name), torch.device("cuda")
    impl = op.select_impl(dev, use_fused=False)  # the torch reference path
    inputs, attrs = CASES[name](gen(1))
    fresh, _ = CASES[name](gen(2))
    static = [t.to(dev) for t in inputs]
    specs = op.infer([TensorSpec.of(t) for t in static], attrs)
    outputs = [torch.empty(s.shape, dtype=s.dtype, device=dev) for s in specs]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        impl(static, outputs, attrs, None)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl(static, outputs, attrs, None)

    for t, f in zip(static, fresh):
        t.copy_(f)  # new data (and fresh state) into the captured inputs
    _poison(outputs)
    graph.replay()

    eager_in = [f.to(dev) for f in fresh]
    eager_out = [torch.empty_like(o) for o in outputs]
    impl(eager_in, eager_out, attrs, None)
    torch.cuda.synchronize()
    for replayed, eager in zip(outputs, eager_out):
        assert torch.equal(replayed, eager), name
    for i in op.mutates:
        assert torch.equal(static[i], eager_in[i]), f"{name} state input {i}"


@pytest.mark.parametrize("name", V4_OPS)
def test_gpu_eager_matches_cpu(name):
    op, dev = get_op(name), torch.device("cuda")
    inputs, attrs = CASES[name](gen(3))
    cpu_out = run_op(name, [t.clone() for t in inputs], attrs)
    gpu_in = [t.to(dev) for t in inputs]
    specs = op.infer([TensorSpec.of(t) for t in gpu_in], attrs)
    gpu_out = [torch.empty(s.shape, dtype=s.dtype, device=dev) for s in specs]
    _poison(gpu_out)
    op.select_impl(dev, use_fused=False)(gpu_in, gpu_out, attrs, None)
    for c, g in zip(cpu_out, gpu_out):
        g = g.cpu()
        if c.is_floating_point():
            assert not torch.isnan(g).any(), name
            assert rel_err(g, c) < 1e-2 if c.abs().sum() > 0 else torch.equal(g, c), name
        else:
            assert torch.equal(g, c), name
