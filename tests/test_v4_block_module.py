"""V4Block (the independent nn.Module block), the tiny model's names, the byte tokenizer and a
smoke training run. References here are written from the spec in float64 loops, not from the
code under test."""

from __future__ import annotations

import math

import pytest
import torch
from draftgraph.runtime.decode.tokenizer import ByteTokenizer
from draftgraph.runtime.errors import InputError, WeightError
from draftgraph.runtime.model import v4_block_math as vm
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.tiny_model import TinyV4Mtp, TinyV4Target
from draftgraph.runtime.model.v4_block_module import V4Block

torch.set_num_threads(1)
BS = vm.KV_BLOCK_SIZE


def small(**kw) -> V4Config:
    base = dict(
        hidden_size=64,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=32,
        o_lora_rank=16,
        sliding_window=8,
        vocab_size=300,
        n_routed_experts=6,
        moe_intermediate_size=32,
    )
    base.update(kw)
    return V4Config.small(**base)


def make_block(config: V4Config, hash_routed: bool = False, seed: int = 0) -> V4Block:
    """A block whose mHC and sink are far from their init, so every term matters."""
    torch.manual_seed(seed)
    block = V4Block(config, hash_routed=hash_routed)
    with torch.no_grad():
        block.attn.attn_sink.normal_()
        for half in ("attn", "ffn"):
            getattr(block, f"hc_{half}_fn").normal_(0, 0.05)
            getattr(block, f"hc_{half}_base").normal_()
            getattr(block, f"hc_{half}_scale").uniform_(0.5, 1.5)
        if not hash_routed:
            block.ffn.gate.bias.normal_(0, 0.1)
    return block


