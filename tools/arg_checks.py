"""Checks the tools run on their arguments before any long work: each bad value is one UsageError.

A bad flag must not surface as a traceback after the run it spoiled (a missing ``--out`` folder
after planning, ``--num-drafts 1000`` after minutes of drafting): the tools call these first,
and the command line prints the error as one line, ``--flag: expected X, got Y (hint: ...)``,
with exit code 2.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from draftgraph.runtime.errors import describe
from draftgraph.tools.cli import UsageError


def check_at_least(flag: str, value: int, minimum: int, hint: str | None = None) -> None:
    """``value >= minimum``, else UsageError naming ``flag``."""
    if value < minimum:
        raise UsageError(describe(flag, f">= {minimum}", value, hint))


def check_num_drafts(value: int, flag: str = "--num-drafts") -> None:
    """1 <= K <= the proposer's cap (``ProposerOptions.max_num_drafts``, read, not copied)."""
    from draftgraph.runtime.proposer.proposer import ProposerOptions

    cap = ProposerOptions().max_num_drafts
    if not 1 <= value <= cap:
        raise UsageError(describe(flag, f"1..{cap} drafts", value, f"the proposer drafts at most {cap} per call"))


def check_batch(value: int, flag: str = "--batch") -> None:
    """1 <= B <= the largest batch a proposer runs by default (its last bucket: ``propose_batch_max``).

    The graph tools plan and show the chain at B; a B no proposer runs (``--batch 100000``) would
    plan an arena for nothing, or, for capture-dump, capture a graph no propose replays.
    """
    from draftgraph.runtime.proposer.options import DEFAULT_BUCKETS

    cap = max(DEFAULT_BUCKETS)
    if not 1 <= value <= cap:
        raise UsageError(describe(flag, f"1..{cap}", value, f"a proposer runs at most {cap} rows a call "
                                                           "(ProposerOptions.buckets)"))


def check_seconds(flag: str, value: float) -> None:
    """A finite number of seconds > 0 (``nan`` and ``inf`` parse as floats, but bound nothing)."""
    if not (math.isfinite(value) and value > 0):
        raise UsageError(describe(flag, "a finite number of seconds > 0", value))


def picture_format(flag: str, path: Path) -> str:
    """``"svg"`` or ``"png"``, from ``path``'s suffix: the pictures the tools draw; any other is a UsageError."""
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in ("svg", "png"):
        raise UsageError(describe(flag, "a .svg or .png file", repr(str(path)), "name the picture .png or .svg"))
    return suffix


def check_output_file(flag: str, path: str | Path | None) -> None:
    """``path`` can be written: not a folder, and its folder exists and is writable. None passes."""
    if path is None:
        return
    path = Path(path)
    with lookup_errors(flag, "a file to write", path):
        if path.is_dir():
            raise UsageError(describe(flag, "a file to write", f"the folder {str(path)!r}", "name a file in it"))
    check_output_folder(flag, path.parent, what="a file in an existing, writable folder", shown=path)


def check_output_folder(
    flag: str, folder: Path, what: str = "a writable folder", shown: Path | None = None, create: bool = False
) -> None:
    """``folder`` exists and is writable; with ``create``, its nearest existing ancestor instead
    (the tool makes the rest)."""
    shown = folder if shown is None else shown
    folder = folder if str(folder) else Path(".")
    with lookup_errors(flag, what, shown):
        if create:
            while not folder.exists() and folder != folder.parent:
                folder = folder.parent
        if not folder.exists():
            raise UsageError(describe(flag, what, f"{str(shown)!r} ({folder} does not exist)", "create it first"))
        if not folder.is_dir():
            raise UsageError(describe(flag, what, f"{str(shown)!r} ({folder} is a file)"))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(describe(flag, what, f"{str(shown)!r} ({folder} is not writable)"))


@contextlib.contextmanager
def lookup_errors(flag: str, what: str, shown: Path):
    """A path the OS cannot even look up (a name longer than the file system allows): pathlib's
    ``exists`` / ``is_dir`` raise OSError there instead of returning False; one UsageError instead."""
    try:
        yield
    except OSError as exc:
        raise UsageError(describe(flag, what, f"{str(shown)!r} ({exc.strerror or exc})")) from None


def check_runner(spec: str) -> None:
    """The runner loads (``load_runner``, the proposer's own loader); a RunnerError otherwise."""
    from draftgraph.runtime.proposer.runners.base import load_runner

    load_runner(spec)
