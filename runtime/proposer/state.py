"""Per-sequence state of the MTP proposer (the seed's DeepseekV4MtpProposerState).

A handle: the sequence lives in a row of its proposer's persistent batch
(:class:`~draftgraph.runtime.proposer.sequences.SequenceRows`); the fields below read that row.
Drafter rows are indexed by position: the row of position p lives at slot
``table[p // 16] * 16 + p % 16``, and rows ``kv_start .. seq_len - 1`` are valid. An engine
may keep its own attributes on a state.
"""

from __future__ import annotations

from draftgraph.runtime.cache.paged_cache import BlockTable
from draftgraph.runtime.native.batch_kernel import ROW_MASK
from draftgraph.runtime.proposer.sequences import SequenceRows


class MtpProposerState:
    """One sequence of one proposer. Fields read the proposer's arrays (a freed state reads zeros)."""

    def __init__(self, rows: SequenceRows, key: int, owner: int) -> None:
        self._rows, self.key, self.owner = rows, key, owner

    @property
    def row(self) -> int:
        """Its row in the proposer's persistent batch."""
        return self.key & ROW_MASK

    @property
    def is_freed(self) -> bool:
        return not self._rows.is_live(self.key)

    def _read(self, array) -> int:
        return 0 if self.is_freed else int(array[self.row])

    @property
    def seq_len(self) -> int:
        """One past the newest valid drafter row (a position)."""
        return self._read(self._rows.seq_len)

    @property
    def kv_start(self) -> int:
        """The first valid drafter row."""
        return self._read(self._rows.kv_start)

    @property
    def last_num_drafted(self) -> int:
        """Drafts of the last propose (after_verify trims against it)."""
        return self._read(self._rows.last_drafted)

    @property
    def awaiting_verify(self) -> bool:
        """A propose since the last after_verify: the one call after_verify takes now."""
        return bool(self._read(self._rows.verify_due))

    @property
    def max_positions(self) -> int:
        """Positions this sequence may reach (its token budget)."""
        return self._read(self._rows.max_positions)

    @property
    def table(self) -> BlockTable:
        """The sequence's block table (read it; only the cache writes it)."""
        table = None if self.is_freed else self._rows.table_of[self.row]
        return table if table is not None else BlockTable()

    def snapshot(self) -> tuple:
        """Everything a failed call must leave unchanged (tests compare before/after)."""
        return (tuple(self.table.entries()), self.seq_len, self.kv_start, self.last_num_drafted, self.awaiting_verify,
                self.is_freed)

    def __repr__(self) -> str:
        if self.is_freed:
            return f"MtpProposerState(row {self.row}, freed)"
        return (f"MtpProposerState(row {self.row}, rows {self.kv_start}..{self.seq_len - 1}, "
                f"last drafted {self.last_num_drafted}, blocks {self.table.held()})")
