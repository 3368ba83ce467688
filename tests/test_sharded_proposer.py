"""The proposer sharded over 2 and 4 gloo ranks drafts what the unsharded proposer drafts.

Each rank runs the same calls with the same inputs (design note "replicated host",
runtime/proposer/sharding.py): a drafter prefill, propose_batch at K=1 and K=3 (with
confidences), propose with a grammar mask, a runtime vocab limit and a device propose with
catch-up rows in its first step, in both input modes,
with and without mtp_vocab_size. The parent runs the same calls unsharded on the same
checkpoint. Drafts must be equal on every rank; confidences and the final hidden agree
within fp32 rounding (the MoE's partial sums and the softmax denominator are added in
another order). Each rank holds only its shard; a rank that refuses its input makes every
rank fail within the collective timeout, never hang.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from checkpoint_spy import SpyOpen
from draftgraph.runtime.errors import InputError
from draftgraph.runtime.ir.printer import format_graph
from draftgraph.runtime.model.sharding import ShardPlan
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.model.weights import load_checkpoint, make_synthetic_checkpoint
from draftgraph.runtime.proposer.binding import prepare_weights, weights_nbytes
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from proposer_fixtures import TINY
from rank_processes import results, run_ranks

SEED, VOCAB_LIMITED = 3, 60  # TINY: 4 experts, vocab 100; 60 drafted rows split in 2 and in 4
BATCH = 3


def _drive(prop: DeepseekV4MtpProposer) -> dict:
    """The calls every rank (and the unsharded reference) makes; what each returned."""
    g = torch.Generator().manual_seed(11)
    shape = (TINY.hc_mult, TINY.hidden_size) if prop.options.mode == "streams" else (TINY.hidden_size,)
    states = [prop.alloc_state() for _ in range(BATCH)]
    for s in states:
        prop.prefill_drafter([1, 2, 3, 4, 5], torch.randn(5, *shape, generator=g).bfloat16(), s)
    out = {"drafts": [], "conf": [], "hidden": []}
    position = 4
    for k in (1, 3):
        conf = []
        drafts = prop.propose_batch([7, 8, 9], torch.randn(BATCH, *shape, generator=g).bfloat16(), [position] * BATCH,
                                    k, states, out_conf=conf)
        out["drafts"].append(drafts)
        out["conf"].append(conf)
        out["hidden"].append(prop.last_hidden(BATCH))
        for s in states:
            prop.after_verify(k - 1, s)
        position += k
    mask = torch.randint(-(2**31), 2**31 - 1, ((TINY.vocab_size + 31) // 32,), generator=g, dtype=torch.int64)
    out["drafts"].append(prop.propose(5, torch.randn(*shape, generator=g).bfloat16(), position, 3, states[0],
                                      grammar_bitmask=mask.to(torch.int32)))
    prop.after_verify(0, states[0])
    prop.set_vocab_limit(37)  # a runtime limit inside the first rank's rows (and inside a slice at W=4)
    out["drafts"].append(prop.propose_batch([3, 4, 5], torch.randn(BATCH, *shape, generator=g).bfloat16(),
                                            [position] * BATCH, 2, states))
    # the device loop's propose: two catch-up rows each in the chain's first step, then K - 1 steps
    for s in states:
        prop.after_verify(1, s)
    k = 1 if prop.options.draft_conf_tau > 0 else 3  # a gated chain's device propose drafts one
    owed = ([[6, 7]] * BATCH, [torch.randn(2, *shape, generator=g).bfloat16() for _ in range(BATCH)],
            [position + 1] * BATCH)
    handle = prop.propose_device([2, 3, 4], torch.randn(BATCH, *shape, generator=g).bfloat16(), [position + 3] * BATCH,
                                 k, states, catchup=owed)
    out["drafts"].append(handle.drafts.tolist())
    prop.after_verify_device(handle, [0] * BATCH, dropped=False)
    out["needs_comm"] = prop.needs_comm()
    out["weight_bytes"] = weights_nbytes(prop.weights)
    out["free_blocks"] = prop.cache.num_free_blocks
    return out


# (mode, mtp_vocab_size, draft_conf_tau): the last one confidence-gated (a gate's flag is read the same on every rank)
CASES = [("streams", 0, 0.0), ("collapsed", 0, 0.0), ("streams", VOCAB_LIMITED, 0.0), ("collapsed", VOCAB_LIMITED, 0.0),
         ("streams", 0, 0.08)]


def _from_checkpoint(rank: int, world: int, path: str, cases) -> list[dict]:
    return [_drive(DeepseekV4MtpProposer.from_checkpoint(path, process_group=dist.group.WORLD, mode=mode,
                                                         mtp_vocab_size=vocab, draft_conf_tau=tau, executor="eager",
                                                         buckets=(1, 4)))
            for mode, vocab, tau in cases]


def _from_tensors(rank: int, world: int, cases) -> list[dict]:
    """The constructor path: the whole checkpoint in memory, cut to the rank's shard by prepare_weights."""
    weights = random_mtp_weights(TINY, seed=SEED)
    return [_drive(DeepseekV4MtpProposer(TINY, weights, process_group=dist.group.WORLD, mode=mode,
                                         mtp_vocab_size=vocab, draft_conf_tau=tau, executor="eager", buckets=(1, 4)))
            for mode, vocab, tau in cases]


