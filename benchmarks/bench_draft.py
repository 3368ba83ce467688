"""Benchmark of the draft step at the real DeepSeek-V4-Flash shapes (GPU), one table.

    python benchmarks/bench_draft.py [--cases 1x1,1x3,8x1,32x1] [--kernels torch,compiled,fused]
                                [--weights native,bf16] [--no-compile] [--profile] [--config flash|small]
                                [--out DIR]
    python benchmarks/bench_draft.py --cpu-dry-run    # the weights, floors and kernel choice on CPU, no timing

Random weights, one process: bf16 (~15 GB on the device) and, with ``--weights native``, the
same draws in the checkpoint's formats (~5.7 GB: FP8 linears with 128x128 UE8M0 scales, MXFP4
routed experts with 1x32 scales, as ``weights="native"`` binds them; issue 28). For each case
(B=1 with K=1 and K=3; B=8 and B=32 with K=1) and weights format the floor is the bytes the step
must read, from the specs of the chain the proposer binds (so in that format; the distinct
experts the batch touches counted from the router) over the copy bandwidth measured in the same
run. Rows, each as ms and the ratio to the floor:

- plain torch: the same step as a functional program over an nn.Module V4 block
  (no graph runtime), eager; captured by hand into a CUDA graph; and
  torch.compile(mode="max-autotune-no-cudagraphs") of one draft step, run K times and
  captured by hand (the strongest stock-PyTorch baseline; compiled once per batch size,
  100-200 s each: set TORCHINDUCTOR_CACHE_DIR to a kept folder and a second run reuses it);
- draftgraph: the eager executor (torch ops), and the captured replay with each
  kernel set: the torch ops, the torch ops compiled per op, the fused Triton kernels
  (on native weights: fp8_gemv and moe_mxfp4 for the nodes reading them).

The plain-torch rows run on the bf16 weights only (its nn.Module reads bf16).

"replay ms" is the GPU time of the graph replay alone (CUDA events around rounds of
20 replays queued back to back, inputs already staged; median of 15 rounds); "propose ms" is what
a decode loop's caller waits a round, by CUDA events: the after_verify of each row and a whole propose
call (checks, staging copy, replay, reading the K tokens back; median of 100 rounds);
"host µs" is the CPU time of a propose up to the launch (the same rounds). Also: the
capture time, the device memory the first propose added (arena, staging and graph
pool), and CUDA-graph kernel nodes per draft step. ``--profile`` adds, for each case,
each captured variant's kernels by name and, at K=1, each step's time alone
(benchmarks/profile_step.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_floor import measure_copy_bandwidth, step_weight_bytes
from bench_host import WARMUP_ROUNDS, time_phases
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import MXFP4_DATA_DTYPE, QuantWeight, quantize_mxfp4, quantize_weight
from draftgraph.runtime.model.weight_names import linear_kind

CASES = [(1, 1), (1, 3), (8, 1), (32, 1)]


def random_weights(cfg: V4Config, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the graph's layout, made on the device (experts stacked directly)."""
    from draftgraph.runtime.model.weight_names import MTP_TENSOR_NAMES

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


WEIGHTS = ("native", "bf16", "native-fp8head", "native-w8a8")
# format -> the proposer's options: native-fp8head is native with the draft head quantised to FP8 at load
# (head_dtype="fp8", issue 28.5), native-w8a8 native with the reference's W8A8 numerics
# (activations="fp8", issue 28.4); both on the same weight set as native.
PROPOSER_FORMAT = {"native": {"weights": "native"}, "bf16": {"weights": "bf16"},
                   "native-fp8head": {"weights": "native", "head_dtype": "fp8"},
                   "native-w8a8": {"weights": "native", "activations": "fp8"}}
ON_NATIVE = ("native", "native-fp8head", "native-w8a8")  # the formats that read the native weight set


def native_weights(cfg: V4Config, bf16: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | QuantWeight]:
    """The same draws in the checkpoint's formats: each FP8 linear quantised, the stacked experts MXFP4.

    Quantised on the device expert by expert (no bf16 copy of a stack beyond one expert), so the two
    formats' rows compare the same model up to the quantisation.
    """
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for name, t in bf16.items():
        if ".experts.stacked." in name:
            out[name] = _mxfp4_stack(t)
        elif linear_kind(name) is not None:  # every linear the checkpoint quantises outside the experts is FP8
            out[name] = quantize_weight(t, "fp8")
        else:
            out[name] = t
    return out


