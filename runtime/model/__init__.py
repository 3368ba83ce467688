"""The DeepSeek-V4 model as data: config, checkpoint tensor names, loading and writing
checkpoints (bf16, FP8 block-scaled, MXFP4), synthetic weights, and an independent
nn.Module of the V4 block (the torch_module runner and the tiny trained model)."""
