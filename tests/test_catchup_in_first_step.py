"""propose_device(..., catchup=): the catch-up rows written in the chain's first step (issue 27).

The reference is what the loop did before: catchup_batch, then propose_device. The merged call
must draft the same tokens, leave the same states, blocks and cache rows, and, refused or
dropped, leave everything as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode_fixtures import drafter_after_prompts, make_proposer, make_target, single_thread  # noqa: F401
from draftgraph.runtime.cache.hidden_rows import HiddenRows
from draftgraph.runtime.errors import InputError, NonFiniteError
from proposer_fixtures import assert_unchanged, frozen


@pytest.fixture(scope="module")
def target():
    return make_target()


def _mid_decode(proposer, target, k: int, accepted: list[int]):
    """Two sequences one verify into a decode: the states after after_verify_device, what each owes
    (tokens, hiddens, first position) and the next propose's token, hidden and position."""
    states, hid, tok, pos = drafter_after_prompts(proposer, target)
    handle = proposer.propose_device(tok, hid, pos, k, states)
    drafts = handle.drafts.tolist()
    proposer.after_verify_device(handle, accepted, dropped=False)
    gen = torch.Generator().manual_seed(7)
    owed, nxt = [], []
    for d, t, h, p, a in zip(drafts, tok, hid, pos, accepted):
        # the verify's hiddens for [t, d_1..d_a] and the bonus row: any finite values pair the same way
        rows = torch.randn((a + 2, *h.shape), generator=gen).to(torch.bfloat16)
        rows[0] = h
        owed.append(([t, *d[:a]], rows[: a + 1], p))
        nxt.append(((t + 3 + a) % 264, rows[a + 1], p + a + 1))  # the bonus: any token
    return states, owed, nxt


def _free(proposer, states) -> None:
    for s in states:
        proposer.free_state(s)
    assert proposer.cache.num_free_blocks == proposer.cache.num_blocks


@pytest.mark.parametrize("buckets", [(1, 2, 4, 8, 16), (1, 2, 4)])  # (1, 2, 4): rows past 4 go first, in prefill runs
@pytest.mark.parametrize("k,accepted", [(1, [1, 0]), (3, [3, 1]), (3, [0, 0])])
def test_merged_catchup_equals_catchup_then_propose(target, k, accepted, buckets):
    ref, merged = make_proposer(buckets=buckets), make_proposer(buckets=buckets)
    rs, owed, nxt = _mid_decode(ref, target, k, accepted)
    ms, _, _ = _mid_decode(merged, target, k, accepted)
    tokens, hiddens, first = (list(x) for x in zip(*owed))
    ref.catchup_batch(tokens, hiddens, first, rs)
    want = ref.propose_device([t for t, _, _ in nxt], torch.stack([h for _, h, _ in nxt]), [p for _, _, p in nxt],
                              k, rs)
    got = merged.propose_device([t for t, _, _ in nxt], torch.stack([h for _, h, _ in nxt]),
                                [p for _, _, p in nxt], k, ms, catchup=(tokens, hiddens, first))
    assert got.drafts.tolist() == want.drafts.tolist()
    assert torch.equal(merged.cache.kv, ref.cache.kv)  # the same rows: the catch-up's and the chain's
    ref.after_verify_device(want, [1, 0], dropped=False)
    merged.after_verify_device(got, [1, 0], dropped=False)
    assert [s.snapshot() for s in ms] == [s.snapshot() for s in rs]
    assert merged.cache.num_free_blocks == ref.cache.num_free_blocks
    _free(ref, rs)
    _free(merged, ms)


def test_a_sequence_owing_nothing_and_a_list_of_hiddens(target):
    """An empty entry owes no row; the propose's hiddens may be a list (one tensor a sequence)."""
    ref, merged = make_proposer(buckets=(1, 2, 4, 8)), make_proposer(buckets=(1, 2, 4, 8))
    rs, owed, nxt = _mid_decode(ref, target, 2, [2, 1])
    ms, _, _ = _mid_decode(merged, target, 2, [2, 1])
    t1, h1, p1 = owed[1]
    ref.catchup_batch([t1], [h1], [p1], [rs[1]])
    ref.catchup_batch([[nxt[0][0]]], [nxt[0][1][None]], [owed[0][2]], [rs[0]])  # sequence 0 jumps: a fresh row
    want = ref.propose_device([t for t, _, _ in nxt], [h for _, h, _ in nxt], [p for _, _, p in nxt], 2, rs)
    none = h1[:0]
    merged.catchup_batch([[nxt[0][0]]], [nxt[0][1][None]], [owed[0][2]], [ms[0]])
    got = merged.propose_device([t for t, _, _ in nxt], [h for _, h, _ in nxt], [p for _, _, p in nxt], 2, ms,
                                catchup=([[], t1], [none, h1], [nxt[0][2], p1]))
    assert got.drafts.tolist() == want.drafts.tolist()
    merged.after_verify_device(got, [0, 2], dropped=False)
    ref.after_verify_device(want, [0, 2], dropped=False)
    assert [s.snapshot() for s in ms] == [s.snapshot() for s in rs]
    _free(ref, rs)
    _free(merged, ms)


