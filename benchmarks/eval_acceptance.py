"""Acceptance of the committed tiny MTP in the real decode loop, on held-out stdlib files.

    python benchmarks/eval_acceptance.py [--files 8] [--prompt-bytes 256] [--max-tokens 48] [--num-drafts 3]
                                         [--head-dtype bf16|fp8]

Prompts are the first bytes of Python standard-library files that train_tiny.py held out
(never trained on); the loop is draftgraph.runtime.decode.loop.speculative_decode with greedy verification.
Prints the stats table (acceptance per draft position first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--prompt-bytes", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--head-dtype", default="bf16", choices=["bf16", "fp8"],
                    help="the proposer's draft head (ProposerOptions.head_dtype); the target's stays bf16")
    ap.add_argument("--checkpoint", default=str(Path(__file__).resolve().parents[1] / "tools" / "data" / "tiny_v4"))
    args = ap.parse_args()
    from draftgraph.runtime.decode.loop import speculative_decode
    from draftgraph.runtime.decode.target import TargetModel
    from draftgraph.runtime.decode.tokenizer import encode
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
    from train_tiny import is_held_out, stdlib_files

    root, files = stdlib_files()
    held = [f for f in files if is_held_out(f)][: args.files]
    prompts = [encode((Path(root) / f).read_text(errors="replace")[: args.prompt_bytes]) for f in held]
    target = TargetModel.from_checkpoint(args.checkpoint, executor="eager", buckets=(256,))
    proposer = DeepseekV4MtpProposer.from_checkpoint(args.checkpoint, executor="eager", head_dtype=args.head_dtype)
    result = speculative_decode(target, proposer, prompts, args.max_tokens, args.num_drafts)
    print(f"held-out files: {', '.join(held)}; draft head {args.head_dtype}")
    print(result.stats.format_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
