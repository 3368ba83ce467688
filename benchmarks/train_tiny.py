"""Train the tiny V4-shaped target model and its MTP head on the Python standard library's source.

    python benchmarks/train_tiny.py [--minutes 18] [--out tools/data/tiny_v4] [--seed 0] [--init DIR]
        [--mtp-depth K] [--freeze-target]

Data: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (site-packages excluded), sorted by
relative path, byte-tokenized, each file framed as BOS + bytes + EOS. A file whose
``sha1(relative path) % 10 == 0`` is held out for evaluation and never trained on.

Loss: target next-token CE + ``--mtp-weight`` * MTP CE for token t+2. The MTP reads the target's
streams at t DETACHED (the target learns only from its own loss, as a frozen target would be seen
at inference) and the TRUE token t+1; the shared embedding and head get gradients from both.
``--mtp-depth K`` chains the MTP K times in the loss, as drafting does (step k reads step k-1's
own streams and the token t+k, predicts t+1+k; MTP CE is the mean), so draft positions 2..K are
trained too. ``--freeze-target`` trains the MTP only: the target (embedding, head and router
biases included) and so its greedy text stay exactly as loaded from ``--init``.

Schedule: linear warm-up over min(30 s, 5 % of the budget), then cosine decay to 0.1 x ``--lr`` at
the end of the wall-time budget. ``--init DIR`` warm-starts from a checkpoint this script wrote
(its config.json sets the sizes; the bf16 weights are widened to fp32; the optimizer starts fresh,
hence the warm-up again), so a later run continues an earlier one instead of starting over.

Writes ``config.json``, ``model.safetensors`` (bf16 linears; fp32 ``hc_*``, ``attn_sink`` and gate
bias; int32 ``tid2eid``; real DeepSeek-V4 tensor names) and ``metrics.json``, after evaluating
the saved bf16 checkpoint on the held-out files: target next-token accuracy and the MTP's
first-position agreement (argmax MTP at (t, t+1) == argmax target at t+1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from draftgraph.runtime.decode.tokenizer import BOS_ID, EOS_ID
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.tiny_model import TinyV4Mtp, TinyV4Target, load_tiny_checkpoint

FP32_NAMES = ("hc_", "attn_sink", "gate.bias")  # stored fp32 in the real checkpoint (spec section 1)
MAX_CHECKPOINT_BYTES = 5 * 1024 * 1024


# ---- data --------------------------------------------------------------------------------------


def stdlib_files() -> tuple[Path, list[str]]:
    """The stdlib root and its ``*.py`` files as sorted posix relative paths (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return root, sorted(found)


def is_held_out(rel_path: str) -> bool:
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % 10 == 0


def token_stream(root: Path, rel_paths: list[str]) -> torch.Tensor:
    """All files as one int16 token stream, each as BOS + bytes + EOS."""
    parts = []
    for rel in rel_paths:
        data = np.frombuffer((root / rel).read_bytes(), dtype=np.uint8).astype(np.int16)
        parts += [np.array([BOS_ID], np.int16), data, np.array([EOS_ID], np.int16)]
    return torch.from_numpy(np.concatenate(parts))


def tiny_config(**overrides) -> V4Config:
    """The committed demo model: ~1.8 M parameters, under 5 MB in bf16.

    ``V4Config.small()`` at half its width and experts, with a byte-level vocab and a 64-token window.
    """
    base = dict(
        vocab_size=264,  # 258 byte-level ids padded to a multiple of 8
        hidden_size=128,
        head_dim=64,
        qk_rope_head_dim=16,
        sliding_window=64,
        n_routed_experts=8,
    )
    base.update(overrides)
    return V4Config.small(**base)


def load_init(path: Path) -> tuple[V4Config, TinyV4Target, TinyV4Mtp]:
    """A checkpoint written by this script as fp32 models to continue training from."""
    config, target, mtp = load_tiny_checkpoint(path)
    for module in (target, mtp):
        for tensor in (*module.parameters(), *module.buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.float()
    return config, target, mtp


# ---- training ----------------------------------------------------------------------------------


def joint_loss(target: TinyV4Target, mtp: TinyV4Mtp, window: torch.Tensor, mtp_weight: float, mtp_depth: int = 1):
    """``window [B, T+1+depth]`` -> (total, target CE, MTP CE). Positions 0..T-1 predict t+1 and,
    through the MTP chained ``mtp_depth`` times, t+2 .. t+1+depth (MTP CE is their mean).

    Chaining as in drafting: step k reads step k-1's own streams (the target's for k = 1) and the
    token t+k, so draft positions 2..K are trained too, not only the first.
    """
    T = window.shape[1] - 1 - mtp_depth
    inputs = window[:, :T]
    positions = torch.arange(T)
    logits, streams = target.forward_seq(inputs, positions)  # [B, T, V], [B, T, C, D]
    ce_target = F.cross_entropy(logits.flatten(0, 1), window[:, 1 : T + 1].flatten())
    Z, ce_mtp = streams.detach(), 0.0
    for k in range(1, mtp_depth + 1):
        Z = mtp.block.forward_seq(mtp.combine(Z, window[:, k : T + k], target.embed), positions)  # [B, T, C, D]
        mtp_logits = mtp.logits(Z, target.head)
        ce_mtp = ce_mtp + F.cross_entropy(mtp_logits.flatten(0, 1), window[:, k + 1 : T + k + 1].flatten()) / mtp_depth
    return ce_target + mtp_weight * ce_mtp, ce_target, ce_mtp


def _balance_routers(modules, gamma: float) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3 noaux_tc): nudge each score-routed expert's
    selection bias toward the mean load."""
    for module in modules:
        for block in getattr(module, "layers", [getattr(module, "block", None)]):
            moe = block.ffn
            if moe.hash_routed or moe.last_load is None:
                continue
            load = moe.last_load.float()
            moe.gate.bias += gamma * torch.sign(load.mean() - load)


def train(
    config: V4Config,
    stream: torch.Tensor,
    seconds: float,
    *,
    seed: int = 0,
    batch: int = 8,
    seq_len: int = 256,
    lr: float = 3e-3,
    mtp_weight: float = 0.5,
    max_steps: int | None = None,
    progress: bool = True,
    init: tuple[TinyV4Target, TinyV4Mtp] | None = None,
    mtp_depth: int = 1,
    freeze_target: bool = False,
) -> tuple[TinyV4Target, TinyV4Mtp, list[dict]]:
    """Train until ``seconds`` of wall time (or ``max_steps``); warmup, then cosine over the budget.

    ``init``: fp32 models to continue from (see ``load_init``) instead of fresh ones.
    ``freeze_target``: train the MTP only (loss = MTP CE); the target, its embedding and head and its
    router biases stay as they are, so its greedy text does not change.
    Returns the fp32 models and one history entry per step (loss, ce_target, ce_mtp, lr, t).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    target, mtp = init if init is not None else (TinyV4Target(config), TinyV4Mtp(config))
    trained = (mtp,) if freeze_target else (target, mtp)
    target.requires_grad_(not freeze_target)
    params = [p for m in trained for p in m.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup_s = min(30.0, 0.05 * seconds)
    history: list[dict] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=int(seconds), unit="s", desc="train", dynamic_ncols=True)
    start = time.perf_counter()
    step = 0
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= seconds or (max_steps is not None and step >= max_steps):
            break
        frac = elapsed / seconds
        scale = min(1.0, (elapsed + 1e-3) / warmup_s) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        offsets = torch.randint(0, len(stream) - seq_len - 1 - mtp_depth, (batch,), generator=gen)
        window = torch.stack([stream[o : o + seq_len + 1 + mtp_depth] for o in offsets.tolist()]).long()
        loss, ce_t, ce_m = joint_loss(target, mtp, window, mtp_weight, mtp_depth)
        if freeze_target:
            loss = ce_m
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            _balance_routers(trained, gamma=1e-3)
        step += 1
        history.append(
            {
                "step": step,
                "loss": loss.item(),
                "ce_target": ce_t.item(),
                "ce_mtp": ce_m.item(),
                "lr": lr * scale,
                "t": time.perf_counter() - start,
            }
        )
        if bar is not None:
            bar.n = min(int(time.perf_counter() - start), bar.total)
            bar.set_postfix(step=step, ce=f"{ce_t.item():.3f}", ce_mtp=f"{ce_m.item():.3f}", refresh=False)
            bar.refresh()
    if bar is not None:
        bar.close()
    return target, mtp, history


# ---- checkpoint and evaluation -----------------------------------------------------------------


def checkpoint_tensors(target: TinyV4Target, mtp: TinyV4Mtp) -> dict[str, torch.Tensor]:
    """Real-named tensors: bf16 except the spec's fp32 ones; int tensors unchanged."""
    out = {}
    for name, t in {**target.state_dict_v4(), **mtp.state_dict_v4()}.items():
        if t.is_floating_point():
            t = t.float() if any(key in name for key in FP32_NAMES) else t.bfloat16()
        out[name] = t.contiguous()
    return out


def save_checkpoint(out: Path, config: V4Config, target: TinyV4Target, mtp: TinyV4Mtp) -> int:
    """Write config.json and model.safetensors; returns the safetensors size in bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    meta = config.to_dict()
    meta["tokenizer"] = "byte"
    meta["model_type"] = "deepseek_v4_tiny"
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    save_file(checkpoint_tensors(target, mtp), str(out / "model.safetensors"))
    return (out / "model.safetensors").stat().st_size


@torch.no_grad()
def evaluate(
    target: TinyV4Target, mtp: TinyV4Mtp, stream: torch.Tensor, *, seq_len: int = 512, num_windows: int = 48
) -> dict:
    """Teacher-forced metrics on evenly spaced windows of ``stream``.

    target_accuracy: argmax target at t == token t+1. mtp_agreement: argmax MTP at (t, t+1) ==
    argmax target at t+1 (first-position acceptance of greedy speculative decoding).
    mtp_accuracy: argmax MTP at (t, t+1) == token t+2.
    """
    starts = torch.linspace(0, len(stream) - seq_len - 2, num_windows).long().tolist()
    hits = {"target_accuracy": 0, "mtp_agreement": 0, "mtp_accuracy": 0}
    counts = {"target_accuracy": 0, "mtp_agreement": 0, "mtp_accuracy": 0}
    positions = torch.arange(seq_len)
    for s in starts:
        w = stream[s : s + seq_len + 1].long().unsqueeze(0)  # [1, T+1]
        logits, streams = target.forward_seq(w[:, :seq_len], positions)
        pred = logits.argmax(-1)  # [1, T]
        mtp_pred = mtp.forward_seq(streams, w[:, 1:], target.embed, target.head, positions).argmax(-1)
        hits["target_accuracy"] += (pred == w[:, 1:]).sum().item()
        counts["target_accuracy"] += seq_len
        # MTP at t pairs with the target at t+1, which exists for t < T-1 only.
        hits["mtp_agreement"] += (mtp_pred[:, :-1] == pred[:, 1:]).sum().item()
        counts["mtp_agreement"] += seq_len - 1
        hits["mtp_accuracy"] += (mtp_pred[:, :-1] == w[:, 2:]).sum().item()
        counts["mtp_accuracy"] += seq_len - 1
    metrics = {k: hits[k] / counts[k] for k in hits}
    metrics["eval_positions"] = counts["target_accuracy"]
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=18.0, help="training wall-time budget")
    parser.add_argument("--out", type=Path, default=Path("tools/data/tiny_v4"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--mtp-weight", type=float, default=0.5)
    parser.add_argument("--mtp-depth", type=int, default=1, help="MTP steps chained in the loss (draft positions)")
    parser.add_argument("--freeze-target", action="store_true", help="train the MTP only (use with --init)")
    parser.add_argument("--init", type=Path, default=None, help="warm-start from this checkpoint folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    wall = time.perf_counter()
    root, files = stdlib_files()
    train_files = [f for f in files if not is_held_out(f)]
    eval_files = [f for f in files if is_held_out(f)]
    train_stream, eval_stream = token_stream(root, train_files), token_stream(root, eval_files)
    print(
        f"data: {root} {len(train_files)} train files ({len(train_stream):,} tokens), "
        f"{len(eval_files)} held out ({len(eval_stream):,} tokens)"
    )

    init = None
    if args.init is not None:
        config, *init = load_init(args.init)
        print(f"init: {args.init} (its sizes; optimizer fresh)")
    else:
        config = tiny_config()
    target, mtp, history = train(
        config,
        train_stream,
        args.minutes * 60,
        seed=args.seed,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        mtp_weight=args.mtp_weight,
        init=None if init is None else tuple(init),
        mtp_depth=args.mtp_depth,
        freeze_target=args.freeze_target,
    )
    train_s = history[-1]["t"] if history else 0.0
    size = save_checkpoint(args.out, config, target, mtp)
    if size > MAX_CHECKPOINT_BYTES:
        raise SystemExit(f"model.safetensors: expected at most {MAX_CHECKPOINT_BYTES} bytes, got {size}")

    # Evaluate what was committed: the bf16 checkpoint, with bf16 activations as at inference.
    _, target_bf16, mtp_bf16 = load_tiny_checkpoint(args.out)
    metrics = evaluate(target_bf16, mtp_bf16, eval_stream)
    tail = history[-50:]
    metrics.update(
        steps=len(history),
        train_seconds=round(train_s, 1),
        final_ce_target=sum(h["ce_target"] for h in tail) / max(len(tail), 1),
        final_ce_mtp=sum(h["ce_mtp"] for h in tail) / max(len(tail), 1),
        safetensors_bytes=size,
        num_parameters=sum(p.numel() for m in (target, mtp) for p in m.parameters()),
        train_files=len(train_files),
        eval_files=len(eval_files),
        seed=args.seed,
        wall_seconds=round(time.perf_counter() - wall, 1),
        command="python benchmarks/train_tiny.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    if args.init is not None and (args.init / "metrics.json").exists():
        # A warm start's lineage: the run it continued (its command, steps and seconds).
        before = json.loads((args.init / "metrics.json").read_text())
        metrics["init"] = {k: before[k] for k in ("command", "steps", "train_seconds", "init") if k in before}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(
        f"target next-token accuracy {metrics['target_accuracy']:.4f}, MTP first-position agreement "
        f"{metrics['mtp_agreement']:.4f}, MTP accuracy {metrics['mtp_accuracy']:.4f}; "
        f"{size / 1e6:.2f} MB, {len(history)} steps in {train_s:.0f} s -> {args.out}"
    )


if __name__ == "__main__":
    main()
