"""What a checkpoint path names, looked up once: a folder, a file, or nothing.

A path that is no path at all (None, a number) is an InputError before any lookup: ``Path()``
would raise a bare TypeError from inside pathlib.

pathlib's ``exists`` / ``is_dir`` / ``is_file`` answer False for a missing path but raise OSError
for one the system cannot look up at all (a name longer than the file system allows, a folder
above it that may not be searched); a loader must turn that into its typed error, not a
traceback, and say why.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from draftgraph.runtime.errors import InputError, WeightError, describe

_NOTHING_THERE = (errno.ENOENT, errno.ENOTDIR)  # the path names nothing: a plain "not found"


def as_path(path: object, what: str, expected: str) -> Path:
    """``path`` (a str or an os.PathLike) as a Path; anything else is an InputError naming ``what``."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(describe(what, f"{expected} (a str or pathlib.Path)", type(path).__name__))
    return Path(path)


def path_kind(path: str | Path, what: str, expected: str) -> str | None:
    """``"dir"``, ``"file"`` (anything else there: a file, a pipe) or None (nothing at ``path``).
    A path the system cannot look up is a WeightError naming ``what`` and ``expected``."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno in _NOTHING_THERE:
            return None
        raise WeightError(describe(what, expected, f"{str(path)!r} ({exc.strerror or exc})")) from None
    return "dir" if stat.S_ISDIR(mode) else "file"
