"""The speculative decode loop: MTP drafts, one target forward verifies them, greedy acceptance.

One round for every live sequence (positions as in proposer.py: the drafter row
of position p comes from the pair (t_{p+1}, h_p))::

    p, t, h      the sequence: target length p + 1, t = t_{p+1} (the newest token, not yet
                 seen by the target), h = the target's hidden at p
    propose      d_1..d_K = proposer.propose(t, h, p, K)       (propose_batch for several)
    verify       the target runs [t, d_1..d_K] at positions p+1 .. p+K+1: ONE forward for
                 every live sequence; g_j = its argmax after the j-th of those tokens
    accept       a = longest prefix with d_{j+1} == g_j; bonus = g_a  (accept_greedy)
    emit         d_1..d_a, bonus (cut at EOS / max_new_tokens)
    roll back    target.truncate(p + a + 2): the rows of t, d_1..d_a stay, the rest go;
                 proposer.after_verify(a)
    catch up     drafter rows p .. p+a from [t, d_1..d_a] x [h_p, h_{p+1}..h_{p+a}]
                 (the device loop writes them in the next propose's first step)
    next         p' = p + a + 1, t' = bonus, h' = the target's hidden at p'

Every emitted token is the target's own argmax given only accepted (true)
tokens, so the output equals plain greedy decoding token for token whatever
the drafter proposes: a bad drafter costs speed, never correctness. (Bit
equality also needs the target's numerics not to depend on how many rows a run
has: CPU and GPU GEMMs pick kernels by row count, so exact-equality checks pin
the target to one row bucket; see TargetModel's ``buckets``.)

Every path out of a sequence (EOS, max tokens, cancel, an exception anywhere in
a step) frees its target and proposer states, so both block pools end exact.

Two ways to run a round (``device_loop``; both give the same tokens):

- the device loop (the default where it can run: an ungated chain, every live batch in one
  verify run): ``propose_device`` leaves the drafts on the device, the target's verify graph
  takes them from there and accepts on the device (decode/device_verify.py), and the host
  reads back ONE small tensor per step, [a, dropped, non-finite, g_0..g_K] per sequence;
  the proposer commits its rows in ``after_verify_device`` from it; the catch-up rows a step
  owes ride in the next step's propose (``propose_device(..., catchup=)``: the chain's first
  step runs over them and the new row together, design note "catch-up in the first step" in
  proposer/device_propose.py), so a step runs the chain and the verify, not a third graph;
- the host path: ``propose`` / ``propose_batch`` read the drafts back, ``verify`` reads the
  target's argmax back, ``accept_greedy`` accepts on the host.

Warm-up (design note "warm-up apart", decode/warmup.py): before its first step a session
builds, captures and compiles every executor any of its steps can use, timed on its own
(``stats.warmup_seconds``); the figures of the stats are steady state.

Example
-------
>>> result = speculative_decode(target, proposer, [[256, 104, 105]], 16, 3)   # doctest: +SKIP
>>> result.tokens[0], result.stats.mean_accepted_length                       # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from draftgraph.graphs.draft_chain import is_gated
from draftgraph.ops.acceptance import ACCEPTED, DROPPED, NONFINITE_HIDDEN, TOKENS
from draftgraph.runtime.cache.hidden_rows import HiddenRows
from draftgraph.runtime.decode import warmup as warmups
from draftgraph.runtime.decode.stats import DecodeProgress, DecodeStats
from draftgraph.runtime.decode.target import TargetModel
from draftgraph.runtime.errors import InputError, NonFiniteError, describe
from draftgraph.runtime.proposer.checks import check_ints, sequence_length
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

LIVE, EOS, LENGTH, CANCELLED, FAILED = "live", "eos", "length", "cancelled", "error"


def accept_greedy(drafts: Sequence[int], target_tokens: Sequence[int]) -> tuple[int, int]:
    """Greedy verification: (number of drafts accepted, the bonus token).

    ``target_tokens[j]`` is the target's argmax after the j-th token of the verify window
    (the last token, then d_1..d_K), so draft d_{j+1} is right iff it equals
    ``target_tokens[j]``; the first mismatch (or the end) gives the bonus ``target_tokens[a]``.

    >>> accept_greedy([5, 7, 9], [5, 7, 2, 4])
    (2, 2)
    """
    try:
        k, n = len(drafts), len(target_tokens)
    except TypeError:
        raise InputError(describe("accept_greedy", "two sequences of token ids (drafts, target tokens)",
                                  f"{type(drafts).__name__} and {type(target_tokens).__name__}")) from None
    if n != k + 1:  # the verify window: the last token, then each draft; one argmax after each
        raise InputError(describe("target_tokens length", f"{k + 1} (one per draft, then the bonus)", n,
                                  "the target's argmax after the last token and after each draft"))
    a = 0
    while a < k and drafts[a] == target_tokens[a]:
        a += 1
    return a, target_tokens[a]


@dataclass
class DecodeResult:
    """Generated tokens per sequence (prompt excluded; EOS included when hit), why each ended, stats."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: DecodeStats


