"""CallLock: the proposer's one lock, held with autograd off.

A proposer writes what it is given into buffers it keeps (the staging block, the drafter cache).
Under autograd, a hidden that requires grad (straight from a model's forward, outside
``torch.no_grad``) makes the copy into such a buffer record a backward node: the buffer then
requires grad itself, and every later call, whatever its input, fails in the first op that writes
into an ``out=`` tensor. So every call holds the lock with grad off: ~0.6 us a call on the CPU
machine where the caller already runs under ``torch.no_grad`` / ``inference_mode`` (as engines do),
~0.9 us where it does not (the two mode changes).

Re-entrant (a public call may make another): each entry remembers whether it turned grad off,
and its exit restores just that. Grad mode is per thread, and the lock holds one thread at a time.
"""

from __future__ import annotations

import threading

import torch

# torch.set_grad_enabled(mode) is a context-manager class: calling it builds an object that reads
# the mode again before it sets it (~0.5 us a call here). The lock sets the mode itself and keeps
# what to restore, so it calls the setter under it (the same one since torch 1.x; 2.11-2.13 here).
_set_grad_enabled = torch._C._set_grad_enabled


class CallLock:
    __slots__ = ("_lock", "_restore")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._restore: list[bool] = []  # one entry per nested acquisition: turn grad back on at exit

    def __enter__(self) -> CallLock:
        self._lock.acquire()
        on = torch.is_grad_enabled()
        if on:
            _set_grad_enabled(False)
        self._restore.append(on)
        return self

    def __exit__(self, *exc) -> None:
        if self._restore.pop():
            _set_grad_enabled(True)
        self._lock.release()
