"""benchmarks/bench_mxfp4_gemv.py on the CPU: every variant under Triton's interpreter against the
torch reference, and the GPU-only inline PTX (the fp16 decode, the mma.sync tiles) run line by
line on a model of its instructions (PTX ISA semantics; mma.sync with the m16n8k16 fragment
layout of the ISA, executed for a whole warp in lockstep)."""

from __future__ import annotations

import os
import re
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import bench_mxfp4_gemv as B  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MASK = 0xFFFFFFFF


def e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def bf16_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def bf16_value(bits: int) -> float:
    return float(torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item())


def f16_value(bits: int) -> float:
    return float(struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0])


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
        halves.append(bf16_bits(float(x * y + z)))  # the product exact in fp32 here, then RNE
    return halves[0] | halves[1] << 16


def _operands(text: str) -> list[str]:
    """'d, {a, b}, c' -> ['d', '{a, b}', 'c']."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    return out + [cur.strip()]


def _regs(tok: str) -> list[str]:
    return [r.strip() for r in tok.strip("{}").split(",")]


def mma_m16n8k16(lanes: list[dict], d: list[str], a: list[str], b: list[str], c: list[str]) -> None:
    """D = A B + C for a warp (bf16 in, fp32 accumulate), fragments as the PTX ISA lays them out."""
    A = [[0.0] * 16 for _ in range(16)]
    Bm = [[0.0] * 8 for _ in range(16)]
    C = [[0.0] * 8 for _ in range(16)]
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, name in enumerate(a):
            v = regs[name]
            for h in range(2):
                A[g + 8 * (r % 2)][2 * (t + 4 * (r // 2)) + h] = bf16_value(v >> 16 * h)
        for r, name in enumerate(b):
            v = regs[name]
            for h in range(2):
                Bm[2 * (t + 4 * r) + h][g] = bf16_value(v >> 16 * h)
        for r, name in enumerate(c):
            C[g + 8 * (r // 2)][2 * t + r % 2] = regs[name]
    D = [[C[m][n] + sum(A[m][k] * Bm[k][n] for k in range(16)) for n in range(8)] for m in range(16)]
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, name in enumerate(d):
            regs[name] = D[g + 8 * (r // 2)][2 * t + r % 2]


def run_ptx(text: str, lanes: list[dict]) -> list[dict]:
    """Execute ``text`` on each lane's registers (``$n`` inputs given), the lanes in lockstep."""
    for line in text.strip().splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        ops = _operands(args)
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"):
            mma_m16n8k16(lanes, *(_regs(o) for o in ops))
            continue
        for regs in lanes:

            def val(tok: str, regs=regs) -> int:
                if tok in regs:
                    return regs[tok]
                return int(tok, 16) if tok.lower().startswith("0x") else int(tok)

            dst, src = ops[0], ops[1:]
            if op == "mov.b32" and dst.startswith("{"):  # unpack into two b16 registers
                lo, hi = _regs(dst)
                regs[lo], regs[hi] = val(src[0]) & 0xFFFF, val(src[0]) >> 16
                continue
            v = [val(s) for s in src]
            if op == "mov.b32":
                r = v[0]
            elif op == "and.b32":
                r = v[0] & v[1]
            elif op == "or.b32":
                r = v[0] | v[1]
            elif op == "shl.b32":
                r = v[0] << v[1]
            elif op == "shr.u32":
                r = v[0] >> v[1]
            elif op == "prmt.b32":
                r = prmt(v[0], v[1], v[2])
            elif op == "mul.lo.u32":
                r = v[0] * v[1]
            elif op == "fma.rn.bf16x2":
                r = fma_bf16x2(v[0], v[1], v[2])
            elif op == "cvt.f32.f16":
                regs[dst] = f16_value(v[0])
                continue
            else:
                raise AssertionError(f"an instruction the model does not know: {op}")
            regs[dst] = r & MASK
    return lanes


def test_f16_decode_ptx_gives_every_code_times_2_to_the_minus_14():
    g = torch.Generator().manual_seed(3)
    for byte in range(256):
        for pos in range(4):
            word = int(torch.randint(0, 2**32, (1,), generator=g, dtype=torch.int64).item())
            word = word & ~(0xFF << 8 * pos) | byte << 8 * pos
            (regs,) = run_ptx(B.E2M1_F16_PTX.value, [{"$8": word}])
            for col in range(8):
                expected = e2m1(word >> 4 * col & 15) * 2.0**-14
                assert regs[f"${col}"] == expected, (hex(word), col, regs[f"${col}"], expected)
    # -0 stays -0 (code 8): the sign bit alone is an fp16 -0
    (regs,) = run_ptx(B.E2M1_F16_PTX.value, [{"$8": 0x88888888}])
    assert all(str(regs[f"${c}"]) == "-0.0" for c in range(8))


