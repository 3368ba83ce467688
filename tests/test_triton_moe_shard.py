"""The fused moe_shard (issue 29): the expert-parallel MoE on this rank's experts, through moe's kernels.

Each rank's fused partial (fp32 [B, D], outputs poisoned with NaN) is checked against the torch
moe_shard on the same inputs and against that op on fp32 copies (the reference, as in
test_triton_kernels.compare), for W = 2 and 4, every rank, bf16 and MXFP4 (+ FP8 shared)
experts, batch 1 (slot-major kernels) and 4 (expert-major). The ranks' fused partials, summed,
are the fused unsharded ``moe`` (its kernels writing an fp32 output) within fp32 rounding: the
routing, the act rows and each pair's products are the same; only the order of the fp32 sums
differs. Remote pairs read no expert bytes: the interpreter's loads are counted per expert, and
the rank's stacks sit in a buffer whose other experts (and a guard expert either side) are NaN.
Without CUDA the kernels run under Triton's CPU interpreter; the cuda-marked test (V4-Flash
shapes) has never run on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch

# Before anything imports triton: without CUDA it sets the interpreter up (tests/triton_modules.py).
from triton_modules import INTERPRET, counting_carves, load_kernel_modules

K = load_kernel_modules(["_common", "fp8_round", "gemv", "moe_grouped", "fp8_linear", "moe_mxfp4", "moe"])

from draftgraph.ops.moe import gate_scores  # noqa: E402
from draftgraph.runtime.execution.kernel_choice import block_scaled_gap, select_impl  # noqa: E402
from draftgraph.runtime.ir.op_registry import get_op, register_fused  # noqa: E402
from draftgraph.runtime.ir.tensor_spec import TensorSpec  # noqa: E402
from draftgraph.runtime.model.config import V4Config  # noqa: E402
from draftgraph.runtime.model.quant import QuantWeight, quantize_weight  # noqa: E402
from v4_op_cases import CFG, gen, moe_case, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, TOP_K = CFG.n_routed_experts, CFG.num_experts_per_tok
FUSED_SHARD, FUSED_MOE = K["moe"].moe_shard_impl, K["moe"].moe_impl
EXPERTS, SHARED = (3, 4, 5), (6, 7, 8)  # positions in moe's (and rank 0's moe_shard's) inputs


# ---- cases ------------------------------------------------------------------------------------


def whole_case(fmt: str, batch: int, steered: bool = False):
    """moe's inputs (all E experts); ``fmt`` "mxfp4": MXFP4 routed experts, FP8 shared expert.

    steered: a large bias on experts E/4 and E/4 + 1 (rank 1's first at W=4, rank 0's at W=2)
    makes every row choose them (top-2): at W=4 every row is all-remote on ranks 0, 2 and 3.
    """
    inputs, attrs = moe_case(gen(900 + batch + 10 * steered), batch=batch)
    if steered:
        inputs[2] = inputs[2].clone()
        inputs[2][[E // 4, E // 4 + 1]] += 50.0
    if fmt == "mxfp4":
        inputs = [quantize_weight(t.float(), "mxfp4") if i in EXPERTS else t for i, t in enumerate(inputs)]
        inputs = [quantize_weight(t.float(), "fp8") if i in SHARED else t for i, t in enumerate(inputs)]
    return [t.to(DEVICE) for t in inputs], attrs


def rank_case(inputs, attrs, rank: int, world: int, stacks=None):
    """Rank ``rank``'s moe_shard inputs: its experts' stacks (``stacks`` given: those), the shared expert on rank 0."""
    lo, n = rank * E // world, E // world
    held = stacks if stacks is not None else [inputs[i][lo : lo + n] for i in EXPERTS]
    shard = [*inputs[:3], *held, *(inputs[i] for i in SHARED if rank == 0)]
    return shard, {**attrs, "expert_start": lo}


def routed_experts(inputs, attrs) -> torch.Tensor:
    """[B, K] the experts each row chooses (the torch op's routing; ties are not expected at these draws)."""
    scores = gate_scores(inputs[0], inputs[1])
    return torch.topk(scores + inputs[2], int(attrs["top_k"]), dim=-1).indices.cpu()


def run(impl, inputs, attrs, out_dtype=None, op="moe_shard"):
    """``impl`` on a NaN-poisoned output (the op's spec, or ``out_dtype``), given the op's declared workspace
    (as an executor gives it: moe_shard's torch op keeps the shared expert's bf16 output there)."""
    specs = [TensorSpec.of(t) for t in inputs]
    (spec,) = get_op(op).infer(specs, attrs)
    out = torch.full(spec.shape, float("nan"), dtype=out_dtype or spec.dtype, device=DEVICE)
    nbytes = get_op(op).workspace_bytes(specs, attrs, spec.shape[0])
    ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=DEVICE) if nbytes else None
    assert impl(inputs, [out], attrs, ws) is None
    return out


