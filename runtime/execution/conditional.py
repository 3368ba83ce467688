"""CUDA graph conditional nodes (IF and WHILE) inside a ``torch.cuda.graph`` capture.

A draft step that may stop early (or loop until every row is done) wants the decision
taken on the device, without a host sync between replays. CUDA 12.4+ graphs can do that
with conditional nodes; torch 2.11-2.13 has no public API for them (the private
``CUDAGraph.begin_capture_to_if_node`` covers IF only), so this module builds them with
cuda-python (the driver API and NVRTC)::

    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(g, pool=pool):
        before()
        with if_node(flag, pool):        # body runs at replay when flag[0] != 0
            body()
        after()

How a node is made, on torch's current (capturing) stream:

1. a one-thread kernel, compiled once per device with NVRTC, copies ``flag[0] != 0``
   into a fresh conditional handle (``cudaGraphSetConditional``);
2. a conditional node that depends on everything captured so far (that kernel last) is
   added to the graph being captured, and the capture is told to continue after it;
3. the with-block is captured into the node's body graph on a side stream of our own,
   which is torch's current stream inside the block. For WHILE the same kernel is
   captured once more at the end of the body, so each trip re-reads the flag the body
   just wrote.

Limits: the body may hold only kernels, memsets, memcpys and nested conditionals
(no event record/wait nodes, so no cross-stream work inside it); no RNG ops in a body
(their offsets are counted once per capture; torch refuses them in its own conditional
nodes); ``flag`` must stay alive, at the same address, for
as long as the graph is replayed. After an exception inside the block the body capture
is ended and the current stream restored, but the outer capture already holds the node
(CUDA forbids removing nodes from a graph under capture): discard that CUDAGraph.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from draftgraph.runtime.errors import CaptureError, describe

try:  # the CUDA 13 signatures are used below (edge data in capture info and node adds)
    import cuda.bindings as _bindings
    from cuda.bindings import driver as _drv
    from cuda.bindings import nvrtc as _nvrtc
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    _bindings = _drv = _nvrtc = None

__all__ = ["ConditionalError", "count_conditional_nodes", "if_node", "is_available", "while_node"]

_MIN_CUDA = (12, 4)  # conditional nodes captured into with cuStreamBeginCaptureToGraph
_MIN_BINDINGS = 13  # cuStreamGetCaptureInfo / cuGraphAddNode with edge data
# torch's private allocator routing (see _route_allocations_to_pool).
_ALLOC_BINDINGS = ("_cuda_endAllocateToPool", "_cuda_beginAllocateCurrentThreadToPool", "_cuda_releasePool")

_KERNEL_NAME = b"draftgraph_set_conditional"
# No header and no options beyond the architecture: NVRTC predefines __cudart_builtin__, and
# the cubin leaves cudaGraphSetConditional to the driver's loader (an undefined symbol in
# constant bank 4, as nvcc's output does), so no -rdc, no cudadevrt, no -I. Checked by
# compiling with NVRTC 13.0 for sm_90; the load itself is checked only on a GPU.
_KERNEL_SOURCE = rb"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

extern "C" __global__ void draftgraph_set_conditional(cudaGraphConditionalHandle handle, const int* flag) {
    cudaGraphSetConditional(handle, flag[0] != 0 ? 1u : 0u);
}
"""
_NVRTC_HINT = (
    "install the CUDA 13 NVRTC wheel (pip install nvidia-cuda-nvrtc); cuda-pathfinder looks in site-packages "
    "(nvidia/cu13/lib), then $CONDA_PREFIX, then the system loader (LD_LIBRARY_PATH)"
)


class ConditionalError(CaptureError):
    """A conditional node that cannot be made: bad flag or pool, no capture, no support."""


# ---------------------------------------------------------------------------------------------
# availability


def _version_tuple(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in (text or "").split(".")[:2])
    except ValueError:
        return ()


