"""draftgraph.ops.constants: read-only aranges and fills made once per key, never inside a capture."""

from __future__ import annotations

import pytest
import torch
from draftgraph.ops import constants


def test_a_constant_is_made_once_per_key_with_the_values_asked_for():
    ids = constants.arange(-3, 5, torch.int32, torch.device("cpu"))
    assert ids.tolist() == list(range(-3, 5)) and ids.dtype == torch.int32
    assert constants.arange(-3, 5, torch.int32, "cpu") is ids  # a device given by name: the same key
    assert constants.arange(-3, 5, torch.int64, "cpu") is not ids
    halves = constants.full(4, 0.5, torch.float32, "cpu")
    assert halves.tolist() == [0.5] * 4
    assert constants.full(4, 0.5, torch.float32, "cpu") is halves
    assert constants.full(4, 0.25, torch.float32, "cpu") is not halves
    freqs = constants.logspace(-0.75, 4, 10000.0, torch.float32, "cpu")
    assert torch.equal(freqs, torch.logspace(0.0, -0.75, 4, base=10000.0))
    assert constants.logspace(-0.75, 4, 10000.0, torch.float32, "cpu") is freqs
    assert constants.logspace(-0.75, 4, 500.0, torch.float32, "cpu") is not freqs
    signs = constants.values(((1.0, -2.0), (-2.0, 1.0)), torch.float32, "cpu")
    assert signs.tolist() == [[1.0, -2.0], [-2.0, 1.0]]
    assert constants.values(((1.0, -2.0), (-2.0, 1.0)), torch.float32, "cpu") is signs
    assert constants.values(((1.0, -2.0), (-2.0, 1.0)), torch.float64, "cpu") is not signs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inside_a_capture_a_new_key_is_built_in_the_graph_and_not_kept():
    dev = torch.device("cuda", torch.cuda.current_device())
    kept = constants.arange(0, 7, torch.int64, dev)  # made eagerly: read as it is inside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inside = constants.arange(0, 9, torch.int64, dev)
        again = constants.arange(0, 7, torch.int64, dev)
    graph.replay()
    torch.cuda.synchronize()
    assert again is kept
    assert inside.tolist() == list(range(9))
    assert constants.arange(0, 9, torch.int64, dev) is not inside  # made now, outside the capture
