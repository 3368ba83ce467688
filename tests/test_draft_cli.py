"""The `draftgraph draft` contract: JSON drafts, equal to the proposer; one-line errors, exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from draftgraph.runtime.model.checkpoint_writer import make_synthetic_checkpoint
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from draftgraph.tools.cli import main
from safetensors.torch import save_file

CFG = V4Config.small()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    make_synthetic_checkpoint(root / "ckpt", CFG, fmt="fp8", seed=2)
    hidden = torch.randn(CFG.hc_mult, CFG.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    save_file({"hidden": hidden}, str(root / "h.safetensors"))
    save_file({"other": hidden}, str(root / "bad.safetensors"))
    return root, hidden


def test_json_drafts_equal_the_proposer(files, capsys):
    root, hidden = files
    code = main(["draft", "--checkpoint", str(root / "ckpt"), "--token", "17", "--hidden", str(root / "h.safetensors"),
                 "--position", "40", "--num-drafts", "3", "--json", "--device", "cpu"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    prop = DeepseekV4MtpProposer.from_checkpoint(root / "ckpt", executor="eager")
    expected = prop.propose(17, hidden, 40, 3, prop.alloc_state())
    assert out["drafts"] == expected and len(expected) == 3


def test_vocab_limit_is_honoured(files, capsys):
    root, _ = files
    main(["draft", "--checkpoint", str(root / "ckpt"), "--token", "5", "--hidden", str(root / "h.safetensors"),
          "--position", "0", "--num-drafts", "3", "--vocab-limit", "10", "--json", "--device", "cpu"])
    drafts = json.loads(capsys.readouterr().out)["drafts"]
    assert all(0 <= d < 10 for d in drafts)


@pytest.mark.parametrize("args,fragment", [
    (["--token", "999999"], "last_token"),
    (["--position", "-3"], "--position"),
    (["--hidden", "missing.safetensors"], "--hidden"),
    (["--hidden", "bad.safetensors"], "'hidden'"),
    (["--num-drafts", "0"], "--num-drafts"),
])
def test_bad_arguments_get_one_line_errors_and_exit_2(files, capsys, args, fragment):
    root, _ = files
    base = {"--token": "1", "--hidden": "h.safetensors", "--position": "3", "--num-drafts": "2"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["draft", "--checkpoint", str(root / "ckpt"), "--device", "cpu"]
    for flag, value in base.items():
        argv += [flag, str(root / value) if flag == "--hidden" else value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1, err


def test_missing_checkpoint(tmp_path, capsys):
    assert main(["draft", "--checkpoint", str(tmp_path), "--token", "1", "--hidden", "x", "--position", "0"]) == 2
    assert "config.json" in capsys.readouterr().err
