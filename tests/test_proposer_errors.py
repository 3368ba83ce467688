"""Each bad input gets its typed error and leaves the state and the cache unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from draftgraph.runtime.errors import CacheError, InputError
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer, ProposerOptions
from proposer_fixtures import TINY, hidden, make_proposer

WORDS = (TINY.vocab_size + 31) // 32


@pytest.fixture()
def setup():
    gen = torch.Generator().manual_seed(0)
    prop = make_proposer(TINY)
    state = prop.alloc_state()
    prop.prefill_drafter(list(range(6)), hidden(TINY, gen, n=6), state)
    prop.propose(3, hidden(TINY, gen), 5, 2, state)
    return prop, state, gen


def frozen(prop, state):
    return state.snapshot(), prop.cache.num_free_blocks, prop.cache.kv.clone()


def assert_unchanged(prop, state, before):
    snap, free, kv = before
    assert state.snapshot() == snap
    assert prop.cache.num_free_blocks == free
    assert torch.equal(prop.cache.kv, kv)


BAD_PROPOSE = {
    "token past vocab": dict(last_token=TINY.vocab_size),
    "negative token": dict(last_token=-1),
    "token not an int": dict(last_token="7"),
    "negative position": dict(position=-1),
    "position past max": dict(position=TINY.max_position_embeddings),
    "hidden shape": dict(target_hidden=torch.zeros(3, TINY.hidden_size, dtype=torch.bfloat16)),
    "hidden dtype": dict(target_hidden=torch.zeros(TINY.hc_mult, TINY.hidden_size)),
    "hidden device": dict(target_hidden=torch.zeros(TINY.hc_mult, TINY.hidden_size, dtype=torch.bfloat16,
                                                    device="meta")),
    "bitmask length": dict(grammar_bitmask=[1] * (WORDS + 1)),
    "zero drafts": dict(num_drafts=0),
    "too many drafts": dict(num_drafts=99),
}


@pytest.mark.parametrize("case", sorted(BAD_PROPOSE))
def test_bad_propose_input(setup, case):
    prop, state, gen = setup
    args = dict(last_token=3, target_hidden=hidden(TINY, gen), position=7, num_drafts=2, grammar_bitmask=None)
    args.update(BAD_PROPOSE[case])
    before = frozen(prop, state)
    with pytest.raises(InputError) as info:
        prop.propose(args["last_token"], args["target_hidden"], args["position"], args["num_drafts"], state,
                     grammar_bitmask=args["grammar_bitmask"])
    assert "expected" in str(info.value)
    assert_unchanged(prop, state, before)


def test_budget_from_alloc_state_for_is_enforced(setup):
    prop, _, gen = setup
    state = prop.alloc_state_for(10)
    prop.propose(1, hidden(TINY, gen), 7, 3, state)  # positions 7..9 fit a budget of 10
    before = frozen(prop, state)
    with pytest.raises(InputError, match="budget"):
        prop.propose(1, hidden(TINY, gen), 8, 3, state)
    assert_unchanged(prop, state, before)
    with pytest.raises(InputError):
        prop.alloc_state_for(0)


def test_bad_batch_inputs(setup):
    prop, state, gen = setup
    before = frozen(prop, state)
    h = hidden(TINY, gen)
    with pytest.raises(InputError, match="length"):
        prop.propose_batch([1, 2], [h], [7, 7], 1, [state, prop.alloc_state()])
    with pytest.raises(InputError, match="distinct"):
        prop.propose_batch([1, 2], [h, h], [7, 7], 1, [state, state])
    many = [prop.alloc_state() for _ in range(prop.propose_batch_max() + 1)]
    with pytest.raises(InputError, match="propose_batch_max"):
        prop.propose_batch([1] * len(many), [h] * len(many), [0] * len(many), 1, many)
    bad_token_batch = [prop.alloc_state(), state]
    with pytest.raises(InputError):
        prop.propose_batch([1, TINY.vocab_size], [h, h], [0, 7], 1, bad_token_batch)
    assert_unchanged(prop, state, before)


def test_bad_state_and_after_verify(setup):
    prop, state, gen = setup
    other = make_proposer(TINY)
    before = frozen(prop, state)
    with pytest.raises(InputError, match="another proposer"):
        prop.propose(1, hidden(TINY, gen), 7, 1, other.alloc_state())
    with pytest.raises(InputError, match="num_accepted"):
        prop.after_verify(3, state)  # only 2 were drafted
    with pytest.raises(InputError, match="MtpProposerState"):
        prop.after_verify(0, object())
    assert_unchanged(prop, state, before)
    freed = prop.alloc_state()
    prop.free_state(freed)
    with pytest.raises(InputError, match="freed"):
        prop.propose(1, hidden(TINY, gen), 0, 1, freed)


def test_bad_catchup(setup):
    prop, state, gen = setup
    before = frozen(prop, state)
    with pytest.raises(InputError, match="hiddens"):
        prop.catchup_drafter([1, 2, 3], hidden(TINY, gen, n=2), 7, 7, state)
    with pytest.raises(InputError, match="row_base"):
        prop.catchup_drafter([1], hidden(TINY, gen, n=1), 3, 7, state)
    with pytest.raises(InputError):
        prop.catchup_drafter([TINY.vocab_size], hidden(TINY, gen, n=1), 7, 7, state)
    assert_unchanged(prop, state, before)


def test_pool_exhaustion_is_a_cache_error_and_changes_nothing():
    gen = torch.Generator().manual_seed(1)
    prop = make_proposer(TINY, num_cache_blocks=3)
    a, b = prop.alloc_state(), prop.alloc_state()
    prop.propose(1, hidden(TINY, gen), 0, 1, a)
    prop.propose(1, hidden(TINY, gen), 100, 1, b)  # 2 of 3 blocks used
    before = frozen(prop, a)
    with pytest.raises(CacheError, match="free"):
        prop.propose_batch([1, 1], [hidden(TINY, gen)] * 2, [200, 300], 2, [a, b])  # needs 2 more
    assert_unchanged(prop, a, before)
    assert b.snapshot()[1] == 101
    prop.free_state(a)
    prop.free_state(b)
    assert prop.cache.num_free_blocks == 3


@pytest.mark.parametrize("options, fragment", [
    ({"overlap": "yes"}, "overlap: expected True or False, got 'yes'"),
    ({"debug": 1}, "debug: expected True or False, got 1"),
    ({"poison_arena": None}, "poison_arena: expected True or False, got None"),
    ({"max_seq_len": 0}, "max_seq_len: expected None or an int in [1, 512]"),
    ({"max_seq_len": 10**12}, "got 1000000000000"),  # was a MemoryError from the host's row tables
    ({"num_cache_blocks": 0}, "num_cache_blocks: expected None or an int >= 1, got 0"),
    ({"extra": {"nosuch": 1}}, "extra: expected a dict with keys among ['vocab_limit'], got ['nosuch']"),
    ({"extra": {"vocab_limit": 10**9}}, "extra['vocab_limit']: expected an int in [1, 100]"),
    ({"max_num_drafts": True}, "max_num_drafts: expected an int in [1, "),  # True had passed as 1
    ({"mtp_vocab_size": False}, "mtp_vocab_size: expected an int in [0, 100]"),  # False had passed as 0
    ({"draft_conf_tau": "0.5"}, "draft_conf_tau: expected a number in [0, 1]"),  # was a TypeError
    ({"draft_conf_tau": float("nan")}, "got nan"),
    ({"buckets": None}, "buckets: expected a sequence of ints >= 1 (batch sizes), got None"),  # was a TypeError
    ({"buckets": (1, True)}, "got (1, True)"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_bad_options_are_typed_before_any_allocation(options, fragment):
    with pytest.raises(InputError) as e:
        DeepseekV4MtpProposer(TINY, {}, **options)  # no weights: the options fail first
    assert fragment in str(e.value)


def test_a_cache_that_does_not_fit_is_a_cache_error():
    with pytest.raises(CacheError, match=r"num_blocks: expected a cache that fits in cpu memory, got 10\*\*15"
                                         .replace(r"10\*\*15", str(10**15))):
        make_proposer(TINY, num_cache_blocks=10**15)


def test_the_constructor_names_its_arguments_when_given_a_path(tmp_path):
    """A path where the config goes (the classmethod's job) was an AttributeError deep inside."""
    with pytest.raises(InputError, match="config: expected a V4Config, got PosixPath .*from_checkpoint"):
        DeepseekV4MtpProposer(tmp_path, {})
    with pytest.raises(InputError, match="tensors: expected a mapping"):
        DeepseekV4MtpProposer(TINY, [torch.zeros(1)])
    with pytest.raises(InputError, match=r"options= or keyword options, not both.*\['executor'\]"):
        DeepseekV4MtpProposer(TINY, {}, options=ProposerOptions(), executor="eager")  # executor was dropped
    with pytest.raises(InputError, match="options: expected a ProposerOptions, got dict"):
        DeepseekV4MtpProposer(TINY, {}, options={"executor": "eager"})


def test_last_hidden_is_checked_against_the_last_propose():
    """Before any propose it was an IndexError; past the last batch's rows it returned the bucket's
    padding rows as if they were sequences', and n=-1 dropped a row."""
    gen = torch.Generator().manual_seed(3)
    prop = make_proposer(TINY, buckets=(1, 4))
    with pytest.raises(InputError, match="last_hidden: expected a propose before it, got none yet"):
        prop.last_hidden()
    states = [prop.alloc_state() for _ in range(3)]
    prop.propose_batch([1, 2, 3], [hidden(TINY, gen)] * 3, [0, 0, 0], 2, states)  # 3 rows in the bucket of 4
    assert prop.last_hidden(3).shape == (3, TINY.hc_mult, TINY.hidden_size)
    for n in (4, 0, -1, True, 2.0):
        with pytest.raises(InputError, match=r"last_hidden n: expected an int in \[1, 3\]"):
            prop.last_hidden(n)
    prop.propose(4, hidden(TINY, gen), 0, 1, prop.alloc_state())
    assert prop.last_hidden().shape == (1, TINY.hc_mult, TINY.hidden_size)
    with pytest.raises(InputError, match=r"\[1, 1\]"):
        prop.last_hidden(2)


@pytest.mark.parametrize("device, fragment", [
    ("tpu", "expected cpu, cuda or cuda:N, got 'tpu'"),
    (3.5, "expected cpu, cuda or cuda:N, got 3.5"),
    ("cuda:99", "cuda"),  # without CUDA: no GPU visible; with it: past the last one
])
def test_a_device_the_runtime_cannot_use_is_refused_before_the_read(tmp_path, monkeypatch, device, fragment):
    """device= of from_checkpoint (proposer and target): one InputError naming what runs, before a
    byte of the checkpoint is read (torch raised RuntimeError or AssertionError after the read)."""
    from draftgraph.runtime.decode.target import TargetModel
    from draftgraph.runtime.model import weights

    def no_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the device was checked")

    monkeypatch.setattr(weights, "load_checkpoint", no_read)
    for build in (DeepseekV4MtpProposer.from_checkpoint, TargetModel.from_checkpoint):
        with pytest.raises(InputError, match=r"^device: expected ") as exc:
            build(tmp_path, device=device)
        assert fragment in str(exc.value)


def test_an_unknown_option_is_refused_before_the_read(tmp_path, monkeypatch):
    from draftgraph.runtime.model import weights

    monkeypatch.setattr(weights, "load_checkpoint", lambda *a, **k: pytest.fail("read before the options"))
    with pytest.raises(TypeError, match="no_such_option"):
        DeepseekV4MtpProposer.from_checkpoint(tmp_path, no_such_option=1)


@pytest.mark.parametrize("count, expected", [(1, "cuda or cuda:0"), (2, "cuda, or cuda:0 .. cuda:1")])
def test_a_gpu_past_the_last_visible_one_is_named_with_the_visible_range(monkeypatch, count, expected):
    """check_device's CUDA branch on a CPU machine: torch's CUDA queries stand in for count GPUs."""
    from draftgraph.runtime.device import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert check_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    with pytest.raises(InputError, match=rf"^device: expected {expected}, got 'cuda:{count}' \(hint: {count} CUDA"):
        check_device(f"cuda:{count}")


@pytest.mark.parametrize("drafts, target_tokens, match", [
    ([1, 2, 3], [1], r"target_tokens length: expected 4 \(one per draft, then the bonus\), got 1"),
    ([1, 2], [1, 2, 3, 4], r"target_tokens length: expected 3 .*got 4"),
    (None, [1], r"accept_greedy: expected two sequences of token ids .*got NoneType and list"),
])
def test_accept_greedy_refuses_a_window_of_the_wrong_length(drafts, target_tokens, match):
    """Was an IndexError (too short) or a silent answer from a window that is not this propose's (too long)."""
    from draftgraph.runtime.decode.loop import accept_greedy

    with pytest.raises(InputError, match=match):
        accept_greedy(drafts, target_tokens)
    assert accept_greedy([5, 7, 9], [5, 7, 2, 4]) == (2, 2)


def test_the_cpu_is_one_device():
    """cpu:0 is the cpu; cpu:1 was accepted and then every weight failed to bind at the first propose."""
    from draftgraph.runtime.device import check_device

    assert check_device("cpu:0") == torch.device("cpu") == check_device(torch.device("cpu", 0))
    with pytest.raises(InputError, match=r"^device: expected cpu, cuda or cuda:N, got 'cpu:1' \(hint: the CPU is one"):
        check_device("cpu:1")


@pytest.mark.parametrize("buckets", [None, 8, "12", (), (0, 2), (1.5,), (np.True_,)])
def test_set_buckets_refuses_what_the_options_refuse_and_keeps_its_own(buckets):
    prop = make_proposer(TINY, buckets=(1, 4))
    with pytest.raises(InputError, match=r"^buckets: expected a sequence of ints >= 1 \(batch sizes\), got "):
        prop.set_buckets(buckets)
    assert prop.buckets == (1, 4)
    prop.set_buckets([np.int64(2), 1, 2])  # numpy ints taken as ints, sorted, once each
    assert prop.buckets == (1, 2)



def _prefilled(prop, gen):
    state = prop.alloc_state()
    prop.prefill_drafter([1, 2, 3], hidden(TINY, gen, n=3), state)
    return state


# Calls with arguments of the wrong kind that ended in a TypeError, IndexError, AttributeError or
# ValueError from inside (found by a random fuzz of every public method); each must be an InputError
# and leave the state, the pool and the cache as they were.
MISUSE = {
    "after_verify_batch with no counts": lambda p, s, h: p.after_verify_batch([], [s]),  # was an IndexError
    "after_verify_batch with a float": lambda p, s, h: p.after_verify_batch(1.5, [s]),
    "after_verify_batch with a dict": lambda p, s, h: p.after_verify_batch({}, [s]),
    "catchup_batch with a 0-d token tensor": lambda p, s, h: p.catchup_batch(torch.tensor(1), [h[None]], [0], [s]),
    "catchup_batch with 0-d states": lambda p, s, h: p.catchup_batch([[1]], [h[None]], [0], torch.tensor(1)),
    "prefill_drafter with an int prompt": lambda p, s, h: p.prefill_drafter(5, h[None], s),
    "free_drafter_kv of an int": lambda p, s, h: p.free_drafter_kv(3),
    "free_drafter_kv of strings": lambda p, s, h: p.free_drafter_kv(["a"]),
    "prefill_hidden_rows of a str": lambda p, s, h: p.prefill_hidden_rows("8"),
    "capture of K 1000": lambda p, s, h: p.capture(1000),  # built a graph of 1000 steps first
    "capture of a str": lambda p, s, h: p.capture("x"),
    "chain_graph of K 2**63": lambda p, s, h: p.chain_graph(2**63),  # a hang
    "chain_graph masked by an array": lambda p, s, h: p.chain_graph(1, masked=np.zeros(2)),
    "warm_up of a bucket int": lambda p, s, h: p.warm_up(1, 4, [1]),
    "warm_up of an unknown bucket": lambda p, s, h: p.warm_up(1, [3], [1]),
    "set_circuit_draft of an array": lambda p, s, h: p.set_circuit_draft(np.zeros(2)),
    "load_weights of one tensor": lambda p, s, h: p.load_weights({"embed.weight": h}),  # replaced them all
    "load_weights of a str value": lambda p, s, h: p.load_weights({"embed.weight": "x"}),
    "load_weights of a list": lambda p, s, h: p.load_weights([h]),
    # out_conf was filled after the run: a dict made an AttributeError with the propose already committed
    "propose_batch out_conf a dict": lambda p, s, h: p.propose_batch([1], [h], [s.seq_len], 1, [s], out_conf={}),
    # checked after the run until now: the propose had committed its drafts when the error came
    "propose with a float embed target": lambda p, s, h: p.propose(1, h, s.seq_len, 2, s,
                                                                   draft_embed_target=torch.zeros(TINY.hidden_size)),
    "propose with a two-row embed target": lambda p, s, h: p.propose(
        1, h, s.seq_len, 2, s, draft_embed_target=torch.zeros(2, TINY.hidden_size, dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("call", MISUSE.values(), ids=MISUSE.keys())
def test_misuse_is_typed_and_harmless(call):
    from draftgraph.runtime.errors import DraftGraphError, RunnerError

    gen = torch.Generator().manual_seed(11)
    prop = make_proposer(TINY, buckets=(1, 4))
    state = _prefilled(prop, gen)
    weights = dict(prop.weights)
    before = (state.snapshot(), prop.cache.num_free_blocks, prop.cache.kv.clone())
    h = hidden(TINY, gen)
    with pytest.raises(DraftGraphError) as info:
        call(prop, state, h)
    assert isinstance(info.value, (InputError, CacheError, RunnerError)), info.value
    assert_unchanged(prop, state, before)
    assert prop.weights.keys() == weights.keys() and all(prop.weights[k] is v for k, v in weights.items())
    assert len(prop.propose(1, h, state.seq_len, 2, state)) == 2  # and the proposer still drafts


def test_a_proposer_without_its_weights_is_refused_when_built():
    """Was accepted, and every propose then failed to bind."""
    with pytest.raises(InputError, match=r"^cannot bind graph tensors: \d+ problem\(s\): @embed.weight: missing"):
        DeepseekV4MtpProposer(TINY, {})
