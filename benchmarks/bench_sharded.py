"""The sharded draft step (issue 29) on W GPUs, next to W=1: replay / propose ms against the per-rank floor.

    torchrun --nproc-per-node 2 benchmarks/bench_sharded.py [--cases 1x1,1x3,32x1] [--config flash] [--out DIR]
    torchrun --nproc-per-node 1 benchmarks/bench_sharded.py            # the W=1 row, same script, same weights
    python benchmarks/bench_sharded.py --cpu-dry-run                   # 2 gloo ranks, small shapes, no timing
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_sharded.py --device cpu --config small  # torchrun path

Each rank makes random bf16 weights for its shard only (runtime/model/sharding.py: its E/W experts,
its Vd/W head rows, the shared expert on rank 0; the rest replicated) on its GPU, builds the proposer
with the default process group (NCCL), and for each case (B, K) times:

- replay ms: the captured chain alone (rounds of 20 replays queued back to back, median of 15);
- propose ms: a whole propose_batch call (checks, staging, replay, read-back);
- comm us: the step's collectives alone (the MoE's fp32 [B, D] all-reduce and the argmax's [B, 3]
  all-gather, K of each), captured into one graph and replayed the same way;
- the per-rank floor: the bytes the rank's own bound chain reads (its weights' specs; the experts
  the batch routes to THIS rank, counted from the router; its head rows; the KV window) over the
  copy bandwidth measured on its GPU in the same run.

The step waits for its slowest rank, so each figure is the max over the ranks (an all-reduce MAX).
Target (issue 29): replay <= 1.3x the per-rank floor at B=1, collectives included. The spec-only
part (``--floors``: per-rank floor bytes at V4-Flash shapes in the checkpoint's formats, W = 1, 2, 4,
8) needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_floor import step_weight_bytes  # beside this script (its folder is first on the path)
from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain
from draftgraph.graphs.v4_block import CacheGeometry, Numerics, checkpoint_formats
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.sharding import ShardPlan
from draftgraph.runtime.model.weight_names import MTP_TENSOR_NAMES

CASES = "1x1,1x3,32x1"


def rank_floor_bytes(cfg: V4Config, plan: ShardPlan | None, batch: int, local_experts: float, graph=None,
                     fmt: str = "mxfp4") -> dict[str, int]:
    """Bytes one step reads on one rank, by group, from the specs of ``graph`` (default: the rank's chain in
    checkpoint format ``fmt``): ``local_experts`` of its stacked experts, all its head rows."""
    if graph is None:
        numerics = Numerics(checkpoint_formats(cfg, fmt) if fmt != "bf16" else ())
        geometry = CacheGeometry(num_slots=cfg.sliding_window + 16, max_blocks_per_seq=1)
        graph = build_draft_chain(cfg, geometry, ChainSpec(numerics=numerics, shard=plan))
    world = plan.world if plan is not None else 1
    # step_weight_bytes scales the stack by n / E: the rank's stack holds E / W experts
    return step_weight_bytes(cfg, distinct_experts=round(local_experts * world), vocab_rows=cfg.vocab_size,
                             batch=batch, graph=graph)


def expected_local_experts(cfg: V4Config, world: int, batch: int) -> float:
    """Distinct experts a rank reads for a batch under uniform routing: (E/W) (1 - (1 - K/E)^B)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e / world * (1 - (1 - k / e) ** batch)


def print_floors(cfg: V4Config) -> None:
    """Per-rank floor bytes at V4-Flash shapes, checkpoint formats, uniform routing (spec-only)."""
    print("per-rank floor bytes (MB), checkpoint formats, experts by uniform routing; rank 0 (holds the shared expert)")
    for batch in (1, 32):
        for world in (1, 2, 4, 8):
            plan = ShardPlan.make(cfg, 0, world) if world > 1 else None
            groups = rank_floor_bytes(cfg, plan, batch, expected_local_experts(cfg, world, batch))
            print(f"  B={batch:<2} W={world}: {sum(groups.values()) / 1e6:8.1f}  " +
                  ", ".join(f"{k} {v / 1e6:.1f}" for k, v in groups.items()))


