"""Static input buffers of a chain run, filled by one host-to-device copy.

Everything host-built that a run reads (tokens, decode metadata, vocab limit,
grammar masks) is packed into one uint8 host buffer (pinned on CUDA) and copied
to one device buffer; the graph inputs are views of it. Hiddens, which already
live on the device, go into their own static buffer: copied device-to-device, or,
in a graph that starts with :meth:`ChainStaging.in_graph_copy`, gathered there by
the graph itself from their addresses, which the host buffer carries
(:mod:`draftgraph.ops.triton.rows`). The buffers never move, so a captured graph can read
them on every replay.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch
from draftgraph.runtime.cache.metadata import MetadataView, MetadataWriter, check_rows, row_bytes_for
from draftgraph.runtime.execution import raw_copy
from draftgraph.runtime.ir.tensor_spec import TensorSpec

ALIGN = 256
Hiddens = Sequence[torch.Tensor] | torch.Tensor  # one [C, D] / [D] per row, or one [n, ...] block
Masks = Sequence[Sequence[int] | torch.Tensor | None] | None  # one grammar mask (int32 words) or None per row
_LIMIT = struct.Struct("<i")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _triton_rows():
    """``ops.triton.rows`` (the one-kernel staging: the buffer's copy and the hidden gather), or None without triton."""
    try:
        from draftgraph.ops.triton import rows
    except Exception:  # ImportError, or a broken triton install (as draftgraph.ops.triton.available)
        return None
    return rows


class ChainStaging:
    """Static device buffers for one batch bucket. Names match the chain's graph inputs.

    Staging is incremental (design note "incremental staging" in :mod:`draftgraph.runtime.cache.metadata`):
    the host buffer keeps what the last ``stage`` wrote and a call rewrites only what moved,
    with ``struct`` / numpy writes on the host memory instead of torch ops, each of which
    costs microseconds of dispatch. Only ``stage`` writes the host buffer.
    """

    def __init__(
        self,
        bucket: int,
        hidden: TensorSpec,
        max_blocks_per_seq: int,
        mask_words: int,
        device: torch.device,
        window: int | None = None,
        gather_hiddens: bool | None = None,
    ) -> None:
        self.bucket, self.device, self.max_blocks = bucket, device, max_blocks_per_seq
        self.window = window  # block-table entries older than the window are never staged
        row = row_bytes_for(max_blocks_per_seq)
        self._meta_at, self._token_at = 0, _align(bucket * row)
        self._limit_at = self._token_at + _align(bucket * 8)
        self._address_at = self._limit_at + ALIGN  # int64 [B]: each row's hidden, where the graph gathers it
        self._mask_at = self._address_at + _align(bucket * 8)
        total = self._mask_at + _align(bucket * mask_words * 4)
        pin = device.type == "cuda"
        self.host_buf = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self.device_buf = torch.zeros(total, dtype=torch.uint8, device=device)
        self._device_index = self.device_buf.device.index if pin else None  # None: torch copies (CPU)
        self.hidden_buf = torch.zeros(hidden.concrete(bucket), dtype=hidden.dtype, device=device)
        self.mask_words = mask_words
        self._row = row
        self.host = self._views(self.host_buf)
        self.views = self._views(self.device_buf)
        self.writer = MetadataWriter(self.host["meta"].buf, max_blocks_per_seq, window)
        self._mem = memoryview(self.host_buf.numpy())
        self._mask_words_np = self.host["grammar_mask"].numpy()  # [B, W] int32, the host buffer's memory
        self._hidden_rows = [self.hidden_buf[:i] for i in range(bucket + 1)]  # views made once, not per call
        self._hidden_shape = self.hidden_buf.shape[1:]
        # A batched hidden tensor whose rows have these strides has each row contiguous: its rows'
        # addresses are base + i * stride(0), with no copy.
        self._row_strides, self._row_bytes = self.hidden_buf[0].stride(), self.hidden_buf[0].nbytes
        # Everything before the masks: the one copy when the masks did not change since the last one.
        self._host_head, self._device_head = self.host_buf[: self._mask_at], self.device_buf[: self._mask_at]
        self._num_tokens = self._num_hiddens = 0  # rows holding a token / a hidden (the rest are zeros)
        self._num_masked = bucket  # rows holding a mask (not all -1): all of them while the buffer is zeros
        self._is_mask_copied = False
        # The host buffer is pinned and copied asynchronously: a stage must not rewrite it before the
        # last copy has read it. A propose's read-back synchronizes (no wait then, and no event: on
        # some hosts every CUDA call costs ~10 us); a catch-up stages chunks with no read-back between.
        self._is_copy_pending = False
        self._hidden_row0 = self.hidden_buf[0]
        # Hiddens by address (a graph with in_graph_copy gathers them): None on the CPU, without
        # cuda-python or without triton, or where the device cannot read the pinned buffer at its
        # host address; then a run with copy_in=False copies them as any other.
        wants_gather = self._device_index is not None if gather_hiddens is None else gather_hiddens
        rows = _triton_rows() if wants_gather else None
        readable = self._device_index is None or raw_copy.is_device_addressable(self.host_buf)
        self._stage = rows.stage_from_host if rows is not None and readable else None
        self._num_addresses = 0  # rows holding an address (the rest are 0: padding, gathered as zeros)
        # (base, step, n) of the hiddens tensor whose row addresses the buffer holds, None when a
        # list's: a stage of the same rows rewrites nothing (design note "incremental staging").
        self._span_written: tuple[int, int, int] | None = None
        self._kept: list[torch.Tensor] = []  # contiguous copies of strided hiddens, alive until the next stage
        self._chain_inputs: dict[int | None, Mapping[str, torch.Tensor]] = {}
        self._read_bufs: dict[tuple, torch.Tensor] = {}  # pinned host copies of outputs, per (shape, dtype)
        # Start with every row dead (slot -1, no keys): a warm-up or capture run on these
        # buffers writes no cache row.
        self.stage([], [], [], vocab_limit=1)

    def __del__(self) -> None:
        # The raw staging copy records no event in torch's pinned-memory cache: the host buffer
        # must not go back to that cache (to be handed out and rewritten) while a copy may still
        # be reading it.
        if getattr(self, "_is_copy_pending", False):
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # interpreter shutdown: the context is going away with the buffer
                pass

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        b = self.bucket
        meta = MetadataView.of(buf[self._meta_at : self._meta_at + b * self._row].view(b, self._row), self.max_blocks)
        return {
            "meta": meta,
            "token": buf[self._token_at : self._token_at + 8 * b].view(torch.int64),
            "vocab_limit": buf[self._limit_at : self._limit_at + 4].view(torch.int32),
            "hidden_address": buf[self._address_at : self._address_at + 8 * b].view(torch.int64),
            "grammar_mask": buf[self._mask_at : self._mask_at + 4 * b * self.mask_words]
            .view(torch.int32)
            .view(b, self.mask_words),
        }

    def stage(
        self,
        rows: Sequence,
        tokens: Sequence[int],
        hiddens: Hiddens,
        vocab_limit: int,
        masks: Masks = None,
        copy_in: bool = True,
    ) -> Mapping[str, torch.Tensor]:
        """Write one batch (rows past ``len(tokens)`` are padding) and return the graph inputs.

        ``hiddens`` is one hidden per row, or one [n, ...] tensor of them (staged as a block:
        one copy, or addresses by arithmetic, with no work per row).
        ``copy_in=False``: the host buffer is left for the replay to copy (a graph captured
        with :meth:`in_graph_copy` as its first node). The returned mapping is shared
        between calls and read-only. A propose stages its rows itself and the rest with
        :meth:`stage_after_rows`.
        """
        checked = check_rows(rows, self.max_blocks)  # every row checked before anything is written
        self.wait_for_copy()
        self.writer.write(checked)
        return self.stage_after_rows(tokens, hiddens, vocab_limit, masks, copy_in)

    def wait_for_copy(self) -> None:
        """Wait for the last staging copy (or replay) to have read the host buffer: call before writing it."""
        if self._is_copy_pending:
            torch.cuda.synchronize(self.device)
            self._is_copy_pending = False

    def stage_after_rows(self, tokens: Sequence[int], hiddens: Hiddens, vocab_limit: int, masks: Masks = None,
                         copy_in: bool = True, tokens_written: bool = False) -> Mapping[str, torch.Tensor]:
        """``stage`` of a batch whose metadata rows ``writer`` holds already (after ``wait_for_copy``).

        The tokens must be checked ints. A propose stages its rows in the loop that checks them
        (:mod:`draftgraph.runtime.proposer.front`) and the rest here. ``tokens_written``: the compiled front
        wrote them already, through :meth:`token_sink` (0 past the batch).
        """
        if tokens_written:
            self._num_tokens = len(tokens)
        else:
            self._write_tokens(tokens)
        _LIMIT.pack_into(self._mem, self._limit_at, int(vocab_limit))
        self._write_masks(masks)
        if not copy_in and self._stage is not None:
            self._write_addresses(hiddens)
        if copy_in:
            self._copy_to_device()
        else:  # the replay reads the host buffer: it must not be rewritten before a sync
            self._is_copy_pending = True
        if copy_in or self._stage is None:
            self._stage_hiddens(hiddens)
        return self.chain_inputs(self.mask_words)

    def chain_inputs(self, mask_words: int | None) -> Mapping[str, torch.Tensor]:
        """The graph inputs (device views), the grammar mask cut to ``mask_words`` (None: no mask).

        Made once per width and shared: a run can hand it to the executor as it is.
        """
        inputs = self._chain_inputs.get(mask_words)
        if inputs is None:
            names = {name: view for name, view in self.graph_inputs().items() if name != "grammar_mask"}
            if mask_words is not None:
                names["grammar_mask"] = self.views["grammar_mask"][:, :mask_words]
            inputs = self._chain_inputs[mask_words] = MappingProxyType(names)
        return inputs

    def read_rows(self, tensor: torch.Tensor, n: int) -> torch.Tensor:
        """The first ``n`` rows of a device output, on the host (read once, after the run).

        On CUDA into a pinned buffer kept per shape (no allocation per propose), then one stream
        synchronize; on the CPU the rows themselves.
        """
        if not tensor.is_cuda:  # not tensor.device.type: that builds a string per call
            return tensor[:n]
        host = self._read_bufs.get((tensor.shape, tensor.dtype))
        if host is None:
            host = self._read_bufs[(tensor.shape, tensor.dtype)] = torch.empty(
                tensor.shape, dtype=tensor.dtype, pin_memory=True)
        rows = host[:n]
        rows.copy_(tensor[:n], non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        self._is_copy_pending = False  # the staging copy, queued before the run, is done too
        return rows

    def token_sink(self) -> tuple[memoryview, int]:
        """(host buffer bytes, byte offset of the int64 tokens) for the one other writer of tokens.

        A propose's compiled front (:mod:`draftgraph.runtime.proposer.front`) writes the batch's tokens in the
        call that stages its rows, and zeros past it, as :meth:`_write_tokens` does.
        """
        return self._mem, self._token_at

    def _write_tokens(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        if n:
            struct.pack_into(f"<{n}q", self._mem, self._token_at, *tokens)
        if n < self._num_tokens:  # rows that held a token last time are padding now: token 0
            stale = 8 * (self._num_tokens - n)
            self._mem[self._token_at + 8 * n : self._token_at + 8 * n + stale] = bytes(stale)
        self._num_tokens = n

    def _write_masks(self, masks) -> None:
        words = self._mask_words_np
        if self._num_masked:  # padded and unmasked rows allow everything (a padded row's output is dropped)
            words[: self._num_masked] = -1
            self._is_mask_copied = False
        self._num_masked = 0
        if masks is None:
            return
        converted: dict[int, np.ndarray] = {}
        for i, mask in enumerate(masks):
            if mask is None:  # may be shorter than a row: the drafted vocab rows only
                continue
            row = converted.get(id(mask))
            if row is None:
                row = converted[id(mask)] = torch.as_tensor(mask, dtype=torch.int32).cpu().numpy()
            words[i, : row.size] = row
            self._num_masked = i + 1
        self._is_mask_copied = False

    def in_graph_copy(self, masked: bool) -> Callable[[], None] | None:
        """The staging copy as a function to capture at the head of a chain graph, or None.

        Captured, it reads this pinned host buffer at every replay. With triton it is one
        kernel that copies the buffer and gathers the hiddens from the addresses it holds
        (``draftgraph.ops.triton.rows.stage_from_host``); without, a memcpy node. A propose then makes no
        CUDA call before its launch. It copies what the chain reads: everything with the
        grammar masks (``masked``), else everything before them. None where the copy cannot be
        captured this way (CPU, no cuda-python).
        """
        if self._device_index is None or not raw_copy.is_enabled:
            return None
        dst, src = (self.device_buf, self.host_buf) if masked else (self._device_head, self._host_head)
        index, address_at, hiddens, stage = self._device_index, self._address_at, self.hidden_buf, self._stage

        def copy() -> None:
            if stage is not None:
                stage(src, dst, address_at, hiddens)
            else:
                raw_copy.copy_async(dst, src, index)

        return copy

    def _write_addresses(self, hiddens: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """Each hidden's device address into the host buffer (0 for padding): the graph gathers them.

        A strided hidden is made contiguous first and kept alive until the next stage, which
        comes after the replay has read it (a stage waits for the last copy to finish).
        """
        self._kept.clear()
        if isinstance(hiddens, torch.Tensor):
            span = self._block_span(hiddens)
            if span == self._span_written:  # the rows the last stage wrote (a serving loop's own buffer)
                return
            base, step, n = span
            addresses = range(base, base + n * step, step) if step else [base] * n
        else:
            span, addresses = None, []
            for hidden in hiddens:
                if not hidden.is_contiguous():
                    hidden = hidden.contiguous()
                    self._kept.append(hidden)
                addresses.append(hidden.data_ptr())
        n = len(addresses)
        if n:
            struct.pack_into(f"<{n}q", self._mem, self._address_at, *addresses)
        if n < self._num_addresses:
            stale = 8 * (self._num_addresses - n)
            self._mem[self._address_at + 8 * n : self._address_at + 8 * n + stale] = bytes(stale)
        self._num_addresses = n
        self._num_hiddens = n  # the gather writes every row: the rest become zeros
        self._span_written = span

    def _block_span(self, block: torch.Tensor) -> tuple[int, int, int]:
        """(base, row step in bytes, n) of an [n, ...] hiddens tensor: its rows are base + i * step.

        Rows apart but each contiguous (a slice with a step) are read where they are; a block
        whose rows are strided inside is made contiguous once and kept as a strided hidden is.
        A step of 0 is an expanded row: every address the same.
        """
        if block.stride()[1:] == self._row_strides:
            step = block.stride(0) * block.element_size()
        else:
            block = block.contiguous()
            self._kept.append(block)
            step = self._row_bytes
        return block.data_ptr(), step, block.shape[0]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._device_index is None:
            dst.copy_(src)
        else:
            raw_copy.copy_async(dst, src, self._device_index)

    def _copy_to_device(self) -> None:
        if self._is_mask_copied:  # the device already holds these masks: copy the head only
            self._copy(self._device_head, self._host_head)
        else:
            self._copy(self.device_buf, self.host_buf)  # the one staging copy
            self._is_mask_copied = True
        self._is_copy_pending = self._device_index is not None  # on CUDA

    def _stage_hiddens(self, hiddens: Sequence[torch.Tensor] | torch.Tensor) -> None:
        is_block = isinstance(hiddens, torch.Tensor)
        n, shape = hiddens.shape[0] if is_block else len(hiddens), self._hidden_shape
        if is_block:  # [n, ...]: one copy for the batch, whatever its strides
            if n:
                self._copy(self._hidden_rows[n], hiddens)
        elif n == 1:
            hidden = hiddens[0]
            self._copy(self._hidden_row0, hidden if hidden.shape == shape else hidden.reshape(shape))
        elif n:
            try:  # one op for the batch (one launch on CUDA), not one copy per row
                torch.stack(hiddens, out=self._hidden_rows[n])
            except RuntimeError:  # other shapes (with the same numel), dtypes or devices: row by row
                for i, hidden in enumerate(hiddens):
                    self.hidden_buf[i].copy_(hidden.reshape(shape), non_blocking=True)
        if n < self._num_hiddens:  # rows that held a hidden last time are padding now: zeros
            self.hidden_buf[n : self._num_hiddens].zero_()
        self._num_hiddens = n

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
