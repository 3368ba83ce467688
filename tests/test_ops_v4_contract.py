"""The OpDef contract for every V4 op: shape rules, out= writes, declarations."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.ir.op_registry import ShapeRuleError, get_op
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from v4_op_cases import CASES, gen

V4_OPS = sorted(CASES)

DECLARED = {  # name: (output_names, inplace, mutates)
    "embed": (("out",), {}, ()),
    "combiner": (("out",), {}, ()),
    "hc_expand": (("out",), {}, ()),
    "hc_pre": (("y", "post", "comb"), {}, ()),
    "hc_pre_norm": (("y", "post", "comb"), {}, ()),
    "hc_post": (("out",), {0: 1}, ()),
    "hc_head": (("out",), {}, ()),
    "swa_attention": (("out",), {}, (9,)),
    "moe": (("out",), {}, ()),
    "moe_hash": (("out",), {}, ()),
    "lm_head": (("out",), {}, ()),
    "draft_argmax": (("token", "prob"), {}, ()),
    "offset_positions": (("out",), {0: 0}, ()),
    "minimum": (("out",), {0: 0}, ()),
}

EXPECTED_OUT = {  # name: output specs for batch B (small config)
    "embed": ["bf16[B,256]"],
    "combiner": ["bf16[B,4,256]"],
    "hc_expand": ["bf16[B,4,256]"],
    "hc_pre": ["bf16[B,256]", "f32[B,4]", "f32[B,4,4]"],
    "hc_pre_norm": ["bf16[B,256]", "f32[B,4]", "f32[B,4,4]"],
    "hc_post": ["bf16[B,4,256]"],
    "hc_head": ["bf16[B,256]"],
    "swa_attention": ["bf16[B,256]"],
    "moe": ["bf16[B,256]"],
    "moe_hash": ["bf16[B,256]"],
    "lm_head": ["f32[B,1000]"],
    "draft_argmax": ["i64[B]", "f32[B]"],
    "offset_positions": ["i64[B]"],
    "minimum": ["f32[B]"],
}

SYMBOLIC_BATCH = 5  # no weight dim of the small config is 5, so dim 0 == 5 marks a batch dim


def symbolic_specs(name):
    inputs, attrs = CASES[name](gen(0), batch=SYMBOLIC_BATCH)
    specs = []
    for t in inputs:
        shape = tuple(t.shape)
        if shape and shape[0] == SYMBOLIC_BATCH:
            shape = (B, *shape[1:])
        specs.append(TensorSpec(shape, t.dtype))
    return specs, attrs


def test_declarations():
    for name, (outputs, inplace, mutates) in DECLARED.items():
        op = get_op(name)
        assert op.output_names == outputs, name
        assert dict(op.inplace) == inplace, name
        assert tuple(op.mutates) == mutates, name
        assert op.workspace is None, f"{name} declares workspace it does not use"


@pytest.mark.parametrize("name", V4_OPS)
def test_infer_with_symbolic_batch(name):
    specs, attrs = symbolic_specs(name)
    out = get_op(name).infer(specs, attrs)
    assert [s.short() for s in out] == EXPECTED_OUT[name]


def _wrong_dtype(dtype):
    return torch.float64 if dtype.is_floating_point else torch.int16


@pytest.mark.parametrize("name", V4_OPS)
def test_infer_rejects_each_wrong_dtype(name):
    specs, attrs = symbolic_specs(name)
    for i, spec in enumerate(specs):
        bad = list(specs)
        bad[i] = spec.with_dtype(_wrong_dtype(spec.dtype))
        with pytest.raises(ShapeRuleError) as info:
            get_op(name).infer(bad, attrs)
        message = str(info.value)
        assert "expected" in message and f"got {bad[i].short()}" in message, (name, i, message)


# Inputs whose last dim is a free size (the hidden of a pure copy, block-table width, experts per
# token, a vocab that needs no more mask words): growing it is legal, so only their rank is checked.
FREE_LAST_DIM = {("embed", 1), ("hc_expand", 0), ("swa_attention", 12), ("moe_hash", 2), ("draft_argmax", 0)}


def _bad_shapes(name, index, spec):
    yield spec.shape + (2,)  # one dim too many
    if spec.shape and spec.shape[-1] != B and (name, index) not in FREE_LAST_DIM:
        yield spec.shape[:-1] + (spec.shape[-1] + 1,)


@pytest.mark.parametrize("name", V4_OPS)
def test_infer_rejects_each_wrong_shape(name):
    specs, attrs = symbolic_specs(name)
    for i, spec in enumerate(specs):
        for shape in _bad_shapes(name, i, spec):
            bad = list(specs)
            bad[i] = spec.with_shape(*shape)
            with pytest.raises(ShapeRuleError) as info:
                get_op(name).infer(bad, attrs)
            message = str(info.value)
            assert "expected" in message and "got" in message, (name, i, shape, message)


def test_shape_messages_name_the_input():
    specs, attrs = symbolic_specs("swa_attention")
    specs[4] = TensorSpec((128, 255), torch.bfloat16)
    wanted = r"swa_attention wkv: expected bf16\[128,256\], got bf16\[128,255\]"
    with pytest.raises(ShapeRuleError, match=wanted):
        get_op("swa_attention").infer(specs, attrs)
    specs, attrs = symbolic_specs("hc_pre")
    specs[3] = TensorSpec((2,), torch.float32)
    with pytest.raises(ShapeRuleError, match=r"hc_pre scale: expected f32\[3\], got f32\[2\]"):
        get_op("hc_pre").infer(specs, attrs)


@pytest.mark.parametrize("name", V4_OPS)
def test_impl_writes_every_output_in_place(name):
    op = get_op(name)
    inputs, attrs = CASES[name](gen(1))
    specs = op.infer([TensorSpec.of(t) for t in inputs], attrs)
    outputs = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
    for out in outputs:
        out.fill_(float("nan") if out.is_floating_point() else -7)
    pointers = [out.data_ptr() for out in outputs]
    assert op.impl(inputs, outputs, attrs, None) is None
    assert [out.data_ptr() for out in outputs] == pointers
    for out, spec in zip(outputs, specs):
        assert TensorSpec.of(out) == spec
        if out.is_floating_point():
            assert not torch.isnan(out).any(), f"{name} left NaN in an output"
        else:
            assert (out != -7).all(), f"{name} left an output unwritten"


@pytest.mark.parametrize("name", [n for n in V4_OPS if get_op(n).inplace])
def test_inplace_outputs_are_correct_when_aliased(name):
    op = get_op(name)
    inputs, attrs = CASES[name](gen(2))
    specs = op.infer([TensorSpec.of(t) for t in inputs], attrs)
    separate = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
    op.impl([t.clone() for t in inputs], separate, attrs, None)
    aliased_inputs = [t.clone() for t in inputs]
    outputs = list(separate)
    for out_index, in_index in op.inplace.items():
        outputs[out_index] = aliased_inputs[in_index]
    op.impl(aliased_inputs, outputs, attrs, None)
    for a, b in zip(outputs, separate):
        assert torch.equal(a, b), name


def test_a_fused_impl_is_attached_to_the_registered_opdef_itself():
    """``register_fused`` keeps ``ops.<module>.<OP>`` the object ``get_op`` returns: a patch of it
    reaches every device (a copy in the registry once made one miss the CUDA path)."""
    import draftgraph.ops.combiner
    from draftgraph.runtime.ir.op_registry import register_fused

    op = get_op("combiner")
    assert op is draftgraph.ops.combiner.COMBINER
    fused = object()
    try:
        register_fused("combiner", "meta", fused)
        assert get_op("combiner") is draftgraph.ops.combiner.COMBINER
        assert op.select_impl(torch.device("meta")) is fused
        assert op.select_impl(torch.device("cpu")) is op.impl
        assert op.select_impl(torch.device("meta"), use_fused=False) is op.impl
    finally:
        op.fused.pop("meta", None)