def _unsharded(path, mode: str, vocab: int, tau: float) -> dict:
    return _drive(DeepseekV4MtpProposer.from_checkpoint(path, mode=mode, mtp_vocab_size=vocab, draft_conf_tau=tau,
                                                        executor="eager", buckets=(1, 4)))


def _held_bytes(rank: int, world: int, vocab: int) -> int:
    """Bytes a rank should hold, from the whole weights: what ShardPlan gives it, counted here independently."""
    weights = random_mtp_weights(TINY, seed=SEED)
    e, drafted = TINY.n_routed_experts // world, (vocab or TINY.vocab_size) // world
    total = 0
    for name, t in weights.items():
        expert = name.split(".experts.")[1].split(".")[0] if ".experts." in name else None
        if expert is not None and int(expert) not in range(rank * e, (rank + 1) * e):
            continue
        if ".shared_experts." in name and rank > 0:
            continue
        rows = drafted if name == "head.weight" else t.shape[0]
        total += t[:rows].numel() * t.element_size()
    return total


def _check_against_unsharded(per_rank: list[list[dict]], cases, want: list[dict], world: int) -> None:
    for index, (mode, vocab, tau) in enumerate(cases):
        ref = want[index]
        assert not ref["needs_comm"]
        for rank, got in enumerate(r[index] for r in per_rank):
            where = (world, rank, mode, vocab, tau)
            assert got["drafts"] == ref["drafts"], where
            assert got["needs_comm"], where
            assert got["free_blocks"] == ref["free_blocks"], where  # the host bookkeeping is the same
            for g, w in zip(got["conf"], ref["conf"]):  # per row: gated rows may be shorter than K
                for g_row, w_row in zip(g, w, strict=True):
                    torch.testing.assert_close(torch.tensor(g_row), torch.tensor(w_row), rtol=1e-5, atol=1e-7)
            for g, w in zip(got["hidden"] if not tau else [], ref["hidden"]):  # bf16: at most one rounding apart
                torch.testing.assert_close(g.float(), w.float(), rtol=2**-7, atol=1e-6)
            assert got["weight_bytes"] == _held_bytes(rank, world, vocab), where
        flat = [d for drafts in ref["drafts"] for row in drafts for d in (row if isinstance(row, list) else [row])]
        assert max(flat) < (vocab or TINY.vocab_size)  # mtp_vocab_size held
        assert max(d for drafts in ref["drafts"][-2:] for row in drafts for d in row) < 37  # the runtime limit held
        if tau:  # the gate stopped some row early: the case tests what it says
            assert any(len(row) < 3 for row in ref["drafts"][1]), ref["drafts"][1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    make_synthetic_checkpoint(path, TINY, fmt="bf16", seed=SEED)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """One rank's results, on one intra-op thread as every rank runs (rank_processes.py): a CPU GEMM's
    reduction order follows its thread count, and the confidences are compared to 1e-5. (Until
    2026-12-05 this held only when another test module had set one thread at its import.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {case: _unsharded(checkpoint, *case) for case in CASES}
    finally:
        torch.set_num_threads(before)


def test_two_ranks_draft_what_one_drafts(tmp_path, checkpoint, reference):
    per_rank = results(run_ranks(2, _from_checkpoint, str(checkpoint), CASES, folder=tmp_path))
    _check_against_unsharded(per_rank, CASES, [reference[c] for c in CASES], 2)


def test_four_ranks_from_whole_tensors_draft_what_one_drafts(tmp_path, reference):
    cases = [("streams", VOCAB_LIMITED, 0.0), ("collapsed", 0, 0.0)]
    per_rank = results(run_ranks(4, _from_tensors, cases, folder=tmp_path))
    _check_against_unsharded(per_rank, cases, [reference[c] for c in cases], 4)


def _native(rank: int, world: int, path: str) -> dict:
    """Weights kept as stored (MXFP4 experts, FP8 linears): moe_shard reads only its experts' blocks."""
    return _drive(DeepseekV4MtpProposer.from_checkpoint(path, process_group=dist.group.WORLD, weights="native",
                                                        executor="eager", buckets=(1, 4)))


def test_two_ranks_on_native_mxfp4_weights_draft_what_one_drafts(tmp_path):
    path = tmp_path / "mxfp4"
    make_synthetic_checkpoint(path, TINY, fmt="mxfp4", seed=SEED)
    want = _drive(DeepseekV4MtpProposer.from_checkpoint(path, weights="native", executor="eager", buckets=(1, 4)))
    for got in results(run_ranks(2, _native, str(path), folder=tmp_path / "ranks")):
        assert got["drafts"] == want["drafts"] and got["needs_comm"]
        for g, w in zip(got["conf"], want["conf"]):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-5, atol=1e-7)


