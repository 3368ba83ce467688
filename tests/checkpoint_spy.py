"""safe_open as the loader sees it, reporting every tensor (and slice) it hands out.

The tests that check what a load reads (which tensors; how many bytes per rank) patch
``draftgraph.runtime.model.weights.safe_open`` with a :class:`SpyOpen`, independent of the
loader's own bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SpyOpen:
    """Wraps ``safe_open``: ``on_read(name, tensor)`` for every ``get_tensor`` and ``get_slice(...)[...]``."""

    def __init__(self, real, on_read: Callable[[str, torch.Tensor], None]):
        self.real, self.on_read = real, on_read

    def __call__(self, *args, **kwargs):
        on_read, handle = self.on_read, self.real(*args, **kwargs)

        class Handle:
            def __enter__(self):
                self.inner = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_tensor(self, name):
                t = self.inner.get_tensor(name)
                on_read(name, t)
                return t

            def get_slice(self, name):
                inner = self.inner.get_slice(name)

                class Slice:
                    def __getitem__(self, index):
                        t = inner[index]
                        on_read(name, t)
                        return t

                return Slice()

        return Handle()
