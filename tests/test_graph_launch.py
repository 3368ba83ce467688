"""runtime/graph_launch.c and raw_launch.launcher (design note "compiled launch" in runtime/execution/launch.py).

On a machine without a GPU driver (CI) the module still builds and imports, answers that it
cannot launch, and the launcher falls back to cuda-python's launch; a launch the driver
refuses raises RawLaunchError with the driver's name for the error. The launch itself on a
GPU: tests/test_raw_launch_cuda.py.
"""

from __future__ import annotations

import pytest
from draftgraph.runtime.execution import launch as raw_launch
from draftgraph.runtime.native import build as native_build

NO_DRIVER = -1


@pytest.fixture(scope="module")
def native():
    module = native_build.load("graph_launch")
    if module is None:
        pytest.skip(f"graph_launch not built here: {native_build.why_not('graph_launch')}")
    return module


class FakeDriver:
    """A graph_launch module whose driver answers ``code`` to every launch."""

    def __init__(self, code: int) -> None:
        self.code, self.calls = code, []

    def is_available(self) -> bool:
        return True

    def launch(self, exec_address: int, stream: int) -> int:
        self.calls.append((exec_address, stream))
        return self.code

    def error_name(self, code: int) -> str | None:
        return {700: "CUDA_ERROR_ILLEGAL_ADDRESS"}.get(code)


class Handle:
    """An exec handle as cuda-python's: an object whose int is the address."""

    def __int__(self) -> int:
        return 0x7F00


def test_the_module_refuses_a_null_handle_and_bad_arguments(native):
    with pytest.raises(ValueError, match="null exec"):
        native.launch(0, 0)
    with pytest.raises(TypeError, match="2 arguments"):
        native.launch(1)
    with pytest.raises(TypeError):
        native.launch("exec", 0)


def test_without_a_driver_the_module_says_so_and_the_launcher_keeps_cuda_python(native, monkeypatch):
    if native.is_available():
        pytest.skip("this machine has libcuda")
    assert native.launch(0x7F00, 0) == NO_DRIVER
    assert native.error_name(1) is None
    calls = []
    monkeypatch.setattr(raw_launch, "launch", lambda handle, index: calls.append((handle, index)))
    handle = Handle()
    raw_launch.launcher(handle, 3)()
    assert calls == [(handle, 3)]


@pytest.mark.parametrize("code", [0, 700, 999])
def test_the_compiled_launcher_launches_on_the_current_stream_and_raises_what_the_driver_refuses(monkeypatch, code):
    driver = FakeDriver(code)
    monkeypatch.setitem(native_build._loaded, "graph_launch", driver)
    monkeypatch.setattr(raw_launch, "_raw_stream", lambda index: 0x5000 + index)
    launch = raw_launch.launcher(Handle(), 2)
    if code == 0:
        launch()
        launch()
        assert driver.calls == [(0x7F00, 0x5002)] * 2
        return
    with pytest.raises(raw_launch.RawLaunchError, match="CUDA_ERROR_ILLEGAL_ADDRESS" if code == 700 else "999"):
        launch()