def fp32_inputs(inputs):
    return [t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t for t in inputs]


@functools.cache
def fused_partials(fmt: str, world: int, batch: int, steered: bool = False) -> tuple:
    inputs, attrs = whole_case(fmt, batch, steered)
    return tuple(run(FUSED_SHARD, *rank_case(inputs, attrs, r, world)) for r in range(world))


@functools.cache
def fused_whole(fmt: str, batch: int) -> torch.Tensor:
    """The fused moe of the whole case, unrounded: one per case for every world size (20 s under the
    interpreter at batch 4)."""
    inputs, attrs = whole_case(fmt, batch)
    return run(FUSED_MOE, inputs, attrs, out_dtype=torch.float32, op="moe")


@contextlib.contextmanager
def counted_reads(ranges: dict):
    """Bytes the interpreter loads (unmasked lanes only) inside each named [start, end) address range."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    real = builder.create_masked_load
    counts = dict.fromkeys(ranges, 0)

    def load(self, ptrs, mask, other, *args):
        addrs = ptrs.data[mask.data].astype("uint64")
        size = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
        for name, (start, end) in ranges.items():
            counts[name] += int(((addrs >= start) & (addrs < end)).sum()) * size
        return real(self, ptrs, mask, other, *args)

    builder.create_masked_load = load
    try:
        yield counts
    finally:
        builder.create_masked_load = real


# ---- each rank against the torch op; the ranks' sum against the fused moe --------------------


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_each_ranks_fused_partial_matches_the_torch_moe_shard(fmt, world, batch):
    inputs, attrs = whole_case(fmt, batch)
    chosen = routed_experts(inputs, attrs)
    all_remote = 0
    for rank, fused in enumerate(fused_partials(fmt, world, batch)):
        shard, sattrs = rank_case(inputs, attrs, rank, world)
        torch_op = get_op("moe_shard").impl
        ref_torch, ref = run(torch_op, shard, sattrs), run(torch_op, fp32_inputs(shard), sattrs)
        assert fused.dtype == torch.float32 and not torch.isnan(fused).any(), f"rank {rank}: unwritten elements"
        if torch.any(ref != 0):  # else: no row has an expert here and the rank holds no shared expert (below)
            e_f, e_t = rel_err(fused, ref), rel_err(ref_torch, ref)
            assert e_f <= max(2 * e_t, 2e-3) and e_f < 1.5e-2, f"{fmt} W={world} rank {rank}: {e_f:.2e}, {e_t:.2e}"
        lo, hi = rank * E // world, (rank + 1) * E // world
        remote = ~((chosen >= lo) & (chosen < hi)).any(-1)  # [B]: rows with no expert on this rank
        if rank > 0:  # no shared expert: such a row's partial is exactly 0, in both
            assert torch.all(fused[remote] == 0) and torch.all(ref_torch[remote] == 0), (rank, remote)
        all_remote += int(remote.sum())
    if world == 4:
        assert all_remote > 0, "the draw has no all-remote row at W=4: the case tests nothing of it"


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_rows_whose_experts_are_all_on_one_rank(fmt):
    """Every row chooses rank 1's two experts (W=4): rank 0 writes the shared expert alone, ranks 2
    and 3 exact zeros, rank 1 all the routed pairs; checked against the torch op."""
    inputs, attrs = whole_case(fmt, 4, steered=True)
    assert torch.all(routed_experts(inputs, attrs).sort(-1).values == torch.tensor([E // 4, E // 4 + 1]))
    partials = fused_partials(fmt, 4, 4, True)
    for rank in (0, 1):
        shard, sattrs = rank_case(inputs, attrs, rank, 4)
        torch_op = get_op("moe_shard").impl
        ref_torch, ref = run(torch_op, shard, sattrs), run(torch_op, fp32_inputs(shard), sattrs)
        e_f, e_t = rel_err(partials[rank], ref), rel_err(ref_torch, ref)
        assert e_f <= max(2 * e_t, 2e-3), f"rank {rank}: fused {e_f:.2e}, torch {e_t:.2e}"
    assert torch.all(partials[2] == 0) and torch.all(partials[3] == 0)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_the_ranks_fused_partials_sum_to_the_fused_moe(fmt, world, batch):
    whole = fused_whole(fmt, batch)
    total = torch.stack(fused_partials(fmt, world, batch)).sum(0)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6 * float(whole.abs().max()))


# ---- remote pairs read no expert bytes ---------------------------------------------------------


def _nan_fenced(t, lo: int, n: int):
    """t's experts [lo, lo + n) inside a buffer of E + 2 experts whose others (a guard either side) are NaN.

    MXFP4: the data is kept, the UE8M0 scales of the others are 0xFF (NaN). Returns (the view of
    the rank's experts, the buffer, the buffer's expert size in bytes per part)."""
    if isinstance(t, QuantWeight):
        data = torch.zeros((E + 2, *t.data.shape[1:]), dtype=torch.uint8, device=DEVICE)
        scale = torch.full((E + 2, *t.scale.shape[1:]), 0xFF, dtype=torch.uint8, device=DEVICE)
        data[1 : E + 1] = t.data.view(torch.uint8)
        scale[1 + lo : 1 + lo + n] = t.scale[lo : lo + n].view(torch.uint8)
        view = QuantWeight(data[1 + lo : 1 + lo + n].view(t.data.dtype), scale[1 + lo : 1 + lo + n].view(t.scale.dtype),
                           t.fmt)  # fmt: skip
        return view, (data, scale)
    buf = torch.full((E + 2, *t.shape[1:]), float("nan"), dtype=t.dtype, device=DEVICE)
    buf[1 + lo : 1 + lo + n] = t[lo : lo + n]
    return buf[1 + lo : 1 + lo + n], (buf,)


@pytest.mark.skipif(not INTERPRET, reason="counts the interpreter's loads")
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_remote_pairs_read_no_expert_bytes(fmt, batch):
    world = 4
    inputs, attrs = whole_case(fmt, batch)
    chosen = routed_experts(inputs, attrs)
    reads = 0
    for rank in (0, 2):  # the first (the guard below it; the shared expert) and one fenced by others' experts
        clean = fused_partials(fmt, world, batch)[rank]
        lo, n = rank * E // world, E // world
        fenced = [_nan_fenced(inputs[i], lo, n) for i in EXPERTS]
        shard, sattrs = rank_case(inputs, attrs, rank, world, stacks=[view for view, _ in fenced])
        ranges = {}
        for j, (_, bufs) in enumerate(fenced):
            for buf in bufs:
                size = buf[0].numel() * buf.element_size()
                for slot in range(E + 2):  # slot 0 and E + 1: the guards; slot 1 + e: expert e
                    start = buf.data_ptr() + slot * size
                    ranges[(j, buf.data_ptr(), slot)] = (start, start + size)
        with counted_reads(ranges) as counts:
            fused = run(FUSED_SHARD, shard, sattrs)
        assert torch.equal(fused, clean), f"rank {rank}: the fenced stacks changed the result (a NaN was read)"
        read = {slot - 1 for (_, _, slot), nbytes in counts.items() if nbytes}
        local_chosen = {int(e) for e in chosen.flatten() if lo <= e < lo + n}
        # Every stack (and its scales) read exactly at this rank's chosen experts: nothing remote, no guard.
        assert read == local_chosen, (rank, sorted(read), sorted(local_chosen))
        unread = [key for key, nbytes in counts.items() if key[2] - 1 in local_chosen and nbytes == 0]
        assert not unread, (rank, unread)  # w1, w2, w3 (and their scales) of each chosen local expert
        reads += sum(counts.values())
    assert reads > 0, "no expert of ranks 0 and 2 chosen: the count tests nothing"


# ---- the workspace rule, selection, the torch fallback -----------------------------------------


@pytest.mark.parametrize("fmt,batch,rank,w8a8", [("bf16", 1, 0, False), ("bf16", 4, 1, False),
                                                 ("mxfp4", 1, 1, True), ("mxfp4", 4, 0, False)])  # fmt: skip
def test_workspace_rule_is_the_scratch_the_fused_moe_shard_carves(fmt, batch, rank, w8a8, monkeypatch):
    """Given a workspace of exactly the rule's bytes (poisoned with 0xFF), every carve fits, nothing is
    allocated, and the result is the unpoisoned one; the rule leaves the shared rows out off rank 0."""
    inputs, attrs = whole_case(fmt, batch)
    attrs = {**attrs, "activations": "fp8"} if w8a8 else attrs
    shard, sattrs = rank_case(inputs, attrs, rank, 2)
    specs = [TensorSpec.of(t) for t in shard]
    nbytes = K["moe"].moe_shard_workspace(specs, sattrs, batch)
    carved = counting_carves(K, monkeypatch)
    ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=DEVICE)
    out = torch.full((batch, inputs[0].shape[1]), float("nan"), device=DEVICE)
    FUSED_SHARD(shard, [out], sattrs, ws)
    monkeypatch.undo()
    assert sum(carved[:2] if fmt == "mxfp4" else carved) == nbytes, (carved, nbytes)  # tight (W8A8 carves act again)
    want = run(FUSED_SHARD, shard, sattrs) if w8a8 else fused_partials(fmt, 2, batch)[rank]
    assert torch.equal(out, want)
    with_shared = K["moe"].moe_shard_workspace([TensorSpec.of(t) for t in rank_case(inputs, attrs, 0, 2)[0]],
                                               {**sattrs, "expert_start": 0}, batch)  # fmt: skip
    assert (with_shared > nbytes) == (rank == 1), (with_shared, nbytes)


def _spec(fmt, shape):
    return TensorSpec.of(quantize_weight(torch.randn(*shape), fmt)) if fmt else TensorSpec(shape, torch.bfloat16)


def _shard_specs(routed, shared, rank0: bool):
    x = TensorSpec((1, 128), torch.bfloat16)
    gate, bias = TensorSpec((8, 128), torch.bfloat16), TensorSpec((8,), torch.float32)
    experts = [_spec(routed, s) for s in ((4, 64, 128), (4, 128, 64), (4, 64, 128))]
    held = [_spec(shared, s) for s in ((64, 128), (128, 64), (64, 128))] if rank0 else []
    return [x, gate, bias, *experts, *held]


@pytest.fixture
def on_fake_device():
    """The fused moe_shard registered for the meta device, as register_all does for CUDA."""
    register_fused("moe_shard", "meta", FUSED_SHARD)
    yield torch.device("meta")
    get_op("moe_shard").fused.pop("meta", None)


def test_selection_binds_the_fused_moe_shard_to_bf16_and_mxfp4_experts(on_fake_device):
    op = get_op("moe_shard")
    cases = [
        (_shard_specs(None, None, True), True),
        (_shard_specs(None, None, False), True),
        (_shard_specs("mxfp4", "fp8", True), True),
        (_shard_specs("mxfp4", None, False), True),  # off rank 0: no shared expert to read
        (_shard_specs("fp8", "fp8", True), False),  # the "fp8" checkpoint format: no FP8 expert kernel
        (_shard_specs("fp8", None, False), False),
        (_shard_specs("mxfp4", None, True), False),  # a bf16 shared expert beside MXFP4 experts
    ]
    for specs, fused in cases:
        got = select_impl(op, on_fake_device, "auto", specs)
        assert (got is FUSED_SHARD) == fused and (got is op.impl) != fused, [s.short() for s in specs]
        assert select_impl(op, on_fake_device, "torch", specs) is op.impl
    assert "MXFP4 routed experts" in block_scaled_gap(FUSED_SHARD, _shard_specs("fp8", None, False))
    from draftgraph.ops.triton import fused_impls

    assert fused_impls()["moe_shard"].__name__ == "moe_shard_impl"


def test_inputs_the_kernels_do_not_take_run_the_torch_op(monkeypatch):
    import draftgraph.ops.moe

    calls = []
    monkeypatch.setattr(draftgraph.ops.moe, "_moe_shard_impl", lambda *a: calls.append(a))
    inputs, attrs = whole_case("bf16", 1)
    shard, sattrs = rank_case(inputs, attrs, 1, 2)
    out = torch.empty(1, inputs[0].shape[1], device=DEVICE)
    FUSED_SHARD([shard[0].float(), *shard[1:]], [out], sattrs, None)  # fp32 activations
    FUSED_SHARD(shard, [torch.empty(1, 2 * inputs[0].shape[1], device=DEVICE)[:, ::2]], sattrs, None)  # strided out
    assert len(calls) == 2
    FUSED_SHARD(shard, [out], sattrs, None)
    assert len(calls) == 2


# ---- the sharded chain through the fused moe_shard (2 gloo ranks) ------------------------------


def _propose_sharded(rank: int, world: int, fused: bool):
    """Rank ``rank``'s K=2 drafts at batch 3, its moe_shard steps bound to the fused impl (as on CUDA) if ``fused``."""
    import draftgraph.ops.moe
    import torch.distributed as dist
    from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
    from proposer_fixtures import TINY

    group = dist.group.WORLD if world > 1 else None
    prop = DeepseekV4MtpProposer(TINY, random_mtp_weights(TINY, seed=9), executor="eager", buckets=(3,),
                                 process_group=group)  # fmt: skip
    executor = prop._executor(3, 2, False)
    bound = []
    for step in executor.steps:
        if fused and step.node.op == "moe_shard":
            step.impl = FUSED_SHARD
            bound.append(step.node.op)
    if fused:  # this rank process only: the fused impl must not hand its inputs to the torch op

        def refuse(*args):
            raise AssertionError("the fused moe_shard fell back to the torch op")

        draftgraph.ops.moe._moe_shard_impl = refuse
    g = torch.Generator().manual_seed(5)
    hiddens = torch.randn(3, TINY.hc_mult, TINY.hidden_size, generator=g).bfloat16()
    states = [prop.alloc_state() for _ in range(3)]
    drafts = prop.propose_batch([5, 17, 61], list(hiddens), [30, 45, 7], 2, states)
    return drafts, prop.last_hidden(3).float(), bound


