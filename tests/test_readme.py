"""README.md, held to the code: its example runs, and its figures are the ones its commands print.

Each figure in the README is written there once; these tests recompute it with the command or
the saved run the README names and compare, so a change to the planner, the passes or the CLI
that moves a figure fails here with the row to write instead.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PROSE = " ".join(README.split())  # the README with its line breaks as spaces, for sentences that wrap

# The summary line of a planned dump, e.g. "arena 7.5 KB (naive 32.5 KB, lower bound 7.5 KB), 46 values at B=1".
SUMMARY = re.compile(
    r"^arena (?P<arena>[\d.]+ \w+) \(naive (?P<naive>[\d.]+ \w+), lower bound (?P<bound>[\d.]+ \w+)\), "
    r"(?P<values>\d+) values at B=(?P<batch>\d+)$",
    re.M,
)


def section(title: str) -> str:
    """The README's text from the heading ``## title`` up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"README.md: expected a section '## {title}', got none"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """Cells of every markdown table row in ``text`` (header and rule rows left out)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append([c.replace("\\|", "|") for c in cells])
    return [r for r in rows if r and r[0] not in ("command", "B")]


def run_cli(argv: list[str]) -> str:
    """stdout of ``draftgraph ARGV``, run in this process as the console script runs it."""
    from draftgraph.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    assert code == 0, f"draftgraph {' '.join(argv)}: expected exit 0, got {code}"
    return out.getvalue()


# ---- the API example ---------------------------------------------------------------------------
def test_the_api_example_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", section("The proposer API"), re.M | re.S)
    assert len(blocks) == 1, f"README.md, The proposer API: expected one python block, got {len(blocks)}"
    monkeypatch.chdir(tmp_path)  # whatever it writes lands here, not in the checkout
    exec(compile(blocks[0], "README.md (The proposer API)", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    assert printed.startswith("import os"), f"the example prints the prompt and its continuation, got {printed!r}"


# ---- CPU-side figures: the arena table ---------------------------------------------------------
def arena_rows() -> list[list[str]]:
    rows = [r for r in table_rows(section("Concepts")) if r[0].startswith("`draftgraph dump")]
    assert len(rows) >= 2, f"README.md, Concepts: expected the arena table's dump rows, got {rows}"
    return rows


def write_flash_config(folder: Path) -> None:
    """Run the README's own command that writes flash.json, in ``folder``."""
    match = re.search(r'`python -c "(.*?)"`', section("Concepts"))
    assert match and "flash.json" in match.group(1), "README.md, Concepts: expected the command writing flash.json"
    subprocess.run([sys.executable, "-c", match.group(1)], cwd=folder, check=True)


@pytest.mark.parametrize("row", arena_rows(), ids=lambda r: r[0].strip("`").removeprefix("draftgraph dump "))
def test_arena_table_is_what_dump_prints(row, tmp_path, monkeypatch):
    command = row[0].strip("`")
    argv = shlex.split(command)[1:]
    if "flash.json" in argv:
        write_flash_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    printed = run_cli(argv)
    found = SUMMARY.findall(printed)
    assert len(found) == 1, f"{command}: expected one arena summary line, got {len(found)}"
    arena, naive, bound, values, batch = found[0]
    assert f"-b {batch}" in command, f"{command}: the summary is at B={batch}"
    want = f"| `{command}` | {arena} | {naive} | {bound} | {values} |"
    assert row[1:] == [arena, naive, bound, values], f"README.md arena table: expected the row\n{want}"


def test_passes_named_are_the_ones_dump_runs():
    match = re.search(r"by default ((?:`\w+`(?:, | and )?)+)", PROSE)
    assert match, "README.md, Concepts: expected the default passes, 'by default `a`, `b` and `c`'"
    written = re.findall(r"`(\w+)`", match.group(1))
    printed = re.findall(r"^# pass (\w+):", run_cli(["dump", "-k", "3"]), re.M)
    assert written == printed, f"README.md names the passes {written}; draftgraph dump ran {printed}"


# ---- the commands table documents every command and flag ---------------------------------------
def cli_subcommands():
    from draftgraph.tools.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices


def test_commands_table_has_every_command_and_flag():
    rows = {r[0].strip("`").split()[1]: r[0] for r in table_rows(section("Commands"))}
    for name, sub in cli_subcommands().items():
        assert name in rows, f"README.md, Commands: expected a row for `draftgraph {name}`, got {sorted(rows)}"
        written = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rows[name]))
        for action in sub._actions:
            if action.option_strings and "-h" not in action.option_strings:
                assert written & set(action.option_strings), (
                    f"README.md, Commands: `draftgraph {name}` row lacks {action.option_strings[0]}"
                )