def _one_rank(rank: int, world: int, path: str) -> tuple:
    prop = DeepseekV4MtpProposer.from_checkpoint(path, process_group=dist.group.WORLD, executor="eager",
                                                 buckets=(1, 4))
    return format_graph(prop.chain_graph(3)), prop.needs_comm(), _drive(prop)["drafts"]


def test_a_group_of_one_rank_is_the_unsharded_proposer(tmp_path, checkpoint, reference):
    text, needs_comm, drafts = results(run_ranks(1, _one_rank, str(checkpoint), folder=tmp_path))[0]
    plain = DeepseekV4MtpProposer.from_checkpoint(checkpoint, executor="eager", buckets=(1, 4))
    assert text == format_graph(plain.chain_graph(3)) and "vocab_parallel" not in text
    assert not needs_comm and drafts == reference[("streams", 0, 0.0)]["drafts"]


def _refuses_on_rank_one(rank: int, world: int, path: str) -> None:
    prop = DeepseekV4MtpProposer.from_checkpoint(path, process_group=dist.group.WORLD, executor="eager",
                                                 buckets=(1, 4))
    hidden = torch.zeros(TINY.hc_mult, TINY.hidden_size, dtype=torch.bfloat16)
    token = TINY.vocab_size if rank == 1 else 5  # rank 1 alone is given a token out of the vocab
    prop.propose(token, hidden, 0, 2, prop.alloc_state())


def test_a_rank_that_refuses_its_input_fails_every_rank_without_hanging(tmp_path, checkpoint):
    outcomes = run_ranks(2, _refuses_on_rank_one, str(checkpoint), folder=tmp_path, timeout=60, collective_timeout=5)
    assert not outcomes[1]["ok"] and outcomes[1]["error"].startswith("InputError") and "last_token" in \
        outcomes[1]["error"]
    assert not outcomes[0]["ok"]  # waited in the MoE's all-reduce: timed out or saw the peer leave


# ---- in one process: the shard's bytes, the plan's checks ---------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_only_its_shard(tmp_path, monkeypatch, fmt, world):
    import draftgraph.runtime.model.weights as weights_module

    make_synthetic_checkpoint(tmp_path, TINY, fmt=fmt, seed=SEED)
    counter = [0]
    # Every tensor and slice safe_open hands out, counted apart from the loader's own count; the head
    # rows are read past it, through read_byte_range, counted too.
    def count(name, tensor):
        counter[0] += tensor.nbytes

    monkeypatch.setattr(weights_module, "safe_open", SpyOpen(weights_module.safe_open, count))
    real_range = weights_module.read_byte_range

    def counted_range(file, offset, size):
        counter[0] += size
        return real_range(file, offset, size)

    monkeypatch.setattr(weights_module, "read_byte_range", counted_range)
    whole = load_checkpoint(tmp_path, weights="native")
    whole_bytes, counter[0] = counter[0], 0
    head = whole.tensors["head.weight"]
    seen_experts, seen_rows = [], 0
    for rank in range(world):
        plan = ShardPlan.make(TINY, rank, world, VOCAB_LIMITED)
        ckpt = load_checkpoint(tmp_path, weights="native", shard=plan)
        read, counter[0] = counter[0], 0
        assert read == ckpt.bytes_read  # the loader's own count is what it read
        mine = {n for n in ckpt.tensors if ".experts." in n and ".shared_" not in n}
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in mine}
        assert experts == set(range(*plan.experts)), (rank, experts)
        seen_experts += sorted(experts)
        assert ("mtp.0.ffn.shared_experts.w1.weight" in ckpt.tensors) == (rank == 0)
        assert torch.equal(ckpt.tensors["head.weight"], head[plan.vocab_start : plan.vocab_stop])
        assert ckpt.tensors["head.weight"].untyped_storage().nbytes() == ckpt.tensors["head.weight"].nbytes
        seen_rows += ckpt.tensors["head.weight"].shape[0]
        skipped = sum(whole.tensors[n].nbytes for n in whole.tensors if n not in ckpt.tensors)
        head_skipped = (head.shape[0] - plan.num_local_rows) * head.shape[1] * head.element_size()
        assert read == whole_bytes - skipped - head_skipped, (rank, read, whole_bytes)
    assert seen_experts == list(range(TINY.n_routed_experts)) and seen_rows == VOCAB_LIMITED


