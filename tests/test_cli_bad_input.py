"""Every bad command-line input is one line on stderr (expected, got) and exit code 2, before any long work.

Issue 26.6: damaged checkpoints and configs, impossible devices, output paths that cannot be
written, out-of-range numbers, unknown runners and malformed CSVs each ended in a traceback (some
only after the whole run) or were accepted silently. Each case here runs the real ``main`` with the
long step of its tool (building the proposer, loading the models, building the chain graph,
drawing, planning) replaced by a tripwire, so a check that comes too late fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from draftgraph.runtime.model.checkpoint_writer import make_synthetic_checkpoint
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer, ProposerOptions
from draftgraph.tools.cli import main
from safetensors.torch import save_file

CFG = V4Config.small()
CAP = ProposerOptions().max_num_drafts


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A good small checkpoint, a hidden, and the bad inputs made from them."""
    root = tmp_path_factory.mktemp("bad_input")
    make_synthetic_checkpoint(root / "good", CFG, fmt="bf16", seed=0)
    save_file({"hidden": torch.zeros(CFG.hc_mult, CFG.hidden_size).bfloat16()}, str(root / "h.safetensors"))
    weights = root / "good" / "model.safetensors"
    for name in ("truncated", "random_bytes", "not_json", "hidden_abc", "no_hidden", "wider"):
        (root / name).mkdir()
        shutil.copy(root / "good" / "config.json", root / name / "config.json")
        if name not in ("truncated", "random_bytes"):
            (root / name / "model.safetensors").symlink_to(weights)
    data = weights.read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(data[: len(data) // 2])
    (root / "random_bytes" / "model.safetensors").write_bytes(os.urandom(4096))
    (root / "not_json" / "config.json").write_text("{hidden_size: 256")
    _edit_config(root / "hidden_abc", hidden_size="abc")
    _edit_config(root / "no_hidden", hidden_size=None)
    _edit_config(root / "wider", hidden_size=512)  # every tensor misshapen: 67 problems
    (root / "read_only").mkdir()
    (root / "header_only.csv").write_text("id,lower,upper,size\n")
    (root / "binary.csv").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))  # a picture named .csv
    (root / "zero_config").mkdir()
    (root / "zero_config" / "config.json").symlink_to("/dev/zero")  # endless: must not be read to the end
    (root / "huge.csv").write_text("id,lower,upper,size\nb1,0,3,100000000000000000000000\n")
    (root / "huge_total.csv").write_text("id,lower,upper,size\n" + "".join(f"b{i},0,3,{2**61}\n" for i in range(2)))
    (root / "ok.csv").write_text("id,lower,upper,size\nb1,0,3,4\n")
    (root / "latin1.txt").write_bytes("def caf\xe9():\n".encode("latin-1"))
    (root / "blank.txt").write_text("\n  \n")
    return root


@pytest.fixture
def tripwires(monkeypatch, root):
    """The long step of every tool fails the test if it starts; so does writing into read_only/."""

    def long_work(*args, **kwargs):
        raise AssertionError("long work started before the bad input was refused")

    monkeypatch.setattr(DeepseekV4MtpProposer, "__init__", long_work)
    monkeypatch.setattr("draftgraph.tools.workload.load_models", long_work)
    monkeypatch.setattr("draftgraph.tools.chain_select.build_draft_chain", long_work)
    monkeypatch.setattr("draftgraph.tools.draw.draw_matplotlib", long_work)
    monkeypatch.setattr("draftgraph.tools.demo.default_checkpoint", long_work)
    monkeypatch.setattr("draftgraph.runtime.planning.arena_plan.plan_arena", long_work)
    real_access = os.access
    read_only = str(root / "read_only")  # root may write anywhere: the check is what is tested
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == read_only else real_access(p, mode))


DRAFT = ["draft", "--token", "1", "--hidden", "{root}/h.safetensors", "--position", "3", "--device", "cpu"]

