"""One repeated piece of the Triton interpreter's work done once a launch, for the CPU tests.

Under ``TRITON_INTERPRET=1`` every call of a ``@triton.jit`` helper from a kernel
(``InterpretedFunction.__call__``) re-patches the language modules its globals name
(``_patch_lang``: ``inspect.getmembers`` over ``triton.language``, its ``tensor`` and ``math``),
though the launch (``GridExecutor.__call__``) patched them already, and a helper's patches are
never restored (Triton drops that scope), so a module once patched stays patched for the rest of
the launch. Skipping a helper's patching when every module it names has been patched in this
launch changes nothing the kernels compute: the same patched functions are in place. It took a
third of the time of the interpreter's MoE tests (cProfile: 66 of 189 s in ``_patch_builtin`` for
``test_moe_workspace_rule_covers_the_mxfp4_scratch[3-True]``, which ran in 62 s before and 33 s
after on a CI core).

Triton internals: where they are not as expected, nothing is installed and the tests run as
before, only slower. While launches run on two threads at once, one's end restores the modules
under the other, so nothing is skipped then: every helper patches, as without this module.
"""

from __future__ import annotations

import inspect
import threading


def skip_repeated_lang_patching() -> bool:
    """Install the skip; False (and nothing changed) where this Triton's interpreter differs."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid = getattr(interpreter, "GridExecutor", None)
    empty_scope = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or grid is None or empty_scope is None or getattr(patch_lang, "skips_repeats", False):
        return False
    launch = grid.__call__
    local = threading.local()  # the launches running on this thread: the modules each has patched
    # running: launches on any thread; epoch: bumped when one ends beside another (its restore may
    # have undone what the other's helpers patched): what a launch noted before then counts no more.
    shared = {"running": 0, "epoch": 0}
    count_lock = threading.Lock()

    def langs_of(fn) -> frozenset[int]:
        # the modules _patch_lang patches for fn: triton.language and triton.language.core
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_once(fn):
        stack = getattr(local, "stack", None)
        if stack and shared["running"] == 1:
            epoch, patched = stack[-1]
            langs = langs_of(fn)
            if epoch == shared["epoch"] and langs <= patched:
                return empty_scope()
            stack[-1] = (shared["epoch"], (patched if epoch == shared["epoch"] else frozenset()) | langs)
        return patch_lang(fn)

    def launch_tracked(self, *args, **kwargs):
        stack = local.__dict__.setdefault("stack", [])
        stack.append((-1, frozenset()))  # nothing noted: the launch's own _patch_lang call comes first
        with count_lock:
            shared["running"] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            with count_lock:
                shared["running"] -= 1
                if shared["running"]:
                    shared["epoch"] += 1
            stack.pop()

    patch_once.skips_repeats = True
    interpreter._patch_lang = patch_once
    grid.__call__ = launch_tracked
    return True
