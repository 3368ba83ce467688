"""Per-sequence state of the MTP proposer (the seed's DeepseekV4MtpProposerState).

Drafter rows are indexed by position: the row of position p lives at slot
``table[p // 16] * 16 + p % 16``. Rows ``kv_start .. seq_len - 1`` are valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftgraph.runtime.cache.paged_cache import BlockTable


@dataclass(slots=True)  # read by slot offset in the compiled loops (runtime/decode_pass.c, cache_rows.c)
class MtpProposerState:
    table: BlockTable = field(default_factory=BlockTable)
    seq_len: int = 0  # one past the newest valid drafter row (a position)
    kv_start: int = 0  # first valid drafter row
    last_num_drafted: int = 0  # drafts of the last propose (after_verify trims against it)
    max_positions: int = 0  # positions this sequence may reach (its token budget)
    owner: int = 0  # id of the proposer that allocated it
    is_freed: bool = False

    def snapshot(self) -> tuple:
        """Everything a failed call must leave unchanged (tests compare before/after)."""
        return (tuple(self.table.blocks), self.seq_len, self.kv_start, self.last_num_drafted, self.is_freed)

    def reset(self) -> None:
        self.seq_len = self.kv_start = self.last_num_drafted = 0