def _mxfp4_stack(stack: torch.Tensor) -> QuantWeight:
    e, rows, cols = stack.shape
    data = torch.empty(e, rows, cols // 2, dtype=torch.uint8, device=stack.device)
    scale = torch.empty(e, rows, cols // 32, dtype=torch.uint8, device=stack.device)
    for i in range(e):
        packed, s = quantize_mxfp4(stack[i])
        data[i].copy_(packed.view(torch.uint8))
        scale[i].copy_(s.view(torch.uint8))
    return QuantWeight(data.view(MXFP4_DATA_DTYPE), scale.view(torch.float8_e8m0fnu), "mxfp4")


def weights_nbytes(weights: dict) -> int:
    seen, total = set(), 0
    for t in weights.values():
        for part in (t.data, t.scale) if isinstance(t, QuantWeight) else (t,):
            key = part.untyped_storage().data_ptr()
            if key not in seen:  # per-expert views share their stack's storage
                seen.add(key)
                total += part.untyped_storage().nbytes()
    return total


def timed_rounds(fn, rounds: int, per_round: int = 1, warmup: int = 5) -> list[float]:
    """ms per call of ``fn`` in each round of ``per_round`` calls between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_round):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / per_round)
    return times


def time_cuda(fn, iters: int = 50) -> float:
    """Median ms of ``fn`` timed call by call (a propose: its sync is part of it)."""
    return statistics.median(timed_rounds(fn, iters))


def time_replays(replay, per_round: int = 20, rounds: int = 15) -> tuple[float, float]:
    """(median ms per replay, spread) of graph replays launched back to back.

    Each round times ``per_round`` replays queued without a sync between them, so the GPU
    never waits for the host and the time is the graph's own (a replay timed alone also
    counts the gap between the start event and the graph's first kernel). The spread,
    (max - min) / median over the rounds, is the noise a difference must beat.
    """
    times = timed_rounds(replay, rounds, per_round)
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


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
    """The draft step in plain torch (no graph runtime): the anchors' "plain torch code".

    ``step`` is one draft (embed ... argmax) and returns what the next one reads, so
    ``torch.compile`` compiles it once per batch size and every K runs the same code.
    """

    def __init__(self, cfg, weights, device):
        from draftgraph.runtime.model.v4_block_module import V4Block

        self.cfg, self.w = cfg, weights
        with torch.device("meta"):  # no random init of 15 GB of parameters: load_block replaces them all
            block = V4Block(cfg)
        block = block.to_empty(device=device)
        block.load_block(weights, "mtp.0.")
        self.block = block.eval()
        # The MoE copies the chosen experts out before using them (the anchors' plain torch code).
        self.block.ffn.stacked = tuple(weights[f"mtp.0.ffn.experts.stacked.{w}"] for w in ("w1", "w2", "w3"))

    @torch.no_grad()
    def step(self, token, hidden, positions, kv, kv_start, block_table):
        """One draft: (next token, the streams, positions + 1)."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        e = torch.nn.functional.embedding(token, w["embed.weight"])
        e = _rms(e, w["mtp.0.enorm.weight"], eps)
        h = _rms(hidden, w["mtp.0.hnorm.weight"], eps)
        x = h @ w["mtp.0.h_proj.weight"].T + (e @ w["mtp.0.e_proj.weight"].T).unsqueeze(1)
        x = self.block.decode(x, positions, kv, block_table, kv_start)
        flat = x.float().flatten(1)
        rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
        gate = torch.sigmoid((flat @ w["mtp.0.hc_head_fn"].T) * rho * w["mtp.0.hc_head_scale"]
                             + w["mtp.0.hc_head_base"]) + cfg.hc_eps
        h_out = (gate.unsqueeze(-1) * x.float()).sum(1).bfloat16()
        logits = (_rms(h_out, w["mtp.0.norm.weight"], eps) @ w["head.weight"].T).float()
        return logits.argmax(-1), x, positions + 1

    def chain(self, step, k, token, hidden, positions, kv, kv_start, block_table):
        """K drafts with ``step`` (``self.step`` or a compiled one): [B, K] tokens."""
        tokens = []
        for _ in range(k):
            token, hidden, positions = step(token, hidden, positions, kv, kv_start, block_table)
            tokens.append(token)
        return torch.stack(tokens, -1)


_PLAIN: dict[str, object] = {}  # one plain step and one compile of it per process (recompiled per batch size)


def _rms(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def distinct_experts(prop, batch: int) -> int:
    """Experts the batch's MoE touches in the first draft step (read from an unaliased eager run)."""
    from draftgraph.runtime.execution.eager import EagerExecutor

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
        from draftgraph.tools.capture_dump import count_kernel_nodes
    except Exception:
        return None
    try:
        return count_kernel_nodes(executor) // k
    except Exception:
        return None


VARIANTS = ("torch", "compiled", "fused")
# variant -> ProposerOptions.kernels; "fused-nopdl" is "fused" with programmatic dependent launch off,
# "torch-serial" is "torch" on one stream (no side-stream overlap: draftgraph.ops.overlap), "torch-noprio" is
# "torch" with every side lane at normal priority (DRAFTGRAPH_LANE_PRIORITY=0)
KERNELS_OPTION = {"torch": "torch", "torch-serial": "torch", "torch-noprio": "torch", "compiled": "compiled",
                  "fused": "auto", "fused-nopdl": "auto"}


@contextlib.contextmanager
def variant_setting(kernels: str):
    """The switches a variant turns: PDL off for "fused-nopdl" (read at launch: its capture keeps
    plain launches), lanes at normal priority for "torch-noprio" (read when the executor makes its lanes)."""
    if kernels == "torch-noprio":
        os.environ["DRAFTGRAPH_LANE_PRIORITY"] = "0"
        try:
            yield
        finally:
            del os.environ["DRAFTGRAPH_LANE_PRIORITY"]
        return
    if kernels != "fused-nopdl":
        yield
        return
    from draftgraph.ops.triton._common import set_pdl

    set_pdl(False)
    try:
        yield
    finally:
        set_pdl(None)


def make_proposer(cfg, weights, device, batch: int, executor: str, kernels: str, fmt: str):
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

    return DeepseekV4MtpProposer(cfg, weights, device=device, executor=executor, kernels=KERNELS_OPTION[kernels],
                                 buckets=(batch,), num_cache_blocks=batch * 16, overlap=kernels != "torch-serial",
                                 **PROPOSER_FORMAT[fmt])


def measure_proposer(cfg, weights, device, batch: int, k: int, executor: str, kernels: str, profile: bool,
                     fmt: str = "bf16"):
    """One proposer's row: replay / propose ms, host µs, capture s, memory, kernel nodes."""
    prop = make_proposer(cfg, weights, device, batch, executor, kernels, fmt)
    gen = torch.Generator(device=device).manual_seed(batch)
    hiddens = [torch.randn(cfg.hc_mult, cfg.hidden_size, device=device, generator=gen).bfloat16()
               for _ in range(batch)]
    tokens = list(range(1, batch + 1))
    states = [prop.alloc_state() for _ in range(batch)]

    proposed = []  # whether a propose awaits its verify: the loop's own flag, as an engine knows it
    # (reading a state's last_num_drafted here put ~1 us of the harness into the verify column)

    def reject():  # reject every draft: the same positions again
        if not proposed:
            return
        proposed.clear()
        if hasattr(prop, "after_verify_batch"):  # one call for the batch, as an engine verifies
            prop.after_verify_batch([0] * batch, states)
            return
        for s in states:  # trees before it: row by row
            prop.after_verify(0, s)

    def call():
        proposed.append(True)
        if batch == 1:
            return [prop.propose(tokens[0], hiddens[0], 200, k, states[0])]
        return prop.propose_batch(tokens, hiddens, [200] * batch, k, states)

    def propose():
        reject()
        return call()

    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    start = time.perf_counter()
    drafts = propose()
    torch.cuda.synchronize()
    # Held by the arena, the staging buffers and the graph pool (warm-up temporaries are freed).
    row = dict(setup_s=time.perf_counter() - start, mem_mb=(torch.cuda.memory_allocated() - allocated) / 2**20,
               drafts=drafts)
    # As an engine does after capturing (vLLM's model runner): move what setup made (Triton
    # and inductor caches, the graphs' objects) out of the collector's way before timing.
    gc.collect()
    gc.freeze()
    # Every host-side number of a round comes from one loop, so that all of them see the same
    # stretch of the host's time: the lent hosts have slow spells of seconds, and numbers taken in
    # separate loops disagreed by up to 2x (benchmarks/h200, the twentieth session's table).
    # A round: propose ms, the caller's wait for the loop's after_verify and the propose by CUDA
    # events around both (its sync is part of it); verify, the after_verify alone (host work); the
    # call alone; host, the proposer's own time up to the launch; and, from its timestamps, the wait
    # for the replay and the drafts' read-back, and the commit after it. The event us column is the
    # host cost of one event record, which propose ms holds beside verify and the call; the same
    # wait by the host's clock (verify and the call, no event inside) is propose by clock.
    # The warm-up is bench_host's (100 rounds, which took the cold first rounds out of its cases).
    # After 5 here the run's first case often came out slow in every phase of its host time (B=1
    # K=1 native at b6535a7 on an H100: 42 us before the launch, 22 in the third case); some of
    # that is the lent hosts' slow spells, which fall on whichever case runs in them (the
    # twentieth session reversed the cases) and which no warm-up removes.
    for _ in range(WARMUP_ROUNDS):
        propose()
    proposes, walls, host, calls, verifies, waits, commits = [], [], [], [], [], [], []
    for _ in range(10 if kernels == "torch" and executor == "eager" else 100):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        reject()
        verified = time.perf_counter()
        call()  # returns once the drafts are on the host: its read-back synchronizes
        returned = time.perf_counter()
        end.record()
        end.synchronize()
        proposes.append(begin.elapsed_time(end))
        walls.append(returned - start)
        calls.append(returned - verified)
        verifies.append(verified - start)
        host.append(prop.last_host_seconds)
        times = getattr(prop, "last_times", ())
        if len(times) == 4:
            waits.append(times[2] - times[1])
            commits.append(times[3] - times[2])
    row["propose_ms"], row["host_us"] = statistics.median(proposes), statistics.median(host) * 1e6
    row["propose_clock_ms"] = statistics.median(walls) * 1e3
    row["call_ms"], row["verify_us"] = statistics.median(calls) * 1e3, statistics.median(verifies) * 1e6
    event, records = torch.cuda.Event(enable_timing=True), []
    for _ in range(100):
        start = time.perf_counter()
        event.record()
        records.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    row["event_us"] = statistics.median(records) * 1e6
    if waits:
        row["wait_us"], row["commit_us"] = statistics.median(waits) * 1e6, statistics.median(commits) * 1e6
    if executor == "captured" and hasattr(prop, "_staging_for"):
        # The read-back alone on an idle GPU (the drafts' copy and its sync): wait - read - replay is
        # the launch's latency on an idle GPU.
        staging, drafts_out, reads = prop._staging_for(prop.buckets[0]), prop.last_outputs["drafts"], []
        for _ in range(100):
            torch.cuda.synchronize()
            start = time.perf_counter()
            staging.read_rows(drafts_out, batch)
            reads.append(time.perf_counter() - start)
        row["read_us"] = statistics.median(reads) * 1e6
    if batch > 1 and executor == "captured":
        # The hiddens as one [B, C, D] tensor, as vLLM and SGLang hold the target's: the same call,
        # checked and staged as one block (the list above costs host work per row).
        stacked, calls, host = torch.stack(hiddens), [], []
        for _ in range(100):
            reject()
            torch.cuda.synchronize()
            start = time.perf_counter()
            got = prop.propose_batch(tokens, stacked, [200] * batch, k, states)
            calls.append(time.perf_counter() - start)
            proposed.append(True)
            host.append(prop.last_host_seconds)
        if got != drafts:
            print(f"  MISMATCH: [B, C, D] hiddens drafted {got} != the list's {drafts}", flush=True)
        row["call_stacked_ms"], row["host_stacked_us"] = statistics.median(calls) * 1e3, statistics.median(host) * 1e6
    phases = time_phases(prop, propose, iters=30)
    row["host_phases_us"] = {name: round(us, 1) for name, us in phases.items()}
    gc.unfreeze()  # frozen objects are never collected: the bench frees proposers between cases
    if executor == "captured":
        ex = next(iter(prop._executors.values()))
        row["capture_s"] = ex.capture_seconds
        row["replay_ms"], row["replay_spread"] = time_replays(ex.replay)
        row["nodes_per_step"] = kernel_nodes_per_step(ex, k)
        if profile:
            from profile_step import kernel_table, print_kernel_table

            rows, busy = kernel_table(ex, k)
            print_kernel_table(f"B={batch} K={k} captured, kernels={kernels}", rows, busy,
                               row["replay_ms"] * 1e3 / k)
            if k == 1:
                from profile_step import op_table, print_op_table

                print_op_table(f"B={batch} K=1 steps alone, kernels={kernels}", op_table(ex), row["replay_ms"] * 1e3)
    else:
        row["replay_ms"] = row["propose_ms"]  # an eager run is its launches
    for s in states:
        prop.free_state(s)
    return row, prop


def plain_rows(cfg, weights, prop, batch: int, k: int, compile_baseline: bool):
    """Yield (name, ms) of the plain-torch anchors over ``prop``'s cache and staged inputs, as measured."""
    if "plain" not in _PLAIN:
        _PLAIN["plain"] = PlainTorchStep(cfg, weights, prop.device)
    plain = _PLAIN["plain"]
    st = prop.alloc_state()
    prop.cache.ensure(st.table, 200, 200 + k)
    hidden = torch.zeros(cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16, device=prop.device)
    rows = np.full(batch, st.row, dtype=np.int64)  # every row reads the one sequence's table at 200
    staged = prop._staging_for(batch).stage(prop.rows.tables, rows, np.full(batch, 200, dtype=np.int64),
                                            np.zeros(batch, dtype=np.int64), np.arange(1, batch + 1, dtype=np.int64),
                                            [hidden] * batch, cfg.vocab_size)
    inputs = (staged["token"], staged["hidden"], staged["positions"], prop.cache.kv, staged["kv_start"],
              staged["block_table"])

    def chain(step):
        return lambda: plain.chain(step, k, *inputs)

    yield "plain torch eager", time_cuda(chain(plain.step), iters=10)
    yield "plain torch, hand-captured graph", time_replays(capture(chain(plain.step)).replay)[0]
    if compile_baseline:
        ms = None
        try:
            if "compiled" not in _PLAIN:
                _PLAIN["compiled"] = torch.compile(plain.step, mode="max-autotune-no-cudagraphs", dynamic=False)
            t = time.perf_counter()
            chain(_PLAIN["compiled"])()
            torch.cuda.synchronize()
            print(f"  torch.compile of the step at B={batch} took {time.perf_counter() - t:.0f} s", flush=True)
            ms = time_replays(capture(chain(_PLAIN["compiled"])).replay)[0]
        except Exception as exc:  # report, don't die: the other numbers still count
            print(f"  torch.compile failed: {type(exc).__name__}: {exc}", flush=True)
        yield "torch.compile max-autotune + graph", ms
    prop.free_state(st)


def print_table(rows: list[dict], bandwidth: float) -> None:
    print(f"\nfloor = weight bytes / {bandwidth / 1e12:.2f} TB/s (copy bandwidth measured in this run)")
    # The weights column from the runs that had one (2026-12-05 on: native and bf16 side by side).
    has_fmt = any("weights" in r for r in rows)
    fmt_head = f" {'weights':>7}" if has_fmt else ""

    def fmt_cell(r: dict) -> str:  # the row's weight format, in both tables
        return f" {r.get('weights', 'bf16'):>7}" if has_fmt else ""
    print(f"{'B':>3} {'K':>2} {'exp':>4}{fmt_head} {'floor ms':>8}  {'variant':<36} {'replay ms':>9} "
          f"{'x floor':>7} "
          f"{'propose ms':>10} {'host us':>7} {'capture s':>9} {'mem MB':>7} {'nodes/step':>10} {'=torch':>6}")

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        x = None if r["replay_ms"] is None else r["replay_ms"] / r["floor_ms"]
        print(f"{r['batch']:>3} {r['k']:>2} {r['experts']:>4}{fmt_cell(r)} {r['floor_ms']:>8.3f}  {r['variant']:<36} "
              f"{num(r['replay_ms'], '.3f'):>9} {num(x, '.2f'):>7} {num(r.get('propose_ms'), '.3f'):>10} "
              f"{num(r.get('host_us'), '.0f'):>7} {num(r.get('capture_s'), '.2f'):>9} "
              f"{num(r.get('mem_mb'), '.0f'):>7} {num(r.get('nodes_per_step'), '.1f'):>10} "
              f"{num(r.get('agree'), '.2f'):>6}")
    bound = [r for r in rows if r.get("fused_native_nodes")]
    if bound:  # the nodes reading block-scaled weights and the impl each captured variant bound them to
        print("\nnodes reading block-scaled weights, by the impl bound (kernel_choice)")
        for r in bound:
            print(f"{r['batch']:>3} {r['k']:>2} {r['weights']:>7}  {r['variant']:<36} {r['fused_native_nodes']}")
    timed = [r for r in rows if r.get("call_ms") is not None and r["variant"] != "draftgraph eager executor, torch ops"]
    if timed:  # runs from 2026-12-05 on: the call alone and where the time after the launch goes
        print("\nthe propose call alone (what its caller waits; propose ms above also holds the loop's after_verify"
              " of each row),\nits host time up to the launch, the wait for the replay and the drafts' read-back, "
              "and the commit after it")
        print("(wait: from the launch to the drafts on the host; read: the read-back alone on an idle GPU;\n"
              " the hiddens as a list of B [C, D] tensors; B > 1 again as one [B, C, D] tensor: its call - replay "
              "and host)")
        print("(verify: the round's after_verify before the call; event: the host cost of recording a CUDA event,\n"
              " which propose ms holds once; all from the same rounds: propose - replay ~ call - replay + verify"
              " + event;\n by clock: verify and the call by the host's clock, what the caller waits without the"
              " events;\n launch: the graph's launch alone, the same driver call in every row: a row whose launch took"
              " 2-4x the run's\n quickest ran in a slow spell of the host, every host phase with it)")
        print(f"{'B':>3} {'K':>2}{fmt_head}  {'variant':<36} {'replay ms':>9} {'call ms':>8} {'call-replay us':>14} "
              f"{'host us':>7} {'launch us':>9} {'wait us':>7} {'read us':>7} {'commit us':>9} "
              f"{'[B,C,D] call-replay us':>22} {'host us':>7} {'verify us':>9} {'event us':>8} "
              f"{'by clock - replay us':>20}")
        for r in timed:
            stacked = r.get("call_stacked_ms")
            stacked_us = None if stacked is None else (stacked - r["replay_ms"]) * 1e3
            clock = r.get("propose_clock_ms")
            clock_us = None if clock is None else (clock - r["replay_ms"]) * 1e3
            launch_us = (r.get("host_phases_us") or {}).get("run")
            print(f"{r['batch']:>3} {r['k']:>2}{fmt_cell(r)}  {r['variant']:<36} {r['replay_ms']:>9.3f} "
                  f"{r['call_ms']:>8.3f} {(r['call_ms'] - r['replay_ms']) * 1e3:>14.0f} {r['host_us']:>7.0f} "
                  f"{num(launch_us, '.1f'):>9} {num(r.get('wait_us'), '.0f'):>7} {num(r.get('read_us'), '.0f'):>7} "
                  f"{num(r.get('commit_us'), '.0f'):>9} {num(stacked_us, '.0f'):>22} "
                  f"{num(r.get('host_stacked_us'), '.0f'):>7} {num(r.get('verify_us'), '.0f'):>9} "
                  f"{num(r.get('event_us'), '.1f'):>8} {num(clock_us, '.0f'):>20}")


def apply_kernel_configs(path: Path) -> dict[str, object]:
    """Set each ``module.KNOB`` of a bench_kernels.json's ``chosen_values`` (tile configs as dicts)."""
    import dataclasses
    import importlib

    chosen = json.loads(path.read_text()).get("chosen_values", {})
    for knob, value in chosen.items():
        module_name, attr = knob.rsplit(".", 1)
        module = importlib.import_module(module_name)
        current = getattr(module, attr)  # a knob the tree does not have is an error, not a no-op
        if dataclasses.is_dataclass(current):
            value = type(current)(**value)
        setattr(module, attr, value)
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("flash", "small"), default="flash")
    ap.add_argument("--cases", default=",".join(f"{b}x{k}" for b, k in CASES), help="BxK cases, e.g. 1x1,1x3")
    ap.add_argument("--kernels", default=",".join(VARIANTS),
                    help="captured variants: torch,compiled,fused (and fused-nopdl: PDL off; "
                         "torch-serial: the torch ops on one stream; torch-noprio: side lanes at normal priority)")
    ap.add_argument("--weights", default="native,bf16",
                    help="weights formats, side by side: native (FP8 linears + MXFP4 experts, as weights='native' "
                         "binds the checkpoint), bf16, native-fp8head (native with head_dtype='fp8'), "
                         "native-w8a8 (native with activations='fp8')")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--compile-cases", default=",".join(f"{b}x{k}" for b, k in CASES),
                    help="cases that get the torch.compile baseline (100-200 s of compiling per batch size)")
    ap.add_argument("--compiled-cases", default="1x1,1x3",
                    help="cases that get the compiled-ops variant (compiles each op per batch size)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-torch anchors")
    ap.add_argument("--profile", action="store_true", help="kernels by name for each case and captured variant")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="on CPU at the small config: make each weights format, build and run the eager proposer, "
                         "print the floors from the specs and which nodes take fused kernels on CUDA; no timing")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--kernel-configs", metavar="JSON",
                    help="set the kernels' tile configs a bench_kernels.py --tune run chose (its bench_kernels.json)")
    ap.add_argument("--table", metavar="JSON", help="print the table of a run's bench_draft_*.json and exit")
    args = ap.parse_args()
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        print_table(saved["rows"], saved["bandwidth"])
        return 0
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    formats = args.weights.split(",")
    if any(f not in WEIGHTS for f in formats):
        ap.error(f"--weights: expected a comma list of {' / '.join(WEIGHTS)}, got {args.weights!r}")
    if args.kernel_configs:
        for knob, value in apply_kernel_configs(Path(args.kernel_configs)).items():
            print(f"kernel config {knob} = {value}", flush=True)
    if args.cpu_dry_run:
        return dry_run(cases, formats)
    kernel_sets = args.kernels.split(",")
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = V4Config.flash() if args.config == "flash" else V4Config.small()
    cfg = cfg.replace(max_position_embeddings=4096)
    bandwidth = measure_copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s (read+write)", flush=True)
    real = sum(step_weight_bytes(cfg, fmt="mxfp4").values())
    print(f"floor in the checkpoint's formats (FP8 + MXFP4 experts + bf16 head), B=1 K=1: {real / 1e9:.3f} GB "
          f"= {real / bandwidth * 1e3:.3f} ms", flush=True)
    sets = make_weight_sets(cfg, device, formats)
    rows: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for batch, k in cases:
        t_case = time.perf_counter()
        for fmt in formats:
            weights = sets[fmt]
            row, prop = measure_proposer(cfg, weights, device, batch, k, "eager", "torch", False, fmt)
            reference = row["drafts"]
            experts = cfg.num_experts_per_tok if batch == 1 else distinct_experts(prop, batch)
            # From the specs of the chain the proposer binds: the formats its weights are held in.
            floor_ms = sum(step_weight_bytes(cfg, experts, batch=batch, graph=prop.chain_graph(1)).values()) \
                * k / bandwidth * 1e3

            def record(name, row, batch=batch, k=k, experts=experts, floor_ms=floor_ms, fmt=fmt):
                row = {key: v for key, v in row.items() if key != "drafts"}
                rows.append(dict(batch=batch, k=k, experts=experts, weights=fmt, floor_ms=floor_ms, variant=name,
                                 **row))
                print(json.dumps(rows[-1]), flush=True)  # as measured: a run cut short keeps what it had
                saved = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "bandwidth": bandwidth,
                         "rows": rows}
                (out / f"bench_draft_{args.config}.json").write_text(json.dumps(saved, indent=1))

            record("draftgraph eager executor, torch ops", row)
            for kernels in kernel_sets:
                if kernels == "compiled" and f"{batch}x{k}" not in args.compiled_cases.split(","):
                    continue
                try:
                    with variant_setting(kernels):
                        row, captured = measure_proposer(cfg, weights, device, batch, k, "captured", kernels,
                                                         args.profile, fmt)
                    row["fused_native_nodes"] = fused_native_nodes(captured)
                    del captured
                except Exception as exc:  # report, don't die: the other rows still count
                    print(f"  captured {kernels} ({fmt}) failed: {type(exc).__name__}: {exc}", flush=True)
                    continue
                finally:
                    gc.collect()
                    torch.cuda.empty_cache()
                # torch: the eager executor's kernels in the same order, so the drafts must be equal;
                # others: the share of drafts equal to the torch ops' (near-ties may differ).
                row["agree"] = sum(a == b for ra, rb in zip(row["drafts"], reference) for a, b in zip(ra, rb)) / (
                    batch * k)
                if kernels.startswith("torch") and row["agree"] != 1.0:
                    print(f"  MISMATCH: captured torch ops {row['drafts']} != eager {reference}", flush=True)
                record(f"draftgraph captured, {kernels} ops", row)
            if fmt == "bf16" and not args.no_plain:  # last: the torch.compile baseline is the slow part of a case
                compile_here = not args.no_compile and f"{batch}x{k}" in args.compile_cases.split(",")
                try:
                    for name, ms in plain_rows(cfg, weights, prop, batch, k, compile_here):
                        record(name, {"replay_ms": ms})
                except Exception as exc:
                    print(f"  plain torch failed: {type(exc).__name__}: {exc}", flush=True)
            del prop
            gc.collect()
            torch.cuda.empty_cache()
        print(f"case B={batch} K={k} took {time.perf_counter() - t_case:.0f} s", flush=True)
    print_table(rows, bandwidth)
    return 0


