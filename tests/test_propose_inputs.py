"""A batched propose's inputs: any bad item anywhere in a batch of 32 is refused, typed, harmlessly.

Design note "one path" (runtime/proposer/proposer.py): a batch is checked with array ops and
only on a failure item by item, so the error names the first bad item. Here each bad item, at
the front, middle and end of a batch of 32, raises an InputError that says what was expected
and what came, and changes no state, no block and no cache row; numpy integers and integer
arrays are taken as ints; and only the rows that cross into a new block get blocks, all or
nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from draftgraph.runtime.cache.paged_cache import BlockTable
from draftgraph.runtime.errors import CacheError, InputError, describe
from proposer_fixtures import TINY, accepted_batch, assert_unchanged, frozen, make_proposer

B, K = 32, 2
BAD_AT = (0, 17, 31)
SHAPE = (TINY.hc_mult, TINY.hidden_size)


@pytest.fixture()
def batch():
    """A proposer and 32 states that hold blocks, at their next positions (mid-block and on a boundary)."""
    return accepted_batch([20 + i for i in range(B)], K, seed=0)


def propose_with(prop, states, hiddens, positions, tokens=None):
    return prop.propose_batch(list(range(B)) if tokens is None else tokens, hiddens, positions, K, states)


def refused(prop, states, *args, match=None, watch=None, **kw) -> str:
    """The message of the InputError a propose of ``states`` raises; ``watch`` (default: the states) unchanged."""
    watch = states if watch is None else watch
    before = frozen(prop, watch)
    with pytest.raises(InputError, match=match) as info:
        propose_with(prop, states, *args, **kw)
    assert_unchanged(prop, watch, before)
    message = str(info.value)
    assert "expected" in message and "got" in message, message
    return message


@pytest.mark.parametrize("at", BAD_AT)
@pytest.mark.parametrize("bad", [TINY.vocab_size, -1, True, "7", 3.0, np.bool_(True)], ids=repr)
def test_a_bad_token_anywhere_is_refused_naming_it(batch, at, bad):
    prop, states, hiddens, positions = batch
    tokens = list(range(B))
    tokens[at] = bad
    message = refused(prop, states, hiddens, positions, tokens)
    assert message.startswith(f"last_tokens[{at}]: expected an int in [0, {TINY.vocab_size - 1}]"), message


@pytest.mark.parametrize("at", BAD_AT)
@pytest.mark.parametrize("bad", [-1, 2.5, False, TINY.max_position_embeddings - 1], ids=repr)
def test_a_bad_position_anywhere_is_refused_naming_it(batch, at, bad):
    prop, states, hiddens, positions = batch
    positions[at] = bad
    message = refused(prop, states, hiddens, positions)
    assert message.startswith(f"positions[{at}]: expected"), message


@pytest.mark.parametrize("at", BAD_AT)
def test_a_position_past_one_states_budget_is_refused_for_that_state_only(batch, at):
    prop, states, hiddens, positions = batch
    states[at] = prop.alloc_state_for(positions[at] + K - 1)  # one position short
    message = refused(prop, states, hiddens, positions, match="budget")
    assert message.startswith(f"positions[{at}]: expected position + num_drafts <= {positions[at] + K - 1}")


BAD_HIDDENS = {
    "shape": (torch.zeros(3, TINY.hidden_size, dtype=torch.bfloat16), "shape"),
    "dtype": (torch.zeros(*SHAPE), "dtype"),
    "device": (torch.zeros(*SHAPE, dtype=torch.bfloat16, device="meta"), "device"),
    "not a tensor": ([[0.0] * TINY.hidden_size] * TINY.hc_mult, "a bf16 tensor"),
}


@pytest.mark.parametrize("at", BAD_AT)
@pytest.mark.parametrize("case", list(BAD_HIDDENS))
def test_a_bad_hidden_anywhere_is_refused_naming_it(batch, at, case):
    prop, states, hiddens, positions = batch
    hiddens = list(hiddens)
    hiddens[at], what = BAD_HIDDENS[case]
    message = refused(prop, states, hiddens, positions)
    assert message.startswith(f"target_hiddens[{at}]") and what in message, message


@pytest.mark.parametrize("at", BAD_AT)
@pytest.mark.parametrize("kind", ["freed", "foreign", "not a state"])
def test_a_bad_state_anywhere_is_refused_naming_it(batch, at, kind):
    prop, states, hiddens, positions = batch
    if kind == "freed":
        bad = prop.alloc_state()
        prop.free_state(bad)
    else:
        bad = make_proposer(TINY).alloc_state() if kind == "foreign" else object()
    message = refused(prop, states[:at] + [bad] + states[at + 1 :], hiddens, positions, watch=states)
    assert message.startswith(f"states[{at}]: expected"), message


@pytest.mark.parametrize("at", BAD_AT)
def test_a_duplicate_state_anywhere_is_refused(batch, at):
    prop, states, hiddens, positions = batch
    twin = (at + 5) % B
    message = refused(prop, states[:at] + [states[twin]] + states[at + 1 :], hiddens, positions)
    assert message == describe("states", "distinct states", "the same state twice")


def test_the_first_kind_of_check_that_fails_names_the_error(batch):
    """K, then states, then tokens, then positions, then hiddens."""
    prop, states, hiddens, positions = batch
    bad_hiddens = list(hiddens)
    bad_hiddens[0] = BAD_HIDDENS["dtype"][0]
    bad_positions = list(positions)
    bad_positions[31] = -1
    bad_tokens = [0] * 31 + [-1]
    with pytest.raises(InputError, match="num_drafts"):
        prop.propose_batch(bad_tokens, bad_hiddens, bad_positions, 0, states)
    with pytest.raises(InputError, match="another proposer"):
        propose_with(prop, states[:31] + [make_proposer(TINY).alloc_state()], bad_hiddens, bad_positions, bad_tokens)
    with pytest.raises(InputError, match="last_tokens"):
        propose_with(prop, states, bad_hiddens, bad_positions, bad_tokens)
    with pytest.raises(InputError, match="positions"):
        propose_with(prop, states, bad_hiddens, bad_positions)
    with pytest.raises(InputError, match="target_hiddens"):
        propose_with(prop, states, bad_hiddens, positions)


def test_numpy_ints_arrays_and_0d_tensors_are_taken_as_ints(batch):
    prop, states, hiddens, positions = batch
    twin, twin_states, twin_hiddens, _ = accepted_batch([20 + i for i in range(B)], K, seed=0)
    tokens = list(range(B))
    odd_tokens = [np.int64(t) for t in tokens]
    odd_tokens[17] = torch.tensor(17)
    odd_hiddens = list(hiddens)
    odd_hiddens[31] = hiddens[31].unsqueeze(0)  # a [1, C, D] row
    assert propose_with(prop, states, odd_hiddens, np.array(positions, dtype=np.int32), odd_tokens) == \
        propose_with(twin, twin_states, twin_hiddens, positions, tokens)
    assert [s.snapshot() for s in states] == [s.snapshot() for s in twin_states]


# ---- blocks: only the rows that need them, all or nothing ------------------------------------------


def needy_rows(states, positions) -> list[int]:
    return [i for i, (s, p) in enumerate(zip(states, positions)) if s.table.block_of(p + K - 1) < 0]


def test_only_the_rows_that_cross_into_a_new_block_get_one(batch):
    prop, states, hiddens, positions = batch
    needy = needy_rows(states, positions)
    assert 0 < len(needy) < B  # the batch mixes both
    before = [s.table.held() for s in states]
    free = prop.cache.num_free_blocks
    propose_with(prop, states, hiddens, positions)
    for i, state in enumerate(states):
        grown = [b for b in state.table.held() if b not in before[i]]
        assert len(grown) == (i in needy), (i, before[i], state.table.held())
    assert prop.cache.num_free_blocks <= free - len(needy) + B  # windows trimmed give some back


def test_a_failed_run_gives_back_exactly_the_blocks_it_mapped(batch):
    prop, states, hiddens, positions = batch
    executor = prop._executor(prop._bucket(B), K, False)

    def fail(inputs, check=True):
        raise RuntimeError("the graph failed")

    executor.run = fail
    before = frozen(prop, states)
    with pytest.raises(RuntimeError, match="graph failed"):
        propose_with(prop, states, hiddens, positions)
    assert_unchanged(prop, states, before)
    del executor.run
    propose_with(prop, states, hiddens, positions)


def test_a_pool_too_small_for_the_rows_that_need_blocks_changes_nothing(batch):
    prop, states, hiddens, positions = batch
    needy = needy_rows(states, positions)
    while prop.cache.num_free_blocks > len(needy) - 1:  # one block short
        prop.cache.ensure(BlockTable(), 0, 0)
    before = frozen(prop, states)
    with pytest.raises(CacheError) as info:
        propose_with(prop, states, hiddens, positions)
    assert str(info.value) == describe(
        f"MTP cache blocks for {len(needy)} sequences", f"{len(needy)} free block(s)",
        f"{len(needy) - 1} free of {prop.cache.num_blocks}",
        "free finished sequences, call trim_window, or size the pool larger")
    assert_unchanged(prop, states, before)
