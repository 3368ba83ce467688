"""Read-only constant tensors (aranges, fills) made once per device and reused by every run.

Why: an op that builds ``torch.arange(E)`` or ``new_full(...)`` on every call puts one more
kernel on the chain for a value that never changes. Captured, each is a node of its own
(1-2 us on an H200, plus the gap before the next kernel), and most of them sit on the
critical path: the MoE's expert ids before the group ends, the vocab ids before the
argmax. Made once, outside any capture, they are plain reads.

A constant is made eagerly and kept: the first call for a key must not be inside a CUDA
graph capture (the kernel that fills it would run only when that graph replays). Such a
call, and any call under torch.compile (which traces the op instead), builds the tensor in
place as before and keeps nothing. Executors run every op once eagerly (warm-up) before they
capture, so the constants exist by then. Callers must never write to a constant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _kept(key: tuple, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return make()
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = make()
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _CONSTANTS[key] = tensor
    return tensor


def arange(start: int, end: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.arange(start, end)``, made once per (range, dtype, device); read-only."""
    device = torch.device(device)
    return _kept(("arange", start, end, dtype, device), device,
                 lambda: torch.arange(start, end, dtype=dtype, device=device))


def full(n: int, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full((n,), value)``, made once per (n, value, dtype, device); read-only."""
    device = torch.device(device)
    return _kept(("full", n, value, dtype, device), device,
                 lambda: torch.full((n,), value, dtype=dtype, device=device))


def logspace(end: float, steps: int, base: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.logspace(0, end, steps, base)``, made once per (end, steps, base, dtype, device); read-only."""
    device = torch.device(device)
    return _kept(("logspace", end, steps, base, dtype, device), device,
                 lambda: torch.logspace(0.0, end, steps, base=base, dtype=dtype, device=device))


def values(data: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data)`` for a nested tuple of numbers, made once per (data, dtype, device); read-only."""
    device = torch.device(device)
    return _kept(("values", data, dtype, device), device, lambda: torch.tensor(data, dtype=dtype, device=device))


__all__ = ["arange", "full", "logspace", "values"]
