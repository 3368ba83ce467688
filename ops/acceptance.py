"""Greedy acceptance of K drafts on the device: the two ends of a decode loop's verify run.

A device verify (runtime/decode/device_verify.py) runs the target over S sequences of W = K + 1
rows each, [t, d_1 .. d_K] sequence-major, around two steps written here:

    clamp_drafts    the verify input's draft columns: token[s * W + 1 + j] = clamp(drafts[s, j], 0, V - 1)
                    (a chain that dropped its batch marks every draft NONFINITE < 0: still a token id)
    accept_drafts   g = the target's argmax as [S, W]; a_s = the longest prefix where drafts[s] == g[s]
                    (gpt-fast's rule); verdict[s] = [a, dropped, bad, g_0 .. g_K], where dropped says
                    some draft < 0 and bad a NaN or an infinity in a hidden the catch-up reads: pair
                    rows 0 .. a, with pair[s, 0] = next_hidden[s] (h_p, the hidden the propose read)
                    and pair[s, 1 + r] = the verify's row r (row 1 + a: the bonus token's position's
                    hidden, the next propose's).

These are the torch reference (the CPU path, and the test oracle); ops/triton/acceptance.py does
each in one kernel (the torch ops are two and about twenty launches: each a node of the captured
verify graph).
"""

from __future__ import annotations

import torch
from draftgraph.ops.nonfinite import finite_rows

ACCEPTED, DROPPED, NONFINITE_HIDDEN, TOKENS = 0, 1, 2, 3  # verdict columns; TOKENS.. are g_0 .. g_K


def clamp_drafts(drafts: torch.Tensor, tokens: torch.Tensor, top: int) -> None:
    """tokens[s * W + 1 + j] = clamp(drafts[s, j], 0, top) for drafts int64 [S, K], tokens int64 [>= S * W]."""
    s, k = drafts.shape
    tokens[: s * (k + 1)].view(s, k + 1)[:, 1:].copy_(drafts.clamp(0, top))


def accept_drafts(drafts: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, next_hidden: torch.Tensor,
                  pair: torch.Tensor, verdict: torch.Tensor) -> None:
    """The verdict and pair rows of S sequences (see the module docstring).

    drafts int64 [S, K]; tokens int64 [>= S * W] (the argmax of each verify row); hidden [>= S * W, ...]
    (each row's hidden); next_hidden [S, ...]; out: pair [S, W + 1, ...], verdict int64 [S, 3 + W].
    """
    s, k = drafts.shape
    w = k + 1
    g = tokens[: s * w].view(s, w)
    run = torch.cumprod((drafts == g[:, :k]).to(torch.int64), 1)  # run[s, j] = 1 iff drafts 0..j all match
    accepted = run.sum(1)
    pair[:, 0].copy_(next_hidden)
    pair[:, 1:].copy_(hidden[: s * w].reshape(s, w, *hidden.shape[1:]))
    finite = finite_rows(pair[:, :w].reshape(s * w, -1)).view(s, w)  # pair rows 0 .. K
    verdict[:, ACCEPTED].copy_(accepted)
    verdict[:, DROPPED].copy_((drafts < 0).any(1))
    verdict[:, NONFINITE_HIDDEN].copy_(~finite[:, 0] | ((~finite[:, 1:]) & run.bool()).any(1))
    verdict[:, TOKENS:].copy_(g)