@dataclass
class StepEvent:
    """What one ``step()`` did: the tokens each sequence emitted and its accepted drafts (by index)."""

    step: int
    new_tokens: dict[int, list[int]] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)


@dataclass
class _Sequence:
    index: int
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    status: str = LIVE
    target_state: object = None
    draft_state: object = None
    position: int = 0  # p: the target holds positions 0..p
    token: int = 0  # t_{p+1}: the newest token, the next one the target sees
    hidden: torch.Tensor | None = None  # the target's hidden at p


class DecodeSession:
    """A resumable speculative decode over several prompts: ``step()`` until it returns False.

    The first ``step()`` prefills (target over every prompt in one forward, then the drafter
    rows) and emits each sequence's first token; every later one is a propose / verify /
    accept / catch-up round over the live sequences. ``cancel(i)`` ends sequence i at once.
    Use it as a context manager (or call ``close()``): whatever happens, the target's and the
    proposer's states are freed.

    Example
    -------
    >>> with DecodeSession(target, proposer, prompts, 32, 3) as session:     # doctest: +SKIP
    ...     while session.step():
    ...         session.cancel(0)
    ...     result = session.result()
    """

    def __init__(
        self,
        target,
        proposer,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        num_drafts: int,
        eos_id: int | None = None,
        on_step: Callable[[DecodeSession, StepEvent], None] | None = None,
        progress: bool | None = False,
        *,
        warmup: bool = True,
        device_loop: bool | None = None,
        sync_phases: bool = False,
    ) -> None:
        prompts = _check_request(target, prompts, max_new_tokens, eos_id)
        if not isinstance(proposer, DeepseekV4MtpProposer):
            raise InputError(describe("proposer", "a DeepseekV4MtpProposer", type(proposer).__name__))
        if not isinstance(num_drafts, int) or isinstance(num_drafts, bool) or num_drafts < 1:
            raise InputError(describe("num_drafts", "an int >= 1", repr(num_drafts)))
        if on_step is not None and not callable(on_step):
            raise InputError(describe("on_step", "None or a callable on_step(session, event)", type(on_step).__name__))
        if proposer.options.mode != target.mode:
            raise InputError(
                describe(
                    "proposer mode",
                    f"the target's {target.mode!r}",
                    repr(proposer.options.mode),
                    "the MTP reads the hidden the target gives",
                )
            )
        if (
            proposer.config.hidden_size != target.config.hidden_size
            or proposer.config.vocab_size != target.config.vocab_size
        ):
            raise InputError(
                describe(
                    "proposer config",
                    "the target's hidden_size and vocab_size",
                    f"{proposer.config.hidden_size}, {proposer.config.vocab_size}",
                )
            )
        budget = max(len(p) for p in prompts) + max_new_tokens + num_drafts + 1
        limit = min(target.max_seq_len, proposer.max_seq_len)
        if budget > limit:
            raise InputError(
                describe("prompt + max_new_tokens + num_drafts + 1", f"<= {limit} (max_seq_len)", budget)
            )
        why_not = _device_loop_refusal(target, proposer, len(prompts), num_drafts)
        if device_loop and why_not:
            raise InputError(describe("device_loop", "a session the device loop can run", why_not,
                                      "device_loop=None picks the host path there"))
        self.device_loop = why_not is None if device_loop is None else bool(device_loop)
        self.warmup, self.sync_phases, self.is_warm = warmup, sync_phases, False
        self.target, self.proposer = target, proposer
        self.max_new_tokens, self.num_drafts = max_new_tokens, num_drafts
        self.eos_id, self.on_step = eos_id, on_step
        self.sequences = [_Sequence(i, p) for i, p in enumerate(prompts)]
        self.stats = DecodeStats(num_drafts=num_drafts, num_sequences=len(prompts))
        self.progress = DecodeProgress(len(prompts) * max_new_tokens, progress, desc=f"decode K={num_drafts}")
        self.num_steps_run = 0
        self.is_closed = False
        self._verifier = target.device_verifier(num_drafts) if self.device_loop else None
        self._slots: list[int] = []  # sequence index of each row of the verifier's next_hidden
        # Design note "rows by index": after a verify, each live sequence's next hidden and its
        # catch-up rows are rows of the verifier's pair_hidden (flattened: ``_rows``); the next
        # propose reads them there by index (cache/hidden_rows.py), no gather before its launch.
        # sequence index -> (catch-up tokens, the first catch-up row in _rows, first position)
        self._owed: dict[int, tuple[list[int], int, int]] = {}
        self._next_rows: dict[int, int] = {}  # sequence index -> the row of its next hidden in _rows
        self._rows = self._verifier.pair_hidden.flatten(0, 1) if self.device_loop else None
        self._pair_rows = self._rows  # the verifier's pair rows as one [S (K + 2), ...] view, made once
        self._saved_hidden: torch.Tensor | None = None  # next_hidden's rows, while another session holds the buffers
        # The device loop's target roll-backs (state, accepted length), done right after the next
        # propose's launch: the GPU runs while the host gives the rejected rows' blocks back.
        self._rollbacks: list[tuple[object, int]] = []
        if max_new_tokens == 0:
            for seq in self.sequences:
                seq.status = LENGTH

    # ---- the loop ------------------------------------------------------------------------------
    @property
    def live(self) -> list[_Sequence]:
        return [s for s in self.sequences if s.status == LIVE]

    def warm_up(self) -> float:
        """Build, capture and compile every executor this session's steps can use; its seconds.

        The first ``step()`` calls it (unless ``warmup=False``); a second call does nothing.
        ``warmups.build_counts()`` after it stays put for the rest of the decode.
        """
        if self.is_warm or self.is_closed:
            return 0.0
        started = time.perf_counter()
        plan = warmups.plan_warmup(self.target, self.proposer, [len(s.prompt) for s in self.sequences],
                                   self.num_drafts, self.device_loop)
        try:
            warmups.warm_up(self.target, self.proposer, plan, self.num_drafts)
        except BaseException:
            self._abort()
            raise
        self._sync()
        self.is_warm = True
        self.stats.warmup_seconds += time.perf_counter() - started
        return self.stats.warmup_seconds

    def step(self) -> bool:
        """Prefill (first call) or run one round; True while some sequence is still live."""
        if self.is_closed or not self.live:
            self.close()
            return False
        if self.warmup and not self.is_warm:
            self.warm_up()
        full_batch = self.num_steps_run > 0 and len(self.live) == len(self.sequences)
        started = time.perf_counter()
        event = StepEvent(self.num_steps_run)
        try:
            if self.num_steps_run == 0:
                self._prefill(event)
            else:
                self._round(event)
        except BaseException:
            self._abort()
            raise
        finally:
            elapsed = time.perf_counter() - started
            self.stats.total_seconds += elapsed
        self.num_steps_run += 1
        generated = sum(len(t) for t in event.new_tokens.values())
        if full_batch:
            self.stats.full_batch_generated += generated
            self.stats.full_batch_seconds += elapsed
        self.progress.update(generated, self.stats)
        if self.on_step is not None:
            try:
                self.on_step(self, event)
            except BaseException:
                self._abort()
                raise
        if not self.live:
            self.close()
            return False
        return True

    def run(self) -> DecodeResult:
        """Step until every sequence has finished; returns the result."""
        try:
            while self.step():
                pass
        finally:
            self.close()
        return self.result()

    def _prefill(self, event: StepEvent) -> None:
        start = time.perf_counter()
        live = self.live
        budget = max(len(s.prompt) for s in live) + self.max_new_tokens + self.num_drafts + 1
        for seq in live:
            seq.target_state = self.target.alloc_state(budget)
            seq.draft_state = self.proposer.alloc_state_for(budget)
        outs = self.target.forward(
            [s.target_state for s in live], [s.prompt for s in live], [0] * len(live), final=True
        )
        drafting = []
        for seq, out in zip(live, outs):
            seq.position, seq.token, seq.hidden = len(seq.prompt) - 1, out.tokens[-1], out.hiddens[-1]
            event.new_tokens[seq.index] = self._emit(seq, [out.tokens[-1]])
            if seq.status == LIVE:
                drafting.append((seq, out.hiddens))
            else:
                self._release(seq)
        if drafting:  # prefill_drafter for every sequence, in one run: rows i from (prompt[i+1], h_i)
            self.proposer.catchup_batch(
                [s.prompt[1:] for s, _ in drafting],
                [h[:-1] for _, h in drafting],
                [0] * len(drafting),
                [s.draft_state for s, _ in drafting],
            )
            if self.device_loop:  # the first propose reads its hiddens from the verifier's rows
                self._claim_verifier()
                self._verifier.next_hidden[: len(drafting)].copy_(torch.stack([h[-1] for _, h in drafting]))
                self._slots = [s.index for s, _ in drafting]
        self._sync()
        self.stats.prefill_seconds += time.perf_counter() - start

    def _round(self, event: StepEvent) -> None:
        if self.device_loop:
            self._round_on_device(event)
            return
        live = self.live
        t0 = time.perf_counter()
        drafts = self._propose(live)
        t1 = time.perf_counter()
        outs = self.target.verify(
            [s.target_state for s in live],
            [[s.token, *d] for s, d in zip(live, drafts)],
            [s.target_state.length for s in live],
        )
        t2 = time.perf_counter()
        rows = len(live) * (self.num_drafts + 1)
        self.stats.num_read_backs += -(-rows // self.target.buckets[-1])  # the argmax of each target run
        catchup = []
        for seq, d, out in zip(live, drafts, outs):
            a, bonus = accept_greedy(d, out.tokens)
            self.stats.record_verify(a)
            event.accepted[seq.index] = a
            p = seq.position
            self.target.truncate(seq.target_state, p + a + 2)  # keep t_{p+1}, d_1..d_a
            self.proposer.after_verify(a, seq.draft_state)
            pair_hiddens = torch.cat([seq.hidden.unsqueeze(0), out.hiddens[:a]])  # [h_p, h_{p+1}..h_{p+a}]
            pair_tokens = [seq.token, *d[:a]]
            event.new_tokens[seq.index] = self._emit(seq, [*d[:a], bonus])
            if seq.status != LIVE:
                self._release(seq)
                continue
            catchup.append((pair_tokens, pair_hiddens, p, seq.draft_state))
            seq.position, seq.token, seq.hidden = p + a + 1, bonus, out.hiddens[a]
        t3 = time.perf_counter()
        if catchup:
            self.proposer.catchup_batch(*map(list, zip(*catchup)))
            self.stats.num_read_backs += 1  # its finiteness check
        self._end_step(t0, t1, t2, t3)

    def _end_step(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """Wait for the step's device work, then book its phases (propose t0-t1, verify t1-t2, catch-up t3-now)."""
        self._sync()
        t4 = time.perf_counter()
        self.stats.num_steps += 1
        self.stats.propose_seconds += t1 - t0
        self.stats.verify_seconds += t2 - t1
        self.stats.catchup_seconds += t4 - t3

    def _round_on_device(self, event: StepEvent) -> None:
        """One round with the drafts, the verify input and the acceptance on the device; one read-back."""
        live, k, verifier = self.live, self.num_drafts, self._verifier
        n = len(live)
        self._claim_verifier()
        if self._next_rows:  # rows of the last verify (design note "rows by index")
            hiddens = HiddenRows(self._rows, np.array([self._next_rows[s.index] for s in live], dtype=np.int64))
        else:  # the first propose: the prefill's last hiddens, in next_hidden
            self._arrange_hiddens(live)
            hiddens = verifier.next_hidden[:n]
        t0 = time.perf_counter()
        handle = self.proposer.propose_device(
            [s.token for s in live], hiddens, [s.position for s in live], k,
            [s.draft_state for s in live], catchup=self._take_owed(live), assume_finite=True,
        )
        if isinstance(hiddens, HiddenRows):  # next_hidden[i]: live[i]'s h_p, the verify's pair row 0
            torch.index_select(hiddens.tensor, 0, hiddens.index_on_device(), out=verifier.next_hidden[:n])
            self._next_rows.clear()
            self._slots = [s.index for s in live]
        self._roll_back_target()
        self.stats.num_proposes += 1
        self._sync()
        t1 = time.perf_counter()
        verifier.run([s.target_state for s in live], [s.token for s in live], handle.drafts)
        verdict = self._read_verdict(n)  # [n, 3 + K + 1]: the step's one device-to-host read
        t2 = time.perf_counter()
        accepted = verdict[:, ACCEPTED]
        self.proposer.after_verify_device(handle, accepted, any(verdict[:, DROPPED].tolist()))
        self._rows, rows_a_sequence = self._pair_rows, k + 2  # pair rows 0 .. K + 1
        for i, (seq, row) in enumerate(zip(live, verdict.tolist())):  # Python ints: no numpy item reads
            a = row[ACCEPTED]
            g = row[TOKENS : TOKENS + a + 1]  # d_1..d_a (== g_0..g_{a-1}), bonus g_a
            self.stats.record_verify(a)
            event.accepted[seq.index] = a
            p = seq.position
            event.new_tokens[seq.index] = self._emit(seq, g)
            if seq.status != LIVE:
                self._release(seq)
                continue
            self._rollbacks.append((seq.target_state, p + a + 2))  # keep t_{p+1}, d_1..d_a
            if row[NONFINITE_HIDDEN]:
                raise NonFiniteError(describe(f"the target's hiddens of sequence {seq.index}", "finite values",
                                              "a NaN or an infinity", "the decode is stopped: no drafter row written"))
            # catch-up rows p .. p + a: pair rows 0 .. a; the next hidden (position p + a + 1): row 1 + a
            self._owed[seq.index] = ([seq.token, *g[:a]], i * rows_a_sequence, p)
            self._next_rows[seq.index] = i * rows_a_sequence + 1 + a
            seq.position, seq.token = p + a + 1, g[a]
        t3 = time.perf_counter()
        self._end_step(t0, t1, t2, t3)

    def _roll_back_target(self) -> None:
        """The last verify's rejected drafts leave the target (before the next verify appends rows)."""
        rollbacks, self._rollbacks = self._rollbacks, []
        for state, length in rollbacks:
            if not state.is_freed:  # a sequence cancelled since: its blocks went back with it
                self.target.truncate(state, length)

    def _take_owed(self, live: list[_Sequence]):
        """The catch-up rows the live sequences owe, as ``propose_device`` takes them (None: none):
        their hiddens one HiddenRows of ``_rows``, sequence after sequence."""
        if not self._owed:
            return None
        owed = [self._owed.pop(s.index, ([], 0, s.position)) for s in live]
        index = np.array([r for tokens, first, _ in owed for r in range(first, first + len(tokens))], dtype=np.int64)
        return [t for t, _, _ in owed], HiddenRows(self._rows, index), [p for _, _, p in owed]

    def _claim_verifier(self) -> None:
        """The verifier's buffers are the target's, shared by every session of it with this K: a
        session that takes them over from another saves the other's rows and restores its own."""
        verifier = self._verifier
        if verifier.owner is self:
            return
        other = verifier.owner
        if other is not None and not other.is_closed and other._slots:
            other._saved_hidden = verifier.next_hidden[: len(other._slots)].clone()
            if (other._owed or other._next_rows) and other._rows.data_ptr() == verifier.pair_hidden.data_ptr():
                other._rows = other._rows[: len(other._slots) * (other.num_drafts + 2)].clone()  # rewritten next
        verifier.owner = self
        if self._saved_hidden is not None:
            verifier.next_hidden[: len(self._saved_hidden)].copy_(self._saved_hidden)
            self._saved_hidden = None

    def _arrange_hiddens(self, live: list[_Sequence]) -> None:
        """Rows 0..n-1 of next_hidden in ``live``'s order (rows of ended sequences dropped)."""
        self._claim_verifier()
        order = [s.index for s in live]
        if order != self._slots:
            rows = [self._slots.index(i) for i in order]
            hidden = self._verifier.next_hidden
            hidden[: len(rows)] = hidden[torch.tensor(rows, device=hidden.device)]
            self._slots = order

    def _read_verdict(self, n: int) -> np.ndarray:
        """The verdict's first n rows on the host: one copy, one wait (counted in stats.num_read_backs)."""
        self.stats.num_read_backs += 1
        return self._verifier.read_verdict(n)

    def _sync(self) -> None:
        """With ``sync_phases``: wait for the device here, so each phase's time holds its device work."""
        if self.sync_phases and self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def _propose(self, live: list[_Sequence]) -> list[list[int]]:
        k = self.num_drafts
        self.stats.num_proposes += 1
        if len(live) == 1:
            s = live[0]
            self.stats.num_read_backs += 1
            return [self.proposer.propose(s.token, s.hidden, s.position, k, s.draft_state)]
        drafts: list[list[int]] = []
        step = self.proposer.propose_batch_max()
        for at in range(0, len(live), step):
            part = live[at : at + step]
            self.stats.num_read_backs += 1
            drafts += self.proposer.propose_batch(
                [s.token for s in part],
                [s.hidden for s in part],
                [s.position for s in part],
                k,
                [s.draft_state for s in part],
            )
        return drafts

    def _emit(self, seq: _Sequence, tokens: list[int]) -> list[int]:
        """Append tokens, stopping after EOS or at max_new_tokens; returns those appended."""
        out = []
        for t in tokens:
            seq.generated.append(t)
            out.append(t)
            if self.eos_id is not None and t == self.eos_id:
                seq.status = EOS
            elif len(seq.generated) >= self.max_new_tokens:
                seq.status = LENGTH
            if seq.status != LIVE:
                break
        self.stats.num_generated += len(out)
        return out

    # ---- ending sequences ------------------------------------------------------------------------
    def cancel(self, index: int) -> bool:
        """End sequence ``index`` now and free its states; False if it had already ended."""
        if not isinstance(index, int) or not 0 <= index < len(self.sequences):
            raise InputError(describe("cancel index", f"0..{len(self.sequences) - 1}", repr(index)))
        seq = self.sequences[index]
        if seq.status != LIVE:
            return False
        seq.status = CANCELLED
        self._release(seq)
        return True

    def _release(self, seq: _Sequence) -> None:
        """Free the sequence's target and proposer states (each at most once)."""
        target_state, draft_state = seq.target_state, seq.draft_state
        seq.target_state = seq.draft_state = None
        seq.hidden = None
        self._owed.pop(seq.index, None)
        self._next_rows.pop(seq.index, None)
        try:
            if target_state is not None:
                self.target.free(target_state)
        finally:
            if draft_state is not None:
                self.proposer.free_state(draft_state)

    def _abort(self) -> None:
        """After an exception: every live sequence fails and every state goes back."""
        for seq in self.sequences:
            if seq.status == LIVE:
                seq.status = FAILED
        self.close()

    def close(self) -> None:
        """Free every state still held (idempotent); the session cannot step again."""
        errors = []
        for seq in self.sequences:
            try:
                self._release(seq)
            except Exception as exc:  # keep freeing the others; report the first failure
                errors.append(exc)
        if not self.is_closed:
            self.progress.close()
        self.is_closed = True
        if errors:
            raise errors[0]

    def result(self) -> DecodeResult:
        return DecodeResult(
            [list(s.generated) for s in self.sequences], [s.status for s in self.sequences], self.stats
        )

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def speculative_decode(
    target,
    proposer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    num_drafts: int,
    eos_id: int | None = None,
    on_step=None,
    progress: bool | None = False,
    *,
    warmup: bool = True,
    device_loop: bool | None = None,
    sync_phases: bool = False,
) -> DecodeResult:
    """Speculative greedy decoding of every prompt; equals :func:`greedy_decode` token for token.

    Parameters
    ----------
    target : a :class:`draftgraph.runtime.decode.target.TargetModel`.
    proposer : a :class:`draftgraph.runtime.proposer.proposer.DeepseekV4MtpProposer` in the target's mode.
    prompts : token lists (at least one token each), of any lengths.
    max_new_tokens, num_drafts : tokens to generate per sequence; drafts K per round.
    eos_id : a sequence ends after emitting it (None: only at max_new_tokens).
    on_step : called as ``on_step(session, StepEvent)`` after every step.
    progress : tqdm bar on stderr (None: only when stderr is a terminal).
    warmup : build, capture and compile every executor first, timed apart (``stats.warmup_seconds``).
    device_loop : drafts, verify input and acceptance on the device, one read-back a step (None: where
        it can run; True: refuse a session it cannot run; False: the host path).
    sync_phases : wait for the device at each phase's end, so that the time split holds device time.
    """
    with DecodeSession(target, proposer, prompts, max_new_tokens, num_drafts, eos_id, on_step, progress,
                       warmup=warmup, device_loop=device_loop, sync_phases=sync_phases) as s:
        return s.run()


def greedy_decode(
    target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_id: int | None = None,
    *,
    warmup: bool = True,
) -> DecodeResult:
    """Plain greedy decoding with the target alone (the oracle): one token per sequence per forward.

    ``warmup``: build (capture, compile) every target bucket it can use first, timed apart.
    """
    prompts = _check_request(target, prompts, max_new_tokens, eos_id)
    stats = DecodeStats(num_drafts=0, num_sequences=len(prompts))
    tokens: list[list[int]] = [[] for _ in prompts]
    reasons = [LENGTH if max_new_tokens == 0 else LIVE for _ in prompts]
    states = {}
    if warmup and max_new_tokens > 0:
        begun = time.perf_counter()
        target.warm_up(warmups.plan_greedy_warmup(target, [len(p) for p in prompts]))
        stats.warmup_seconds = time.perf_counter() - begun
    started = time.perf_counter()
    try:
        if max_new_tokens > 0:
            budget = max(len(p) for p in prompts) + max_new_tokens
            states = {i: target.alloc_state(budget) for i in range(len(prompts))}
            outs = target.forward(
                list(states.values()), [list(p) for p in prompts], [0] * len(prompts), final=True
            )
            stats.prefill_seconds = time.perf_counter() - started
            nexts = {i: out.tokens[-1] for i, out in enumerate(outs)}
            full_since = None  # the start of a round that began with every sequence live (DecodeStats)
            while nexts:
                for i, t in nexts.items():
                    tokens[i].append(t)
                    stats.num_generated += 1
                    if eos_id is not None and t == eos_id:
                        reasons[i] = EOS
                    elif len(tokens[i]) >= max_new_tokens:
                        reasons[i] = LENGTH
                    if reasons[i] != LIVE:
                        target.free(states.pop(i))
                if full_since is not None:
                    stats.full_batch_generated += len(nexts)
                    stats.full_batch_seconds += time.perf_counter() - full_since
                live = [i for i in nexts if reasons[i] == LIVE]
                if not live:
                    break
                t0 = time.perf_counter()
                full_since = t0 if len(live) == len(prompts) else None
                outs = target.forward(
                    [states[i] for i in live],
                    [[tokens[i][-1]] for i in live],
                    [states[i].length for i in live],
                    final=True,
                )
                stats.verify_seconds += time.perf_counter() - t0
                stats.num_steps += 1
                nexts = {i: out.tokens[-1] for i, out in zip(live, outs)}
    finally:
        for state in states.values():
            target.free(state)
        stats.total_seconds = time.perf_counter() - started
    return DecodeResult(tokens, reasons, stats)


def _device_loop_refusal(target, proposer, num_sequences: int, num_drafts: int) -> str | None:
    """Why the device loop cannot run this session (None: it can)."""
    if not hasattr(proposer, "propose_device"):
        return f"a proposer without propose_device ({type(proposer).__name__})"
    if is_gated(proposer.options.draft_conf_tau, num_drafts):
        return f"a confidence-gated chain (draft_conf_tau {proposer.options.draft_conf_tau})"
    if num_sequences * (num_drafts + 1) > target.buckets[-1]:
        return (f"{num_sequences} sequences x (K + 1) = {num_sequences * (num_drafts + 1)} verify rows "
                f"> the target's largest row bucket {target.buckets[-1]}")
    if num_sequences > proposer.propose_batch_max():
        return f"{num_sequences} sequences > propose_batch_max {proposer.propose_batch_max()}"
    if target.device != proposer.device:
        return f"target on {target.device}, proposer on {proposer.device}"
    return None


def _check_request(target, prompts, max_new_tokens, eos_id=None) -> list[list[int]]:
    """The prompts as lists of ints, each id checked by the proposer's ``check_ints`` (ints, numpy or
    torch integers; a float or a str was truncated or failed in ``int()``), or InputError;
    max_new_tokens and eos_id too."""
    if not isinstance(target, TargetModel):
        raise InputError(describe("target", "a TargetModel (TargetModel.from_checkpoint)", type(target).__name__))
    if not sequence_length(prompts):  # a str, a number, a 0-d or 2-D tensor's truth value, none at all
        raise InputError(describe("prompts", "at least one prompt (a sequence of token-id sequences)",
                                  repr(prompts)[:40] if prompts is not None else "none"))
    vocab = target.config.vocab_size
    checked = [_prompt_ids(i, p, vocab) for i, p in enumerate(prompts)]
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise InputError(describe("max_new_tokens", "an int >= 0", repr(max_new_tokens)))
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, (int, np.integer))
                               or not 0 <= eos_id < vocab):
        raise InputError(describe("eos_id", f"None or a token id in [0, {vocab})", repr(eos_id),
                                  "an id no sequence can emit would never end one"))
    return checked


def _prompt_ids(i: int, prompt, vocab: int) -> list[int]:
    if isinstance(prompt, (str, bytes)):
        raise InputError(describe(f"prompt {i}", "a sequence of token ids", type(prompt).__name__,
                                  "encode text first, e.g. ByteTokenizer().encode(text, add_bos=True)"))
    if sequence_length(prompt) is None:
        raise InputError(describe(f"prompt {i}", "a sequence of token ids", type(prompt).__name__))
    if len(prompt) == 0:
        raise InputError(describe(f"prompt {i}", "at least one token", "an empty prompt"))
    return check_ints(prompt, f"prompt {i} tokens", 0, vocab, len(prompt)).tolist()