def random_block_table(B: int, max_blocks: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct, shuffled (non-contiguous) physical blocks for every row."""
    phys = torch.randperm(num_blocks, generator=gen)[: B * max_blocks].view(B, max_blocks)
    return phys.to(torch.int32)


def run_decode(block, X, positions, kv, table, kv_start, tokens=None):
    """Feed ``X [B, T, C, D]`` one token at a time; positions ``[B, T]``."""
    outs = []
    for t in range(X.shape[1]):
        ids = None if tokens is None else tokens[:, t]
        outs.append(block.decode(X[:, t], positions[:, t], kv, table, kv_start, ids))
    return torch.stack(outs, 1)


# ---- decode vs forward_seq -----------------------------------------------------------------------


@pytest.mark.parametrize("hash_routed", [False, True])
def test_decode_through_paged_cache_matches_forward_seq(hash_routed):
    config = small()
    block = make_block(config, hash_routed)
    gen = torch.Generator().manual_seed(1)
    B, T = 3, 29  # T > 2 * window: forward_seq takes its chunked path
    X = torch.randn(B, T, config.hc_mult, config.hidden_size, generator=gen).bfloat16()
    tokens = torch.randint(0, config.vocab_size, (B, T), generator=gen)
    positions = torch.tensor([0, 5, 17]).unsqueeze(1) + torch.arange(T)  # rows cross blocks differently
    table = random_block_table(B, 4, 40, gen)
    kv = torch.zeros(40 * BS, config.head_dim, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = block.forward_seq(X, positions, tokens)
        kv_start = positions[:, 0].to(torch.int32)  # each row's sequence starts at its first position
        out = run_decode(block, X, positions, kv, table, kv_start, tokens)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    assert diff.max() < 0.05 * ref.float().abs().max(), diff.max()
    assert diff.mean() < 2e-3, diff.mean()


def test_kv_start_hides_earlier_keys():
    config = small()
    block = make_block(config)
    gen = torch.Generator().manual_seed(2)
    B, T, start = 2, 12, 5
    X = torch.randn(B, T, config.hc_mult, config.hidden_size, generator=gen).bfloat16()
    positions = torch.arange(T).expand(B, T)
    kv = torch.zeros(8 * BS, config.head_dim, dtype=torch.bfloat16)
    table = random_block_table(B, 2, 8, gen)
    with torch.no_grad():
        out = run_decode(block, X, positions, kv, table, torch.full((B,), start, dtype=torch.int32))
        ref = block.forward_seq(X[:, start:], positions[:, start:])
    torch.testing.assert_close(out[:, start:].float(), ref.float(), atol=0.05, rtol=0.02)


# ---- sink and window -----------------------------------------------------------------------------


def test_sink_softmax_puts_the_sink_in_the_denominator_only():
    s = torch.tensor([[0.3, -1.0, 2.0, 0.5]], dtype=torch.float64)
    sink = torch.tensor([1.2], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False]])
    w = vm.sink_softmax(s, sink, valid).double()
    e = [math.exp(x) for x in s[0, :3].tolist()]
    expected = [x / (sum(e) + math.exp(1.2)) for x in e] + [0.0]
    torch.testing.assert_close(w[0], torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    assert w.sum() < 0.9  # a sink in the numerator as well would renormalise the weights to one


def test_large_sink_silences_attention_in_decode():
    config = small()
    loud, zeroed = make_block(config), make_block(config)
    with torch.no_grad():
        loud.attn.attn_sink.fill_(60.0)  # all the mass goes to the sink, no value reaches the output
        zeroed.attn.wo_b.weight.zero_()  # the exact "attention contributes nothing" block
    X = torch.randn(2, config.hc_mult, config.hidden_size).bfloat16()
    args = (
        torch.tensor([3, 20]),
        None,
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
    )

    def step(block):
        kv = torch.zeros(4 * BS, config.head_dim, dtype=torch.bfloat16)
        with torch.no_grad():
            return block.decode(X, args[0], kv, *args[2:]).float()

    torch.testing.assert_close(step(loud), step(zeroed), atol=1e-2, rtol=0)
    assert not torch.allclose(step(make_block(config)), step(zeroed), atol=1e-2, rtol=0)  # the test has teeth


def test_decode_never_reads_keys_older_than_the_window():
    config = small()
    block = make_block(config)
    W, T = config.sliding_window, 20
    X = torch.randn(1, T, config.hc_mult, config.hidden_size).bfloat16()
    positions = torch.arange(T).unsqueeze(0)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    kv = torch.zeros(4 * BS, config.head_dim, dtype=torch.bfloat16)
    with torch.no_grad():
        run_decode(block, X[:, : T - 1], positions[:, : T - 1], kv, table, torch.zeros(1, dtype=torch.int32))
        clean = kv.clone()
        p = T - 1
        for old in range(p - W + 1):  # every position that fell out of the window of p
            kv[int(table[0, old // BS]) * BS + old % BS] = float("nan")
        args = (positions[:, p], kv, table, torch.zeros(1, dtype=torch.int32))
        poisoned = block.decode(X[:, p], *args)
        reference = block.decode(X[:, p], positions[:, p], clean, table, torch.zeros(1, dtype=torch.int32))
    assert torch.isfinite(poisoned.float()).all()
    assert torch.equal(poisoned, reference)


def test_forward_seq_window_is_exactly_window_tokens():
    config = small()
    block = make_block(config)
    W, T = config.sliding_window, 2 * config.sliding_window + 3
    X = torch.randn(1, T, config.hc_mult, config.hidden_size)
    pos = torch.arange(T)
    p = T - 1
    with torch.no_grad():
        base = block.forward_seq(X, pos)[0, p]
        outside, inside = X.clone(), X.clone()
        outside[0, p - W] += 3.0
        inside[0, p - W + 1] += 3.0
        assert torch.equal(block.forward_seq(outside, pos)[0, p], base)
        assert not torch.allclose(block.forward_seq(inside, pos)[0, p], base)


# ---- paged writes --------------------------------------------------------------------------------


def test_padded_rows_write_nothing():
    config = small()
    block = make_block(config)
    kv = torch.randn(6 * BS, config.head_dim).bfloat16()
    before = kv.clone()
    table = torch.tensor([[4, 2], [-1, -1], [0, 5]], dtype=torch.int32)
    positions = torch.tensor([17, 17, 3])
    X = torch.randn(3, config.hc_mult, config.hidden_size).bfloat16()
    with torch.no_grad():
        out = block.decode(X, positions, kv, table, torch.zeros(3, dtype=torch.int32))
    changed = (kv != before).any(-1).nonzero().flatten().tolist()
    assert changed == sorted([2 * BS + 1, 0 * BS + 3]), changed
    assert torch.isfinite(out.float()).all()
    # A batch of padded rows only leaves the cache bit-for-bit unchanged.
    snapshot = kv.clone()
    with torch.no_grad():
        block.decode(
            X[:2],
            torch.tensor([0, 40]),
            kv,
            torch.full((2, 2), -1, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
        )
    assert torch.equal(kv, snapshot)


# ---- mHC against float64 spec loops ------------------------------------------------------------


def test_hc_post_mixes_the_residual_by_comb_transposed():
    gen = torch.Generator().manual_seed(3)
    C, D = 4, 5
    X = torch.randn(2, C, D, generator=gen, dtype=torch.float64)
    y = torch.randn(2, D, generator=gen, dtype=torch.float64)
    post = torch.rand(2, C, generator=gen, dtype=torch.float64)
    comb = torch.rand(2, C, C, generator=gen, dtype=torch.float64)
    assert not torch.allclose(comb, comb.transpose(-1, -2))
    expected = torch.zeros_like(X)
    for b in range(2):
        for k in range(C):
            expected[b, k] = post[b, k] * y[b] + sum(comb[b, j, k] * X[b, j] for j in range(C))
    torch.testing.assert_close(vm.hc_post(y, X, post, comb), expected)
    assert not torch.allclose(vm.hc_post(y, X, post, comb.transpose(-1, -2)), expected)


def test_hc_pre_matches_a_spec_loop():
    gen = torch.Generator().manual_seed(4)
    C, D, iters, eps = 4, 6, 3, 1e-6  # few iterations: an order slip must not converge away
    X = torch.randn(C, D, generator=gen, dtype=torch.float64)
    fn = torch.randn((2 + C) * C, C * D, generator=gen, dtype=torch.float64) * 0.3
    base = torch.randn((2 + C) * C, generator=gen, dtype=torch.float64)
    scale = torch.tensor([0.7, 1.3, 0.9], dtype=torch.float64)
    x = X.flatten()
    rho = 1 / math.sqrt(float((x * x).mean()) + eps)
    m = [float(fn[i] @ x) * rho for i in range(fn.shape[0])]
    sig = lambda v: 1 / (1 + math.exp(-v))
    pre = [sig(m[j] * 0.7 + float(base[j])) + eps for j in range(C)]
    post = [2 * sig(m[C + j] * 1.3 + float(base[C + j])) for j in range(C)]
    L = [[m[2 * C + C * j + k] * 0.9 + float(base[2 * C + C * j + k]) for k in range(C)] for j in range(C)]
    M = [[math.exp(v) / sum(math.exp(u) for u in row) + eps for v in row] for row in L]
    col = lambda M: [[M[j][k] / (sum(M[i][k] for i in range(C)) + eps) for k in range(C)] for j in range(C)]
    M = col(M)
    for _ in range(iters - 1):
        M = [[v / (sum(row) + eps) for v in row] for row in M]
        M = col(M)
    y, post_t, comb = vm.hc_pre(X, fn, base, scale, iters=iters, hc_eps=eps, norm_eps=eps)
    torch.testing.assert_close(y, sum(pre[j] * X[j] for j in range(C)).float().double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(post_t.double(), torch.tensor(post, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), torch.tensor(M, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_rope_is_relative_and_inverse_undoes_it():
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 12, generator=gen)
    dot = []
    for p in (3, 40):
        cq, sq = vm.rope_cos_sin(torch.tensor(p + 7), 8, 10000.0)
        ck, sk = vm.rope_cos_sin(torch.tensor(p), 8, 10000.0)
        dot.append(float(vm.apply_rope(q, cq, sq) @ vm.apply_rope(k, ck, sk)))
        torch.testing.assert_close(vm.apply_rope(vm.apply_rope(q, cq, sq), cq, sq, inverse=True), q)
    assert abs(dot[0] - dot[1]) < 1e-4
    rotated = vm.apply_rope(q, *vm.rope_cos_sin(torch.tensor(1), 8, 10000.0))
    assert torch.equal(rotated[:4], q[:4]) and not torch.allclose(rotated[4:], q[4:])


# ---- MoE -----------------------------------------------------------------------------------------


def test_moe_bias_selects_but_does_not_weight_and_dense_equals_sparse():
    config = small()
    block = make_block(config)
    x = torch.randn(7, config.hidden_size)
    with torch.no_grad():
        scores = vm.gate_scores(x, block.ffn.gate.weight)
        block.ffn.gate.bias.zero_()
        block.ffn.gate.bias[5] = 100.0  # expert 5 is always chosen, its weight still from its score
        idx, w = block.ffn.route(x, None)
        assert (idx == 5).any(-1).all()
        expected = scores.gather(-1, idx) / scores.gather(-1, idx).sum(-1, keepdim=True) * 1.5
        torch.testing.assert_close(w, expected)
        torch.testing.assert_close(block.ffn.forward_dense(x, None), block.ffn.forward_sparse(x, None))
    hashed = make_block(config, hash_routed=True)
    tokens = torch.tensor([0, 1, 299])
    idx, _ = hashed.ffn.route(x[:3], tokens)
    assert torch.equal(idx, hashed.ffn.gate.tid2eid[tokens].long())
    with pytest.raises(InputError):
        hashed.ffn.route(x[:3], None)


# ---- names and loading ---------------------------------------------------------------------------


def expected_block_names(config: V4Config, hash_routed: bool) -> set[str]:
    names = {f"attn.{w}.weight" for w in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")}
    names |= {"attn.attn_sink", "attn_norm.weight", "ffn_norm.weight", "ffn.gate.weight"}
    names |= {f"hc_{h}_{p}" for h in ("attn", "ffn") for p in ("fn", "base", "scale")}
    names.add("ffn.gate.tid2eid" if hash_routed else "ffn.gate.bias")
    for e in range(config.n_routed_experts):
        names |= {f"ffn.experts.{e}.{w}.weight" for w in ("w1", "w2", "w3")}
    names |= {f"ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}
    return names


def test_state_dict_names_are_the_real_checkpoint_names():
    config = small(num_hidden_layers=3, num_hash_layers=2)
    assert set(V4Block(config).state_dict()) == expected_block_names(config, False)
    block = V4Block(config, hash_routed=True)
    assert set(block.state_dict()) == expected_block_names(config, True)
    assert block.state_dict()["ffn.gate.tid2eid"].dtype == torch.int32
    assert block.state_dict()["hc_attn_fn"].shape == (config.hc_mix_dim, config.hc_mult * config.hidden_size)
    assert block.state_dict()["attn.wo_a.weight"].shape == (2 * 16, 4 * 32 // 2)
    target = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    for i in range(3):
        target |= {f"layers.{i}.{n}" for n in expected_block_names(config, i < 2)}
    assert set(TinyV4Target(config).state_dict_v4()) == target
    mtp = {f"mtp.0.{n}" for n in expected_block_names(config, False)}
    mtp |= {
        f"mtp.0.{n}"
        for n in (
            "e_proj.weight",
            "h_proj.weight",
            "enorm.weight",
            "hnorm.weight",
            "norm.weight",
            "hc_head_fn",
            "hc_head_base",
            "hc_head_scale",
        )
    }
    assert set(TinyV4Mtp(config).state_dict_v4()) == mtp


def test_load_v4_round_trip_and_bad_checkpoints():
    config = small()
    torch.manual_seed(0)
    src_t, src_m = TinyV4Target(config), TinyV4Mtp(config)
    tensors = {**src_t.state_dict_v4(), **src_m.state_dict_v4()}
    dst_t, dst_m = TinyV4Target(config), TinyV4Mtp(config)
    dst_t.load_v4(tensors)
    dst_m.load_v4(tensors)
    tokens = torch.randint(0, config.vocab_size, (1, 6))
    with torch.no_grad():
        (a, sa), (b, sb) = src_t.forward_seq(tokens), dst_t.forward_seq(tokens)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        pos = torch.arange(5)
        ma = src_m.forward_seq(sa[:, :5], tokens[:, 1:], src_t.embed, src_t.head, pos)
        mb = dst_m.forward_seq(sb[:, :5], tokens[:, 1:], dst_t.embed.weight, dst_t.head.weight, pos)
        torch.testing.assert_close(ma, mb, rtol=0, atol=0)
    with pytest.raises(WeightError, match="missing"):
        TinyV4Mtp(config).load_v4({k: v for k, v in tensors.items() if k != "mtp.0.attn.wkv.weight"})
    bad = dict(tensors)
    bad["layers.1.attn.wkv.weight"] = torch.zeros(3, 3)
    fresh = TinyV4Target(config)
    before = fresh.state_dict()["layers.0.attn.wq_a.weight"].clone()
    with pytest.raises(WeightError, match="wkv"):
        fresh.load_v4(bad)
    assert torch.equal(fresh.state_dict()["layers.0.attn.wq_a.weight"], before)  # nothing half-loaded


def test_tiny_model_decode_chain_matches_forward_seq():
    config = small()
    torch.manual_seed(0)
    target, mtp = TinyV4Target(config), TinyV4Mtp(config)
    B, T = 2, 20
    tokens = torch.randint(0, config.vocab_size, (B, T + 1))
    pos = torch.arange(T)
    gen = torch.Generator().manual_seed(8)
    table = random_block_table(B, 2, 8, gen)
    start = torch.zeros(B, dtype=torch.int32)
    caches = [torch.zeros(8 * BS, config.head_dim) for _ in range(config.num_hidden_layers + 1)]
    with torch.no_grad():
        logits, streams = target.forward_seq(tokens[:, :T], pos)
        mtp_logits = mtp.forward_seq(streams, tokens[:, 1:], target.embed, target.head, pos)
        for t in range(T):
            p = pos[t].expand(B)
            step_logits, step_streams = target.decode(tokens[:, t], p, caches[:-1], table, start)
            draft_logits, _ = mtp.decode(
                step_streams, tokens[:, t + 1], target.embed, target.head, p, caches[-1], table, start
            )
            torch.testing.assert_close(step_logits, logits[:, t], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(draft_logits, mtp_logits[:, t], atol=1e-4, rtol=1e-4)


# ---- tokenizer and training ----------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓ 🐍"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, 260, 263]) == text  # specials and padding dropped
    assert tok.encode("a", add_bos=True, add_eos=True) == [256, 97, 257]
    assert tok.decode([0xC3]) == "\ufffd"


def test_byte_tokenizer_refuses_what_is_not_text():
    tok = ByteTokenizer()
    with pytest.raises(InputError, match=r"text: expected encodable as UTF-8, got '\\udcff' at character 2"):
        tok.encode("ab\udcff")  # a byte that was not UTF-8, decoded with surrogateescape
    with pytest.raises(InputError, match="text: expected a str, got bytes"):
        tok.encode(b"ab")


def test_tiny_config_is_the_committed_model():
    """tiny_config is written as overrides of V4Config.small(): it must still be what was trained."""
    from draftgraph.tools.workload import TINY_CHECKPOINT
    from train_tiny import tiny_config

    assert tiny_config() == V4Config.load(TINY_CHECKPOINT), tiny_config()


@pytest.mark.slow
def test_smoke_training_lowers_the_loss():
    from train_tiny import is_held_out, stdlib_files, tiny_config, token_stream, train

    root, files = stdlib_files()
    stream = token_stream(root, [f for f in files if not is_held_out(f)][:40])
    config = tiny_config(hidden_size=64, n_routed_experts=4, moe_intermediate_size=64, q_lora_rank=32)
    _, _, history = train(config, stream, seconds=30, batch=8, seq_len=64, max_steps=60, progress=False)
    first = sum(h["loss"] for h in history[:3]) / 3
    last = sum(h["loss"] for h in history[-3:]) / 3
    assert len(history) >= 10, len(history)
    assert last < first - 1.0, (first, last)


def test_warm_start_continues_from_the_saved_checkpoint(tmp_path):
    """--init: the saved bf16 checkpoint comes back as fp32 models with the saved values (bf16-rounded),
    and train() continues those models instead of fresh ones."""
    from train_tiny import FP32_NAMES, joint_loss, load_init, save_checkpoint, tiny_config, train

    config = tiny_config(hidden_size=64, n_routed_experts=4, moe_intermediate_size=64, q_lora_rank=32)
    torch.manual_seed(0)
    target, mtp = TinyV4Target(config), TinyV4Mtp(config)
    save_checkpoint(tmp_path, config, target, mtp)
    loaded_config, target2, mtp2 = load_init(tmp_path)
    assert loaded_config == config
    saved = {**target.state_dict_v4(), **mtp.state_dict_v4()}
    for name, t in {**target2.state_dict_v4(), **mtp2.state_dict_v4()}.items():
        kept = not t.is_floating_point() or any(key in name for key in FP32_NAMES)  # stored exactly
        expected = saved[name] if kept else saved[name].bfloat16().float()
        assert t.dtype == saved[name].dtype and torch.equal(t, expected), (name, t.dtype)
    stream = torch.randint(0, 256, (4096,), dtype=torch.int16)
    window = stream[:66].long().unsqueeze(0).expand(2, -1)  # [B, T+2]
    with torch.no_grad():
        fresh, loaded = joint_loss(target, mtp, window, 0.5)[0].item(), joint_loss(target2, mtp2, window, 0.5)[0].item()
    assert abs(fresh - loaded) < 0.05, (fresh, loaded)
    trained, trained_mtp, history = train(
        config, stream, seconds=60, batch=2, seq_len=32, max_steps=2, progress=False, init=(target2, mtp2)
    )
    assert trained is target2 and trained_mtp is mtp2 and len(history) == 2, len(history)


def test_chained_mtp_loss_and_frozen_target():
    """--mtp-depth 1 is the MTP's teacher-forced loss; depth 2 feeds step 1's own streams to step 2
    (as drafting does); --freeze-target trains the MTP only and leaves every target tensor as it was."""
    import torch.nn.functional as F
    from train_tiny import joint_loss, tiny_config, train

    config = tiny_config(hidden_size=64, n_routed_experts=4, moe_intermediate_size=64, q_lora_rank=32)
    torch.manual_seed(0)
    target, mtp = TinyV4Target(config), TinyV4Mtp(config)
    window = torch.randint(0, 256, (2, 35))  # [B, T+1+depth] with T = 32, depth 2
    positions = torch.arange(32)
    with torch.no_grad():
        _, streams = target.forward_seq(window[:, :32], positions)
        logits1 = mtp.forward_seq(streams, window[:, 1:33], target.embed, target.head, positions)
        ce1 = F.cross_entropy(logits1.flatten(0, 1), window[:, 2:34].flatten())
        Z1 = mtp.block.forward_seq(mtp.combine(streams, window[:, 1:33], target.embed), positions)
        logits2 = mtp.forward_seq(Z1, window[:, 2:34], target.embed, target.head, positions)
        ce2 = F.cross_entropy(logits2.flatten(0, 1), window[:, 3:35].flatten())
        assert torch.allclose(joint_loss(target, mtp, window[:, :34], 0.5)[2], ce1)
        assert torch.allclose(joint_loss(target, mtp, window, 0.5, mtp_depth=2)[2], (ce1 + ce2) / 2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    mtp_before = {k: v.clone() for k, v in mtp.state_dict().items()}
    stream = torch.randint(0, 256, (4096,), dtype=torch.int16)
    _, _, history = train(
        config,
        stream,
        seconds=60,
        batch=2,
        seq_len=32,
        max_steps=2,
        progress=False,
        init=(target, mtp),
        mtp_depth=3,
        freeze_target=True,
    )
    assert len(history) == 2 and all(h["loss"] == h["ce_mtp"] for h in history), history
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert any(not torch.equal(mtp_before[k], v) for k, v in mtp.state_dict().items())


# ---- CUDA graph capture --------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_decode_captures_in_a_cuda_graph_without_host_syncs():
    config = small()
    block = make_block(config, hash_routed=True).cuda()
    dev, B, C, D = "cuda", 4, config.hc_mult, config.hidden_size
    gen = torch.Generator().manual_seed(7)

    def fresh_inputs():
        X = torch.randn(B, C, D, generator=gen).bfloat16()
        positions = torch.randint(0, 60, (B,), generator=gen)
        table = random_block_table(B, 4, 16, gen)
        table[2] = -1  # a padded row
        kv = torch.randn(16 * BS, config.head_dim, generator=gen).bfloat16()
        tokens = torch.randint(0, config.vocab_size, (B,), generator=gen)
        start = torch.zeros(B, dtype=torch.int32)
        return [t.to(dev) for t in (X, positions, kv, table, start, tokens)]

    static = fresh_inputs()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside decode raises
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):
                block.decode(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = block.decode(*static)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for _ in range(2):  # replay on new data written into the static inputs
        new = fresh_inputs()
        for dst, src in zip(static, new):
            dst.copy_(src)
        eager_kv = new[2].clone()
        with torch.no_grad():
            expected = block.decode(new[0], new[1], eager_kv, *new[3:])
        graph.replay()
        torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=0)
        assert torch.equal(static[2], eager_kv)
