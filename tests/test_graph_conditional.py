"""draftgraph.runtime.execution.conditional without a GPU: input checks, availability, and the call sequence.

The sequence tests drive the node against a fake driver (the real cuda-python enums and
structs, fake functions) and fake torch streams, so the order of the CUDA calls, the
allocator routing and the clean-up on errors are checked here; the GPU file checks
what the graphs do.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from draftgraph.runtime.errors import CaptureError, DraftGraphError
from draftgraph.runtime.execution import conditional as gc

POOL = (0, 1)  # the shape of torch.cuda.graph_pool_handle()'s token


class _Forbidden:
    """Stands in for cuda.bindings.driver: any use is a CUDA call made too early."""

    def __getattr__(self, name):
        raise AssertionError(f"CUDA call {name} before the inputs were checked")


@pytest.fixture
def no_cuda_calls(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda call before the inputs were checked")

    monkeypatch.setattr(gc, "_drv", _Forbidden())
    monkeypatch.setattr(gc, "_nvrtc", _Forbidden())
    for name in ("current_stream", "current_device", "set_stream", "is_available"):
        monkeypatch.setattr(torch.cuda, name, forbidden)


def test_is_available_is_a_bool_and_false_without_a_gpu():
    available = gc.is_available()
    assert isinstance(available, bool)
    if not torch.cuda.is_available():
        assert available is False
        assert gc._unavailable_reason()


def test_is_available_never_raises(monkeypatch):
    def broken():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert gc.is_available() is False
    assert "driver exploded" in gc._unavailable_reason()


def test_the_error_is_a_capture_error():
    assert issubclass(gc.ConditionalError, CaptureError)
    assert issubclass(gc.ConditionalError, DraftGraphError)


@pytest.mark.parametrize("node", [gc.if_node, gc.while_node])
@pytest.mark.parametrize(
    "flag",
    [
        torch.zeros(1, dtype=torch.int32),  # on the CPU
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros((), dtype=torch.int32),
        torch.zeros(1, dtype=torch.bool),
    ],
)
def test_a_bad_flag_fails_before_any_cuda_call(no_cuda_calls, node, flag):
    with pytest.raises(gc.ConditionalError, match=r"expected a CUDA int32 tensor of shape \[1\]"):
        with node(flag, POOL):
            pytest.fail("the body must not run")


def test_a_flag_that_is_no_tensor(no_cuda_calls):
    with pytest.raises(gc.ConditionalError, match="got list"):
        with gc.if_node([1], POOL):
            pass


@pytest.mark.parametrize("node", [gc.if_node, gc.while_node])
def test_no_pool_says_to_pass_graph_pool_handle_to_both(no_cuda_calls, node):
    with pytest.raises(gc.ConditionalError, match=r"graph_pool_handle\(\)") as caught:
        with node(torch.zeros(1, dtype=torch.int32), None):
            pass
    assert "torch.cuda.graph(g, pool=pool)" in str(caught.value)


def test_a_pool_that_is_no_handle(no_cuda_calls):
    with pytest.raises(gc.ConditionalError, match="expected a \\(int, int\\) handle"):
        with gc.if_node(torch.zeros(1, dtype=torch.int32), "pool"):
            pass


def test_the_record_stream_reuse_option_is_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,graph_capture_record_stream_reuse:True")
    with pytest.raises(gc.ConditionalError, match="graph_capture_record_stream_reuse"):
        gc._check_allocator_config()


def test_without_support_the_error_says_why(monkeypatch):
    monkeypatch.setattr(gc, "_unavailable_reason", lambda: "NVRTC could not be loaded (no libnvrtc.so.13)")
    with pytest.raises(gc.ConditionalError, match="nvidia-cuda-nvrtc"):
        gc._require_available()


# ---------------------------------------------------------------------------------------------
# NVRTC, where the library is there (it needs no GPU)


def _nvrtc_loads() -> bool:
    try:
        return gc._nvrtc is not None and gc._nvrtc.nvrtcVersion()[0] == gc._nvrtc.nvrtcResult.NVRTC_SUCCESS
    except Exception:
        return False


@pytest.mark.skipif(not _nvrtc_loads(), reason="libnvrtc is not loadable here")
def test_the_set_kernel_compiles_to_a_cubin_and_to_ptx():
    cubin, option = gc._compile_set_kernel(90)
    assert option == "--gpu-architecture=sm_90"
    assert cubin.startswith(b"\x7fELF")
    ptx, option = gc._compile_set_kernel(95)  # no sm_95: PTX for the newest architecture below it
    assert option.startswith("--gpu-architecture=compute_")
    assert b".entry draftgraph_set_conditional" in ptx and b"cudaGraphSetConditional" in ptx
    assert ptx.endswith(b"\0")


# ---------------------------------------------------------------------------------------------
# the call sequence, against fakes

OUTER, GRAPH, HANDLE, CONTEXT, FLAG_PTR = 0xABC, 0x999, 0x4242, 0x77, 0xF1A6


class FakeDriver:
    """The driver functions graph_conditional calls, recording them; the rest is cuda-python's."""

    def __init__(self, real, capturing=True):
        self._real = real
        self.calls = []
        self.capturing = {OUTER} if capturing else set()
        self.next_stream = 0x900

    def __getattr__(self, name):  # enums and structs
        return getattr(self._real, name)

    def _ok(self, *values):
        return (self._real.CUresult.CUDA_SUCCESS, *values)

    def cuStreamGetCaptureInfo(self, stream):
        d = self._real
        status = d.CUstreamCaptureStatus
        active = (
            status.CU_STREAM_CAPTURE_STATUS_ACTIVE if stream in self.capturing else status.CU_STREAM_CAPTURE_STATUS_NONE
        )
        return self._ok(active, 7, d.CUgraph(GRAPH), [d.CUgraphNode(0x111)], [], 1)

    def cuCtxGetCurrent(self):
        return self._ok(self._real.CUcontext(CONTEXT))

    def cuGraphConditionalHandleCreate(self, graph, context, value, flags):
        self.calls.append(("handle", int(graph), int(context), value, flags))
        return self._ok(self._real.CUgraphConditionalHandle(HANDLE))

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, args, extra):
        self.calls.append(("launch", stream, (gx, gy, gz, bx, by, bz), args))
        return self._ok()

    def cuGraphAddNode(self, graph, deps, edges, count, params):
        cond = params.conditional
        self.calls.append(("add", int(graph), count, int(params.type), cond.type.name, cond.size, int(cond.ctx)))
        return self._ok(self._real.CUgraphNode(0x500))

    def cuStreamUpdateCaptureDependencies(self, stream, deps, edges, count, flags):
        self.calls.append(("after", stream, [int(node) for node in deps], flags.name))
        return self._ok()

    def cuThreadExchangeStreamCaptureMode(self, mode):
        return self._ok(mode)

    def cuStreamCreate(self, flags):
        self.calls.append(("create", flags))
        self.next_stream += 1
        return self._ok(self._real.CUstream(self.next_stream))

    def cuStreamBeginCaptureToGraph(self, stream, graph, deps, edges, count, mode):
        self.calls.append(("begin", stream))
        self.capturing.add(stream)
        return self._ok()

    def cuStreamEndCapture(self, stream):
        self.calls.append(("end", stream))
        self.capturing.discard(stream)
        return self._ok(self._real.CUgraph(0))


class FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self):
        return self.cuda_stream


@pytest.fixture
def fakes(monkeypatch):
    if gc._drv is None:
        pytest.skip("cuda-python is not installed")
    driver = FakeDriver(gc._drv)
    state = {"current": FakeStream(OUTER), "log": driver.calls}

    def set_stream(stream):
        state["current"] = stream
        driver.calls.append(("set_stream", stream.cuda_stream))

    def allocator(name):
        return lambda device, pool: driver.calls.append((name, device, pool))

    monkeypatch.setattr(gc, "_drv", driver)
    monkeypatch.setattr(gc, "_set_kernel", lambda device: "set-kernel")
    monkeypatch.setattr(gc, "_free_streams", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device=None: FakeStream(handle))
    for name in gc._ALLOC_BINDINGS:
        monkeypatch.setattr(torch._C, name, allocator(name), raising=False)
    state["driver"] = driver
    return state


def _launch(stream):
    return ("launch", stream, (1, 1, 1, 1, 1, 1), ((HANDLE, FLAG_PTR), (ctypes.c_ulonglong, ctypes.c_void_p)))


ROUTING = [
    ("_cuda_endAllocateToPool", 0, POOL),
    ("_cuda_beginAllocateCurrentThreadToPool", 0, POOL),
    ("_cuda_releasePool", 0, POOL),
]


