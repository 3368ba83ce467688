"""Typed errors: every failure a user can cause has its own class.

All of them derive from :class:`DraftGraphError`, so a caller can catch the
whole family at once. Messages follow one shape: what was expected, what came,
and a hint on how to fix it (see :func:`describe`).
"""

from __future__ import annotations


class DraftGraphError(Exception):
    """Base class of every error draftgraph raises on purpose."""


class GraphError(DraftGraphError):
    """A malformed graph: cycle, undefined or doubly defined value, bad shape."""


class PlanError(DraftGraphError):
    """An arena plan that cannot be made or fails verification."""


class ExecutionError(DraftGraphError):
    """An op failed while executing; the message names the node."""


class CaptureError(DraftGraphError):
    """CUDA graph capture or replay went wrong (or a stale graph was asked for)."""


class WeightError(DraftGraphError):
    """Missing, unexpected or misshapen checkpoint tensors, or a bad config."""


class CacheError(DraftGraphError):
    """Paged-cache misuse: pool exhausted, unknown block, double free."""


class RunnerError(DraftGraphError):
    """A body runner that cannot be loaded or returned a wrong tensor."""


class InputError(DraftGraphError, ValueError):
    """Bad input at a public boundary (token, position, hidden, batch, mask)."""


class NonFiniteError(InputError):
    """A hidden given to the proposer holds a NaN or an infinity (refused; nothing was written)."""


def describe(what: str, expected: object, got: object, hint: str | None = None) -> str:
    """The one message shape: ``what: expected X, got Y (hint: ...)``."""
    text = f"{what}: expected {expected}, got {got}"
    if hint:
        text += f" (hint: {hint})"
    return text


MAX_LISTED_PROBLEMS = 8  # on an error's first line (the one line the CLI prints); all of them follow


def first_problems(problems: list[str]) -> str:
    """The first ``MAX_LISTED_PROBLEMS`` of ``problems`` on one line, and how many more: for the
    first line of an error that lists them all below it, one a line."""
    shown = "; ".join(problems[:MAX_LISTED_PROBLEMS])
    if len(problems) > MAX_LISTED_PROBLEMS:
        shown += f"; ... and {len(problems) - MAX_LISTED_PROBLEMS} more"
    return shown