def shard_weights(cfg: V4Config, plan: ShardPlan | None, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights of this rank's shard only, made on ``device`` (experts stacked directly)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e0, e1 = plan.experts if plan is not None else (0, cfg.n_routed_experts)
    r0, r1 = plan.vocab_rows if plan is not None else (0, cfg.vocab_size)
    inter, d = cfg.moe_intermediate_size, cfg.hidden_size
    out = {}
    for w, shape in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
        t = torch.empty((e1 - e0, *shape), dtype=torch.bfloat16, device=device)
        for i in range(e1 - e0):  # one expert at a time: no fp32 temporary of the whole stack
            t[i].normal_(0, 1 / shape[1] ** 0.5, generator=gen)
        out[f"mtp.0.ffn.experts.stacked.{w}"] = t
    for entry in MTP_TENSOR_NAMES(cfg):
        if (".experts." in entry.name and ".shared_experts." not in entry.name) or \
                (plan is not None and not plan.holds(entry.name)):
            continue
        shape = (r1 - r0, d) if entry.name == "head.weight" else entry.shape
        dtype = torch.float32 if entry.kind == "fp32" else torch.bfloat16
        t = torch.empty(shape, dtype=dtype, device=device)
        if entry.name.endswith("norm.weight") or entry.name.endswith("_scale"):
            t.fill_(1.0)
        elif "hc_" in entry.name and entry.name.endswith("_fn"):
            t.normal_(0, 0.02, generator=gen)
        elif len(shape) == 2:
            t.normal_(0, 1 / shape[1] ** 0.5, generator=gen)
        else:
            t.normal_(0, 1.0, generator=gen)
        out[entry.name] = t
    return out


def local_experts_touched(prop, batch: int) -> int:
    """Experts of THIS rank the batch's first MoE routes to (the gate is replicated: every rank sees all)."""
    from draftgraph.runtime.execution.eager import EagerExecutor
    from draftgraph.runtime.proposer.sharding import runners_for

    ex = EagerExecutor(prop.chain_graph(1), batch, prop.weights, prop.state_tensors, device=prop.device, alias=False,
                       runners=runners_for(prop.rank_group))
    staged = prop._staging_for(batch).graph_inputs()
    ex.run({n: staged[n] for n in ex.graph.inputs}, check=False)
    x = ex.bound["d0.body.ffn_norm"].float()
    s = torch.sqrt(torch.nn.functional.softplus(x @ prop.weights["mtp.0.ffn.gate.weight"].float().T))
    idx = torch.topk(s + prop.weights["mtp.0.ffn.gate.bias"], prop.config.num_experts_per_tok).indices.unique()
    lo, hi = prop.shard.experts if prop.shard is not None else (0, prop.config.n_routed_experts)
    return int(((idx >= lo) & (idx < hi)).sum())


class Clock:
    """ms per call: CUDA events on a GPU, perf_counter on the CPU (the dry run: structure only)."""

    def __init__(self, device: torch.device, rounds: int, per_round: int):
        self.cuda, self.rounds, self.per_round = device.type == "cuda", rounds, per_round

    def ms(self, fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(self.rounds):
            if self.cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(self.per_round):
                fn()
            if self.cuda:
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / self.per_round)
            else:
                times.append((time.perf_counter() - t0) * 1e3 / self.per_round)
        return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Copy bandwidth in bytes/s (read + written), measured on this rank's device."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = Clock(device, 9, 2).ms(lambda: dst.copy_(src))
    return nbytes / (ms / 1e3)


def comm_fn(prop, batch: int, k: int):
    """The step's collectives alone, K times: the fp32 [B, D] all-reduce and the [B, 3] all-gather (CUDA: captured)."""
    group = prop.rank_group
    d, dev = prop.config.hidden_size, prop.device
    partial = torch.zeros(batch, d, device=dev)
    mine, gathered = torch.zeros(batch, 3, device=dev), torch.zeros(group.world * batch, 3, device=dev)
    from draftgraph.ops.collectives import _all_gather

    def run():
        for _ in range(k):
            dist.all_reduce(partial, group=group.group)
            _all_gather(gathered, mine, group=group.group)

    if dev.type != "cuda":
        return run
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def measure(cfg, weights, device, batch: int, k: int, dry: bool) -> dict:
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    prop = DeepseekV4MtpProposer(cfg, weights, device=device, process_group=group, buckets=(batch,),
                                 executor="eager" if device.type == "cpu" else "captured",
                                 num_cache_blocks=batch * 16)
    gen = torch.Generator(device=device).manual_seed(batch)
    hiddens = torch.randn(batch, cfg.hc_mult, cfg.hidden_size, device=device, generator=gen).bfloat16()
    states = [prop.alloc_state() for _ in range(batch)]
    tokens = list(range(1, batch + 1))

    def propose():
        if states[0].last_num_drafted:
            prop.after_verify_batch([0] * batch, states)
        return prop.propose_batch(tokens, hiddens, [200] * batch, k, states)

    drafts = propose()
    clock = Clock(device, 3 if dry else 15, 1 if dry else 20)
    executor = prop._plan(batch, k, False).executor
    row = {"B": batch, "K": k, "drafts": drafts[0]}
    row["replay_ms"] = clock.ms(executor.replay if hasattr(executor, "replay") else
                                lambda: executor.run(prop._staging_for(batch).chain_inputs(None), check=False))
    row["propose_ms"] = Clock(device, 3 if dry else 50, 1).ms(propose)
    row["comm_us"] = clock.ms(comm_fn(prop, batch, k)) * 1e3 if prop.rank_group is not None else 0.0
    touched = local_experts_touched(prop, batch)
    groups = rank_floor_bytes(cfg, prop.shard, batch, touched, graph=prop.chain_graph(1))
    row["floor_bytes"] = k * sum(groups.values())  # K steps, each reads the weights again
    row["local_experts"] = touched
    return row


def max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank_main(args, device: torch.device) -> list[dict]:
    cfg = V4Config.small() if args.config == "small" else V4Config.flash()
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = ShardPlan.make(cfg, rank, world) if world > 1 else None
    weights = shard_weights(cfg, plan, device)
    bandwidth = copy_bandwidth(device, 4 << 30 if device.type == "cuda" else 64 << 20)
    rows = []
    for case in args.cases.split(","):
        batch, k = (int(v) for v in case.split("x"))
        row = measure(cfg, weights, device, batch, k, device.type == "cpu")
        row["floor_ms"] = row["floor_bytes"] / bandwidth * 1e3
        for key in ("replay_ms", "propose_ms", "comm_us", "floor_ms", "floor_bytes"):
            row[key] = max_over_ranks(row[key], device)  # the step waits for its slowest rank
        row["ratio"] = row["replay_ms"] / row["floor_ms"]
        row["W"] = world
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'W':>2} {'B':>3} {'K':>2} {'floor MB':>9} {'floor ms':>9} {'replay ms':>10} {'x floor':>8} "
          f"{'comm us':>8} {'propose ms':>11}")
    for r in rows:
        print(f"{r['W']:>2} {r['B']:>3} {r['K']:>2} {r['floor_bytes'] / 1e6:>9.1f} {r['floor_ms']:>9.3f} "
              f"{r['replay_ms']:>10.3f} {r['ratio']:>8.2f} {r['comm_us']:>8.1f} {r['propose_ms']:>11.3f}")


