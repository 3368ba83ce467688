"""draftgraph tools."""
