"""The e2m1 decode's PTX, run on the CPU by a model of its few instructions.

``moe_mxfp4`` decodes MXFP4 codes on the GPU with inline PTX (the interpreter runs none, so the
CPU tests of the kernels take its arithmetic twin). Here the PTX text itself is executed,
instruction by instruction, by a model of the six instructions it uses (PTX ISA semantics:
``prmt`` default mode, ``fma.rn.bf16x2`` round to nearest even), for every byte value and
the scale bytes at the edges. The cuda tests run the same text on the device.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from draftgraph.ops.triton import moe_mxfp4 as MX  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MASK = 0xFFFFFFFF


def e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def bf16_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def bf16_value(bits: int) -> float:
    return float(torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item())


def prmt(a: int, b: int, sel: int) -> int:
    pool = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        nib = sel >> (4 * i) & 0xF
        byte = pool[nib & 7]
        if nib & 8:  # replicate the selected byte's sign bit
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def fma_bf16x2(a: int, b: int, c: int) -> int:
    halves = []
    for shift in (0, 16):
        x, y, z = (torch.tensor(bf16_value(v >> shift), dtype=torch.float32) for v in (a, b, c))
        halves.append(bf16_bits(float(x * y + z)))  # the product exact in fp32 here (or inf), then RNE
    return halves[0] | halves[1] << 16


def run_ptx(text: str, operands: dict[str, int]) -> dict[str, int]:
    """Execute ``text`` with ``$n`` operands given (inputs) or returned (outputs)."""
    regs = dict(operands)

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 16) if tok.lower().startswith("0x") else int(tok)

    for line in text.strip().splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [t.strip() for t in args.split(",")]
        v = [val(t) for t in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "prmt.b32":
            r = prmt(v[0], v[1], v[2])
        elif op == "mul.lo.u32":
            r = v[0] * v[1]
        elif op == "fma.rn.bf16x2":
            r = fma_bf16x2(v[0], v[1], v[2])
        else:
            raise AssertionError(f"an instruction the model does not know: {op}")
        regs[dst] = r & MASK
    return regs


def word_decode(rebiased: bool) -> str:
    """moe_mxfp4_mma's PTX up to its two mma.sync (which the model does not run): the decode of row
    g's word ($4) and row g + 8's ($5) into the A fragments a0..a3 / b0..b3, times the scales $6 / $7."""
    from draftgraph.ops.triton import moe_mxfp4_mma as MMA

    text, mma = (MMA.MMA_WORD_REBIASED_PTX if rebiased else MMA.MMA_WORD_PTX).value.split("mma.sync", 1)
    assert mma.count("mma.sync") == 1
    return text


def test_the_model_knows_every_instruction_of_the_ptx():
    texts = (MX.E2M1_HALVES_PTX.value, word_decode(False), word_decode(True))
    ops = {line.split()[0] for text in texts for line in text.strip().splitlines() if re.match(r"\s*[a-z]", line)}
    # fma.rn.bf16x2, not mul.rn.bf16x2: the mul needs sm_90, the fma sm_80 (compile_kernels.py --arch 80)
    assert ops == {"mov.b32", "and.b32", "shr.u32", "prmt.b32", "mul.lo.u32", "fma.rn.bf16x2"}


@pytest.mark.parametrize("rebiased", [False, True])
def test_word_decode_gives_each_pair_of_codes_as_bf16x2_in_column_order(rebiased):
    """Every byte value at every place of a word, scale 1 (rebiased: 2^126, the 2^126 in the scale)."""
    one = 0x7E80 if rebiased else bf16_bits(1.0)
    text = word_decode(rebiased)
    g = torch.Generator().manual_seed(7)
    for byte in range(256):
        for pos in range(4):
            word = int(torch.randint(0, 2**32, (1,), generator=g, dtype=torch.int64).item())
            word = word & ~(0xFF << 8 * pos) | byte << 8 * pos
            regs = run_ptx(text, {"$4": word, "$5": word, "$6": one * 0x10001, "$7": one * 0x10001})
            for j in range(4):
                b = word >> 8 * j & 0xFF
                expected = bf16_bits(e2m1(b & 15)) | bf16_bits(e2m1(b >> 4)) << 16
                assert regs[f"a{j}"] == regs[f"b{j}"] == expected, (hex(word), j, hex(regs[f"a{j}"]), hex(expected))


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 127, 128, 200, 254, 255])
def test_halves_ptx_gives_even_and_odd_codes_times_the_scale(scale_byte):
    scale = 2.0 ** (scale_byte - 127) if scale_byte < 255 else float("nan")
    s_bits = bf16_bits(scale) if scale_byte else 0x0040  # 2^-127: a bf16 subnormal
    assert scale_byte == 255 or bf16_value(s_bits) == scale
    for word in (0x76543210, 0xFEDCBA98, 0x0F1E2D3C, 0x80808080, 0x08F7E6D5):
        regs = run_ptx(MX.E2M1_HALVES_PTX.value, {"$4": word, "$5": s_bits * 0x10001, "$6": s_bits * 0x10001})
        got = [bf16_value(regs[f"${r}"] >> h) for r in range(4) for h in (0, 16)]
        codes = [word >> 8 * j & 0xFF for j in range(4)]
        # As fp32 does it (the arithmetic twin): 4 * 2^127 overflows to inf.
        want = [e2m1(c & 15) for c in codes] + [e2m1(c >> 4) for c in codes]
        want = (torch.tensor(want, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)).tolist()
        for gv, wv in zip(got, want):
            assert (gv == wv) or (gv != gv and wv != wv), (hex(word), scale_byte, got, want)


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 127, 128, 200, 254, 255])
def test_mma_word_ptx_decodes_both_rows_times_their_scales_into_the_a_fragments(scale_byte):
    """moe_mxfp4_mma's PTX up to its two mma.sync: row g's word ($4) and row g + 8's ($5), each
    as its 4 bf16x2 pairs in column order times its block scale ($6 / $7, bf16 in both halves)."""
    text = word_decode(False)
    scale = 2.0 ** (scale_byte - 127) if scale_byte < 255 else float("nan")
    s_bits = bf16_bits(scale) if scale_byte else 0x0040  # as _scale_pair: 2^-127 a bf16 subnormal
    other = bf16_bits(0.5)  # row g + 8's scale, another value: the two rows' scales kept apart
    for word in (0x76543210, 0xFEDCBA98, 0x0F1E2D3C, 0x80808080, 0x08F7E6D5):
        regs = run_ptx(text, {"$4": word, "$5": word ^ 0x88888888, "$6": s_bits * 0x10001, "$7": other * 0x10001})
        for reg, w, s in (("a", word, scale), ("b", word ^ 0x88888888, 0.5)):
            got = [bf16_value(regs[f"{reg}{j}"] >> h) for j in range(4) for h in (0, 16)]
            want = [e2m1(w >> 8 * j + 4 * h & 15) for j in range(4) for h in (0, 1)]  # column order
            want = (torch.tensor(want, dtype=torch.float32) * torch.tensor(s, dtype=torch.float32)).tolist()
            for gv, wv in zip(got, want):
                assert (gv == wv) or (gv != gv and wv != wv), (hex(w), scale_byte, reg, got, want)
