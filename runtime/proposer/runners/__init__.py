"""Body runners: ``builtin`` (the op subgraph, no runner object), ``identity``, ``torch_module``."""

from draftgraph.runtime.proposer.runners.identity import IdentityRunner
from draftgraph.runtime.proposer.runners.torch_module import CompiledTorchModuleRunner, TorchModuleRunner

SHIPPED = {
    "identity": IdentityRunner,
    "torch_module": TorchModuleRunner,
    "torch_module_compiled": CompiledTorchModuleRunner,
}
