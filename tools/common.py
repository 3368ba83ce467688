"""Shared pieces of the command-line tools: the embedded default checkpoint and selectors."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
from draftgraph.runtime.model.config import V4Config

DEMO_SEED = 0
DEMO_FORMAT = "mxfp4"  # the real layout: FP8 block-scaled linears, MXFP4 routed experts


def cache_dir() -> Path:
    root = os.environ.get("DRAFTGRAPH_CACHE") or Path.home() / ".cache" / "draftgraph"
    return Path(root)


def default_checkpoint() -> Path:
    """A small V4-shaped checkpoint in the real format, made deterministically on first use."""
    return cached_small_checkpoint("demo", DEMO_FORMAT, DEMO_SEED)


def cached_small_checkpoint(purpose: str, fmt: str, seed: int, include_target_layers: bool = False) -> Path:
    """A random ``V4Config.small()`` checkpoint, made once in the cache folder and then reused.

    It is written to a folder of this process and renamed into place, so that tools started
    together neither read a half-written checkpoint nor fail when another made it first.
    """
    from draftgraph.runtime.model.checkpoint_writer import make_synthetic_checkpoint

    path = cache_dir() / f"{purpose}-small-{fmt}-seed{seed}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_synthetic_checkpoint(
            tmp, V4Config.small(), fmt=fmt, seed=seed, include_target_layers=include_target_layers
        )
        if path.exists():  # another process made it first
            shutil.rmtree(tmp)
        else:
            tmp.rename(path)
    return path


def add_selectors(parser: argparse.ArgumentParser, batch: bool = True) -> None:
    """--num-drafts, --batch, --mode, --checkpoint, --runner: which chain graph a tool shows."""
    parser.add_argument("--num-drafts", "-k", type=int, default=3,
                        help="drafts K in the chain (1 = one step; at most the proposer's max_num_drafts)")
    if batch:
        parser.add_argument("--batch", "-b", type=int, default=1, help="batch size B the arena is planned for")
    parser.add_argument("--mode", choices=("streams", "collapsed"), default="streams", help="hidden input mode")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="folder with config.json (default: the embedded small config)")
    parser.add_argument("--runner", default="builtin",
                        help="body runner: builtin, identity, torch_module or package.module:callable "
                             "(refused unless it loads)")


def device_arg(value: str | None) -> torch.device:
    """``--device``: cpu, or cuda[:N] when that GPU is visible; default cuda when present, else cpu.

    Anything else is a UsageError (the runtime runs on the CPU and on CUDA only).
    """
    from draftgraph.runtime.device import check_device
    from draftgraph.runtime.errors import InputError
    from draftgraph.tools.cli import UsageError

    if not value:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return check_device(value, "--device")  # the runtime's own check: one rule for the API and the CLI
    except InputError as exc:
        raise UsageError(str(exc)) from None


def selected_config(args) -> V4Config:
    if args.checkpoint is not None:
        return V4Config.load(args.checkpoint)
    return V4Config.small()
