"""docs/TOOLS.md, held to the code: the figures and printed lines it shows are what the commands print.

A change to the planner, the passes or the printer that moves one fails here, naming the command
to run again (and, for a caption, the picture to draw again with the command the caption gives).
"""

from __future__ import annotations

import re
from pathlib import Path

from test_readme import SUMMARY, run_cli

TOOLS = (Path(__file__).resolve().parents[1] / "docs" / "TOOLS.md").read_text()


def test_the_dump_example_is_what_dump_prints():
    """The lines shown under "Lines of `draftgraph dump -k 1` look like" appear as printed."""
    block = re.search(r"Lines of `draftgraph dump -k 1` look like\n\n```\n(.*?)```", TOOLS, re.S)
    assert block, "docs/TOOLS.md: expected the dump -k 1 example block"
    printed = run_cli(["dump", "-k", "1"]).splitlines()
    shown = [line for line in block.group(1).splitlines() if line.strip() and line.strip() != "..."]
    missing = [line for line in shown if line not in printed]
    assert not missing, f"docs/TOOLS.md dump example: lines `draftgraph dump -k 1` no longer prints: {missing}"


def test_the_arena_caption_is_what_arena_prints():
    caption = re.search(r"\(`draftgraph arena -k 3 --out docs/arena_k3.png`\): (\d+)\s+values, ([\d.]+ \w+) against "
                        r"([\d.]+ \w+) naive, at the lower bound ([\d.]+ \w+)\.", TOOLS)
    assert caption, "docs/TOOLS.md: expected the arena picture's caption with its figures"
    (arena, naive, bound, values, batch), = SUMMARY.findall(run_cli(["arena", "-k", "3", "--format", "text"]))
    want = (values, arena, naive, bound)
    assert caption.groups() == want, (f"docs/TOOLS.md arena caption: expected {values} values, {arena} against "
                                      f"{naive} naive, lower bound {bound} (and the picture drawn again: "
                                      "draftgraph arena -k 3 --out docs/arena_k3.png)")
