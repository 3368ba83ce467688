"""Benchmark of the draft step at the real DeepSeek-V4-Flash shapes (GPU), one table.

    python tools/bench_draft.py [--config flash|small] [--no-compile] [--out DIR]

Random bf16 weights (~15 GB on the device) in one process. For each case (B=1 with
K=1 and K=3; B=8 and B=32 with K=1) it prints the floor (weight bytes / measured
copy bandwidth), then ms and the ratio to the floor for: plain torch eager (a
functional step over the nn.Module V4 block: the anchor's "plain torch code"),
the same captured by hand into a CUDA graph, torch.compile (max-autotune-no-cudagraphs)
captured by hand, the draftgraph eager executor, and the draftgraph captured replay;
plus host time per propose, capture time, graph-pool bytes and kernel nodes per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.config import V4Config  # noqa: E402
from tools.bench_floor import measure_copy_bandwidth, step_weight_bytes  # noqa: E402

CASES = [(1, 1), (1, 3), (8, 1), (32, 1)]


def random_weights(cfg: V4Config, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the graph's layout, made on the device (experts stacked directly)."""
    from runtime.weight_names import MTP_TENSOR_NAMES

    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    e, inter, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for w, shape in (("w1", (e, inter, d)), ("w2", (e, d, inter)), ("w3", (e, inter, d))):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        for i in range(e):  # chunked so no fp32 temporary of 4 GB is needed
            t[i].normal_(0, 1 / shape[2] ** 0.5, generator=gen)
        out[f"mtp.0.ffn.experts.stacked.{w}"] = t
    for entry in MTP_TENSOR_NAMES(cfg):
        if ".experts." in entry.name and ".shared_experts." not in entry.name:
            continue
        shape = entry.shape
        if entry.kind == "int32":
            out[entry.name] = torch.randint(0, cfg.n_routed_experts, shape, device=device, dtype=torch.int32)
            continue
        dtype = torch.float32 if entry.kind == "fp32" else torch.bfloat16
        t = torch.empty(shape, dtype=dtype, device=device)
        if entry.name.endswith(("norm.weight",)):
            t.fill_(1.0).add_(torch.randn(shape, device=device, generator=gen, dtype=dtype), alpha=0.05)
        elif "hc_" in entry.name and entry.name.endswith("_fn"):
            t.normal_(0, 0.02, generator=gen)
        elif entry.name.endswith(("_scale",)):
            t.fill_(1.0)
        elif len(shape) == 2:
            t.normal_(0, 1 / shape[1] ** 0.5, generator=gen)
        else:
            t.normal_(0, 1.0, generator=gen)
        out[entry.name] = t
    return out


