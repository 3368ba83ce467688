"""The seed's DraftProposer over the graph executors: the API, its input checks, the
per-sequence state, the propose front, the circuit-draft binding and the body runners."""
