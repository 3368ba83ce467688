"""Side-stream overlap: part of an op runs on a side CUDA stream (a lane), beside other work.

Why: hc_pre's Sinkhorn is 45 launches of tiny kernels with the torch ops up to B=8 and 81
above (about 110 us at B=1 on an H200), and its result, comb, is read only by hc_post, after
the whole attention or MoE. Queued on a side lane, it runs while those run; captured, it
becomes a parallel branch of the CUDA graph. Likewise the MoE's shared expert runs beside the
router and the routed experts (its routing weights beside the sort and the gate GEMM), the
attention's latent kv, cache write and window gather beside its slot math and query path, and
the argmax's confidence beside its token. The fused kernels do these inside their own kernels
and never fork.

The contract, for an op's implementation:

- ``with side_stream():`` runs its block on one of the executor's side lanes, after
  everything queued on the main stream so far; all blocks of one step share a lane, in
  order. ``side_stream(urgent=True)`` asks for the high-priority lane (the longer branch
  of a fork). Without lanes (CPU, no executor, a debug run, a gated step, or inside
  torch.compile) the block runs inline, in order.
- ``join_side_stream()`` makes the main stream wait for every block the step queued so
  far. A block joined this way inside the op may read the op's inputs and read or write
  tensors the op allocated before the block (their bytes are the main stream's, which reads
  them after the join). The op keeps such a tensor referenced until that join: freed
  earlier, its bytes go at once to the main stream's next allocation, which may overwrite
  them while the lane still reads (the attention's slots once did, in a helper that
  returned before the join). Its own temporaries the block allocates inside it (on the lane: the
  caching allocator hands those bytes back to that lane alone). The main stream may read
  such a temporary after the join: the lane reuses its bytes only in a later block, which
  is queued after everything the main stream queued before that block.
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
import os
import warnings
from collections.abc import Iterator

import torch

_ACTIVE: contextvars.ContextVar[SideStream | None] = contextvars.ContextVar("side_stream", default=None)


class SideWork:
    """What one step left queued on one lane: the main stream joins it by waiting on ``event``."""

    __slots__ = ("event", "lane")

    def __init__(self, lane: int, event: torch.cuda.Event) -> None:
        self.lane, self.event = lane, event


class SideStream:
    """One executor's side lanes (extra CUDA streams), and the lane the running step forked onto.

    Why lanes: a deferred block (hc_pre's Sinkhorn) stays queued until a later step joins it;
    a step that forks meanwhile (the MoE's shared expert, the attention's kv path) would queue
    behind it on a single side stream and its join would wait for both. A step takes a lane
    with no unjoined work (the least recently forked busy one when every lane is busy), and
    keeps it for all its blocks, so blocks of one step stay in order.

    Why an urgent lane: lane 0 has the device's highest stream priority (``DRAFTGRAPH_LANE_PRIORITY=0``
    turns it off). A Sinkhorn is 45-81 one-block kernels in a row; beside the MoE its next kernel
    waits, at normal priority, behind every pending tile of a grouped GEMM (an H200 trace: 300
    us against 110 alone), and the chain waits for it at hc_post. With priority the block
    scheduler places its one block first. Captured, kernel nodes keep their stream's priority,
    which the raw launch's exec honours (``draftgraph.runtime.execution.launch.node_priority_exec``).
    """

    def __init__(self, device: torch.device, lanes: int = 2) -> None:
        if lanes < 1:
            raise ValueError(f"SideStream lanes: expected >= 1, got {lanes}")
        self.device = device
        urgent = torch.cuda.Stream.priority_range()[1] if lane_priority_enabled() else 0  # lower is higher
        self.streams = [torch.cuda.Stream(device=device, priority=urgent if lane == 0 else 0) for lane in range(lanes)]
        self.forked = False  # whether the running step queued work not joined yet
        self.lane: int | None = None  # the lane of the running step, once it forked
        self._unjoined: list[SideWork] = []  # deferred work the main stream has not waited for, oldest first

    @property
    def stream(self) -> torch.cuda.Stream:
        """The lane of the running step (lane 0 before it forks)."""
        return self.streams[self.lane or 0]

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Offer the lanes to ``side_stream()`` blocks while one step runs."""
        token = _ACTIVE.set(self)
        self.lane = None
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            self.lane = None

    @contextlib.contextmanager
    def fork(self, urgent: bool = False) -> Iterator[None]:
        """Queue the block on the step's lane, after everything on the main stream so far."""
        if self.lane is None:
            self.lane = pick_lane(len(self.streams), [work.lane for work in self._unjoined], urgent)
        stream = self.streams[self.lane]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.forked = True  # before the block: a block that fails part way has queued work to join too
        with torch.cuda.stream(stream):
            yield

    def join_event(self) -> SideWork:
        """The step's work forked so far; the main stream waits on it (``wait``) to join."""
        event = torch.cuda.Event()
        event.record(self.stream)
        self.forked = False
        work = SideWork(self.lane or 0, event)
        self._unjoined.append(work)
        return work

    def wait(self, work: SideWork) -> None:
        """The main stream waits for ``work``; its lane is free again for the next step that forks."""
        torch.cuda.current_stream(self.device).wait_event(work.event)
        if work in self._unjoined:
            self._unjoined.remove(work)


