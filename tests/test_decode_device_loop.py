"""The device loop (issue 27.2, 27.4): drafts, verify input and acceptance on the device, one read-back
a step; warm-up apart, and no executor built after it; propose_device / after_verify_device."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from decode_fixtures import (  # noqa: F401
    OracleProposer,
    drafter_after_prompts,
    make_proposer,
    make_target,
    pools_full,
    prompts,
    single_thread,
)
from draftgraph.ops.acceptance import ACCEPTED, DROPPED, NONFINITE_HIDDEN, TOKENS
from draftgraph.runtime.decode.loop import DecodeSession, accept_greedy, greedy_decode, speculative_decode
from draftgraph.runtime.decode.warmup import build_counts, plan_warmup
from draftgraph.runtime.errors import InputError, NonFiniteError
from proposer_fixtures import assert_unchanged, frozen


@pytest.fixture(scope="module")
def target():
    return make_target()


@functools.lru_cache(maxsize=8)
def greedy_of(lengths: tuple, max_new: int, eos_id=None):
    return greedy_decode(make_target(), prompts(lengths), max_new, eos_id=eos_id)


def oracle(lengths, max_new, **kw):
    truths = [p + g for p, g in zip(prompts(lengths), greedy_of(lengths, max_new).tokens)]
    return make_proposer(cls=OracleProposer, truths=truths, **kw)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("lengths", [(7,), (3, 9, 20)])
def test_device_loop_equals_greedy_and_the_host_path(target, lengths, k):
    want = greedy_of(lengths, 14)
    runs = {}
    for device_loop in (True, False):
        for drafter in ("builtin", "oracle"):
            proposer = make_proposer() if drafter == "builtin" else oracle(lengths, 14)
            result = speculative_decode(target, proposer, prompts(lengths), 14, k, device_loop=device_loop)
            assert result.tokens == want.tokens and result.finish_reasons == want.finish_reasons
            assert pools_full(target, proposer)
            runs[device_loop, drafter] = (result.tokens, result.stats.num_steps, result.stats.num_accepted)
    assert runs[True, "builtin"] == runs[False, "builtin"]  # same drafts, same acceptance, step by step
    assert runs[True, "oracle"] == runs[False, "oracle"]


@pytest.mark.parametrize("k", [1, 3])
def test_device_loop_eos_max_tokens_and_cancel(target, k):
    lengths = (3, 9, 20)
    greedy = greedy_of(lengths, 16).tokens
    eos = greedy[2][5]  # sequence 2 ends at its sixth token (or earlier where the token comes sooner)
    want = greedy_decode(target, prompts(lengths), 16, eos_id=eos)
    proposer = oracle(lengths, 16)
    with DecodeSession(target, proposer, prompts(lengths), 16, k, eos_id=eos, device_loop=True) as session:
        assert session.device_loop
        session.step()
        session.step()
        session.cancel(0)
        while session.step():
            pass
        result = session.result()
    assert result.finish_reasons[0] == "cancelled"
    assert result.tokens[0] == want.tokens[0][: len(result.tokens[0])] and len(result.tokens[0]) < 16
    assert result.tokens[1:] == want.tokens[1:] and result.finish_reasons[1:] == want.finish_reasons[1:]
    assert pools_full(target, proposer)


_READS = ("cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_one_read_back_per_step(target, monkeypatch):
    """Every tensor-to-host call (.cpu, .tolist, .item, .numpy, bool/int/float of a tensor) is counted."""
    calls = collections.Counter()
    counting = [False]

    def counted(name):
        method = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if counting[0]:
                calls[name] += 1
            return method(self, *args, **kwargs)

        return read

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    reads = {}
    for device_loop in (True, False):
        calls.clear()
        with DecodeSession(target, make_proposer(), prompts((3, 9, 20)), 12, 3, device_loop=device_loop) as s:
            s.step()  # the prefill: reads the prompts' argmax and checks their hiddens
            counting[0] = True
            while s.step():
                pass
            counting[0] = False
        steps = s.stats.num_steps
        reads[device_loop] = sum(calls.values()) / steps
        if device_loop:  # (the host path's .cpu().tolist() is one read, counted twice here)
            assert s.stats.num_read_backs == sum(calls.values()) == steps, calls
    assert reads[True] == 1  # the verdict, nothing else
    assert reads[False] >= 3  # the drafts, the target's argmax, the catch-up's finiteness


def test_no_executor_built_after_warm_up_in_a_long_decode(target):
    """A few hundred tokens a sequence, sequences ending at different steps: every bucket was warmed."""
    lengths, max_new = (3, 9, 20), 150
    greedy = greedy_decode(target, prompts(lengths), max_new).tokens
    # sequence 0 ends early at a token the others never emit: the live batch shrinks 3 -> 2
    eos = next(t for t in greedy[0][10:] if t not in greedy[1] + greedy[2])
    for device_loop in (True, False):
        proposer = make_proposer(buckets=(1, 2, 4, 8, 16))
        with DecodeSession(target, proposer, prompts(lengths), max_new, 3, eos_id=eos,
                           device_loop=device_loop) as session:
            session.warm_up()
            assert session.stats.warmup_seconds > 0
            before = build_counts()
            live = set()
            while session.step():
                live.add(len(session.live))
            result = session.result()
        assert build_counts() - before == type(before)(), device_loop
        assert result.finish_reasons == ["eos", "length", "length"] and len(live) >= 2  # the batch shrank
        assert pools_full(target, proposer)


def test_lazy_builds_land_in_the_loop_without_warm_up(target):
    """The oracle of the test above: without warm-up the same decode builds executors mid-loop."""
    proposer = make_proposer(buckets=(1, 2, 4, 8, 16))
    with DecodeSession(target, proposer, prompts((3, 9, 20)), 24, 3, warmup=False) as session:
        session.step()
        before = build_counts()
        while session.step():
            pass
    assert (build_counts() - before).executors > 0


def test_warm_up_plan_covers_every_live_count():
    target, proposer = make_target(buckets=(4, 8, 16)), make_proposer(buckets=(1, 2, 4, 8))
    plan = plan_warmup(target, proposer, [3, 9, 20], 3, device_loop=True)
    assert plan.verify == (4, 8, 16)  # 1, 2, 3 sequences x 4 rows
    assert plan.chain == (1, 2, 4)  # 1, 2, 3 sequences
    assert plan.prefill == (1, 2, 4, 8)  # catch-up rows 1 .. 29 (the prompts) in runs of <= 8
    assert plan.target == (16,)  # the prefill: 32 rows, two runs of 16
    host = plan_warmup(target, proposer, [3, 9, 20], 3, device_loop=False)
    assert host.verify == () and host.target == (4, 8, 16)


def test_warmup_only_session_decodes_nothing(target):
    proposer = make_proposer()
    session = DecodeSession(target, proposer, prompts((5,)), 8, 2)
    seconds = session.warm_up()
    assert seconds > 0 and session.warm_up() == 0.0 and session.stats.num_generated == 0
    session.close()
    assert pools_full(target, proposer)


# ---- the proposer's device entry ---------------------------------------------------------------------
def test_propose_device_equals_propose_batch_and_after_verify(target):
    host, device = make_proposer(), make_proposer()
    hs, hid, tok, pos = drafter_after_prompts(host, target)
    ds, _, _, _ = drafter_after_prompts(device, target)
    want = host.propose_batch(tok, hid, pos, 3, hs)
    handle = device.propose_device(tok, hid, pos, 3, ds)
    assert handle.drafts.tolist() == want
    host.after_verify_batch([2, 0], hs)
    device.after_verify_device(handle, [2, 0], dropped=False)
    assert [s.snapshot() for s in ds] == [s.snapshot() for s in hs]
    assert device.cache.num_free_blocks == host.cache.num_free_blocks
    # the next round from the same rows drafts the same tokens
    assert device.propose_device([t + 1 for t in tok], hid, [p + 1 for p in pos], 2, ds).drafts.tolist() == \
        host.propose_batch([t + 1 for t in tok], hid, [p + 1 for p in pos], 2, hs)
    for p, states in ((host, hs), (device, ds)):
        for s in states:
            p.free_state(s)
        assert p.cache.num_free_blocks == p.cache.num_blocks


def test_propose_device_misuse_is_typed_and_harmless(target):
    proposer = make_proposer()
    states, hid, tok, pos = drafter_after_prompts(proposer, target)
    before = frozen(proposer, states)
    with pytest.raises(InputError, match="num_drafts"):
        proposer.propose_device(tok, hid, pos, 0, states)
    with pytest.raises(InputError, match="target_hiddens"):
        proposer.propose_device(tok, hid[:1], pos, 3, states)
    with pytest.raises(InputError, match="last_token"):
        proposer.propose_device([10_000, 1], hid, pos, 3, states)
    assert_unchanged(proposer, states, before)
    handle = proposer.propose_device(tok, hid, pos, 3, states)
    with pytest.raises(InputError, match="unfinished device propose"):
        proposer.propose_device(tok, hid, pos, 3, states)
    with pytest.raises(InputError, match="num_accepted"):
        proposer.after_verify_device(handle, [4, 0], dropped=False)  # K = 3
    with pytest.raises(InputError, match="one call after each propose"):
        proposer.after_verify(0, states[0])  # the device propose is not committed yet
    proposer.after_verify_device(handle, [3, 1], dropped=False)
    with pytest.raises(InputError, match="already finished"):
        proposer.after_verify_device(handle, [3, 1], dropped=False)
    gated = make_proposer(draft_conf_tau=0.5)
    gs, ghid, gtok, gpos = drafter_after_prompts(gated, target)
    with pytest.raises(InputError, match="ungated"):
        gated.propose_device(gtok, ghid, gpos, 3, gs)
    for p, ss in ((proposer, states), (gated, gs)):
        for s in ss:
            p.free_state(s)
        assert p.cache.num_free_blocks == p.cache.num_blocks


def test_a_dropped_device_propose_changes_nothing(target):
    proposer = make_proposer()
    states, hid, tok, pos = drafter_after_prompts(proposer, target)
    before = frozen(proposer, states)
    bad = hid.clone()
    bad[1, 0, 0] = float("nan")
    handle = proposer.propose_device(tok, bad, pos, 3, states)
    with pytest.raises(NonFiniteError):
        proposer.after_verify_device(handle, [0, 0])  # dropped=None: reads the mark itself
    assert_unchanged(proposer, states, before)
    proposer.after_verify_device(proposer.propose_device(tok, hid, pos, 3, states), [1, 1], dropped=False)
    for s in states:
        proposer.free_state(s)
    assert proposer.cache.num_free_blocks == proposer.cache.num_blocks


def test_device_verdict_is_accept_greedy(target):
    """The verify graph's acceptance against the host rule, for chosen drafts (right, wrong, dropped)."""
    verifier = target.device_verifier(3)
    toks = prompts((5, 8), seed=5)
    states = [target.alloc_state(64) for _ in toks]
    outs = [target.prefill(s, t) for s, t in zip(states, toks)]
    last = [o.tokens[-1] for o in outs]
    truth = [target.verify([s], [[t, 0, 0, 0]], [s.length])[0].tokens for s, t in zip(states, last)]
    for s, o in zip(states, outs):
        target.truncate(s, len(o.tokens))
    # greedy continuations g: drafts right for 2 positions in sequence 0, wrong at once in sequence 1
    g0 = greedy_decode(target, [toks[0]], 4).tokens[0]
    drafts = torch.tensor([[g0[1], g0[2], (g0[3] + 1) % 264], [(truth[1][0] + 1) % 264, 5, 6]])
    verifier.run(states, last, drafts)
    verdict = verifier.verdict[:2].clone()
    pair = verifier.pair_hidden.clone()
    bucket = verifier.bucket_for(2)  # a second run on the same inputs (a capture's warm-up runs): the same
    verifier.executor(bucket).run(dict(target._staging_for(bucket).graph_inputs()), check=False)
    assert torch.equal(verifier.verdict[:2], verdict) and torch.equal(verifier.pair_hidden, pair)
    assert verdict[0, ACCEPTED] == accept_greedy(drafts[0].tolist(), verdict[0, TOKENS:].tolist())[0] == 2
    assert verdict[1, ACCEPTED] == 0 and verdict[1, TOKENS] == truth[1][0]
    assert verdict[:, DROPPED].tolist() == [0, 0] and verdict[:, NONFINITE_HIDDEN].tolist() == [0, 0]
    for s, o in zip(states, outs):
        target.truncate(s, len(o.tokens))
    verifier.run(states, last, torch.tensor([[-2, -2, -2], [g0[1], 1, 1]]))  # a dropped chain's marks
    assert verifier.verdict[:2, DROPPED].tolist() == [1, 0] and verifier.verdict[0, ACCEPTED] == 0
    with pytest.raises(InputError, match="drafts"):
        verifier.run(states, last, torch.zeros(2, 2, dtype=torch.int64))
    for s in states:
        target.free(s)
    assert target.cache.num_free_blocks == target.cache.num_blocks


