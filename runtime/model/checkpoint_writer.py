"""Writing DeepSeek-V4 checkpoints in the real layouts: bf16, FP8 (128x128) and MXFP4 experts.

The writer produces exactly what :func:`draftgraph.runtime.model.weights.load_checkpoint` reads (and what the
published checkpoint holds): ``config.json``, ``model.safetensors`` or numbered shards with
``model.safetensors.index.json``, quantised weights beside ``<base>.scale`` UE8M0 tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from draftgraph.runtime.errors import WeightError, describe
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import quantize_fp8, quantize_mxfp4
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.model.weight_names import check_format, linear_kind, scale_name, stored_kind
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# The quantisation_config the writer records (DeepSeek's keys; the loader itself decides the
# format of each tensor from its stored dtype, so it never depends on this block).
_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}


def write_checkpoint(
    directory: str | Path,
    config: V4Config,
    tensors: dict[str, torch.Tensor],
    *,
    fmt: str = "bf16",
    shards: int = 1,
) -> list[Path]:
    """Write ``config.json`` and the tensors in a DeepSeek-V4 checkpoint format.

    Parameters
    ----------
    directory : created if absent; must not already hold safetensors files.
    tensors : logical tensors (bf16 linears / norms, fp32 ``hc_*`` etc., int32 ``tid2eid``).
    fmt : ``"bf16"`` (nothing quantised), ``"fp8"`` (every quantisable linear in FP8 e4m3 with
        128x128 UE8M0 scales) or ``"mxfp4"`` (the real layout: routed experts MXFP4 with 1x32
        scales, the other linears FP8).
    shards : 1 writes ``model.safetensors``; more writes ``model-0000i-of-0000N.safetensors``
        and ``model.safetensors.index.json``. A weight and its scale share a shard.

    Returns
    -------
    The safetensors files written.
    """
    directory = Path(directory)
    check_format(fmt)
    if shards < 1:
        raise WeightError(describe("shards", "an int >= 1", shards))
    directory.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in directory.glob("*.safetensors")) + (
        [INDEX_FILE] if (directory / INDEX_FILE).exists() else []
    )
    if stale:
        raise WeightError(
            describe(
                f"checkpoint folder {directory}",
                "no safetensors files yet",
                stale,
                "write into an empty folder; the loader would mix old and new files",
            )
        )
    units = [_stored_unit(name, t, fmt) for name, t in tensors.items()]
    if shards > max(len(units), 1):
        raise WeightError(describe("shards", f"at most the number of tensors ({len(units)})", shards))
    quant = dict(_QUANT_CONFIG) if fmt != "bf16" else None
    if fmt == "mxfp4":
        quant["expert_dtype"] = "mxfp4"  # routed experts: e2m1 pairs with 1x32 UE8M0 scales
    config.replace(quantization_config=quant).save(directory / "config.json")
    groups = _split(units, shards)
    if shards == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map, total = {}, 0
    for file_name, group in zip(names, groups):
        payload = {k: v.contiguous().cpu() for unit in group for k, v in unit.items()}
        save_file(payload, str(directory / file_name), metadata={"format": "pt"})
        for k, v in payload.items():
            weight_map[k] = file_name
            total += v.numel() * v.element_size()
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [directory / n for n in names]


def _stored_unit(name: str, tensor: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """A logical tensor as stored in ``fmt``: itself, or its quantised form and scale."""
    kind = linear_kind(name)
    if kind is None:
        if tensor.dtype in (torch.float32, torch.int32):
            return {name: tensor}
        return {name: tensor.to(torch.bfloat16)}
    written = stored_kind(kind, fmt)
    if written == "fp8":
        q, scale = quantize_fp8(tensor)
    elif written == "mxfp4":
        q, scale = quantize_mxfp4(tensor)
    else:
        return {name: tensor.to(torch.bfloat16)}
    return {name: q, scale_name(name): scale}


def _split(units: list[dict[str, torch.Tensor]], shards: int) -> list[list[dict[str, torch.Tensor]]]:
    """Consecutive groups of roughly equal bytes, none empty."""
    sizes = [sum(t.numel() * t.element_size() for t in u.values()) for u in units]
    total = sum(sizes)
    groups: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(shards)]
    shard, running = 0, 0
    for i, (unit, size) in enumerate(zip(units, sizes)):
        remaining_units, remaining_shards = len(units) - i, shards - shard
        # Move on when this shard has its share, but keep one unit for every later shard.
        if (
            groups[shard]
            and shard < shards - 1
            and (running >= total * (shard + 1) / shards or remaining_units <= remaining_shards - 1)
        ):
            shard += 1
        groups[shard].append(unit)
        running += size
    return groups


def make_synthetic_checkpoint(
    directory: str | Path,
    config: V4Config,
    fmt: str = "bf16",
    seed: int = 0,
    shards: int = 1,
    *,
    include_target_layers: bool = False,
) -> dict[str, torch.Tensor]:
    """Write :func:`random_mtp_weights` as a checkpoint; returns the (unquantised) weights.

    Example
    -------
    >>> weights = make_synthetic_checkpoint(tmp, V4Config.small(), fmt="mxfp4")
    >>> load_checkpoint(tmp).source["mtp.0.ffn.experts.0.w1.weight"]
    'mxfp4'
    """
    weights = random_mtp_weights(config, seed=seed, include_target_layers=include_target_layers)
    write_checkpoint(directory, config, weights, fmt=fmt, shards=shards)
    return weights