def pick_lane(lanes: int, busy: list[int], urgent: bool = False) -> int:
    """A lane with no unjoined work; when all have some, the one forked longest ago.

    ``busy`` lists the lanes of the unjoined work, oldest first. An urgent block takes lane 0
    (the high-priority one) when it is free; other blocks take the other lanes first, keeping
    lane 0 free for the next urgent one.
    """
    free = [lane for lane in range(lanes) if lane not in busy]
    if not free:
        return busy[0]
    if urgent or len(free) == 1:
        return free[0]
    return free[1] if free[0] == 0 else free[0]


def lane_priority_enabled() -> bool:
    """Whether lane 0 gets the device's highest stream priority (``DRAFTGRAPH_LANE_PRIORITY=0``: no)."""
    return os.environ.get("DRAFTGRAPH_LANE_PRIORITY", "1") != "0"


def side_stream(urgent: bool = False) -> contextlib.AbstractContextManager:
    """Run the block on one of the executor's side lanes when it offers them, else inline (see the module doc).

    ``urgent``: the block is the longer branch of its fork (a Sinkhorn beside the attention or
    the MoE): it goes on the high-priority lane when that is free.
    """
    if torch.compiler.is_compiling():  # first: a traced function sees a plain nullcontext
        return contextlib.nullcontext()
    side = _ACTIVE.get()
    return contextlib.nullcontext() if side is None else side.fork(urgent)


def join_side_stream() -> None:
    """The main stream waits for every block the running step queued so far (no-op without any)."""
    side = None if torch.compiler.is_compiling() else _ACTIVE.get()
    if side is not None and side.forked:
        side.wait(side.join_event())


# SMs a big GEMM leaves free while lanes run (``sms_left_for_lanes``).
LANE_SMS = 2


@contextlib.contextmanager
def sms_left_for_lanes() -> Iterator[None]:
    """GEMMs launched inside leave LANE_SMS SMs free, when the executor offers lanes; else nothing.

    Why: a lane's Sinkhorn is 40 one-block kernels in a row, the critical path beside the
    attention and the MoE. A persistent grouped GEMM keeps a block on every SM for its whole
    run (40-50 us for an expert weight at V4-Flash B=1), and each of its launches held the
    next Sinkhorn kernel back that long: ~100 us of stalls beside the MoE in an H200 timeline.
    torch's grouped GEMM and cuBLAS read the SM carveout when they launch (a capture keeps
    it); with 2 or 4 SMs left, the B=1 chain replayed in 809-814 us against 818-827 without
    (benchmarks/h200/ab_carveout_1ef6330.txt in git at 873b0e1). The carveout is global torch state: set for
    the block only, and put back.
    """
    if torch.compiler.is_compiling() or _ACTIVE.get() is None:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    with warnings.catch_warnings():  # torch warns once that the carveout is experimental
        warnings.simplefilter("ignore")
        torch._C._set_sm_carveout_experimental(LANE_SMS)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


__all__ = ["LANE_SMS", "SideStream", "SideWork", "join_side_stream", "lane_priority_enabled", "pick_lane",
           "side_stream", "sms_left_for_lanes"]
