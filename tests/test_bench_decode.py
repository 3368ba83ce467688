"""benchmarks/bench_decode.py on the CPU: a short run's table, and the host-gap marking leaves the
models as it found them."""

from __future__ import annotations

import bench_decode
from decode_fixtures import make_proposer, make_target, prompts
from draftgraph.runtime.decode.loop import speculative_decode


def cell(header: str, line: str, name: str) -> str:
    """The cell of column ``name`` (cells are right-aligned under their header): '' if blank."""
    end = header.index(name) + len(name)
    return line[:end].split()[-1] if line[end - 1] != " " else ""


def test_a_short_run_reports_the_gap_and_the_full_batch_figures(capsys):
    assert bench_decode.main(["--device", "cpu", "--batches", "1", "--executors", "eager", "--max-tokens", "8",
                              "-k", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("  B executor"))
    rows = {line[14:24].strip(): line for line in lines if line.startswith("  1 eager")}  # name: columns 14-23
    assert set(rows) == {"greedy", "spec", "spec host"}
    assert cell(header, rows["spec host"], "same") in ("yes", "no") and cell(header, rows["greedy"], "same") == ""
    assert cell(header, rows["spec host"], "gap us") == ""  # a gap on the device loop only
    gap = float(cell(header, rows["spec"], "gap us"))
    assert 0 < gap < 1e6  # microseconds: host time between a read-back and the next launch
    # B=1: every round after the prefill began with the one sequence live, until it ended
    for name in ("greedy", "spec"):
        assert float(cell(header, rows[name], "full tok/s")) > 0
    assert cell(header, rows["greedy"], "full s/g") == "" and float(cell(header, rows["spec"], "full s/g")) > 0


def test_marking_records_each_read_and_launch_then_restores():
    target, proposer = make_target(), make_proposer()
    speculative_decode(target, proposer, prompts((5, 9)), 6, 2)  # builds the executors
    verifier = target.device_verifier(2)
    before = (verifier.read_verdict, [vars(e).get("run") for e in proposer._executors.values()])
    with bench_decode.marking(target, proposer, 2, bench_decode.Clock()) as clock:
        result = speculative_decode(target, proposer, prompts((5, 9)), 6, 2)
    reads = [what for what, _ in clock.events if what == "read"]
    assert len(reads) == result.stats.num_steps and len(clock.gaps("read")) == len(reads) - 1  # the last: no launch
    assert (verifier.read_verdict, [vars(e).get("run") for e in proposer._executors.values()]) == before
