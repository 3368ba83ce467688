"""Running planned graphs: the eager executor, the captured executor (one CUDA graph per
bucket), CUDA conditional nodes, which implementation an op runs, and graph launch."""
