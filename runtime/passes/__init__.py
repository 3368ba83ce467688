"""Named passes: pure rewrites Graph -> Graph applied to a declared graph, each with one summary line.

The builders in ``graphs/`` declare the math op by op; what makes it fast is done here, by name,
where ``draftgraph dump`` shows it (``--passes none`` prints the declared graph). The executors
run the passed graph (``DEFAULT_PASSES``). See :mod:`draftgraph.runtime.passes.pipeline`.
"""

from draftgraph.runtime.passes.pipeline import DEFAULT_PASSES, Lowered, Pass, parse_passes, run_passes

__all__ = ["DEFAULT_PASSES", "Lowered", "Pass", "parse_passes", "run_passes"]
