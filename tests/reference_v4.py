"""A float64 straight-line reference of the MTP draft step, written from the spec alone.

It shares no code with ops/ or graphs/: every equation is restated here from
spec/deepseek_v4_mtp.md. The drafter cache is a dict position -> latent row.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def rms(x, w=None, eps=1e-6):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def rope(v, p, theta, sign=1.0):
    r = v.shape[-1]
    out = v.clone()
    for i in range(r // 2):
        ang = sign * p * theta ** (-2 * i / r)
        c, s = math.cos(ang), math.sin(ang)
        a, b = v[..., 2 * i].clone(), v[..., 2 * i + 1].clone()
        out[..., 2 * i] = a * c - b * s
        out[..., 2 * i + 1] = a * s + b * c
    return out


class ReferenceMtp:
    def __init__(self, cfg, tensors, mode="streams", vocab_rows=None):
        self.cfg, self.mode = cfg, mode
        self.w = {k: v.to(F64) if v.is_floating_point() else v for k, v in tensors.items()}
        self.vocab_rows = vocab_rows or cfg.vocab_size
        self.cache: dict[int, torch.Tensor] = {}
        self.start = 0

    def W(self, name):
        return self.w["mtp.0." + name]

    # ---- mHC -------------------------------------------------------------------------
    def hc_pre(self, X, which):
        cfg, C = self.cfg, self.cfg.hc_mult
        fn, base, sc = self.W(f"hc_{which}_fn"), self.W(f"hc_{which}_base"), self.W(f"hc_{which}_scale")
        x = X.reshape(-1)
        rho = 1 / math.sqrt(float((x * x).mean()) + cfg.rms_norm_eps)
        m = (fn @ x) * rho
        pre = torch.sigmoid(m[:C] * sc[0] + base[:C]) + cfg.hc_eps
        post = 2 * torch.sigmoid(m[C : 2 * C] * sc[1] + base[C : 2 * C])
        L = (m[2 * C :] * sc[2] + base[2 * C :]).reshape(C, C)
        M = torch.softmax(L, dim=-1) + cfg.hc_eps
        M = M / (M.sum(0, keepdim=True) + cfg.hc_eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            M = M / (M.sum(1, keepdim=True) + cfg.hc_eps)
            M = M / (M.sum(0, keepdim=True) + cfg.hc_eps)
        y = (pre[:, None] * X).sum(0)
        return y, post, M

    @staticmethod
    def hc_post(y, X, post, comb):
        C = X.shape[0]
        return torch.stack([post[k] * y + sum(comb[j, k] * X[j] for j in range(C)) for k in range(C)])

    # ---- attention (one token at position p) --------------------------------------------
    def attention(self, x, p):
        cfg = self.cfg
        H, d, r = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        n, g, ol = d - r, cfg.o_groups, cfg.o_lora_rank
        q = self.W("attn.wq_b.weight") @ rms(self.W("attn.wq_a.weight") @ x, self.W("attn.q_norm.weight"),
                                              cfg.rms_norm_eps)
        q = rms(q.reshape(H, d), None, cfg.rms_norm_eps)
        q[:, n:] = rope(q[:, n:], p, cfg.rope_theta)
        kv = rms(self.W("attn.wkv.weight") @ x, self.W("attn.kv_norm.weight"), cfg.rms_norm_eps)
        kv[n:] = rope(kv[n:], p, cfg.rope_theta)
        self.cache[p] = kv
        keys = [j for j in range(max(self.start, p - cfg.sliding_window + 1), p + 1) if j in self.cache]
        K = torch.stack([self.cache[j] for j in keys])  # [W, d]
        sink = self.W("attn.attn_sink")
        out_heads = []
        for h in range(H):
            s = (K @ q[h]) / math.sqrt(d)
            mu = max(float(s.max()), float(sink[h]))
            e = torch.exp(s - mu)
            wts = e / (e.sum() + math.exp(float(sink[h]) - mu))
            o = (wts[:, None] * K).sum(0)
            o[n:] = rope(o[n:], p, cfg.rope_theta, sign=-1.0)
            out_heads.append(o)
        o = torch.stack(out_heads).reshape(g, -1)  # [g, (H/g) * d]
        wo_a = self.W("attn.wo_a.weight").reshape(g, ol, -1)
        z = torch.cat([wo_a[i] @ o[i] for i in range(g)])
        return self.W("attn.wo_b.weight") @ z

    # ---- MoE ---------------------------------------------------------------------------------
    def moe(self, x):
        cfg, lim = self.cfg, self.cfg.swiglu_limit
        s = torch.sqrt(torch.nn.functional.softplus(self.W("ffn.gate.weight") @ x))
        idx = torch.topk(s + self.W("ffn.gate.bias"), cfg.num_experts_per_tok).indices
        wts = s[idx] / s[idx].sum() * cfg.routed_scaling_factor

        def swiglu(prefix, weight=1.0):
            gte = torch.clamp(self.W(prefix + "w1.weight") @ x, max=lim)
            up = torch.clamp(self.W(prefix + "w3.weight") @ x, -lim, lim)
            return self.W(prefix + "w2.weight") @ (weight * torch.nn.functional.silu(gte) * up)

        out = swiglu("ffn.shared_experts.")
        for e, wt in zip(idx.tolist(), wts):
            out = out + swiglu(f"ffn.experts.{e}.", wt)
        return out

    # ---- the step ------------------------------------------------------------------------------
    def block(self, X, p):
        eps = self.cfg.rms_norm_eps
        y, post, comb = self.hc_pre(X, "attn")
        X = self.hc_post(self.attention(rms(y, self.W("attn_norm.weight"), eps), p), X, post, comb)
        y, post, comb = self.hc_pre(X, "ffn")
        return self.hc_post(self.moe(rms(y, self.W("ffn_norm.weight"), eps)), X, post, comb)

    def hc_head(self, X):
        cfg = self.cfg
        x = X.reshape(-1)
        rho = 1 / math.sqrt(float((x * x).mean()) + cfg.rms_norm_eps)
        gt = torch.sigmoid((self.W("hc_head_fn") @ x) * rho * self.W("hc_head_scale")[0] + self.W("hc_head_base"))
        return ((gt + cfg.hc_eps)[:, None] * X).sum(0)

    def step(self, token, hidden, p, mask=None, vocab_limit=None):
        """One draft step; returns (logits [Vd], next_hidden)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        e = rms(self.w["embed.weight"][token], self.W("enorm.weight"), eps)
        ep = self.W("e_proj.weight") @ e
        if self.mode == "streams":
            h = rms(hidden, self.W("hnorm.weight"), eps)  # [C, D], one weight for every stream
            X = (h @ self.W("h_proj.weight").T) + ep[None, :]
        else:
            h_in = ep + self.W("h_proj.weight") @ rms(hidden, self.W("hnorm.weight"), eps)
            X = h_in[None, :].repeat(cfg.hc_mult, 1)
        Xo = self.block(X, p)
        h_out = self.hc_head(Xo)
        logits = self.w["head.weight"][: self.vocab_rows] @ rms(h_out, self.W("norm.weight"), eps)
        return logits, (Xo if self.mode == "streams" else h_out)

    @staticmethod
    def allowed(vocab, mask=None, vocab_limit=None):
        ok = torch.ones(vocab, dtype=torch.bool)
        if vocab_limit is not None:
            ok[vocab_limit:] = False
        if mask is not None:
            for t in range(vocab):
                word = int(mask[t // 32]) & 0xFFFFFFFF
                ok[t] &= bool((word >> (t % 32)) & 1)
        return ok