def make_weight_sets(cfg: V4Config, device, formats: list[str]) -> dict[str, dict]:
    """format -> graph weights (per-expert views of the stacks, for the nn.Module and the binding)."""
    from draftgraph.runtime.proposer.binding import prepare_weights

    t0 = time.perf_counter()
    bf16 = random_weights(cfg, device)
    sets = {}
    if set(ON_NATIVE) & set(formats):
        sets["native"] = prepare_weights(cfg, native_weights(cfg, bf16), device, weights="native")
        for fmt in set(ON_NATIVE[1:]) & set(formats):  # the same tensors: the options act at load or in the ops
            sets[fmt] = sets["native"]
    if "bf16" in formats:
        sets["bf16"] = prepare_weights(cfg, bf16, device)
    del bf16
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if "native" not in formats:
        sets.pop("native", None)
    for fmt, weights in sets.items():
        print(f"weights {fmt}: {weights_nbytes(weights) / 1e6:.1f} MB", flush=True)
    print(f"made in {time.perf_counter() - t0:.1f} s", flush=True)
    return sets


def fused_native_nodes(prop) -> str:
    """The nodes reading block-scaled weights and the impl each is bound to: "op:fused" or "op:torch"."""
    from draftgraph.runtime.ir.op_registry import get_op

    seen = {}
    for executor in prop._executors.values():
        eager = getattr(executor, "eager", executor)
        for step in eager.steps:
            specs = [eager.graph.values[n].spec for n in step.node.inputs if n in eager.graph.values]
            if any(s.is_quantised for s in specs):
                op = get_op(step.node.op)
                seen[step.node.op] = "torch" if step.impl is op.impl else "fused"
    return " ".join(f"{op}:{impl}" for op, impl in sorted(seen.items()))


