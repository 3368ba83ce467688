"""``draftgraph draft``: run the K-draft chain once on a checkpoint (the contract other tools use).

The sequence starts empty at position P: its drafter cache holds only what this
call writes. The hidden comes from a safetensors file holding one bf16 tensor
named ``hidden``: [C, D] in streams mode, [D] in collapsed mode.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from draftgraph.tools.arg_checks import check_at_least, check_num_drafts, check_output_file, lookup_errors
from draftgraph.tools.cli import UsageError
from draftgraph.tools.common import device_arg

EXAMPLES = """examples:
  draftgraph draft --checkpoint ckpt/ --token 17 --hidden h.safetensors --position 40 --num-drafts 3 --json
  draftgraph draft --checkpoint ckpt/ --token 17 --hidden h.safetensors --position 0 --mode collapsed
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("draft", help="run the draft chain once on a checkpoint", description=__doc__, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="folder with config.json and the safetensors")
    p.add_argument("--token", required=True, type=int, help="the token after position P (t_{P+1})")
    p.add_argument("--hidden", required=True, type=Path, help="safetensors file with one bf16 tensor 'hidden'")
    p.add_argument("--position", required=True, type=int, help="position P of the hidden")
    p.add_argument("--num-drafts", "-k", type=int, default=1,
                   help="drafts K (default 1; at most the proposer's max_num_drafts)")
    p.add_argument("--mode", choices=("streams", "collapsed"), default="streams")
    p.add_argument("--vocab-limit", type=int, default=None, help="draft only tokens below N")
    p.add_argument("--mtp-vocab-size", type=int, default=0, help="LM-head rows used for drafting (0 = all)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    p.add_argument("--eager", action="store_true", help="force the eager executor")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", default=None,
                   help="write a Chrome/Perfetto trace JSON of the run (its folder must exist)")
    return p


def load_hidden(path: Path) -> torch.Tensor:
    from safetensors import safe_open

    with lookup_errors("--hidden", "a safetensors file", path):
        missing = not path.exists()
    if missing:
        raise UsageError(f"--hidden: expected a safetensors file holding a tensor named 'hidden', got no file at "
                         f"{path} (hint: save it with safetensors.torch.save_file({{'hidden': tensor}}, path))")
    try:
        with safe_open(str(path), framework="pt") as f:
            if "hidden" not in f.keys():
                raise UsageError(f"--hidden: expected a tensor named 'hidden' in {path}, got {sorted(f.keys())}")
            return f.get_tensor("hidden")
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"--hidden: expected a readable safetensors file, got {path} ({exc}) (hint: save it with "
                         f"safetensors.torch.save_file({{'hidden': tensor}}, path))") from None


def run(args) -> int:
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
    from draftgraph.tools.trace import Tracer

    with lookup_errors("--checkpoint", "a folder with config.json", args.checkpoint):
        found = (args.checkpoint / "config.json").exists() or args.checkpoint.is_file()
    if not found:
        raise UsageError(f"--checkpoint: expected a folder with config.json, got {args.checkpoint}")
    check_num_drafts(args.num_drafts)
    if args.position < 0:
        raise UsageError(f"--position: expected >= 0, got {args.position}")
    check_at_least("--mtp-vocab-size", args.mtp_vocab_size, 0, "0 drafts over the whole vocabulary")
    if args.vocab_limit is not None:
        check_at_least("--vocab-limit", args.vocab_limit, 1)
    check_output_file("--trace", args.trace)
    device = device_arg(args.device)
    hidden = load_hidden(args.hidden)
    prop = DeepseekV4MtpProposer.from_checkpoint(
        args.checkpoint, device=device, mode=args.mode, mtp_vocab_size=args.mtp_vocab_size,
        executor="eager" if args.eager else "auto", buckets=(1,))
    if args.vocab_limit is not None:
        prop.set_vocab_limit(args.vocab_limit)
    tracer = Tracer() if args.trace else None
    if tracer is not None:
        tracer.attach(prop)
    state = prop.alloc_state()
    try:
        drafts = prop.propose(args.token, hidden.to(device), args.position, args.num_drafts, state)
    finally:
        prop.free_state(state)
    if tracer is not None:
        tracer.save(args.trace)
    if args.json:
        print(json.dumps({"drafts": drafts, "position": args.position, "mode": args.mode,
                          "num_drafts": args.num_drafts, "propose_ms": round(prop.last_propose_seconds * 1e3, 3)}))
    else:
        print(" ".join(str(d) for d in drafts))
    return 0
