"""The device verify's two ends in one kernel each (ops/triton/acceptance.py) against the torch ops.

Without CUDA the kernels run under Triton's CPU interpreter; on a GPU also captured in a CUDA
graph and replayed over new drafts and hiddens, as the verify graph replays them.
"""

from __future__ import annotations

import random

import pytest
import torch

# Before anything imports triton: without CUDA it sets the interpreter up (tests/triton_modules.py).
from triton_modules import HAS_CUDA, INTERPRET, load_kernel_modules

K_MODULES = load_kernel_modules(["_common", "acceptance"])
FUSED = K_MODULES["acceptance"]

from draftgraph.ops import acceptance as reference  # noqa: E402
from draftgraph.ops.acceptance import ACCEPTED, DROPPED, NONFINITE_HIDDEN, TOKENS  # noqa: E402
from draftgraph.ops.nonfinite import NONFINITE  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRET, reason="the interpreter tests run where there is no CUDA")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEVICES = [pytest.param("cpu", marks=cpu_only), pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]
VOCAB, SPARE = 50, 3  # the target's outputs hold a bucket's rows: more than S x W


def case(s: int, k: int, row: tuple[int, ...], device: str, seed: int):
    """Drafts whose matching prefix is drawn per sequence (0 .. K), some batches dropped (NONFINITE),
    and NaNs / infinities in hiddens the catch-up reads (h_p, rows < a) and in ones it does not."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    w = k + 1
    tokens = torch.randint(0, VOCAB, (s * w + SPARE,), generator=gen)
    drafts = torch.randint(0, VOCAB, (s, k), generator=gen)
    for i in range(s):
        a = rng.randrange(k + 1)
        drafts[i, :a] = tokens[i * w : i * w + a]
        if a < k:
            drafts[i, a] = (tokens[i * w + a] + 1) % VOCAB
    if rng.random() < 0.3:
        drafts[:] = NONFINITE  # a chain that dropped its batch marks every draft
    hidden = torch.randn(s * w + SPARE, *row, generator=gen).bfloat16()
    next_hidden = torch.randn(s, *row, generator=gen).bfloat16()
    for _ in range(rng.randrange(4)):
        bad = rng.choice([float("nan"), float("inf"), float("-inf")])
        if rng.random() < 0.25:
            next_hidden.view(s, -1)[rng.randrange(s), rng.randrange(next_hidden[0].numel())] = bad
        else:
            hidden.view(s * w + SPARE, -1)[rng.randrange(s * w), rng.randrange(hidden[0].numel())] = bad
    return [t.to(device) for t in (drafts, tokens, hidden, next_hidden)]


def run(module, drafts, tokens, hidden, next_hidden):
    s, k = drafts.shape
    pair = torch.full((s, k + 2, *next_hidden.shape[1:]), 7.0, dtype=torch.bfloat16, device=drafts.device)
    verdict = torch.full((s, TOKENS + k + 1), -7, dtype=torch.int64, device=drafts.device)
    module.accept_drafts(drafts, tokens, hidden, next_hidden, pair, verdict)
    columns = tokens.clone()
    module.clamp_drafts(drafts, columns, VOCAB - 1)
    return verdict, pair, columns


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaN rows compare equal as bits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("s,k,row", [(1, 3, (4, 40)), (5, 1, (4, 40)), (3, 4, (2, 1200))])  # 2400: two row blocks
@pytest.mark.parametrize("seed", range(6))
def test_one_kernel_each_equals_the_torch_ops(device, s, k, row, seed):
    inputs = case(s, k, row, device, seed)
    got, want = run(FUSED, *inputs), run(reference, *inputs)
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert same_bits(got[1], want[1]) and torch.equal(got[2], want[2])


def test_the_cases_meet_every_verdict():
    """The random cases above reach every outcome: each accepted count, dropped, a bad hidden read
    and one not read (the oracle is the torch ops, so this checks the cases, not the kernel)."""
    seen = set()
    for s, k, row in [(1, 3, (4, 40)), (5, 1, (4, 40)), (3, 4, (2, 1200))]:
        for seed in range(6):
            drafts, tokens, hidden, next_hidden = case(s, k, row, "cpu", seed)
            verdict, pair, _ = run(reference, drafts, tokens, hidden, next_hidden)
            for i in range(s):
                seen.add(("accepted", k, int(verdict[i, ACCEPTED])))
                seen.add(("dropped", int(verdict[i, DROPPED])))
                bad_anywhere = not bool(torch.isfinite(pair[i].float()).all())
                seen.add(("bad", int(verdict[i, NONFINITE_HIDDEN]), bad_anywhere))
    assert {("dropped", 0), ("dropped", 1), ("bad", 0, False), ("bad", 1, True), ("bad", 0, True)} <= seen
    assert {("accepted", 3, a) for a in range(4)} <= seen


@pytest.mark.parametrize("device", DEVICES)
def test_clamp_writes_only_the_draft_columns(device):
    for module in (reference, FUSED):
        drafts = torch.tensor([[3, NONFINITE], [VOCAB + 5, 0]], device=device)
        tokens = torch.arange(8, dtype=torch.int64, device=device) + 100  # rows [t, d_1, d_2] a sequence
        module.clamp_drafts(drafts, tokens, VOCAB - 1)
        assert tokens.tolist() == [100, 3, 0, 103, VOCAB - 1, 0, 106, 107], module


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_captured_ends_read_each_replays_inputs():
    s, k, row = 4, 3, (4, 512)
    drafts, tokens, hidden, next_hidden = case(s, k, row, "cuda", 0)
    pair = torch.zeros(s, k + 2, *row, dtype=torch.bfloat16, device="cuda")
    verdict = torch.zeros(s, TOKENS + k + 1, dtype=torch.int64, device="cuda")
    columns = tokens.clone()

    def ends():
        FUSED.clamp_drafts(drafts, columns, VOCAB - 1)
        FUSED.accept_drafts(drafts, tokens, hidden, next_hidden, pair, verdict)

    ends()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ends()
    for seed in range(1, 4):
        new = case(s, k, row, "cuda", seed)
        for buf, value in zip((drafts, tokens, hidden, next_hidden), new):
            buf.copy_(value)
        columns.copy_(new[1])  # the staging writes each step's t columns; the clamp, the draft columns
        graph.replay()
        want = run(reference, *new)
        assert torch.equal(verdict, want[0]) and same_bits(pair, want[1])
        assert torch.equal(columns, want[2]), seed


@cpu_only
@pytest.mark.parametrize("k", [1, 3])
def test_a_device_decode_through_the_kernels_equals_greedy(monkeypatch, k):
    """The verify graph's two ends as the kernels (interpreted), wired as on CUDA: the decode's tokens
    are greedy's, and a NaN in a hidden the catch-up reads stops it with the pools whole."""
    from decode_fixtures import make_proposer, make_target, prompts
    from draftgraph.runtime.decode import device_verify
    from draftgraph.runtime.decode.loop import greedy_decode, speculative_decode
    from draftgraph.runtime.errors import NonFiniteError

    monkeypatch.setattr(device_verify, "_verify_ends", lambda device: FUSED)
    lengths = (3, 9, 20)
    want = greedy_decode(make_target(), prompts(lengths), 12)
    target, proposer = make_target(), make_proposer()
    got = speculative_decode(target, proposer, prompts(lengths), 12, k, device_loop=True)
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    real = FUSED.accept_drafts

    def poisoned(drafts, tokens, hidden, next_hidden, *rest):
        next_hidden[0].fill_(float("nan"))  # sequence 0's h_p: pair row 0, which every catch-up reads
        real(drafts, tokens, hidden, next_hidden, *rest)

    monkeypatch.setattr(device_verify, "_verify_ends", lambda device: type("Ends", (), {
        "clamp_drafts": staticmethod(FUSED.clamp_drafts), "accept_drafts": staticmethod(poisoned)}))
    target, proposer = make_target(), make_proposer()
    with pytest.raises(NonFiniteError):
        speculative_decode(target, proposer, prompts(lengths), 12, k, device_loop=True)
    assert target.cache.num_free_blocks == target.cache.num_blocks
    assert proposer.cache.num_free_blocks == proposer.cache.num_blocks
