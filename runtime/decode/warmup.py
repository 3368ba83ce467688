"""The decode loop's warm-up: which buckets a decode can use, building them all, and counting builds.

Design note "warm-up apart" (issue 27): every executor of the loop is made on first use, per
bucket: the target's per row bucket, the K-draft chain's per batch bucket, the drafter-prefill
graph's per row bucket of a catch-up. On CUDA each first use is a capture (two warm-up runs
and the capture) and, for every kernel whose launch arguments fall in a new specialisation
(Triton specialises int arguments equal to 1 and divisible by 16; the batch block and the
batch-1 FMA variant of the gemv are picked per batch), a kernel compile. Done lazily these land
inside the timed loop, and not only at its start: a catch-up bucket first seen when every draft
of every sequence is accepted, or the batch-1 chain when all sequences but one have ended, are
built in the middle of the decode. :func:`plan_warmup` names every bucket a decode can use, from
the prompts, K and the bucket sets alone, and :func:`warm_up` builds them all before the first
step; :func:`build_counts` counts what was built, so a test can require none after it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields

from draftgraph.runtime.execution.eager import EagerExecutor


@dataclass(frozen=True)
class BuildCounts:
    """What this process has built so far; subtract two snapshots for what happened in between.

    executors : EagerExecutor builds (a captured executor builds one too): graph passes, plan, bind.
    captures : CUDA graph captures (CapturedExecutor.capture).
    kernel_compiles : Triton kernel compiles (the JIT's post-compile hook; 0 without triton).
    torch_compiles : torch.compile graph compiles (dynamo's unique graphs).
    """

    executors: int = 0
    captures: int = 0
    kernel_compiles: int = 0
    torch_compiles: int = 0

    def __sub__(self, other: BuildCounts) -> BuildCounts:
        return BuildCounts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


_kernel_compiles = [0]
_hook_lock = threading.Lock()
_hook_installed = [False]


_hook_where = [""]  # where the compile hook sits ("" while none: then no compile is counted)


def _install_compile_hook() -> None:
    """Count Triton compiles: ``triton.knobs.runtime.jit_post_compile_hook`` (triton >= 3.4), else
    ``JITFunction.compiled_hook`` (older); either way after any hook already set, which still runs.
    The JIT calls it for each kernel it makes in this process (a new specialisation), from source
    or from its disk cache."""
    with _hook_lock:
        if _hook_installed[0]:
            return
        _hook_installed[0] = True
        try:
            import triton
        except Exception:  # no triton (or a broken one): nothing compiles through it here
            return
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "jit_post_compile_hook"):
            owner, name = knobs.runtime, "jit_post_compile_hook"
        else:
            from triton.runtime.jit import JITFunction

            owner, name = JITFunction, "compiled_hook"
        previous = getattr(owner, name, None)

        def hook(*args, **kwargs):
            _kernel_compiles[0] += 1
            return previous(*args, **kwargs) if previous is not None else None

        setattr(owner, name, hook)
        _hook_where[0] = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"


def compile_counting() -> str:
    """Where Triton compiles are counted ('' when they are not: no triton)."""
    _install_compile_hook()
    return _hook_where[0]


def build_counts() -> BuildCounts:
    """A snapshot of the counters (installs the Triton compile hook on first call)."""
    _install_compile_hook()
    from draftgraph.runtime.execution.captured import CapturedExecutor

    try:
        from torch._dynamo.utils import counters

        torch_compiles = int(counters["stats"]["unique_graphs"])
    except Exception:
        torch_compiles = 0
    return BuildCounts(EagerExecutor.num_built, CapturedExecutor.num_captures, _kernel_compiles[0], torch_compiles)


@dataclass(frozen=True)
class WarmupPlan:
    """The buckets a decode can use, per executor family."""

    target: tuple[int, ...]  # the target's own graph (prefill, host-path verify, greedy)
    verify: tuple[int, ...]  # the device verify graphs (device loop only)
    chain: tuple[int, ...]  # the K-draft chain's batch buckets
    prefill: tuple[int, ...]  # the drafter-prefill graph's row buckets (prompt and per-step catch-up)
    first_step: tuple[int, ...] = ()  # the device loop's merged first steps (propose rows + catch-up rows)

    def describe(self) -> str:
        return (f"target {list(self.target)}, verify {list(self.verify)}, chain {list(self.chain)}, "
                f"drafter prefill {list(self.prefill)}, first step {list(self.first_step)}")


def _bucket(buckets: Sequence[int], rows: int) -> int:
    return next(b for b in buckets if b >= rows)


def _chunk_buckets(buckets: Sequence[int], rows: int) -> set[int]:
    """The buckets of a run of ``rows`` rows split into runs of at most the largest bucket."""
    largest, used = buckets[-1], set()
    if rows >= largest:
        used.add(largest)
    if rows % largest:
        used.add(_bucket(buckets, rows % largest))
    return used


def plan_warmup(target, proposer, prompt_lengths: Sequence[int], num_drafts: int, device_loop: bool) -> WarmupPlan:
    """Every bucket a speculative decode of these prompts can use (any EOS, cancel or acceptance).

    Sequences end in any order, so every live count 1..N occurs; catch-up rows of n live
    sequences are n .. n (K + 1); the drafter prefill covers any subset of the prompts. The
    device loop's merged first step runs n propose rows and up to the largest bucket's worth of
    catch-up rows (proposer/device_propose.py).
    """
    n, width = len(prompt_lengths), num_drafts + 1
    tb, pb = target.buckets, proposer.buckets
    target_buckets = _chunk_buckets(tb, sum(prompt_lengths))
    verify = set()
    for live in range(1, n + 1):
        if device_loop:
            verify.add(_bucket(tb, live * width))
        else:
            target_buckets |= _chunk_buckets(tb, live * width)
    step = proposer.propose_batch_max()
    chain = {_bucket(pb, size) for live in range(1, n + 1) for size in {min(live, step), live % step} if size}
    catchup_rows = max(sum(max(p - 1, 0) for p in prompt_lengths), n * width)
    top = _bucket(pb, min(catchup_rows, pb[-1]))
    prefill = {b for b in pb if b <= top}
    first_step = set()
    if device_loop:
        first_step = {_bucket(pb, min(rows, pb[-1])) for live in range(1, min(n, step) + 1)
                      for rows in range(live + 1, live * (width + 1) + 1)}
    return WarmupPlan(*(tuple(sorted(s)) for s in (target_buckets, verify, chain, prefill, first_step)))


def plan_greedy_warmup(target, prompt_lengths: Sequence[int]) -> tuple[int, ...]:
    """The target buckets a plain greedy decode of these prompts can use (prefill, then 1 row a sequence)."""
    used = _chunk_buckets(target.buckets, sum(prompt_lengths))
    for live in range(1, len(prompt_lengths) + 1):
        used |= _chunk_buckets(target.buckets, live)
    return tuple(sorted(used))


def warm_up(target, proposer, plan: WarmupPlan, num_drafts: int) -> None:
    """Build (and on CUDA capture and compile) every executor of ``plan``; see the module docstring."""
    target.warm_up(plan.target)
    if plan.verify:
        target.device_verifier(num_drafts).warm_up(plan.verify)
    proposer.warm_up(num_drafts, plan.chain, plan.prefill, plan.first_step)