def written_commands() -> list[str]:
    """Every complete ``draftgraph ...`` command in a code span (table synopses with [...] left out)."""
    spans = re.findall(r"`(draftgraph [^`]+)`", README)
    return [s for s in spans if not re.search(r"[\[|]", s) and len(s.split()) > 1]


@pytest.mark.parametrize("command", written_commands())
def test_each_command_written_out_parses(command):
    from draftgraph.tools.cli import build_parser

    build_parser().parse_args(shlex.split(command)[1:])


def test_linked_files_exist():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / target).exists(), f"README.md links {target}, which is not in the checkout"


# ---- the performance table: the saved run it cites ---------------------------------------------
def saved_run() -> tuple[Path, dict]:
    match = re.search(r"--table (benchmarks/h200/\S+\.json)", section("Performance"))
    assert match, "README.md, Performance: expected the --table command of the saved run"
    path = ROOT / match.group(1)
    return path, json.loads(path.read_text())


def test_performance_table_is_the_saved_run():
    """Every captured row of the saved run, each figure as the run has it (eager rows: --table)."""
    path, run = saved_run()
    rows = table_rows(section("Performance"))
    captured = [r for r in run["rows"] if r["variant"].startswith("draftgraph captured")]
    assert len(rows) == len(captured), f"{path.name}: {len(captured)} captured rows, README shows {len(rows)}"
    by_case = {(r["batch"], r["k"], r["weights"]): r for r in captured}
    for cells in rows:
        b, k, weights, *figures = cells
        saved = by_case[(int(b), int(k), weights)]
        got = [
            f"{saved['floor_ms']:.3f}",
            f"{saved['replay_ms']:.3f}",
            f"{saved['replay_ms'] / saved['floor_ms']:.2f}",
            f"{saved['propose_ms']:.3f}",
            f"{saved['propose_clock_ms']:.3f}",  # the caller's wait by the host's clock (runs from 49edb00 on)
        ]
        want = f"| {b} | {k} | {weights} | {' | '.join(got)} |"
        assert figures == got, f"README.md performance table: expected the row\n{want}"
    assert f"{run['bandwidth'] / 1e12:.2f} TB/s" in section("Performance")
    assert run["torch"] in section("Performance")


def test_performance_command_is_the_one_that_made_the_run():
    path, _ = saved_run()
    (command,) = re.findall(r"^python3? benchmarks/bench_draft\.py .*$", section("Performance"), re.M)
    log = path.with_name(path.stem + "_log.txt").read_text().splitlines()[0]
    assert log.startswith(command + " "), f"{path.name}'s log ran: {log}"


# ---- the tiny model's figures ------------------------------------------------------------------
def test_tiny_model_agreement_is_its_metrics_file():
    metrics = json.loads((ROOT / "tools" / "data" / "tiny_v4" / "metrics.json").read_text())
    match = re.search(r"at (0\.\d+) of ([\d,]+) held-out positions", PROSE)
    assert match, "README.md: expected the tiny model's agreement 'at X of N held-out positions'"
    assert match.groups() == (f"{metrics['mtp_agreement']:.3f}", f"{metrics['eval_positions']:,}")
    # The commands that made it (three runs, each warm-starting the last) are in metrics.json, named here.
    assert "tools/data/tiny_v4/metrics.json" in PROSE
    assert metrics["command"].replace("tools/", "benchmarks/").startswith("python benchmarks/train_tiny.py")


@pytest.fixture
def only_when_slow_selected(request):
    markexpr = request.config.getoption("markexpr") or ""
    if "slow" not in markexpr or "not slow" in markexpr:
        pytest.skip("the decode loop over 6 held-out files takes ~40 s: run with -m slow")


@pytest.mark.slow
def test_tiny_model_acceptance_is_what_eval_prints(only_when_slow_selected):
    (command,) = re.findall(r"`(python benchmarks/eval_acceptance\.py [^`]*)`", README)
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    first = re.search(r"^\s+accepted\s+([\d.]+)", done.stdout, re.M).group(1)
    mean = re.search(r"mean accepted length\s+([\d.]+)", done.stdout).group(1)
    assert f"first-draft acceptance {first}, mean accepted length {mean}" in PROSE


def test_the_readme_stays_short():
    """User documentation of at most 250 lines (issue 25); measurement history lives in benchmarks/."""
    lines = len(README.splitlines())
    assert lines <= 250, f"README.md: expected at most 250 lines, got {lines} (move history to benchmarks/)"