def _spawned(rank: int, world: int, folder: str, args) -> None:
    """A --cpu-dry-run rank: gloo over a file rendezvous (torchrun needs no network here either)."""
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        rows = rank_main(args, torch.device("cpu"))
        if rank == 0:
            print_rows(rows)
            if rows and not all(r["floor_bytes"] > 0 and r["replay_ms"] > 0 for r in rows):
                raise SystemExit("dry run: a row without a floor or a time")
    finally:
        dist.destroy_process_group()
    # Out without the interpreter's teardown: there, after the rows and the group's destruction,
    # about one rank in six aborted in torch's C++ ("terminate called without an active exception",
    # no Python frame; torch 2.13, gloo) and failed a dry run that had done all its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=CASES, help="BxK cases, comma-separated (default %(default)s)")
    p.add_argument("--config", choices=("flash", "small"), default="flash")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON into this folder (rank 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (NCCL, one GPU a rank: LOCAL_RANK) or cpu (gloo: checks the torchrun path, no timing)")
    p.add_argument("--floors", action="store_true", help="print the per-rank floor bytes at V4-Flash shapes and exit")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="2 gloo ranks on the CPU at the small config: checks the script, times nothing meaningful")
    args = p.parse_args(argv)
    if args.floors:
        print_floors(V4Config.flash())
        return 0
    if args.cpu_dry_run:
        import torch.multiprocessing as mp

        args.config = "small"
        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(_spawned, args=(2, folder, args), nprocs=2, start_method="spawn")
        return 0
    from draftgraph.runtime.proposer.sharding import process_group_from_env

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    process_group_from_env(device)
    try:
        rows = rank_main(args, device)
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            print(f"# {name} x {dist.get_world_size()}, config {args.config}, bf16 weights")
            print_rows(rows)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                path = args.out / f"bench_sharded_w{dist.get_world_size()}.json"
                path.write_text(json.dumps(rows, indent=1, default=str))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
