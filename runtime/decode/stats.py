"""DecodeStats: what a speculative decode run measured, and its table; DecodeProgress: the tqdm bar.

Definitions (per sequence and verify step, K drafts proposed, a of them accepted):

- acceptance at draft position j (1..K): the share of verify steps with a >= j;
- acceptance rate: sum(a) / sum(K), over every verify step;
- mean accepted length: mean(a + 1), the tokens one target forward yields (bonus included);
- time split: ``prefill`` (target over the prompts + drafter prefill), ``draft`` (proposes and
  drafter catch-up), ``verify`` (target forwards), ``host`` (the rest: acceptance, bookkeeping);
- tokens per second: generated tokens / wall time of the run (prefill and steps);
- full-batch tokens per second: the tokens of the rounds that began with every sequence live,
  over those rounds' wall time. A fixed batch decoded in lockstep ends in rounds with fewer
  live rows (speculation ends them at different rounds: acceptance varies by sequence); an
  engine that refills its batch never runs those, so this is its throughput at that batch;
- warm-up (building, capturing and compiling every executor the run can use) is timed apart
  and is in none of the figures above: they are steady state.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Counters and timers of one decode run; ``format_table()`` prints them.

    Example
    -------
    >>> stats = DecodeStats(num_drafts=2)
    >>> stats.record_verify(1); stats.record_verify(2)
    >>> stats.acceptance_by_position(), stats.mean_accepted_length
    ([1.0, 0.5], 2.5)
    """

    num_drafts: int
    num_sequences: int = 0
    num_generated: int = 0  # tokens handed out (after EOS / max-token cuts)
    num_steps: int = 0  # loop iterations (one propose batch + one verify forward each)
    num_proposes: int = 0  # propose / propose_batch calls
    num_verifies: int = 0  # sequence-verify pairs: one per live sequence per step
    accepted_at: list[int] = field(default_factory=list)  # [K]: verify steps whose draft j+1 was accepted
    prefill_seconds: float = 0.0
    propose_seconds: float = 0.0
    catchup_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    warmup_seconds: float = 0.0  # apart: not in total_seconds nor any figure derived from it
    num_read_backs: int = 0  # device-to-host reads of the steps (the device loop: one per step)
    full_batch_generated: int = 0  # tokens of the rounds that began with every sequence live
    full_batch_seconds: float = 0.0  # those rounds' wall time

    def __post_init__(self) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * self.num_drafts

    def record_verify(self, num_accepted: int) -> None:
        self.num_verifies += 1
        for j in range(num_accepted):
            self.accepted_at[j] += 1

    # ---- derived ----------------------------------------------------------------------------
    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_at)

    def acceptance_by_position(self) -> list[float]:
        return [a / self.num_verifies if self.num_verifies else 0.0 for a in self.accepted_at]

    @property
    def acceptance_rate(self) -> float:
        drafted = self.num_verifies * self.num_drafts
        return self.num_accepted / drafted if drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target verify forward, the bonus token included: mean(a + 1)."""
        return (self.num_accepted + self.num_verifies) / self.num_verifies if self.num_verifies else 0.0

    @property
    def draft_seconds(self) -> float:
        return self.propose_seconds + self.catchup_seconds

    @property
    def host_seconds(self) -> float:
        return max(self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds, 0.0)

    @property
    def draft_ms_per_propose(self) -> float:
        return 1e3 * self.propose_seconds / self.num_proposes if self.num_proposes else 0.0

    @property
    def verify_ms_per_step(self) -> float:
        return 1e3 * self.verify_seconds / self.num_steps if self.num_steps else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_seconds / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def full_batch_tokens_per_second(self) -> float:
        return self.full_batch_generated / self.full_batch_seconds if self.full_batch_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "sequences": self.num_sequences,
            "generated": self.num_generated,
            "steps": self.num_steps,
            "verifies": self.num_verifies,
            "acceptance_by_position": self.acceptance_by_position(),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "draft_ms_per_propose": self.draft_ms_per_propose,
            "verify_ms_per_step": self.verify_ms_per_step,
            "read_backs": self.num_read_backs,
            "warmup_seconds": self.warmup_seconds,
            "seconds": {
                "prefill": self.prefill_seconds,
                "draft": self.draft_seconds,
                "verify": self.verify_seconds,
                "host": self.host_seconds,
                "total": self.total_seconds,
            },
            "tokens_per_second": self.tokens_per_second,
            "full_batch_tokens_per_second": self.full_batch_tokens_per_second,
        }

    # ---- printing -------------------------------------------------------------------------------
    def format_table(self) -> str:
        """Three aligned blocks: acceptance by draft position, summary, time split."""
        k = self.num_drafts
        lines = ["acceptance by draft position"]
        lines += [
            _row("  draft position", [str(j + 1) for j in range(k)]),
            _row("  accepted", [f"{r:.3f}" for r in self.acceptance_by_position()]),
        ]
        lines.append("summary")
        summary = [
            ("sequences", f"{self.num_sequences}"),
            ("generated tokens", f"{self.num_generated}"),
            ("verify steps", f"{self.num_steps} ({self.num_verifies} sequence-verifies)"),
            ("acceptance rate", f"{self.acceptance_rate:.3f}"),
            ("mean accepted length", f"{self.mean_accepted_length:.2f} tokens per verify (bonus included)"),
            ("draft ms / propose", f"{self.draft_ms_per_propose:.2f}"),
            ("verify ms / step", f"{self.verify_ms_per_step:.2f}"),
            ("host ms / step", f"{self.host_ms_per_step:.2f}"),
            ("tokens / s", f"{self.tokens_per_second:.1f}"),
            ("tokens / s, full batch", f"{self.full_batch_tokens_per_second:.1f} (rounds with every sequence live)"),
            ("warm-up", f"{self.warmup_seconds:.3f} s (apart: in no figure above or below)"),
        ]
        width = max(len(name) for name, _ in summary) + 2
        lines += [f"  {name:<{width}}{value}" for name, value in summary]
        lines.append(f"{'time split':<{width + 2}}{'seconds':>9}  {'share':>6}")
        total = self.total_seconds or 1.0
        for name, secs in (
            ("prefill", self.prefill_seconds),
            ("draft", self.draft_seconds),
            ("verify", self.verify_seconds),
            ("host", self.host_seconds),
            ("total", self.total_seconds),
        ):
            lines.append(f"  {name:<{width}}{secs:>9.4f}  {100 * secs / total:>5.1f}%")
        return "\n".join(lines)


def _row(label: str, cells: list[str], label_width: int = 24, cell_width: int = 7) -> str:
    return f"{label:<{label_width}}" + "".join(f"{c:>{cell_width}}" for c in cells)


class DecodeProgress:
    """A tqdm bar of generated tokens on stderr. ``enabled=None``: only when stderr is a terminal."""

    def __init__(self, total: int, enabled: bool | None = None, desc: str = "decode") -> None:
        from tqdm import tqdm

        disable = None if enabled is None else not enabled
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit="tok",
            file=sys.stderr,
            disable=disable,
            leave=False,
            dynamic_ncols=True,
        )

    def update(self, tokens: int, stats: DecodeStats | None = None) -> None:
        if self.bar.disable:  # no bar (stderr is no terminal): not even the postfix's formatting, every step
            return
        if stats is not None and stats.num_verifies:
            self.bar.set_postfix(
                acc=f"{stats.acceptance_rate:.2f}", len=f"{stats.mean_accepted_length:.2f}", refresh=False
            )
        self.bar.update(tokens)

    def close(self) -> None:
        self.bar.close()
