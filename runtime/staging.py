"""Static input buffers of a chain run, filled by one host-to-device copy.

Everything host-built that a run reads (tokens, decode metadata, vocab limit,
grammar masks) is packed into one uint8 host buffer (pinned on CUDA) and copied
to one device buffer; the graph inputs are views of it. Hiddens, which already
live on the device, are copied device-to-device into their own static buffer.
The buffers never move, so a captured graph can read them on every replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.kv_metadata import MetadataView, pack_metadata, row_bytes_for
from runtime.tensor_spec import TensorSpec

ALIGN = 256


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ChainStaging:
    """Static device buffers for one batch bucket. Names match the chain's graph inputs."""

    def __init__(
        self,
        bucket: int,
        hidden: TensorSpec,
        max_blocks_per_seq: int,
        mask_words: int,
        device: torch.device,
        window: int | None = None,
    ) -> None:
        self.bucket, self.device, self.max_blocks = bucket, device, max_blocks_per_seq
        self.window = window  # block-table entries older than the window are never staged
        row = row_bytes_for(max_blocks_per_seq)
        self._meta_at, self._token_at = 0, _align(bucket * row)
        self._limit_at = self._token_at + _align(bucket * 8)
        self._mask_at = self._limit_at + ALIGN
        total = self._mask_at + _align(bucket * mask_words * 4)
        pin = device.type == "cuda"
        self.host_buf = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self.device_buf = torch.zeros(total, dtype=torch.uint8, device=device)
        self.hidden_buf = torch.zeros(hidden.concrete(bucket), dtype=hidden.dtype, device=device)
        self.mask_words = mask_words
        self._row = row
        self.host = self._views(self.host_buf)
        self.views = self._views(self.device_buf)
        # Start with every row dead (slot -1, no keys): a warm-up or capture run on these
        # buffers writes no cache row.
        self.stage([], [], [], vocab_limit=1)

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        b = self.bucket
        meta = MetadataView.of(buf[self._meta_at : self._meta_at + b * self._row].view(b, self._row), self.max_blocks)
        return {
            "meta": meta,
            "token": buf[self._token_at : self._token_at + 8 * b].view(torch.int64),
            "vocab_limit": buf[self._limit_at : self._limit_at + 4].view(torch.int32),
            "grammar_mask": buf[self._mask_at : self._mask_at + 4 * b * self.mask_words]
            .view(torch.int32)
            .view(b, self.mask_words),
        }

    def stage(
        self,
        rows: Sequence,
        tokens: Sequence[int],
        hiddens: Sequence[torch.Tensor],
        vocab_limit: int,
        masks: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Write one batch (rows past ``len(tokens)`` are padding) and return the graph inputs."""
        b, n = self.bucket, len(tokens)
        host = self.host
        pack_metadata(list(rows) + [None] * (b - n), self.max_blocks, out=host["meta"].buf, window=self.window)
        host["token"].zero_()
        host["token"][:n] = torch.tensor(list(tokens), dtype=torch.int64)
        host["vocab_limit"].fill_(int(vocab_limit))
        host["grammar_mask"].fill_(-1)  # padded rows allow everything (their output is dropped)
        if masks is not None:
            for i, mask in enumerate(masks):
                if mask is not None:  # may be shorter than a row: the drafted vocab rows only
                    words = torch.as_tensor(mask, dtype=torch.int32)
                    host["grammar_mask"][i, : words.numel()] = words
        self.device_buf.copy_(self.host_buf, non_blocking=True)  # the one staging copy
        for i, hidden in enumerate(hiddens):
            self.hidden_buf[i].copy_(hidden.reshape(self.hidden_buf.shape[1:]), non_blocking=True)
        if n < b:
            self.hidden_buf[n:].zero_()
        return self.graph_inputs()

    def graph_inputs(self) -> dict[str, torch.Tensor]:
        meta = self.views["meta"]
        return {
            "token": self.views["token"],
            "hidden": self.hidden_buf,
            "positions": meta.pos,
            "kv_start": meta.kv_start,
            "block_table": meta.block_table,
            "vocab_limit": self.views["vocab_limit"],
            "grammar_mask": self.views["grammar_mask"],
        }
