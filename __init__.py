"""draftgraph: a graph runtime with CUDA Graph capture for the draft step of speculative decoding.

The repository's folders are this package's subpackages: ``draftgraph.runtime`` (the engine, one
subpackage per concept), ``draftgraph.ops`` (op definitions), ``draftgraph.graphs`` (declared
graphs) and ``draftgraph.tools`` (the command line). The names below are the public API.
"""
