"""``draftgraph decode``: speculative decoding with the MTP drafter and the small V4 target.

The prompt is byte-tokenized (BOS first), the target prefills it, then rounds of
propose K drafts -> one target forward verifies them -> greedy acceptance run
until EOS or --max-tokens. Prints each prompt with its continuation, then the
stats table (acceptance by draft position, mean accepted length, time split,
tokens per second). The output equals the target's own greedy decoding.

Checkpoint: --checkpoint DIR, else the trained tiny model at tools/data/tiny_v4
when it is there, else a small random one (made once in the cache folder: its
text is noise, but the loop, the stats and the equivalence hold).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from draftgraph.tools.cli import UsageError
from draftgraph.tools.common import cache_dir, device_arg

EXAMPLES = """examples:
  draftgraph decode --prompt "def fibonacci(n):"
  draftgraph decode --prompt "import os" --num-drafts 4 --max-tokens 128 --trace decode_trace.json
  draftgraph decode --batch-prompts prompts.txt --eager
"""

TINY_CHECKPOINT = Path(__file__).resolve().parent / "data" / "tiny_v4"
DEFAULT_PROMPT = "def main():"
MIN_ROW_BUCKET = 16


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "decode",
        help="speculative decoding: MTP drafts verified by the small V4 target",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_args(p, max_tokens=64)
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace (draft ops, target forwards)")
    return p


def add_workload_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The arguments decode and swap share: prompts, checkpoint, K, max tokens, device, executor."""
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeat for several)")
    p.add_argument("--batch-prompts", type=Path, default=None, help="a file with one prompt per line")
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="checkpoint folder with target layers (default: tools/data/tiny_v4 when present)",
    )
    p.add_argument("--num-drafts", "-k", type=int, default=3, help="drafts K per round (default 3)")
    p.add_argument(
        "--max-tokens",
        "-n",
        type=int,
        default=max_tokens,
        help=f"new tokens per prompt (default {max_tokens})",
    )
    p.add_argument(
        "--mode", choices=("streams", "collapsed"), default="streams", help="the MTP's hidden input"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--eager", action="store_true", help="eager executors only (no CUDA graphs)")


# ---- shared with tools/swap.py ---------------------------------------------------------------------
def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.batch_prompts is not None:
        if not args.batch_prompts.is_file():
            raise UsageError(f"--batch-prompts: expected a file, got {args.batch_prompts}")
        prompts += [line for line in args.batch_prompts.read_text().splitlines() if line.strip()]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    if args.num_drafts < 1:
        raise UsageError(f"--num-drafts: expected >= 1, got {args.num_drafts}")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens: expected >= 1, got {args.max_tokens}")
    return prompts


def resolve_checkpoint(path: Path | None) -> tuple[Path, str]:
    """(folder, a note on what it is)."""
    if path is not None:
        if not (path / "config.json").exists():
            raise UsageError(f"--checkpoint: expected a folder with config.json, got {path}")
        return path, str(path)
    if (TINY_CHECKPOINT / "config.json").exists():
        return TINY_CHECKPOINT, f"{TINY_CHECKPOINT} (the trained tiny model)"
    return (
        random_target_checkpoint(),
        "a random small model (tools/data/tiny_v4 is absent: the text is noise)",
    )


def random_target_checkpoint() -> Path:
    """A small V4-shaped checkpoint WITH target layers (bf16, random), made once in the cache folder."""
    from draftgraph.runtime.model.checkpoint_writer import make_synthetic_checkpoint
    from draftgraph.runtime.model.config import V4Config

    path = cache_dir() / "decode-small-bf16-seed0"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_synthetic_checkpoint(tmp, V4Config.small(), fmt="bf16", seed=0, include_target_layers=True)
        if not path.exists():
            tmp.rename(path)
    return path


def row_bucket(num_prompts: int, num_drafts: int) -> int:
    """One row bucket for every target run: verify windows of all prompts fit, and the numerics of a
    row never depend on the run's row count (kernels are picked by shape), so the output is the
    same whatever the drafter."""
    rows = max(MIN_ROW_BUCKET, num_prompts * (num_drafts + 1))
    return 1 << (rows - 1).bit_length()


def load_models(path: Path, args, num_prompts: int):
    """(target, proposer, tokenizer) on the requested device and executor."""
    from draftgraph.runtime.decode.target import TargetModel, concrete_device
    from draftgraph.runtime.decode.tokenizer import VOCAB_SIZE, ByteTokenizer
    from draftgraph.runtime.model.weights import MTP_TENSOR_NAMES, TARGET_TENSOR_NAMES, load_checkpoint
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

    device = concrete_device(device_arg(args.device))
    executor = "eager" if args.eager else "auto"
    ckpt = load_checkpoint(path, names="all", device="cpu")
    if ckpt.config.vocab_size < VOCAB_SIZE:
        raise UsageError(
            f"checkpoint vocab: expected >= {VOCAB_SIZE} (byte-level ids), got {ckpt.config.vocab_size}"
        )
    config, bucket = ckpt.config, row_bucket(num_prompts, args.num_drafts)
    target_tensors = {e.name: ckpt.tensors[e.name] for e in TARGET_TENSOR_NAMES(config)}
    mtp_tensors = {e.name: ckpt.tensors[e.name] for e in MTP_TENSOR_NAMES(config)}
    target = TargetModel(
        config,
        target_tensors,
        device=device,
        mode=args.mode,
        executor=executor,
        buckets=(bucket,),
        max_sequences=max(8, num_prompts),
    )
    proposer = DeepseekV4MtpProposer(
        config,
        mtp_tensors,
        device=device,
        mode=args.mode,
        executor=executor,
        max_num_drafts=max(8, args.num_drafts),
    )
    return target, proposer, ByteTokenizer()


def run(args) -> int:
    from draftgraph.runtime.decode.loop import speculative_decode
    from draftgraph.tools.trace import Tracer

    prompts = read_prompts(args)
    path, note = resolve_checkpoint(args.checkpoint)
    target, proposer, tok = load_models(path, args, len(prompts))
    print(f"# checkpoint {note}")
    print(f"# {target!r}")
    tracer = Tracer() if args.trace else None
    on_step = None
    if tracer is not None:
        tracer.attach(proposer)
        target.tracer = tracer
        last = [time.perf_counter_ns()]

        def on_step(session, event):
            now = time.perf_counter_ns()
            tracer.slice(
                f"decode step {event.step}",
                last[0],
                now - last[0],
                cat="decode",
                args={"accepted": {str(k): v for k, v in event.accepted.items()}},
            )
            last[0] = now

    encoded = [tok.encode(p, add_bos=True) for p in prompts]
    result = speculative_decode(
        target,
        proposer,
        encoded,
        args.max_tokens,
        args.num_drafts,
        eos_id=tok.eos_id,
        on_step=on_step,
        progress=None,
    )
    for i, (prompt, tokens, reason) in enumerate(zip(prompts, result.tokens, result.finish_reasons)):
        print(f"\n--- prompt {i} ({len(tokens)} tokens, ended by {reason})")
        print(prompt + tok.decode(tokens))
    print(
        f"\n# speculative decoding, K={args.num_drafts}, {'eager' if not target.use_captured else 'captured'}"
    )
    print(result.stats.format_table())
    if tracer is not None:
        tracer.detach(proposer)
        target.tracer = None
        tracer.save(args.trace)
        print(f"trace written to {args.trace}")
    return 0
