"""What the scratch scripts share: a callable timed inside a CUDA graph, and a warmed-up proposer.

Imported by the scripts beside it (each puts this folder on sys.path); not part of the package.
"""

import torch


def best_in_graph(fn, reps: int = 20, n: int = 50) -> float:
    """Microseconds per call of ``fn``: ``reps`` calls captured in one CUDA graph, replayed ``n``
    times in 5 rounds; the best round (the noise of a shared machine only adds time)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        st.record()
        for _ in range(n // 5):
            g.replay()
        en.record()
        en.synchronize()
        ts.append(st.elapsed_time(en) * 1e3 / (n // 5) / reps)
    return min(ts)


def warm_torch_proposer(cfg, weights, dev, batch: int):
    """(proposer, its captured executor, the drafts of its second propose) for one bucket of
    ``batch`` rows at position 200, torch ops: the first propose captured, the second replayed."""
    from runtime.proposer import DeepseekV4MtpProposer

    prop = DeepseekV4MtpProposer(cfg, weights, device=dev, executor="captured", kernels="torch", buckets=(batch,),
                                 num_cache_blocks=batch * 16)
    gen = torch.Generator(device=dev).manual_seed(batch)
    hs = [torch.randn(cfg.hc_mult, cfg.hidden_size, device=dev, generator=gen).bfloat16() for _ in range(batch)]
    sts = [prop.alloc_state() for _ in range(batch)]
    prop.propose_batch(list(range(1, batch + 1)), hs, [200] * batch, 1, sts)
    for s in sts:
        prop.after_verify(0, s)
    d = prop.propose_batch(list(range(1, batch + 1)), hs, [200] * batch, 1, sts)
    return prop, next(iter(prop._executors.values())), d


def print_variants(cfg, weights, dev, cases: dict, variant, width: int = 16, repeats: int = 1,
                   traced: tuple = (), out_dir=None) -> None:
    """For each batch and variant name in ``cases`` ({batch: [names]}): ``variant(name)`` puts it in,
    then one line of its captured replay time (``repeats`` timings) and whether its drafts equal
    the batch's first. A B=1 variant named in ``traced`` also writes its replay's kernel timeline
    to ``out_dir``/timeline_b1_<name>.txt."""
    from tools.bench_draft import time_replays

    for batch, names in cases.items():
        first = None
        for name in names:
            variant(name)
            prop, ex, d = warm_torch_proposer(cfg, weights, dev, batch)
            first = d if first is None else first
            times = [time_replays(ex.replay) for _ in range(repeats)]
            replay = " / ".join(f"{ms * 1e3:7.1f}" for ms, _ in times)
            print(f"B={batch:2d} {name:{width}s} replay {replay} us spread {times[0][1]:.3f} same drafts {d == first}",
                  flush=True)
            if batch == 1 and name in traced:
                text = replay_timeline(ex.cuda_graph.replay, out_dir / "trace.json")
                (out_dir / f"timeline_b1_{name.replace(' ', '_')}.txt").write_text(text + "\n")
            del prop, ex
            torch.cuda.empty_cache()


def profiled_kernels(launch, path, replays: int = 1) -> list[dict]:
    """The kernel and copy events of the last of ``replays`` launches under torch.profiler (after
    three unprofiled ones), sorted by start; ``path`` is a scratch file for the trace."""
    import json

    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(replays):
            launch()
        torch.cuda.synchronize()
    p.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    path.unlink()
    ks = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                key=lambda e: e["ts"])
    return ks[(replays - 1) * (len(ks) // replays):]


def replay_timeline(replay, path) -> str:
    """The kernels of one replay (the third of three under torch.profiler), a line each:
    start us, duration us, stream, name; ``path`` is a scratch file for the trace."""
    ks = profiled_kernels(replay, path, replays=3)
    t0 = ks[0]["ts"]
    lines = [f"{len(ks)} kernels, {max(e['ts'] + e['dur'] for e in ks) - t0:.1f} us; start dur stream name"]
    lines += [f"{e['ts'] - t0:8.1f} {e['dur']:6.1f} s{e.get('tid', '?')!s:>4} {e['name'][:90]}" for e in ks]
    return "\n".join(lines)
