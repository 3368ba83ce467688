"""draftgraph ops."""
