import os

# Without a GPU, Triton kernels run in its interpreter (set before anything imports triton).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