def test_two_sessions_stepped_in_turn_share_the_verifier(target):
    """Sessions of one target and K share the verify buffers: stepping them in turn gives each its
    own tokens and the acceptance of running it alone."""
    alone = {}
    for lengths in ((3, 9), (5,)):
        result = speculative_decode(target, make_proposer(), prompts(lengths), 12, 3)
        alone[lengths] = (result.tokens, result.stats.num_accepted)
    proposer = make_proposer()
    with DecodeSession(target, proposer, prompts((3, 9)), 12, 3) as a, \
            DecodeSession(target, proposer, prompts((5,)), 12, 3) as b:
        going = [a, b]
        while going:
            going = [s for s in going if s.step()]
        for lengths, s in (((3, 9), a), ((5,), b)):
            assert (s.result().tokens, s.stats.num_accepted) == alone[lengths]
    assert pools_full(target, proposer)


def test_a_gated_chain_runs_the_host_path(target):
    proposer = make_proposer(draft_conf_tau=0.3)
    with pytest.raises(InputError, match="confidence-gated"):
        DecodeSession(target, proposer, prompts((3, 9)), 8, 3, device_loop=True)
    session = DecodeSession(target, proposer, prompts((3, 9)), 8, 3)
    assert not session.device_loop
    assert session.run().tokens == greedy_of((3, 9), 8).tokens
    assert pools_full(target, proposer)


