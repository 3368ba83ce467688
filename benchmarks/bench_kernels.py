"""Check and time the fused Triton kernels against their torch ops, on one GPU, in one process.

    python benchmarks/bench_kernels.py [--tune] [--tune-jobs moe:32,hc_pre:32] [--budget-s 240] [--out DIR]
                                  [--ops lm_head,moe] [--weights bf16|native]
    python benchmarks/bench_kernels.py --cpu-dry-run        # the script's logic, interpreter, no timing

``--weights native`` holds each case's block-scaled weights as the checkpoint stores them
(QuantWeights: FP8 linears of linear and swa_attention, MXFP4 routed experts with an FP8 shared
expert for moe / moe_hash; the other ops as they are), so the fused rows time fp8_gemv and
moe_mxfp4 inside the ops, and the floors count the stored bytes and scales. The tuning knobs
are the bf16 kernels' (fp8_linear / moe_mxfp4 keep their own configs).

``--tune`` first times block-size variants of the big kernels at V4-Flash shapes, one knob
at a time, keeping each winner (the printed "chosen configs" are the defaults to set in
ops/triton), and times each launch of lm_head, moe and swa_attention alone. Then for every
op and shape (V4-Flash at batch 1 and 4, the small test config at batch 3): fresh random
inputs (never zeros), outputs poisoned with NaN, the fused impl and the torch op each
compared by ||out - ref|| / ||ref|| against the torch op run on fp32 copies of the inputs;
then both timed as CUDA-graph replays (R calls per graph, median over replays; ops whose
weights fit in the L2 rotate weight copies), and the fused time turned into GB/s of the
bytes the op must move, against the device-to-device copy bandwidth (measured after a
warm-up). The table is printed last; the log and JSON go to $OUT (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--cpu-dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
from draftgraph.graphs.v4_block import CacheGeometry, attention_attrs
from draftgraph.runtime.ir.op_registry import get_op
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.config import V4Config

BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
DEV = "cuda"
ROTATE = {"linear": 8}  # ops whose weights fit in the L2: time over this many weight copies
DRY = False  # --cpu-dry-run: the interpreter on CPU, small shapes, no timing (checks this script)
WEIGHTS = "bf16"  # --weights: "native" quantises the block-scaled weights of each case (NATIVE)
# Inputs the real checkpoint holds block-scaled, by op (runtime/model/weight_names.linear_kind).
NATIVE = {
    "linear": {1: "fp8"},
    "swa_attention": {1: "fp8", 3: "fp8", 4: "fp8", 6: "fp8", 7: "fp8"},
    "moe": {3: "mxfp4", 4: "mxfp4", 5: "mxfp4", 6: "fp8", 7: "fp8", 8: "fp8"},
    "moe_hash": {4: "mxfp4", 5: "mxfp4", 6: "mxfp4", 7: "fp8", 8: "fp8", 9: "fp8"},
}
T0 = time.time()
LOG: list[str] = []
ROWS: list[dict] = []


LOG_FILE: Path | None = None


def log(msg: str) -> None:
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)
    if LOG_FILE is not None:  # written as we go: a run cut off by its time limit keeps its log
        with LOG_FILE.open("a") as f:
            f.write(line + "\n")


# ---- inputs ------------------------------------------------------------------------------------


def randn(*shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, device=DEV, dtype=F32) * scale).to(dtype)


def norm_w(n):
    return (1 + randn(n, scale=0.1, dtype=F32)).to(BF16)


def lin(out_f, in_f):
    return randn(out_f, in_f, scale=1 / math.sqrt(in_f))


def lm_head_case(cfg, b):
    d = cfg.hidden_size
    return [randn(b, d, scale=3.0), norm_w(d), lin(cfg.vocab_size, d)], {
        "eps": cfg.rms_norm_eps,
        "vocab_rows": 0,
    }


def draft_argmax_case(cfg, b):
    v = cfg.vocab_size
    words = torch.randint(-(2**31), 2**31, (b, -(-v // 32)), device=DEV, dtype=I64).to(I32)
    limit = torch.tensor([v - 1000 if v > 2000 else v], dtype=I32, device=DEV)
    return [randn(b, v, scale=3.0, dtype=F32), limit, words], {}


def moe_case(cfg, b):
    d, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    inputs = [
        randn(b, d),
        lin(e, d),
        randn(e, scale=0.1, dtype=F32),
        randn(e, i, d, scale=d**-0.5),
        randn(e, d, i, scale=i**-0.5),
        randn(e, i, d, scale=d**-0.5),
        lin(i, d),
        lin(d, i),
        lin(i, d),
    ]
    attrs = {
        "top_k": cfg.num_experts_per_tok,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
    }
    return inputs, attrs


def moe_hash_case(cfg, b):
    inputs, attrs = moe_case(cfg, b)
    x, gate_w, _bias, *experts = inputs
    k, e, v = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.vocab_size
    tid2eid = torch.argsort(torch.rand(v, e, device=DEV), dim=1)[:, :k].to(I32).contiguous()
    token = torch.randint(0, v, (b,), device=DEV)
    attrs = {k_: a for k_, a in attrs.items() if k_ != "top_k"}
    return [x, token, tid2eid, gate_w, *experts], attrs


def hc_attrs(cfg):
    return {"eps": cfg.rms_norm_eps, "hc_eps": cfg.hc_eps, "iters": cfg.hc_sinkhorn_iters}


def hc_pre_case(cfg, b):
    c, d, m = cfg.hc_mult, cfg.hidden_size, cfg.hc_mix_dim
    scale = (0.5 + torch.rand(3, device=DEV)).float()
    return [
        randn(b, c, d),
        randn(m, c * d, scale=(c * d) ** -0.5, dtype=F32),
        randn(m, scale=0.5, dtype=F32),
        scale,
    ], hc_attrs(cfg)


def hc_pre_norm_case(cfg, b):
    """hc_pre with the norm that reads its y (the fold_norm_into_hc_pre pass's op)."""
    inputs, attrs = hc_pre_case(cfg, b)
    return [*inputs, norm_w(cfg.hidden_size)], {**attrs, "norm_eps": cfg.rms_norm_eps}


def hc_head_case(cfg, b):
    c, d = cfg.hc_mult, cfg.hidden_size
    scale = (0.5 + torch.rand(1, device=DEV)).float()
    attrs = {"eps": cfg.rms_norm_eps, "hc_eps": cfg.hc_eps}
    return [
        randn(b, c, d),
        randn(c, c * d, scale=(c * d) ** -0.5, dtype=F32),
        randn(c, scale=0.5, dtype=F32),
        scale,
    ], attrs


def hc_post_case(cfg, b):
    c, d = cfg.hc_mult, cfg.hidden_size
    post = 2 * torch.sigmoid(randn(b, c, dtype=F32))
    comb = torch.softmax(randn(b, c, c, scale=2.0, dtype=F32), dim=-1)
    return [randn(b, d), randn(b, c, d), post, comb], {}


def attention_case(cfg, b):
    h, d, dim, ql, g, ol = (
        cfg.num_attention_heads,
        cfg.head_dim,
        cfg.hidden_size,
        cfg.q_lora_rank,
        cfg.o_groups,
        cfg.o_lora_rank,
    )
    positions = ([1000, 37, 128, 4000] * (b // 4 + 1))[:b] if b > 1 else [1000]
    blocks = max(positions) // 16 + 1
    num_blocks = b * blocks + 7
    table = torch.randperm(num_blocks, device=DEV)[: b * blocks].view(b, blocks).to(I32)
    inputs = [
        randn(b, dim),
        lin(ql, dim),
        norm_w(ql),
        lin(h * d, ql),
        lin(d, dim),
        norm_w(d),
        lin(g * ol, h * d // g),
        lin(dim, g * ol),
        randn(h, dtype=F32),
        randn(num_blocks * 16, d),
        torch.tensor(positions, dtype=I64, device=DEV),
        torch.zeros(b, dtype=I32, device=DEV),
        table,
    ]
    attrs = attention_attrs(cfg, CacheGeometry(num_slots=num_blocks * 16, max_blocks_per_seq=blocks))
    if dim < 1024:
        attrs["kv_fp8_round"] = True  # the small shapes also exercise the FP8-rounded cache write
    return inputs, attrs


def linear_case(cfg, b):
    d = cfg.hidden_size
    return [randn(b, d), lin(d, d)], {}


def rms_norm_case(cfg, b):
    d = cfg.hidden_size
    return [randn(b, d, scale=2.0), norm_w(d)], {"eps": cfg.rms_norm_eps}


CASES = {
    "lm_head": lm_head_case,
    "draft_argmax": draft_argmax_case,
    "moe": moe_case,
    "moe_hash": moe_hash_case,
    "swa_attention": attention_case,
    "hc_pre": hc_pre_case,
    "hc_pre_norm": hc_pre_norm_case,
    "hc_head": hc_head_case,
    "hc_post": hc_post_case,
    "linear": linear_case,
    "rms_norm": rms_norm_case,
}


def make_case(name, cfg, b):
    """CASES[name](cfg, b), with its block-scaled weights quantised under ``--weights native``."""
    inputs, attrs = CASES[name](cfg, b)
    if WEIGHTS == "native":
        from draftgraph.runtime.model.quant import quantize_weight

        for i, fmt in NATIVE.get(name, {}).items():
            inputs[i] = quantize_weight(inputs[i], fmt)  # the bf16 draw, as the checkpoint stores it
    return inputs, attrs


def clone(t):
    from draftgraph.runtime.model.quant import QuantWeight

    if isinstance(t, QuantWeight):  # float4 has no clone: its bytes
        return QuantWeight(t.data.view(torch.uint8).clone().view(t.data.dtype), t.scale.clone(), t.fmt)
    return t.clone()


def bytes_moved(name, inputs, attrs, cfg) -> int:
    """The fewest bytes the op must move: each touched weight once, activations in and out.

    Bytes from each input's spec: a block-scaled weight (QuantWeight) counts its data and scales.
    """
    nb = lambda t: TensorSpec.of(t).nbytes(1)  # noqa: E731
    b = inputs[0].shape[0]
    if name == "lm_head":
        return nb(inputs[2]) + b * inputs[2].shape[0] * 4 + nb(inputs[0])
    if name == "draft_argmax":
        return sum(nb(t) for t in inputs) + b * 12
    if name in ("moe", "moe_hash"):
        gate = inputs[1] if name == "moe" else inputs[3]
        w1 = inputs[3] if name == "moe" else inputs[4]
        stacks = inputs[3:6] if name == "moe" else inputs[4:7]
        per_expert = sum(nb(w) for w in stacks) // w1.shape[0]
        slots = min(b * attrs.get("top_k", cfg.num_experts_per_tok), w1.shape[0])
        return nb(gate) + (slots + 1) * per_expert + 2 * nb(inputs[0])
    if name == "swa_attention":
        weights = sum(nb(t) for t in inputs[1:9])
        keys = b * attrs["window"] * attrs["head_dim"] * 2
        return weights + keys + 2 * nb(inputs[0])
    if name in ("hc_pre", "hc_pre_norm", "hc_head"):
        return nb(inputs[1]) + nb(inputs[0]) + b * inputs[0].shape[2] * 2
    if name == "hc_post":
        return nb(inputs[0]) + 2 * nb(inputs[1])
    if name == "linear":
        return nb(inputs[1]) + nb(inputs[0]) + b * inputs[1].shape[0] * 2
    if name == "rms_norm":
        return 2 * nb(inputs[0])
    return 0


# ---- running ---------------------------------------------------------------------------------


def outputs_for(name, inputs, attrs):
    specs = get_op(name).infer([TensorSpec.of(t) for t in inputs], attrs)
    return [torch.empty(s.shape, dtype=s.dtype, device=DEV) for s in specs]


def poison(outs):
    for o in outs:
        o.fill_(float("nan") if o.is_floating_point() else -7)


def upcast(t):
    return t.float() if t.dtype in (BF16, torch.float16) else t


def rel_err(out, ref) -> float:
    ref = ref.double()
    den = ref.norm()
    return float((out.double() - ref).norm() / den) if den > 0 else float((out.double() - ref).norm())


def fresh_state(name, inputs):
    """Copies of the inputs the op writes (the KV cache); the rest are shared, not copied."""
    mutated = set(get_op(name).mutates)
    return [t.clone() if i in mutated else t for i, t in enumerate(inputs)]


def run_once(name, impl, inputs, attrs, ws=None, in_fp32=False):
    """``in_fp32``: the bf16 inputs and outputs as fp32 (output specs from the inputs as given: the
    shape rules want bf16 activations beside a block-scaled weight)."""
    outs = outputs_for(name, inputs, attrs)
    if in_fp32:
        inputs, outs = [upcast(t) for t in inputs], [upcast(o) for o in outs]
    inputs = fresh_state(name, inputs)
    poison(outs)
    impl(inputs, outs, attrs, ws)
    if not DRY:
        torch.cuda.synchronize()
    return outs, inputs


def time_graph(fn, reps: int, iters: int = 15) -> float:
    """Median microseconds per call, from replays of a CUDA graph holding ``reps`` calls of fn.

    ``fn`` may be a list of callables (the same op on different input copies, so that
    weights smaller than the L2 are not re-read from it): each is captured ``reps`` times
    round-robin and the time is per call.
    """
    fns = fn if isinstance(fn, list) else [fn]
    if DRY:
        fns[0]()
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    calls = reps * len(fns)
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def reps_for(nbytes: int) -> int:
    return 5 if nbytes > 500e6 else 10 if nbytes > 50e6 else 20


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Run matrix products until the clocks have left idle (the first run read 405 MHz)."""
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    t_end = time.time() + seconds
    while time.time() < t_end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Device-to-device copy, read + written bytes: the best of three ways, each logged.

    Run 2 showed a copy_ captured in a CUDA graph (a memcpy node) at 2.73 TB/s while the
    LM-head GEMV streamed 4.42 TB/s: the graph's memcpy node is not an SM copy. So time an
    eager copy_ (events) and an SM elementwise copy in a graph too, and take the best.
    """
    n = 1 << 28  # 256 Mi fp32 = 1 GiB each way
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    nbytes = 2 * n * 4
    results = {
        "graph memcpy": time_graph(lambda: dst.copy_(src), reps=5),
        "graph SM copy (mul by 1)": time_graph(lambda: torch.mul(src, 1.0, out=dst), reps=5),
    }
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    results["eager copy_"] = statistics.median(times)
    for how, us in results.items():
        log(f"  copy {how:26s} {nbytes / (us * 1e-6) / 1e9:6.0f} GB/s")
    return max(nbytes / (us * 1e-6) / 1e9 for us in results.values())


def workspace_for(name, inputs, attrs):
    from draftgraph.ops.triton import workspace_rules

    rule = workspace_rules().get(name)
    if rule is None:
        return None
    nbytes = rule([TensorSpec.of(t) for t in inputs], attrs, inputs[0].shape[0])
    return torch.empty(nbytes, dtype=torch.uint8, device=DEV)


# ---- one case --------------------------------------------------------------------------------


def _try(what, notes, fn):
    """fn(), or None with the error noted (one failing reference must not hide the fused result)."""
    try:
        return fn()
    except Exception as exc:
        notes.append(f"{what} failed: {repr(exc)[:80]}")
        log(f"{what} failed:\n{traceback.format_exc()}")
        return None


def check_case(name, label, cfg, b, fused, copy_bw, time_it=True):
    torch.manual_seed(hash((name, label, b)) % (2**31))
    inputs, attrs = make_case(name, cfg, b)
    row = {"op": name, "shape": f"{label} B={b}", "bytes": bytes_moved(name, inputs, attrs, cfg)}
    notes: list[str] = []
    ws = workspace_for(name, inputs, attrs)
    f_out, f_in = run_once(name, fused, inputs, attrs, ws)
    t_res = _try("torch op", notes, lambda: run_once(name, get_op(name).impl, inputs, attrs))
    if name == "draft_argmax":
        t_out = t_res[0]
        row["err_fused"] = rel_err(f_out[1], t_out[1])
        row["err_torch"] = 0.0
        same = torch.equal(f_out[0], t_out[0])
        notes.append("tokens equal" if same else "TOKENS DIFFER")
        row["ok"] = same and row["err_fused"] < 1e-5
    else:
        r_res = _try(
            "fp32 reference",
            notes,
            lambda: run_once(name, get_op(name).impl, inputs, attrs, in_fp32=True),
        )
        if r_res is None:  # fall back to the bf16 torch op as the reference
            r_res = t_res
        r_out, r_in = r_res
        errs_f, errs_t, nan = [], [], False
        for i, (f, r) in enumerate(zip(f_out, r_out)):
            if not f.is_floating_point():
                continue
            nan |= bool(torch.isnan(f).any())
            errs_f.append(rel_err(f, r))
            errs_t.append(rel_err(t_res[0][i], r) if t_res is not None else float("nan"))
        if name == "swa_attention":
            errs_f.append(rel_err(f_in[9], r_in[9]))
            errs_t.append(rel_err(t_res[1][9], r_in[9]) if t_res is not None else float("nan"))
        row["err_fused"], row["err_torch"] = max(errs_f), max(errs_t)
        bound = max(2 * row["err_torch"], 2e-3) if t_res is not None else 1e-2
        row["ok"] = not nan and row["err_fused"] <= bound and row["err_fused"] < 1.5e-2
        if nan:
            notes.append("NaN in output")
        if name == "lm_head":
            fa, ra = f_out[0].argmax(-1), r_out[0].argmax(-1)
            top2 = r_out[0].topk(2, dim=-1).values
            gap = (top2[:, 0] - top2[:, 1]).min().item()
            notes.append(f"argmax {'agrees' if torch.equal(fa, ra) else 'DIFFERS'} (min top-2 gap {gap:.3g})")
        del r_out, r_in, r_res
    del f_out, f_in, t_res
    if time_it:
        reps = reps_for(row["bytes"])
        copies = ROTATE.get(name, 1)  # weights under the L2 size: rotate copies so they come from HBM
        sets = [inputs] + [[clone(t) for t in inputs] for _ in range(copies - 1)]
        t_calls, f_calls = [], []
        for inp in sets:
            t_in, f_in2 = fresh_state(name, inp), fresh_state(name, inp)
            t_outs, f_outs = outputs_for(name, t_in, attrs), outputs_for(name, f_in2, attrs)
            t_calls.append(lambda t_in=t_in, t_outs=t_outs: get_op(name).impl(t_in, t_outs, attrs, None))
            f_calls.append(lambda f_in2=f_in2, f_outs=f_outs: fused(f_in2, f_outs, attrs, ws))
        t_us = _try("torch timing", notes, lambda: time_graph(t_calls, reps))
        row["torch_us"] = float("nan") if t_us is None else t_us
        row["fused_us"] = time_graph(f_calls, reps)
        if copies > 1:
            notes.append(f"{copies} weight copies rotated")
        del sets
        row["gbps"] = row["bytes"] / (row["fused_us"] * 1e-6) / 1e9
        row["pct_copy"] = 100 * row["gbps"] / copy_bw
        row["floor_us"] = row["bytes"] / (copy_bw * 1e9) * 1e6
    row["note"] = "; ".join(notes)
    ROWS.append(row)
    log(
        f"{name:14s} {row['shape']:14s} err fused {row['err_fused']:.2e} torch {row['err_torch']:.2e} "
        f"{'ok' if row['ok'] else 'FAIL'} {row['note']} "
        f"torch {row.get('torch_us', float('nan')):8.1f}us fused {row.get('fused_us', float('nan')):8.1f}us "
        f"({row.get('gbps', 0):6.0f} GB/s, {row.get('pct_copy', 0):4.0f}% of copy)"
    )
    torch.cuda.empty_cache()
    return row


# ---- tuning: one knob at a time, winners kept ----------------------------------------------


def _short(value):
    if hasattr(value, "block_n"):
        kind = "" if value.use_dot else "fma"
        return f"n{value.block_n}k{value.block_k}w{value.num_warps}s{value.num_stages}{kind}"
    return str(value)


class Tuner:
    """Time the whole fused op per value of one module knob; keep the fastest (>1% better)."""

    def __init__(self, copy_bw: float, deadline: float):
        self.copy_bw, self.deadline = copy_bw, deadline
        self.results: list[dict] = []
        self.chosen: dict[str, str] = {}
        self.values: dict[str, object] = {}  # the same as JSON values: bench_draft.py --kernel-configs reads them

    def case(self, name, cfg, b):
        from draftgraph.ops.triton import _impls

        inputs, attrs = make_case(name, cfg, b)
        copies = ROTATE.get(name, 1)
        sets = [inputs] + [[clone(t) for t in inputs] for _ in range(copies - 1)]
        return {
            "name": name,
            "b": b,
            "sets": sets,
            "attrs": attrs,
            "impl": _impls()[name],
            "ws": workspace_for(name, inputs, attrs),
            "bytes": bytes_moved(name, inputs, attrs, cfg),
        }

    def _time(self, c) -> float:
        calls = []
        for inp in c["sets"]:
            f_in = fresh_state(c["name"], inp)
            f_out = outputs_for(c["name"], f_in, c["attrs"])
            calls.append(lambda f_in=f_in, f_out=f_out: c["impl"](f_in, f_out, c["attrs"], c["ws"]))
        return time_graph(calls, reps_for(c["bytes"]))

    def _record(self, label, us, c, error=None):
        if error is not None:
            self.results.append({"variant": label, "error": error})
            log(f"  tune {label:58s} ERROR {error[:160]}")
            return
        gbps = c["bytes"] / (us * 1e-6) / 1e9
        self.results.append({"variant": label, "us": us, "gbps": gbps, "pct_copy": 100 * gbps / self.copy_bw})
        log(f"  tune {label:58s} {us:8.1f}us {gbps:6.0f} GB/s ({100 * gbps / self.copy_bw:3.0f}%)")

    def knob(self, c, module, knob, values):
        """Try each value of module.knob on case c; leave the fastest set. Returns it."""
        name = c["name"]
        current = getattr(module, knob)
        ref_out, _ = run_once(name, c["impl"], c["sets"][0], c["attrs"], c["ws"])
        best_val, best_us = current, self._time(c)
        self._record(f"{name} B={c['b']} {knob}={_short(current)} (current)", best_us, c)
        for value in values:
            if value == current:
                continue
            if time.time() > self.deadline:
                log(f"  tune {name} {knob}: out of time budget")
                break
            setattr(module, knob, value)
            label = f"{name} B={c['b']} {knob}={_short(value)}"
            try:
                out, _ = run_once(name, c["impl"], c["sets"][0], c["attrs"], c["ws"])
                err = max(rel_err(o, r) for o, r in zip(out, ref_out) if o.is_floating_point())
                if not err < 1e-2:
                    raise RuntimeError(f"wrong result: rel err vs current {err:.3g}")
                us = self._time(c)
                self._record(label, us, c)
                if us < 0.99 * best_us:
                    best_val, best_us = value, us
            except Exception as exc:  # a variant that fails to compile or run is reported, skipped
                self._record(label, None, c, repr(exc)[:300])
        setattr(module, knob, best_val)
        self.chosen[f"{module.__name__}.{knob}"] = repr(best_val)
        self.values[f"{module.__name__}.{knob}"] = dataclasses.asdict(best_val) if dataclasses.is_dataclass(best_val) \
            else best_val
        log(f"  tune -> {module.__name__}.{knob} = {_short(best_val)} ({best_us:.1f}us)")
        return best_val


def tune_all(flash, copy_bw, deadline, only: set[str] | None = None) -> Tuner:
    """Tune every job, or those named in ``only`` ("op:batch", e.g. "moe:32")."""
    from draftgraph.ops.triton import attention as A
    from draftgraph.ops.triton import gemv as G
    from draftgraph.ops.triton import mhc as H
    from draftgraph.ops.triton import moe as M
    from draftgraph.ops.triton.gemv import GemvConfig as C

    t = Tuner(copy_bw, deadline)
    jobs = [
        (
            "lm_head",
            1,
            [
                (
                    G,
                    "LM_HEAD_CONFIG",
                    [
                        C(64, 128, 4, 4),
                        C(8, 1024, 4, 3, False),
                        C(128, 128, 4, 3),
                        C(32, 256, 4, 4),
                        C(16, 512, 4, 3, False),
                        C(4, 2048, 4, 3, False),
                    ],
                )
            ],
        ),
        (
            "moe",
            1,
            [
                (
                    M,
                    "W13_CONFIG",
                    [
                        C(64, 64, 4, 5),
                        C(32, 256, 4, 3),
                        C(8, 512, 4, 3, False),
                        C(16, 256, 4, 3, False),
                        C(4, 1024, 4, 3, False),
                        C(8, 256, 4, 4, False),
                        C(16, 512, 8, 3, False),
                    ],
                ),
                (
                    M,
                    "W2_CONFIG",
                    [
                        C(16, 512, 4, 3),
                        C(16, 128, 4, 6),
                        C(8, 1024, 4, 3, False),
                        C(16, 512, 4, 3, False),
                        C(4, 1024, 4, 3, False),
                        C(8, 512, 4, 4, False),
                    ],
                ),
                (M, "GATE_SPLIT", [8, 16, 4]),
            ],
        ),
        (
            "swa_attention",
            1,
            [
                (A, "ATTN_IMPL", ["fma", "dot"]),
                (
                    A,
                    "Q_CONFIG",
                    [
                        C(64, 128, 4, 4),
                        C(16, 1024, 4, 2, False),
                        C(8, 1024, 4, 3, False),
                        C(128, 128, 4, 3),
                        C(4, 1024, 4, 3, False),
                    ],
                ),
                (
                    A,
                    "WO_A_CONFIG",
                    [C(32, 256, 4, 4), C(64, 128, 4, 4), C(8, 1024, 4, 3, False), C(16, 512, 4, 3, False)],
                ),
                (
                    A,
                    "WO_B_CONFIG",
                    [C(16, 256, 4, 4), C(16, 512, 4, 3), C(8, 1024, 4, 3, False), C(16, 512, 4, 3, False)],
                ),
                (A, "PROJ_CONFIG", [C(16, 256, 4, 4), C(8, 1024, 4, 3, False), C(16, 512, 4, 3, False)]),
            ],
        ),
        (
            "linear",
            1,
            [
                (
                    G,
                    "LINEAR_CONFIG",
                    [
                        C(8, 1024, 4, 3, False),
                        C(16, 512, 4, 3, False),
                        C(4, 1024, 4, 3, False),
                        C(8, 512, 4, 4, False),
                        C(64, 128, 4, 4),
                        C(16, 256, 4, 4),
                    ],
                )
            ],
        ),
        (
            "moe",
            4,
            [
                (
                    M,
                    "W13_CONFIG_BATCHED",
                    [C(64, 64, 4, 5), C(32, 128, 4, 4), C(64, 128, 4, 3), C(32, 256, 4, 3)],
                ),
                (
                    M,
                    "W2_CONFIG_BATCHED",
                    [C(16, 512, 4, 3), C(32, 256, 4, 3), C(16, 256, 4, 4), C(16, 128, 4, 6)],
                ),
            ],
        ),
        (
            "swa_attention",
            4,
            [(G, "BATCHED", [C(64, 128, 4, 4), C(32, 256, 4, 3), C(16, 512, 4, 3), C(128, 128, 4, 3)])],
        ),
        (
            "moe",
            32,
            [
                (
                    M,
                    "W2_CONFIG_BATCHED",
                    [C(64, 128, 4, 3), C(32, 128, 4, 4), C(128, 64, 4, 4), C(32, 256, 4, 3), C(16, 512, 4, 3)],
                ),
                (M, "W13_CONFIG_BATCHED", [C(32, 128, 4, 3), C(64, 128, 4, 3), C(64, 64, 4, 4)]),
            ],
        ),
        ("hc_pre", 32, [(H, "MIX_ROWS", [2, 4, 8])]),
    ]
    if WEIGHTS == "native":
        jobs = native_jobs()
    if only:
        jobs = [job for job in jobs if f"{job[0]}:{job[1]}" in only]
    for name, b, knobs in jobs:
        if time.time() > deadline:
            log(f"tune {name} B={b}: skipped, out of time budget")
            continue
        try:
            c = t.case(name, flash, b)
            for module, knob, values in knobs:
                t.knob(c, module, knob, values)
                if knob == "ATTN_IMPL":  # then the chosen core's own knobs
                    if A.ATTN_IMPL == "dot":
                        t.knob(c, A, "DOT_BLOCK_W", [32, 16, 64])
                        t.knob(c, A, "DOT_WARPS", [4, 8])
                        t.knob(c, A, "DOT_BLOCK_H", [16, 32, 64])
                        t.knob(c, A, "DOT_STAGES", [2, 3, 1])
                        t.knob(c, A, "ATTN_MIN_PROGRAMS", [64, 1, 32, 128])  # the window's split
                    else:
                        t.knob(c, A, "BLOCK_W", [8, 4, 16])
                        t.knob(c, A, "ATTN_WARPS", [4, 8])
            del c
        except Exception:
            log(f"tune {name} B={b}: ERROR\n{traceback.format_exc()}")
        torch.cuda.empty_cache()
    return t


def native_jobs() -> list:
    """The block-scaled kernels' own knobs (--weights native). Batch 1: FMA tiles from narrow and
    long ("wide tiles", "MXFP4 words": many scale blocks a tile) to the 128-column ones of b93df2d,
    and the dot path padded to 16 rows; batch > 1: dot tiles, at most 128 columns (one FP8 scale
    block)."""
    from draftgraph.ops.triton import fp8_linear as F
    from draftgraph.ops.triton import moe_mxfp4 as MX
    from draftgraph.ops.triton.gemv import GemvConfig as C

    wide = ((4, 1024, 1), (8, 512, 2), (8, 1024, 4), (16, 256, 4), (16, 512, 4), (16, 1024, 8), (32, 256, 4),
            (4, 2048, 4), (32, 128, 4), (64, 128, 8))  # fmt: skip
    fma = [C(n, k, warps, 3, False) for n, k, warps in wide]
    tiles = ((16, 4, 4), (32, 4, 4), (64, 4, 4), (128, 4, 3), (64, 8, 4), (128, 8, 4))
    dot = [C(n, 128, warps, stages) for n, warps, stages in tiles]
    # Deeper pipelines (more weight bytes in flight a program: one 32-row program a SM at 4096
    # rows), tried at batch 4 and for more than 16 rows (LARGE_BATCH_CONFIG) after the tiles above.
    deep = [C(n, 128, warps, stages) for n, warps, stages in ((16, 4, 6), (16, 4, 8), (32, 4, 6), (32, 4, 8),
                                                              (64, 4, 6), (32, 8, 6), (64, 8, 6))]  # fmt: skip
    mma = [C(n, k, n // 16, 1, False) for n, k in ((16, 512), (16, 1024), (32, 256), (32, 512), (64, 256), (64, 512),
                                                    (128, 256))]  # fmt: skip
    return [
        ("linear", 1, [(F, "BATCH1_CONFIG", fma + dot[:2])]),
        ("moe", 1, [(MX, "W13_CONFIG", fma + dot[:2]), (MX, "W2_CONFIG", fma + dot[:2]),
                    (MX, "GROUPED_MIN_BATCH", [1])]),  # fmt: skip
        ("linear", 4, [(F, "DEFAULT", dot + deep)]),
        ("linear", 32, [(F, "LARGE_BATCH_CONFIG", dot + deep)]),
        # The launches past 16 rows whose grid stays full on 64-row tiles (fp8_linear.config_for):
        # at B=32 the attention's wq_b, wo_a and wo_b. Tiles of 64 rows or more: the op's scratch
        # holds the split's arrival counts of 64-row tiles (more, narrower tiles would not fit).
        ("swa_attention", 32, [(F, "WIDE_GRID_CONFIG", [c for c in dot + deep if c.block_n >= 64])]),
        # The tensor-core kernels (moe_mxfp4_mma) against the dot tiles (MMA_MAX_BATCH 0), then their tiles.
        ("moe", 4, [(MX, "MMA_MAX_BATCH", [0]), (MX, "W13_CONFIG_MMA", mma), (MX, "W2_CONFIG_MMA", mma),
                    (MX, "W13_SPLIT_MMA", [2, 4])]),  # w13's K in parts (moe_mxfp4_mma, "split K")
        # B=32 takes the mma kernels too, on the B=4 job's tiles: this case routes 32 rows to ~150
        # experts (one row each), the chain to ~23 (~8 rows each), so it would tune for another load.
    ]


def phase_breakdown(flash, b: int = 1) -> list[dict]:
    """Per-launch times of the multi-kernel ops at batch ``b`` (each launch timed alone, scratch warm)."""
    from draftgraph.ops.triton import attention as A
    from draftgraph.ops.triton import head as Hd
    from draftgraph.ops.triton import moe as M

    rows = []
    for name, plan in (
        ("lm_head", Hd.plan),
        ("moe", lambda *a: M.plan(*a, hashed=False)),
        ("swa_attention", A.plan),
    ):
        try:
            inputs, attrs = make_case(name, flash, b)
            ws = workspace_for(name, inputs, attrs)
            f_in = fresh_state(name, inputs)
            outs = outputs_for(name, f_in, attrs)
            launches = plan(f_in, outs, attrs, ws)
            for _, launch in launches:  # fill the scratch once
                launch()
            total = 0.0
            for phase, launch in launches:
                us = time_graph(launch, 10)
                total += us
                rows.append({"op": name, "b": b, "phase": phase, "us": us})
                log(f"  phase {name:14s} B={b:<3d} {phase:10s} {us:8.1f}us")
            rows.append({"op": name, "b": b, "phase": "sum", "us": total})
        except Exception:
            log(f"phase breakdown {name} B={b}: ERROR\n{traceback.format_exc()}")
        torch.cuda.empty_cache()
    return rows


# ---- main ------------------------------------------------------------------------------------


def print_table(copy_bw):
    head = (
        f"{'op':14s} {'shape':12s} {'err fused':>9s} {'err torch':>9s} {'ok':4s} {'torch us':>9s} "
        f"{'fused us':>9s} {'floor us':>8s} {'GB/s':>6s} {'%copy':>5s}  note"
    )
    print("\n" + "=" * len(head))
    print(
        f"copy bandwidth (read+write): {copy_bw:.0f} GB/s; "
        "errors: ||out-ref||/||ref|| vs the torch op on fp32 inputs"
    )
    print(head)
    for r in ROWS:
        print(
            f"{r['op']:14s} {r['shape']:12s} {r['err_fused']:9.2e} {r['err_torch']:9.2e} "
            f"{'ok' if r['ok'] else 'FAIL':4s} "
            f"{r.get('torch_us', float('nan')):9.1f} {r.get('fused_us', float('nan')):9.1f} "
            f"{r.get('floor_us', float('nan')):8.1f} {r.get('gbps', float('nan')):6.0f} "
            f"{r.get('pct_copy', float('nan')):5.0f}  {r.get('note', '')}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tune", action="store_true", help="tune block sizes first; the table uses the winners"
    )
    parser.add_argument(
        "--budget-s", type=float, default=240.0, help="stop starting tuning runs after this long"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--ops", default=",".join(CASES), help="comma-separated op names")
    parser.add_argument("--tune-jobs", default="", help="tune only these op:batch jobs, e.g. moe:32,hc_pre:32")
    parser.add_argument("--phase-batches", default="1",
                        help="with --tune: the batches whose per-launch times are printed, e.g. 1,8,32")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="run the logic on CPU (TRITON_INTERPRET=1)"
    )
    parser.add_argument("--weights", choices=("bf16", "native"), default="bf16",
                        help="native: FP8 / MXFP4 weights as stored (linear, swa_attention, moe, moe_hash)")
    args = parser.parse_args()
    global DEV, DRY, LOG_FILE, WEIGHTS
    WEIGHTS = args.weights
    if args.cpu_dry_run:
        DEV, DRY = "cpu", True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    LOG_FILE = out_dir / "bench_kernels.log"
    LOG_FILE.write_text("")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    import triton
    from draftgraph.ops.triton import _impls

    if DRY:
        from draftgraph.ops.triton._common import patch_interpreter_rounding

        patch_interpreter_rounding()
        log(f"CPU dry run (interpreter), torch {torch.__version__}, triton {triton.__version__}")
        copy_bw = 1.0
    else:
        props = torch.cuda.get_device_properties(0)
        versions = f"torch {torch.__version__}, triton {triton.__version__}"
        log(f"{props.name}, {props.multi_processor_count} SMs, {versions}")
        warm_up_gpu()
        copy_bw = copy_bandwidth()
    log(f"device-to-device copy: {copy_bw:.0f} GB/s (read + write); weights {WEIGHTS}")
    flash, small = V4Config.flash(), V4Config.small()
    if DRY:
        flash = small  # the whole plan at the small shapes
    only = {job for job in args.tune_jobs.split(",") if job} or None
    tuner = tune_all(flash, copy_bw, T0 + args.budget_s, only) if args.tune else None
    batches = [int(v) for v in args.phase_batches.split(",") if v]
    phases = [r for b in batches for r in phase_breakdown(flash, b)] if args.tune and not DRY else []
    impls = _impls()
    ops = [o for o in args.ops.split(",") if o]
    plan = [(name, "v4-flash", flash, 1, True) for name in ops]
    timed_b4 = ("lm_head", "moe", "swa_attention", "hc_pre", "linear")
    plan += [(n, "v4-flash", flash, 4, n in timed_b4) for n in ops if n not in ("moe_hash", "rms_norm")]
    # B=32 where the FP8 dot tiles take LARGE_BATCH_CONFIG (the MoE's torch reference at 32 rows
    # would take minutes): the linear alone and the attention's four GEMVs.
    plan += [(n, "v4-flash", flash, 32, True) for n in ops if n in ("linear", "swa_attention")]
    plan += [(name, "small", small, 3, False) for name in ops]
    failures = 0
    for name, label, cfg, b, time_it in plan:
        try:
            row = check_case(name, label, cfg, b, impls[name], copy_bw, time_it)
            failures += 0 if row["ok"] else 1
        except Exception as exc:
            failures += 1
            ROWS.append(
                {
                    "op": name,
                    "shape": f"{label} B={b}",
                    "err_fused": float("nan"),
                    "ok": False,
                    "err_torch": float("nan"),
                    "note": f"ERROR {repr(exc)[:120]}",
                }
            )
            log(f"{name} {label} B={b}: ERROR\n{traceback.format_exc()}")
            torch.cuda.empty_cache()
    if not DRY:
        copy_end = copy_bandwidth()
        log(f"device-to-device copy at the end: {copy_end:.0f} GB/s")
    if tuner is not None:
        print("\nchosen configs (tuned at V4-Flash shapes; the table below uses them):")
        for knob, value in tuner.chosen.items():
            print(f"  {knob} = {value}")
    if phases:
        print("\nper-launch times, V4-Flash (each launch alone in a graph, scratch warm):")
        for r in phases:
            print(f"  {r['op']:14s} B={r['b']:<3d} {r['phase']:10s} {r['us']:8.1f} us")
    print_table(copy_bw)
    (out_dir / "bench_kernels.json").write_text(
        json.dumps(
            {
                "copy_gbps": copy_bw,
                "weights": WEIGHTS,
                "rows": ROWS,
                "tuning": tuner.results if tuner else [],
                "chosen": tuner.chosen if tuner else {},
                "chosen_values": tuner.values if tuner else {},
                "phases": phases,
            },
            indent=1,
            default=str,
        )
    )
    print(f"\n{failures} failing checks; total {time.time() - T0:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
