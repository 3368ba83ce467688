"""The draft head as the executor binds it (the seed's ``circuit_draft()``), and its weights.

``prepare_weights`` turns a loaded checkpoint into the tensors the graph names:
the routed experts are stacked once into ``experts.stacked.{w1,w2,w3}`` [E, ...]
and the per-expert names stay as views of the stack (no copy), so an nn.Module
runner that wants ``experts.{e}.w1.weight`` sees the very same bytes.

``weights="native"`` keeps block-scaled weights (QuantWeight: FP8 / MXFP4 data and UE8M0 scales)
as they are, experts stacked as data and scales; ``"bf16"`` dequantises them once, here (what
loading with ``load_checkpoint(weights="bf16")`` gives, value for value: the dequantisation is
exact). Weights that are bf16 stay bf16 either way.

With a ``shard`` (runtime/model/sharding.py) only this rank's part is kept, and only it goes to the
device: its experts (stacked as [E/W, ...], the per-expert names under their global ids), its head
rows, the shared expert on the rank that computes it. The tensors may be the whole checkpoint (cut
here) or a sharded load's (``load_checkpoint(shard=...)``, already cut).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.execution.eager import check_tensor_map
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import FP8_BLOCK, QuantWeight, fp8_scale_shape, quantize_fp8
from draftgraph.runtime.model.sharding import ShardPlan

WEIGHT_MODES = ("native", "bf16")
HEAD_DTYPES = ("bf16", "fp8")
_ONE_EXPERT = re.compile(r"\.experts\.\d+\.")


TENSORS_HINT = "load_checkpoint(path).tensors, or from_checkpoint(path)"


def prepare_weights(
    config: V4Config, tensors: Mapping[str, torch.Tensor | QuantWeight], device: torch.device,
    prefix: str = "mtp.0.", weights: str = "bf16", shard: ShardPlan | None = None, head_dtype: str = "bf16",
) -> dict[str, torch.Tensor | QuantWeight]:
    """Checkpoint tensors -> graph weights on ``device`` (experts stacked, per-expert views kept).

    ``weights``: "bf16" dequantises block-scaled weights, "native" keeps them as stored.
    ``shard``: keep this rank's part only (see the module docstring).
    ``head_dtype``: "fp8" quantises ``head.weight`` (this rank's rows) to FP8 for drafting
    (:func:`quantise_head`); the embedding is its own tensor and stays bf16. Sharded, a rank's
    128-row scale blocks start at its first row, so its scales may differ from the unsharded head's.
    """
    if weights not in WEIGHT_MODES:
        raise InputError(describe("weights", " or ".join(map(repr, WEIGHT_MODES)), repr(weights)))
    if head_dtype not in HEAD_DTYPES:
        raise InputError(describe("head_dtype", " or ".join(map(repr, HEAD_DTYPES)), repr(head_dtype)))
    check_tensor_map("tensors", tensors, "checkpoint names", TENSORS_HINT)
    experts = range(config.n_routed_experts)
    if shard is not None and shard.is_sharded:
        tensors = _shard_of(config, tensors, shard, prefix)
        experts = range(*shard.experts)
    out = {name: t.to(device) for name, t in tensors.items()}
    if weights == "bf16":
        out = {name: t.dequantize(torch.bfloat16) if isinstance(t, QuantWeight) else t for name, t in out.items()}
    if head_dtype == "fp8" and "head.weight" in out:
        out["head.weight"] = quantise_head(out["head.weight"])
    for w in ("w1", "w2", "w3"):
        names = [f"{prefix}ffn.experts.{e}.{w}.weight" for e in experts]
        stacked_name = f"{prefix}ffn.experts.stacked.{w}"
        if stacked_name in out:  # already stacked (e.g. a benchmark made it so): keep views in step
            for e, n in enumerate(names):
                out[n] = out[stacked_name][e]
            continue
        if not all(n in out for n in names):
            continue
        stacked = _stack([out[n] for n in names])  # [E, out, in]
        out[f"{prefix}ffn.experts.stacked.{w}"] = stacked
        for e, n in enumerate(names):
            out[n] = stacked[e]
    return out


def quantise_head(head: torch.Tensor | QuantWeight) -> QuantWeight:
    """The LM head [V, D] as FP8 e4m3 with 128 x 128 UE8M0 block scales (quant.quantize_fp8).

    Done in 128-row blocks (a scale block's rows), so the only temporary is a block's fp32 copy,
    not the whole head's (2 GB at V4-Flash). A head already FP8 is kept.
    """
    if isinstance(head, QuantWeight):
        if head.fmt == "fp8":
            return head
        head = head.dequantize(torch.bfloat16)
    rows, cols = head.shape
    data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=head.device)
    scale = torch.empty(fp8_scale_shape((rows, cols)), dtype=torch.float8_e8m0fnu, device=head.device)
    step = 64 * FP8_BLOCK  # rows quantised at a time: whole scale blocks
    for start in range(0, rows, step):
        q, s = quantize_fp8(head[start : start + step])
        data[start : start + q.shape[0]] = q
        scale[start // FP8_BLOCK : start // FP8_BLOCK + s.shape[0]] = s
    return QuantWeight(data, scale, "fp8")


def _shard_of(config: V4Config, tensors: Mapping, shard: ShardPlan, prefix: str) -> dict:
    """The tensors this rank holds: others' experts (and the shared expert off rank 0) left out, head rows cut."""
    from draftgraph.runtime.errors import WeightError

    stacked = f"{prefix}ffn.experts.stacked."
    out = {}
    for name, t in tensors.items():
        if name.startswith(stacked):  # stacked over every expert: this rank's range of them
            t = t if t.shape[0] == shard.num_local_experts else _rows(t, *shard.experts)
        elif not shard.holds(name, prefix):
            continue
        out[name] = t
    head = out.get("head.weight")
    if head is not None:
        start, stop = shard.vocab_rows
        if head.shape[0] == config.vocab_size:
            out["head.weight"] = head[start:stop].clone()  # a copy: the whole head's bytes are not kept
        elif head.shape[0] != shard.num_local_rows:
            raise WeightError(describe("head.weight rows", f"the vocab ({config.vocab_size}) or this rank's slice "
                                       f"({shard.num_local_rows}: {shard})", head.shape[0]))
    return out


def _rows(t, start: int, stop: int):
    if isinstance(t, QuantWeight):
        data = t.data.view(torch.uint8)[start:stop].clone().view(t.data.dtype)  # float4 has no clone
        return QuantWeight(data, t.scale.view(torch.uint8)[start:stop].clone().view(t.scale.dtype), t.fmt)
    return t[start:stop].clone()


def _stack(parts: list) -> torch.Tensor | QuantWeight:
    kinds = {p.fmt if isinstance(p, QuantWeight) else "tensor" for p in parts}
    if len(kinds) > 1:
        raise InputError(describe("routed experts' formats", "one format for all experts", sorted(kinds),
                                  "write the checkpoint's experts in one format"))
    if not isinstance(parts[0], QuantWeight):
        return torch.stack(parts).contiguous()
    data = torch.stack([p.data.view(torch.uint8) for p in parts]).view(parts[0].dtype)  # float4 has no stack
    return QuantWeight(data, torch.stack([p.scale for p in parts]), parts[0].fmt)


def weight_formats(weights: Mapping[str, torch.Tensor | QuantWeight]) -> tuple[tuple[str, str], ...]:
    """(name, "fp8" | "mxfp4") of the block-scaled graph weights, sorted: graphs.v4_block.Numerics.formats.

    Per-expert views are left out: the graph reads the stacked experts.
    """
    return tuple(sorted((n, t.fmt) for n, t in weights.items()
                        if isinstance(t, QuantWeight) and not _ONE_EXPERT.search(n)))


def weights_nbytes(weights: Mapping[str, torch.Tensor | QuantWeight]) -> int:
    """Device bytes of prepared weights, each storage once (per-expert views share the stack's)."""
    seen, total = set(), 0
    for t in weights.values():
        for part in ((t.data, t.scale) if isinstance(t, QuantWeight) else (t,)):
            key = (part.untyped_storage().data_ptr(), part.device)
            if key not in seen:
                seen.add(key)
                total += part.untyped_storage().nbytes()
    return total


@dataclass(frozen=True)
class DraftBinding:
    """What ``circuit_draft()`` returns: the draft head as the executor binds it.

    Attributes
    ----------
    graph : the K-draft chain as declared (the body one ``body`` node: its subgraph, or its runner);
        the executors run it after ``runtime.passes``.
    weights : name -> tensor, every ``@name`` of the graph.
    body_inputs : the body's interface, in order (streams, positions, kv_start, block_table).
    body_output : streams [B, C, D].
    runner : the bound body runner's name ("builtin" for the op subgraph).
    workspace_bytes : the body runner's declared scratch at the largest bucket.
    arena_bytes : the passed chain's planned arena at the largest bucket.
    """

    graph: Graph
    weights: Mapping[str, torch.Tensor]
    body_inputs: Mapping[str, TensorSpec]
    body_output: TensorSpec
    runner: str
    workspace_bytes: int
    arena_bytes: int
