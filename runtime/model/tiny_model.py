"""A tiny V4-shaped target model and its MTP head, built from V4Block (training and demos).

Module attribute names mirror the real checkpoint, so ``state_dict_v4()`` returns the real
DeepSeek-V4 tensor names (``embed.weight``, ``layers.{i}.attn.wq_a.weight``, ``hc_head_fn``,
``mtp.0.e_proj.weight``, ``mtp.0.attn.wq_a.weight``, ...). The MTP owns no embedding or head: it
borrows the target's ``embed.weight`` and ``head.weight``, as in DeepSeek-V4.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from draftgraph.runtime.errors import WeightError, describe
from draftgraph.runtime.model import v4_block_math as vm
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.v4_block_module import RMSNorm, V4Block
from torch import nn

MTP_PREFIX = "mtp.0."


class _HcHead(nn.Module):
    """Holds ``hc_head_fn/base/scale`` and collapses ``[..., C, D] -> [..., D]``."""

    def _init_hc_head(self, config: V4Config) -> None:
        C, D = config.hc_mult, config.hidden_size
        self.hc_head_fn = nn.Parameter(torch.randn(C, C * D) * 0.01)
        self.hc_head_base = nn.Parameter(torch.full((C,), math.log(1.0 / max(C - 1, 1))))  # g ~ 1/C
        self.hc_head_scale = nn.Parameter(torch.full((1,), 0.1))

    def hc_head(self, X: torch.Tensor) -> torch.Tensor:
        c = self.config
        return vm.hc_head(
            X,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            hc_eps=c.hc_eps,
            norm_eps=c.rms_norm_eps,
        )


def _weight(x: nn.Module | torch.Tensor) -> torch.Tensor:
    return x.weight if isinstance(x, nn.Module) else x


def _assign(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace one parameter or buffer by ``value`` (its stored dtype kept)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    current = owner._parameters.get(leaf, owner._buffers.get(leaf))
    if current is None or tuple(current.shape) != tuple(value.shape):
        expected = None if current is None else list(current.shape)
        raise WeightError(describe(name, expected, list(value.shape)))
    value = value.to(current.device)
    if leaf in owner._parameters:
        owner._parameters[leaf].data = value
    else:
        owner._buffers[leaf] = value


def _load_named(
    module: nn.Module, names: dict[str, str], tensors: dict[str, torch.Tensor], scope: str
) -> None:
    """Load ``module`` from ``tensors``; ``names`` maps checkpoint name -> module name.

    Checks everything first (missing, unexpected within ``scope``, shapes) so a bad checkpoint
    changes nothing.
    """
    missing = sorted(n for n in names if n not in tensors)
    unexpected = sorted(n for n in tensors if n.startswith(scope) and n not in names and _in_scope(n, scope))
    if missing or unexpected:
        raise WeightError(
            describe(
                f"checkpoint ({type(module).__name__})",
                "the real V4 tensor names",
                f"missing {missing[:4]} ({len(missing)}), unexpected {unexpected[:4]} ({len(unexpected)})",
                "was it written by benchmarks/train_tiny.py?",
            )
        )
    own = module.state_dict()
    for ckpt_name, own_name in names.items():
        if tuple(tensors[ckpt_name].shape) != tuple(own[own_name].shape):
            raise WeightError(describe(ckpt_name, list(own[own_name].shape), list(tensors[ckpt_name].shape)))
    for ckpt_name, own_name in names.items():
        _assign(module, own_name, tensors[ckpt_name])


def _in_scope(name: str, scope: str) -> bool:
    # The target's scope is everything but the MTP's tensors.
    return not (scope == "" and name.startswith("mtp."))


class TinyV4Target(_HcHead):
    """embed -> hc_expand -> L V4Blocks (the first ``num_hash_layers`` hash-routed) -> hc_head ->
    norm -> head.

    Examples
    --------
    >>> target = TinyV4Target(V4Config.small(vocab_size=264))
    >>> logits, streams = target.forward_seq(torch.randint(0, 256, (2, 8)))  # [B, T, V], [B, T, C, D]
    """

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(
            V4Block(config, hash_routed=i < config.num_hash_layers) for i in range(config.num_hidden_layers)
        )
        self._init_hc_head(config)
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.head = nn.Linear(D, config.vocab_size, bias=False)
        nn.init.normal_(self.head.weight, std=D**-0.5)

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Pre-hc_head streams ``[..., C, D]`` -> fp32 logits ``[..., V]``."""
        return F.linear(self.norm(self.hc_head(X)).float(), self.head.weight.float())

    def forward_seq(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [B, T]`` -> (logits ``[B, T, V]`` fp32, streams ``[B, T, C, D]`` after the last
        block, before hc_head). Activations take the embedding's dtype."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        X = vm.hc_expand(self.embed(tokens), self.config.hc_mult)  # [B, T, C, D]
        for layer in self.layers:
            X = layer.forward_seq(X, positions, token_ids=tokens)
        return self.logits(X), X

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        block_table: torch.Tensor,
        kv_start: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row: ``tokens [B]`` -> (logits ``[B, V]``, streams ``[B, C, D]``).

        ``kv_caches`` holds one ``[num_slots, d]`` latent cache per layer, all paged through the
        same ``block_table``; see :meth:`V4Block.decode`.
        """
        X = vm.hc_expand(self.embed(tokens), self.config.hc_mult)  # [B, C, D]
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            X = layer.decode(X, positions, kv, block_table, kv_start, token_ids=tokens)
        return self.logits(X), X

    def state_dict_v4(self) -> dict[str, torch.Tensor]:
        """Model-level and ``layers.{i}.`` tensors under their real checkpoint names."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def load_v4(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load from real-named tensors (``mtp.*`` entries are ignored). Raises WeightError."""
        _load_named(self, {k: k for k in self.state_dict()}, tensors, scope="")


class TinyV4Mtp(_HcHead):
    """The MTP head in streams mode (spec section 5): combiner, one V4Block, its own hc_head and
    norm; the target's embedding and head are passed in.

    Examples
    --------
    >>> mtp = TinyV4Mtp(config)
    >>> logits = mtp.forward_seq(streams, tokens[:, 1:], target.embed, target.head, torch.arange(T - 1))
    """

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        nn.init.normal_(self.e_proj.weight, std=D**-0.5)
        nn.init.normal_(self.h_proj.weight, std=D**-0.5)
        self.enorm = RMSNorm(D, config.rms_norm_eps)
        self.hnorm = RMSNorm(D, config.rms_norm_eps)
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self._init_hc_head(config)
        self.block = V4Block(config, hash_routed=False)

    def combine(self, streams: torch.Tensor, next_tokens: torch.Tensor, embed) -> torch.Tensor:
        """``Z = h_proj(hnorm(H)) + e_proj(enorm(embed[t]))`` broadcast over the C streams."""
        e = self.enorm(F.embedding(next_tokens, _weight(embed)))  # [..., D]
        h = self.hnorm(streams)  # [..., C, D]: one weight shared by the streams
        Z = (
            F.linear(h.float(), self.h_proj.weight.float())
            + F.linear(e.float(), self.e_proj.weight.float())[..., None, :]
        )
        return Z.to(streams.dtype)

    def logits(self, Z: torch.Tensor, head) -> torch.Tensor:
        return F.linear(self.norm(self.hc_head(Z)).float(), _weight(head).float())

    def forward_seq(
        self, streams: torch.Tensor, next_tokens: torch.Tensor, embed, head, positions: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced MTP over sequences.

        Parameters
        ----------
        streams : ``[B, T, C, D]`` the target's pre-hc_head streams at positions p.
        next_tokens : int ``[B, T]`` the token at p + 1.
        embed, head : the target's ``embed`` / ``head`` (modules or ``[V, D]`` weights).
        positions : int ``[T]`` or ``[B, T]``.

        Returns
        -------
        logits ``[B, T, V]`` fp32, predicting the token at p + 2.
        """
        Z = self.block.forward_seq(self.combine(streams, next_tokens, embed), positions)
        return self.logits(Z, head)

    def decode(
        self,
        streams: torch.Tensor,
        next_tokens: torch.Tensor,
        embed,
        head,
        positions: torch.Tensor,
        kv: torch.Tensor,
        block_table: torch.Tensor,
        kv_start: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (logits ``[B, V]``, the MTP's own streams ``[B, C, D]`` for the next step)."""
        Z = self.block.decode(self.combine(streams, next_tokens, embed), positions, kv, block_table, kv_start)
        return self.logits(Z, head), Z

    def _names(self) -> dict[str, str]:
        """checkpoint name -> module name."""
        out = {}
        for name in self.state_dict():
            out[MTP_PREFIX + name.removeprefix("block.")] = name
        return out

    def state_dict_v4(self) -> dict[str, torch.Tensor]:
        """The ``mtp.0.*`` tensors under their real checkpoint names."""
        own = self.state_dict()
        return {ckpt: own[name].detach().contiguous() for ckpt, name in self._names().items()}

    def load_v4(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the ``mtp.0.*`` tensors. Raises WeightError."""
        _load_named(self, self._names(), tensors, scope=MTP_PREFIX)


def load_tiny_checkpoint(path: str | Path, device: str = "cpu") -> tuple[V4Config, TinyV4Target, TinyV4Mtp]:
    """Read ``config.json`` + ``model.safetensors`` (as written by benchmarks/train_tiny.py)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = V4Config.load(path)
    meta = json.loads((path / "config.json").read_text())
    if meta.get("tokenizer", "byte") != "byte":
        raise WeightError(describe("config.json tokenizer", "'byte'", meta.get("tokenizer")))
    tensors = load_file(str(path / "model.safetensors"), device=device)
    target, mtp = TinyV4Target(config).to(device), TinyV4Mtp(config).to(device)
    target.load_v4(tensors)
    mtp.load_v4(tensors)
    return config, target, mtp
