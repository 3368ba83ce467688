"""Build and load a one-file C extension of the host path, as triton builds its launchers.

Design note "flat kernel" (runtime/native/batch_kernel.py): the C beside this file is
compiled on first use with the machine's C compiler against the running Python's headers, into
a cache keyed by the source, the compiler and the interpreter, and loaded from there afterwards
(~0.3 s once, then an import). It reads and writes flat buffers only (the buffer protocol).
Where it cannot be built (no compiler, no headers, ``DRAFTGRAPH_NATIVE=0``), :func:`load`
answers None and says why in :func:`why_not`: the callers keep the numpy twin, the reference
the compiled code is tested against.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

_loaded: dict[str, ModuleType | None] = {}
_why_not: dict[str, str] = {}
FLAGS = ("-O2", "-shared", "-fPIC", "-Wall", "-Werror=implicit-function-declaration")


def is_enabled() -> bool:
    """False when ``DRAFTGRAPH_NATIVE=0`` asks for the Python loops only."""
    return os.environ.get("DRAFTGRAPH_NATIVE", "1") != "0"


def cache_dir() -> Path:
    """``DRAFTGRAPH_CACHE`` or ``~/.cache/draftgraph``, then ``native/`` (a temp dir when home is read-only)."""
    root = os.environ.get("DRAFTGRAPH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "draftgraph")
    path = Path(root) / "native"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"draftgraph-native-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def load(name: str) -> ModuleType | None:
    """The extension built from ``runtime/native/<name>.c`` (``<name>_native``), or None (see :func:`why_not`)."""
    if name not in _loaded:
        _loaded[name] = None
        if not is_enabled():
            _why_not[name] = "DRAFTGRAPH_NATIVE=0"
        else:
            try:
                _loaded[name] = _build_and_import(name)
            except (OSError, subprocess.SubprocessError, ImportError) as exc:
                _why_not[name] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
    return _loaded[name]


def why_not(name: str) -> str | None:
    """Why :func:`load` answered None for ``name`` (None when it loaded, or was not asked)."""
    return _why_not.get(name)


def _build_and_import(name: str) -> ModuleType:
    source = Path(__file__).with_name(f"{name}.c")
    text = source.read_bytes()
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise ImportError(f"no Python.h under {include} (install the Python development headers)")
    compiler = _compiler()
    key = hashlib.sha256(text + repr((compiler, FLAGS, sys.version, include)).encode()).hexdigest()[:16]
    module_name = f"{name}_native"
    target = cache_dir() / f"{module_name}-{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if not target.exists():
        # Built beside the target and renamed: processes building at once each finish whole.
        fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
        os.close(fd)
        try:
            command = [*compiler, *FLAGS, f"-I{include}", str(source), "-o", partial]
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise ImportError(f"{' '.join(compiler)} failed on {source.name}: {done.stderr}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    spec = importlib.util.spec_from_file_location(module_name, target)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {target}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
