"""The decode workload that ``draftgraph decode`` and ``draftgraph swap`` share.

Its arguments (prompts, checkpoint, K, max tokens, mode, device, executor), the
checkpoint it resolves to, the target and proposer it loads, and one speculative
decoding run of the byte-tokenized prompts. ``decode`` adds a trace around that run;
``swap`` repeats it once per body runner.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from draftgraph.runtime.decode.tokenizer import not_utf8
from draftgraph.runtime.errors import describe
from draftgraph.tools.arg_checks import check_at_least, check_num_drafts, lookup_errors
from draftgraph.tools.cli import UsageError
from draftgraph.tools.common import cached_small_checkpoint, device_arg

if TYPE_CHECKING:
    from draftgraph.runtime.decode.loop import DecodeResult
    from draftgraph.runtime.decode.target import TargetModel
    from draftgraph.runtime.decode.tokenizer import ByteTokenizer
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

TINY_CHECKPOINT = Path(__file__).resolve().parent / "data" / "tiny_v4"
# Stdlib-style code the tiny model was trained on, so that drafting is a measurement: on the tiny
# model (CPU, K=3, 32 tokens) builtin accepts 0.733 of the drafts, the identity body 0.159. A
# prompt like "def main():" continues with spaces only, which every drafter guesses (all 1.000).
DEFAULT_PROMPT = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"
MIN_ROW_BUCKET = 16


def add_workload_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The arguments decode and swap share: prompts, checkpoint, K, max tokens, device, executor."""
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help='prompt text (repeat for several; default: a short Python class, "class Point: ...")',
    )
    p.add_argument("--batch-prompts", type=Path, default=None, help="a file with one prompt per line")
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="checkpoint folder with target layers (default: tools/data/tiny_v4 when present)",
    )
    p.add_argument(
        "--num-drafts",
        "-k",
        type=int,
        default=3,
        help="drafts K per round (default 3; at most the proposer's max_num_drafts)",
    )
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
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    p.add_argument("--eager", action="store_true", help="eager executors only (no CUDA graphs)")


@dataclass
class Workload:
    """The prompts and models of one decode workload, loaded once and decoded as often as asked."""

    prompts: list[str]
    encoded: list[list[int]]  # BOS + the bytes of each prompt
    checkpoint_note: str  # which checkpoint, in words
    target: TargetModel
    proposer: DeepseekV4MtpProposer
    tokenizer: ByteTokenizer
    max_tokens: int
    num_drafts: int

    def decode(self, on_step=None) -> DecodeResult:
        """Speculative decoding of every prompt with the proposer as it is now (greedy, stop at EOS)."""
        from draftgraph.runtime.decode.loop import speculative_decode

        return speculative_decode(
            self.target,
            self.proposer,
            self.encoded,
            self.max_tokens,
            self.num_drafts,
            eos_id=self.tokenizer.eos_id,
            on_step=on_step,
            progress=None,
        )


def load_workload(args) -> Workload:
    """The workload the arguments of :func:`add_workload_args` name; a bad argument raises UsageError
    (before any model is loaded)."""
    check_workload_args(args)
    prompts = read_prompts(args)
    path, note = resolve_checkpoint(args.checkpoint)
    target, proposer, tok = load_models(path, args, len(prompts))
    encoded = [tok.encode(p, add_bos=True) for p in prompts]
    return Workload(prompts, encoded, note, target, proposer, tok, args.max_tokens, args.num_drafts)


def read_prompts(args) -> list[str]:
    """--prompt texts, then --batch-prompts' non-blank lines; UTF-8 text only: the tokenizer encodes
    text, and a byte that is not UTF-8 (a surrogate from argv, a Latin-1 file) cannot be printed back."""
    prompts = list(args.prompt or [])
    for i, prompt in enumerate(prompts):
        _check_utf8(f"--prompt #{i + 1}", prompt)
    if args.batch_prompts is not None:
        with lookup_errors("--batch-prompts", "a file", args.batch_prompts):
            is_file = args.batch_prompts.is_file()
        if not is_file:
            raise UsageError(f"--batch-prompts: expected a file, got {args.batch_prompts}")
        data = args.batch_prompts.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(describe("--batch-prompts", "a UTF-8 text file", f"byte 0x{data[e.start]:02x} at offset "
                                      f"{e.start} of {args.batch_prompts}", "save the file as UTF-8")) from None
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:  # not the default prompt in its place: the run would measure what was not asked for
            raise UsageError(describe("--batch-prompts", "a file with one prompt a line",
                                      f"no prompt in {args.batch_prompts} (empty, or blank lines only)"))
        prompts += lines
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    return prompts


def _check_utf8(flag: str, text: str) -> None:
    bad = not_utf8(text)
    if bad is not None:
        raise UsageError(describe(flag, "UTF-8 text", bad, "the shell passed bytes that are not UTF-8"))


def check_workload_args(args) -> None:
    """--num-drafts (1 .. the proposer's cap), --max-tokens >= 1, --device (an available one)."""
    check_num_drafts(args.num_drafts)
    check_at_least("--max-tokens", args.max_tokens, 1)
    device_arg(args.device)


def resolve_checkpoint(path: Path | None) -> tuple[Path, str]:
    """(folder, a note on what it is)."""
    if path is not None:
        with lookup_errors("--checkpoint", "a folder with config.json", path):
            found = (path / "config.json").exists()
        if not found:
            raise UsageError(f"--checkpoint: expected a folder with config.json, got {path}")
        return path, str(path)
    if (TINY_CHECKPOINT / "config.json").exists():
        return TINY_CHECKPOINT, f"{TINY_CHECKPOINT} (the trained tiny model)"
    return (
        cached_small_checkpoint("decode", "bf16", seed=0, include_target_layers=True),
        "a random small model (tools/data/tiny_v4 is absent: the text is noise)",
    )


def row_bucket(num_prompts: int, num_drafts: int) -> int:
    """One row bucket for every target run: verify windows of all prompts fit, and the numerics of a
    row never depend on the run's row count (kernels are picked by shape), so the output is the
    same whatever the drafter."""
    rows = max(MIN_ROW_BUCKET, num_prompts * (num_drafts + 1))
    return 1 << (rows - 1).bit_length()


def load_models(path: Path, args, num_prompts: int):
    """(target, proposer, tokenizer) on the requested device and executor."""
    from draftgraph.runtime.decode.target import TargetModel
    from draftgraph.runtime.decode.tokenizer import VOCAB_SIZE, ByteTokenizer
    from draftgraph.runtime.device import concrete_device
    from draftgraph.runtime.model.weights import MTP_TENSOR_NAMES, TARGET_TENSOR_NAMES, load_checkpoint
    from draftgraph.runtime.proposer.options import DEFAULT_BUCKETS
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
    # The device loop's merged first step runs a propose row and up to K + 1 catch-up rows a prompt:
    # buckets up to that, so that no step spills rows into a drafter-prefill run of their own.
    top = max(DEFAULT_BUCKETS[-1], row_bucket(num_prompts, args.num_drafts + 1))
    buckets = tuple(1 << i for i in range(top.bit_length()))
    proposer = DeepseekV4MtpProposer(config, mtp_tensors, device=device, mode=args.mode, executor=executor,
                                     buckets=buckets)
    return target, proposer, ByteTokenizer()
