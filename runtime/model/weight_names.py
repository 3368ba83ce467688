"""The checkpoint tensors of DeepSeek-V4: names, logical shapes and storage kinds.

One list is the single source of truth for the loader, the writer and the random-weight maker.
A :class:`TensorEntry` names a *logical* tensor (what the runtime sees after loading); its
``kind`` says how the real checkpoint stores it:

=========  ==========================================  ======================
kind       real storage                                 loaded as
=========  ==========================================  ======================
``bf16``   BF16                                         bf16 (or the dtype asked)
``fp32``   F32                                          fp32
``int32``  I32                                          int32
``fp8``    F8_E4M3 + ``<base>.scale`` F8_E8M0 128x128   bf16, dequantised
``mxfp4``  I8 e2m1 pairs + ``<base>.scale`` 1x32        bf16, dequantised
=========  ==========================================  ======================

``checkpoint_layout`` expands entries into the stored tensors of one format; for V4-Flash the
real (``mxfp4``) layout has 1,575 tensors under ``mtp.0.`` (797 logical ones plus 778 scales).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from draftgraph.runtime.errors import WeightError, describe
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import fp8_scale_shape, mxfp4_shapes

KINDS = ("bf16", "fp32", "int32", "fp8", "mxfp4")
FORMATS = ("bf16", "fp8", "mxfp4")
QUANTISED_KINDS = ("fp8", "mxfp4")
MTP_PREFIX = "mtp.0."

# Which linear weights the real checkpoint quantises; matched on the name so that the writer
# classifies any tensor dict (MTP, target layers) the same way the name lists do.
_FP8_LINEAR = re.compile(
    r"(^|\.)(e_proj|h_proj|attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight$"
)
_MXFP4_LINEAR = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")


class TensorEntry(NamedTuple):
    """One logical checkpoint tensor: ``(name, shape, kind)``."""

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the loader returns (bf16 for the quantised kinds, by default)."""
        return {"fp32": torch.float32, "int32": torch.int32}.get(self.kind, torch.bfloat16)


