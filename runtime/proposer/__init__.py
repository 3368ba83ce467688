"""The seed's DraftProposer over the graph executors: the API, its options and input checks, the
persistent batch of its sequences and their state handles, the circuit-draft binding and the
body runners."""
