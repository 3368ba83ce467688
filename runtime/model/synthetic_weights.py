"""Deterministic random DeepSeek-V4 weights with realistic scales, for tests and the demo model.

Scales are chosen so every stage stays O(1) on unit-RMS inputs: linears ~ N(0, 1/fan_in)
variance (outputs keep the input's RMS), the mHC ``fn`` rows ~ N(0, 1/(C*D)) so that
``(x @ fn^T) * rho`` (rho normalises x to unit RMS over C*D) is ~ N(0, 1) and the sigmoid /
Sinkhorn arguments are O(1), norm weights near 1, mHC scales in [0.5, 1.5].

A private ``torch.Generator`` drives everything: the global RNG state is never touched.
"""

from __future__ import annotations

import math

import torch
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.weight_names import MTP_TENSOR_NAMES, TARGET_TENSOR_NAMES, TensorEntry

_TID2EID_CHUNK = 8192  # rows per draw, so a full-vocab table never needs a [V, E] float block


def random_mtp_weights(
    config: V4Config, seed: int = 0, include_target_layers: bool = False
) -> dict[str, torch.Tensor]:
    """Random weights for the MTP draft step (and optionally the whole small target).

    Parameters
    ----------
    config : the model config; sizes come from it.
    seed : same seed, same config -> bit-identical tensors.
    include_target_layers : also make :func:`TARGET_TENSOR_NAMES` (final norm, hc_head,
        ``layers.{i}.*``), for the decode loop's target model.

    Returns
    -------
    name -> tensor: bf16 (linears, norms, embed, head), fp32 (``hc_*``, ``attn_sink``, gate
    bias) and int32 (``tid2eid``: distinct valid expert ids per row), in entry order.

    Example
    -------
    >>> w = random_mtp_weights(V4Config.small(), seed=1)
    >>> w["mtp.0.hc_attn_fn"].dtype, w["embed.weight"].shape
    (torch.float32, torch.Size([1000, 256]))
    """
    entries = list(MTP_TENSOR_NAMES(config))
    if include_target_layers:
        seen = {e.name for e in entries}
        entries += [e for e in TARGET_TENSOR_NAMES(config) if e.name not in seen]
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return {entry.name: _init(entry, config, gen) for entry in entries}


def _init(entry: TensorEntry, config: V4Config, gen: torch.Generator) -> torch.Tensor:
    name, shape = entry.name, entry.shape
    leaf = name.rsplit(".", 1)[-1] if "." in name else name
    if leaf == "tid2eid":
        return _tid2eid(shape, config.n_routed_experts, gen)
    if "hc_" in name and name.endswith("_fn"):
        std = 1.0 / math.sqrt(config.hc_mult * config.hidden_size)
        return torch.randn(shape, generator=gen) * std
    if "hc_" in name and name.endswith("_base"):
        return torch.randn(shape, generator=gen) * 0.5
    if "hc_" in name and name.endswith("_scale"):
        return torch.rand(shape, generator=gen) + 0.5
    if name.endswith("attn_sink"):
        return torch.randn(shape, generator=gen)
    if name.endswith("gate.bias"):
        return torch.randn(shape, generator=gen) * 0.01
    if name.endswith("norm.weight"):
        return (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    if name == "embed.weight":
        return torch.randn(shape, generator=gen).to(torch.bfloat16)
    if len(shape) == 2:  # every linear (and the LM head): unit-RMS in, unit-RMS out
        return (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(torch.bfloat16)
    raise AssertionError(f"no initialiser for {entry}")  # a new entry kind needs a rule here


def _tid2eid(shape: tuple[int, ...], num_experts: int, gen: torch.Generator) -> torch.Tensor:
    rows, k = shape
    out = torch.empty(shape, dtype=torch.int32)
    for start in range(0, rows, _TID2EID_CHUNK):
        stop = min(rows, start + _TID2EID_CHUNK)
        # The top-k of i.i.d. uniforms is a uniformly random k-subset: distinct ids per row.
        keys = torch.rand(stop - start, num_experts, generator=gen)
        out[start:stop] = keys.topk(k, dim=1).indices.to(torch.int32)
    return out
