"""draftgraph graphs."""
