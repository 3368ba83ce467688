"""Input checks at the proposer's boundary: typed errors, expected vs got, before any change.

Integers: Python ints and numpy integers are taken alike (and 0-d integer tensors, read with
one ``.item()``); a bool, a float or anything else is refused with an InputError naming it. A
batch's tokens and positions come back as one int64 array: checked with a few array ops for
the batch, and only when those find something, item by item, so that the error is the one of
the first bad item.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import numpy as np
import torch
from draftgraph.runtime.cache.hidden_rows import HiddenRows
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.proposer.sequences import SequenceRows
from draftgraph.runtime.proposer.state import MtpProposerState

PLAIN_INT_TYPES = frozenset({int, np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16, np.uint32, np.uint64})
# Up to this many ints, Python's min and max over a list test the range ~10x faster than numpy's
# reductions (~1 us of dispatch each, whatever the length), on every propose and verify.
_SMALL = 64


def as_int(value: object, what: str, expected: str) -> int:
    """``value`` as an int: an int, a numpy integer or a 0-d integer tensor; never a bool."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise InputError(describe(what, expected, repr(value), "a bool is not a count or an id"))
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() <= 1:
        value = value.reshape(()).item() if not value.is_floating_point() else value
    try:
        return operator.index(value)
    except TypeError:
        raise InputError(describe(what, expected, repr(value))) from None