def time_cuda(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median ms of ``fn`` timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def capture(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class PlainTorchStep:
    """The draft step in plain torch (no graph runtime): the anchors' "plain torch code"."""

    def __init__(self, cfg, weights, cache_kv, device):
        from runtime.runners.v4_block_module import V4Block

        self.cfg, self.w = cfg, weights
        block = V4Block(cfg)
        block.load_block(weights, "mtp.0.")
        self.block = block.to(device).eval()
        # The MoE copies the chosen experts out before using them (the anchors' plain torch code).
        self.block.ffn.stacked = tuple(weights[f"mtp.0.ffn.experts.stacked.{w}"] for w in ("w1", "w2", "w3"))
        self.kv = cache_kv

    @torch.no_grad()
    def __call__(self, token, hidden, positions, kv_start, block_table):
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        tokens = []
        for k in range(self.k):
            e = torch.nn.functional.embedding(token, w["embed.weight"])
            e = _rms(e, w["mtp.0.enorm.weight"], eps)
            h = _rms(hidden, w["mtp.0.hnorm.weight"], eps)
            x = h @ w["mtp.0.h_proj.weight"].T + (e @ w["mtp.0.e_proj.weight"].T).unsqueeze(1)
            x = self.block.decode(x, positions + k, self.kv, block_table, kv_start)
            flat = x.float().flatten(1)
            rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
            gate = torch.sigmoid((flat @ w["mtp.0.hc_head_fn"].T) * rho * w["mtp.0.hc_head_scale"]
                                 + w["mtp.0.hc_head_base"]) + cfg.hc_eps
            h_out = (gate.unsqueeze(-1) * x.float()).sum(1).bfloat16()
            logits = (_rms(h_out, w["mtp.0.norm.weight"], eps) @ w["head.weight"].T).float()
            token = logits.argmax(-1)
            tokens.append(token)
            hidden = x
        return torch.stack(tokens, -1)


def _rms(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def distinct_experts(prop, batch: int) -> int:
    """Experts the batch's MoE touches in the first draft step (read from an unaliased eager run)."""
    from runtime.executor import EagerExecutor

    graph = prop.chain_graph(1)
    ex = EagerExecutor(graph, batch, prop.weights, prop.state_tensors, device=prop.device, alias=False)
    staged = prop._staging_for(batch).graph_inputs()
    ex.run({n: staged[n] for n in ex.graph.inputs}, check=False)
    x = ex.bound["d0.body.ffn_norm"].float()
    s = torch.sqrt(torch.nn.functional.softplus(x @ prop.weights["mtp.0.ffn.gate.weight"].float().T))
    idx = torch.topk(s + prop.weights["mtp.0.ffn.gate.bias"], prop.config.num_experts_per_tok).indices
    return int(idx.unique().numel())


def kernel_nodes_per_step(executor, k: int) -> int | None:
    try:
        from tools.capture_dump import count_kernel_nodes
    except Exception:
        return None
    try:
        return count_kernel_nodes(executor) // k
    except Exception:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("flash", "small"), default="flash")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--compile-cases", default="1x1", help="cases for torch.compile, e.g. 1x1,8x1")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--fused", choices=("auto", "off"), default="auto", help="fused Triton kernels when present")
    ap.add_argument("--cases", default=",".join(f"{b}x{k}" for b, k in CASES), help="BxK cases, e.g. 1x1,1x3")
    args = ap.parse_args()
    if args.fused == "off":  # before any op is registered
        os.environ["DRAFTGRAPH_FUSED"] = "0"
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    from runtime.proposer import DeepseekV4MtpProposer

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = V4Config.flash() if args.config == "flash" else V4Config.small()
    cfg = cfg.replace(max_position_embeddings=4096)
    bandwidth = measure_copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write)",
          flush=True)
    t0 = time.perf_counter()
    weights = random_weights(cfg, device)
    torch.cuda.synchronize()
    print(f"weights {sum(t.numel() * t.element_size() for t in weights.values()) / 1e9:.1f} GB made in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    from runtime.draft_binding import prepare_weights

    weights = prepare_weights(cfg, weights, device)  # per-expert views of the stacks, for the nn.Module
    rows = []
    from tqdm import tqdm

    for batch, k in tqdm(cases, desc="cases", unit="case", file=sys.stderr):
        eager = DeepseekV4MtpProposer(cfg, weights, device=device, executor="eager", buckets=(batch,),
                                      num_cache_blocks=batch * 16)
        captured = DeepseekV4MtpProposer(cfg, weights, device=device, executor="captured", buckets=(batch,),
                                         num_cache_blocks=batch * 16)
        gen = torch.Generator(device=device).manual_seed(batch)
        hiddens = [torch.randn(cfg.hc_mult, cfg.hidden_size, device=device, generator=gen).bfloat16()
                   for _ in range(batch)]
        tokens = list(range(1, batch + 1))
        results = {}
        for name, prop in (("eager", eager), ("captured", captured)):
            states = [prop.alloc_state() for _ in range(batch)]
            positions = [200] * batch

            def propose(prop=prop, states=states, positions=positions):
                prop.after_verify(0, states[0]) if states[0].last_num_drafted else None
                for s in states[1:]:
                    if s.last_num_drafted:
                        prop.after_verify(0, s)
                if batch == 1:
                    return prop.propose(tokens[0], hiddens[0], positions[0], k, states[0])
                return prop.propose_batch(tokens, hiddens, positions, k, states)

            mem0 = torch.cuda.memory_reserved()
            start = time.perf_counter()
            first = propose()
            setup = time.perf_counter() - start
            pool = torch.cuda.memory_reserved() - mem0
            ms = time_cuda(propose, iters=30 if name == "eager" else 100)
            host = []
            for _ in range(50):
                propose()
                host.append(prop.last_host_seconds)
            results[name] = dict(ms=ms, host_us=statistics.median(host) * 1e6, setup_s=setup, pool=pool,
                                 drafts=first)
        assert results["eager"]["drafts"] == results["captured"]["drafts"], "captured != eager"
        ex = next(iter(captured._executors.values()))
        nodes = kernel_nodes_per_step(ex, k)
        experts = cfg.num_experts_per_tok if batch == 1 else distinct_experts(eager, batch)
        floor_bytes = sum(step_weight_bytes(cfg, experts, batch=batch).values()) * k
        floor_ms = floor_bytes / bandwidth * 1e3
        # Plain torch baselines over the same weights and cache.
        plain = PlainTorchStep(cfg, weights, captured.cache.kv, device)
        plain.k = k
        st = captured.alloc_state()
        captured.cache.ensure(st.table, 200, 200 + k)
        staged = captured._staging_for(batch).stage([(200, 0, st.table)] * batch, tokens, hiddens, cfg.vocab_size)
        inputs = (staged["token"], staged["hidden"], staged["positions"], staged["kv_start"], staged["block_table"])
        plain_ms = time_cuda(lambda: plain(*inputs), iters=10)
        graph = capture(lambda: plain(*inputs))
        plain_graph_ms = time_cuda(graph.replay)
        compile_ms = None
        if not args.no_compile and f"{batch}x{k}" in args.compile_cases.split(","):
            try:
                compiled = torch.compile(plain.__call__, mode="max-autotune-no-cudagraphs", dynamic=False)
                t = time.perf_counter()
                compiled(*inputs)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t
                cgraph = capture(lambda: compiled(*inputs))
                compile_ms = time_cuda(cgraph.replay)
                print(f"  torch.compile took {compile_s:.0f} s", flush=True)
            except Exception as exc:  # report, don't die: the other numbers still count
                print(f"  torch.compile failed: {type(exc).__name__}: {exc}", flush=True)
        captured.free_state(st)
        row = dict(batch=batch, k=k, experts=experts, floor_ms=floor_ms, plain_eager_ms=plain_ms,
                   plain_graph_ms=plain_graph_ms, compile_graph_ms=compile_ms, eager_ms=results["eager"]["ms"],
                   captured_ms=results["captured"]["ms"], host_us=results["captured"]["host_us"],
                   capture_s=ex.capture_seconds, pool_mb=results["captured"]["pool"] / 2**20, nodes_per_step=nodes)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del eager, captured, plain, graph
        torch.cuda.empty_cache()
    print()
    print(f"fused kernels: {args.fused}")
    print(f"floor = weight bytes / {bandwidth / 1e12:.2f} TB/s measured; ratios are ms / floor")
    head = (f"{'B':>3} {'K':>2} {'exp':>4} {'floor ms':>9} {'torch eager':>12} {'torch graph':>12} "
            f"{'compile+graph':>14} {'dg eager':>10} {'dg captured':>12} {'host us':>8} {'capture s':>9} "
            f"{'pool MB':>8} {'nodes/step':>10}")
    print(head)

    def cell(ms, floor):
        return "-" if ms is None else f"{ms:.3f} {ms / floor:4.2f}x"

    for r in rows:
        f = r["floor_ms"]
        print(f"{r['batch']:>3} {r['k']:>2} {r['experts']:>4} {f:>9.3f} {cell(r['plain_eager_ms'], f):>12} "
              f"{cell(r['plain_graph_ms'], f):>12} {cell(r['compile_graph_ms'], f):>14} {cell(r['eager_ms'], f):>10} "
              f"{cell(r['captured_ms'], f):>12} {r['host_us']:>8.1f} {r['capture_s']:>9.2f} {r['pool_mb']:>8.1f} "
              f"{str(r['nodes_per_step']):>10}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"bench_draft_{args.config}_{args.cases.replace(',', '_')}.json"
    (Path(args.out) / name).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
