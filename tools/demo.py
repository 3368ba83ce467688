"""``draftgraph demo``: the MTP draft step on the embedded small checkpoint, end to end.

Builds the proposer on a small V4-shaped checkpoint in the real format (FP8
linears, MXFP4 experts; made deterministically on first use), prints the K=3
chain graph with its arena plan, then runs a few rounds of prefill -> propose
K=3 -> verify against a stand-in target -> after_verify -> catch-up, printing
the drafts and the time per propose.
"""

from __future__ import annotations

import argparse
import time

import torch
from draftgraph.runtime.errors import describe
from draftgraph.runtime.model.config import V4Config
from draftgraph.tools.arg_checks import check_at_least, check_num_drafts, check_output_file
from draftgraph.tools.cli import UsageError
from draftgraph.tools.common import default_checkpoint, device_arg

EXAMPLES = """examples:
  draftgraph demo
  draftgraph demo --rounds 8 --trace demo_trace.json
  draftgraph demo --eager --mode collapsed
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="run the MTP draft step on the embedded default checkpoint",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="propose/verify rounds, >= 1 (default 5)")
    p.add_argument("--num-drafts", "-k", type=int, default=3,
                   help="drafts per propose (default 3; at most the proposer's max_num_drafts)")
    p.add_argument("--mode", choices=("streams", "collapsed"), default="streams")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    p.add_argument("--eager", action="store_true", help="force the eager executor (no CUDA graphs)")
    p.add_argument("--trace", default=None,
                   help="write a Chrome/Perfetto trace of the runs to this JSON file (its folder must exist)")
    p.add_argument("--quiet-graph", action="store_true", help="print only the arena summary, not the graph")
    return p


class StandInTarget:
    """A deterministic stand-in for the target model: random streams, a fixed token rule.

    It accepts a draft when the draft equals its own next token, which it takes to
    be the draft itself with probability ``agree`` (seeded), so rollbacks happen.
    """

    def __init__(self, config, mode: str, device, seed: int = 0, agree: float = 0.6) -> None:
        self.config, self.mode, self.device, self.agree = config, mode, device, agree
        self.gen = torch.Generator().manual_seed(seed)

    def hidden(self, n: int) -> torch.Tensor:
        c, d = self.config.hc_mult, self.config.hidden_size
        shape = (n, c, d) if self.mode == "streams" else (n, d)
        return torch.randn(*shape, generator=self.gen).to(torch.bfloat16).to(self.device)

    def verify(self, drafts: list[int]) -> tuple[int, int]:
        """(number accepted, the target's bonus token)."""
        accepted = 0
        for _ in drafts:
            if torch.rand((), generator=self.gen).item() < self.agree:
                accepted += 1
            else:
                break
        bonus = int(torch.randint(self.config.vocab_size, (), generator=self.gen))
        return accepted, bonus


PROMPT_TOKENS = 12  # the stand-in prompt's length


def max_rounds(num_drafts: int) -> int:
    """Rounds that fit the demo model's positions whatever the stand-in target accepts: a round
    moves the sequence 1 .. K + 1 positions, and each propose needs K positions past its own."""
    positions = V4Config.small().max_position_embeddings  # default_checkpoint's config
    return (positions - PROMPT_TOKENS - num_drafts) // (num_drafts + 1) + 1


def run(args) -> int:
    from draftgraph.runtime.ir.printer import format_graph
    from draftgraph.runtime.passes import run_passes
    from draftgraph.runtime.planning.graph_plan import plan_graph
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
    from draftgraph.tools.trace import Tracer

    check_at_least("--rounds", args.rounds, 1)
    check_num_drafts(args.num_drafts)
    if args.rounds > max_rounds(args.num_drafts):  # else the sequence runs out of positions mid-run
        raise UsageError(describe("--rounds", f"1..{max_rounds(args.num_drafts)} with --num-drafts {args.num_drafts}",
                                  args.rounds, "a round may move the sequence K + 1 positions of the demo "
                                  f"model's {V4Config.small().max_position_embeddings}"))
    check_output_file("--trace", args.trace)
    device = device_arg(args.device)
    path = default_checkpoint()
    executor = "eager" if args.eager else "auto"
    prop = DeepseekV4MtpProposer.from_checkpoint(path, device=device, mode=args.mode, executor=executor)
    k = args.num_drafts
    lowered = run_passes(prop.chain_graph(k))  # what the executors run
    graph = lowered.graph
    plan = plan_graph(graph, 1)
    print(f"# checkpoint {path} ({prop.config.hidden_size=}, experts MXFP4, linears FP8 -> bf16 at load)")
    if not args.quiet_graph:
        print("".join(f"# pass {line}\n" for line in lowered.summaries) + format_graph(graph, plan))
    else:
        print(plan.summary())
    target = StandInTarget(prop.config, args.mode, device)
    state = prop.alloc_state()
    prompt = [int(t) for t in torch.randint(prop.config.vocab_size, (PROMPT_TOKENS,), generator=target.gen)]
    hiddens = target.hidden(len(prompt))
    tracer = Tracer() if args.trace else None
    rows = prop.prefill_drafter(prompt, hiddens, state)
    print(f"\nprefill_drafter: {rows} drafter rows for a {len(prompt)}-token prompt")
    position, token, hidden = len(prompt) - 1, target.verify([])[1], hiddens[-1]
    times = []
    for round_index in range(args.rounds):
        if tracer is not None:
            tracer.attach(prop)
        start = time.perf_counter()
        drafts = prop.propose(token, hidden, position, k, state)
        times.append(time.perf_counter() - start)
        if tracer is not None:
            tracer.detach(prop)
        accepted, bonus = target.verify(drafts)
        prop.after_verify(accepted, state)
        # The target's verify pass gives hiddens for positions p+1 .. p+accepted+1. Catch the
        # drafter up with the exact pairs (t_{p+1}, h_p), (d_1, h_{p+1}) .. (d_a, h_{p+a}).
        new_hiddens = target.hidden(accepted + 1)
        pairs_hidden = torch.cat([hidden.unsqueeze(0), new_hiddens[:accepted]])
        caught = prop.catchup_drafter([token, *drafts[:accepted]], pairs_hidden, position, position, state)
        print(f"round {round_index}: position {position:3d} token {token:4d} -> drafts {drafts} "
              f"accepted {accepted} (catch-up {caught} rows) {times[-1] * 1e3:.2f} ms")
        position, token, hidden = position + accepted + 1, bonus, new_hiddens[-1]
    prop.free_state(state)
    steady = sorted(times[1:]) or times
    print(f"\npropose K={k}: median {steady[len(steady) // 2] * 1e3:.2f} ms (first {times[0] * 1e3:.1f} ms incl. "
          f"planning{' and capture' if prop.use_captured else ''}), free blocks {prop.cache.num_free_blocks}/"
          f"{prop.cache.num_blocks}")
    if tracer is not None:
        tracer.save(args.trace)
        print(f"trace written to {args.trace}")
    return 0
