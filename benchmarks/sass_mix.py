"""(CPU, no GPU needed) The SASS of fp8_gemv's variants: the K loop's instructions and the registers.

    python benchmarks/sass_mix.py [--arch 90] [--batches 1,8] [--k 4096]

Each variant (batch 1: three FMA tiles, ``BATCH1_CONFIG`` first; more rows: the dot tiles
``config_for`` picks and others) is compiled for ``--arch`` through
``compile_kernels.py``'s compile-only driver, disassembled with Triton's bundled ``nvdisasm`` and
``cuobjdump``, and printed as one line: registers, stack bytes, the whole kernel's instruction
count, and the K loop's (the longest span from a label to the backward branch to it) with its most
frequent opcodes. What a variant costs a code, before a GPU times it (benchmarks/h200/KERNEL_RUNS.md, "The batch-1
forms, by the SASS, then by the GPU": fewer instructions did not mean less time); the counts are
of the compiler here, not necessarily the device's.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: jit makes compiled kernels

import torch  # noqa: E402
import triton  # noqa: E402
from compile_kernels import install  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

LINE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def loop_body(sass: str) -> list[str]:
    """The opcodes of the longest span from a label to a later branch back to it (the K loop)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), len(lines)) < i:
            body = [op.group(1) for x in lines[labels[m.group(1)]:i + 1] if (op := LINE.match(x))]
            best = max(best, body, key=len)
    return best


def disassemble(kernel) -> tuple[str, str]:
    """(nvdisasm's SASS, cuobjdump's resource usage) of a compiled kernel."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{tools}/nvdisasm", "-c", f.name], capture_output=True, text=True, check=True)
        usage = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True)  # fmt: skip
    return sass.stdout, usage.stdout


def variants(batch: int):
    from draftgraph.ops.triton import fp8_linear as F
    from draftgraph.ops.triton.gemv import GemvConfig

    if batch == 1:
        tiles = [F.BATCH1_CONFIG, GemvConfig(4, 512, 1, 6, use_dot=False), GemvConfig(8, 1024, 2, 3, use_dot=False)]
        return [("fma", t) for t in tiles]
    tiles = [F.config_for(batch, 4096), GemvConfig(32, 128, 2, 6), GemvConfig(64, 128, 4, 3), GemvConfig(16, 128, 1, 6)]
    return [("dot", t) for t in tiles]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4096, help="K (and N) of the [N, K] weight; a multiple of 128")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b.isdigit()]
    if not batches or min(batches) < 1 or args.k < 128 or args.k % 128:
        ap.error(f"--batches {args.batches!r} / --k {args.k}: expected sizes >= 1 and K a multiple of 128")
    install(args.arch)
    from draftgraph.ops.triton import fp8_linear as F

    compiled = []
    run = JITFunction.run

    def keep(self, *a, **kw):  # the kernel object of each launch (install's driver only compiles)
        kernel = run(self, *a, **kw)
        compiled.append(kernel)
        return kernel

    JITFunction.run = keep
    n = k = args.k
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    s = torch.zeros(n // 128, k // 128, dtype=torch.uint8)
    try:
        for batch in batches:
            x = torch.zeros(batch, k, dtype=torch.bfloat16)
            for label, cfg in variants(batch):
                compiled.clear()
                F.fp8_gemv(x, w, s, torch.zeros(batch, n, dtype=torch.bfloat16), config=cfg)
                sass, usage = disassemble(compiled[-1])
                regs, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
                total = sum(1 for line in sass.splitlines() if LINE.match(line))
                body = loop_body(sass)
                top = " ".join(f"{op}={c}" for op, c in collections.Counter(body).most_common(8))
                tile = f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
                print(f"B={batch} {label:<4} {tile:<16} regs {regs:>3} stack {stack:>3} kernel {total:>5} "
                      f"loop {len(body):>4}: {top}", flush=True)
    finally:
        JITFunction.run = run
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