def dry_run(cases, formats) -> int:
    """The native path's set-up on CPU at the small config: weights, floors from the specs, an eager propose
    each, and which nodes reading block-scaled weights take their fused impl on CUDA (kernel_choice)."""
    from draftgraph.ops.triton import fused_impls
    from draftgraph.runtime.execution.kernel_choice import block_scaled_gap

    cfg = V4Config.small().replace(max_position_embeddings=4096)
    device = torch.device("cpu")
    print(f"CPU dry run: V4Config.small(), weights {formats}, torch {torch.__version__}", flush=True)
    sets = make_weight_sets(cfg, device, formats)
    impls = fused_impls()
    for batch, k in cases:
        for fmt in formats:
            prop = make_proposer(cfg, sets[fmt], device, batch, "eager", "torch", fmt)
            gen = torch.Generator().manual_seed(batch)  # the same hiddens for both formats
            hiddens = [torch.randn(cfg.hc_mult, cfg.hidden_size, generator=gen).bfloat16() for _ in range(batch)]
            states = [prop.alloc_state() for _ in range(batch)]
            drafts = prop.propose_batch(list(range(1, batch + 1)), hiddens, [200] * batch, k, states)
            experts = cfg.num_experts_per_tok if batch == 1 else distinct_experts(prop, batch)
            floor = sum(step_weight_bytes(cfg, experts, batch=batch, graph=prop.chain_graph(1)).values()) * k
            chosen = {}
            executor = next(iter(prop._executors.values()))
            for step in executor.steps:
                specs = [executor.graph.values[n].spec for n in step.node.inputs if n in executor.graph.values]
                if any(s.is_quantised for s in specs):
                    impl = impls.get(step.node.op)
                    gap = "no fused impl" if impl is None else block_scaled_gap(impl, specs)
                    chosen[step.node.op] = "fused" if gap is None else f"torch ({gap})"
            numerics = prop.numerics()
            print(f"B={batch} K={k} {fmt:>6}: floor {floor / 1e6:.3f} MB ({experts} experts), "
                  f"kv_fp8_round={numerics.kv_fp8_round}, activations={numerics.activations}, drafts {drafts[0]}; "
                  f"on CUDA "
                  f"{' '.join(f'{op}:{c}' for op, c in sorted(chosen.items())) or 'no block-scaled node'}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
