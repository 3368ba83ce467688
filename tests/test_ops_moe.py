"""moe and moe_hash against float64 references written from spec section 4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from v4_op_cases import BATCH, CFG, gen, moe_case, moe_hash_case, rel_err, run_op

F64 = torch.float64


def ref_scores(x, gate_w):
    return torch.sqrt(F.softplus(x.to(F64) @ gate_w.to(F64).T))  # [B, E]


def ref_swiglu(w1, w3, x, limit, clamp=True):
    g, u = w1 @ x, w3 @ x
    if clamp:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g * torch.sigmoid(g) * u


def ref_experts(x, idx, weights, w1, w2, w3, sw1, sw2, sw3, limit, clamp=True):
    x, w1, w2, w3, sw1, sw2, sw3 = (t.to(F64) for t in (x, w1, w2, w3, sw1, sw2, sw3))
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for e, w in zip(idx[b].tolist(), weights[b]):
            out[b] += w2[e] @ (w * ref_swiglu(w1[e], w3[e], x[b], limit, clamp))
        out[b] += sw2 @ ref_swiglu(sw1, sw3, x[b], limit, clamp)
    return out


def ref_moe(inputs, attrs, bias_in_weights=False, clamp=True):
    x, gate_w, bias, w1, w2, w3, sw1, sw2, sw3 = inputs
    s = ref_scores(x, gate_w)
    biased = s + bias.to(F64)
    idx = biased.topk(attrs["top_k"], dim=-1).indices
    chosen = (biased if bias_in_weights else s).gather(1, idx)
    weights = chosen / chosen.sum(-1, keepdim=True) * attrs["routed_scaling_factor"]
    out = ref_experts(x, idx, weights, w1, w2, w3, sw1, sw2, sw3, attrs["swiglu_limit"], clamp)
    return out, idx


def ref_moe_hash(inputs, attrs):
    x, token, tid2eid, gate_w, w1, w2, w3, sw1, sw2, sw3 = inputs
    idx = tid2eid[token].long()
    chosen = ref_scores(x, gate_w).gather(1, idx)
    weights = chosen / chosen.sum(-1, keepdim=True) * attrs["routed_scaling_factor"]
    return ref_experts(x, idx, weights, w1, w2, w3, sw1, sw2, sw3, attrs["swiglu_limit"])


def test_moe_matches_float64_reference():
    inputs, attrs = moe_case(gen(31))
    (out,) = run_op("moe", inputs, attrs)
    assert out.shape == (BATCH, CFG.hidden_size) and out.dtype == torch.bfloat16
    assert rel_err(out, ref_moe(inputs, attrs)[0]) < 1e-2


def test_gate_bias_steers_selection_but_not_weights():
    inputs, attrs = moe_case(gen(32))
    favoured = 7
    inputs[2] = torch.zeros(CFG.n_routed_experts)
    inputs[2][favoured] = 5.0  # wins a top-k place on every row
    ref, idx = ref_moe(inputs, attrs)
    assert (idx == favoured).any(-1).all()
    _, idx_unbiased = ref_moe([*inputs[:2], torch.zeros(CFG.n_routed_experts), *inputs[3:]], attrs)
    assert not (idx_unbiased == favoured).any(-1).all(), "the bias should change the selection"
    (out,) = run_op("moe", inputs, attrs)
    assert rel_err(out, ref) < 1e-2
    unbiased_out = run_op("moe", [*inputs[:2], torch.zeros(CFG.n_routed_experts), *inputs[3:]], attrs)[0]
    assert rel_err(out, unbiased_out) > 0.05
    assert rel_err(out, ref_moe(inputs, attrs, bias_in_weights=True)[0]) > 0.05


def test_swiglu_limit_clamps_large_activations():
    inputs, attrs = moe_case(gen(33))
    inputs[0] = (inputs[0].double() * 40).to(torch.bfloat16)  # |w1 x| ~ 40: well past the limit 10
    x, w1, sw1 = inputs[0].double(), inputs[3].double(), inputs[6].double()
    assert ((w1 @ x.T).abs() > CFG.swiglu_limit).double().mean() > 0.3
    assert ((sw1 @ x.T).abs() > CFG.swiglu_limit).double().mean() > 0.3
    (out,) = run_op("moe", inputs, attrs)
    assert rel_err(out, ref_moe(inputs, attrs)[0]) < 1e-2
    assert rel_err(out, ref_moe(inputs, attrs, clamp=False)[0]) > 0.3


def test_moe_hash_matches_reference_and_reads_tid2eid():
    inputs, attrs = moe_hash_case(gen(34))
    (out,) = run_op("moe_hash", inputs, attrs)
    assert rel_err(out, ref_moe_hash(inputs, attrs)) < 1e-2
    # Reroute only the batch's tokens: the output follows the table.
    rerouted = inputs[2].clone()
    rerouted[inputs[1]] = (rerouted[inputs[1]] + 1) % CFG.n_routed_experts
    moved = [inputs[0], inputs[1], rerouted, *inputs[3:]]
    (out_moved,) = run_op("moe_hash", moved, attrs)
    assert rel_err(out_moved, ref_moe_hash(moved, attrs)) < 1e-2
    assert rel_err(out_moved, out) > 0.1


def test_moe_hash_routes_by_token_not_by_score():
    inputs, attrs = moe_hash_case(gen(35))
    tokens = torch.tensor([4, 4, 9])  # rows 0 and 1 share a token: the same experts
    inputs[1] = tokens
    x, _, tid2eid, gate_w = inputs[:4]
    score_top = ref_scores(x, gate_w).topk(CFG.num_experts_per_tok, dim=-1).indices
    hashed = tid2eid[tokens].long()
    assert not torch.equal(score_top.sort(-1).values, hashed.sort(-1).values), "a weak test otherwise"
    (out,) = run_op("moe_hash", inputs, attrs)
    assert rel_err(out, ref_moe_hash(inputs, attrs)) < 1e-2


def grouped_case(seed: int, batch: int):
    """(x, w1, w2, w3, swiglu limit) of a moe case, skipped where this torch has no CPU _grouped_mm."""
    from draftgraph.ops.moe import can_grouped_mm

    inputs, attrs = moe_case(gen(seed), batch=batch)
    x, _, _, w1, w2, w3 = inputs[:6]
    if not can_grouped_mm(x, w1, w2, w3):
        pytest.skip(f"torch {torch.__version__} has no CPU _grouped_mm: the gather path runs")
    return x, w1, w2, w3, float(attrs["swiglu_limit"])


def test_grouped_path_runs_on_cpu_and_equals_the_gather_path():
    # torch >= 2.13 has a CPU _grouped_mm: the op takes the grouped path there, as on sm90.
    from draftgraph.ops.moe import routed_gather, routed_grouped

    x, w1, w2, w3, limit = grouped_case(36, batch=5)
    e, k = CFG.n_routed_experts, CFG.num_experts_per_tok
    # Shared experts across rows, a row's experts out of order, most experts unused (empty groups).
    idx = torch.tensor([[3, 1], [1, 3], [e - 1, 0], [3, 0], [1, e - 1]])[:, :k]
    weights = torch.rand(5, k, generator=gen(37)) + 0.5
    grouped = routed_grouped(x, idx, weights, w1, w2, w3, limit)
    gathered = routed_gather(x, idx, weights, w1, w2, w3, limit)
    assert grouped.dtype == gathered.dtype == torch.float32
    assert rel_err(grouped, gathered) < 1e-3, rel_err(grouped, gathered)
    inter, dim = CFG.moe_intermediate_size, CFG.hidden_size
    no_shared = (torch.zeros(inter, dim), torch.zeros(dim, inter), torch.zeros(inter, dim))
    ref = ref_experts(x, idx, weights, w1, w2, w3, *no_shared, limit)  # routed experts only, float64
    assert rel_err(grouped, ref) < 1e-2


def test_one_row_grouped_path_needs_no_gather_or_unsort():
    # One row: its pairs' rows are K copies of x (no gather after a sort), and the sum over k
    # runs in expert order. Both must give the gather path's result.
    from draftgraph.ops.moe import one_row_pairs, routed_gather, routed_grouped

    x, w1, w2, w3, limit = grouped_case(40, batch=1)
    e, k = CFG.n_routed_experts, CFG.num_experts_per_tok
    idx = torch.tensor([[e - 1, 0, 3][:k]])  # out of expert order
    weights = torch.rand(1, k, generator=gen(41)) + 0.5
    rows = one_row_pairs(x, k)
    assert rows.shape == (k, x.shape[1]) and torch.equal(rows, x.expand(k, -1))
    assert one_row_pairs(torch.cat([x, x]), k) is None
    for experts in (idx, torch.tensor([[3] * k])):  # out of order; one expert twice (a hash table may)
        gathered = routed_gather(x, experts, weights, w1, w2, w3, limit)
        grouped = routed_grouped(x, experts, weights, w1, w2, w3, limit)
        assert grouped.shape == (1, x.shape[1]) and grouped.dtype == torch.float32
        assert rel_err(grouped, gathered) < 1e-3, rel_err(grouped, gathered)


@pytest.mark.parametrize("op", ["moe", "moe_hash"])
def test_one_row_op_matches_float64_reference(op):
    # One row sums its pairs onto the shared expert with one GEMM (out.addmm_): the op's output
    # must still be the reference's.
    inputs, attrs = (moe_case if op == "moe" else moe_hash_case)(gen(42), batch=1)
    (out,) = run_op(op, inputs, attrs)
    ref = ref_moe(inputs, attrs)[0] if op == "moe" else ref_moe_hash(inputs, attrs)
    assert out.shape == (1, CFG.hidden_size) and rel_err(out, ref) < 1e-2, rel_err(out, ref)


def test_moe_without_grouped_mm_takes_the_gather_path(monkeypatch):
    import draftgraph.ops.moe

    inputs, attrs = moe_case(gen(38))
    (grouped,) = run_op("moe", inputs, attrs)
    monkeypatch.setattr(draftgraph.ops.moe, "can_grouped_mm", lambda *a: False)
    (gathered,) = run_op("moe", inputs, attrs)
    assert rel_err(gathered, ref_moe(inputs, attrs)[0]) < 1e-2
    assert rel_err(grouped, gathered) < 2e-3


def test_swiglu_clamps_up_exactly_with_a_limit_bf16_cannot_hold():
    # up is clamped in bf16 only when the limit is a bf16 value; 7.3 is not (bf16 has 7.3125).
    from draftgraph.ops.moe import _swiglu

    gate = torch.full((1, 4), 1.0, dtype=torch.bfloat16)
    up = torch.tensor([[7.3125, -7.3125, 7.0, 20.0]], dtype=torch.bfloat16)
    for limit in (7.3, 10.0):
        want = F.silu(gate.float()) * up.float().clamp(-limit, limit)
        assert torch.equal(_swiglu(gate, up, limit), want)


@pytest.mark.parametrize("batch", [1, 5, 40])
def test_the_expert_order_by_ranks_is_the_stable_sort(monkeypatch, batch):
    """sorted_by_expert's two forms give one order and one set of group ends, ties by pair order."""
    import draftgraph.ops.moe

    g, e, k = gen(39), 9, 3
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(batch)])  # rows share experts
    monkeypatch.setattr(draftgraph.ops.moe, "RANKS_MIN_PAIRS", batch * k + 1)  # the sort
    sorted_order, sorted_ends = draftgraph.ops.moe.sorted_by_expert(idx, e)
    monkeypatch.setattr(draftgraph.ops.moe, "RANKS_MIN_PAIRS", 1)  # the ranks
    ranked_order, ranked_ends = draftgraph.ops.moe.sorted_by_expert(idx, e)
    assert torch.equal(ranked_order, sorted_order) and torch.equal(ranked_ends, sorted_ends)
    flat = idx.flatten()
    assert torch.equal(flat[ranked_order], flat.sort(stable=True).values)
    assert ranked_ends.dtype == torch.int32 and int(ranked_ends[-1]) == batch * k
    assert torch.equal(ranked_ends, torch.tensor([int((flat <= x).sum()) for x in range(e)], dtype=torch.int32))
