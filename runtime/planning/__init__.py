"""Memory planning: lifetimes, a graph's arena plan, the arena planner and its search,
the independent checker verify_plan, and the MiniMalloc CSV format."""
