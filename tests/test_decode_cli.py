"""``draftgraph decode --warmup-only`` and ``--host-loop`` (issue 27.1, 27.2) on a tiny self-made checkpoint."""

from __future__ import annotations

import json

import pytest
from decode_fixtures import CFG, single_thread  # noqa: F401
from draftgraph.runtime.model.weights import make_synthetic_checkpoint
from draftgraph.tools.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    make_synthetic_checkpoint(path, CFG, fmt="bf16", seed=0, include_target_layers=True)
    return path


def args(checkpoint, *extra):
    return ["decode", "--checkpoint", str(checkpoint), "--max-tokens", "8", "--device", "cpu", "--eager",
            "--prompt", "def f(x):", "--prompt", "hello", *extra]


def test_warmup_only_prints_the_warm_up_and_decodes_nothing(checkpoint, capsys):
    assert main(args(checkpoint, "--warmup-only")) == 0
    out = capsys.readouterr().out
    assert "--- prompt" not in out and "acceptance by draft position" not in out
    line = next(ln for ln in out.splitlines() if ln.startswith("warm-up "))
    seconds = float(line.split()[1])
    assert seconds > 0 and "executors built, 0 CUDA graphs captured" in line
    assert "# device loop: buckets target [16], verify [16], chain [1, 2]" in out


def test_device_and_host_loop_print_the_same_text(checkpoint, tmp_path, capsys):
    outs = {}
    for loop in ("device", "host"):
        trace = tmp_path / f"{loop}.json"
        extra = ["--host-loop"] if loop == "host" else []
        assert main(args(checkpoint, "--trace", str(trace), *extra)) == 0
        out = capsys.readouterr().out
        assert f"{loop} loop" in next(ln for ln in out.splitlines() if ln.startswith("# speculative decoding"))
        warm = next(ln for ln in out.splitlines() if ln.strip().startswith("warm-up"))
        assert float(warm.split()[1]) > 0
        outs[loop] = out[: out.index("# speculative decoding")]  # the prompts and their continuations
        names = {e["name"].split(" R=")[0] for e in json.loads(trace.read_text())["traceEvents"]}
        assert ("target verify on device" in names) == (loop == "device")
    assert outs["device"] == outs["host"]
