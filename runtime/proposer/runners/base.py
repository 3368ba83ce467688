"""DraftRunner: the body of the draft step, swappable (the seed's circuit-draft binding).

A runner takes the body's interface and returns the new streams::

    runner(streams [B, C, D] bf16, positions i64[B], kv_cache bf16[S, d] (mutable),
           kv_start i32[B], block_table i32[B, MB], workspace u8[N] | None) -> [B, C, D] bf16

It must not sync with the host (it is captured into the CUDA graph with the
rest of the chain) and may use only its declared workspace beyond temporaries.
:class:`RunnerNode` adapts a runner to the executor's op-call convention and
checks what it returns: a wrong shape, dtype or device is a RunnerError naming it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from draftgraph.runtime.errors import RunnerError, describe
from draftgraph.runtime.model.config import V4Config


@runtime_checkable
class DraftRunner(Protocol):
    name: str

    def bind(self, config: V4Config, weights: Mapping[str, torch.Tensor], device: torch.device) -> None:
        """Take the weights (named as in the checkpoint) once, before any call."""

    def workspace_bytes(self, batch: int) -> int:
        """Scratch the runner needs per call at ``batch`` (0 if none)."""

    def __call__(self, streams, positions, kv_cache, kv_start, block_table, workspace) -> torch.Tensor:
        """Return the body's output streams [B, C, D]."""


class RunnerNode:
    """Executor adapter: calls the runner and writes its result into the node's output view."""

    def __init__(self, runner: DraftRunner) -> None:
        self.runner = runner

    def run_node(self, inputs, outputs, attrs, workspace) -> None:
        streams, positions, kv_start, block_table, kv_cache = inputs
        (out,) = outputs
        result = self.runner(streams, positions, kv_cache, kv_start, block_table, workspace)
        name = getattr(self.runner, "name", type(self.runner).__name__)
        if not isinstance(result, torch.Tensor):
            raise RunnerError(describe(f"runner {name!r} result", "a torch.Tensor", type(result).__name__))
        if tuple(result.shape) != tuple(out.shape):
            raise RunnerError(describe(f"runner {name!r} output shape", list(out.shape), list(result.shape),
                                       "a body returns streams [B, C, D]"))
        if result.dtype != out.dtype:
            raise RunnerError(describe(f"runner {name!r} output dtype", out.dtype, result.dtype))
        if result.device != out.device:
            raise RunnerError(describe(f"runner {name!r} output device", out.device, result.device))
        if result.data_ptr() != out.data_ptr():
            out.copy_(result)


def load_runner(spec: str | DraftRunner | None) -> DraftRunner | None:
    """``None``/"builtin" -> None (the op subgraph); a name of a shipped runner; or ``pkg.mod:callable``."""
    if spec is None or (isinstance(spec, str) and spec == "builtin"):
        return None
    if not isinstance(spec, str):
        if not callable(spec):
            raise RunnerError(describe("runner", "a DraftRunner, a name or 'module:callable'", type(spec).__name__))
        _check_takes_the_body(spec, repr(getattr(spec, "name", type(spec).__name__)))
        return spec if hasattr(spec, "workspace_bytes") else FunctionRunner(spec, type(spec).__name__)
    from draftgraph.runtime.proposer.runners import SHIPPED

    if spec in SHIPPED:
        return SHIPPED[spec]()
    if ":" not in spec:
        raise RunnerError(describe("runner", f"one of {['builtin', *SHIPPED]} or 'package.module:callable'",
                                   repr(spec)))
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RunnerError(f"runner {spec!r}: cannot import {module_name!r}: {exc}") from exc
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise RunnerError(f"runner {spec!r}: {module_name!r} has no attribute {attr!r}")
    # A class is instantiated; any other callable is the runner itself.
    runner = factory() if isinstance(factory, type) else factory
    if not callable(runner):
        raise RunnerError(describe(f"runner {spec!r}", "a callable", type(runner).__name__))
    _check_takes_the_body(runner, repr(spec))
    return runner if hasattr(runner, "workspace_bytes") else FunctionRunner(runner, spec)


BODY_ARGS = ("streams", "positions", "kv_cache", "kv_start", "block_table", "workspace")


def _check_takes_the_body(runner, what: str) -> None:
    """A callable that cannot take the body's six arguments is refused here, not in the first propose
    (an ExecutionError deep in a run). Callables without a signature (some builtins) pass."""
    try:
        signature = inspect.signature(runner)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*BODY_ARGS)
    except TypeError:
        raise RunnerError(describe(f"runner {what}", f"a callable of the body's arguments ({', '.join(BODY_ARGS)})",
                                   f"{getattr(runner, '__name__', type(runner).__name__)}{signature}",
                                   "see DraftRunner in runtime/proposer/runners/base.py")) from None


class FunctionRunner:
    """A plain function used as a runner: no weights to bind, no workspace."""

    def __init__(self, fn, name: str) -> None:
        self.fn, self.name = fn, getattr(fn, "name", name)

    def bind(self, config, weights, device) -> None:
        pass

    def workspace_bytes(self, batch: int) -> int:
        return 0

    def __call__(self, streams, positions, kv_cache, kv_start, block_table, workspace):
        return self.fn(streams, positions, kv_cache, kv_start, block_table, workspace)


def runner_name(runner: DraftRunner | None) -> str:
    return "builtin" if runner is None else str(getattr(runner, "name", type(runner).__name__))
