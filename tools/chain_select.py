"""The chain graph and arena plan that ``dump``, ``draw`` and ``arena`` show.

The selectors of :func:`draftgraph.tools.common.add_selectors` (--num-drafts, --batch,
--mode, --checkpoint, --runner) pick the graph; the cache geometry is a fixed
64-block pool sized so that one sequence can reach ``max_position_embeddings``
(it only sets the shapes of ``block_table`` and the KV cache in the dump).
"""

from __future__ import annotations

import math

from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain
from draftgraph.graphs.v4_block import CacheGeometry
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.model.config import V4Config
from draftgraph.tools.common import selected_config

BLOCK_SIZE = 16
NUM_BLOCKS = 64


def chain_geometry(config: V4Config, block_size: int = BLOCK_SIZE) -> CacheGeometry:
    """A ``NUM_BLOCKS``-block pool; block tables long enough for ``max_position_embeddings``."""
    max_blocks_per_seq = math.ceil(config.max_position_embeddings / block_size) + 1
    return CacheGeometry(NUM_BLOCKS * block_size, max_blocks_per_seq, block_size)


def chain_spec(args) -> ChainSpec:
    """K within the proposer's cap and a runner that loads (checked before any graph is built)."""
    from draftgraph.tools.arg_checks import check_num_drafts, check_runner

    num_drafts = getattr(args, "num_drafts", 1)
    check_num_drafts(num_drafts)
    runner = getattr(args, "runner", "builtin")
    check_runner(runner)
    return ChainSpec(num_drafts=num_drafts, mode=getattr(args, "mode", "streams"), runner=runner)


def add_shard_selectors(parser) -> None:
    """--world W --rank R: show rank R's graph of the chain sharded over W ranks (docs/SHARDING.md)."""
    parser.add_argument("--world", type=int, default=1,
                        help="ranks the MTP layer is sharded over (default 1: unsharded; docs/SHARDING.md)")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose graph is shown (with --world)")


def selected_graph(args) -> Graph:
    """The chain graph as declared (the ``body`` one node with its subgraph); ``--world W --rank R``: that rank's."""
    spec = chain_spec(args)
    config = selected_config(args)
    world, rank = getattr(args, "world", 1), getattr(args, "rank", 0)
    if world != 1 or rank != 0:
        from dataclasses import replace

        from draftgraph.runtime.errors import InputError
        from draftgraph.runtime.model.sharding import ShardPlan
        from draftgraph.tools.cli import UsageError

        try:
            spec = replace(spec, shard=ShardPlan.make(config, rank, world))
        except InputError as exc:
            raise UsageError(f"--world/--rank: {exc}") from None
    return build_draft_chain(config, chain_geometry(config), spec)


def selected_passes(args) -> tuple:
    """The passes ``--passes`` names (all of them by default), as ``runtime.passes.Pass``es."""
    from draftgraph.runtime.errors import GraphError
    from draftgraph.runtime.passes import parse_passes
    from draftgraph.tools.cli import UsageError

    try:
        return parse_passes(getattr(args, "passes", "all"))
    except GraphError as exc:
        raise UsageError(f"--{exc}") from None


def selected_lowering(args):
    """The selected chain after the selected passes: ``runtime.passes.Lowered`` (graph, summaries)."""
    from draftgraph.runtime.passes import run_passes

    passes = selected_passes(args)
    return run_passes(selected_graph(args), passes)


def selected_chain(args):
    """``(flat graph, plan)``: the selected chain after its passes, flattened and planned at ``--batch``.

    Example
    -------
    >>> import argparse
    >>> args = argparse.Namespace(num_drafts=1, batch=1, mode="streams", checkpoint=None, runner="builtin")
    >>> flat, plan = selected_chain(args)              # doctest: +SKIP
    >>> plan.arena_bytes <= plan.arena.naive_bytes     # doctest: +SKIP
    True
    """
    from draftgraph.runtime.ir.schedule import flatten
    from draftgraph.runtime.planning.graph_plan import plan_graph
    from draftgraph.tools.arg_checks import check_batch

    batch = getattr(args, "batch", 1)
    check_batch(batch)
    flat = flatten(selected_lowering(args).graph)
    return flat, plan_graph(flat, batch)