def test_prepare_weights_keeps_the_shard_only():
    weights = random_mtp_weights(TINY, seed=SEED)
    plan = ShardPlan.make(TINY, 1, 2)
    held = prepare_weights(TINY, weights, torch.device("cpu"), shard=plan)
    stacked = held["mtp.0.ffn.experts.stacked.w1"]
    assert stacked.shape[0] == 2 and torch.equal(stacked[0], weights["mtp.0.ffn.experts.2.w1.weight"])
    assert "mtp.0.ffn.experts.0.w1.weight" not in held and "mtp.0.ffn.shared_experts.w1.weight" not in held
    assert torch.equal(held["head.weight"], weights["head.weight"][50:])
    assert held["head.weight"].untyped_storage().nbytes() == 50 * TINY.hidden_size * 2  # a copy, not a view


@pytest.mark.parametrize("kw, what", [
    ({"rank": 2, "world": 2}, "shard rank"),
    ({"rank": 0, "world": 3}, "routed experts"),  # 4 experts do not split in 3
    ({"rank": 0, "world": 2, "mtp_vocab_size": 61}, "mtp_vocab_size"),
    ({"rank": 0, "world": 0}, "shard world"),
])
def test_a_plan_that_does_not_split_is_refused(kw, what):
    with pytest.raises(InputError, match=what):
        ShardPlan.make(TINY, **kw)


def test_a_bad_process_group_is_refused_with_a_typed_error(monkeypatch):
    weights = random_mtp_weights(TINY, seed=SEED)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InputError, match="torchrun"):  # 'env' outside torchrun
        DeepseekV4MtpProposer(TINY, weights, process_group="env", executor="eager")
    with pytest.raises(InputError, match="ProcessGroup"):
        DeepseekV4MtpProposer(TINY, weights, process_group=object(), executor="eager")
    with pytest.raises(InputError, match="process_group"):
        DeepseekV4MtpProposer(TINY, weights, process_group="nccl", executor="eager")


@pytest.mark.parametrize("route", ["keyword", "options"])
def test_from_checkpoint_reads_the_shard_whichever_way_the_group_is_given(tmp_path, monkeypatch, route):
    """options=ProposerOptions(process_group=g) read the whole checkpoint on every rank (only the keyword
    was looked at); both routes now hand the loader this rank's plan, with its mtp_vocab_size."""
    import draftgraph.runtime.model.weights as weights_module
    import draftgraph.runtime.proposer.proposer as proposer_module
    from draftgraph.runtime.proposer.options import ProposerOptions

    make_synthetic_checkpoint(tmp_path, TINY, seed=SEED)
    group = object()  # stands for a ProcessGroup: shard_setup is the spy below
    seen = {}

    def fake_setup(config, process_group, mtp_vocab_size, device):
        seen["setup"] = (process_group, mtp_vocab_size)
        return ShardPlan.make(config, 1, 2, mtp_vocab_size), None

    class Stop(Exception):
        pass

    def fake_load(path, config, device, weights, shard):
        seen["shard"] = shard
        raise Stop

    monkeypatch.setattr(proposer_module, "shard_setup", fake_setup)
    monkeypatch.setattr(weights_module, "load_checkpoint", fake_load)
    kw = ({"process_group": group, "mtp_vocab_size": VOCAB_LIMITED} if route == "keyword"
          else {"options": ProposerOptions(process_group=group, mtp_vocab_size=VOCAB_LIMITED)})
    with pytest.raises(Stop):
        DeepseekV4MtpProposer.from_checkpoint(tmp_path, **kw)
    assert seen["setup"] == (group, VOCAB_LIMITED)
    assert seen["shard"] == ShardPlan.make(TINY, 1, 2, VOCAB_LIMITED)


def test_from_checkpoint_checks_a_bad_mtp_vocab_size_before_planning_a_shard(tmp_path):
    make_synthetic_checkpoint(tmp_path, TINY, seed=SEED)
    with pytest.raises(InputError, match="mtp_vocab_size: expected an int in"):
        DeepseekV4MtpProposer.from_checkpoint(tmp_path, process_group=object(), mtp_vocab_size=-1)
