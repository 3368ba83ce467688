"""benchmarks/bench_knobs.py: knobs parsed to their constants' types, set before bench_draft runs;
bad knobs refused in one line with exit code 2 before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bench_knobs import parse_knobs

ROOT = Path(__file__).resolve().parents[1]


def test_knobs_take_their_constants_types():
    (fp8, name, config), (head, flag_name, flag), (moe, split_name, split) = parse_knobs(
        ["fp8_linear.BATCH1_CONFIG=4,512,1,6,fma", "head.LM_HEAD_PROLOGUE=true", "moe_mxfp4.W13_SPLIT_LARGE_BATCH=32"])
    assert (fp8.__name__, name) == ("draftgraph.ops.triton.fp8_linear", "BATCH1_CONFIG")
    shape = (config.block_n, config.block_k, config.num_warps, config.num_stages, config.use_dot)
    assert shape == (4, 512, 1, 6, False)
    assert (head.__name__, flag_name, flag) == ("draftgraph.ops.triton.head", "LM_HEAD_PROLOGUE", True)
    assert (moe.__name__, split_name, split) == ("draftgraph.ops.triton.moe_mxfp4", "W13_SPLIT_LARGE_BATCH", 32)
    (_, _, dot), = parse_knobs(["fp8_linear.LARGE_BATCH_CONFIG=64,128,4,3"])
    assert dot.use_dot and (dot.block_n, dot.num_stages) == (64, 3)


def test_a_knob_is_set_before_bench_draft_runs():
    done = subprocess.run([sys.executable, "benchmarks/bench_knobs.py", "combiner.COMBINER_MAX_ROWS=8", "--", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "knob combiner.COMBINER_MAX_ROWS = 8" in done.stdout
    assert "usage: bench_draft.py" in done.stdout  # bench_draft's own --help, after the knob


@pytest.mark.parametrize("knobs,expected", [
    (["nosuch.X=1"], "no module draftgraph.ops.triton.nosuch"),
    (["fp8_linear.NOPE=1"], "fp8_linear has no constant NOPE"),
    (["fp8_linear.BATCH1_CONFIG"], "expected MODULE.NAME=VALUE"),
    (["fp8_linear.BATCH1_CONFIG=4,512"], "expected block_n,block_k,num_warps,num_stages[,fma|dot]"),
    (["fp8_linear.BATCH1_CONFIG=4,0,1,6,fma"], "(positive ints)"),
    (["head.LM_HEAD_PROLOGUE=maybe"], "expected a bool (1, 0, true, false), got 'maybe'"),
    (["combiner.COMBINER_MAX_ROWS=1.5"], "expected an int, got '1.5'"),
])
def test_bad_knobs_are_one_line_and_exit_2(knobs, expected):
    done = subprocess.run([sys.executable, "benchmarks/bench_knobs.py", *knobs, "--", "--cpu-dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and expected in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "floor" not in done.stdout  # refused before bench_draft started


def test_no_separator_is_exit_2():
    done = subprocess.run([sys.executable, "benchmarks/bench_knobs.py", "head.LM_HEAD_PROLOGUE=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "MODULE.NAME=VALUE" in done.stderr


def test_ab_chain_settings_parse_to_knobs():
    from ab_chain import parse_settings

    both = "s2:moe_mxfp4.W13_SPLIT_MMA=2+head.LM_HEAD_PROLOGUE=1"
    (base, none), (split, knobs) = parse_settings(["base:", both])
    assert (base, none, split) == ("base", [], "s2")
    assert [(name, value) for _, name, value in knobs] == [("W13_SPLIT_MMA", 2), ("LM_HEAD_PROLOGUE", True)]
    (_, [(_, _, tile)]), = parse_settings(["t:fp8_linear.BATCH1_CONFIG=4,512,1,6,fma"])  # commas stay in the value
    assert (tile.block_n, tile.block_k, tile.use_dot) == (4, 512, False)


@pytest.mark.parametrize("args,expected", [
    (["nocolon"], "expected NAME:KNOB[+KNOB...]"),
    (["a:", "a:moe_mxfp4.W13_SPLIT_MMA=1"], "names must differ"),
    (["a:moe_mxfp4.W13_SPLIT_MMA=x"], "expected an int, got 'x'"),
    (["--cases", "1y1", "a:"], "expected BxK pairs"),
])
def test_ab_chain_refuses_bad_settings_before_any_work(args, expected):
    done = subprocess.run([sys.executable, "benchmarks/ab_chain.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and expected in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_ab_chain_cpu_dry_run_alternates_settings_and_restores_the_knobs(capsys):
    """The rounds as on a GPU (a proposer a setting and case, built after its knobs are set), on the
    CPU's eager torch ops: every setting's row and summary, drafts compared, the defaults back after."""
    from ab_chain import main
    from draftgraph.ops.triton import head, moe_mxfp4

    before = (moe_mxfp4.W13_SPLIT_MMA, head.LM_HEAD_PROLOGUE)
    assert main(["--cpu-dry-run", "--cases", "1x1,2x1", "--rounds", "2", "base:",
                 "f2:moe_mxfp4.W13_SPLIT_MMA=2+head.LM_HEAD_PROLOGUE=1"]) == 0
    assert (moe_mxfp4.W13_SPLIT_MMA, head.LM_HEAD_PROLOGUE) == before
    lines = capsys.readouterr().out.splitlines()
    for case in ("B=1 K=1", "B=2 K=1"):
        assert sum(line.startswith(f"{case} f2 ") and " replay " in line for line in lines) == 2
        summary = [line for line in lines if line.startswith(case) and " mean " in line]
        assert len(summary) == 2 and all("drafts equal True" in line for line in summary), summary


def test_probe_fp8_gemv_refuses_an_unknown_table_before_any_work():
    done = subprocess.run([sys.executable, "benchmarks/probe_fp8_gemv.py", "batch1", "dots"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "expected batch1 and / or dot" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