def test_no_single_multiply_places_an_e2m1_code_as_fp16_bits():
    """The module's note: sign shifted by 12 and magnitude by 9 overlap; no m = 1 (mod 8) works."""
    for m in range(1, 1 << 12, 8):
        assert not all((c * m) & 7 == c & 7 and ((c * m) >> 6 & 1) == c >> 3 for c in range(16)), m


def _mma_case(fold: bool, seed: int):
    """A 16-row x 128-column tile (4 scale blocks) as k_mma's lanes hold it, and its reference."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.uint8)
    s = torch.randint(100, 150, (16, 4), generator=g, dtype=torch.uint8)
    x = torch.randn(128, generator=g).to(torch.bfloat16)
    ref = B.dequant_mxfp4(w, s) @ x.to(torch.float32)
    xbits = x.view(torch.int16).to(torch.int64) & 0xFFFF
    lanes = []
    for lane in range(32):
        gr, t = lane // 4, lane % 4

        def word(row, j, gr=gr, t=t):
            return int.from_bytes(bytes(w[row, 16 * t + 4 * j : 16 * t + 4 * j + 4].tolist()), "little")

        def pair_scale(row, t=t):
            b = int(s[row, t])
            bits = (b + 63) << 7 if fold else b << 7
            return bits | bits << 16

        acts = []
        for j in range(4):
            cols = [32 * t + 8 * j + 2 * p for p in range(4)]
            pairs = [int(xbits[c]) | int(xbits[c + 1]) << 16 for c in cols]
            if fold:
                (r,) = run_ptx(B.ACT_REBIAS_PTX.value, [{"$4": pairs[0], "$5": pairs[1], "$6": pairs[2],
                                                         "$7": pairs[3]}])  # fmt: skip
                pairs = [r["$0"], r["$1"], r["$2"], r["$3"]]
            acts.append(pairs)
        lanes.append({"words": [(word(gr, j), word(gr + 8, j)) for j in range(4)],
                      "scales": (pair_scale(gr), pair_scale(gr + 8)), "acts": acts})  # fmt: skip
    return lanes, ref


@pytest.mark.parametrize("fold", [False, True])
def test_mma_ptx_gives_each_lane_its_rows_dots(fold):
    text = (B.MMA_WORDS_FOLD_PTX if fold else B.MMA_WORDS_PTX).value
    for seed in range(2):
        inputs, ref = _mma_case(fold, seed)
        c = [[0.0] * 4 for _ in range(32)]
        for j in range(4):
            lanes = []
            for lane, inp in enumerate(inputs):
                regs = {"$4": inp["words"][j][0], "$5": inp["words"][j][1], "$6": inp["scales"][0],
                        "$7": inp["scales"][1]}  # fmt: skip
                regs.update({f"${8 + p}": inp["acts"][j][p] for p in range(4)})
                regs.update({f"${12 + r}": c[lane][r] for r in range(4)})
                lanes.append(regs)
            run_ptx(text, lanes)
            c = [[regs[f"${r}"] for r in range(4)] for regs in lanes]
        for lane in range(32):
            gr = lane // 4
            for r, row in ((0, gr), (1, gr), (2, gr + 8), (3, gr + 8)):
                assert c[lane][r] == pytest.approx(float(ref[row]), rel=1e-6, abs=1e-6), (lane, r)


def test_the_models_know_every_instruction_of_the_ptx():
    ops = set()
    for text in (B.E2M1_F16_PTX, B.MMA_WORDS_PTX, B.MMA_WORDS_FOLD_PTX, B.ACT_REBIAS_PTX):
        ops |= {line.split()[0] for line in text.value.strip().splitlines() if re.match(r"\s*[a-z]", line)}
    assert ops == {"mov.b32", "and.b32", "or.b32", "shl.b32", "shr.u32", "prmt.b32", "mul.lo.u32", "fma.rn.bf16x2",
                   "cvt.f32.f16", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}  # fmt: skip


def test_few_enough_kernels_to_compile_in_one_device_call():
    assert sum(len(cfgs) for *_, cfgs in B.VARIANTS) <= 24


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU: the interpreter (a GPU runs the script)")
def test_every_variant_matches_the_reference_under_the_interpreter(capsys):
    assert B.main(["--interpret", "--n", "64", "--k", "256", "--experts", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line and not line.startswith(("#", "variant"))]
    names = {r.split()[0] for r in rows}
    assert names == {name for name, *_ in B.VARIANTS}
    assert all(r.rstrip().endswith(" ok") for r in rows), rows
