"""``draftgraph swap``: the same decode workload once per body runner, compared in one table.

For each runner (``builtin`` = the op subgraph, ``identity``, ``torch_module``,
or any ``package.module:callable``) the proposer's body is swapped
(``set_circuit_draft``: re-planned, captures dropped) and the prompts are decoded
speculatively with the same target. Columns: acceptance rate, mean accepted
length (tokens per verify, bonus included), draft ms per propose, max |delta
hidden| of the first propose's final hidden against builtin (same token, hidden
and position in), and whether the decoded text equals builtin's. Greedy
verification makes the text independent of the drafter, so the last line must
say "yes"; the exit code is 1 when it does not. The header names the prompts;
the default is a short Python class, on which the tiny model's MTP drafts well
and the identity body does not (so acceptance tells the runners apart).
"""

from __future__ import annotations

import argparse

from draftgraph.tools.arg_checks import check_runner
from draftgraph.tools.cli import UsageError
from draftgraph.tools.workload import DEFAULT_PROMPT, add_workload_args, load_workload

EXAMPLES = """examples:
  draftgraph swap
  draftgraph swap --runners builtin,identity,torch_module --prompt "class Foo:"
  draftgraph swap --runners builtin,mypkg.runners:make_runner --max-tokens 64
"""

MAX_PROMPT_CHARS = 100  # of a prompt's literal in the table's header
COLUMNS = ("runner", "acceptance", "mean acc len", "draft ms/propose", "max |d hidden|", "text identical")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "swap",
        help="decode once per body runner and compare acceptance, speed, output",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--runners",
        default="builtin,identity,torch_module",
        help="comma-separated runners (builtin is run first as the reference)",
    )
    add_workload_args(p, max_tokens=32)
    return p


def parse_runners(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--runners: expected a comma-separated list, got {text!r}")
    if len(set(names)) != len(names):
        raise UsageError(f"--runners: expected distinct names, got {text!r}")
    if "builtin" in names:
        names.remove("builtin")
    return ["builtin", *names]  # the reference, always first


def run(args) -> int:
    runners = parse_runners(args.runners)
    for name in runners:  # a runner that does not load is refused before any decoding
        check_runner(name)
    work = load_workload(args)
    proposer, prompts = work.proposer, work.prompts
    print(f"# checkpoint {work.checkpoint_note}")
    print(
        f"# {len(prompts)} prompt(s), K={args.num_drafts}, max {args.max_tokens} tokens, "
        f"{'captured' if proposer.use_captured else 'eager'}"
    )
    print("\n".join(prompt_lines(prompts)))
    rows, texts, first_hidden = [], {}, {}
    for name in runners:
        proposer.set_circuit_draft(None if name == "builtin" else name)

        def on_step(session, event, name=name):
            if event.step == 1:  # the first round: every runner got the same token, hidden and position
                first_hidden[name] = proposer.last_hidden(len(event.accepted)).float().cpu()

        result = work.decode(on_step)
        texts[name] = [work.tokenizer.decode(t) for t in result.tokens]
        rows.append((name, result.stats))
    proposer.set_circuit_draft(None)
    reference = texts["builtin"]
    table = []
    for name, stats in rows:
        delta = "-"
        if name in first_hidden and "builtin" in first_hidden:
            delta = f"{float((first_hidden[name] - first_hidden['builtin']).abs().max()):.3g}"
        table.append(
            (
                name,
                f"{stats.acceptance_rate:.3f}",
                f"{stats.mean_accepted_length:.2f}",
                f"{stats.draft_ms_per_propose:.2f}",
                delta,
                "yes" if texts[name] == reference else "NO",
            )
        )
    print(format_rows(COLUMNS, table))
    identical = all(texts[name] == reference for name in runners)
    print(f"decoded text identical for all runners: {'yes' if identical else 'NO'}")
    for i, (prompt, text) in enumerate(zip(prompts, reference)):
        print(f"\n--- prompt {i}\n{prompt + text}")
    return 0 if identical else 1


def prompt_lines(prompts: list[str], width: int = MAX_PROMPT_CHARS) -> list[str]:
    """``# prompt i: 'text'`` per prompt (as a Python literal, cut at ``width``), the default marked."""
    lines = []
    for i, prompt in enumerate(prompts):
        text = repr(prompt)
        if len(text) > width:
            text = text[: width - 3] + "..."
        default = " (the default; --prompt to change it)" if prompt == DEFAULT_PROMPT else ""
        lines.append(f"# prompt {i}: {text}{default}")
    return lines


def format_rows(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """An aligned text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    lines = []
    for row in [columns, *rows]:
        cells = [f"{row[0]:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
