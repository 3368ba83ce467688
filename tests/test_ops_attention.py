"""swa_attention against a float64 reference written from spec section 3, over a paged cache."""

from __future__ import annotations

import math

import pytest
import torch
from v4_op_cases import BATCH, CFG, attention_case, gen, rel_err, run_op

F64 = torch.float64
BLOCK = 16


def rope_ref(v, p, theta, style="interleaved"):
    """Rotate v [..., r] by position p: pairs (2i, 2i+1) (or NeoX halves (i, i + r/2))."""
    r = v.shape[-1]
    out = v.clone()
    for i in range(r // 2):
        a = p * theta ** (-2 * i / r)
        lo, hi = (2 * i, 2 * i + 1) if style == "interleaved" else (i, i + r // 2)
        out[..., lo] = v[..., lo] * math.cos(a) - v[..., hi] * math.sin(a)
        out[..., hi] = v[..., lo] * math.sin(a) + v[..., hi] * math.cos(a)
    return out


def fp8_ref(v):
    """Spec: FP8 e4m3 rounding in blocks of 64 with a power-of-two scale (float64 bookkeeping)."""
    out = v.clone()
    for s in range(0, v.shape[-1], 64):
        blk = v[s : s + 64]
        scale = 2.0 ** math.ceil(math.log2(max(float(blk.abs().max()), 1e-4) / 448.0))
        out[s : s + 64] = (blk / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(F64) * scale
    return out


def slot_of(table_row, p):
    blk = int(table_row[p // BLOCK])
    return None if blk < 0 else blk * BLOCK + p % BLOCK


def ref_attention(inputs, attrs, rope_style="interleaved", sink_mode="denominator"):
    """Returns (out [B, D], new cache rows {slot: kv}) in float64."""
    x, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink, cache, pos, kv_start, table = inputs
    x, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink, cache = (
        t.to(F64) for t in (x, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink, cache)
    )
    h, d, r, eps = attrs["num_heads"], attrs["head_dim"], attrs["rope_dim"], attrs["eps"]
    theta, window, groups, n = attrs["rope_theta"], attrs["window"], attrs["o_groups"], d - r
    rms = lambda v: torch.sqrt((v * v).mean(-1, keepdim=True) + eps)  # noqa: E731
    cache = cache.clone()
    queries, written = [], {}
    for b in range(x.shape[0]):  # every row writes before any row reads, as in one decode step
        p = int(pos[b])
        qa = wq_a @ x[b]
        q = (wq_b @ (qa / rms(qa) * q_norm)).view(h, d)
        q = q / rms(q)
        q[:, n:] = rope_ref(q[:, n:], p, theta, rope_style)
        kv = wkv @ x[b]
        kv = kv / rms(kv) * kv_norm
        if attrs.get("kv_fp8_round"):
            kv[:n] = fp8_ref(kv[:n])
        kv[n:] = rope_ref(kv[n:], p, theta, rope_style)
        slot = slot_of(table[b], p)
        if slot is not None:
            cache[slot] = kv
            written[slot] = kv
        queries.append(q)
    out = torch.zeros(x.shape[0], wo_b.shape[0], dtype=F64)
    for b in range(x.shape[0]):
        p = int(pos[b])
        if slot_of(table[b], p) is None:
            continue  # a padded row: nothing to attend, zero output
        first = max(int(kv_start[b]), p - window + 1, 0)
        slots = [slot_of(table[b], j) for j in range(first, p + 1)]
        keys = torch.stack([cache[s] for s in slots if s is not None])  # [J, d]
        s = queries[b] @ keys.T / math.sqrt(d)  # [H, J]
        if sink_mode == "denominator":
            mu = torch.maximum(s.amax(-1), sink)[:, None]  # [H, 1]
            e = torch.exp(s - mu)
            w = e / (e.sum(-1, keepdim=True) + torch.exp(sink[:, None] - mu))
        else:  # the plain softmax: what ignoring the sink would give
            w = torch.softmax(s, dim=-1)
        o = w @ keys  # [H, d]
        o[:, n:] = rope_ref(o[:, n:], -p, theta, rope_style)
        per = h // groups
        wa = wo_a.view(groups, -1, per * d)
        z = torch.cat([wa[g] @ o[g * per : (g + 1) * per].reshape(-1) for g in range(groups)])
        out[b] = wo_b @ z
    return out, written


def run_attention(inputs, attrs):
    cache_before = inputs[9].clone()
    (out,) = run_op("swa_attention", inputs, attrs)
    return out, cache_before


def assert_cache_changed_only_at(cache, before, slots):
    changed = (cache != before).any(-1).nonzero().flatten().tolist()
    assert set(changed) <= set(slots), f"cache rows {sorted(set(changed) - set(slots))} changed"
    keep = torch.ones(cache.shape[0], dtype=torch.bool)
    keep[list(slots)] = False
    assert torch.equal(cache[keep], before[keep])


def test_swa_attention_matches_reference_over_paged_cache():
    inputs, attrs = attention_case(gen(11), positions=[5, 37, 50], kv_start=[0, 30, 0])
    ref_out, written = ref_attention(inputs, attrs)
    out, before = run_attention(inputs, attrs)
    assert out.shape == (BATCH, CFG.hidden_size) and out.dtype == torch.bfloat16
    assert rel_err(out, ref_out) < 1e-2
    assert len(written) == BATCH
    for slot, kv in written.items():
        assert rel_err(inputs[9][slot], kv) < 5e-3
    assert_cache_changed_only_at(inputs[9], before, written)


def test_block_table_is_used_for_reads_and_writes():
    # Same data with the pool's blocks renumbered: same output, and the writes land in the moved blocks.
    inputs, attrs = attention_case(gen(12))
    perm = torch.randperm(inputs[9].shape[0] // BLOCK, generator=gen(13))
    moved = [t.clone() for t in inputs]
    moved[12] = perm[inputs[12].long()].to(torch.int32)
    moved[9].view(-1, BLOCK, CFG.head_dim)[perm] = inputs[9].view(-1, BLOCK, CFG.head_dim)
    out_a, _ = run_attention(inputs, attrs)
    out_b, _ = run_attention(moved, attrs)
    assert torch.equal(out_a, out_b)
    assert torch.equal(moved[9].view(-1, BLOCK, CFG.head_dim)[perm], inputs[9].view(-1, BLOCK, CFG.head_dim))


def test_sink_is_in_the_denominator_only():
    inputs, attrs = attention_case(gen(14), positions=[9, 37, 50])
    inputs[8] = torch.tensor([3.0, -1.0, 0.5, 2.0])  # a sink heavy enough to matter
    out, _ = run_attention([t.clone() for t in inputs], attrs)
    assert rel_err(out, ref_attention(inputs, attrs)[0]) < 1e-2
    assert rel_err(out, ref_attention(inputs, attrs, sink_mode="none")[0]) > 0.2
    # A huge sink takes all the mass; as a key (value != 0) or in the numerator it would not vanish.
    inputs[8] = torch.full((CFG.num_attention_heads,), 60.0)
    out_big, _ = run_attention([t.clone() for t in inputs], attrs)
    assert out_big.abs().max() < 1e-6
    # A sink far below every score leaves the plain softmax.
    inputs[8] = torch.full((CFG.num_attention_heads,), -1e4)
    out_none, _ = run_attention([t.clone() for t in inputs], attrs)
    assert rel_err(out_none, ref_attention(inputs, attrs, sink_mode="none")[0]) < 1e-2


def test_window_and_kv_start_bound_the_keys():
    inputs, attrs = attention_case(gen(15), positions=[5, 37, 50], kv_start=[2, 30, 0])
    table, cache = inputs[12], inputs[9]
    poisoned = []
    for b, (p, start) in enumerate([(5, 2), (37, 30), (50, 0)]):
        lowest = max(start, p - attrs["window"] + 1)
        for j in range(0, lowest):  # older than the window, or before kv_start
            slot = slot_of(table[b], j)
            cache[slot] = 1e4
            poisoned.append(slot)
    out, _ = run_attention(inputs, attrs)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_attention(inputs, attrs)[0]) < 1e-2
    # The oldest in-window key does count: poisoning it changes row 2's output.
    inputs2, _ = attention_case(gen(15), positions=[5, 37, 50], kv_start=[2, 30, 0])
    inputs2[9][slot_of(inputs2[12][2], 50 - attrs["window"] + 1)] = 30.0
    out2, _ = run_attention(inputs2, attrs)
    assert rel_err(out2[2], out[2]) > 0.1


def test_unmapped_blocks_in_the_window_are_skipped():
    # Row 0 at p = 20 with block 0 released (-1): keys 16..20 only; block 0's rows never read.
    inputs, attrs = attention_case(gen(16), positions=[20, 37, 50])
    inputs[9].view(-1, BLOCK, CFG.head_dim)[int(inputs[12][0, 0])] = float("nan")
    inputs[12][0, 0] = -1
    out, _ = run_attention(inputs, attrs)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_attention(inputs, attrs)[0]) < 1e-2


def test_rope_is_interleaved_not_half_split():
    inputs, attrs = attention_case(gen(17), positions=[21, 37, 50])
    interleaved, written = ref_attention(inputs, attrs)
    neox, written_neox = ref_attention(inputs, attrs, rope_style="neox")
    out, _ = run_attention(inputs, attrs)
    n = CFG.head_dim - CFG.qk_rope_head_dim
    for slot in written:  # the cached kv's rotary tail
        assert rel_err(inputs[9][slot, n:], written[slot][n:]) < 5e-3
        assert rel_err(inputs[9][slot, n:], written_neox[slot][n:]) > 0.1
    assert rel_err(out, interleaved) < 1e-2
    assert rel_err(out, neox) > 0.05


def test_padded_row_writes_nothing_and_gives_finite_output():
    inputs, attrs = attention_case(gen(18), positions=[5, 20, 48])
    inputs[12][1] = -1  # row 1 is padding: no blocks at all
    ref_out, written = ref_attention(inputs, attrs)
    out, before = run_attention(inputs, attrs)
    assert len(written) == 2
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[[0, 2]], ref_out[[0, 2]]) < 1e-2
    assert_cache_changed_only_at(inputs[9], before, written)


def test_padded_row_does_not_clobber_a_live_write_to_slot_zero():
    # A live row writing slot 0 (block 0, offset 0) must win over any padded row's non-write.
    inputs, attrs = attention_case(gen(19), positions=[3, 32, 9])
    inputs[12][1] = torch.tensor([5, 6, 0, 7], dtype=torch.int32)  # p = 32 -> block 0, slot 0
    inputs[12][0] = -1
    inputs[12][2] = -1
    _, written = ref_attention(inputs, attrs)
    run_attention(inputs, attrs)
    assert list(written) == [0]
    assert rel_err(inputs[9][0], written[0]) < 5e-3


def test_all_rows_padded_leave_the_cache_untouched():
    inputs, attrs = attention_case(gen(20))
    inputs[12].fill_(-1)
    out, before = run_attention(inputs, attrs)
    assert torch.equal(inputs[9], before)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dead", [False, True])
def test_one_row_writes_its_slot_or_nothing(dead):
    # One row takes its own write path (no donor): live, it writes its slot; padded, nothing.
    inputs, attrs = attention_case(gen(22), batch=1, positions=[20])
    if dead:
        inputs[12].fill_(-1)
    ref_out, written = ref_attention(inputs, attrs)
    out, before = run_attention(inputs, attrs)
    assert len(written) == (0 if dead else 1)
    assert_cache_changed_only_at(inputs[9], before, written)
    if dead:
        assert torch.equal(inputs[9], before) and torch.equal(out, torch.zeros_like(out))
    else:
        assert rel_err(out, ref_out) < 1e-2


@pytest.mark.parametrize("positions", [[0, 15, 16], [63, 1, 47]])
def test_block_boundaries_and_first_position(positions):
    inputs, attrs = attention_case(gen(21), positions=positions)
    ref_out, _ = ref_attention(inputs, attrs)
    out, _ = run_attention(inputs, attrs)
    assert rel_err(out, ref_out) < 1e-2


def test_kv_fp8_round_rounds_the_non_rotary_head():
    inputs, attrs = attention_case(gen(22), kv_fp8_round=True)
    _, written = ref_attention(inputs, attrs)
    _, plain = ref_attention(inputs, {**attrs, "kv_fp8_round": False})
    ref_out, _ = ref_attention(inputs, attrs)
    out, _ = run_attention(inputs, attrs)
    n = CFG.head_dim - CFG.qk_rope_head_dim
    for slot, kv in written.items():
        row = inputs[9][slot, :n].double()
        assert rel_err(row, kv[:n]) < 2e-2
        assert rel_err(row, plain[slot][:n]) > 5e-3, "fp8 rounding left no trace"
        for s in range(0, n, 64):  # every block sits on the e4m3 grid times its power-of-two scale
            scale = 2.0 ** math.ceil(math.log2(float(kv[s : s + 64].abs().max()) / 448.0))
            scaled = row[s : s + 64] / scale
            assert torch.equal(scaled.to(torch.float8_e4m3fn).double(), scaled)
    assert rel_err(out, ref_out) < 1e-2
