"""The devices the runtime runs on: the CPU, and a CUDA GPU this process can see.

Every ``device=`` of the public API (the proposer, the target model, the eager executor, the
checkpoint loader) and the tools' ``--device`` go through :func:`check_device`, so a device the
runtime cannot use is one InputError (expected, got, a hint) before any weight is read, not a
torch RuntimeError or AssertionError from deep inside the first allocation. A unit of its own
below the model (tests/test_layering.py): the loader takes it too.
"""

from __future__ import annotations

import torch
from draftgraph.runtime.errors import InputError, describe

RUNS_ON = "cpu, cuda or cuda:N"


def check_device(device: object, what: str = "device") -> torch.device:
    """``device`` as a torch.device: cpu, or cuda[:N] where that GPU is visible."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise InputError(describe(what, RUNS_ON, repr(device), "the runtime runs on the CPU and on CUDA GPUs"))
    if parsed.type == "cpu":  # one CPU device: cpu:0 is cpu (tensors report plain cpu), cpu:1 is nothing
        if parsed.index not in (None, 0):
            raise InputError(describe(what, RUNS_ON, repr(device), "the CPU is one device: cpu (or cpu:0)"))
        return torch.device("cpu")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError(describe(what, "cpu or a visible CUDA GPU", repr(device),
                                      "no CUDA GPU is visible here: use the cpu"))
        if parsed.index is not None and parsed.index >= count:
            visible = "cuda or cuda:0" if count == 1 else f"cuda, or cuda:0 .. cuda:{count - 1}"
            raise InputError(describe(what, visible, repr(device), f"{count} CUDA GPU(s) visible here"))
    return parsed


def concrete_device(device: object, what: str = "device") -> torch.device:
    """A checked device with ``cuda`` made ``cuda:N`` (the current device), so device checks
    compare like with like."""
    device = check_device(device, what)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
