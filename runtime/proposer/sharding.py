"""The proposer on several ranks: its process group, its ShardPlan and the RankGroup its executors get.

Design note "replicated host": every rank runs the same proposer calls with the same inputs (as the
target's tensor-parallel ranks do), so the host bookkeeping (states, block tables, the KV pool) is
the same on every rank, and a bad input is refused on every rank by the same host checks before any
collective runs: no rank is left waiting in one. The KV cache is replicated (attention is), so each
rank's cache rows are equal too. What differs per rank is only the weights it holds and the graph
built for its ShardPlan (its comm nodes name the group ``GROUP``; the executor is given a RankGroup
under that name).

``process_group``: a ``torch.distributed`` group, or ``"env"``: initialise the default group from
the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), NCCL on CUDA and
gloo on CPU. A collective that never completes raises after the group's timeout on the ranks that
wait (``COLLECTIVE_TIMEOUT_S`` for a group made here).
"""

from __future__ import annotations

import datetime
import os

import torch
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.sharding import GROUP, ShardPlan

COLLECTIVE_TIMEOUT_S = 120
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def process_group_from_env(device=None, timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """The default process group from torchrun's environment (made once; an existing one is reused).

    NCCL when ``device`` is CUDA (the rank's device is set from LOCAL_RANK first), gloo otherwise.
    Returns None: the default group (torch.distributed's ``group=None``).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return None
    missing = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
    if missing:
        raise InputError(describe("process_group='env'", f"torchrun's variables {list(TORCHRUN_VARIABLES)}",
                                  f"{missing} unset", "launch with torchrun --nproc-per-node W ..."))
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return None


def shard_setup(config: V4Config, process_group, mtp_vocab_size: int, device=None):
    """(ShardPlan or None, RankGroup or None) for a proposer given ``process_group``.

    None for a world of one (no process group, or a group of one rank): today's graphs, no comm.
    """
    if process_group is None:
        return None, None
    import torch.distributed as dist
    from draftgraph.ops.collectives import RankGroup

    group = process_group
    if isinstance(process_group, str):
        if process_group != "env":
            raise InputError(describe("process_group", "a torch.distributed ProcessGroup, 'env' or None",
                                      repr(process_group)))
        group = process_group_from_env(device)
    elif not isinstance(process_group, dist.ProcessGroup):
        raise InputError(describe("process_group", "a torch.distributed ProcessGroup, 'env' or None",
                                  type(process_group).__name__))
    if not dist.is_available() or not dist.is_initialized():
        raise InputError(describe("process_group", "a group of an initialised torch.distributed", "none initialised",
                                  "call torch.distributed.init_process_group first, or pass process_group='env'"))
    ranks = RankGroup(group)
    if ranks.world == 1:
        return None, None
    return ShardPlan.make(config, ranks.rank, ranks.world, mtp_vocab_size), ranks


def runners_for(rank_group) -> dict:
    """The executor's runners= entry for the comm nodes (none unsharded)."""
    return {GROUP: rank_group} if rank_group is not None else {}
