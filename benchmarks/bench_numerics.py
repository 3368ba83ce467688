"""Weights and numerics options on a small FP8 / MXFP4 checkpoint (CPU): memory, agreement, time.

For one random small checkpoint written in DeepSeek-V4's layout (FP8 linears, MXFP4 experts),
the proposer is built with each option set and proposes K drafts for the same rows:

- weights bytes: the device bytes of the bound MTP weights (each storage once);
- agree bf16: the share of drafts equal to the ``weights="bf16"`` chain's (dequantised at load);
- agree ref: the share of first drafts equal to the argmax of a float64 reference step on the
  dequantised weights (no FP8 rounding anywhere), on the rows whose float64 top-2 gap is wider
  than 0.06 (the bf16 chain's own rounding);
- agree w8a8: the share of drafts equal to the full reference-numerics chain's (native, KV
  rounding and W8A8: what DeepSeek's inference code computes);
- ms: CPU milliseconds a propose, the median of three (a ratio between rows only; GPU speed is not
  measured here).

    python benchmarks/bench_numerics.py [--rows 64] [--k 3] [--seed 9]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import torch
from draftgraph.runtime.model.checkpoint_writer import write_checkpoint
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.model.weights import load_checkpoint
from draftgraph.runtime.proposer.binding import weights_nbytes
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

ROOT = Path(__file__).resolve().parents[1]
OPTION_SETS = {
    "bf16 (CPU default)": {"weights": "bf16"},
    "native, kv_fp8_round off": {"weights": "native", "kv_fp8_round": False},
    "native (CUDA default: kv round)": {"weights": "native"},
    "native + W8A8": {"weights": "native", "activations": "fp8"},
}


def drafts_of(path, rows, k, tokens, hiddens, positions, options):
    prop = DeepseekV4MtpProposer.from_checkpoint(path, executor="eager", **options)
    states = [prop.alloc_state() for _ in range(rows)]
    prop.propose_batch(tokens, hiddens, positions, k, states)  # warm-up: the executor is built
    for state in states:
        prop.after_verify(0, state)
    times = []
    for _ in range(3):  # the median of three: the CPU is shared
        start = time.perf_counter()
        drafts = prop.propose_batch(tokens, hiddens, positions, k, states)
        times.append((time.perf_counter() - start) * 1e3)
        for state in states:
            prop.after_verify(0, state)
    return drafts, sorted(times)[1], weights_nbytes(prop.weights)


def _reference_step():
    """tests/reference_v4.py's ReferenceMtp: the float64 reference step the tests use."""
    spec = importlib.util.spec_from_file_location("reference_v4", ROOT / "tests" / "reference_v4.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ReferenceMtp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seed", type=int, default=9)
    args = ap.parse_args()
    ReferenceMtp = _reference_step()  # noqa: N806 - a class

    cfg = V4Config.small()
    path = Path(tempfile.mkdtemp()) / "mxfp4"
    write_checkpoint(path, cfg, random_mtp_weights(cfg, seed=args.seed), fmt="mxfp4")
    gen = torch.Generator().manual_seed(0)
    hiddens = torch.randn(args.rows, cfg.hc_mult, cfg.hidden_size, generator=gen).bfloat16()
    tokens = torch.randint(cfg.vocab_size, (args.rows,), generator=gen).tolist()
    positions = [3 + 2 * i for i in range(args.rows)]
    dequantised = load_checkpoint(path).tensors
    best, wide = [], []
    for token, hidden, position in zip(tokens, hiddens, positions):
        logits, _ = ReferenceMtp(cfg, dequantised).step(token, hidden.double(), position)
        top = torch.topk(logits, 2)
        best.append(int(top.indices[0]))
        wide.append(float(top.values[0] - top.values[1]) > 0.06)
    results = {name: drafts_of(path, args.rows, args.k, tokens, hiddens, positions, options)
               for name, options in OPTION_SETS.items()}
    base, w8a8 = results["bf16 (CPU default)"][0], results["native + W8A8"][0]

    def agree(a, b):
        pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
        return sum(x == y for x, y in pairs) / len(pairs)

    print(f"small config, MXFP4 checkpoint (seed {args.seed}), {args.rows} rows, K={args.k}, CPU, "
          f"torch {torch.__version__}; {sum(wide)} rows with a float64 top-2 gap > 0.06")
    print(f"{'options':<34} {'weights KB':>10} {'agree bf16':>10} {'agree ref':>9} {'agree w8a8':>10} {'ms':>7}")
    for name, (drafts, ms, nbytes) in results.items():
        ref = sum(d[0] == b for d, b, w in zip(drafts, best, wide) if w) / max(1, sum(wide))
        print(f"{name:<34} {nbytes / 1024:>10.1f} {agree(drafts, base):>10.3f} {ref:>9.3f} "
              f"{agree(drafts, w8a8):>10.3f} {ms:>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