def same_ints(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two int arrays of one length hold the same values: a short one's as Python lists (0.3 us
    against 1.5 for numpy's compare and reduction, on every decode step)."""
    return a.tolist() == b.tolist() if len(a) <= _SMALL else bool(np.array_equal(a, b))


def any_set(a: np.ndarray) -> bool:
    """Whether any entry of an int / bool array is non-zero (a short one's as a Python list)."""
    return any(a.tolist()) if len(a) <= _SMALL else bool(a.any())


def check_count(value: object, what: str, low: int, high: int) -> int:
    """An int in [low, high] (``as_int``'s rules)."""
    if type(value) is int and low <= value <= high:  # the usual call (K every propose): no message built
        return value
    expected = f"an int in [{low}, {high}]"
    count = as_int(value, what, expected)
    if not low <= count <= high:
        raise InputError(describe(what, expected, repr(value)))
    return count


def _closed(low: int, high: int) -> str:
    if high <= low:  # e.g. an index into a buffer of no rows
        return f"an int in [{low}, {high}) (an empty range: none is valid)"
    return f"an int in [{low}, {high - 1}]"


def check_ints(values: Sequence | np.ndarray, what: str, low: int, high: int, n: int) -> np.ndarray:
    """``n`` ints in [low, high) as int64 [n]: a sequence of ints / numpy integers, or an integer array.
    The messages name the range closed, [low, high - 1], as every other int check does; the plain
    ints' path builds one only on the way to an error (device_propose's verify calls this every step)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu" and values.ndim == 1:
        array = values.astype(np.int64, copy=False)
        items = array.tolist() if len(array) <= _SMALL else None
    elif type(values) in (list, tuple) and set(map(type, values)) <= PLAIN_INT_TYPES:
        try:
            array = np.array(values, dtype=np.int64)
        except OverflowError:  # an int past int64: out of any range taken here
            i = next(i for i, v in enumerate(values) if not -(1 << 63) <= v < (1 << 63))
            raise InputError(describe(f"{what}[{i}]" if n > 1 else what, _closed(low, high), values[i])) from None
        items = values if len(array) <= _SMALL else None
    else:
        try:
            items = list(values)
        except TypeError:
            raise InputError(describe(what, f"a sequence of {n} ints", type(values).__name__)) from None
        expected = _closed(low, high)  # once, not an item
        array = np.array([as_int(v, f"{what}[{i}]" if n > 1 else what, expected) for i, v in enumerate(items)],
                         dtype=np.int64)
        items = None
    if array.shape != (n,):
        raise InputError(describe(f"{what} length", n, len(array), "one entry per sequence"))
    if not n:
        return array
    if (min(items) < low or max(items) >= high) if items is not None else (array.min() < low or array.max() >= high):
        i = int(np.flatnonzero((array < low) | (array >= high))[0])
        raise InputError(describe(f"{what}[{i}]" if n > 1 else what, _closed(low, high), int(array[i])))
    return array


def check_state(state: object, owner: int, rows: SequenceRows, what: str = "state") -> MtpProposerState:
    if not isinstance(state, MtpProposerState):
        raise InputError(describe(what, "an MtpProposerState from alloc_state()", type(state).__name__))
    if state.owner != owner:
        raise InputError(describe(what, "a state of this proposer", "a state of another proposer"))
    if not rows.is_live(state.key):
        raise InputError(describe(what, "a live state", "a freed state", "alloc_state() a new one"))
    return state


def check_states(states: Sequence, owner: int, rows: SequenceRows, n: int) -> np.ndarray:
    """The batch's keys (sequences.py), int64 [n]: live states of this proposer, all distinct."""
    length = states_length(states)
    if length != n:
        raise InputError(describe("states length", n, length, "one entry per sequence"))
    for i, state in enumerate(states):
        check_state(state, owner, rows, f"states[{i}]" if n > 1 else "state")
    keys = np.array([s.key for s in states], dtype=np.int64)
    if n > 1 and len(set(keys.tolist())) != n:
        raise InputError(describe("states", "distinct states", "the same state twice"))
    return keys


def check_hiddens(hiddens: Sequence | torch.Tensor | HiddenRows, shape: tuple[int, ...], device: torch.device,
                  n: int) -> list[torch.Tensor] | torch.Tensor | HiddenRows:
    """The batch's hiddens: one bf16 tensor [n, *shape] on ``device`` (returned as it is), n rows of
    one such buffer (HiddenRows), or a sequence of n tensors of ``shape`` (a leading 1 accepted)."""
    if isinstance(hiddens, torch.Tensor):
        return check_hidden_batch(hiddens, shape, device, n)
    if isinstance(hiddens, HiddenRows):
        return hiddens if hidden_rows_ok(hiddens, shape, device, n) else check_hidden_rows(hiddens, shape, device, n)
    if type(hiddens) is list and len(hiddens) == n and _are_ready(hiddens, shape, device):
        return hiddens
    if sequence_length(hiddens) is None:
        raise InputError(describe("target_hiddens", f"a tensor [{n}, {', '.join(map(str, shape))}] or {n} tensors",
                                  type(hiddens).__name__))
    if len(hiddens) != n:
        raise InputError(describe("target_hiddens length", n, len(hiddens), "one entry per sequence"))
    return [check_hidden(h, shape, device, f"target_hiddens[{i}]" if n > 1 else "target_hidden")
            for i, h in enumerate(hiddens)]


def check_hidden(hidden: object, shape: tuple[int, ...], device: torch.device,
                 what: str = "target_hidden") -> torch.Tensor:
    """A bf16 tensor of ``shape`` (a leading 1 is accepted) on the proposer's device."""
    if not isinstance(hidden, torch.Tensor):
        raise InputError(describe(what, f"a bf16 tensor {list(shape)}", type(hidden).__name__))
    got = hidden.shape
    if got != shape and got != (1, *shape):
        raise InputError(describe(f"{what} shape", list(shape), list(got),
                                  "streams mode takes [C, D], collapsed mode [D]"))
    _check_bf16_on(hidden, device, what)
    return hidden if got == shape else hidden.reshape(shape)


def check_hidden_batch(hiddens: torch.Tensor, shape: tuple[int, ...], device: torch.device, n: int,
                       what: str = "target_hiddens") -> torch.Tensor:
    """A bf16 tensor of exactly ``[n, *shape]`` on the proposer's device: the batch's hiddens in one block."""
    got, want = hiddens.shape, (n, *shape)
    if got != want:
        raise InputError(describe(f"{what} shape", list(want), list(got),
                                  "one row per sequence: streams mode takes [B, C, D], collapsed mode [B, D]"))
    _check_bf16_on(hiddens, device, what)
    return hiddens


def check_hidden_rows(rows: HiddenRows, shape: tuple[int, ...], device: torch.device, n: int,
                      what: str = "target_hiddens") -> HiddenRows:
    """n rows of a bf16 buffer [R, *shape] on ``device`` whose rows are contiguous (a graph reads each
    at its address), picked by n ints in [0, R) (``check_ints``'s rules; returned as int64)."""
    tensor, index = rows.tensor, rows.index
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape[1:]) != shape:
        raise InputError(describe(f"{what} buffer", f"a tensor [R, {', '.join(map(str, shape))}]",
                                  list(getattr(tensor, "shape", [])) or type(tensor).__name__))
    _check_bf16_on(tensor, device, what)
    if tensor.stride()[1:] != row_strides(shape):
        raise InputError(describe(f"{what} buffer strides", "contiguous rows", list(tensor.stride()),
                                  "make the buffer contiguous, or pass its rows as a tensor"))
    checked = check_ints(index, f"{what} index", 0, tensor.shape[0], n)
    return rows if checked is index else HiddenRows(tensor, checked)