# (id, argv with {root}, fragments the one line must hold)
CASES = [
    ("truncated_safetensors", [*DRAFT, "--checkpoint", "{root}/truncated"], ["WeightError", "bytes of tensor data"]),
    ("random_bytes_safetensors", [*DRAFT, "--checkpoint", "{root}/random_bytes"], ["header length"]),
    ("config_not_json", [*DRAFT, "--checkpoint", "{root}/not_json"], ["config.json", "a JSON object"]),
    ("config_hidden_size_abc", [*DRAFT, "--checkpoint", "{root}/hidden_abc"], ["hidden_size", "an int", "'abc'"]),
    ("config_without_hidden_size", [*DRAFT, "--checkpoint", "{root}/no_hidden"], ["missing hidden_size"]),
    ("draft_hidden_not_safetensors", [*DRAFT[:4], "{root}/good/config.json", *DRAFT[5:], "--checkpoint",
                                      "{root}/good"], ["--hidden", "a readable safetensors file", "config.json"]),
    ("draft_checkpoint_is_config_json", [*DRAFT, "--checkpoint", "{root}/good/config.json"],
     ["checkpoint path", "a .safetensors file", "the file", "give the folder"]),
    ("device_tpu", [*DRAFT, "--checkpoint", "{root}/good", "--device", "tpu"], ["--device", "'tpu'"]),
    ("draft_hidden_missing", [*DRAFT[:4], "{root}/nowhere.safetensors", *DRAFT[5:], "--checkpoint", "{root}/good"],
     ["--hidden", "a tensor named 'hidden'", "no file at", "save_file"]),
    ("device_cpu_1", [*DRAFT, "--checkpoint", "{root}/good", "--device", "cpu:1"],
     ["--device", "'cpu:1'", "one device"]),
    ("device_cuda_without_cuda", [*DRAFT, "--checkpoint", "{root}/good", "--device", "cuda"], ["--device", "cuda"]),
    ("draft_trace_missing_folder", [*DRAFT, "--checkpoint", "{root}/good", "--trace", "{root}/nowhere/t.json"],
     ["--trace", "does not exist"]),
    ("draft_trace_read_only", [*DRAFT, "--checkpoint", "{root}/good", "--trace", "{root}/read_only/t.json"],
     ["--trace", "not writable"]),
    ("draft_num_drafts_1000", [*DRAFT, "--checkpoint", "{root}/good", "--num-drafts", "1000"],
     ["--num-drafts", f"1..{CAP}", "1000"]),
    ("draft_mtp_vocab_size_negative", [*DRAFT, "--checkpoint", "{root}/good", "--mtp-vocab-size", "-1"],
     ["--mtp-vocab-size", "-1"]),
    ("demo_rounds_0", ["demo", "--rounds", "0", "--device", "cpu"], ["--rounds", "0"]),
    # past the positions the demo model has: refused before the run, not an InputError mid-way
    ("demo_rounds_past_the_positions", ["demo", "--rounds", "1022", "--device", "cpu"],
     ["--rounds", "1..1021 with --num-drafts 3", "got 1022"]),
    ("demo_trace_missing_folder", ["demo", "--trace", "{root}/nowhere/t.json"], ["--trace"]),
    ("decode_num_drafts_1000", ["decode", "--num-drafts", "1000", "--device", "cpu"], ["--num-drafts", "1000"]),
    ("decode_device_tpu", ["decode", "--device", "tpu"], ["--device", "'tpu'"]),
    ("decode_trace_missing_folder", ["decode", "--device", "cpu", "--trace", "{root}/nowhere/t.json"], ["--trace"]),
    ("decode_batch_prompts_blank", ["decode", "--device", "cpu", "--batch-prompts", "{root}/blank.txt"],
     ["--batch-prompts", "one prompt a line", "blank lines only"]),
    ("decode_batch_prompts_not_utf8", ["decode", "--device", "cpu", "--batch-prompts", "{root}/latin1.txt"],
     ["--batch-prompts", "UTF-8", "byte 0xe9 at offset 7"]),
    # bytes that are not UTF-8 reach argv as lone surrogates (surrogateescape)
    ("decode_prompt_not_utf8", ["decode", "--device", "cpu", "--prompt", "ok", "--prompt", "caf\udce9"],
     ["--prompt #2", "UTF-8", "'\\udce9' at character 3"]),
    ("capture_dump_without_cuda", ["capture-dump", "--out", "{root}/cd"], ["capture-dump", "a CUDA GPU"]),
    ("swap_runner_nosuch", ["swap", "--runners", "identity,nosuch", "--device", "cpu"], ["RunnerError", "'nosuch'"]),
    ("dump_out_missing_folder", ["dump", "--out", "{root}/nowhere/chain.txt"], ["--out", "does not exist"]),
    ("dump_out_read_only", ["dump", "--out", "{root}/read_only/chain.txt"], ["--out", "not writable"]),
    ("dump_out_is_a_folder", ["dump", "--out", "{root}"], ["--out", "a file to write"]),
    ("dump_out_under_a_file", ["dump", "--out", "{root}/ok.csv/chain.txt"], ["--out", "ok.csv is a file"]),
    # a name past the file system's limit: pathlib's is_dir / exists raise there instead of answering
    ("dump_out_name_too_long", ["dump", "--out", "{root}/" + "x" * 300 + ".txt"], ["--out", "File name too long"]),
    ("demo_trace_name_too_long", ["demo", "--trace", "{root}/" + "x" * 300 + ".json"],
     ["--trace", "File name too long"]),
    ("arena_out_folder_name_too_long", ["arena", "--csv", "{root}", "--out", "{root}/" + "x" * 300 + "/pictures"],
     ["--out", "a folder for the pictures", "File name too long"]),
    # input paths past the limit: the lookup itself fails (OSError), each a typed error naming its flag
    ("draft_checkpoint_name_too_long", [*DRAFT, "--checkpoint", "{root}/" + "x" * 300],
     ["--checkpoint", "a folder with config.json", "File name too long"]),
    ("draft_hidden_name_too_long", [*DRAFT[:4], "{root}/" + "x" * 300, *DRAFT[5:], "--checkpoint", "{root}/good"],
     ["--hidden", "a safetensors file", "File name too long"]),
    ("decode_checkpoint_name_too_long", ["decode", "--device", "cpu", "--checkpoint", "{root}/" + "x" * 300],
     ["--checkpoint", "File name too long"]),
    ("decode_batch_prompts_name_too_long", ["decode", "--device", "cpu", "--batch-prompts", "{root}/" + "x" * 300],
     ["--batch-prompts", "a file", "File name too long"]),
    ("dump_checkpoint_name_too_long", ["dump", "--checkpoint", "{root}/" + "x" * 300],
     ["WeightError", "config.json", "File name too long"]),
    ("arena_csv_name_too_long", ["arena", "--format", "text", "--csv", "{root}/" + "x" * 300 + ".csv"],
     ["--csv", "File name too long"]),
    ("plan_csv_name_too_long", ["plan-csv", "{root}/" + "x" * 300 + ".csv"], ["file", "File name too long"]),
    ("plan_csv_is_a_folder", ["plan-csv", "{root}"], ["file", "a readable MiniMalloc CSV file", "Is a directory"]),
    ("dump_runner_nosuch", ["dump", "--runner", "nosuch"], ["RunnerError", "'nosuch'"]),
    ("dump_num_drafts_1000", ["dump", "--num-drafts", "1000"], ["--num-drafts", "1000"]),
    ("dump_batch_100000", ["dump", "--batch", "100000"], ["--batch", "1..64", "100000", "ProposerOptions.buckets"]),
    ("dump_batch_0", ["dump", "--batch", "0"], ["--batch", "1..64", "got 0"]),
    ("arena_batch_100000", ["arena", "--format", "text", "--batch", "100000"], ["--batch", "1..64", "100000"]),
    ("capture_dump_batch_100000", ["capture-dump", "--out", "{root}/c.dot", "--batch", "100000"],
     ["--batch", "1..64", "100000"]),
    ("draw_dpi_0", ["draw", "--out", "{root}/chain.png", "--engine", "matplotlib", "--dpi", "0"], ["--dpi", "0"]),
    ("draw_runner_nosuch", ["draw", "--out", "{root}/chain.png", "--runner", "nosuch"], ["RunnerError", "'nosuch'"]),
    ("draw_out_missing_folder", ["draw", "--out", "{root}/nowhere/chain.png"], ["--out", "does not exist"]),
    ("draw_out_gif", ["draw", "--out", "{root}/chain.gif"], ["--out", "a .svg or .png file", "chain.gif"]),
    # refused before planning: matplotlib would take the suffix only when saving, after the work
    ("arena_out_csv_suffix", ["arena", "--out", "{root}/arena.csv"], ["--out", "a .svg or .png file", "arena.csv"]),
    ("arena_runner_nosuch", ["arena", "--format", "text", "--runner", "nosuch"], ["RunnerError", "'nosuch'"]),
    ("arena_out_read_only", ["arena", "--out", "{root}/read_only/a.png"], ["--out", "not writable"]),
    ("arena_csv_header_only", ["arena", "--format", "text", "--csv", "{root}/header_only.csv"],
     ["PlanError", "the header only"]),
    ("arena_time_limit_nan", ["arena", "--format", "text", "--csv", "{root}/ok.csv", "--time-limit", "nan"],
     ["--time-limit", "nan"]),
    ("plan_csv_size_1e23", ["plan-csv", "{root}/huge.csv"], ["size", "100000000000000000000000"]),
    ("plan_csv_total_size_overflows", ["plan-csv", "{root}/huge_total.csv"], ["sizes", "a total below 2**62"]),
    ("plan_csv_header_only", ["plan-csv", "{root}/header_only.csv"], ["at least one buffer row"]),
    ("plan_csv_not_utf8", ["plan-csv", "{root}/binary.csv"],
     ["binary.csv", "a UTF-8 MiniMalloc CSV file", "at byte 0"]),
    ("arena_csv_not_utf8", ["arena", "--format", "text", "--csv", "{root}/binary.csv"],
     ["PlanError", "a UTF-8 MiniMalloc CSV file", "at byte 0"]),
    ("plan_csv_endless", ["plan-csv", "/dev/zero"], ["zero", "at most 67108864 bytes", "an endless stream"]),
    ("arena_csv_endless", ["arena", "--format", "text", "--csv", "/dev/zero"], ["PlanError", "an endless stream"]),
    ("dump_config_endless", ["dump", "--checkpoint", "{root}/zero_config"],
     ["WeightError", "more than 16777216 bytes"]),
    ("plan_csv_time_limit_nan", ["plan-csv", "{root}/ok.csv", "--time-limit", "nan"], ["--time-limit", "nan"]),
    ("plan_csv_time_limit_0", ["plan-csv", "{root}/ok.csv", "--time-limit", "0"], ["--time-limit", "got 0"]),
]


