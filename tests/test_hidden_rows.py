"""HiddenRows (runtime/cache/hidden_rows.py): a batch's hiddens as rows of one buffer by a host index.

The stacked tensor is the oracle: staging rows of a buffer writes the bytes staging those rows
stacked writes (the copy path, and the address path that the captured prologue gathers from,
under Triton's interpreter); ``propose_batch`` with HiddenRows gives the drafts, probabilities and
cache of the tensor form; a bad buffer or index is one typed error, before anything changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from draftgraph.runtime.cache.hidden_rows import HiddenRows
from draftgraph.runtime.errors import InputError
from draftgraph.runtime.proposer.checks import check_hiddens
from proposer_fixtures import TINY, hidden
from staging_fixtures import stage_rows
from test_batched_hiddens import SHAPES, assert_same_proposers, gather, prefilled_pair, staging_pair

CPU = torch.device("cpu")


def test_staging_rows_of_a_buffer_writes_what_staging_them_stacked_writes():
    by_block, by_rows = staging_pair(4)
    buffer = torch.randn(9, 2, 3).bfloat16()
    for index in ([7, 0, 7], [2], [8, 1, 4, 3], []):
        rows = [(3 + 2 * i, 0, [i]) for i in range(len(index))]
        picked = np.array(index, dtype=np.int64)
        stage_rows(by_block, rows, [1] * len(index), buffer[picked.tolist()] if index else buffer[:0], 100)
        stage_rows(by_rows, rows, [1] * len(index), HiddenRows(buffer, picked), 100)
        for name in ("host_buf", "device_buf", "hidden_buf"):
            assert torch.equal(getattr(by_rows, name), getattr(by_block, name)), (index, name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no CUDA")
def test_rows_of_a_buffer_give_their_addresses_and_the_gather_reads_them():
    pytest.importorskip("triton")
    st, _ = staging_pair(4, gather_hiddens=True)
    st.hidden_buf.fill_(7.0)  # stale: the gather rewrites every row
    buffer = torch.randn(6, 2, 3).bfloat16()
    index = np.array([5, 0, 5], dtype=np.int64)
    stage_rows(st, [(3, 0, [0]), (5, 0, [1]), (7, 0, [2])], [1, 2, 3], HiddenRows(buffer, index), 100, copy_in=False)
    row_bytes = 2 * 3 * 2
    assert st.addresses.tolist() == [buffer.data_ptr() + i * row_bytes for i in index.tolist()] + [0]
    gather(st)
    assert torch.equal(st.hidden_buf[:3], buffer[index.tolist()]) and not st.hidden_buf[3].any()


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_propose_batch_with_rows_of_a_buffer_equals_the_tensor_form(mode):
    props, states, gen = prefilled_pair(mode, 3)
    buffer = hidden(TINY, gen, mode, 8)
    index = np.array([6, 1, 3], dtype=np.int64)
    confs = [[], []]
    by_tensor = props[0].propose_batch([5, 17, 42], buffer[index.tolist()], [2, 7, 12], 3, states[0],
                                       out_conf=confs[0])
    by_rows = props[1].propose_batch([5, 17, 42], HiddenRows(buffer, index), [2, 7, 12], 3, states[1],
                                     out_conf=confs[1])
    assert by_rows == by_tensor and confs[0] == confs[1]
    assert_same_proposers(props, states)


def bad_rows(shape) -> dict[str, tuple[HiddenRows, str]]:
    good = torch.zeros(5, *shape, dtype=torch.bfloat16)
    index = np.array([0, 4], dtype=np.int64)
    return {
        "row shape": (HiddenRows(torch.zeros(5, 1, *shape, dtype=torch.bfloat16), index), "buffer"),
        "dtype": (HiddenRows(good.float(), index), "dtype"),
        "strides": (HiddenRows(good.transpose(0, -1).contiguous().transpose(0, -1), index), "strides"),
        "index floats": (HiddenRows(good, index.astype(np.float32)), r"index\[0\]: expected an int"),
        "index length": (HiddenRows(good, np.array([0, 1, 2], dtype=np.int64)), "index length"),
        "index range": (HiddenRows(good, np.array([0, 5], dtype=np.int64)), r"index\[1\]: expected an int in \[0, 4\]"),
        "negative": (HiddenRows(good, np.array([-1, 0], dtype=np.int64)), r"index\[0\]: expected an int in \[0, 4\]"),
        "no rows": (HiddenRows(good[:0], index), r"index\[0\]: expected an int in \[0, 0\) \(an empty range"),
    }


@pytest.mark.parametrize("case", ["row shape", "dtype", "strides", "index floats", "index length", "index range",
                                  "negative", "no rows"])
def test_bad_rows_are_a_typed_error(case):
    shape = SHAPES["streams"]
    rows, says = bad_rows(shape)[case]
    with pytest.raises(InputError, match=says):
        check_hiddens(rows, shape, CPU, 2)


def test_good_rows_pass_as_they_are_and_other_integer_indexes_as_int64():
    shape = SHAPES["streams"]
    buffer = torch.zeros(5, *shape, dtype=torch.bfloat16)
    good = HiddenRows(buffer, np.array([0, 4], dtype=np.int64))
    assert check_hiddens(good, shape, CPU, 2) is good
    for index in (np.array([0, 4], dtype=np.int32), [0, 4], [np.int64(0), 4]):
        checked = check_hiddens(HiddenRows(buffer, index), shape, CPU, 2)
        assert checked.tensor is buffer and checked.index.dtype == np.int64 and checked.index.tolist() == [0, 4]


def test_a_bad_rows_propose_changes_nothing():
    props, states, gen = prefilled_pair("streams", 2)
    prop, st = props[0], states[0]
    before = ([s.snapshot() for s in st], prop.cache.num_free_blocks, prop.cache.kv.clone())
    bad = HiddenRows(hidden(TINY, gen, "streams", 4), np.array([1, 4], dtype=np.int64))  # row 4 of 4
    with pytest.raises(InputError, match="target_hiddens index"):
        prop.propose_batch([1, 2], bad, [2, 7], 2, st)
    assert [s.snapshot() for s in st] == before[0] and prop.cache.num_free_blocks == before[1]
    assert torch.equal(prop.cache.kv, before[2])


def test_a_catch_up_with_rows_of_a_buffer_equals_the_per_sequence_form():
    """catchup_batch's hiddens as one HiddenRows of every row (sequence after sequence), and the
    NaN check of its rows (a host sync, as for the tensors)."""
    from draftgraph.runtime.errors import NonFiniteError

    props, states, gen = prefilled_pair("streams", 2)
    buffer = hidden(TINY, gen, "streams", 10)
    tokens, first = [[3, 4, 5], [6, 7]], [3, 8]  # each prompt's next positions (prompts of 3 and 8 tokens)
    index = np.array([9, 2, 5, 0, 7], dtype=np.int64)
    per_sequence = [buffer[index[:3].tolist()], buffer[index[3:].tolist()]]
    assert props[0].catchup_batch(tokens, per_sequence, first, states[0]) == 5
    assert props[1].catchup_batch(tokens, HiddenRows(buffer, index), first, states[1]) == 5
    assert_same_proposers(props, states)
    buffer[7, 0, 0] = float("nan")
    before = [s.snapshot() for s in states[1]]
    with pytest.raises(NonFiniteError):
        props[1].catchup_batch([[1], [2]], HiddenRows(buffer, np.array([1, 7], dtype=np.int64)), [6, 10], states[1])
    assert [s.snapshot() for s in states[1]] == before
    with pytest.raises(InputError, match="catch-up hiddens index"):  # 3 rows for 2 tokens
        props[1].catchup_batch([[1], [2]], HiddenRows(buffer, np.array([1, 2, 3], dtype=np.int64)), [6, 10],
                               states[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_rows_of_a_buffer_equal_the_tensor_form():
    """On a GPU the captured chain gathers the rows from their addresses at every replay."""
    from proposer_fixtures import make_proposer

    gen = torch.Generator().manual_seed(3)
    props = [make_proposer(TINY, seed=1, device="cuda", executor="captured") for _ in range(2)]
    states = [[prop.alloc_state() for _ in range(3)] for prop in props]
    for i in range(3):
        prompt = torch.randint(TINY.vocab_size, (3 + 5 * i,), generator=gen).tolist()
        hs = hidden(TINY, gen, "streams", len(prompt)).cuda()
        for prop, st in zip(props, states):
            prop.prefill_drafter(prompt, hs, st[i])
    positions = [2, 7, 12]
    for index in ([6, 1, 3], [0, 7, 2], [6, 1, 3]):  # new rows each replay, then the first again
        buffer = hidden(TINY, gen, "streams", 8).cuda()
        by_tensor = props[0].propose_batch([5, 17, 42], buffer[index], positions, 3, states[0])
        by_rows = props[1].propose_batch([5, 17, 42], HiddenRows(buffer, np.array(index)), positions, 3, states[1])
        assert by_rows == by_tensor, index
        for prop, st in zip(props, states):
            prop.after_verify_batch([3, 3, 3], st)
        positions = [p + 3 for p in positions]
    assert torch.equal(props[0].cache.kv, props[1].cache.kv)
