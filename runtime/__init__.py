"""The engine, one subpackage per concept, in layers (each imports only the ones above it here).

- ``errors``: the typed errors every layer raises.
- ``ir``: the graph IR: TensorSpec, Graph, the op registry, GraphBuilder, validate, schedule,
  the printer, JSON and DOT.
- ``planning``: lifetimes, the graph's arena plan, the arena planner and its search,
  verify_plan, the MiniMalloc CSV loader.
- ``passes``: named rewrites of a declared graph (fusions, in-place reuse).
- ``model``: the DeepSeek-V4 config, tensor names, checkpoint loading and writing, FP8 / MXFP4.
- ``execution``: the eager and captured executors, CUDA conditional nodes, graph launch.
- ``cache``: the MTP's paged latent cache, its decode metadata, the staging buffers.
- ``proposer``: the seed's DraftProposer (API, options, input checks, the persistent batch of its
  sequences, state handles, binding, body runners).
- ``decode``: the speculative decode loop (target model, loop, stats, tokenizer).
- ``native``: the compiled twin of the propose's array steps (C over flat buffers) and its builder.
"""