def test_the_triton_compile_hook_counts():
    """The JIT calls the hook once per kernel it makes (a GPU-only event); here it is called as the JIT would."""
    triton = pytest.importorskip("triton")
    from draftgraph.runtime.decode.warmup import compile_counting

    where = compile_counting()
    assert where.endswith("jit_post_compile_hook") or where.endswith("compiled_hook")
    hook = (triton.knobs.runtime.jit_post_compile_hook if where.endswith("jit_post_compile_hook")
            else triton.runtime.jit.JITFunction.compiled_hook)
    before = build_counts()
    hook(key="k", repr="kernel[...]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert build_counts() - before == type(before)(kernel_compiles=1)


# rows 0, 1: hiddens a catch-up reads; row 3: read only as the next propose's (a = 3), then as the next
# catch-up's h_p (the oracle overwrites the chain's drafts, so the chain's own drop mark is lost)
@pytest.mark.parametrize("row", [0, 1, 3])
def test_a_nonfinite_verify_hidden_stops_the_decode_with_the_pools_exact(monkeypatch, row):
    from draftgraph.runtime.decode.device_verify import DeviceVerifier

    real = DeviceVerifier._epilogue

    def poisoned(self, slots):
        epilogue = real(self, slots)

        def run(outputs):
            outputs["hidden"][row].fill_(float("nan"))  # sequence 0's verify row `row`
            epilogue(outputs)

        return run

    monkeypatch.setattr(DeviceVerifier, "_epilogue", poisoned)
    target = make_target()  # its verifier is built with the poisoned epilogue
    proposer = oracle((3, 9, 20), 24)
    with pytest.raises(NonFiniteError):
        speculative_decode(target, proposer, prompts((3, 9, 20)), 24, 3, device_loop=True)
    assert pools_full(target, proposer)


def test_a_chain_dropping_its_batch_stops_the_decode_with_the_pools_exact(monkeypatch):
    """A non-finite next hidden: the chain drops the batch (NONFINITE drafts), the verdict says so, and
    after_verify_device refuses it; the real proposer, no oracle."""
    from draftgraph.runtime.decode.device_verify import DeviceVerifier

    real, calls = DeviceVerifier._epilogue, []

    def poisoned(self, slots):
        epilogue = real(self, slots)

        def run(outputs):
            epilogue(outputs)
            calls.append(slots)
            if len(calls) == 2:  # (1: the warm-up's) sequence 0's next hidden: pair row 1 + a, no catch-up reads it
                self.pair_hidden[0, 1 + int(self.verdict[0, ACCEPTED])].fill_(float("inf"))

        return run

    monkeypatch.setattr(DeviceVerifier, "_epilogue", poisoned)
    target, proposer = make_target(), make_proposer()  # its verifier is built with the poisoned epilogue
    with pytest.raises(NonFiniteError, match="the propose is refused"):
        speculative_decode(target, proposer, prompts((3, 9, 20)), 24, 3, device_loop=True)
    assert len(calls) == 3 and pools_full(target, proposer)  # stopped by the verify of the dropped propose


def test_a_freed_pending_state_is_forgotten(target):
    proposer = make_proposer()
    states, hid, tok, pos = drafter_after_prompts(proposer, target)
    handle = proposer.propose_device(tok, hid, pos, 3, states)
    proposer.free_state(states[0])  # an aborted decode frees its states before the verify
    with pytest.raises(InputError, match="freed|live"):
        proposer.after_verify_device(handle, [0, 0], dropped=False)
    fresh = proposer.alloc_state_for(64)
    proposer.prefill_drafter(prompts((6,), seed=3)[0], torch.zeros(6, *hid.shape[1:], dtype=hid.dtype), fresh)
    proposer.propose_device(tok[:1], hid[:1], pos[:1], 3, [fresh])
    assert set(proposer._device_pending) == {fresh.key, states[1].key}
    proposer.free_state(fresh)
    proposer.free_state(states[1])
    assert proposer.cache.num_free_blocks == proposer.cache.num_blocks