def hidden_rows_ok(rows: HiddenRows, shape: tuple[int, ...], device: torch.device, n: int) -> bool:
    """Whether ``rows`` passes check_hidden_rows as it is (its index an int64 array of n rows in range),
    in a few attribute reads; False sends the caller to the checks that name what is wrong."""
    tensor, index = rows.tensor, rows.index
    if type(tensor) is not torch.Tensor or tensor.dtype is not torch.bfloat16 or tensor.shape[1:] != shape:
        return False
    if type(index) is not np.ndarray or index.dtype != np.int64 or index.shape != (n,) or not is_on(tensor, device):
        return False
    if n:
        values = index.tolist() if n <= _SMALL else None  # a short list's builtin min / max: no numpy reductions
        low, high = (min(values), max(values)) if values is not None else (int(index.min()), int(index.max()))
        if not 0 <= low <= high < tensor.shape[0]:
            return False
    return tensor.stride()[1:] == row_strides(shape)


@functools.lru_cache(maxsize=16)
def row_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous row of ``shape`` (a buffer's rows must have them)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _are_ready(hiddens: list, shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether every hidden is a plain bf16 tensor of exactly ``shape`` on ``device``: the usual
    batch, in one loop of attribute reads (a serving batch's 32 rows: a few microseconds)."""
    bf16, cuda, index = torch.bfloat16, device.type == "cuda", device.index
    if not cuda and device.type != "cpu":
        return False  # the item-by-item checks handle other devices
    if cuda and _one_cuda_device():
        index = None  # every CUDA tensor is on it: no get_device() a row (~2 us of a 32-row batch's checks)
    for hidden in hiddens:
        if type(hidden) is not torch.Tensor or hidden.dtype is not bf16 or hidden.shape != shape:
            return False
        if cuda:
            if not hidden.is_cuda or (index is not None and hidden.get_device() != index):
                return False
        elif not hidden.is_cpu:
            return False
    return True


@functools.cache
def _one_cuda_device() -> bool:
    """Whether this process sees one CUDA device (fixed once CUDA is up: CUDA_VISIBLE_DEVICES is read then)."""
    return torch.cuda.device_count() == 1


def _check_bf16_on(hidden: torch.Tensor, device: torch.device, what: str) -> None:
    if hidden.dtype != torch.bfloat16:
        raise InputError(describe(f"{what} dtype", torch.bfloat16, hidden.dtype))
    if not is_on(hidden, device):
        raise InputError(describe(f"{what} device", device, hidden.device))


def is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is on ``device``: ``is_cpu`` / ``is_cuda`` and ``get_device()`` take ~0.05 us
    where ``tensor.device`` builds an object (~0.4 us on the lent hosts), per row on every propose."""
    kind, index = device.type, device.index
    if kind == "cuda":
        return tensor.is_cuda and (index is None or tensor.get_device() == index)
    if kind == "cpu":
        return tensor.is_cpu
    on = tensor.device
    return on.type == kind and (index is None or on.index == index)


def check_bitmask(mask: object, words: int) -> torch.Tensor | None:
    if mask is None:
        return None
    try:
        tensor = torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(describe("grammar_bitmask", f"{words} int32 words", type(mask).__name__)) from None
    if tensor.dim() != 1 or tensor.numel() != words:
        raise InputError(describe("grammar_bitmask length", f"{words} int32 words (ceil(vocab / 32))",
                                  list(tensor.shape)))
    if tensor.dtype not in (torch.int32, torch.int64):
        raise InputError(describe("grammar_bitmask dtype", "int32 words", tensor.dtype))
    return tensor.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32) if tensor.dtype == torch.int64 else tensor


def sequence_length(items: object) -> int | None:
    """``len(items)`` of a sequence the API takes; None for a str or bytes and for what has no length
    (a number, one state; a 0-d tensor or array, whose ``__len__`` raises)."""
    if isinstance(items, (str, bytes, MtpProposerState)):
        return None
    try:
        return len(items)
    except TypeError:
        return None


def states_length(states: object) -> int:
    """The number of states of a batch call; anything but a sequence of them is an InputError."""
    n = sequence_length(states)
    if n is None:
        raise InputError(describe("states", "a sequence of states", type(states).__name__))
    return n


def known_buckets(what: str, buckets: object, allowed: Sequence[int], owner: str) -> list[int]:
    """``buckets`` as distinct ints, largest first, each one of ``allowed`` (the ``owner``'s); else an InputError."""
    expected = f"buckets of the {owner} {tuple(allowed)}"
    if sequence_length(buckets) is None:
        raise InputError(describe(what, f"a sequence of {expected}", type(buckets).__name__))
    sizes = {as_int(b, what, expected) for b in buckets}
    unknown = sorted(sizes - set(allowed))
    if unknown:
        raise InputError(describe(what, expected, unknown))
    return sorted(sizes, reverse=True)


def check_batch(name: str, items: object, n: int) -> None:
    length = sequence_length(items)
    if length is None:
        raise InputError(describe(name, f"a sequence of {n}" if n >= 0 else "a sequence", type(items).__name__))
    if length != n:
        raise InputError(describe(f"{name} length", n, length, "one entry per sequence"))
