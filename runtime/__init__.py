"""draftgraph runtime: IR, scheduler, arena planner, executors, cache, weights, proposer."""
