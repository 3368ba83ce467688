"""Input checks at the proposer's boundary: typed errors, expected vs got, before any change."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.proposer.state import MtpProposerState

# Design note "bulk checks": a batch is checked in one inline loop per kind of input, which
# proves the usual batch good as a whole; a call of the single-item check per item costs
# ~0.2 us more an item (~6 us at B = 32 for each kind). A loop with plain attribute loads is
# also cheaper than passes of map / attrgetter: the interpreter specializes the loads. Only when
# the loop finds something does the batch go item by item through the single-item checks, so
# the error (type and message) is the one of the first bad item, as it always was.


def check_token(token: object, vocab: int, what: str = "last_token") -> int:
    if isinstance(token, torch.Tensor) and token.numel() == 1:
        token = int(token.item())
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
        raise InputError(describe(what, f"an int token id in [0, {vocab})", repr(token)))
    return token


def check_tokens(tokens: Sequence, vocab: int) -> list[int]:
    """``check_token`` of every token (design note "bulk checks")."""
    for token in tokens:
        if type(token) is not int or not 0 <= token < vocab:  # a bool, a tensor: item by item
            return [check_token(t, vocab) for t in tokens]
    return list(tokens)


def check_position(position: object, num_drafts: int, state: MtpProposerState, what: str = "position") -> int:
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise InputError(describe(what, "an int >= 0", repr(position)))
    if position + num_drafts > state.max_positions:
        raise InputError(
            describe(what, f"position + num_drafts <= {state.max_positions}", f"{position} + {num_drafts}",
                     "the sequence's budget (alloc_state_for) or max_seq_len is reached")
        )
    return position


def check_positions(positions: Sequence, num_drafts: int, states: Sequence[MtpProposerState]) -> list[int]:
    """``check_position`` of every position against its (checked) state (design note "bulk checks")."""
    for position, state in zip(positions, states):
        if type(position) is not int or position < 0 or position + num_drafts > state.max_positions:
            return [check_position(p, num_drafts, s) for p, s in zip(positions, states)]
    return list(positions)


def check_num_drafts(num_drafts: object, max_drafts: int) -> int:
    if not isinstance(num_drafts, int) or isinstance(num_drafts, bool) or not 1 <= num_drafts <= max_drafts:
        raise InputError(describe("num_drafts", f"an int in [1, {max_drafts}]", repr(num_drafts)))
    return num_drafts


def check_hidden(hidden: object, shape: tuple[int, ...], device: torch.device, what: str = "target_hidden"):
    """A bf16 tensor of ``shape`` (a leading 1 is accepted) on the proposer's device."""
    if not isinstance(hidden, torch.Tensor):
        raise InputError(describe(what, f"a bf16 tensor {list(shape)}", type(hidden).__name__))
    got = hidden.shape
    if got != shape and got != (1, *shape):
        raise InputError(describe(f"{what} shape", list(shape), list(got),
                                  "streams mode takes [C, D], collapsed mode [D]"))
    _check_bf16_on(hidden, device, what)
    return hidden if got == shape else hidden.reshape(shape)  # a reshape is a dispatch (~1 us): only if needed


def _check_bf16_on(hidden: torch.Tensor, device: torch.device, what: str) -> None:
    if hidden.dtype != torch.bfloat16:
        raise InputError(describe(f"{what} dtype", torch.bfloat16, hidden.dtype))
    if not _is_on(hidden, device):
        raise InputError(describe(f"{what} device", device, hidden.device))


def check_hiddens(hiddens: Sequence | torch.Tensor, shape: tuple[int, ...], device: torch.device,
                  n: int | None = None) -> list[torch.Tensor] | torch.Tensor:
    """``check_hidden`` of every hidden (design note "bulk checks"), or one check of a batched tensor.

    A tensor must be exactly ``[n, *shape]`` (no leading 1 per row): one bf16 block on ``device``,
    returned as it is. ``n`` is the batch (a tensor's leading size when None).
    """
    if isinstance(hiddens, torch.Tensor):  # one check for the batch, not one per row
        if n is None:
            n = hiddens.shape[0] if hiddens.dim() else 1
        return check_hidden_batch(hiddens, shape, device, n)
    if _are_ready(hiddens, shape, device):
        return list(hiddens)
    return [check_hidden(h, shape, device) for h in hiddens]


def check_hidden_batch(hiddens: torch.Tensor, shape: tuple[int, ...], device: torch.device, n: int,
                       what: str = "target_hiddens") -> torch.Tensor:
    """A bf16 tensor of exactly ``[n, *shape]`` on the proposer's device: the batch's hiddens in one block."""
    got, want = hiddens.shape, (n, *shape)
    if got != want:
        raise InputError(describe(f"{what} shape", list(want), list(got),
                                  "one row per sequence: streams mode takes [B, C, D], collapsed mode [B, D]"))
    _check_bf16_on(hiddens, device, what)
    return hiddens


def _are_ready(hiddens: Sequence, shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether every hidden is a plain bf16 tensor of exactly ``shape`` on ``device`` (check_hidden's no-op)."""
    kind, index = _device_key(device)
    if kind not in ("cpu", "cuda"):
        return False
    tensor, bf16, on_cpu = torch.Tensor, torch.bfloat16, kind == "cpu"
    for hidden in hiddens:  # a subclass, a [1, ...] shape: item by item
        if (type(hidden) is not tensor or hidden.shape != shape or hidden.dtype is not bf16 or not (
                hidden.is_cpu if on_cpu else hidden.is_cuda and (index is None or hidden.get_device() == index))):
            return False
    return True


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is on ``device`` (any CUDA device for a bare "cuda").

    Per sequence on every propose: ``is_cuda`` / ``get_device()`` take ~0.05 us where
    ``tensor.device.type`` builds a string (~0.4 us on these hosts).
    """
    kind, index = _device_key(device)
    if kind == "cuda":
        return tensor.is_cuda and (index is None or tensor.get_device() == index)
    if kind == "cpu":
        return tensor.is_cpu
    on = tensor.device
    return on.type == device.type and (device.index is None or on == device)


@functools.cache
def _device_key(device: torch.device) -> tuple[str, int | None]:
    return device.type, device.index


def check_bitmask(mask: object, words: int) -> torch.Tensor | None:
    if mask is None:
        return None
    tensor = torch.as_tensor(mask)
    if tensor.dim() != 1 or tensor.numel() != words:
        raise InputError(describe("grammar_bitmask length", f"{words} int32 words (ceil(vocab / 32))",
                                  list(tensor.shape)))
    if tensor.dtype not in (torch.int32, torch.int64):
        raise InputError(describe("grammar_bitmask dtype", "int32 words", tensor.dtype))
    return tensor.to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32) if tensor.dtype == torch.int64 else tensor


def check_state(state: object, owner: int) -> MtpProposerState:
    if not isinstance(state, MtpProposerState):
        raise InputError(describe("state", "an MtpProposerState from alloc_state()", type(state).__name__))
    if state.owner != owner:
        raise InputError(describe("state", "a state of this proposer", "a state of another proposer"))
    if state.is_freed:
        raise InputError(describe("state", "a live state", "a freed state", "alloc_state() a new one"))
    return state


def check_states(states: Sequence, owner: int) -> list[MtpProposerState]:
    """``check_state`` of every state (design note "bulk checks")."""
    for state in states:
        if type(state) is not MtpProposerState or state.owner != owner or state.is_freed:
            return [check_state(s, owner) for s in states]
    return list(states)


def check_batch(name: str, items: Sequence, n: int) -> None:
    if len(items) != n:
        raise InputError(describe(f"{name} length", n, len(items), "one entry per sequence"))