def test_merged_catchup_misuse_is_typed_and_harmless(target):
    proposer = make_proposer(buckets=(1, 2, 4, 8))
    states, owed, nxt = _mid_decode(proposer, target, 3, [2, 1])
    tokens, hiddens, first = (list(x) for x in zip(*owed))
    tok, hid, pos = [t for t, _, _ in nxt], torch.stack([h for _, h, _ in nxt]), [p for _, _, p in nxt]
    before = frozen(proposer, states)
    with pytest.raises(InputError, match="catchup rows of states\\[1\\]"):  # rows that stop short of the propose
        proposer.propose_device(tok, hid, pos, 3, states, catchup=(tokens, hiddens, [first[0], first[1] - 1]))
    with pytest.raises(InputError, match="catchup"):
        proposer.propose_device(tok, hid, pos, 3, states, catchup=(tokens, hiddens))
    with pytest.raises(InputError, match="catch-up tokens"):
        proposer.propose_device(tok, hid, pos, 3, states, catchup=([tokens[0], [999] * len(tokens[1])], hiddens,
                                                                    first))
    with pytest.raises(InputError, match="catch-up hiddens"):
        proposer.propose_device(tok, hid, pos, 3, states, catchup=(tokens, [hiddens[0], hiddens[1][:1]], first))
    assert_unchanged(proposer, states, before)
    _free(proposer, states)


@pytest.mark.parametrize("where", ["catch-up", "propose"])
def test_a_nonfinite_row_drops_the_whole_call(target, where):
    """A NaN in a catch-up row or a propose row: the merged step drops the batch on the device,
    after_verify_device raises, and states, blocks and cache rows are as before the call."""
    proposer = make_proposer(buckets=(1, 2, 4, 8, 16))
    states, owed, nxt = _mid_decode(proposer, target, 3, [2, 1])
    tokens, hiddens, first = (list(x) for x in zip(*owed))
    hid = torch.stack([h for _, h, _ in nxt])
    bad = [h.clone() for h in hiddens]
    if where == "catch-up":
        bad[1][1, 0, 0] = float("nan")
    else:
        hid[0, 0, 0] = float("inf")
    before = frozen(proposer, states)
    handle = proposer.propose_device([t for t, _, _ in nxt], hid, [p for _, _, p in nxt], 3, states,
                                     catchup=(tokens, bad, first))
    with pytest.raises(NonFiniteError):
        proposer.after_verify_device(handle, [0, 0])  # dropped=None: reads the mark itself
    assert_unchanged(proposer, states, before)
    _free(proposer, states)


def test_nonfinite_rows_for_the_prefill_runs_are_refused_before_any_work(target):
    """Rows past the largest bucket are written by prefill runs, which do not drop: checked on the host."""
    proposer = make_proposer(buckets=(1, 2, 4))
    states, owed, nxt = _mid_decode(proposer, target, 3, [3, 3])
    tokens, hiddens, first = (list(x) for x in zip(*owed))
    bad = [h.clone() for h in hiddens]
    bad[0][0, 0, 0] = float("nan")
    before = frozen(proposer, states)
    with pytest.raises(NonFiniteError):
        proposer.propose_device([t for t, _, _ in nxt], torch.stack([h for _, h, _ in nxt]), [p for _, _, p in nxt],
                                3, states, catchup=(tokens, bad, first))
    assert_unchanged(proposer, states, before)
    _free(proposer, states)