def _unavailable_reason() -> str | None:
    """Why conditional nodes cannot be made here, or None when they can. Never raises."""
    try:
        if _drv is None or _nvrtc is None:
            return "cuda-python is not importable (pip install 'cuda-python>=13')"
        bindings = _version_tuple(getattr(_bindings, "__version__", ""))
        if not bindings or bindings[0] < _MIN_BINDINGS:
            return f"cuda-python {_bindings.__version__} is older than {_MIN_BINDINGS}.0"
        missing = [name for name in _ALLOC_BINDINGS if not hasattr(torch._C, name)]
        if missing:
            return f"torch {torch.__version__} lacks the allocator bindings {', '.join(missing)}"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        if _version_tuple(torch.version.cuda) < _MIN_CUDA:
            return f"torch is built against CUDA {torch.version.cuda}, older than 12.4"
        err, driver = _drv.cuDriverGetVersion()
        if err != _drv.CUresult.CUDA_SUCCESS:
            return f"cuDriverGetVersion failed: {err.name}"
        if driver < 12040:
            return f"the CUDA driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, older than 12.4"
        try:
            err, major, minor = _nvrtc.nvrtcVersion()
        except Exception as exc:  # cuda.pathfinder.DynamicLibNotFoundError when libnvrtc is missing
            return f"NVRTC could not be loaded ({exc})"
        if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS or (major, minor) < _MIN_CUDA:
            return f"NVRTC {major}.{minor} is older than 12.4"
    except Exception as exc:  # is_available() must never raise
        return f"{type(exc).__name__}: {exc}"
    return None


def is_available() -> bool:
    """cuda-python >= 13, a CUDA device, driver and torch's CUDA >= 12.4, NVRTC loadable. Never raises."""
    return _unavailable_reason() is None


def _require_available() -> None:
    reason = _unavailable_reason()
    if reason is not None:
        hint = _NVRTC_HINT if "NVRTC" in reason else "use the plain (unconditional) capture on this host"
        raise ConditionalError(describe("CUDA graph conditional nodes", "available", reason, hint))


# ---------------------------------------------------------------------------------------------
# input checks: pure Python, before any CUDA call (so the CPU tests reach them)


def _check_pool(pool: object) -> None:
    if pool is None:
        raise ConditionalError(
            describe(
                "pool",
                "the torch.cuda.graph_pool_handle() the capture allocates from",
                None,
                "pool = torch.cuda.graph_pool_handle(); pass it to torch.cuda.graph(g, pool=pool) and to the node",
            )
        )
    if not (isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(part, int) for part in pool)):
        raise ConditionalError(describe("pool", "a (int, int) handle from torch.cuda.graph_pool_handle()", repr(pool)))


def _check_flag(flag: object) -> None:
    expected = "a CUDA int32 tensor of shape [1]"
    if not isinstance(flag, torch.Tensor):
        raise ConditionalError(describe("flag", expected, type(flag).__name__))
    if flag.dtype != torch.int32 or tuple(flag.shape) != (1,) or flag.device.type != "cuda":
        got = f"a {flag.device} {str(flag.dtype).removeprefix('torch.')} tensor of shape {list(flag.shape)}"
        raise ConditionalError(
            describe("flag", expected, got, "torch.zeros(1, dtype=torch.int32, device='cuda'), written in place")
        )


def _check_allocator_config() -> None:
    # torch refuses conditional nodes under this option too: its endAllocateToPool then
    # drops per-capture reuse state that the rest of the capture still needs.
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "graph_capture_record_stream_reuse:true" in os.environ.get(name, "").replace(" ", "").lower():
            raise ConditionalError(
                describe(name, "no graph_capture_record_stream_reuse:True", os.environ[name], "unset that option")
            )


# ---------------------------------------------------------------------------------------------
# cuda-python plumbing


def _error_name(err: object) -> str:
    try:
        ok, name = _drv.cuGetErrorName(err)
        if ok == _drv.CUresult.CUDA_SUCCESS and name:
            return name.decode()
    except Exception:
        pass
    return getattr(err, "name", str(err))


def _call(result: tuple, what: str, hint: str | None = None):
    """Unpack a cuda-python driver result: (err,) -> None, (err, x) -> x, (err, x, y...) -> tuple."""
    err, *values = result
    if err != _drv.CUresult.CUDA_SUCCESS:
        raise ConditionalError(describe(what, "CUDA_SUCCESS", _error_name(err), hint))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@contextmanager
