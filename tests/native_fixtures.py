"""The compiled host loops in tests: load them (or skip where no C compiler exists), switch them, record them.

Design note "compiled pass" (runtime/proposer/front.py): ``decode_pass`` (the one pass, the restage)
and ``cache_rows`` (the ensure, the trim) each have a Python twin; the tests run both.
"""

from __future__ import annotations

import shutil
from collections import defaultdict

import pytest
from draftgraph.runtime.native import build as native_build

MODULES = ("decode_pass", "cache_rows")
# Loaded once, before any test switches them off (a switched-off module reads as None in native_build).
_BUILT = {name: native_build.load(name) for name in MODULES}


def compiled(name: str):
    """The compiled module; skips only where the machine has no C compiler at all (a failed build fails)."""
    module = _BUILT[name]
    if module is None:
        if shutil.which(native_build._compiler()[0]) is None or not native_build.is_enabled():
            pytest.skip(f"no compiled {name} here: {native_build.why_not(name)}")
        pytest.fail(f"the compiled {name} did not build: {native_build.why_not(name)}")
    return module


class Recorded:
    """A compiled module whose calls answer as it does, each answer kept by function name.

    An answer is the function's result: NotImplemented where it left the work to its Python twin.
    ``stage_rows`` given the rows to restage (its 21st argument) is kept as ``restage_rows``.
    """

    def __init__(self, module) -> None:
        self.module, self.answers = module, defaultdict(list)

    def __getattr__(self, name):
        function = getattr(self.module, name)

        def recorded(*args):
            answer = function(*args)
            is_restage = name == "stage_rows" and len(args) > 20 and args[20] is not None
            self.answers["restage_rows" if is_restage else name].append(answer)
            return answer

        return recorded


def use_compiled(monkeypatch, on: bool) -> dict[str, Recorded]:
    """Every compiled module on (recorded) or off (the Python twins); returns the recorders by module."""
    recorders = {}
    for name in MODULES:
        if on:
            recorders[name] = Recorded(compiled(name))
        monkeypatch.setitem(native_build._loaded, name, recorders.get(name))
    return recorders


def switch(monkeypatch, recorders: dict[str, Recorded], on: bool) -> None:
    """The given recorders on, or the Python twins (between proposes of twin proposers)."""
    for name in MODULES:
        monkeypatch.setitem(native_build._loaded, name, recorders[name] if on else None)