class StoredEntry(NamedTuple):
    """One tensor as a safetensors file holds it: ``(name, shape, dtype)``, dtype as spelt there."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def linear_kind(name: str) -> str | None:
    """``"fp8"`` / ``"mxfp4"`` for a weight the real checkpoint quantises, else None."""
    if _MXFP4_LINEAR.search(name):
        return "mxfp4"
    if _FP8_LINEAR.search(name):
        return "fp8"
    return None


def scale_name(name: str) -> str:
    """``mtp.0.attn.wkv.weight`` -> ``mtp.0.attn.wkv.scale`` (DeepSeek's naming, not ``weight_scale``)."""
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def block_entries(prefix: str, config: V4Config, *, hash_routed: bool) -> list[TensorEntry]:
    """The tensors of one V4 block (attention, MoE, both mHC halves) under ``prefix``.

    Hash-routed blocks (target layers below ``num_hash_layers``) carry ``ffn.gate.tid2eid``
    [V, k] int32 instead of ``ffn.gate.bias``.
    """
    c = config
    D, H, d, C = c.hidden_size, c.num_attention_heads, c.head_dim, c.hc_mult
    E, inter, mix = c.n_routed_experts, c.moe_intermediate_size, c.hc_mix_dim
    rows: list[tuple[str, tuple[int, ...], str]] = [
        ("attn.wq_a.weight", (c.q_lora_rank, D), "bf16"),
        ("attn.q_norm.weight", (c.q_lora_rank,), "bf16"),
        ("attn.wq_b.weight", (H * d, c.q_lora_rank), "bf16"),
        ("attn.wkv.weight", (d, D), "bf16"),
        ("attn.kv_norm.weight", (d,), "bf16"),
        # Stored flat; the attention op views it as [o_groups, o_lora, H*d/o_groups].
        ("attn.wo_a.weight", (c.o_groups * c.o_lora_rank, H * d // c.o_groups), "bf16"),
        ("attn.wo_b.weight", (D, c.o_groups * c.o_lora_rank), "bf16"),
        ("attn.attn_sink", (H,), "fp32"),
        ("attn_norm.weight", (D,), "bf16"),
        ("ffn_norm.weight", (D,), "bf16"),
    ]
    for half in ("attn", "ffn"):
        rows += [
            (f"hc_{half}_fn", (mix, C * D), "fp32"),
            (f"hc_{half}_base", (mix,), "fp32"),
            (f"hc_{half}_scale", (3,), "fp32"),
        ]
    rows.append(("ffn.gate.weight", (E, D), "bf16"))
    if hash_routed:
        rows.append(("ffn.gate.tid2eid", (c.vocab_size, c.num_experts_per_tok), "int32"))
    else:
        rows.append(("ffn.gate.bias", (E,), "fp32"))
    for e in range(E):
        rows += [
            (f"ffn.experts.{e}.w1.weight", (inter, D), "bf16"),
            (f"ffn.experts.{e}.w2.weight", (D, inter), "bf16"),
            (f"ffn.experts.{e}.w3.weight", (inter, D), "bf16"),
        ]
    shared = inter * c.n_shared_experts
    rows += [
        ("ffn.shared_experts.w1.weight", (shared, D), "bf16"),
        ("ffn.shared_experts.w2.weight", (D, shared), "bf16"),
        ("ffn.shared_experts.w3.weight", (shared, D), "bf16"),
    ]
    return [_entry(prefix + name, shape, kind) for name, shape, kind in rows]


def MTP_TENSOR_NAMES(config: V4Config) -> list[TensorEntry]:  # noqa: N802 - a constant-like table
    """Every tensor the MTP draft step reads: the target's embed/head and all of ``mtp.0.``.

    Names only: nothing is allocated, so ``MTP_TENSOR_NAMES(V4Config.flash())`` is cheap.

    Example
    -------
    >>> entries = MTP_TENSOR_NAMES(V4Config.small())
    >>> entries[0]
    TensorEntry(name='embed.weight', shape=(1000, 256), kind='bf16')
    """
    D, C, V = config.hidden_size, config.hc_mult, config.vocab_size
    p = MTP_PREFIX
    head = [
        _entry("embed.weight", (V, D), "bf16"),
        _entry("head.weight", (V, D), "bf16"),
        _entry(p + "e_proj.weight", (D, D), "bf16"),
        _entry(p + "h_proj.weight", (D, D), "bf16"),
        _entry(p + "enorm.weight", (D,), "bf16"),
        _entry(p + "hnorm.weight", (D,), "bf16"),
        _entry(p + "norm.weight", (D,), "bf16"),
        _entry(p + "hc_head_fn", (C, C * D), "fp32"),
        _entry(p + "hc_head_base", (C,), "fp32"),
        _entry(p + "hc_head_scale", (1,), "fp32"),
    ]
    return head + block_entries(p, config, hash_routed=False)


def TARGET_TENSOR_NAMES(config: V4Config) -> list[TensorEntry]:  # noqa: N802 - a constant-like table
    """The target model's tensors: embed, head, final norm, hc_head and ``layers.{i}.`` blocks.

    Only sliding-window layers are described (compress ratio 0); a config whose target layers
    use compressed attention raises :class:`WeightError`, since their compressor/indexer
    tensors are not part of this runtime.
    """
    ratios = config.compress_ratios
    compressed = [i for i in range(config.num_hidden_layers) if i < len(ratios) and ratios[i]]
    if compressed:
        raise WeightError(
            describe(
                "target layers",
                "compress_ratios 0 (sliding-window attention only)",
                f"compressed attention in layers {compressed[:8]}{'...' if len(compressed) > 8 else ''}",
                "the small target model is V4-shaped without the compressor; use V4Config.small()",
            )
        )
    D, C, V = config.hidden_size, config.hc_mult, config.vocab_size
    entries = [
        _entry("embed.weight", (V, D), "bf16"),
        _entry("head.weight", (V, D), "bf16"),
        _entry("norm.weight", (D,), "bf16"),
        _entry("hc_head_fn", (C, C * D), "fp32"),
        _entry("hc_head_base", (C,), "fp32"),
        _entry("hc_head_scale", (1,), "fp32"),
    ]
    for i in range(config.num_hidden_layers):
        entries += block_entries(f"layers.{i}.", config, hash_routed=i < config.num_hash_layers)
    return entries


def checkpoint_layout(entries: list[TensorEntry], fmt: str = "mxfp4") -> list[StoredEntry]:
    """The stored tensors (with ``.scale`` companions) of ``entries`` written in format ``fmt``.

    ``fmt="mxfp4"`` is the real DeepSeek-V4 layout: routed experts MXFP4, other linears FP8.
    ``fmt="fp8"`` puts routed experts in FP8 too; ``fmt="bf16"`` quantises nothing.
    """
    check_format(fmt)
    stored: list[StoredEntry] = []
    for entry in entries:
        kind = stored_kind(entry.kind, fmt)
        if kind == "fp8":
            stored.append(StoredEntry(entry.name, entry.shape, "F8_E4M3"))
            stored.append(StoredEntry(scale_name(entry.name), fp8_scale_shape(entry.shape), "F8_E8M0"))
        elif kind == "mxfp4":
            packed, scales = mxfp4_shapes(entry.shape)
            stored.append(StoredEntry(entry.name, packed, "I8"))
            stored.append(StoredEntry(scale_name(entry.name), scales, "F8_E8M0"))
        else:
            stored.append(
                StoredEntry(entry.name, entry.shape, {"fp32": "F32", "int32": "I32"}.get(kind, "BF16"))
            )
    return stored


def stored_kind(kind: str, fmt: str) -> str:
    """How a tensor of logical ``kind`` is written in checkpoint format ``fmt``."""
    if kind not in QUANTISED_KINDS or fmt == "bf16":
        return "bf16" if kind in QUANTISED_KINDS else kind
    return "mxfp4" if (kind == "mxfp4" and fmt == "mxfp4") else "fp8"


def scope_of(name: str) -> str:
    """The prefix a strict load checks for unexpected tensors: ``mtp.0.``, ``layers.3.`` or ''."""
    match = re.match(r"^(mtp|layers)\.\d+\.", name)
    return match.group(0) if match else ""


def _entry(name: str, shape: tuple[int, ...], kind: str) -> TensorEntry:
    return TensorEntry(name, tuple(shape), linear_kind(name) or kind)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise WeightError(describe("checkpoint format", " | ".join(FORMATS), repr(fmt)))
