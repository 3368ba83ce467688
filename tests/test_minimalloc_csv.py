"""The MiniMalloc CSV reader/writer and the ``draftgraph plan-csv`` subcommand."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from draftgraph.runtime.errors import PlanError
from draftgraph.runtime.planning.arena_plan import ArenaPlan, Buffer, plan_arena
from draftgraph.runtime.planning.minimalloc_csv import (
    capacity_from_name,
    format_minimalloc_csv,
    load_minimalloc_csv,
    parse_minimalloc_csv,
    read_minimalloc_csv,
    save_minimalloc_csv,
)
from draftgraph.runtime.planning.verify_plan import verify_plan
from draftgraph.tools import plan_csv

FOLDER = Path(__file__).resolve().parents[1] / "benchmarks" / "planner"
EXAMPLE = "id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n"


def test_parse_string_ids_and_half_open_lifetimes():
    parsed = parse_minimalloc_csv(EXAMPLE)
    assert parsed.offsets is None
    assert parsed.buffers[0] == Buffer("b1", 0, 3, 4) and [b.name for b in parsed.buffers][-1] == "b5"
    assert plan_arena(parsed.buffers, alignment=1).arena_bytes == 12


def test_round_trip_problem_and_solution(tmp_path: Path):
    buffers = load_minimalloc_csv(FOLDER / "C.1048576.csv")
    path = tmp_path / "copy.csv"
    save_minimalloc_csv(path, buffers)
    assert load_minimalloc_csv(path) == buffers
    assert format_minimalloc_csv(buffers) == (FOLDER / "C.1048576.csv").read_text()
    plan = plan_arena(buffers[:40], alignment=1, time_limit_s=0.1)
    save_minimalloc_csv(path, plan.buffers, plan.offsets)
    solution = read_minimalloc_csv(path)
    assert solution.buffers == plan.buffers and solution.offsets == plan.offsets
    assert path.read_text().splitlines()[0] == "id,lower,upper,size,offset"


def test_every_benchmark_file_loads():
    files = sorted(FOLDER.rglob("*.csv"))
    assert len(files) == 23
    sizes = {p.name: len(load_minimalloc_csv(p)) for p in files}
    assert sizes["A.1048576.csv"] == 154 and sizes["K.1048576.csv"] == 454 and sizes["input.12.csv"] == 5


def test_capacity_from_name():
    assert capacity_from_name("benchmarks/planner/A.1048576.csv") == 1048576
    assert capacity_from_name(Path("x/input.12.csv")) == 12
    assert capacity_from_name("tflm_greedy_medium.csv") is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty"),
        ("id,lower,upper\na,0,1\n", "columns id,lower,upper,size"),
        ("id,lower,upper,size,gaps\na,0,1,4,x\n", "'gaps'"),
        ("id,lower,upper,size\na,0,1\n", "f.csv:2: expected 4 fields"),
        ("id,lower,upper,size\na,0,x,4\n", "f.csv:2 upper: expected an integer, got 'x'"),
        ("id,lower,upper,size\na,5,5,4\n", "upper > lower"),
        ("id,lower,upper,size\na,0,1,-4\n", "positive size"),
        ("id,lower,upper,size\na,0,1,0\n", "positive size"),
        ("id,lower,upper,size\na,0,1,4\n\nb,0,1,4\na,1,2,4\n", "f.csv:5 id: expected unique ids"),
    ],
)
def test_malformed_csv_names_the_line(text: str, match: str):
    with pytest.raises(PlanError, match=match.replace("(", r"\(").replace(")", r"\)")):
        parse_minimalloc_csv(text, source="f.csv")


def test_old_header_spelling_and_missing_file(tmp_path: Path):
    assert parse_minimalloc_csv("buffer,lower,upper,size\n0,0,1,8\n").buffers == (Buffer("0", 0, 1, 8),)
    with pytest.raises(FileNotFoundError):
        load_minimalloc_csv(tmp_path / "absent.csv")


# ---- the plan-csv subcommand ---------------------------------------------------------------------


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="draftgraph")
    plan_csv.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan-csv", *argv])


def test_plan_csv_text_report(tmp_path: Path, capsys):
    path = tmp_path / "input.12.csv"
    path.write_text(EXAMPLE)
    assert plan_csv.run(parse_args(str(path))) == 0
    out = capsys.readouterr().out
    for line in (
        "buffers      5",
        "lower bound  12",
        "planned      12  (1.0000 x the bound",
        "12: fits",
        "time",
    ):
        assert line in out, (line, out)
    assert plan_csv.run(parse_args(str(path), "--capacity", "11")) == 1  # does not fit
    assert "does NOT fit (1 over)" in capsys.readouterr().out


def test_plan_csv_without_capacity(tmp_path: Path, capsys):
    path = tmp_path / "plain.csv"
    path.write_text(EXAMPLE)
    assert plan_csv.run(parse_args(str(path))) == 0
    assert "capacity     none given" in capsys.readouterr().out


def test_plan_csv_json_holds_every_offset(capsys):
    path = FOLDER / "A.1048576.csv"
    assert plan_csv.run(parse_args(str(path), "--json", "--time-limit", "0.5")) in (0, 1)
    out = capsys.readouterr().out
    report = json.loads(out)
    assert out.count("\n") == 1
    buffers = load_minimalloc_csv(path)
    assert report["num_buffers"] == 154 and report["capacity"] == 1048576 and report["lower_bound"] == 1048576
    assert report["fits"] == (report["arena_bytes"] <= 1048576)
    assert set(report["offsets"]) == {b.name for b in buffers}
    plan = ArenaPlan(report["offsets"], tuple(buffers), report["arena_bytes"], 0, 0, 1, "json", 0.0)
    verify_plan(plan)
    assert report["arena_bytes"] <= 1.15 * report["lower_bound"]


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "no such file"),
        ("id,lower,upper,size\na,0,1\n", "expected 4 fields"),
        ("id,lower,upper,size\na,4,2,8\n", "upper > lower"),
        ("id,lower,upper,size\na,0,2,-8\n", "positive size"),
        ("id;lower;upper;size\n", "header"),
    ],
)
def test_plan_csv_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, text, message):
    path = tmp_path / "bad.csv"
    if text is not None:
        path.write_text(text)
    assert plan_csv.run(parse_args(str(path))) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err


def test_plan_csv_help_has_an_example(capsys):
    with pytest.raises(SystemExit):
        parse_args("--help")
    assert "examples:" in capsys.readouterr().out
