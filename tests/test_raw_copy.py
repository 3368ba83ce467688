"""Which copies runtime/execution/raw_copy.py hands to cudaMemcpyAsync and which to Tensor.copy_ (no GPU needed).

The CUDA calls are replaced by recorders: the raw path must get exactly the pointers and
byte count of a plain copy, and anything else must be done, correctly, by ``copy_``.
The copies themselves are checked on a GPU in test_raw_copy_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.execution import raw_copy


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(raw_copy, "is_enabled", True)
    monkeypatch.setattr(raw_copy, "_raw_stream", lambda index: 1000 + index)
    monkeypatch.setattr(raw_copy, "_memcpy", lambda *args: calls.append(args))
    monkeypatch.setattr(raw_copy, "current_device", lambda: 0)
    return calls


def test_a_plain_copy_goes_to_cuda_memcpy_on_the_current_stream(recorded):
    src = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    dst = torch.zeros(3, 4, dtype=torch.int32)
    raw_copy.copy_async(dst, src, 0)
    assert recorded == [(dst.data_ptr(), src.data_ptr(), 48, 1000)]


@pytest.mark.parametrize(
    "make_src",
    [
        lambda: torch.arange(24, dtype=torch.int32).reshape(3, 8)[:, ::2],  # strided
        lambda: torch.arange(12, dtype=torch.int16).reshape(3, 4),  # a cast
        lambda: torch.arange(12, dtype=torch.int32).reshape(4, 3).t(),  # transposed: same bytes, other order
    ],
)
def test_other_copies_take_tensor_copy(recorded, make_src):
    src = make_src()
    dst = torch.zeros(3, 4, dtype=torch.int32)
    raw_copy.copy_async(dst, src, 0)
    assert recorded == []
    assert torch.equal(dst, src.to(torch.int32))


def test_a_thread_on_another_device_takes_tensor_copy(recorded):
    src = torch.arange(4, dtype=torch.int32)
    dst = torch.zeros(4, dtype=torch.int32)
    raw_copy.copy_async(dst, src, 1)  # the thread's current device is 0
    assert recorded == []
    assert torch.equal(dst, src)


def test_without_cuda_python_everything_takes_tensor_copy(recorded, monkeypatch):
    monkeypatch.setattr(raw_copy, "is_enabled", False)
    src = torch.arange(4, dtype=torch.int32)
    dst = torch.zeros(4, dtype=torch.int32)
    raw_copy.copy_async(dst, src, 0)
    assert recorded == []
    assert torch.equal(dst, src)
