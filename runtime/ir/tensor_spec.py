"""TensorSpec: the static type of a value, with the symbolic batch dim ``B``.

A weight kept in the checkpoint's block-scaled format carries it in its spec: ``quant``
(``"fp8"``: e4m3 data with 128x128 UE8M0 scales; ``"mxfp4"``: e2m1 pairs a byte with 1x32
UE8M0 scales) and the ``scale`` companion's spec, so the printer shows
``f8e4m3[32768,1024] scale ue8m0[256,8]`` and ``nbytes`` counts both.
"""

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
    torch.float4_e2m1fn_x2: "f4e2m1x2",  # two e2m1 values a byte: MXFP4 data
    torch.float8_e8m0fnu: "ue8m0",  # power-of-two block scales
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}

Dim = int | str
QUANTS: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}  # quant -> data dtype


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES_BY_NAME:
        raise GraphError(f"dtype: expected one of {sorted(DTYPES_BY_NAME)}, got {name!r}")
    return DTYPES_BY_NAME[name]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a value. A dim is an int or the symbol ``B``.

    A block-scaled weight also has ``quant`` ("fp8" | "mxfp4") and ``scale`` (its UE8M0
    scales' spec); ``shape`` and ``dtype`` are then the stored data's (MXFP4: half the
    columns, two values a byte) and ``logical_shape`` the weight's.
    """

    shape: tuple[Dim, ...]
    dtype: torch.dtype
    quant: str | None = None
    scale: TensorSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        for dim in self.shape:
            if not (isinstance(dim, int) and dim >= 0) and dim != B:
                raise GraphError(f"TensorSpec dim: expected int >= 0 or {B!r}, got {dim!r}")
        if self.dtype not in DTYPE_NAMES:  # a string or an unnamed dtype: the printer and JSON could not show it
            raise GraphError(f"TensorSpec dtype: expected a torch.dtype of {sorted(DTYPE_NAMES.values())}, "
                             f"got {self.dtype!r} (hint: torch.float32, not 'float32')")
        if self.quant is None and self.scale is None:
            return
        if self.quant not in QUANTS or self.dtype != QUANTS[self.quant] or self.scale is None:
            raise GraphError(f"TensorSpec quant: expected one of {sorted(QUANTS)} with its data dtype and a scale, "
                             f"got quant={self.quant!r} {dtype_name(self.dtype)} scale={self.scale}")
        if self.scale.dtype != torch.float8_e8m0fnu or self.scale.quant is not None:
            raise GraphError(f"TensorSpec scale: expected ue8m0[...], got {self.scale}")

    @property
    def is_quantised(self) -> bool:
        return self.quant is not None

    @property
    def logical_shape(self) -> tuple[Dim, ...]:
        """The shape of the weight the data stands for (MXFP4 packs two values a byte)."""
        if self.quant == "mxfp4":
            return (*self.shape[:-1], self.shape[-1] * 2)
        return self.shape

    @property
    def has_batch(self) -> bool:
        return B in self.shape

    def concrete(self, batch: int) -> tuple[int, ...]:
        return tuple(batch if d == B else d for d in self.shape)

    def numel(self, batch: int) -> int:
        return math.prod(self.concrete(batch))

    def nbytes(self, batch: int) -> int:
        """Bytes of the value; a block-scaled weight's include its scales."""
        scale = self.scale.nbytes(batch) if self.scale is not None else 0
        return self.numel(batch) * self.dtype.itemsize + scale

    def with_shape(self, *shape: Dim) -> TensorSpec:
        return TensorSpec(tuple(shape), self.dtype)

    def with_dtype(self, dtype: torch.dtype) -> TensorSpec:
        return TensorSpec(self.shape, dtype)

    def short(self) -> str:
        """``bf16[B,4,256]``: the printer's form."""
        text = f"{dtype_name(self.dtype)}[{','.join(str(d) for d in self.shape)}]"
        return text if self.scale is None else f"{text} scale {self.scale.short()}"

    def __str__(self) -> str:
        return self.short()

    def to_json(self) -> dict:
        data = {"shape": list(self.shape), "dtype": dtype_name(self.dtype)}
        if self.scale is not None:
            data.update(quant=self.quant, scale=self.scale.to_json())
        return data

    @staticmethod
    def from_json(data: dict) -> TensorSpec:
        scale = TensorSpec.from_json(data["scale"]) if data.get("scale") else None
        return TensorSpec(tuple(data["shape"]), parse_dtype(data["dtype"]), data.get("quant"), scale)

    @staticmethod
    def of(tensor) -> TensorSpec:
        """The spec of a tensor, or of a block-scaled weight (anything with ``data``, ``scale``, ``fmt``:
        runtime.model.quant.QuantWeight, duck-typed since the IR sits below the model)."""
        scale = getattr(tensor, "scale", None)
        if isinstance(scale, torch.Tensor) and hasattr(tensor, "fmt"):
            return TensorSpec(tuple(tensor.shape), tensor.dtype, tensor.fmt, TensorSpec.of(scale))
        return TensorSpec(tuple(tensor.shape), tensor.dtype)