@pytest.mark.skipif(not INTERPRET, reason="the CPU path of the sharded chain (gloo ranks)")
def test_two_gloo_ranks_through_the_fused_moe_shard_draft_as_one_rank(tmp_path):
    """The TINY chain sharded over 2 gloo ranks, each rank's moe_shard on the fused impl (bf16 experts),
    drafts what the unsharded torch chain drafts; the final hidden agrees within bf16 noise."""
    from rank_processes import results, run_ranks

    want, want_hidden, _ = _propose_sharded(0, 1, fused=False)
    ranks = results(run_ranks(2, _propose_sharded, True, folder=tmp_path, timeout=300.0))
    for rank, (drafts, hidden, bound) in enumerate(ranks):
        assert bound == ["moe_shard"] * 2, (rank, bound)  # one per draft step
        assert drafts == want, (rank, drafts, want)
        assert rel_err(hidden, want_hidden) < 2e-2, rank


# ---- V4-Flash shapes (CUDA) --------------------------------------------------------------------


def _mxfp4_stack(stack: torch.Tensor) -> QuantWeight:
    """A [E, O, I] bf16 stack as MXFP4, quantised expert by expert (no fp32 copy of the whole stack)."""
    parts = [quantize_weight(m.float(), "mxfp4") for m in stack]
    data = torch.stack([p.data.view(torch.uint8) for p in parts]).view(parts[0].data.dtype)
    return QuantWeight(data, torch.stack([p.scale for p in parts]), "mxfp4")


