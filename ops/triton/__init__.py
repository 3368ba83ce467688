"""Fused Triton implementations of the hot draft-step ops, selected at bind time on CUDA.

``register_all()`` attaches each one with ``register_fused(op, "cuda", impl)``; the torch
op stays the reference and the CPU path, and every fused impl falls back to it for
inputs it does not cover (odd dtypes or strides, batch over moe's MAX_BATCH). Importing
this package needs no triton; ``register_all()`` registers nothing when triton is
missing and returns the names it registered.

Kernels (docs/KERNELS.md has the byte counts and where they stand; benchmarks/h200/KERNEL_RUNS.md every run):

========================  =========================================================
op                        module
========================  =========================================================
lm_head, draft_argmax     draftgraph.ops.triton.head   (norm + GEMV; two-stage argmax + prob)
moe, moe_hash,            draftgraph.ops.triton.moe    (gate split-K, w1/w3 + SwiGLU, w2;
moe_shard                                    batch > 1: draftgraph.ops.triton.moe_grouped;
                                             moe_shard: this rank's experts, the others' pairs skipped)
hc_pre, hc_pre_norm,      draftgraph.ops.triton.mhc    (split mix + Sinkhorn finish, hc_pre_norm's
hc_head, hc_post                             normed in it; post)
swa_attention             draftgraph.ops.triton.attention
linear, rms_norm          draftgraph.ops.triton.gemv
combiner, embed_combiner  draftgraph.ops.triton.combiner (FP8: both norms, one GEMV over both Ks;
                                             embed_combiner: e's rows read from the table)
draft_gate, cut_drafts    draftgraph.ops.triton.gate   (one program each: a few dozen ints)
drop_nonfinite,           draftgraph.ops.triton.nonfinite (the batch's hiddens checked in wide
mark_dropped                                 tiles: one program, from 4 rows a program a tile and
                                             a merge; one program marks the drafts)
========================  =========================================================

Native weights (FP8 / MXFP4 QuantWeights, issue 28.2): linear, combiner and swa_attention run
``fp8_linear.fp8_gemv`` on FP8 weights, moe, moe_hash and moe_shard ``moe_mxfp4`` on MXFP4 routed
experts with an FP8 shared expert (B > 1 expert-major on the tensor cores: ``moe_mxfp4_mma``);
each such impl carries ``unsupported_block_scaled(specs)`` (why its
kernels cannot read a node's block-scaled inputs, or None), which
``runtime/execution/kernel_choice.select_impl`` asks before binding it to a node that reads one.

Scratch: each impl takes its scratch from ``workspace`` when the op declares one large
enough, else allocates it (as the torch references allocate their temporaries).
``workspace_rules()`` gives the byte rules (the MXFP4 MoE's included), should the OpDefs declare them.
"""

from __future__ import annotations


def _impls() -> dict:
    from draftgraph.ops.triton import attention, combiner, gate, gemv, head, mhc, moe, nonfinite

    return {
        "draft_gate": gate.draft_gate_impl,
        "cut_drafts": gate.cut_drafts_impl,
        "drop_nonfinite": nonfinite.drop_nonfinite_impl,
        "mark_dropped": nonfinite.mark_dropped_impl,
        "lm_head": head.lm_head_impl,
        "draft_argmax": head.draft_argmax_impl,
        "moe": moe.moe_impl,
        "moe_hash": moe.moe_hash_impl,
        "moe_shard": moe.moe_shard_impl,
        "hc_pre": mhc.hc_pre_impl,
        "hc_pre_norm": mhc.hc_pre_norm_impl,
        "hc_head": mhc.hc_head_impl,
        "hc_post": mhc.hc_post_impl,
        "swa_attention": attention.swa_attention_impl,
        "linear": gemv.linear_impl,
        "combiner": combiner.combiner_impl,
        "embed_combiner": combiner.embed_combiner_impl,
        "rms_norm": gemv.rms_norm_impl,
    }


def fused_impls() -> dict:
    """op name -> the fused impl ``register_all`` registers for it (for inspection off CUDA too)."""
    return _impls()


def available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def register_all(ops: list[str] | None = None) -> list[str]:
    """Register the fused CUDA impls (all, or the named ``ops``); returns the names registered."""
    if not available():
        return []
    from draftgraph.runtime.ir.op_registry import register_fused

    impls = _impls()
    names = list(impls) if ops is None else list(ops)
    for name in names:
        register_fused(name, "cuda", impls[name])
    return names


def workspace_rules() -> dict:
    """op name -> ``rule(specs, attrs, batch) -> bytes`` of the scratch each fused impl uses."""
    from draftgraph.ops.triton import attention, combiner, head, mhc, moe, nonfinite

    return {
        "drop_nonfinite": nonfinite.drop_nonfinite_workspace,
        "combiner": combiner.combiner_workspace,
        "embed_combiner": combiner.embed_combiner_workspace,
        "lm_head": head.lm_head_workspace,
        "draft_argmax": head.draft_argmax_workspace,
        "moe": moe.moe_workspace,
        "moe_hash": moe.moe_workspace,
        "moe_shard": moe.moe_shard_workspace,
        "hc_pre": mhc.hc_mix_workspace,
        "hc_pre_norm": mhc.hc_mix_workspace,
        "hc_head": mhc.hc_mix_workspace,
        "swa_attention": attention.attention_workspace,
    }