@pytest.mark.parametrize("argv, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(root, tripwires, capsys, argv, fragments):
    if ("cuda" in argv or argv[0] == "capture-dump") and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main([a.format(root=root) for a in argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    line = lines[0]
    assert line.startswith(f"draftgraph {argv[0]}: ") and "Traceback" not in line, line
    assert "expected" in line and "got" in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)


def test_missing_tensors_show_the_first_problems_and_the_hint(root, tripwires, capsys):
    argv = [a.format(root=root) for a in [*DRAFT, "--checkpoint", "{root}/wider"]]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "67 problem(s) with the requested tensors: misshapen embed.weight: expected BF16[1000, 512]" in line
    assert line.count("misshapen ") == 8 and "; ... and 59 more (hint: check that config.json matches" in line


@pytest.mark.parametrize(
    "argv",
    [
        [*DRAFT, "--checkpoint", "{root}/good", "--trace", "{root}/t.json"],
        ["demo", "--device", "cpu"],
        ["decode", "--device", "cpu"],
        ["swap", "--device", "cpu"],
        ["dump", "--out", "{root}/chain.txt"],
        ["draw", "--out", "{root}/chain.png", "--engine", "matplotlib"],
        ["arena", "--format", "text", "--csv", "{root}/ok.csv"],
        ["plan-csv", "{root}/ok.csv"],
    ],
    ids=lambda argv: argv[0],
)
def test_the_tripwires_catch_long_work(root, tripwires, argv):
    """With good arguments every tool reaches its tripwire: the checks above ran before it."""
    with pytest.raises(AssertionError, match="long work started"):
        main([a.format(root=root) for a in argv])


@pytest.mark.skipif(not (os.path.exists("/dev/full") and os.access("/dev", os.W_OK | os.X_OK)),
                    reason="needs /dev/full and a writable /dev (root) for the write to pass the checks")
def test_a_write_the_system_refuses_is_one_line_and_exit_1(capsys):
    """--out passes its checks (/dev/full can be opened for writing), then the write fails (no space
    left): one line naming the system's reason, exit 1 (not a bad argument), no traceback."""
    assert main(["dump", "--out", "/dev/full"]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["draftgraph dump: error: [Errno 28] No space left on device"], captured
