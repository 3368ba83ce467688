"""Stream-ordered byte copies through cuda-python, for the staging copies.

A ``Tensor.copy_`` costs microseconds of host time per call: dispatch, a TensorIterator,
and for a pinned source the host allocator's event record. A run stages twice (the packed
host buffer up, the target hidden across): a captured chain does both in its first kernel
(``ChainStaging.in_graph_copy``; a memcpy node without triton), so a propose queues
neither; eager runs and catch-ups queue both. ``cudaMemcpyAsync`` on torch's current
stream is the same copy, ordered the same way, without that work. On an H200 host
(``benchmarks/bench_host.py --device cuda --copies raw,torch``) the staging phase of a B=1 K=1
propose took 36-39 us this way against 39-47 us through ``copy_``; that host's noise is as
large (its B=1 K=3 rows ranged over 29-54 us either way). Only plain cases take it: both
sides contiguous, the same dtype and byte count, the calling thread on the tensors'
device; anything else (and hosts without cuda-python) goes through ``copy_``.
"""

from __future__ import annotations

import torch

try:  # cuda-python >= 12.6 layout; older ones, or none, leave the torch copy
    from cuda.bindings import runtime as _cudart
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    _cudart = None

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what inductor's launchers call
is_enabled = _cudart is not None and _raw_stream is not None  # a switch for benchmarks and tests
# The calling thread's device: torch.cuda.current_device() without its Python wrapper (lazy init, checks).
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


class RawCopyError(RuntimeError):
    """cudaMemcpyAsync returned an error (a bad pointer, a sticky context error)."""


def _memcpy(dst_ptr: int, src_ptr: int, nbytes: int, stream: int) -> None:
    (err,) = _cudart.cudaMemcpyAsync(dst_ptr, src_ptr, nbytes, _cudart.cudaMemcpyKind.cudaMemcpyDefault, stream)
    if err != _cudart.cudaError_t.cudaSuccess:
        raise RawCopyError(f"cudaMemcpyAsync of {nbytes} bytes failed: {err.name}")


def copy_async(dst: torch.Tensor, src: torch.Tensor, device_index: int) -> None:
    """``dst.copy_(src, non_blocking=True)`` on the current stream of ``device_index``.

    ``dst`` is a device tensor of that device; ``src`` is on it too or in pinned host
    memory. The caller keeps ``src`` alive and unchanged until the stream reaches the copy.
    """
    nbytes = dst.nbytes
    if (
        is_enabled
        and src.dtype == dst.dtype
        and src.nbytes == nbytes
        and dst.is_contiguous()
        and src.is_contiguous()
        and current_device() == device_index
    ):
        _memcpy(dst.data_ptr(), src.data_ptr(), nbytes, _raw_stream(device_index))
    else:
        dst.copy_(src, non_blocking=True)


def synchronize_current_stream(device_index: int) -> None:
    """``torch.cuda.current_stream(device).synchronize()`` without the Stream object.

    On the lent H100 hosts ``torch.cuda.current_stream(device)`` took 4.0 us a call and its
    ``synchronize()`` 0.9 on an idle GPU; the raw handle 0.15 and ``cudaStreamSynchronize``
    through cuda-python 2.0 (``benchmarks/h200/host_probe_731e6f3_h100.txt``): a propose's
    read-back waits this way once.
    """
    if is_enabled and current_device() == device_index:
        (err,) = _cudart.cudaStreamSynchronize(_raw_stream(device_index))
        if err != _cudart.cudaError_t.cudaSuccess:
            raise RawCopyError(f"cudaStreamSynchronize failed: {err.name}")
    else:
        torch.cuda.current_stream(device_index).synchronize()


def is_device_addressable(host: torch.Tensor) -> bool:
    """Whether a kernel may read the pinned ``host`` tensor at its own address.

    Under unified addressing the device maps pinned memory at its host address (what the
    staging kernel reads, ``draftgraph.ops.triton.rows.stage_from_host``); memory pinned another way
    (``cudaHostRegister`` without mapping) may not be. Asked of the driver, never assumed.
    """
    if _cudart is None or not host.is_pinned():
        return False
    err, device_ptr = _cudart.cudaHostGetDevicePointer(host.data_ptr(), 0)
    return err == _cudart.cudaError_t.cudaSuccess and int(device_ptr) == host.data_ptr()
