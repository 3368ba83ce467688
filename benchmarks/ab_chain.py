"""(GPU) Knob settings A/B on the captured native chain, in one process, alternated round by round.

    python benchmarks/ab_chain.py [--cases 1x1,1x3] [--rounds 2] [--cpu-dry-run] NAME:KNOB[+KNOB...] [...]
    python benchmarks/ab_chain.py --cases 8x1,32x1 base: "dot w2:fp8_linear.DEFAULT=32,128,2,6" \\
        "w13 2 parts:moe_mxfp4.W13_SPLIT_MMA=2+moe_mxfp4.W13_SPLIT_MMA_LARGE=2"

Each setting is a name and the fused-kernel constants it sets (``bench_knobs.py``'s MODULE.NAME=VALUE,
joined by ``+``; none: the defaults). The weights (V4-Flash shapes, native formats, random) are made
once; every round builds one proposer a setting and case with the setting's knobs (a knob acts at
capture: each proposer captures its own graphs), drafts once, and times its replay as bench_draft
does (``time_replays``). One process and alternated rounds cancel most of what separate processes
differ by (the card's clock and the host's slow spells). The summary gives each setting's mean
replay, its distance from the first setting, and whether its drafts equal the first's.
``--cpu-dry-run`` runs the same rounds on the CPU (small config, eager torch ops; the times mean
nothing): the script's logic, tested in CI, so a device call is not spent on its bugs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
from bench_draft import make_proposer, make_weight_sets, time_replays
from bench_floor import measure_copy_bandwidth
from bench_knobs import parse_knobs


def parse_settings(items: list[str]) -> list[tuple[str, list]]:
    """(name, [(module, constant, value)]) of each NAME:KNOB[+KNOB...]; raises ValueError."""
    settings = []
    for item in items:
        name, sep, knobs = item.partition(":")
        if not sep or not name:
            raise ValueError(f"setting {item!r}: expected NAME:KNOB[+KNOB...] (NAME: for the defaults)")
        settings.append((name, parse_knobs([k for k in knobs.split("+") if k])))
    if len({name for name, _ in settings}) != len(settings):
        raise ValueError(f"settings {[n for n, _ in settings]}: names must differ")
    return settings


def run_case(cfg, weights, device, batch: int, k: int) -> tuple[float, float, list]:
    """(replay ms, spread, drafts) of one proposer captured with the knobs as they are now; on the
    CPU (--cpu-dry-run) an eager proposer on the torch ops, its one propose's wall ms, spread 0."""
    dry = device.type == "cpu"
    prop = make_proposer(cfg, weights, device, batch, "eager" if dry else "captured", "torch" if dry else "fused",
                         "native")  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(batch)
    hiddens = [torch.randn(cfg.hc_mult, cfg.hidden_size, device=device, generator=gen).bfloat16()
               for _ in range(batch)]
    states = [prop.alloc_state() for _ in range(batch)]
    try:
        start = time.perf_counter()
        if batch == 1:
            drafts = [prop.propose(1, hiddens[0], 200, k, states[0])]
        else:
            drafts = prop.propose_batch(list(range(1, batch + 1)), hiddens, [200] * batch, k, states)
        if dry:
            ms, spread = (time.perf_counter() - start) * 1e3, 0.0
        else:
            ms, spread = time_replays(next(iter(prop._executors.values())).replay)
    finally:
        for s in states:
            prop.free_state(s)
    del prop
    gc.collect()
    if not dry:
        torch.cuda.empty_cache()
    return ms, spread, drafts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1x1", help="BxK cases, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="the same rounds on the CPU at the small config (eager, torch ops): the script's "
                             "logic, no timing")
    parser.add_argument("settings", nargs="+", help="NAME:KNOB[+KNOB...]")
    args = parser.parse_args(argv)
    try:
        settings = parse_settings(args.settings)
        cases = [tuple(int(v) if v.isdigit() else 0 for v in case.split("x")) for case in args.cases.split(",")]
        if any(len(c) != 2 or min(c) < 1 for c in cases) or args.rounds < 1:
            raise ValueError(f"--cases {args.cases!r} / --rounds {args.rounds}: expected BxK pairs (1x1,8x1), "
                             "rounds >= 1")
    except ValueError as exc:
        print(f"ab_chain: {exc}", file=sys.stderr)
        return 2
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("ab_chain: needs a CUDA device (or --cpu-dry-run)", file=sys.stderr)
        return 2
    from draftgraph.runtime.model.config import V4Config

    if args.cpu_dry_run:
        device, cfg = torch.device("cpu"), V4Config.small().replace(max_position_embeddings=4096)
        print(f"CPU dry run: V4Config.small(), eager, torch ops, torch {torch.__version__}", flush=True)
    else:
        device, cfg = torch.device("cuda"), V4Config.flash()
        print(f"{torch.cuda.get_device_name()} copy {measure_copy_bandwidth(device) / 1e12:.2f} TB/s", flush=True)
    weights = make_weight_sets(cfg, device, ["native"])["native"]
    defaults = {(m, n): getattr(m, n) for _, knobs in settings for m, n, _ in knobs}
    t0 = time.perf_counter()
    try:
        for batch, k in cases:
            results = {name: [] for name, _ in settings}
            for _ in range(args.rounds):
                for name, knobs in settings:
                    for (module, const), value in defaults.items():
                        setattr(module, const, value)
                    for module, const, value in knobs:
                        setattr(module, const, value)
                    ms, spread, drafts = run_case(cfg, weights, device, batch, k)
                    results[name].append((ms, drafts))
                    print(f"B={batch} K={k} {name:<24} replay {ms:.4f} ms (spread {spread:.3f})  drafts {drafts}",
                          flush=True)
            first = settings[0][0]
            base = statistics.mean(ms for ms, _ in results[first])
            for name, rows in results.items():
                mean = statistics.mean(ms for ms, _ in rows)
                same = all(d == results[first][0][1] for _, d in rows)
                print(f"B={batch} K={k} {name:<24} mean {mean:.4f} ms  {(mean - base) * 1e3:+6.1f} us against {first}"
                      f"  drafts equal {same}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:  # the defaults back, whatever a round raised (a caller in this process keeps them)
        for (module, const), value in defaults.items():
            setattr(module, const, value)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