def test_an_if_node_in_order(fakes):
    with gc._conditional_node("IF", 0, FLAG_PTR, POOL) as body:
        assert fakes["current"] is body and body.cuda_stream == 0x901
        fakes["log"].append(("body work",))
    assert fakes["current"] == FakeStream(OUTER)
    assert fakes["log"] == [
        *ROUTING,
        ("handle", GRAPH, CONTEXT, 0, 0),
        _launch(OUTER),
        ("add", GRAPH, 1, 13, "CU_GRAPH_COND_TYPE_IF", 1, CONTEXT),
        ("after", OUTER, [0x500], "CU_STREAM_SET_CAPTURE_DEPENDENCIES"),
        ("create", 1),
        ("begin", 0x901),
        ("set_stream", 0x901),
        ("body work",),
        ("set_stream", OUTER),
        ("end", 0x901),
    ]


def test_a_while_node_sets_the_condition_again_at_the_end_of_the_body(fakes):
    with gc._conditional_node("WHILE", 0, FLAG_PTR, POOL):
        fakes["log"].append(("body work",))
    log = fakes["log"]
    assert ("add", GRAPH, 1, 13, "CU_GRAPH_COND_TYPE_WHILE", 1, CONTEXT) in log
    assert [entry for entry in log if entry[0] == "launch"] == [_launch(OUTER), _launch(0x901)]
    assert log[log.index(("body work",)) + 1] == _launch(0x901)
    assert log[-2:] == [("set_stream", OUTER), ("end", 0x901)]


def test_an_error_in_the_body_restores_the_stream_and_ends_the_body_capture(fakes):
    with pytest.raises(KeyError, match="boom"):
        with gc._conditional_node("WHILE", 0, FLAG_PTR, POOL):
            raise KeyError("boom")
    assert fakes["current"] == FakeStream(OUTER)
    assert fakes["log"][-2:] == [("set_stream", OUTER), ("end", 0x901)]
    assert [entry for entry in fakes["log"] if entry[0] == "launch"] == [_launch(OUTER)]  # no end-of-body launch
    assert fakes["driver"].capturing == {OUTER}
    assert gc._free_streams == {0: [0x901]}


def test_body_streams_are_ours_and_reused(fakes):
    for _ in range(3):
        with gc._conditional_node("IF", 0, FLAG_PTR, POOL):
            pass
    assert [entry for entry in fakes["log"] if entry[0] == "create"] == [("create", 1)]
    with gc._conditional_node("IF", 0, FLAG_PTR, POOL):
        with gc._conditional_node("IF", 0, FLAG_PTR, POOL) as inner:  # nested: a second stream
            assert inner.cuda_stream == 0x902
    assert sorted(gc._free_streams[0]) == [0x901, 0x902]


def test_no_active_capture_changes_nothing(fakes):
    fakes["driver"].capturing.clear()
    with pytest.raises(gc.ConditionalError, match="active"):
        with gc._conditional_node("IF", 0, FLAG_PTR, POOL):
            pytest.fail("the body must not run")
    assert fakes["log"] == []
    assert fakes["current"] == FakeStream(OUTER)


def test_a_pool_the_capture_does_not_use_changes_nothing(fakes, monkeypatch):
    def not_recording(device, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", not_recording)
    with pytest.raises(gc.ConditionalError, match="same torch.cuda.graph_pool_handle"):
        with gc._conditional_node("IF", 0, FLAG_PTR, POOL):
            pytest.fail("the body must not run")
    assert fakes["log"] == []
    assert fakes["current"] == FakeStream(OUTER)


def test_count_conditional_nodes_needs_a_kept_graph(monkeypatch):
    class NotKept:
        def raw_cuda_graph(self):
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless keep_graph=true")

    monkeypatch.setattr(gc, "_require_available", lambda: None)
    with pytest.raises(gc.ConditionalError, match="keep_graph=True"):
        gc.count_conditional_nodes(NotKept())
