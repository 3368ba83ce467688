"""Side-stream overlap: part of an op runs on a second CUDA stream, beside other work.

Why: hc_pre's Sinkhorn is 79 launches of tiny kernels with the torch ops (about 115 us at
B=1 on an H200), and its result, comb, is read only by hc_post, after the whole attention
or MoE. Queued on a side stream, it runs while those run; captured, it becomes a parallel
branch of the CUDA graph. Likewise the MoE's shared expert runs beside the router and the
routed experts. The fused kernels do these inside their own kernels and never fork.

The contract, for an op's implementation:

- ``with side_stream():`` runs its block on the executor's side stream, after everything
  queued on the main stream so far. Without one (CPU, no executor, a debug run, a gated
  step, or inside torch.compile) the block runs inline, in order.
- ``join_side_stream()`` makes the main stream wait for every block queued so far. A block
  joined this way inside the op may read the op's inputs and write tensors the op
  allocated before the block (their bytes are the main stream's, which reads them after
  the join); its own temporaries it allocates inside the block (on the side stream: the
  caching allocator hands those bytes back to that stream alone).
- A block still running when the op returns writes only the outputs the op lists in
  ``OpDef.deferred`` and reads only those, its own temporaries and weights: an input's
  planned bytes may be reused by the very next step. The executor makes the main stream
  wait for it before the first step that reads a deferred output (or shares its bytes),
  and at once after the step when the op lists none. Every block is joined before a run
  (or a gated region) ends.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_ACTIVE: contextvars.ContextVar[SideStream | None] = contextvars.ContextVar("side_stream", default=None)


class SideStream:
    """One executor's second stream, and whether the step now running forked onto it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.forked = False

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Offer this stream to ``side_stream()`` blocks while one step runs."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Queue the block on the side stream, after everything on the main stream so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.forked = True  # before the block: a block that fails part way has queued work to join too
        with torch.cuda.stream(self.stream):
            yield

    def join_event(self) -> torch.cuda.Event:
        """An event after everything forked so far; the main stream waits on it to join."""
        event = torch.cuda.Event()
        event.record(self.stream)
        self.forked = False
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


def side_stream() -> contextlib.AbstractContextManager:
    """Run the block on the executor's side stream when it offers one, else inline (see the module doc)."""
    if torch.compiler.is_compiling():  # first: a traced function sees a plain nullcontext
        return contextlib.nullcontext()
    side = _ACTIVE.get()
    return contextlib.nullcontext() if side is None else side.fork()


def join_side_stream() -> None:
    """The main stream waits for every block the running step queued so far (no-op without any)."""
    side = None if torch.compiler.is_compiling() else _ACTIVE.get()
    if side is not None and side.forked:
        side.wait(side.join_event())


__all__ = ["SideStream", "join_side_stream", "side_stream"]
