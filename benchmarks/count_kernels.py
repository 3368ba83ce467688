"""Count the aten ops each graph node runs in one draft step: a CPU proxy for CUDA kernel launches.

    python benchmarks/count_kernels.py [--drafts K] [--batch B] [--masked] [--ops] [--device cuda]
                                       [--weights bf16|native]

Builds a ``DeepseekV4MtpProposer`` on ``V4Config.small()`` with random weights
(``executor="eager", kernels="torch"``: the torch reference ops), runs one
propose of K drafts on CPU under a ``TorchDispatchMode`` and attributes every
aten op to the graph node running at the time (through the executor's
``tracer`` hook). The table has one row per op type, per draft step (counts
over the K-draft chain divided by K):

- ``compute``: ops that launch a kernel on CUDA (math, copies, fills, index ops);
- ``views``: ops whose every output aliases an input (view, slice, expand, ...):
  metadata only, no kernel;
- ``alloc``: ``empty*``: an allocation, no kernel (a caching-allocator hit on CUDA).

A host sync inside an op (``_local_scalar_dense``, i.e. ``.item()``) is reported
as an error: the op contract forbids it. The counts are a proxy: dispatch sees
ops after CompositeImplicit decompositions, which are mostly, but not always,
the same on CPU and CUDA (e.g. ``lm_head`` widens the head in chunks on CPU
only, and some CPU kernels are composite where CUDA has one fused kernel).
With ``--ops`` each op type also lists its aten ops and their counts.
``--weights native`` holds the same random weights in the checkpoint's formats (FP8 linears,
MXFP4 routed experts: ``weights="native"``), so the torch ops' dequantisation counts too. The
fused kernels' launches per step are ``bench_draft.py``'s ``nodes/step`` (captured, on a GPU).

Example
-------
    $ python benchmarks/count_kernels.py
    op              nodes  compute  views  alloc  compute/node
    hc_pre              2      ...
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import torch
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import quantize_weight
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.model.weight_names import linear_kind
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from torch.utils._python_dispatch import TorchDispatchMode

OUTSIDE = "(outside ops)"  # staging and read-back around the chain, not part of a draft step
HOST_SYNC = {"_local_scalar_dense"}


def classify(func) -> str:
    """'view', 'alloc' or 'compute' for one aten overload."""
    name = func.overloadpacket.__name__
    if name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"):
        return "alloc"
    returns = func._schema.returns
    tensors = [r for r in returns if "Tensor" in str(r.type)]
    if not tensors:
        return "view"  # sym sizes, strides, ...: metadata
    if all(r.alias_info is not None and not r.alias_info.is_write for r in tensors):
        return "view"
    if name in ("_unsafe_view", "alias", "detach"):
        return "view"
    return "compute"


class AtenCounter(TorchDispatchMode):
    """Counts aten ops by (graph node, op); use as the executor's tracer and as a dispatch mode."""

    def __init__(self) -> None:
        super().__init__()
        self.node = None
        self.counts: dict = defaultdict(Counter)  # (node name, op) or OUTSIDE -> Counter of OpOverloads
        self.syncs: list[str] = []

    # executor tracer hooks
    def begin(self, node) -> None:
        self.node = node

    def end(self, node) -> None:
        self.node = None

    def slice(self, *args, **kwargs) -> None:
        pass

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        key = (self.node.name, self.node.op) if self.node is not None else OUTSIDE
        self.counts[key][func] += 1
        if name in HOST_SYNC and self.node is not None:
            self.syncs.append(f"%{self.node.name} ({self.node.op}): aten.{name}")
        return func(*args, **(kwargs or {}))


def stored_weights(cfg: V4Config, seed: int, weights: str) -> dict:
    """Random MTP weights, bf16, or ``weights="native"``: each linear in the real checkpoint's format."""
    tensors = random_mtp_weights(cfg, seed=seed)
    if weights == "bf16":
        return tensors
    return {n: quantize_weight(t, linear_kind(n)) if linear_kind(n) else t for n, t in tensors.items()}