def _relaxed_capture_mode() -> Iterator[None]:
    """Allow module loads and stream creation while this thread (or another) captures."""
    previous = _call(
        _drv.cuThreadExchangeStreamCaptureMode(_drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
        "cuThreadExchangeStreamCaptureMode",
    )
    try:
        yield
    finally:
        _drv.cuThreadExchangeStreamCaptureMode(previous)


_lock = threading.Lock()
_kernels: dict[int, tuple[object, object, bytes]] = {}  # device -> (CUmodule, CUfunction, image): kept alive
_free_streams: dict[int, list[int]] = {}  # device -> body streams not in use (ours, never torch's pool)


def _nvrtc_check(result: tuple, what: str, log: str = ""):
    err, *values = result
    if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ConditionalError(describe(what, "NVRTC_SUCCESS", f"{err.name}{': ' + log if log else ''}"))
    return values[0] if len(values) == 1 else tuple(values)


def _compile_set_kernel(arch: int) -> tuple[bytes, str]:
    """The set-conditional kernel for compute capability ``arch`` (90 = sm_90): (image, option).

    A cubin when NVRTC knows the architecture (no driver JIT, and a cubin of a newer 13.x
    NVRTC loads on an older 13.x driver); else PTX for the newest architecture it knows
    below ``arch``, which the driver JIT-compiles forward.
    """
    try:
        supported = _nvrtc_check(_nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    except ConditionalError:
        raise
    except Exception as exc:  # libnvrtc missing: cuda.pathfinder raises on the first call
        raise ConditionalError(describe("NVRTC", "a loadable libnvrtc", str(exc), _NVRTC_HINT)) from exc
    if arch in supported:
        option, cubin = f"--gpu-architecture=sm_{arch}", True
    else:
        older = [known for known in supported if known <= arch]
        if not older:
            raise ConditionalError(describe("NVRTC architectures", f"one at or below sm_{arch}", list(supported)))
        option, cubin = f"--gpu-architecture=compute_{max(older)}", False
    program = _nvrtc_check(
        _nvrtc.nvrtcCreateProgram(_KERNEL_SOURCE, b"draftgraph_set_conditional.cu", 0, [], []), "nvrtcCreateProgram"
    )
    try:
        (err,) = _nvrtc.nvrtcCompileProgram(program, 1, [option.encode()])
        if err != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = _nvrtc_check(_nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            log = bytearray(size)  # NVRTC writes into it: must be mutable
            _nvrtc.nvrtcGetProgramLog(program, log)
            _nvrtc_check((err,), f"nvrtcCompileProgram({option})", bytes(log).rstrip(b"\0").decode(errors="replace"))
        if cubin:
            image = bytearray(_nvrtc_check(_nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize"))
            _nvrtc_check(_nvrtc.nvrtcGetCUBIN(program, image), "nvrtcGetCUBIN")
        else:  # the size counts the terminating NUL that cuModuleLoadData needs for PTX
            image = bytearray(_nvrtc_check(_nvrtc.nvrtcGetPTXSize(program), "nvrtcGetPTXSize"))
            _nvrtc_check(_nvrtc.nvrtcGetPTX(program, image), "nvrtcGetPTX")
    finally:
        _nvrtc.nvrtcDestroyProgram(program)
    return bytes(image), option


def _set_kernel(device: int):
    """The loaded set-conditional CUfunction for ``device``; compiled and loaded once."""
    with _lock:
        if device in _kernels:
            return _kernels[device][1]
        major, minor = torch.cuda.get_device_capability(device)
        image, option = _compile_set_kernel(major * 10 + minor)
        with _relaxed_capture_mode():  # the first node is usually made mid-capture
            module = _call(_drv.cuModuleLoadData(image), f"cuModuleLoadData(set-conditional kernel, {option})")
            function = _call(_drv.cuModuleGetFunction(module, _KERNEL_NAME), "cuModuleGetFunction")
            if hasattr(_drv, "cuFuncLoad"):  # load now, not lazily at the first (captured) launch
                _call(_drv.cuFuncLoad(function), "cuFuncLoad")
        _kernels[device] = (module, function, image)
        return function


def _launch_set_kernel(function, handle, flag_ptr: int, stream: int) -> None:
    # cuda-python packs ((values), (ctypes types)) into the void** array cuLaunchKernel wants;
    # the values are copied at launch (into the captured node), so the buffer may go.
    args = ((int(handle), flag_ptr), (ctypes.c_ulonglong, ctypes.c_void_p))
    _call(_drv.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, stream, args, 0), "cuLaunchKernel(set-conditional)")


def _capture_graph(stream: int):
    """The graph under capture on ``stream``; ConditionalError when none is active."""
    hint = "call if_node/while_node inside `with torch.cuda.graph(g, pool=pool):`, on its current stream"
    info = _drv.cuStreamGetCaptureInfo(stream)  # (err, status, id, graph, deps, edge data, count)
    err, status, graph = info[0], info[1], info[3]
    if err != _drv.CUresult.CUDA_SUCCESS:
        raise ConditionalError(describe("stream capture", "an active capture", _error_name(err), hint))
    if status != _drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        raise ConditionalError(describe("stream capture on the current stream", "active", status.name, hint))
    return graph


def _add_conditional_node(stream: int, kind, handle, context):
    """Add the node after all of ``stream``'s captured work; the capture goes on after it. Returns its body."""
    info = _call(_drv.cuStreamGetCaptureInfo(stream), "cuStreamGetCaptureInfo")
    graph, dependencies, count = info[2], info[3], info[5]
    params = _drv.CUgraphNodeParams()  # zeroed, as cuGraphAddNode requires of unused bytes
    params.type = _drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = kind
    params.conditional.size = 1
    params.conditional.ctx = context
    # Edge data None = default edges: the node's last dependency is our plain kernel launch.
    node = _call(_drv.cuGraphAddNode(graph, dependencies, None, count, params), "cuGraphAddNode(conditional)")
    body = params.conditional.phGraph_out[0]  # CUDA-owned, lives as long as the node
    _call(
        _drv.cuStreamUpdateCaptureDependencies(
            stream, [node], None, 1, _drv.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        ),
        "cuStreamUpdateCaptureDependencies",
    )
    return body


def _acquire_stream(device: int) -> int:
    # Our own non-blocking streams: one from torch's round-robin pool could be the very
    # stream the outer capture runs on (then cuStreamBeginCaptureToGraph fails).
    with _lock:
        free = _free_streams.setdefault(device, [])
        if free:
            return free.pop()
    with _relaxed_capture_mode():
        stream = _call(_drv.cuStreamCreate(_drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
    return int(stream)


def _release_stream(device: int, stream: int) -> None:
    with _lock:
        _free_streams.setdefault(device, []).append(stream)


# ---------------------------------------------------------------------------------------------
# the caching allocator


def _route_allocations_to_pool(device: int, pool: tuple[int, int]) -> None:
    """Make tensors allocated inside the body (and after it) come from ``pool``.

    torch's capture registered (pool, "stream's capture id == the outer capture's id").
    The body stream is captured under another id, so its allocations would miss that
    filter and come from the general pool: freed (and reused) when the Python tensors die
    after capture while the graph still reads and writes them. Python can only register
    "all streams" or "the calling thread", so the sequence is:

    1. ``_cuda_endAllocateToPool(device, pool)`` erases the pool's (first, here only)
       registration: the outer capture's, or the thread one of an earlier node. It is
       also the check that ``pool`` is the capture's pool: torch raises when it is not.
    2. ``_cuda_beginAllocateCurrentThreadToPool(device, pool)`` registers "this thread"
       (torch checks one registration per pool, hence step 1 first). Body allocations
       and the outer capture's later ones, both made by this thread, go to ``pool``.
       begin also increments the pool's use_count,
    3. which ``_cuda_releasePool(device, pool)`` gives back at once: the outer capture
       holds its own count, so this never reaches zero (the pool is never freeable here).

    Nothing is undone at the block's end: the thread registration stands in for the outer
    one until ``torch.cuda.graph`` exits, where ``capture_end``'s ``endAllocateToPool``
    erases it. So afterwards nothing of ours is registered and use_count is as torch left
    it. What changes for the rest of the capture: other threads' allocations on the capture
    stream no longer go to the pool (the thread's allocations on other streams do).
    """
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError as exc:
        raise ConditionalError(
            describe(
                "pool",
                "the pool the current torch.cuda.graph capture allocates from",
                repr(pool),
                "pass the same torch.cuda.graph_pool_handle() to torch.cuda.graph(g, pool=pool) and to the node",
            )
        ) from exc
    torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
    torch._C._cuda_releasePool(device, pool)


# ---------------------------------------------------------------------------------------------
# the nodes


def _cond_type(name: str):
    return getattr(_drv.CUgraphConditionalNodeType, f"CU_GRAPH_COND_TYPE_{name}")


@contextmanager
def _conditional_node(kind: str, device: int, flag_ptr: int, pool: tuple[int, int]) -> Iterator[torch.cuda.Stream]:
    """The node itself, from checked inputs (kept apart so tests can drive it with fakes)."""
    outer = torch.cuda.current_stream(device)
    outer_handle = outer.cuda_stream
    graph = _capture_graph(outer_handle)
    function = _set_kernel(device)  # the likeliest failure (NVRTC), before anything is changed
    context = _call(_drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(context) == 0:
        raise ConditionalError(describe("CUDA context", "one current on this thread", "none"))
    _route_allocations_to_pool(device, pool)
    handle = _call(_drv.cuGraphConditionalHandleCreate(graph, context, 0, 0), "cuGraphConditionalHandleCreate")
    _launch_set_kernel(function, handle, flag_ptr, outer_handle)  # decides the first trip
    body_graph = _add_conditional_node(outer_handle, _cond_type(kind), handle, context)

    body = _acquire_stream(device)
    try:
        _call(
            _drv.cuStreamBeginCaptureToGraph(
                body, body_graph, None, None, 0, _drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            ),
            "cuStreamBeginCaptureToGraph(body)",
        )
    except BaseException:
        _release_stream(device, body)
        raise
    finished = False
    try:
        body_stream = torch.cuda.ExternalStream(body, device=torch.device("cuda", device))
        torch.cuda.set_stream(body_stream)
        yield body_stream
        if kind == "WHILE":  # re-decide after every trip, from what the body wrote
            _launch_set_kernel(function, handle, flag_ptr, body)
        finished = True
    finally:
        torch.cuda.set_stream(outer)
        result = _drv.cuStreamEndCapture(body)
        if result[0] == _drv.CUresult.CUDA_SUCCESS:
            _release_stream(device, body)  # else it may still be capturing: leave it out of the pool
        if finished:  # on an exception from the block, that exception is the one to see
            _call(result, "cuStreamEndCapture(body)", "a body may hold only kernels, memsets, memcpys, conditionals")


def _enter(kind: str, flag: torch.Tensor, pool) -> tuple[int, int]:
    _check_pool(pool)
    _check_flag(flag)
    _check_allocator_config()
    _require_available()
    device = flag.device.index if flag.device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_device()
    if device != current:
        raise ConditionalError(
            describe("flag device", f"cuda:{current} (the current device)", f"cuda:{device}", "move the flag")
        )
    return device, flag.data_ptr()


@contextmanager
def if_node(flag: torch.Tensor, pool) -> Iterator[torch.cuda.Stream]:
    """Capture the with-block as the body of an IF node: at replay it runs when ``flag[0] != 0``.

    Inside an active ``torch.cuda.graph(g, pool=pool)`` capture, on torch's current stream.
    ``flag``: int32 tensor of shape [1] on the capture's device, read at replay time.
    ``pool``: the ``torch.cuda.graph_pool_handle()`` given to ``torch.cuda.graph``; tensors
    allocated in the block come from it. Yields the body stream, torch's current stream
    inside the block; on exit the body capture ends and the previous stream is current again.
    """
    device, flag_ptr = _enter("IF", flag, pool)
    with _conditional_node("IF", device, flag_ptr, pool) as stream:
        yield stream


@contextmanager
def while_node(flag: torch.Tensor, pool) -> Iterator[torch.cuda.Stream]:
    """Capture the with-block as the body of a WHILE node: it runs while ``flag[0] != 0``.

    As :func:`if_node`; the flag is read before the first trip and again after each trip
    (the set kernel is captured at the end of the body too), so the body must write it.
    """
    device, flag_ptr = _enter("WHILE", flag, pool)
    with _conditional_node("WHILE", device, flag_ptr, pool) as stream:
        yield stream


def count_conditional_nodes(cuda_graph: torch.cuda.CUDAGraph) -> int:
    """Conditional nodes at the top level of a graph captured with ``CUDAGraph(keep_graph=True)``.

    Nodes nested inside bodies are not counted.
    """
    _require_available()
    try:
        raw = cuda_graph.raw_cuda_graph()
    except RuntimeError as exc:
        raise ConditionalError(
            describe("cuda_graph", "a CUDAGraph(keep_graph=True) after capture", str(exc).splitlines()[0])
        ) from exc
    _, count = _call(_drv.cuGraphGetNodes(raw), "cuGraphGetNodes")
    if count == 0:
        return 0
    nodes, count = _call(_drv.cuGraphGetNodes(raw, count), "cuGraphGetNodes")
    conditional = _drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    return sum(1 for node in nodes[:count] if _call(_drv.cuGraphNodeGetType(node), "cuGraphNodeGetType") == conditional)
