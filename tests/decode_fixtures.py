"""Shared tiny model, builders and drafters for the decode-loop, target-model and tool tests."""

from __future__ import annotations

import functools

import pytest
import torch
from draftgraph.runtime.decode.target import TargetModel
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from proposer_fixtures import TINY

# The proposer tests' TINY config with vocab 264, so that the byte tokenizer fits: two layers
# (layer 0 hash-routed), window 16 (one block).
CFG = TINY.replace(vocab_size=264)
ROW_BUCKET = 16  # one bucket: every target run has the same GEMM shapes, so rows are bit-reproducible


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny ops on 2 shared cores: one intra-op thread is several times faster than oversubscription."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=4)
def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    return random_mtp_weights(CFG, seed=seed, include_target_layers=True)


def make_target(seed: int = 0, **kw) -> TargetModel:
    kw.setdefault("executor", "eager")
    kw.setdefault("buckets", (ROW_BUCKET,))
    return TargetModel(CFG, weights(seed), **kw)


def make_proposer(seed: int = 0, cls=DeepseekV4MtpProposer, **kw) -> DeepseekV4MtpProposer:
    kw.setdefault("executor", "eager")
    kw.setdefault("buckets", (1, 2, 4))
    kw.setdefault("num_cache_blocks", 48)
    return cls(CFG, weights(seed), **kw)


def prompts(lengths=(3, 9, 20), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def drafter_after_prompts(proposer, target, n=2):
    """n sequences with drafter rows from a prompt: (states, their last hiddens [n, C, D], the
    target's next tokens, the positions of the first propose)."""
    toks = prompts((6, 11, 4)[:n], seed=3)
    states, hiddens, last = [], [], []
    for t in toks:
        ts = target.alloc_state(64)
        out = target.prefill(ts, t)
        target.free(ts)
        state = proposer.alloc_state_for(64)
        proposer.prefill_drafter(t, out.hiddens, state)
        states.append(state)
        hiddens.append(out.hiddens[-1])
        last.append((out.tokens[-1], len(t) - 1))
    return states, torch.stack(hiddens), [t for t, _ in last], [p for _, p in last]


def pools_full(target, proposer) -> bool:
    return (
        target.cache.num_free_blocks == target.cache.num_blocks
        and proposer.cache.num_free_blocks == proposer.cache.num_blocks
    )


class OracleProposer(DeepseekV4MtpProposer):
    """The real proposer (its cache and states are exercised), with drafts replaced by the known
    greedy continuation, deliberately wrong at a rotating draft position: every acceptance count
    0..K occurs, so rollback and catch-up run for each.

    ``truths[i]`` is prompt i followed by its greedy tokens; states map to prompts in allocation order.
    """

    def __init__(self, *args, truths: list[list[int]], **kw) -> None:
        super().__init__(*args, **kw)
        self.truths, self._owner_of, self.calls = truths, {}, 0
        self.accept_plan: list[int] = []

    def alloc_state_for(self, budget_tokens):
        state = super().alloc_state_for(budget_tokens)
        self._owner_of[id(state)] = len(self._owner_of) % len(self.truths)
        return state

    def _propose(self, tokens, hiddens, positions, num_drafts, states, bitmask):
        drafts = super()._propose(tokens, hiddens, positions, num_drafts, states, bitmask)
        self.calls += 1
        for row, (state, p) in enumerate(zip(states, positions)):
            drafts[row] = self._oracle_drafts(state, p, num_drafts)
        return drafts

    def propose_device(self, tokens, hiddens, positions, num_drafts, states, *args, **kw):
        """The device loop's propose, its drafts overwritten on the device by the oracle's."""
        handle = super().propose_device(tokens, hiddens, positions, num_drafts, states, *args, **kw)
        self.calls += 1
        rows = [self._oracle_drafts(state, p, num_drafts) for state, p in zip(states, positions)]
        handle.drafts.copy_(torch.tensor(rows, dtype=torch.int64))
        return handle

    def _oracle_drafts(self, state, p: int, num_drafts: int) -> list[int]:
        seq = self._owner_of[id(state)]
        truth = self.truths[seq][p + 2 : p + 2 + num_drafts]
        truth = truth + [0] * (num_drafts - len(truth))
        right = (self.calls + seq) % (num_drafts + 1)  # leading drafts that are right
        wrong = [(t + 1) % self.config.vocab_size for t in truth]
        return truth[:right] + wrong[right:]


class FailingRunner:
    """A body runner that raises on its ``fail_at``-th call (an injected mid-step failure)."""

    name = "failing"

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls = fail_at, 0

    def bind(self, config, weights, device) -> None:
        pass

    def workspace_bytes(self, batch: int) -> int:
        return 0

    def __call__(self, streams, positions, kv_cache, kv_start, block_table, workspace):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError(f"injected runner failure at call {self.calls}")
        return streams
