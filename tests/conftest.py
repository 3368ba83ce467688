import os

import pytest
from gpu_memory_lock import gpu_heavy_lock

# Without a GPU, Triton kernels run in its interpreter (set before anything imports triton).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_speed import skip_repeated_lang_patching

    skip_repeated_lang_patching()  # the interpreter's per-helper patching, once a launch (see the module)

# The files holding the longest tests (the interpreter's Triton runs, the kernel compiles, the
# install, the fuzz and the gloo ranks: 10-105 s each on a CI core), collected first. Under
# `pytest -n auto --dist worksteal` an idle worker takes tests queued for a busy one, but not the
# test that worker is running: a 100 s test started last would run alone at the end. Started
# first, the short tests fill in beside it. Each file keeps its tests together, in order.
HEAVY_FIRST = (
    "test_triton_native_ops.py",
    "test_install.py",
    "test_triton_fp8_mxfp4.py",
    "test_kernels_compile_for_the_gpu.py",
    "test_triton_moe_shard.py",
    "test_proposer_fuzz.py",
    "test_sharded_proposer.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: the rest as collected


@pytest.fixture(autouse=True)
def _one_gpu_heavy_test_at_a_time(request):
    """A ``gpu_heavy`` test runs holding the machine's lock (gpu_memory_lock.py), and gives its memory
    back to the driver before it lets go. Autouse, so set up before the test's own fixtures of the
    same scope: a heavy fixture is function-scoped, so it allocates inside the lock and is torn down
    (its tensors dropped) before the lock's teardown empties the cache."""
    if request.node.get_closest_marker("gpu_heavy") is None:
        yield
        return
    with gpu_heavy_lock():
        yield
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
