"""The speculative decode loop: greedy equivalence whatever the drafter, every acceptance count,
EOS, cancel and injected failures leaving both block pools exact, stats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode_fixtures import (  # noqa: F401
    FailingRunner,
    OracleProposer,
    make_proposer,
    make_target,
    pools_full,
    prompts,
    single_thread,
)
from draftgraph.runtime.decode.loop import DecodeSession, accept_greedy, greedy_decode, speculative_decode
from draftgraph.runtime.decode.stats import DecodeStats
from draftgraph.runtime.errors import ExecutionError, InputError

K, MAX_NEW = 3, 12
PROMPTS = prompts((3, 9, 20))  # mixed lengths; 20 > the row bucket: prefill runs are split


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def greedy(target):
    return greedy_decode(target, PROMPTS, MAX_NEW).tokens


def oracle(greedy, **kw):
    truths = [p + g for p, g in zip(PROMPTS, greedy)]
    return make_proposer(cls=OracleProposer, truths=truths, **kw)


@pytest.mark.parametrize("device_loop", [True, False])
@pytest.mark.parametrize("drafter", ["builtin", "identity", "random_weights"])
def test_speculative_equals_greedy_for_any_drafter(target, greedy, drafter, device_loop):
    proposer = make_proposer(seed=7 if drafter == "random_weights" else 0)
    if drafter == "identity":
        proposer.set_circuit_draft("identity")
    result = speculative_decode(target, proposer, PROMPTS, MAX_NEW, K, device_loop=device_loop)
    assert result.tokens == greedy
    assert result.finish_reasons == ["length"] * 3
    assert pools_full(target, proposer)
    assert result.stats.num_generated == 3 * MAX_NEW and result.stats.num_verifies > 0


@pytest.mark.parametrize("device_loop", [True, False])
@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_every_acceptance_count_rolls_back_and_catches_up(greedy, mode, device_loop):
    target = make_target(mode=mode)
    proposer = oracle(greedy, mode=mode)
    counts = []
    result = speculative_decode(
        target, proposer, PROMPTS, MAX_NEW, K, on_step=lambda s, e: counts.extend(e.accepted.values()),
        device_loop=device_loop,
    )
    assert result.tokens == greedy
    assert set(counts) == {0, 1, 2, 3}  # rejection at every draft position, and all accepted
    stats = result.stats
    assert stats.num_verifies == len(counts) and stats.num_accepted == sum(counts)
    assert stats.mean_accepted_length == pytest.approx(1 + sum(counts) / len(counts))
    by_pos = stats.acceptance_by_position()
    assert by_pos == sorted(by_pos, reverse=True) and by_pos[0] > 0
    assert stats.num_steps < MAX_NEW - 1  # fewer target forwards than greedy needs
    assert pools_full(target, proposer)


def test_more_rows_than_the_bucket_split_into_runs(target):
    many = prompts((2, 5, 3, 7, 4), seed=9)  # 5 x (K + 1) = 20 verify rows > 16
    want = greedy_decode(target, many, 6).tokens
    proposer = make_proposer(buckets=(1, 2, 4, 8))
    with pytest.raises(InputError, match="device_loop"):  # one verify run cannot hold them: host path only
        DecodeSession(target, proposer, many, 6, K, device_loop=True)
    session = DecodeSession(target, proposer, many, 6, K)
    assert not session.device_loop
    assert session.run().tokens == want
    assert pools_full(target, proposer)


@pytest.mark.parametrize("device_loop", [True, False])
def test_eos_ends_one_sequence(target, greedy, device_loop):
    eos = greedy[1][4]  # the fifth token of sequence 1 becomes EOS
    want = greedy_decode(target, PROMPTS, MAX_NEW, eos_id=eos)
    proposer = oracle(greedy)
    result = speculative_decode(target, proposer, PROMPTS, MAX_NEW, K, eos_id=eos, device_loop=device_loop)
    assert result.tokens == want.tokens and result.finish_reasons == want.finish_reasons
    assert result.tokens[1][-1] == eos and len(result.tokens[1]) <= 5 and result.finish_reasons[1] == "eos"
    assert pools_full(target, proposer)


@pytest.mark.parametrize("greedy_run", [True, False])
def test_full_batch_figures_hold_the_rounds_that_began_with_every_sequence_live(target, greedy, greedy_run):
    eos = greedy[1][4]  # sequence 1 ends early: the rounds after its end are not full-batch
    live_after, full_tokens = [], []

    def on_step(session, event):
        if event.step > 0 and live_after[-1] == len(PROMPTS):
            full_tokens.append(sum(len(t) for t in event.new_tokens.values()))
        live_after.append(len(session.live))

    if greedy_run:  # one token a sequence a forward: full rounds make tokens 2 .. the first end's
        result = greedy_decode(target, PROMPTS, MAX_NEW, eos_id=eos)
        full_tokens = [len(PROMPTS)] * (min(len(t) for t in result.tokens) - 1)
    else:
        result = speculative_decode(target, oracle(greedy), PROMPTS, MAX_NEW, K, eos_id=eos, on_step=on_step)
        assert 0 < len(full_tokens) < len(live_after) - 1  # some rounds full, some after sequence 1's end
    stats = result.stats
    assert full_tokens and stats.full_batch_generated == sum(full_tokens) < stats.num_generated
    assert 0 < stats.full_batch_seconds < stats.total_seconds
    assert stats.full_batch_tokens_per_second == pytest.approx(stats.full_batch_generated / stats.full_batch_seconds)
    assert "tokens / s, full batch" in stats.format_table()


@pytest.mark.parametrize("device_loop", [True, False])
def test_cancel_midway_frees_the_sequence(target, greedy, device_loop):
    proposer = oracle(greedy)
    with DecodeSession(target, proposer, PROMPTS, MAX_NEW, K, device_loop=device_loop) as session:
        assert session.step() and session.step()  # prefill, one round
        held = target.cache.num_free_blocks
        assert session.cancel(1) and not session.cancel(1)
        assert target.cache.num_free_blocks > held
        while session.step():
            pass
        result = session.result()
    assert result.finish_reasons == ["length", "cancelled", "length"]
    assert result.tokens[0] == greedy[0] and result.tokens[2] == greedy[2]
    assert result.tokens[1] == greedy[1][: len(result.tokens[1])] and len(result.tokens[1]) < MAX_NEW
    assert pools_full(target, proposer)
    with pytest.raises(InputError, match="cancel index"):
        session.cancel(3)


def test_cancel_every_sequence_ends_the_loop(target):
    proposer = make_proposer()
    session = DecodeSession(target, proposer, PROMPTS, MAX_NEW, K)
    session.step()
    for i in range(3):
        session.cancel(i)
    assert not session.step() and session.is_closed
    assert pools_full(target, proposer)


@pytest.mark.parametrize("device_loop", [True, False])
@pytest.mark.parametrize("fail_at", [1, 2, 7])  # drafter prefill, first propose, a later round
def test_a_failing_runner_mid_step_leaves_the_pools_exact(target, fail_at, device_loop):
    proposer = make_proposer()
    proposer.set_circuit_draft(FailingRunner(fail_at))
    with pytest.raises(ExecutionError, match="injected runner failure"):  # warm-up off: the steps fail
        speculative_decode(target, proposer, PROMPTS, MAX_NEW, K, warmup=False, device_loop=device_loop)
    assert pools_full(target, proposer)


def test_a_failing_warm_up_leaves_the_pools_exact(target):
    proposer = make_proposer()
    proposer.set_circuit_draft(FailingRunner(1))  # the warm-up's first drafter run raises
    session = DecodeSession(target, proposer, PROMPTS, MAX_NEW, K)
    with pytest.raises(ExecutionError, match="injected runner failure"):
        session.step()
    assert session.is_closed and session.result().finish_reasons == ["error"] * 3
    assert pools_full(target, proposer)


@pytest.mark.parametrize("device_loop", [True, False])
def test_a_failing_verify_or_callback_leaves_the_pools_exact(target, monkeypatch, device_loop):
    proposer = make_proposer()
    session = DecodeSession(target, proposer, PROMPTS, MAX_NEW, K, device_loop=device_loop)
    session.step()
    session.step()
    died = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("verify died"))  # noqa: E731
    if device_loop:
        monkeypatch.setattr(session._verifier, "run", died)
    else:
        monkeypatch.setattr(target, "verify", died)
    with pytest.raises(RuntimeError, match="verify died"):
        session.step()
    assert session.result().finish_reasons == ["error"] * 3 and not session.step()
    assert pools_full(target, proposer)
    monkeypatch.undo()

    def bad_callback(session, event):
        if event.step == 2:
            raise KeyError("callback")

    with pytest.raises(KeyError):
        speculative_decode(target, proposer, PROMPTS, MAX_NEW, K, on_step=bad_callback)
    assert pools_full(target, proposer)


def test_bad_requests_are_refused_before_any_allocation(target):
    proposer = make_proposer()
    with pytest.raises(InputError, match="prompt 1"):
        speculative_decode(target, proposer, [[1], []], 4, K)
    with pytest.raises(InputError, match="proposer mode"):
        speculative_decode(target, make_proposer(mode="collapsed"), [[1]], 4, K)
    with pytest.raises(InputError, match="max_seq_len"):
        speculative_decode(target, proposer, [[1] * 500], 20, K)
    with pytest.raises(InputError, match="num_drafts"):
        speculative_decode(target, proposer, [[1]], 4, 0)
    with pytest.raises(InputError, match="target: expected a TargetModel"):  # an AttributeError before
        speculative_decode(proposer, proposer, [[1]], 4, K)
    with pytest.raises(InputError, match="proposer: expected a DeepseekV4MtpProposer, got TargetModel"):
        speculative_decode(target, target, [[1]], 4, K)
    with pytest.raises(InputError, match="on_step: expected None or a callable"):
        speculative_decode(target, proposer, [[1]], 4, K, on_step=3)
    assert speculative_decode(target, proposer, [[1]], 0, K).tokens == [[]]
    assert pools_full(target, proposer)


@pytest.mark.parametrize("prompts, kw, fragments", [
    (["def f"], {}, ["prompt 0: expected a sequence of token ids, got str"]),  # a ValueError from int('d') before
    ([[1, 2.5]], {}, ["prompt 0 tokens[1]: expected an int in [0, ", "got 2.5"]),  # 2.5 ran as 2
    ([[1], [[1, 2]]], {}, ["prompt 1 tokens: expected an int in [0, ", "got [1, 2]"]),
    ([[1, 10**6]], {}, ["prompt 0 tokens[1]: expected an int in [0, ", "got 1000000"]),
    ([[1]], {"eos_id": -1}, ["eos_id: expected None or a token id", "got -1"]),  # never emitted: taken before
    ([[1]], {"eos_id": "2"}, ["eos_id: expected None or a token id", "got '2'"]),
    # from a fuzz of the loop's arguments: each was a TypeError or RuntimeError from inside
    (np.int64(3), {}, ["prompts: expected at least one prompt", "got np.int64(3)"]),
    ([np.int64(3)], {}, ["prompt 0: expected a sequence of token ids, got int64"]),
], ids=["str", "float", "nested", "out_of_vocab", "eos_negative", "eos_str", "int_prompts", "int_prompt"])
def test_prompts_and_eos_are_checked_as_ids(target, prompts, kw, fragments):
    proposer = make_proposer()
    for decode in (lambda: speculative_decode(target, proposer, prompts, 4, K, **kw),
                   lambda: greedy_decode(target, prompts, 4, **kw)):
        with pytest.raises(InputError) as e:
            decode()
        assert all(f in str(e.value) for f in fragments), str(e.value)
    assert pools_full(target, proposer)


def test_integer_prompts_of_every_kind_decode_alike(target):
    proposer = make_proposer()
    want = speculative_decode(target, proposer, [[1, 2, 3]], 4, K, warmup=False).tokens
    for ids in (np.array([1, 2, 3], dtype=np.int32), torch.tensor([1, 2, 3]), (np.int64(1), 2, 3)):
        assert speculative_decode(target, proposer, [ids], 4, K, warmup=False).tokens == want
    # the prompts as one 2-D tensor: its truth value was a RuntimeError before
    assert speculative_decode(target, proposer, torch.tensor([[1, 2, 3]]), 4, K, warmup=False).tokens == want


def test_accept_greedy():
    assert accept_greedy([5, 7, 9], [5, 7, 9, 4]) == (3, 4)
    assert accept_greedy([5, 7, 9], [5, 8, 9, 4]) == (1, 8)
    assert accept_greedy([5, 7, 9], [6, 7, 9, 4]) == (0, 6)
    assert accept_greedy([], [3]) == (0, 3)


def test_stats_table():
    stats = DecodeStats(
        num_drafts=3,
        num_sequences=2,
        num_generated=10,
        num_steps=3,
        num_proposes=3,
        propose_seconds=0.03,
        verify_seconds=0.05,
        total_seconds=0.1,
    )
    for a in (3, 1, 0, 2):
        stats.record_verify(a)
    assert stats.acceptance_by_position() == [0.75, 0.5, 0.25]
    assert stats.acceptance_rate == pytest.approx(6 / 12) and stats.mean_accepted_length == 2.5
    assert stats.draft_ms_per_propose == pytest.approx(10.0) and stats.tokens_per_second == pytest.approx(100)
    table = stats.format_table()
    lines = table.splitlines()
    assert lines[0] == "acceptance by draft position"
    assert lines[1].split() == ["draft", "position", "1", "2", "3"]
    assert lines[2].split() == ["accepted", "0.750", "0.500", "0.250"]
    for name in ("acceptance rate", "mean accepted length", "tokens / s", "draft ms / propose"):
        assert name in table
    split = {
        line.split()[0]: line.split()[1:]
        for line in lines[lines.index(next(ln for ln in lines if ln.startswith("time split"))) + 1 :]
    }
    assert list(split) == ["prefill", "draft", "verify", "host", "total"]
    assert split["host"] == ["0.0200", "20.0%"] and split["total"][1] == "100.0%"
    assert stats.as_dict()["seconds"]["draft"] == pytest.approx(0.03)


def test_progress_bar_goes_to_stderr(target, capsys):
    proposer = make_proposer()
    speculative_decode(target, proposer, PROMPTS[:1], 4, K, progress=True)
    captured = capsys.readouterr()
    assert "decode K=3" in captured.err and captured.out == ""
    assert torch.get_num_threads() == 1
