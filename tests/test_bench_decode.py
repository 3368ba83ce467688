"""benchmarks/bench_decode.py on the CPU: a short run's table, and the host-gap marking leaves the
models as it found them."""

from __future__ import annotations

import bench_decode
from decode_fixtures import make_proposer, make_target, prompts
from draftgraph.runtime.decode.loop import speculative_decode


def test_a_short_run_reports_the_gap_of_the_device_loop(capsys):
    assert bench_decode.main(["--device", "cpu", "--batches", "1", "--executors", "eager", "--max-tokens", "8",
                              "-k", "2"]) == 0
    rows = {line[14:24].strip(): line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("  1 eager")}  # the run's name: columns 14-23
    assert set(rows) == {"greedy", "spec", "spec host"}
    assert rows["spec host"][-1] in ("yes", "no") and rows["greedy"][-1] != "yes"  # a gap on the device loop only
    gap = float(rows["spec"][-1])
    assert 0 < gap < 1e6  # microseconds: host time between a read-back and the next launch


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
