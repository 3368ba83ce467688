import os

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
