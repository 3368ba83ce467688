"""draftgraph: a graph runtime with CUDA Graph capture for the draft step of speculative decoding.

The repository's folders are this package's subpackages: ``draftgraph.runtime`` (the engine, one
subpackage per concept), ``draftgraph.ops`` (op definitions), ``draftgraph.graphs`` (declared
graphs) and ``draftgraph.tools`` (the command line). The names below are the public API::

    from draftgraph import DeepseekV4MtpProposer, ProposerOptions

    prop = DeepseekV4MtpProposer.from_checkpoint("ckpt/", device="cuda")
"""

from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain
from draftgraph.graphs.v4_block import CacheGeometry
from draftgraph.runtime.cache.hidden_rows import HiddenRows
from draftgraph.runtime.errors import (
    CacheError,
    CaptureError,
    DraftGraphError,
    ExecutionError,
    GraphError,
    InputError,
    PlanError,
    RunnerError,
    WeightError,
)
from draftgraph.runtime.execution.captured import CapturedExecutor
from draftgraph.runtime.execution.eager import EagerExecutor
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.printer import format_graph
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.weights import load_checkpoint
from draftgraph.runtime.planning.arena_plan import ArenaPlan, Buffer, plan_arena
from draftgraph.runtime.planning.graph_plan import GraphPlan, plan_graph
from draftgraph.runtime.planning.verify_plan import verify_plan
from draftgraph.runtime.proposer.binding import DraftBinding
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer, ProposerOptions
from draftgraph.runtime.proposer.runners.base import DraftRunner
from draftgraph.runtime.proposer.state import MtpProposerState

__version__ = "0.1.0"

__all__ = [
    "ArenaPlan",
    "B",
    "Buffer",
    "CacheError",
    "CacheGeometry",
    "CaptureError",
    "CapturedExecutor",
    "ChainSpec",
    "DeepseekV4MtpProposer",
    "DraftBinding",
    "DraftGraphError",
    "DraftRunner",
    "EagerExecutor",
    "ExecutionError",
    "Graph",
    "GraphBuilder",
    "GraphError",
    "GraphPlan",
    "HiddenRows",
    "InputError",
    "MtpProposerState",
    "PlanError",
    "ProposerOptions",
    "RunnerError",
    "TensorSpec",
    "V4Config",
    "WeightError",
    "build_draft_chain",
    "format_graph",
    "load_checkpoint",
    "plan_arena",
    "plan_graph",
    "verify_plan",
]