@pytest.mark.gpu_heavy
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_flash_fused_partials_sum_to_the_fused_moe(fmt, batch):
    """256 experts, W=2 (never run on a GPU yet): the two ranks' fused partials summed == the fused moe,
    both with fp32 outputs (bf16 experts, or MXFP4 experts with the FP8 shared expert)."""
    flash = V4Config.flash()
    d, e, i = flash.hidden_size, flash.n_routed_experts, flash.moe_intermediate_size
    g = torch.Generator(device="cuda").manual_seed(11)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    inputs = [randn(batch, d), randn(e, d, scale=1 / math.sqrt(d)), randn(e, scale=0.1, dtype=torch.float32),
              randn(e, i, d, scale=1 / math.sqrt(d)), randn(e, d, i, scale=1 / math.sqrt(i)),
              randn(e, i, d, scale=1 / math.sqrt(d)), randn(i, d, scale=1 / math.sqrt(d)),
              randn(d, i, scale=1 / math.sqrt(i)), randn(i, d, scale=1 / math.sqrt(d))]  # fmt: skip
    if fmt == "mxfp4":
        inputs[3:6] = [_mxfp4_stack(t) for t in inputs[3:6]]
        inputs[6:9] = [quantize_weight(t.float(), "fp8") for t in inputs[6:9]]
        torch.cuda.empty_cache()
    attrs = {"top_k": flash.num_experts_per_tok, "routed_scaling_factor": flash.routed_scaling_factor,
             "swiglu_limit": flash.swiglu_limit}  # fmt: skip
    whole = run(FUSED_MOE, inputs, attrs, out_dtype=torch.float32, op="moe")
    total = torch.zeros_like(whole)
    for rank in range(2):
        lo, n = rank * e // 2, e // 2
        shard = [*inputs[:3], *(inputs[j][lo : lo + n] for j in EXPERTS), *(inputs[j] for j in SHARED if rank == 0)]
        total += run(FUSED_SHARD, shard, {**attrs, "expert_start": lo})
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6 * float(whole.abs().max()))