def count_draft_step(
    drafts: int = 1, batch: int = 1, masked: bool = False, seed: int = 0, device: str = "cpu", weights: str = "bf16"
) -> AtenCounter:
    """Run one propose of ``drafts`` tokens for ``batch`` sequences under an AtenCounter."""
    cfg = V4Config.small()
    prop = DeepseekV4MtpProposer(
        cfg, stored_weights(cfg, seed, weights), executor="eager", kernels="torch", buckets=(batch,), device=device,
        weights=weights,
    )
    gen = torch.Generator().manual_seed(seed)
    states = [prop.alloc_state() for _ in range(batch)]
    hiddens = [
        torch.randn(cfg.hc_mult, cfg.hidden_size, generator=gen).to(device, torch.bfloat16) for _ in range(batch)
    ]
    tokens, positions = list(range(1, batch + 1)), [20] * batch
    mask = [-1] * ((cfg.vocab_size + 31) // 32) if masked else None

    def run():
        if batch == 1:
            prop.propose(tokens[0], hiddens[0], positions[0], drafts, states[0], grammar_bitmask=mask)
        else:
            prop.propose_batch(tokens, hiddens, positions, drafts, states)

    # Warm-up: builds and plans the executor outside the count.
    run()
    for s in states:
        prop.free_state(s)
    states[:] = [prop.alloc_state() for _ in range(batch)]
    counter = AtenCounter()
    prop.tracer = counter
    with counter:
        run()
    return counter


def summarize(counter: AtenCounter, drafts: int) -> list[tuple]:
    """Rows (op, nodes per step, compute, views, alloc, aten Counter) per draft step, by compute desc."""
    by_op: dict[str, dict] = {}
    for key, ops in counter.counts.items():
        if key == OUTSIDE:
            continue
        row = by_op.setdefault(key[1], {"nodes": 0, "aten": Counter()})
        row["nodes"] += 1
        row["aten"].update(ops)
    rows = []
    for op, row in by_op.items():
        kinds = Counter()
        for func, n in row["aten"].items():
            kinds[classify(func)] += n
        rows.append(
            (
                op,
                row["nodes"] / drafts,
                kinds["compute"] / drafts,
                kinds["view"] / drafts,
                kinds["alloc"] / drafts,
                row["aten"],
            )
        )
    rows.sort(key=lambda r: (-r[2], r[0]))
    return rows


def format_table(rows: list[tuple], drafts: int, show_ops: bool = False) -> str:
    def num(x: float) -> str:
        return f"{x:g}"

    lines = [f"{'op':<16}{'nodes':>6}{'compute':>9}{'views':>7}{'alloc':>7}{'compute/node':>14}"]
    total = Counter()
    for op, nodes, compute, views, alloc, aten in rows:
        lines.append(
            f"{op:<16}{num(nodes):>6}{num(compute):>9}{num(views):>7}{num(alloc):>7}"
            f"{num(round(compute / nodes, 1)):>14}"
        )
        total.update({"nodes": nodes, "compute": compute, "views": views, "alloc": alloc})
        if show_ops:
            for func, n in aten.most_common():
                name = f"{func.overloadpacket.__name__}.{func._overloadname}"
                lines.append(f"    {name:<30}{classify(func):>8}{num(n / drafts):>6}")
    lines.append(
        f"{'total / step':<16}{num(total['nodes']):>6}{num(total['compute']):>9}"
        f"{num(total['views']):>7}{num(total['alloc']):>7}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafts", type=int, default=1, help="K, drafts in the chain (counts are per step)")
    parser.add_argument("--batch", type=int, default=1, help="B, sequences in the propose")
    parser.add_argument("--masked", action="store_true", help="with a grammar bitmask (B=1 only)")
    parser.add_argument("--ops", action="store_true", help="list the aten ops of each op type")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: the aten ops the GPU runs")
    parser.add_argument("--weights", choices=("bf16", "native"), default="bf16",
                        help="bf16 (default) or native: FP8 linears and MXFP4 experts, as stored")
    args = parser.parse_args(argv)
    if args.masked and args.batch != 1:
        parser.error("--masked needs --batch 1 (propose_batch takes no grammar bitmask)")
    counter = count_draft_step(args.drafts, args.batch, args.masked, device=args.device, weights=args.weights)
    cfg = V4Config.small()
    print(
        f"aten ops per draft step: V4Config.small() (D={cfg.hidden_size}, iters={cfg.hc_sinkhorn_iters}), "
        f"B={args.batch}, K={args.drafts}{', masked' if args.masked else ''}, kernels=torch, {args.device}, "
        f"{args.weights} weights"
    )
    print(format_table(summarize(counter, args.drafts), args.drafts, args.ops))
    if counter.syncs:
        print("host syncs inside ops (forbidden by the op contract):\n  " + "\n  ".join(counter.syncs))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
