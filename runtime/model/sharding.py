"""ShardPlan: which part of the MTP layer one rank of W holds (design note "sharding", docs/SHARDING.md).

- Routed experts, expert-parallel: rank r holds experts ``[r * E / W, (r + 1) * E / W)`` (and loads
  only those tensors). Routing (the gate, its bias, the top-k) is replicated: every rank picks
  the same experts and computes the pairs that fall in its range.
- The LM head, vocab-parallel over the DRAFTED rows ``Vd`` (``mtp_vocab_size`` when set, else the
  vocab): rank r holds head rows ``[r * Vd / W, (r + 1) * Vd / W)``. Slicing the drafted rows,
  not the whole vocab, keeps the ranks' head bytes equal when a vocab limit is set (a slice of the
  whole vocab past ``mtp_vocab_size`` would hold rows no draft reads, and its rank would idle).
- The shared expert on rank 0 only (``holds_shared``): its output joins rank 0's partial sum,
  which the MoE's all-reduce adds anyway.
- Everything else (embed, combiner, mHC, norms, attention, hc_head) replicated.

A plan of world 1 is no sharding at all: the graphs built for it are today's, node for node.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.model.config import V4Config

GROUP = "tp"  # the name the comm nodes carry (attrs["group"]); the executor is given the RankGroup under it


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``world``: its expert range and its vocab (head-row) range.

    Example
    -------
    >>> plan = ShardPlan.make(V4Config.small(), rank=1, world=2)
    >>> plan.experts, plan.vocab_rows
    ((8, 16), (500, 1000))
    """

    rank: int
    world: int
    expert_start: int
    expert_stop: int
    vocab_start: int
    vocab_stop: int
    drafted_vocab: int  # Vd: the rows the head drafts from, sliced across the ranks

    @staticmethod
    def make(config: V4Config, rank: int = 0, world: int = 1, mtp_vocab_size: int = 0) -> ShardPlan:
        """The plan of ``rank`` in ``world``; InputError when the model does not split in W equal parts."""
        for name, value, low in (("world", world, 1), ("rank", rank, 0)):
            if type(value) is not int or value < low:
                raise InputError(describe(f"shard {name}", f"an int >= {low}", repr(value)))
        if rank >= world:
            raise InputError(describe("shard rank", f"0..{world - 1} (world {world})", rank))
        experts = config.n_routed_experts
        drafted = min(mtp_vocab_size, config.vocab_size) if mtp_vocab_size > 0 else config.vocab_size
        if experts % world:
            raise InputError(describe("routed experts", f"a multiple of the world {world} (expert-parallel)",
                                      experts, "run on a number of ranks that divides n_routed_experts"))
        if drafted % world:
            what = "mtp_vocab_size" if mtp_vocab_size > 0 else "vocab_size"
            raise InputError(describe(f"drafted vocab ({what})", f"a multiple of the world {world} "
                                      "(vocab-parallel head: equal slices)", drafted,
                                      f"set mtp_vocab_size to a multiple of {world}, e.g. {drafted - drafted % world}"))
        e, v = experts // world, drafted // world
        return ShardPlan(rank, world, rank * e, (rank + 1) * e, rank * v, (rank + 1) * v, drafted)

    @property
    def is_sharded(self) -> bool:
        return self.world > 1

    @property
    def experts(self) -> tuple[int, int]:
        """[start, stop) of this rank's routed experts (global ids)."""
        return self.expert_start, self.expert_stop

    @property
    def num_local_experts(self) -> int:
        return self.expert_stop - self.expert_start

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """[start, stop) of this rank's head rows (global token ids)."""
        return self.vocab_start, self.vocab_stop

    @property
    def num_local_rows(self) -> int:
        return self.vocab_stop - self.vocab_start

    @property
    def holds_shared(self) -> bool:
        """Whether this rank computes the shared expert (rank 0: computed once, added in the all-reduce)."""
        return self.rank == 0

    def holds(self, name: str, prefix: str = "mtp.0.") -> bool:
        """Whether this rank loads checkpoint tensor ``name`` (other experts and the shared expert on rank > 0: no)."""
        experts = f"{prefix}ffn.experts."
        if name.startswith(experts):
            index = name[len(experts):].split(".", 1)[0]
            return not index.isdigit() or self.expert_start <= int(index) < self.expert_stop
        if name.startswith(f"{prefix}ffn.shared_experts."):
            return self.holds_shared or not self.is_sharded
        return True

    def __str__(self) -> str:
        return (f"rank {self.rank} of {self.world}: experts [{self.expert_start}, {self.expert_stop}), "
                f"head rows [{self.vocab_start}, {self.vocab_stop}) of {self.drafted_vocab}")
