"""Hiddens by address (draftgraph.ops.triton.rows): the host writes addresses, the graph gathers the rows.

On the CPU the staging kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py), over a staging buffer whose "device" half is host memory: the same kernel,
the same address arithmetic, what the captured graph's prologue does.
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.cache.staging import ChainStaging
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from staging_fixtures import stage_rows

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no CUDA")

C, D = 4, 96


def staging(bucket=4) -> ChainStaging:
    return ChainStaging(bucket, TensorSpec(("B", C, D), torch.bfloat16), max_blocks_per_seq=4, mask_words=2,
                        device=torch.device("cpu"), window=16, gather_hiddens=True)


def replay_prologue(st: ChainStaging, staged: torch.Tensor | None = None) -> None:
    """What in_graph_copy captures, run eagerly: the one kernel copying the buffer and gathering."""
    from draftgraph.ops.triton.rows import stage_from_host

    stage_from_host(st.host_buf, st.device_buf if staged is None else staged, st._address_at, st.hidden_buf)
    st._is_copy_pending = False  # done, as a propose's read-back (a stream sync) tells it on CUDA


def rows(n, positions=(3, 5, 7, 9)):
    return [(p, 0, [i]) for i, p in zip(range(n), positions)]


def test_rows_are_gathered_from_their_addresses_and_padding_is_zero():
    st = staging()
    st.hidden_buf.fill_(7.0)  # stale contents: the gather rewrites every row
    big = torch.randn(6, C, D).bfloat16()
    hiddens = [big[4], torch.randn(C, D).bfloat16(), big[1]]  # views at offsets, and a tensor of its own
    stage_rows(st, rows(3), [1, 2, 3], hiddens, vocab_limit=100, copy_in=False)
    assert st.addresses.tolist() == [h.data_ptr() for h in hiddens] + [0]
    replay_prologue(st)
    for i, h in enumerate(hiddens):
        assert torch.equal(st.hidden_buf[i], h)
    assert not st.hidden_buf[3].any()


def test_the_kernel_copies_the_host_buffer_it_is_given():
    st = staging()
    stage_rows(st, rows(2), [11, 12], [torch.randn(C, D).bfloat16() for _ in range(2)], 100, copy_in=False)
    st.host_buf[st._mask_at:] = 9  # the masks' bytes: copied only with the whole buffer
    st.device_buf.fill_(3)
    replay_prologue(st, staged=st._device_head)  # an unmasked chain: the head only
    assert torch.equal(st.device_buf[: st._mask_at], st.host_buf[: st._mask_at])
    assert (st.device_buf[st._mask_at :] == 3).all()
    assert st.views["token"][:2].tolist() == [11, 12]
    replay_prologue(st)  # a masked chain: everything
    assert torch.equal(st.device_buf, st.host_buf)


def test_a_smaller_batch_clears_the_stale_addresses():
    st = staging()
    stage_rows(st, rows(3), [1, 2, 3], [torch.randn(C, D).bfloat16() for _ in range(3)], 100, copy_in=False)
    replay_prologue(st)
    only = torch.randn(C, D).bfloat16()
    stage_rows(st, rows(1), [4], [only], 100, copy_in=False)
    assert st.addresses.tolist() == [only.data_ptr(), 0, 0, 0]
    replay_prologue(st)
    assert torch.equal(st.hidden_buf[0], only) and not st.hidden_buf[1:].any()


def test_a_strided_hidden_is_gathered_from_a_copy_kept_until_the_next_stage():
    st = staging()
    wide = torch.randn(C, 2 * D).bfloat16()
    strided = wide[:, ::2]
    stage_rows(st, rows(1), [1], [strided], 100, copy_in=False)
    assert st.addresses[0] != strided.data_ptr()
    assert len(st._kept) == 1 and st._kept[0].data_ptr() == st.addresses[0]
    replay_prologue(st)
    assert torch.equal(st.hidden_buf[0], strided)
    stage_rows(st, rows(1), [1], [torch.randn(C, D).bfloat16()], 100, copy_in=False)
    assert st._kept == []


def test_a_staging_copy_run_still_copies_the_hiddens():
    st = staging()
    h = torch.randn(C, D).bfloat16()
    stage_rows(st, rows(1), [1], [h], 100, copy_in=True)  # an executor without the in-graph copy
    assert torch.equal(st.hidden_buf[0], h)


def test_the_read_kernel_writes_an_output_to_its_host_buffer():
    """in_graph_read: what a captured chain's last node runs (copy_to_host), run eagerly: the output's
    bytes in a host buffer of its shape, the same buffer again on the next run (int64 drafts, and an
    odd shape of int32); an output it cannot copy word by word is left to read_rows' copy."""
    st = staging()
    read = st.in_graph_read()
    for shape, dtype in (((4, 3), torch.int64), ((5, 1), torch.int32)):
        for run in range(2):
            drafts = torch.randint(-(2**31), 2**31 - 1, shape, generator=torch.Generator().manual_seed(run))
            read({"drafts": drafts.to(dtype)})
            host = st._publish_bufs[(drafts.shape, dtype)]
            assert torch.equal(host, drafts.to(dtype)), (shape, run)
    read({"probs": torch.ones(2)})  # not the output it reads
    read({"drafts": torch.ones(3, dtype=torch.int16)})  # 6 bytes: not whole words
    assert len(st._publish_bufs) == 2 and not st._published  # nothing captured here: read_rows copies