@pytest.mark.parametrize("short_for", ["catch-up", "propose"])
def test_a_pool_too_short_is_refused_with_nothing_changed(target, short_for):
    """Every block held: the catch-up rows (or the propose's rows after them) need one more. The
    call raises CacheError and leaves states, pool and cache rows as they were (the catch-up's
    placement undone when the propose's rows are the ones short)."""
    from draftgraph.runtime.errors import CacheError

    proposer = make_proposer(buckets=(1, 2), num_cache_blocks=2)
    states = [proposer.alloc_state_for(64) for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    hid = torch.randn(2, 14, 4, 64, generator=gen).to(torch.bfloat16)  # TINY: hc_mult 4, hidden 64
    for s, h in zip(states, hid):
        proposer.prefill_drafter(list(range(1, 15)), h, s)  # rows 0..12: each holds block 0, none free
    assert proposer.cache.num_free_blocks == 0
    rows = 3 if short_for == "propose" else 4  # rows 13..15 fit block 0; 13..16 need block 1
    owed = ([[7] * rows] * 2, [hid[i, :rows] for i in range(2)], [13, 13])
    before = frozen(proposer, states)
    with pytest.raises(CacheError, match="MTP cache blocks"):
        proposer.propose_device([3, 4], hid[:, 0], [13 + rows] * 2, 1, states, catchup=owed)
    assert_unchanged(proposer, states, before)
    _free(proposer, states)


def _as_rows(hiddens: list[torch.Tensor]) -> HiddenRows:
    """The catch-up hiddens as the decode loop passes them: rows of one buffer, picked by index."""
    buffer = torch.cat(hiddens)
    return HiddenRows(buffer, np.arange(len(buffer), dtype=np.int64))


def test_the_loops_rows_take_the_usual_path_and_equal_the_checked_one(target, monkeypatch):
    """Catch-up rows as a HiddenRows of plain ints (the decode loop's call) skip check_rows (design note
    "checks the kernel makes") and draft, place and write exactly what the checked path does."""
    from draftgraph.runtime.proposer import device_propose

    ref, fast = make_proposer(buckets=(1, 2, 4, 8)), make_proposer(buckets=(1, 2, 4, 8))
    rs, owed, nxt = _mid_decode(ref, target, 3, [2, 1])
    fs, _, _ = _mid_decode(fast, target, 3, [2, 1])
    tokens, hiddens, first = (list(x) for x in zip(*owed))
    tok, hid, pos = [t for t, _, _ in nxt], torch.stack([h for _, h, _ in nxt]), [p for _, _, p in nxt]
    want = ref.propose_device(tok, hid, pos, 3, rs, catchup=(tokens, hiddens, first))

    def no_checks(*args, **kwargs):
        raise AssertionError("check_rows ran on the usual path")

    with monkeypatch.context() as patch:
        patch.setattr(device_propose, "check_rows", no_checks)
        got = fast.propose_device(tok, hid, pos, 3, fs, catchup=(tokens, _as_rows(hiddens), first))
    assert got.drafts.tolist() == want.drafts.tolist()
    assert torch.equal(fast.cache.kv, ref.cache.kv)
    ref.after_verify_device(want, [1, 0], dropped=False)
    fast.after_verify_device(got, [1, 0], dropped=False)
    assert [s.snapshot() for s in fs] == [s.snapshot() for s in rs]
    _free(ref, rs)
    _free(fast, fs)


@pytest.mark.parametrize("bad", ["freed state", "past the budget", "short of the propose", "index out of range",
                                 "tokens not a list", "numpy first positions"])
def test_the_usual_path_names_the_error_the_checks_name(target, bad):
    """What the batch kernel refuses on the usual path (a freed state, rows past a budget) and what it
    leaves to the checks (rows short of the propose, a bad index) raise the typed error check_rows
    raises for the same call with the hiddens as tensors, and leave states, pool and cache rows as
    they were; numpy positions take the checked path and work."""
    proposer = make_proposer(buckets=(1, 2, 4, 8))
    states, owed, nxt = _mid_decode(proposer, target, 3, [2, 1])
    tokens, hiddens, first = (list(x) for x in zip(*owed))
    tok, hid, pos = [t for t, _, _ in nxt], torch.stack([h for _, h, _ in nxt]), [p for _, _, p in nxt]
    rows = _as_rows(hiddens)
    if bad == "freed state":
        proposer.free_state(states[1])
    elif bad == "past the budget":
        proposer.rows.max_positions[states[1].row] = first[1] + 1  # its two catch-up rows need first + 2
    elif bad == "short of the propose":
        first = [first[0], first[1] - 1]
    elif bad == "index out of range":
        rows = HiddenRows(rows.tensor, rows.index + 1)
    elif bad == "tokens not a list":
        tokens = 5
    elif bad == "numpy first positions":
        first = [np.int64(p) for p in first]
    live = [s for s in states if not s.is_freed]
    before = frozen(proposer, live)
    if bad == "numpy first positions":
        handle = proposer.propose_device(tok, hid, pos, 3, states, catchup=(tokens, rows, first))
        proposer.after_verify_device(handle, [0, 0], dropped=False)
        _free(proposer, states)
        return
    with pytest.raises(InputError) as usual:
        proposer.propose_device(tok, hid, pos, 3, states, catchup=(tokens, rows, first))
    assert_unchanged(proposer, live, before)
    if bad == "index out of range":  # the tensors' form has no index to get wrong
        assert "catch-up hiddens index" in str(usual.value)
    else:
        with pytest.raises(InputError) as checked:
            proposer.propose_device(tok, hid, pos, 3, states, catchup=(tokens, hiddens, first))
        assert_unchanged(proposer, live, before)
        assert str(usual.value) == str(checked.value)
    _free(proposer, live)
