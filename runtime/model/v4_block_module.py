"""V4Block: an independent ``nn.Module`` of one DeepSeek-V4 block (mHC + sliding-window MLA-style
attention with sink + MoE), the ``torch_module`` body runner and the training model's layer.

Parameter names equal the real checkpoint's block tensor names without their prefix
(``attn.wq_a.weight``, ``hc_attn_fn``, ``ffn.experts.3.w1.weight``, ...), so
``block.state_dict()`` and ``load_block(tensors, "mtp.0.")`` speak the checkpoint's language.

Precision (note "boundaries"): math runs in fp32; values are cast to the activation dtype
(``X.dtype``, bf16 at inference) only where the spec puts a boundary: the hc_pre output, the
norm outputs, the attention and MoE outputs, the hc_post output and the cached latent. With fp32
``X`` (training) nothing is rounded, and gradients flow through everything but the top-k choice.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from draftgraph.runtime.errors import InputError, WeightError, describe
from draftgraph.runtime.model import v4_block_math as vm
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import QuantWeight
from torch import nn


class RMSNorm(nn.Module):
    """Vanilla RMS norm with a ``weight`` (w * x, not (1 + w) * x)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vm.rms_norm(x, self.weight, self.eps)


def _linear(in_features: int, out_features: int, std: float | None = None) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(layer.weight, std=std if std is not None else in_features**-0.5)
    return layer


