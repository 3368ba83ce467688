"""API misuse is typed and harmless; a non-finite hidden never reaches the drafter cache.

Each misuse raises an InputError (NonFiniteError for a NaN or an infinity) and leaves every
state, the block pool and the cache's bytes exactly as they were; numpy integers are taken where
ints are. A refused non-finite propose leaves the proposer drafting exactly what a twin that never
saw the call drafts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from draftgraph.runtime.errors import InputError, NonFiniteError
from proposer_fixtures import TINY, assert_unchanged, frozen, hidden, make_proposer


def prefilled(seed=0, tokens=(1, 2, 3, 4, 5, 6)):
    gen = torch.Generator().manual_seed(seed)
    prop = make_proposer(TINY)
    state = prop.alloc_state()
    prop.prefill_drafter(list(tokens), hidden(TINY, gen, n=len(tokens)), state)
    return prop, state, gen


def test_after_verify_without_a_propose_since_the_last_verify_is_refused():
    prop, state, gen = prefilled()
    before = frozen(prop, [state])
    with pytest.raises(InputError, match="after_verify: expected one call after each propose"):
        prop.after_verify(0, state)  # before any propose: it would drop a prefill row
    assert_unchanged(prop, [state], before)
    assert not state.awaiting_verify
    prop.propose(7, hidden(TINY, gen), 5, 3, state)
    assert state.awaiting_verify
    prop.after_verify(1, state)
    assert not state.awaiting_verify
    before = frozen(prop, [state])
    with pytest.raises(InputError, match="a call with no propose since the last one"):
        prop.after_verify(1, state)  # twice: it would trim again
    assert_unchanged(prop, [state], before)
    assert state.seq_len == 6  # 5 + 3 drafted - (3 - 1) rejected, once


@pytest.mark.parametrize("count", [True, False, np.bool_(True), 1.0, "1", None], ids=repr)
def test_a_count_that_is_no_int_is_refused(count):
    prop, state, gen = prefilled()
    prop.propose(7, hidden(TINY, gen), 5, 3, state)
    before = frozen(prop, [state])
    with pytest.raises(InputError, match="num_accepted"):
        prop.after_verify(count, state)
    assert_unchanged(prop, [state], before)
    prop.after_verify(np.int64(2), state)  # a numpy integer is an int
    assert state.seq_len == 7


def test_numpy_integers_are_taken_wherever_ints_are():
    prop, state, gen = prefilled()
    twin, twin_state, twin_gen = prefilled()
    h = hidden(TINY, gen)
    assert prop.propose(np.int64(7), h, np.int32(5), np.int64(3), state) == twin.propose(7, h, 5, 3, twin_state)
    prop.after_verify(np.uint8(2), state)
    twin.after_verify(2, twin_state)
    assert state.snapshot() == twin_state.snapshot()
    budgeted = prop.alloc_state_for(np.int64(40))
    assert budgeted.max_positions == 40
    prop.set_vocab_limit(np.int64(50))
    prop.free_state(budgeted)


def test_a_list_of_hiddens_to_prefill_is_refused_with_a_hint():
    gen = torch.Generator().manual_seed(0)
    prop = make_proposer(TINY)
    state = prop.alloc_state()
    h = hidden(TINY, gen)
    before = frozen(prop, [state])
    with pytest.raises(InputError, match=r"prefill_drafter hiddens: expected one tensor \[3, \.\.\.\], got list "
                                         r"\(hint: torch.stack a list of hiddens\)"):
        prop.prefill_drafter([1, 2, 3], [h, h, h], state)
    assert_unchanged(prop, [state], before)


def test_a_non_finite_hidden_is_refused_and_the_proposer_drafts_as_if_it_never_came():
    prop, state, gen = prefilled(seed=3)
    twin, twin_state, _ = prefilled(seed=3)
    for value in (float("nan"), float("inf"), -float("inf")):
        bad = hidden(TINY, gen)
        bad[1, 7] = value
        before = frozen(prop, [state])
        with pytest.raises(NonFiniteError, match=r"target_hidden: expected finite values, got a NaN or an infinity in "
                                                 r"row\(s\) \[0\]"):
            prop.propose(7, bad, 5, 3, state)
        assert_unchanged(prop, [state], before)
    for step in range(8):  # the next proposes: the twin's drafts, the twin's cache rows
        h = hidden(TINY, gen)
        assert prop.propose(7 + step, h, 5 + step, 3, state) == twin.propose(7 + step, h, 5 + step, 3, twin_state)
        prop.after_verify(1, state)
        twin.after_verify(1, twin_state)
    assert state.snapshot() == twin_state.snapshot()


def test_one_non_finite_row_refuses_the_whole_batch_and_names_it():
    gen = torch.Generator().manual_seed(5)
    prop = make_proposer(TINY)
    states = [prop.alloc_state() for _ in range(8)]
    prop.propose_batch(list(range(8)), hidden(TINY, gen, n=8), list(range(0, 80, 10)), 2, states)
    for state in states:
        prop.after_verify(2, state)
    hiddens = hidden(TINY, gen, n=8)
    hiddens[5, 0, 0] = float("nan")
    before = frozen(prop, states)
    with pytest.raises(NonFiniteError, match=r"in row\(s\) \[5\]"):
        prop.propose_batch(list(range(8)), hiddens, list(range(2, 82, 10)), 2, states)
    assert_unchanged(prop, states, before)


def test_a_non_finite_hidden_to_prefill_or_catch_up_is_refused_before_anything_is_written():
    gen = torch.Generator().manual_seed(0)
    prop = make_proposer(TINY)
    state = prop.alloc_state()
    hiddens = hidden(TINY, gen, n=5)
    hiddens[2, 1, 3] = float("inf")
    before = frozen(prop, [state])
    with pytest.raises(NonFiniteError, match="catch-up hiddens: expected finite values"):
        prop.prefill_drafter([1, 2, 3, 4, 5], hiddens, state)
    assert_unchanged(prop, [state], before)
    with pytest.raises(NonFiniteError):
        prop.catchup_drafter([1, 2], hiddens[1:3], 0, 0, state)
    assert_unchanged(prop, [state], before)


def batch_of_proposed(seed: int, n: int = 4, k: int = 3):
    """Two proposers (a twin to compare with) with n sequences each, every one after a propose of k."""
    gen = torch.Generator().manual_seed(seed)
    props, states = [], []
    hs = torch.stack([hidden(TINY, gen) for _ in range(n)])
    for _ in range(2):
        prop = make_proposer(TINY)
        st = [prop.alloc_state() for _ in range(n)]
        prop.propose_batch(list(range(1, n + 1)), hs, [15 + 9 * i for i in range(n)], k, st)
        props.append(prop)
        states.append(st)
    return props, states


def test_after_verify_batch_equals_after_verify_row_by_row():
    """Accepted counts that trim nothing, some rows, and rows back across a block boundary."""
    (batched, single), (bs, ss) = batch_of_proposed(5)
    accepted = [3, 0, 1, 2]
    batched.after_verify_batch(np.array(accepted), bs)
    for count, state in zip(accepted, ss):
        single.after_verify(count, state)
    assert [s.snapshot() for s in bs] == [s.snapshot() for s in ss]
    assert batched.cache.num_free_blocks == single.cache.num_free_blocks
    assert not any(s.awaiting_verify for s in bs)


@pytest.mark.parametrize("case", ["over", "negative", "bool", "length", "twice", "duplicate", "freed"])
def test_a_bad_after_verify_batch_changes_no_row(case):
    (prop, _), (states, _) = batch_of_proposed(6)
    accepted = [1, 1, 1, 1]
    if case == "over":
        accepted[2] = 4  # 3 drafted
    elif case == "negative":
        accepted[1] = -1
    elif case == "bool":
        accepted[0] = True
    elif case == "length":
        accepted = accepted[:3]
    elif case == "twice":
        prop.after_verify(1, states[3])  # its verify is done: the batch's would be a second
    elif case == "duplicate":
        states = [states[0], states[1], states[1], states[3]]
    elif case == "freed":
        prop.free_state(states[2])
    before = frozen(prop, states)
    with pytest.raises(InputError):
        prop.after_verify_batch(accepted, states)
    assert_unchanged(prop, states, before)


@pytest.mark.parametrize("where", ["token", "position", "batch token", "count"])
def test_an_int_past_int64_is_a_typed_error(where):
    prop, state, gen = prefilled()
    h, huge = hidden(TINY, gen), 1 << 70
    if where == "count":
        prop.propose(7, h, 5, 3, state)
    before = frozen(prop, [state])
    with pytest.raises(InputError, match="expected an int in"):
        if where == "token":
            prop.propose(huge, h, 5, 3, state)
        elif where == "position":
            prop.propose(7, h, -huge, 3, state)
        elif where == "batch token":
            prop.propose_batch([huge], [h], [5], 3, [state])
        else:
            prop.after_verify(huge, state)
    assert_unchanged(prop, [state], before)


def test_hiddens_that_require_grad_draft_as_plain_ones_and_poison_nothing():
    """A hidden straight from a forward under autograd made the staging buffer require grad: that
    propose and every later one failed in the combiner (``out=`` under autograd)."""
    plain, p_state, gen = prefilled(seed=3)
    graded, g_state, _ = prefilled(seed=3)
    for step in range(3):
        h = hidden(TINY, gen)
        prompt = hidden(TINY, gen, n=2)
        assert torch.is_grad_enabled()
        want = plain.propose(7 + step, h, 5 + 3 * step, 2, p_state)
        assert graded.propose(7 + step, h.clone().requires_grad_(), 5 + 3 * step, 2, g_state) == want
        assert torch.is_grad_enabled()  # the caller's grad mode comes back
        plain.after_verify(1, p_state)
        graded.after_verify(1, g_state)
        assert torch.equal(plain.cache.kv, graded.cache.kv) and not graded.cache.kv.requires_grad
    other = graded.alloc_state()
    graded.prefill_drafter([1, 2], prompt.requires_grad_(), other)  # the catch-up path too
    with torch.no_grad():
        graded.propose(3, hidden(TINY, gen), 1, 1, other)
        assert not torch.is_grad_enabled()  # nor does a caller's no_grad get turned on
