"""The graph IR: values and nodes (graph), their types (tensor_spec), the op registry,
GraphBuilder, validate, schedule and flatten, the one printer, JSON and DOT."""
