"""The gpu_heavy lock (gpu_memory_lock.py) serialises holders across processes and dies with its holder."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_memory_lock import LOCK_PATH, fcntl, gpu_heavy_lock

pytestmark = pytest.mark.skipif(fcntl is None, reason="flock is POSIX")

HOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
from gpu_memory_lock import gpu_heavy_lock
with gpu_heavy_lock({path!r}):
    print("held", flush=True)
    time.sleep({hold})
"""


def _holder(tmp_path: Path, hold: float) -> subprocess.Popen:
    code = HOLDER.format(tests=str(Path(__file__).parent), path=str(tmp_path / "lock"), hold=hold)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_waits_for_the_first(tmp_path):
    proc = _holder(tmp_path, hold=1.5)
    start = time.perf_counter()
    with gpu_heavy_lock(str(tmp_path / "lock")):
        waited = time.perf_counter() - start
    assert waited > 1.0, f"the lock was taken after {waited:.2f} s, while the other process held it 1.5 s"
    assert proc.wait(timeout=10) == 0


def test_a_killed_holder_frees_the_lock(tmp_path):
    proc = _holder(tmp_path, hold=60)
    proc.kill()
    proc.wait(timeout=10)
    start = time.perf_counter()
    with gpu_heavy_lock(str(tmp_path / "lock")):
        assert time.perf_counter() - start < 5


@pytest.mark.gpu_heavy
def test_a_heavy_test_runs_holding_the_machine_lock():
    """conftest's autouse fixture took the lock before this body: another process cannot take it now."""
    code = "import fcntl, sys; f = open(sys.argv[1], 'a+b'); fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)"
    probe = subprocess.run([sys.executable, "-c", code, LOCK_PATH], capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "BlockingIOError" in probe.stderr, probe.stderr


def test_heavy_markers_are_registered(pytestconfig):
    assert any(line.startswith("gpu_heavy:") for line in pytestconfig.getini("markers"))
