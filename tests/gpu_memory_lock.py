"""One test marked ``gpu_heavy`` at a time on a machine, whatever the pytest workers.

A test marked ``gpu_heavy`` holds tens of GiB of GPU memory (the V4-Flash routed experts in bf16 are
13 GB, and their fp32 reference copies twice that). Under ``pytest -m cuda -n 2`` two of them at
once overflowed an 80 GB H100 (the thirty-fifth session's suite: test_flash_moe[1] and [8] out of
memory beside a worker holding 41.7 GiB), where the H200's 141 GB had hidden it. An exclusive
``flock`` on one file in the temporary folder serialises them across processes (xdist workers, or
two suites on one machine); the lock dies with its process, so a killed worker frees it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock (the GPU tests run on Linux)
    fcntl = None

_USER = os.getuid() if hasattr(os, "getuid") else 0
LOCK_PATH = os.path.join(tempfile.gettempdir(), f"draftgraph-gpu-heavy-{_USER}.lock")


@contextlib.contextmanager
def gpu_heavy_lock(path: str = LOCK_PATH):
    """Hold the machine's gpu_heavy lock for the ``with`` block (waits for another holder)."""
    if fcntl is None:
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
