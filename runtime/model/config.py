"""V4Config: the DeepSeek-V4 model config, read from a Hugging Face ``config.json``.

Field names are the Hugging Face ones (spec section 1), so a real DeepSeek-V4-Flash
``config.json`` loads as is. ``small()`` is the structure-preserving test config.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from draftgraph.runtime.errors import WeightError


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
    def from_dict(data: dict) -> V4Config:
        known = {f.name for f in fields(V4Config)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "compress_ratios" in kwargs:
            kwargs["compress_ratios"] = tuple(kwargs["compress_ratios"])
        try:
            config = V4Config(**kwargs)
        except TypeError as exc:  # pragma: no cover - dataclass rejects odd values
            raise WeightError(f"config.json: {exc}") from exc
        config.check()
        return config

    @staticmethod
    def load(path: str | Path) -> V4Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise WeightError(
                f"config: expected a Hugging Face config.json, got no file at {path} "
                "(hint: point --checkpoint at the folder that holds config.json)"
            )
        return V4Config.from_dict(json.loads(path.read_text()))

    def check(self) -> None:
        """Raise WeightError when the sizes do not fit together."""
        problems = []
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
            raise WeightError("config.json: " + "; ".join(problems))
