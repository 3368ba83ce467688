"""``draftgraph decode`` and ``draftgraph swap`` on a tiny self-made checkpoint (with target layers)."""

from __future__ import annotations

import json

import pytest
from decode_fixtures import CFG, single_thread  # noqa: F401
from draftgraph.runtime.model.weights import make_synthetic_checkpoint
from draftgraph.tools.cli import main
from draftgraph.tools.swap import COLUMNS, parse_runners, prompt_lines
from draftgraph.tools.workload import DEFAULT_PROMPT, TINY_CHECKPOINT, row_bucket

PROMPTS = ["def f(x):", "hello"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    make_synthetic_checkpoint(path, CFG, fmt="bf16", seed=0, include_target_layers=True)
    return path


def workload(checkpoint, *extra):
    args = ["--checkpoint", str(checkpoint), "--max-tokens", "6", "--device", "cpu", "--eager"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return args + list(extra)


def texts_after(out: str, marker: str = "--- prompt") -> list[str]:
    """The line after each ``--- prompt i`` header: the prompt and its continuation."""
    lines = out.splitlines()
    return [lines[i + 1] for i, line in enumerate(lines) if line.startswith(marker)]


def test_decode_prints_text_and_the_stats_table(checkpoint, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["decode", *workload(checkpoint, "--trace", str(trace))]) == 0
    out = capsys.readouterr().out
    texts = texts_after(out)
    assert [t[: len(p)] for t, p in zip(texts, PROMPTS)] == PROMPTS
    assert "(6 tokens, ended by length)" in out or "ended by eos" in out
    lines = out.splitlines()
    assert "acceptance by draft position" in lines
    header = next(ln for ln in lines if ln.strip().startswith("draft position"))
    assert header.split() == ["draft", "position", "1", "2", "3"]
    for name in ("acceptance rate", "mean accepted length", "draft ms / propose", "tokens / s"):
        assert any(ln.strip().startswith(name) for ln in lines), name
    split = lines[lines.index(next(ln for ln in lines if ln.startswith("time split"))) :]
    assert split[0].split() == ["time", "split", "seconds", "share"]
    assert [ln.split()[0] for ln in split[1:6]] == ["prefill", "draft", "verify", "host", "total"]
    events = json.loads(trace.read_text())["traceEvents"]
    cats = {e["cat"] for e in events}
    assert {"target", "decode", "swa_attention"} <= cats
    assert any(e["name"].startswith("target forward") for e in events)


def test_decode_batch_prompts_file_and_bad_arguments(checkpoint, tmp_path, capsys):
    batch = tmp_path / "prompts.txt"
    batch.write_text("import os\n\nclass A:\n")
    args = [
        "decode",
        "--checkpoint",
        str(checkpoint),
        "--batch-prompts",
        str(batch),
        "--max-tokens",
        "3",
        "--num-drafts",
        "2",
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    texts = texts_after(out)
    assert len(texts) == 2 and texts[0].startswith("import os") and texts[1].startswith("class A:")
    assert main(["decode", "--checkpoint", str(checkpoint), "--num-drafts", "0"]) == 2
    assert "--num-drafts" in capsys.readouterr().err
    assert main(["decode", "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_swap_table_and_greedy_equivalence(checkpoint, capsys):
    runners = "identity,builtin,torch_module,draftgraph.runtime.proposer.runners.identity:IdentityRunner"
    assert main(["swap", "--runners", runners, *workload(checkpoint)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("runner"))
    assert [c.strip() for c in lines[head].split("  ") if c.strip()] == list(COLUMNS)
    rows = [ln.split() for ln in lines[head + 2 : head + 6]]
    assert [r[0] for r in rows] == [
        "builtin",
        "identity",
        "torch_module",
        "draftgraph.runtime.proposer.runners.identity:IdentityRunner",
    ]
    for r in rows:
        acceptance, mean_len, draft_ms, delta, same = r[1:]
        assert 0 <= float(acceptance) <= 1 and float(mean_len) >= 1 and float(draft_ms) > 0
        assert same == "yes"
    assert rows[0][4] == "0" and float(rows[2][4]) < 0.5  # torch_module: an independent body, bf16-close
    assert rows[1][4] == rows[3][4]  # identity by name or by module:callable: the same runner
    assert "decoded text identical for all runners: yes" in lines
    swap_texts = texts_after(out)
    assert main(["decode", *workload(checkpoint)]) == 0  # the same workload through decode
    assert texts_after(capsys.readouterr().out) == swap_texts


def test_parse_runners_and_row_bucket():
    assert parse_runners("identity, torch_module") == ["builtin", "identity", "torch_module"]
    assert parse_runners("torch_module,builtin") == ["builtin", "torch_module"]
    assert row_bucket(1, 3) == 16 and row_bucket(5, 3) == 32 and row_bucket(8, 7) == 64
    assert main(["swap", "--runners", "identity,identity"]) == 2


@pytest.mark.skipif(not (TINY_CHECKPOINT / "config.json").exists(), reason="tools/data/tiny_v4 is not shipped here")
def test_swap_default_prompt_tells_the_runners_apart(capsys):
    """Issue 26.7: on the default prompt the identity body drafts clearly worse than builtin, and the
    table's header names the prompt (the old one decoded spaces: every runner accepted 1.000)."""
    assert main(["swap", "--runners", "identity", "--device", "cpu", "--eager"]) == 0
    out = capsys.readouterr().out
    assert f"# prompt 0: {DEFAULT_PROMPT!r} (the default; --prompt to change it)" in out.splitlines()
    rows = [ln.split() for ln in out.splitlines()]
    acceptance = {r[0]: float(r[1]) for r in rows if r[:1] in (["builtin"], ["identity"])}
    assert acceptance["builtin"] >= 0.6 and acceptance["identity"] <= acceptance["builtin"] - 0.4, acceptance


def test_prompt_lines_name_each_prompt_and_cut_long_ones():
    lines = prompt_lines(["import os", "x" * 300, DEFAULT_PROMPT], width=20)
    assert lines[:2] == ["# prompt 0: 'import os'", "# prompt 1: 'xxxxxxxxxxxxxxxx..."]
    assert lines[2].endswith("... (the default; --prompt to change it)")
