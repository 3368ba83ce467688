"""TensorSpec: the static type of a value, with the symbolic batch dim ``B``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from draftgraph.runtime.errors import GraphError

B = "B"  # the symbolic batch dimension; resolved to a bucket size at bind time

# Short names, as in jaxprs: the printer, JSON and errors all use these.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float8_e4m3fn: "f8e4m3",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}

Dim = int | str


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES_BY_NAME:
        raise GraphError(f"dtype: expected one of {sorted(DTYPES_BY_NAME)}, got {name!r}")
    return DTYPES_BY_NAME[name]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a value. A dim is an int or the symbol ``B``."""

    shape: tuple[Dim, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        for dim in self.shape:
            if not (isinstance(dim, int) and dim >= 0) and dim != B:
                raise GraphError(f"TensorSpec dim: expected int >= 0 or {B!r}, got {dim!r}")

    @property
    def has_batch(self) -> bool:
        return B in self.shape

    def concrete(self, batch: int) -> tuple[int, ...]:
        return tuple(batch if d == B else d for d in self.shape)

    def numel(self, batch: int) -> int:
        return math.prod(self.concrete(batch))

    def nbytes(self, batch: int) -> int:
        return self.numel(batch) * self.dtype.itemsize

    def with_shape(self, *shape: Dim) -> TensorSpec:
        return TensorSpec(tuple(shape), self.dtype)

    def with_dtype(self, dtype: torch.dtype) -> TensorSpec:
        return TensorSpec(self.shape, dtype)

    def short(self) -> str:
        """``bf16[B,4,256]``: the printer's form."""
        return f"{dtype_name(self.dtype)}[{','.join(str(d) for d in self.shape)}]"

    def __str__(self) -> str:
        return self.short()

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype)}

    @staticmethod
    def from_json(data: dict) -> TensorSpec:
        return TensorSpec(tuple(data["shape"]), parse_dtype(data["dtype"]))

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(tensor.shape), tensor.dtype)
