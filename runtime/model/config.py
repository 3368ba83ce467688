"""V4Config: the DeepSeek-V4 model config, read from a Hugging Face ``config.json``.

Field names are the Hugging Face ones (spec section 1), so a real DeepSeek-V4-Flash
``config.json`` loads as is. ``small()`` is the structure-preserving test config.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from draftgraph.runtime.errors import WeightError, describe
from draftgraph.runtime.model.checkpoint_path import as_path, path_kind

# The fields a config.json must state. They set the shapes of the checkpoint's tensors and differ
# between any two V4 sizes, so V4-Flash's value as a default would only turn a missing field into
# dozens of misshapen-tensor errors (or, with a matching checkpoint, a silently different model).
# Every other field is an architecture constant of V4 (mHC streams, norms' eps, RoPE, routing) or a
# runtime bound, and defaults to V4-Flash's value.
# A Hugging Face config.json is a few KB (DeepSeek-V4-Flash's ~3 KB); more is not a config.
MAX_CONFIG_BYTES = 16 << 20

REQUIRED_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "vocab_size",
    "n_routed_experts",
    "moe_intermediate_size",
)
# Sizes and counts that must be >= 1 (the others, e.g. qk_rope_head_dim, only >= 0).
POSITIVE_FIELDS = (
    "hidden_size",
    "num_nextn_predict_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "hc_mult",
    "vocab_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class V4Config:
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    vocab_size: int = 129280
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    max_position_embeddings: int = 65536
    quantization_config: dict | None = field(default=None, compare=False)

    # ---- derived sizes -------------------------------------------------
    @property
    def kv_lora_rank(self) -> int:
        """The non-rotary part of the latent (448 for V4-Flash)."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """Row width of the MTP's latent cache: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def hc_mix_dim(self) -> int:
        """Rows of an mHC ``fn``: (2 + C) * C = 24 for C = 4."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def mtp_layer_index(self) -> int:
        return self.num_hidden_layers

    # ---- presets -------------------------------------------------------
    @staticmethod
    def flash() -> V4Config:
        """DeepSeek-V4-Flash, as in its published config.json."""
        return V4Config(compress_ratios=tuple([4] * 43 + [0]))

    @staticmethod
    def small(**overrides) -> V4Config:
        """Same structure, tiny sizes: tests and the embedded default."""
        base = V4Config(
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            head_dim=128,
            qk_rope_head_dim=32,
            q_lora_rank=64,
            o_groups=2,
            o_lora_rank=64,
            sliding_window=16,
            compress_ratios=(0, 0, 0),
            vocab_size=1000,
            n_routed_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            num_hash_layers=1,
            max_position_embeddings=4096,
        )
        return replace(base, **overrides)

    def replace(self, **overrides) -> V4Config:
        return replace(self, **overrides)

    # ---- (de)serialisation ---------------------------------------------
    def to_dict(self) -> dict:
        data = asdict(self)
        data["compress_ratios"] = list(self.compress_ratios)
        if data["quantization_config"] is None:
            del data["quantization_config"]
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def from_dict(data: dict, source: str = "config.json") -> V4Config:
        """The config a parsed ``config.json`` describes; unknown keys are ignored.

        The fields of ``REQUIRED_FIELDS`` (the sizes that set the tensor shapes) must be there;
        the others default to DeepSeek-V4-Flash's values. Every field present must have its type
        (an int for sizes, a finite number for eps and factors, ...), and the sizes must fit
        together (:meth:`check`).

        Raises
        ------
        WeightError : naming ``source``, every missing or mistyped field, and what was expected.

        Example
        -------
        >>> V4Config.from_dict(V4Config.small().to_dict()) == V4Config.small()
        True
        """
        if not isinstance(data, dict):
            raise WeightError(describe(source, "a JSON object of config fields", type(data).__name__))
        problems = []
        missing = [name for name in REQUIRED_FIELDS if name not in data]
        if missing:
            problems.append(f"missing {', '.join(missing)} (no default: they set the tensor shapes)")
        kwargs = {}
        for f in fields(V4Config):
            if f.name in data:
                expected = _type_problem(f, data[f.name])
                if expected:
                    problems.append(f"{f.name}: expected {expected}, got {data[f.name]!r}")
                kwargs[f.name] = data[f.name]
        if problems:
            raise WeightError(
                describe(
                    source,
                    "the fields of a DeepSeek-V4 config.json",
                    "; ".join(problems),
                    "compare with the config.json of the checkpoint that was written with it",
                )
            )
        if "compress_ratios" in kwargs:
            kwargs["compress_ratios"] = tuple(kwargs["compress_ratios"])
        config = V4Config(**kwargs)
        config.check(source)
        return config

    @staticmethod
    def load(path: str | Path) -> V4Config:
        """Read a Hugging Face ``config.json`` (or the one in folder ``path``); see :meth:`from_dict`."""
        expected = "a Hugging Face config.json or the folder that holds it"
        path = as_path(path, "config", expected)
        kind = path_kind(path, "config", expected)
        if kind == "dir":
            path = path / "config.json"
            kind = path_kind(path, "config", expected)
        if kind is None:
            raise WeightError(
                f"config: expected a Hugging Face config.json, got no file at {path} "
                "(hint: point --checkpoint at the folder that holds config.json)"
            )
        try:
            with path.open("rb") as file:  # bounded: a config.json that is a device or a pipe is not read to the end
                raw = file.read(MAX_CONFIG_BYTES + 1)
            if len(raw) > MAX_CONFIG_BYTES:
                raise ValueError(f"more than {MAX_CONFIG_BYTES} bytes (a device or an endless stream?)")
            data = json.loads(raw)
        except (OSError, ValueError) as exc:  # unreadable, too long, not UTF-8, not JSON
            raise WeightError(
                describe(f"config {path}", "a JSON object", repr(exc), "write it with V4Config.save")
            ) from exc
        return V4Config.from_dict(data, source=str(path))

    def check(self, source: str = "config.json") -> None:
        """Raise WeightError when the sizes do not fit together."""
        problems = [f"{name} {getattr(self, name)} must be >= 1" for name in POSITIVE_FIELDS if getattr(self, name) < 1]
        problems += [
            f"{f.name} {getattr(self, f.name)} must be >= 0"
            for f in fields(self)
            if f.name not in POSITIVE_FIELDS and type(f.default) in (int, float) and getattr(self, f.name) < 0
        ]
        if self.head_dim <= self.qk_rope_head_dim:
            problems.append(f"head_dim {self.head_dim} must exceed qk_rope_head_dim")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.num_attention_heads % self.o_groups:
            problems.append(
                f"num_attention_heads {self.num_attention_heads} not divisible by "
                f"o_groups {self.o_groups}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append("num_experts_per_tok exceeds n_routed_experts")
        if self.scoring_func != "sqrtsoftplus":
            problems.append(f"scoring_func: expected 'sqrtsoftplus', got {self.scoring_func!r}")
        if problems:
            raise WeightError(describe(source, "sizes that fit together", "; ".join(problems)))


def _type_problem(f, value) -> str | None:
    """What a field's value should have been, or None when it is fine."""
    if f.name == "quantization_config":
        return None if value is None or isinstance(value, dict) else "a JSON object or null"
    if f.name == "compress_ratios":
        ok = isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value)
        return None if ok else "a list of ints >= 0"
    kind = type(f.default) if f.default is not MISSING else None
    if kind is bool:
        return None if isinstance(value, bool) else "true or false"
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an int"
    if kind is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if number and math.isfinite(value) else "a finite number"
    if kind is str:
        return None if isinstance(value, str) else "a string"
    return None
