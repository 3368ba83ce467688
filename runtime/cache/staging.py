"""Static input buffers of a chain run, filled by array writes and one host-to-device copy.

Everything host-built that a run reads (tokens, decode metadata, vocab limit, grammar masks,
the hiddens' addresses) is packed into one uint8 host buffer (pinned on CUDA) and copied to one
device buffer; the graph inputs are views of it. Hiddens, which already live on the device, go
into their own static buffer: copied device-to-device, or, in a graph that starts with
:meth:`ChainStaging.in_graph_copy`, gathered there by the graph itself from the addresses the
host buffer carries (``ops/triton/rows.py``). The buffers never move, so a captured graph can
read them on every replay. On the CPU the host buffer is the device buffer: no copy at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch
from draftgraph.runtime.cache.hidden_rows import HiddenRows
from draftgraph.runtime.cache.metadata import MetadataView, row_bytes_for, window_columns
from draftgraph.runtime.execution import raw_copy
from draftgraph.runtime.ir.tensor_spec import TensorSpec

ALIGN = 256
# One [C, D] / [D] per row, one [n, ...] block, or rows of a buffer by index (cache/hidden_rows.py)
Hiddens = Sequence[torch.Tensor] | torch.Tensor | HiddenRows
# Whether a captured chain writes its drafts to the host itself (in_graph_read; a switch for benchmarks).
PUBLISH_READS = True
Masks = Sequence[torch.Tensor | np.ndarray | Sequence[int] | None] | None  # int32 words per row, or None


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _triton_rows():
    """``ops/triton/rows.py`` (the staging copy and the hidden gather in one kernel), or None without triton."""
    try:
        from draftgraph.ops.triton import rows
    except Exception:  # ImportError, or a broken triton install (as draftgraph.ops.triton.available)
        return None
    return rows


class ChainStaging:
    """Static device buffers for one batch bucket. Names match the chain's graph inputs.

    Parameters
    ----------
    bucket : rows of the buffers (the batch bucket).
    hidden : the spec of the graph's ``hidden`` input ([B, C, D] or [B, D]).
    max_blocks_per_seq, window, block_size : the cache's geometry.
    span : positions a row writes after its own (K - 1 for a chain of K drafts at most).
    mask_words : int32 words of a full-vocabulary grammar mask.
    kernel : what writes the metadata rows and tokens (``native/batch_kernel.py``'s ``write``, or
        its compiled twin); the numpy twin by default.
    """

    def __init__(self, bucket: int, hidden: TensorSpec, max_blocks_per_seq: int, mask_words: int,
                 device: torch.device, window: int, span: int = 0, block_size: int = 16,
                 gather_hiddens: bool | None = None, kernel=None) -> None:
        self.bucket, self.device, self.max_blocks, self.mask_words = bucket, device, max_blocks_per_seq, mask_words
        row = row_bytes_for(max_blocks_per_seq)
        self._meta_at, self._token_at = 0, _align(bucket * row)
        self._limit_at = self._token_at + _align(bucket * 8)
        self._address_at = self._limit_at + ALIGN  # int64 [B]: each row's hidden, where the graph gathers it
        self._mask_at = self._address_at + _align(bucket * 8)
        total = self._mask_at + _align(bucket * mask_words * 4)
        on_cuda = device.type == "cuda"
        wants_gather = on_cuda if gather_hiddens is None else gather_hiddens
        self.host_buf = torch.zeros(total, dtype=torch.uint8, pin_memory=on_cuda)
        # On the CPU the host buffer is the device buffer, but where a test runs the gather kernel
        # (Triton's interpreter) on the CPU as the captured prologue runs it: then a second one.
        separate = on_cuda or wants_gather
        self.device_buf = torch.zeros(total, dtype=torch.uint8, device=device) if separate else self.host_buf
        self._device_index = self.device_buf.device.index if on_cuda else None
        self.hidden_buf = torch.zeros(hidden.concrete(bucket), dtype=hidden.dtype, device=device)
        host = self.host_buf.numpy()
        if kernel is None:
            from draftgraph.runtime.native import batch_kernel as kernel  # the numpy twin
        self._write = kernel.write
        # Design note "window columns" (cache/metadata.py): the table entries a row's steps read.
        self.window, self.block_size, self.row_bytes = window, block_size, row
        self.columns = window_columns(window, span, block_size, max_blocks_per_seq)
        self.meta = host[: bucket * row]  # uint8 [B * row_bytes]: the metadata rows
        self.tokens = host[self._token_at : self._token_at + 8 * bucket].view(np.int64)
        self.vocab_limit = host[self._limit_at : self._limit_at + 4].view(np.int32)
        self.addresses = host[self._address_at : self._address_at + 8 * bucket].view(np.int64)
        self.masks = host[self._mask_at : self._mask_at + 4 * bucket * mask_words].view(np.int32).reshape(
            bucket, mask_words)
        self.masks[:] = -1  # rows without a mask allow every token
        self.views = self._views(self.device_buf)
        self._hidden_shape = self.hidden_buf.shape[1:]
        # The first n rows of hidden_buf, made once per n: a slice per copy costs as much as the copy
        # of a row on the CPU.
        self._hidden_rows = [self.hidden_buf[:n] for n in range(bucket + 1)]
        self._row_bytes = self.hidden_buf[0].nbytes  # a contiguous row's step
        self._row_strides = self.hidden_buf[0].stride()
        self._num_hiddens = self._num_addresses = self._num_masked = 0
        self._arange = np.arange(bucket, dtype=np.int64)
        no_table = np.full((1, max_blocks_per_seq), -1, dtype=np.int32)
        empty = np.empty(0, dtype=np.int64)
        # Every row dead to start with: a warm-up or capture run on these buffers writes no cache row.
        self.num_live = self._write(self.meta, row, max_blocks_per_seq, self.columns, window, block_size, no_table,
                                    empty, empty, empty, self.tokens, empty, bucket)
        # Everything before the masks: the one copy when the batch has no mask.
        self._host_head, self._device_head = self.host_buf[: self._mask_at], self.device_buf[: self._mask_at]
        # The pinned host buffer is copied asynchronously: it must not be rewritten before the last
        # copy (or replay, which copies it itself) has read it. A propose's read-back synchronizes.
        # The wait is on an event recorded right after that copy, not on the device: a stage
        # that follows another graph's launch (a decode loop's continuation, staged right after
        # its first step's launch) queues its work behind that graph instead of waiting it out.
        # An in-graph copy records it from inside the graph (an event node: ``external``; a
        # plain event recorded in a capture is a fork/join edge, not a node the host can wait on).
        self._is_copy_pending = False
        self._copied = torch.cuda.Event(external=True) if on_cuda else None
        kernels = _triton_rows() if wants_gather else None
        readable = not on_cuda or raw_copy.is_device_addressable(self.host_buf)
        self._gather = kernels.stage_from_host if kernels is not None and readable else None
        self._publish = kernels.copy_to_host if kernels is not None and readable else None
        # (device output, its pinned host copy) for each output a captured graph writes to the host
        # itself (in_graph_read): read_rows waits for the replay and reads them in place. The output
        # is held weakly: its executor owns it, and a graph captured again (capture-dump's recapture)
        # must not keep the graph before it, and its memory pool, alive.
        self._published: list[tuple[weakref.ref, torch.Tensor]] = []
        self._publish_bufs: dict[tuple, torch.Tensor] = {}  # pinned, per (shape, dtype); made by a warm-up run
        self._kept: list[torch.Tensor] = []  # contiguous copies of strided hiddens, alive until the next stage
        self._chain_inputs: dict[int | None, Mapping[str, torch.Tensor]] = {}
        self._read_bufs: dict[tuple, torch.Tensor] = {}  # pinned host copies of outputs, per (shape, dtype)

    def __del__(self) -> None:
        # The raw staging copy records no event in torch's pinned-memory cache: the host buffer
        # must not go back to that cache while a copy may still be reading it.
        if getattr(self, "_is_copy_pending", False):
            try:
                self._copied.synchronize()
            except Exception:  # interpreter shutdown: the context is going away with the buffer
                pass

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        b, row = self.bucket, row_bytes_for(self.max_blocks)
        return {
            "meta": MetadataView.of(buf[: b * row].view(b, row), self.max_blocks),
            "token": buf[self._token_at : self._token_at + 8 * b].view(torch.int64),
            "vocab_limit": buf[self._limit_at : self._limit_at + 4].view(torch.int32),
            "grammar_mask": buf[self._mask_at : self._mask_at + 4 * b * self.mask_words]
            .view(torch.int32).view(b, self.mask_words),
        }

    # ---- writing a batch ------------------------------------------------------------------------
    def stage(self, tables: np.ndarray, which: np.ndarray, pos: np.ndarray, kv_start: np.ndarray,
              tokens: np.ndarray, hiddens: Hiddens, vocab_limit: int, masks: Masks = None,
              copy_in: bool = True) -> Mapping[str, torch.Tensor]:
        """Write one batch (rows past ``len(pos)`` are dead) and return the graph inputs.

        Row i is the sequence whose block table is ``tables[which[i]]``, at ``pos[i]`` with
        ``kv_start[i]`` and token ``tokens[i]`` (int64 arrays, checked by the caller, every
        position's blocks ensured). ``hiddens`` is one hidden per row, or one [n, ...] tensor.
        ``copy_in=False``: the host buffer is left for the replay to copy (a graph captured with
        :meth:`in_graph_copy` as its first node). The returned mapping is shared between calls.
        """
        self.wait_for_copy()
        self.num_live = self._write(self.meta, self.row_bytes, self.max_blocks, self.columns, self.window,
                                    self.block_size, tables, which, pos, kv_start, self.tokens, tokens, self.num_live)
        self.vocab_limit[0] = vocab_limit
        self._write_masks(masks)
        if not copy_in and self._gather is not None:
            self._write_addresses(hiddens)
        else:
            self._copy_hiddens(hiddens)
        if copy_in:
            self._copy_to_device()
        elif self._device_index is not None:
            self._is_copy_pending = True  # the replay reads the host buffer
        return self.chain_inputs(self.mask_words if self._num_masked else None)

    def wait_for_copy(self) -> None:
        """Wait for the last staging copy (or replay) to have read the host buffer: before writing it."""
        if self._is_copy_pending:
            self._copied.synchronize()  # that copy only: the work queued after it may still run
            self._is_copy_pending = False

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

    def graph_inputs(self) -> dict[str, torch.Tensor]:
        meta = self.views["meta"]
        return {"token": self.views["token"], "hidden": self.hidden_buf, "positions": meta.pos,
                "kv_start": meta.kv_start, "block_table": meta.block_table,
                "vocab_limit": self.views["vocab_limit"], "grammar_mask": self.views["grammar_mask"]}

    def read_rows(self, tensor: torch.Tensor, n: int) -> np.ndarray:
        """The first ``n`` rows of a device output as a host array (one copy and one sync on CUDA).

        On CUDA into a pinned buffer kept per shape; on the CPU a copy of the rows (the output
        is a view of the arena, which the next run overwrites).
        """
        if not tensor.is_cuda:
            return tensor[:n].numpy().copy()
        for published, host in self._published:
            if published() is tensor:  # the graph's last node wrote it to ``host``: wait, read in place
                raw_copy.synchronize_current_stream(tensor.get_device())
                self._is_copy_pending = False
                return host[:n].numpy()
        host = self._read_bufs.get((tensor.shape, tensor.dtype))
        if host is None:
            host = self._read_bufs[(tensor.shape, tensor.dtype)] = torch.empty(tensor.shape, dtype=tensor.dtype,
                                                                               pin_memory=True)
        rows = host[:n]
        rows.copy_(tensor[:n], non_blocking=True)
        raw_copy.synchronize_current_stream(tensor.get_device())
        self._is_copy_pending = False  # the staging copy, queued before the run, is done too
        return rows.numpy()

    def in_graph_read(self, name: str = "drafts") -> Callable[[Mapping[str, torch.Tensor]], None] | None:
        """The read-back of a chain's output ``name`` as a function of its outputs, to capture at
        the tail of the graph (CapturedExecutor's ``epilogue``), or None (CPU, no triton, memory
        the device cannot address).

        Captured, one kernel copies the output into a pinned buffer kept here at every replay
        (``ops/triton/rows.py``'s copy_to_host: no copy-engine transfer after the replay);
        :meth:`read_rows` then waits for the stream and reads the buffer. Each capture records
        its own output tensor (a run before it, e.g. the warm-up, writes the buffer too).
        """
        if self._publish is None or not PUBLISH_READS:
            return None
        publish = self._publish

        def read(outputs: Mapping[str, torch.Tensor]) -> None:
            tensor = outputs.get(name)
            if tensor is None or not tensor.is_contiguous() or tensor.nbytes % 4:
                return  # read_rows copies it after the replay, as it does any output
            key = (tensor.shape, tensor.dtype)
            host = self._publish_bufs.get(key)
            capturing = tensor.is_cuda and torch.cuda.is_current_stream_capturing()
            if host is None:
                if capturing:  # no pinned allocation inside a capture: read_rows copies this one
                    return
                host = self._publish_bufs[key] = torch.empty(tensor.shape, dtype=tensor.dtype,
                                                             pin_memory=tensor.is_cuda)
            if capturing:  # the captured graph's own output: read_rows finds it and reads ``host``
                self._published[:] = [(ref, buf) for ref, buf in self._published if ref() is not None]
                self._published.append((weakref.ref(tensor), host))
            publish(tensor, host)

        return read

    def in_graph_copy(self, masked: bool) -> Callable[[], None] | None:
        """The staging copy as a function to capture at the head of a chain graph, or None.

        Captured, it reads this pinned host buffer at every replay: with triton one kernel that
        copies the buffer and gathers the hiddens from the addresses it holds, without a memcpy
        node. A propose then makes no CUDA call before its launch. It copies what the chain
        reads: everything with the grammar masks (``masked``), else everything before them.
        None where the copy cannot be captured this way (CPU, no cuda-python).
        """
        if self._device_index is None or not raw_copy.is_enabled:
            return None
        dst, src = (self.device_buf, self.host_buf) if masked else (self._device_head, self._host_head)
        index, address_at, hiddens, gather = self._device_index, self._address_at, self.hidden_buf, self._gather
        copied = self._copied

        def copy() -> None:
            if gather is not None:
                gather(src, dst, address_at, hiddens)
            else:
                raw_copy.copy_async(dst, src, index)
            copied.record(torch.cuda.current_stream(index))  # captured: an event node, recorded at every replay

        return copy

    # ---- the parts of a stage -------------------------------------------------------------------
    def _write_masks(self, masks: Masks) -> None:
        if self._num_masked:  # rows masked last time allow everything again (a dead row's output is dropped)
            self.masks[: self._num_masked] = -1
            self._num_masked = 0
        if masks is None:
            return
        for i, mask in enumerate(masks):
            if mask is None:
                continue
            words = np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask, dtype=np.int32)
            self.masks[i, : words.size] = words  # may be shorter than a row: the drafted vocab rows only
            self._num_masked = i + 1

    def _write_addresses(self, hiddens: Hiddens) -> None:
        """Each hidden's device address (0 for padding): the graph gathers them.

        A strided hidden is made contiguous first and kept alive until the next stage, which
        comes after the replay has read it (a stage waits for the last copy to finish).
        """
        self._kept.clear()
        if isinstance(hiddens, HiddenRows):  # each row's address from its index: no view, no copy
            n, rows = len(hiddens), hiddens.tensor
            addresses = self.addresses[:n]
            np.multiply(hiddens.index, rows.stride(0) * rows.element_size(), out=addresses)
            addresses += rows.data_ptr()
        elif isinstance(hiddens, torch.Tensor):
            if hiddens.stride()[1:] != self._row_strides:  # rows strided inside: one contiguous copy
                hiddens = hiddens.contiguous()
                self._kept.append(hiddens)
            n, step = hiddens.shape[0], hiddens.stride(0) * hiddens.element_size()
            addresses = self.addresses[:n]
            np.multiply(self._arange[:n], step, out=addresses)
            addresses += hiddens.data_ptr()
        else:
            n = len(hiddens)
            pointers = [hidden.data_ptr() if hidden.is_contiguous() else self._contiguous_pointer(hidden)
                        for hidden in hiddens]
            self.addresses[:n] = pointers
        if n < self._num_addresses:
            self.addresses[n : self._num_addresses] = 0  # padding rows gather zeros
        self._num_addresses = self._num_hiddens = n

    def _contiguous_pointer(self, hidden: torch.Tensor) -> int:
        """The address of a contiguous copy of a strided hidden, kept until the next stage."""
        hidden = hidden.contiguous()
        self._kept.append(hidden)
        return hidden.data_ptr()

    def _copy_hiddens(self, hiddens: Hiddens) -> None:
        # The hiddens are of the row's shape (checked): no view of each before the copy.
        if isinstance(hiddens, HiddenRows):  # one gather of the rows into place
            n = len(hiddens)
            if n:
                torch.index_select(hiddens.tensor, 0, hiddens.index_on_device(), out=self._hidden_rows[n])
        elif isinstance(hiddens, torch.Tensor):  # [n, ...]: one copy for the batch, whatever its strides
            n = hiddens.shape[0]
            if n:
                self._hidden_rows[n].copy_(hiddens, non_blocking=True)
        else:
            n = len(hiddens)
            if n == 1:  # one copy, not a stack (a dispatch the less)
                self._hidden_rows[1].copy_(hiddens[0], non_blocking=True)
            elif n:
                torch.stack(hiddens, out=self._hidden_rows[n])
        if n < self._num_hiddens:  # rows that held a hidden last time are padding now: zeros
            self.hidden_buf[n : self._num_hiddens].zero_()
        self._num_hiddens = n

    def _copy_to_device(self) -> None:
        if self.device_buf is self.host_buf:
            return  # the CPU: nothing to copy
        src, dst = (self.host_buf, self.device_buf) if self._num_masked else (self._host_head, self._device_head)
        if self._device_index is None:
            dst.copy_(src)
            return
        if raw_copy.is_enabled:
            raw_copy.copy_async(dst, src, self._device_index)
        else:
            dst.copy_(src, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self._device_index))
        self._is_copy_pending = True
