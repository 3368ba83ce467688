"""``draftgraph decode``: speculative decoding with the MTP drafter and the small V4 target.

The prompt is byte-tokenized (BOS first), the target prefills it, then rounds of
propose K drafts -> one target forward verifies them -> greedy acceptance run
until EOS or --max-tokens. Prints each prompt with its continuation, then the
stats table (acceptance by draft position, mean accepted length, time split,
tokens per second). The output equals the target's own greedy decoding.

Before the first step every executor the run can use is built (on CUDA captured,
its kernels compiled): the warm-up, timed on its own line; the other figures are
steady state. --warmup-only times the warm-up alone. Rounds run on the device
(drafts, verify input and acceptance; one read-back a step) unless --host-loop.

Checkpoint: --checkpoint DIR, else the trained tiny model at tools/data/tiny_v4
when it is there, else a small random one (made once in the cache folder: its
text is noise, but the loop, the stats and the equivalence hold).
"""

from __future__ import annotations

import argparse
import time

from draftgraph.tools.workload import add_workload_args, load_workload

EXAMPLES = """examples:
  draftgraph decode --prompt "def fibonacci(n):"
  draftgraph decode --prompt "import os" --num-drafts 4 --max-tokens 128 --trace decode_trace.json
  draftgraph decode --batch-prompts prompts.txt --eager
  draftgraph decode --prompt "import os" --prompt "def main(" --warmup-only
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "decode",
        help="speculative decoding: MTP drafts verified by the small V4 target",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_args(p, max_tokens=64)
    p.add_argument(
        "--trace",
        default=None,
        help="write a Chrome/Perfetto trace (draft ops, target forwards); its folder must exist",
    )
    p.add_argument(
        "--warmup-only",
        action="store_true",
        help="build, capture and compile every executor the run would use, print the time, decode nothing",
    )
    p.add_argument(
        "--host-loop",
        action="store_true",
        help="read the drafts and the verify back each step (the host path) instead of the device loop",
    )
    return p


def run(args) -> int:
    from draftgraph.tools.arg_checks import check_output_file
    from draftgraph.tools.trace import Tracer

    check_output_file("--trace", args.trace)
    work = load_workload(args)
    target, proposer = work.target, work.proposer
    print(f"# checkpoint {work.checkpoint_note}")
    print(f"# {target!r}")
    tracer = Tracer() if args.trace else None
    on_step = None
    if tracer is not None:
        tracer.attach(proposer)
        target.tracer = tracer
        last = [time.perf_counter_ns()]

        def on_step(session, event):
            now = time.perf_counter_ns()
            tracer.slice(
                f"decode step {event.step}",
                last[0],
                now - last[0],
                cat="decode",
                args={"accepted": {str(k): v for k, v in event.accepted.items()}},
            )
            last[0] = now

    from draftgraph.runtime.decode.loop import DecodeSession
    from draftgraph.runtime.decode.warmup import build_counts, plan_warmup

    session = DecodeSession(
        target,
        proposer,
        work.encoded,
        work.max_tokens,
        work.num_drafts,
        eos_id=work.tokenizer.eos_id,
        on_step=on_step,
        progress=None,
        device_loop=False if args.host_loop else None,
    )
    loop = "device loop" if session.device_loop else "host loop"
    if args.warmup_only:
        plan = plan_warmup(target, proposer, [len(p) for p in work.encoded], work.num_drafts, session.device_loop)
        before = build_counts()
        seconds = session.warm_up()
        built = build_counts() - before
        session.close()
        print(f"# {loop}: buckets {plan.describe()}")
        print(
            f"warm-up {seconds:.3f} s: {built.executors} executors built, {built.captures} CUDA graphs captured, "
            f"{built.kernel_compiles} Triton kernels compiled"
        )
        return 0
    result = session.run()
    for i, (prompt, tokens, reason) in enumerate(zip(work.prompts, result.tokens, result.finish_reasons)):
        print(f"\n--- prompt {i} ({len(tokens)} tokens, ended by {reason})")
        print(prompt + work.tokenizer.decode(tokens))
    print(
        f"\n# speculative decoding, K={args.num_drafts}, {'eager' if not target.use_captured else 'captured'}, "
        f"{loop}"
    )
    print(result.stats.format_table())
    if tracer is not None:
        tracer.detach(proposer)
        target.tracer = None
        tracer.save(args.trace)
        print(f"trace written to {args.trace}")
    return 0
