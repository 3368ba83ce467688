"""Checkpoint names, writing and loading in bf16 / FP8 / MXFP4, and every bad-checkpoint error."""

from __future__ import annotations

import json
import math
import re

import draftgraph.runtime.model.weights as weights_module
import pytest
import torch
from checkpoint_spy import SpyOpen
from draftgraph.runtime.errors import InputError, WeightError
from draftgraph.runtime.model.checkpoint_writer import INDEX_FILE
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.weights import (
    MTP_TENSOR_NAMES,
    TARGET_TENSOR_NAMES,
    checkpoint_layout,
    load_checkpoint,
    make_synthetic_checkpoint,
    random_mtp_weights,
    write_checkpoint,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

CONFIG = V4Config.small()


@pytest.fixture(scope="module")
def weights():
    return random_mtp_weights(CONFIG, seed=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, weights):
    """The same random weights written in each format (and once sharded)."""
    dirs = {}
    for fmt in ("bf16", "fp8", "mxfp4"):
        dirs[fmt] = tmp_path_factory.mktemp(fmt)
        write_checkpoint(dirs[fmt], CONFIG, weights, fmt=fmt)
    dirs["sharded"] = tmp_path_factory.mktemp("sharded")
    write_checkpoint(dirs["sharded"], CONFIG, weights, fmt="mxfp4", shards=3)
    return dirs


def _write_bf16(path, tensors, config=CONFIG):
    path.mkdir(parents=True, exist_ok=True)
    config.save(path / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


# ---- names -----------------------------------------------------------------------------------


def test_flash_mtp_has_1575_stored_tensors_under_mtp0():
    flash = V4Config.flash()
    entries = MTP_TENSOR_NAMES(flash)  # names and shapes only: nothing is allocated
    assert all(isinstance(e.shape, tuple) and all(isinstance(d, int) for d in e.shape) for e in entries)
    stored = [s for s in checkpoint_layout(entries, "mxfp4") if s.name.startswith("mtp.0.")]
    assert len(stored) == 1575
    # Independent count from spec section 5: 8 MTP-head tensors (e_proj, h_proj, 3 norms, 3
    # hc_head), a block of 10 attention/norm + 6 mHC + 2 gate + 3 x 256 expert + 3 shared
    # tensors; plus one scale per quantised linear (2 + 5 attention + 768 routed + 3 shared).
    assert len(stored) == (8 + 10 + 6 + 2 + 3 * 256 + 3) + (2 + 5 + 3 * 256 + 3)
    by_name = {s.name: s for s in stored}
    assert by_name["mtp.0.e_proj.weight"] == ("mtp.0.e_proj.weight", (4096, 4096), "F8_E4M3")
    assert by_name["mtp.0.e_proj.scale"] == ("mtp.0.e_proj.scale", (32, 32), "F8_E8M0")
    assert by_name["mtp.0.attn.wo_a.weight"].shape == (8 * 1024, 64 * 512 // 8)
    assert by_name["mtp.0.attn.wq_b.scale"].shape == (256, 8)
    assert by_name["mtp.0.ffn.experts.255.w2.weight"] == (
        "mtp.0.ffn.experts.255.w2.weight",
        (4096, 1024),
        "I8",
    )
    assert by_name["mtp.0.ffn.experts.255.w2.scale"].shape == (4096, 64)
    assert by_name["mtp.0.hc_attn_fn"] == ("mtp.0.hc_attn_fn", (24, 4 * 4096), "F32")
    assert by_name["mtp.0.ffn.gate.bias"].dtype == "F32"
    assert "mtp.0.ffn.gate.tid2eid" not in by_name  # the MTP layer is score-routed
    outside = [e.name for e in entries if not e.name.startswith("mtp.0.")]
    assert outside == ["embed.weight", "head.weight"]


def test_target_names_hash_layers_and_compressed_refusal():
    entries = {e.name: e for e in TARGET_TENSOR_NAMES(CONFIG)}
    assert entries["layers.0.ffn.gate.tid2eid"].shape == (CONFIG.vocab_size, CONFIG.num_experts_per_tok)
    assert entries["layers.0.ffn.gate.tid2eid"].kind == "int32"
    assert "layers.0.ffn.gate.bias" not in entries  # num_hash_layers = 1
    assert "layers.1.ffn.gate.bias" in entries and "layers.1.ffn.gate.tid2eid" not in entries
    assert {"norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"} <= set(entries)
    assert not any(n.startswith("layers.2.") for n in entries)
    with pytest.raises(WeightError, match="compressed attention"):
        TARGET_TENSOR_NAMES(V4Config.flash())


def test_written_files_hold_exactly_the_real_layout(checkpoints):
    entries = MTP_TENSOR_NAMES(CONFIG)
    for fmt in ("bf16", "fp8", "mxfp4"):
        with safe_open(str(checkpoints[fmt] / "model.safetensors"), "pt") as f:
            got = {(k, tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        assert got == {tuple(s) for s in checkpoint_layout(entries, fmt)}, fmt
    config = json.loads((checkpoints["mxfp4"] / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert "quantization_config" not in json.loads((checkpoints["bf16"] / "config.json").read_text())


# ---- loading -----------------------------------------------------------------------------------


def test_bf16_checkpoint_loads_exactly(checkpoints, weights):
    ckpt = load_checkpoint(checkpoints["bf16"])
    assert ckpt.config == CONFIG
    assert list(ckpt.tensors) == [e.name for e in MTP_TENSOR_NAMES(CONFIG)]
    for name, tensor in ckpt.tensors.items():
        assert tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name]), name
    assert set(ckpt.source.values()) == {"bf16", "fp32"}
    assert torch.equal(ckpt.mtp("e_proj.weight"), weights["mtp.0.e_proj.weight"])
    assert ckpt.nbytes == sum(t.numel() * t.element_size() for t in weights.values())


@pytest.mark.parametrize("fmt, bound", [("fp8", 0.04), ("mxfp4", 0.15)])
def test_quantised_checkpoints_load_within_quantisation_error(checkpoints, weights, fmt, bound):
    ckpt = load_checkpoint(checkpoints[fmt])
    for entry in MTP_TENSOR_NAMES(CONFIG):
        got, want = ckpt.tensors[entry.name], weights[entry.name]
        assert got.dtype == entry.dtype and got.shape == want.shape, entry.name
        if entry.kind in ("fp8", "mxfp4"):
            assert ckpt.source[entry.name] == ("mxfp4" if fmt == entry.kind == "mxfp4" else "fp8")
            # Relative RMS error: e4m3 rounds within 2^-4 (~2.7% RMS on Gaussian blocks),
            # e2m1 within 1/4 (~12% RMS); a wrong scale or nibble order is far outside.
            rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert 0 < rel < bound, (entry.name, rel)
        else:
            assert torch.equal(got, want), entry.name


def test_fp8_linears_are_identical_in_fp8_and_mxfp4_checkpoints(checkpoints):
    fp8, mx = load_checkpoint(checkpoints["fp8"]), load_checkpoint(checkpoints["mxfp4"])
    for entry in MTP_TENSOR_NAMES(CONFIG):
        if entry.kind == "fp8":
            assert torch.equal(fp8.tensors[entry.name], mx.tensors[entry.name]), entry.name


def test_sharded_checkpoint_with_index(checkpoints):
    root = checkpoints["sharded"]
    files = sorted(p.name for p in root.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((root / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    for name, file in index["weight_map"].items():  # scales live beside their weights
        if name.endswith(".scale"):
            assert index["weight_map"][name[: -len("scale")] + "weight"] == file
    total = sum(t.numel() * t.element_size() for f in files for t in load_file(str(root / f)).values())
    assert index["metadata"]["total_size"] == total
    sharded, single = load_checkpoint(root), load_checkpoint(checkpoints["mxfp4"])
    assert sharded.source == single.source
    for name in single.tensors:
        assert torch.equal(sharded.tensors[name], single.tensors[name]), name


def test_single_file_path(checkpoints, weights):
    file = checkpoints["fp8"] / "model.safetensors"
    by_file = load_checkpoint(file)  # config.json found beside it
    by_dir = load_checkpoint(checkpoints["fp8"])
    assert all(torch.equal(by_file.tensors[n], by_dir.tensors[n]) for n in by_dir.tensors)
    assert load_checkpoint(file, CONFIG, names=["mtp.0.enorm.weight"]).tensors.keys() == {
        "mtp.0.enorm.weight"
    }


def test_lazy_load_reads_only_the_requested_tensors(tmp_path, monkeypatch):
    everything = make_synthetic_checkpoint(tmp_path, CONFIG, fmt="mxfp4", include_target_layers=True)
    assert any(n.startswith("layers.") for n in everything)
    read: list[str] = []
    monkeypatch.setattr(weights_module, "safe_open", SpyOpen(safe_open, lambda name, tensor: read.append(name)))
    ckpt = load_checkpoint(tmp_path)
    expected = {s.name for s in checkpoint_layout(MTP_TENSOR_NAMES(CONFIG), "mxfp4")}
    assert len(read) == len(set(read)) == len(expected)
    assert set(read) == expected
    assert not any(n.startswith("layers.") or n.startswith("hc_head") for n in read)
    read.clear()
    ckpt = load_checkpoint(tmp_path, names=["embed.weight", "mtp.0.ffn.experts.3.w2.weight"])
    assert sorted(read) == ["embed.weight", "mtp.0.ffn.experts.3.w2.scale", "mtp.0.ffn.experts.3.w2.weight"]
    assert ckpt.source["mtp.0.ffn.experts.3.w2.weight"] == "mxfp4"
    read.clear()
    target = load_checkpoint(tmp_path, names="target")
    assert target.tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert torch.equal(target.tensors["layers.0.ffn.gate.tid2eid"], everything["layers.0.ffn.gate.tid2eid"])
    assert not any(n.startswith("mtp.") for n in read)


# ---- bad checkpoints -------------------------------------------------------------------------


def _problems(exc: pytest.ExceptionInfo) -> list[str]:
    return [line[4:] for line in str(exc.value).splitlines() if line.startswith("  - ")]


def test_missing_tensors_are_all_named(tmp_path, weights):
    bad = dict(weights)
    del bad["mtp.0.enorm.weight"], bad["mtp.0.ffn.experts.3.w2.weight"]
    with pytest.raises(WeightError) as exc:
        load_checkpoint(_write_bf16(tmp_path, bad))
    problems = _problems(exc)
    assert len(problems) == 2 and "2 problem(s)" in str(exc.value)
    assert any(p.startswith("missing mtp.0.enorm.weight: expected BF16[256]") for p in problems)
    assert any(
        p.startswith("missing mtp.0.ffn.experts.3.w2.weight: expected BF16[256, 128]") for p in problems
    )


def test_every_kind_of_problem_in_one_error(tmp_path, weights):
    bad = dict(weights)
    del bad["mtp.0.hnorm.weight"]
    bad["mtp.0.attn.wkv.weight"] = bad["mtp.0.attn.wkv.weight"][:, :-1]  # [128, 255]
    bad["mtp.0.hc_attn_fn"] = bad["mtp.0.hc_attn_fn"].bfloat16()  # must stay fp32
    bad["mtp.0.extra"] = torch.zeros(3)
    bad["layers.7.anything"] = torch.zeros(1)  # outside the requested scopes: ignored
    with pytest.raises(WeightError) as exc:
        load_checkpoint(_write_bf16(tmp_path, bad))
    problems = _problems(exc)
    assert len(problems) == 4, problems
    text = "\n".join(problems)
    assert "missing mtp.0.hnorm.weight" in text
    assert "misshapen mtp.0.attn.wkv.weight: expected BF16[128, 256], got BF16[128, 255]" in text
    assert "misshapen mtp.0.hc_attn_fn: expected F32[24, 1024], got BF16[24, 1024]" in text
    assert re.search(
        r"unexpected mtp\.0\.extra: expected no such tensor under 'mtp\.0\.', got F32\[3\]", text
    )
    assert "hint" in str(exc.value)
    # Non-strict loading ignores the extra tensor but still reports the rest.
    with pytest.raises(WeightError) as exc:
        load_checkpoint(tmp_path, strict=False)
    assert len(_problems(exc)) == 3


def test_quantised_weight_problems(tmp_path, checkpoints):
    tensors = load_file(str(checkpoints["mxfp4"] / "model.safetensors"))
    del tensors["mtp.0.attn.wq_a.scale"]
    tensors["mtp.0.ffn.experts.0.w1.scale"] = tensors["mtp.0.ffn.experts.0.w1.scale"][:, :2]
    tensors["mtp.0.e_proj.weight"] = tensors["mtp.0.e_proj.weight"][:, :200]
    tensors["mtp.0.enorm.scale"] = torch.ones(1)  # a bf16 tensor has no scale
    with pytest.raises(WeightError) as exc:
        load_checkpoint(_write_bf16(tmp_path, tensors))
    text = "\n".join(_problems(exc))
    assert len(_problems(exc)) == 4, text
    assert "missing mtp.0.attn.wq_a.scale: expected F8_E8M0[1, 2] (fp8 scales)" in text
    assert "misshapen mtp.0.ffn.experts.0.w1.scale: expected F8_E8M0[128, 8], got F8_E8M0[128, 2]" in text
    assert "misshapen mtp.0.e_proj.weight: expected F8_E4M3[256, 256]" in text
    assert "unexpected mtp.0.enorm.scale" in text


def test_no_config_json(tmp_path, checkpoints):
    save_file({"embed.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match="config.json"):
        load_checkpoint(tmp_path)


def test_no_safetensors_file(tmp_path):
    CONFIG.save(tmp_path / "config.json")
    with pytest.raises(WeightError, match="no safetensors file"):
        load_checkpoint(tmp_path)
    with pytest.raises(WeightError, match="nothing at"):
        load_checkpoint(tmp_path / "absent")


def test_a_path_the_system_cannot_look_up(tmp_path, weights):
    """A name past the file system's limit: pathlib's exists / is_dir raise OSError there; the
    loaders raise their WeightError with the system's reason instead (checkpoint_path.py)."""
    too_long = tmp_path / ("x" * 300)
    with pytest.raises(WeightError, match=r"checkpoint path: expected a folder .*\(File name too long\)"):
        load_checkpoint(too_long)
    with pytest.raises(WeightError, match=r"config: expected .*\(File name too long\)"):
        V4Config.load(too_long)
    write_checkpoint(tmp_path, CONFIG, weights, shards=2)  # an index naming a shard no system can look up
    index = tmp_path / INDEX_FILE
    listed = json.loads(index.read_text())
    listed["weight_map"] = {name: "y" * 300 + ".safetensors" for name in listed["weight_map"]}
    index.write_text(json.dumps(listed))
    with pytest.raises(WeightError, match=r"shard listed in .*\(File name too long\)"):
        load_checkpoint(tmp_path)


def test_a_file_that_is_not_safetensors_or_no_path_at_all(tmp_path, weights):
    """config.json (or any file not named .safetensors) given for the folder is refused as such, not
    parsed as a tensor file ("header length ..."); None or a number is an InputError, not pathlib's
    TypeError."""
    write_checkpoint(tmp_path, CONFIG, weights)
    with pytest.raises(WeightError, match=r"expected a folder or a \.safetensors file, got the file .*config\.json"
                                          r".*give the folder"):
        load_checkpoint(tmp_path / "config.json")
    assert load_checkpoint(tmp_path / "model.safetensors").config == CONFIG  # the file itself: config beside it
    for bad in (None, 42):
        with pytest.raises(InputError, match=f"checkpoint path: .*got {type(bad).__name__}"):
            load_checkpoint(bad)
        with pytest.raises(InputError, match=f"config: .*got {type(bad).__name__}"):
            V4Config.load(bad)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(device="tpu"), InputError, r"device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (dict(config="config.json"), InputError, r"config: expected a V4Config, or None .*got str"),
    (dict(names=5), WeightError, r"names: expected None, 'mtp', 'target', 'all' or a list of names, got 5"),
    (dict(names=[1, 2]), WeightError, r"names: expected .*got a list holding \['int'\]"),
])
def test_bad_arguments_are_typed_before_any_read(checkpoints, monkeypatch, kwargs, error, match):
    """Each was a torch RuntimeError, a TypeError or an AttributeError from inside the loader."""
    monkeypatch.setattr(weights_module, "_read_catalogue", lambda *a: pytest.fail("headers read first"))
    with pytest.raises(error, match=match):
        load_checkpoint(checkpoints["bf16"], **kwargs)


def test_index_naming_an_absent_shard(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightError, match=r"model-00002-of-00002.safetensors'\] missing"):
        load_checkpoint(tmp_path)


def test_config_mismatch_reports_shapes(checkpoints):
    wider = CONFIG.replace(hidden_size=512)
    with pytest.raises(WeightError) as exc:
        load_checkpoint(checkpoints["bf16"], wider)
    assert "misshapen embed.weight: expected BF16[1000, 512], got BF16[1000, 256]" in str(exc.value)


def test_unknown_requested_name(checkpoints):
    with pytest.raises(WeightError, match="unknown"):
        load_checkpoint(checkpoints["bf16"], names=["mtp.0.nope"])


def test_writer_refuses_a_used_folder_and_bad_arguments(tmp_path, weights):
    write_checkpoint(tmp_path / "a", CONFIG, {"embed.weight": weights["embed.weight"]})
    with pytest.raises(WeightError, match="no safetensors files yet"):
        write_checkpoint(tmp_path / "a", CONFIG, {"embed.weight": weights["embed.weight"]})
    with pytest.raises(WeightError, match="checkpoint format"):
        write_checkpoint(tmp_path / "b", CONFIG, weights, fmt="int4")
    with pytest.raises(WeightError, match="shards"):
        write_checkpoint(tmp_path / "c", CONFIG, {"embed.weight": weights["embed.weight"]}, shards=2)


# ---- random weights ----------------------------------------------------------------------------


def test_random_weights_are_deterministic_and_leave_global_rng_alone(weights):
    before = torch.get_rng_state()
    again = random_mtp_weights(CONFIG, seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[n], weights[n]) for n in weights)
    other = random_mtp_weights(CONFIG, seed=1)
    assert not torch.equal(other["mtp.0.e_proj.weight"], weights["mtp.0.e_proj.weight"])


def test_random_weight_scales(weights):
    D, C = CONFIG.hidden_size, CONFIG.hc_mult
    for entry in MTP_TENSOR_NAMES(CONFIG):
        t = weights[entry.name]
        assert t.dtype == entry.dtype and t.shape == entry.shape, entry.name
        if entry.name.endswith("norm.weight"):
            assert (t.float() - 1).abs().max() < 0.5, entry.name
        elif entry.kind in ("fp8", "mxfp4") or entry.name.endswith(("gate.weight", "head.weight")):
            std = t.float().std().item() * math.sqrt(entry.shape[1])
            assert 0.9 < std < 1.1, (entry.name, std)
    # mHC: (x @ fn^T) * rho for a random residual must be O(1), so the sigmoids are not saturated.
    x = torch.randn(64, C * D, generator=torch.Generator().manual_seed(3)) * 7.0
    rho = 1 / x.pow(2).mean(-1, keepdim=True).sqrt()
    mix = (x @ weights["mtp.0.hc_attn_fn"].T) * rho
    assert 0.5 < mix.std().item() < 2.0
    assert ((weights["mtp.0.hc_attn_scale"] >= 0.5) & (weights["mtp.0.hc_attn_scale"] <= 1.5)).all()


def test_tid2eid_rows_are_distinct_valid_experts():
    full = random_mtp_weights(CONFIG, seed=2, include_target_layers=True)
    table = full["layers.0.ffn.gate.tid2eid"]
    assert table.dtype == torch.int32 and table.shape == (CONFIG.vocab_size, CONFIG.num_experts_per_tok)
    assert int(table.min()) >= 0 and int(table.max()) < CONFIG.n_routed_experts
    assert (table[:, 0] != table[:, 1]).all()
    assert len(torch.unique(table[:, 0])) > CONFIG.n_routed_experts // 2  # spread over the experts
    assert set(full) == {e.name for e in MTP_TENSOR_NAMES(CONFIG)} | {
        e.name for e in TARGET_TENSOR_NAMES(CONFIG)
    }
