"""Declared graphs: the V4 block (the MTP's body), the draft step and the K-draft chain, the
drafter prefill, and the small V4-shaped target of the decode loop."""

from draftgraph import ops as _ops  # noqa: F401  (registers the ops these graphs declare)