class Attention(nn.Module):
    """Sliding-window attention with one shared latent as key and value (spec section 3)."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        D, H, d = config.hidden_size, config.num_attention_heads, config.head_dim
        self.num_heads, self.head_dim = H, d
        self.o_groups, self.o_lora = config.o_groups, config.o_lora_rank
        self.eps = config.rms_norm_eps
        self.wq_a = _linear(D, config.q_lora_rank)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = _linear(config.q_lora_rank, H * d)
        self.wkv = _linear(D, d)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps)
        self.wo_a = _linear(H * d // config.o_groups, config.o_groups * config.o_lora_rank)
        self.wo_b = _linear(config.o_groups * config.o_lora_rank, D, std=0.5 * (config.o_lora_rank**-0.5))
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed input ``[..., D]`` -> roped q ``[..., H, d]`` and roped latent ``[..., d]``, fp32."""
        x = x.float()
        q = F.linear(
            vm.rms_norm(F.linear(x, self.wq_a.weight.float()), self.q_norm.weight, self.eps),
            self.wq_b.weight.float(),
        )
        q = vm.rms_norm(q.unflatten(-1, (self.num_heads, self.head_dim)), None, self.eps)  # [..., H, d]
        q = vm.apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        kv = vm.rms_norm(F.linear(x, self.wkv.weight.float()), self.kv_norm.weight, self.eps)  # [..., d]
        kv = vm.apply_rope(kv, cos, sin)
        return q, kv

    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per-head outputs ``[..., H, d]`` -> ``[..., D]`` fp32: inverse RoPE, grouped wo_a, wo_b."""
        o = vm.apply_rope(o.float(), cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
        # Group g holds heads g*H/G .. (g+1)*H/G - 1, concatenated: a plain reshape of [H, d].
        o = o.flatten(-2).unflatten(-1, (self.o_groups, -1))  # [..., G, H*d/G]
        wo_a = self.wo_a.weight.float().unflatten(0, (self.o_groups, self.o_lora))  # [G, o_lora, H*d/G]
        z = torch.einsum("...gi,goi->...go", o, wo_a).flatten(-2)  # [..., G*o_lora]
        return F.linear(z, self.wo_b.weight.float())


class Gate(nn.Module):
    """Router weights; ``bias`` (score routing) or ``tid2eid`` (hash routing) is a buffer:
    neither is learned by gradient (the bias is tuned by load balancing, see benchmarks/train_tiny.py)."""

    def __init__(self, config: V4Config, hash_routed: bool) -> None:
        super().__init__()
        E, k = config.n_routed_experts, config.num_experts_per_tok
        self.weight = nn.Parameter(torch.randn(E, config.hidden_size) * config.hidden_size**-0.5)
        if hash_routed:
            # A fixed random assignment of k distinct experts per token id (seeded: reproducible).
            gen = torch.Generator().manual_seed(1234)
            tid2eid = torch.rand(config.vocab_size, E, generator=gen).argsort(-1)[:, :k]
            self.register_buffer("tid2eid", tid2eid.to(torch.int32))
        else:
            self.register_buffer("bias", torch.zeros(E, dtype=torch.float32))


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.w1 = _linear(dim, inter)
        self.w2 = _linear(inter, dim, std=0.5 * inter**-0.5)
        self.w3 = _linear(dim, inter)

    def forward(self, x: torch.Tensor, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
        return vm.swiglu(x, self.w1.weight, self.w2.weight, self.w3.weight, limit, weight)


class MoE(nn.Module):
    """Routed experts plus one shared expert (spec section 4)."""

    def __init__(self, config: V4Config, hash_routed: bool) -> None:
        super().__init__()
        self.hash_routed = hash_routed
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.limit = config.swiglu_limit
        self.gate = Gate(config, hash_routed)
        D, inter = config.hidden_size, config.moe_intermediate_size
        self.experts = nn.ModuleList(Expert(D, inter) for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(D, inter)
        self.last_load: torch.Tensor | None = None  # tokens per expert of the last forward

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts ``[N, k]`` int64 and their weights ``[N, k]`` fp32 (differentiable)."""
        scores = vm.gate_scores(x, self.gate.weight)  # [N, E]
        if self.hash_routed:
            if token_ids is None:
                raise InputError(
                    describe(
                        "V4Block(hash_routed).token_ids",
                        "int tensor [N]",
                        None,
                        "hash-routed layers pick experts by token id",
                    )
                )
            return vm.route_by_hash(scores, self.gate.tid2eid, token_ids, self.scaling)
        return vm.route_by_score(scores, self.gate.bias, self.top_k, self.scaling)

    def forward_sparse(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """``[N, D] -> [N, D]`` fp32, each expert on its own tokens only (syncs: training/prefill)."""
        idx, w = self.route(x, token_ids)
        out = self.shared_experts(x, self.limit)
        routed = torch.zeros_like(out)
        self.last_load = torch.bincount(idx.flatten(), minlength=len(self.experts)).detach()
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel():
                y = expert(x[rows], self.limit, w[rows, slot].unsqueeze(-1))
                routed = routed.index_add(0, rows, y)
        return routed + out

    def forward_dense(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """Same math, capture-safe: every expert runs on every row with weight 0 when unchosen.

        Costs E/k times the expert FLOPs and reads every expert; a grouped kernel is the graph
        ops' business, this is the reference runner.
        """
        idx, w = self.route(x, token_ids)
        full = torch.zeros(x.shape[0], len(self.experts), device=x.device).scatter(1, idx, w)  # [N, E]
        out = self.shared_experts(x, self.limit)
        routed = torch.zeros_like(out)
        for e, expert in enumerate(self.experts):
            routed = routed + expert(x, self.limit, full[:, e : e + 1])
        return routed + out

    def forward_gathered(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """Capture-safe and sparse: copy each row's k experts out of ``stacked`` weights, then matmul.

        ``self.stacked`` = (w1 [E, I, D], w2 [E, D, I], w3 [E, I, D]) views of the checkpoint's
        experts (set by the runner). Reads k experts per row, as plain torch decode code does.
        """
        idx, w = self.route(x, token_ids)  # [N, k]
        w1, w2, w3 = self.stacked
        xf = x.float()
        gate = torch.einsum("nd,nkid->nki", xf, w1[idx].float()).clamp(max=self.limit)
        up = torch.einsum("nd,nkid->nki", xf, w3[idx].float()).clamp(-self.limit, self.limit)
        hidden = w.unsqueeze(-1) * F.silu(gate) * up  # [N, k, I]
        routed = torch.einsum("nki,nkdi->nd", hidden, w2[idx].float())
        return routed + self.shared_experts(x, self.limit)


class V4Block(nn.Module):
    """One DeepSeek-V4 block on residual streams ``[..., C, D]``.

    Parameters
    ----------
    config : V4Config
    hash_routed : bool
        True for target layers ``i < num_hash_layers`` (experts by ``tid2eid[token]``).

    Examples
    --------
    >>> block = V4Block(V4Config.small())
    >>> Y = block.forward_seq(torch.randn(1, 5, 4, 256), torch.arange(5))  # [B, T, C, D]
    """

    def __init__(self, config: V4Config, hash_routed: bool = False) -> None:
        super().__init__()
        self.config = config
        C, D, mix = config.hc_mult, config.hidden_size, config.hc_mix_dim
        self.attn = Attention(config)
        self.ffn = MoE(config, hash_routed)
        self.attn_norm = RMSNorm(D, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, config.rms_norm_eps)
        for half in ("attn", "ffn"):
            self.register_parameter(f"hc_{half}_fn", nn.Parameter(torch.randn(mix, C * D) * 0.01))
            self.register_parameter(f"hc_{half}_base", nn.Parameter(_hc_base_init(C)))
            self.register_parameter(f"hc_{half}_scale", nn.Parameter(torch.full((3,), 0.1)))

    # ---- helpers -------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[..., r/2]`` for ``positions`` (plain RoPE, no YaRN: spec section 5)."""
        return vm.rope_cos_sin(positions, self.config.qk_rope_head_dim, self.config.rope_theta)

    def _hc_pre(self, X: torch.Tensor, half: str):
        c = self.config
        return vm.hc_pre(
            X,
            getattr(self, f"hc_{half}_fn"),
            getattr(self, f"hc_{half}_base"),
            getattr(self, f"hc_{half}_scale"),
            iters=c.hc_sinkhorn_iters,
            hc_eps=c.hc_eps,
            norm_eps=c.rms_norm_eps,
        )

    def _ffn_half(self, X: torch.Tensor, token_ids: torch.Tensor | None, dense: bool) -> torch.Tensor:
        f, post, comb = self._hc_pre(X, "ffn")
        f = self.ffn_norm(f)
        flat = f.reshape(-1, f.shape[-1])  # [N, D]
        ids = None if token_ids is None else token_ids.reshape(-1)
        if not dense:
            y = self.ffn.forward_sparse(flat, ids)
        elif getattr(self.ffn, "stacked", None) is not None:
            y = self.ffn.forward_gathered(flat, ids)
        else:
            y = self.ffn.forward_dense(flat, ids)
        return vm.hc_post(y.reshape(f.shape).to(X.dtype), X, post, comb)

    # ---- forwards ------------------------------------------------------------------------------
    def forward_seq(
        self, X: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal sliding-window block over whole sequences (training, prefill).

        Parameters
        ----------
        X : ``[B, T, C, D]`` bf16 or fp32 streams.
        positions : int ``[T]`` or ``[B, T]``, increasing along T; query p sees keys
            ``max(0, p - window + 1) .. p`` among the row's T tokens.
        token_ids : int ``[B, T]``, required when hash-routed.

        Returns
        -------
        ``[B, T, C, D]`` in ``X.dtype``.
        """
        if X.dim() != 4 or X.shape[2:] != (self.config.hc_mult, self.config.hidden_size):
            raise InputError(
                describe(
                    "V4Block.forward_seq X",
                    f"[B, T, {self.config.hc_mult}, {self.config.hidden_size}]",
                    list(X.shape),
                )
            )
        B, T = X.shape[:2]
        positions = positions.expand(B, T)
        cos, sin = self.rope(positions)  # [B, T, r/2]
        a, post, comb = self._hc_pre(X, "attn")
        q, kv = self.attn.project(self.attn_norm(a), cos, sin)  # [B, T, H, d], [B, T, d]
        kv = kv.to(X.dtype).float()  # the cache holds activation-dtype rows; mirror decode
        o = vm.local_attention(
            q, kv, positions, self.attn.attn_sink, self.config.sliding_window, self.attn.scale()
        )  # [B, T, H, d]
        a = self.attn.output(o, cos, sin).to(X.dtype)
        X = vm.hc_post(a, X, post, comb)
        return self._ffn_half(X, token_ids, dense=False)

    def decode(
        self,
        X: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        block_table: torch.Tensor,
        kv_start: torch.Tensor,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per row against the paged latent cache; capture-safe (no host syncs).

        Parameters
        ----------
        X : ``[B, C, D]`` bf16 streams.
        positions : int64 ``[B]``, the absolute position of each row's token.
        kv : ``[num_slots, d]`` the paged latent cache; this token's latent is written at slot
            ``block_table[b, p // 16] * 16 + p % 16`` (nothing is written when that entry is -1).
        block_table : int32 ``[B, max_blocks]``, -1 = unmapped.
        kv_start : int32 ``[B]``, the first valid key position of each row.
        token_ids : int ``[B]``, required when hash-routed.

        Returns
        -------
        ``[B, C, D]`` in ``X.dtype``.
        """
        c = self.config
        if X.dim() != 3 or X.shape[1:] != (c.hc_mult, c.hidden_size):
            raise InputError(
                describe("V4Block.decode X", f"[B, {c.hc_mult}, {c.hidden_size}]", list(X.shape))
            )
        if kv.dim() != 2 or kv.shape[1] != c.head_dim:
            raise InputError(describe("V4Block.decode kv", f"[num_slots, {c.head_dim}]", list(kv.shape)))
        cos, sin = self.rope(positions)  # [B, r/2]
        a, post, comb = self._hc_pre(X, "attn")
        q, latent = self.attn.project(self.attn_norm(a), cos, sin)  # [B, H, d], [B, d]
        slots, mapped = vm.paged_slots(positions.long(), block_table)
        vm.paged_write(kv, latent, slots, mapped)
        keys, valid = vm.paged_window(kv, positions, block_table, kv_start, c.sliding_window)  # [B, W, d]
        scores = torch.einsum("bhd,bwd->bhw", q, keys) * self.attn.scale()  # [B, H, W]
        w = vm.sink_softmax(scores, self.attn.attn_sink.view(1, -1, 1), valid.unsqueeze(1))
        o = torch.einsum("bhw,bwd->bhd", w, keys)  # [B, H, d]
        a = self.attn.output(o, cos, sin).to(X.dtype)
        X = vm.hc_post(a, X, post, comb)
        return self._ffn_half(X, token_ids, dense=True)

    # ---- weights -------------------------------------------------------------------------------
    def load_block(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Take this block's tensors from a checkpoint dict (names ``prefix + own name``).

        Shapes are checked before anything changes; dtypes are kept as stored (bf16 linears,
        fp32 ``hc_*``/``attn_sink``/gate bias, int32 ``tid2eid``). Raises WeightError.
        """
        own = self.state_dict()
        missing = [prefix + k for k in own if prefix + k not in tensors]
        if missing:
            raise WeightError(
                describe(
                    f"block {prefix!r}",
                    f"{len(own)} tensors",
                    f"{len(missing)} missing, e.g. {missing[:3]}",
                    "is the prefix right (layers.{i}. / mtp.0.)?",
                )
            )
        # A block-scaled weight (QuantWeight) is dequantised here: this module is the independent
        # bf16 check of the op subgraph, not a path that keeps the checkpoint's formats.
        tensors = {prefix + n: _dequantized(tensors[prefix + n]) for n in own}
        for name, current in own.items():
            got = tensors[prefix + name]
            if tuple(got.shape) != tuple(current.shape):
                raise WeightError(describe(prefix + name, list(current.shape), list(got.shape)))
        for name, current in own.items():
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name) if module_name else self
            value = tensors[prefix + name].to(current.device)
            if leaf in module._parameters:
                module._parameters[leaf].data = value
            else:
                module._buffers[leaf] = value


def _hc_base_init(C: int) -> torch.Tensor:
    """pre ~ 1/C (sums the streams back to one), post ~ 1, comb near identity."""
    pre = torch.full((C,), math.log(1.0 / max(C - 1, 1)))
    post = torch.zeros(C)
    comb = 2.0 * torch.eye(C).flatten()
    return torch.cat((pre, post, comb)).float()


def _dequantized(t):
    return t.dequantize(torch.bfloat16) if isinstance(t, QuantWeight) else t
