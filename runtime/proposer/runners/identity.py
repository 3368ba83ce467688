"""The ``identity`` runner: the body passes the streams through (an ablation).

It writes no cache row, so the draft depends only on the token and hidden.
"""

from __future__ import annotations

import torch


class IdentityRunner:
    name = "identity"

    def bind(self, config, weights, device) -> None:
        pass

    def workspace_bytes(self, batch: int) -> int:
        return 0

    def __call__(self, streams, positions, kv_cache, kv_start, block_table, workspace) -> torch.Tensor:
        return streams
