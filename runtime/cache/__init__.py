"""The MTP attention's own paged latent cache, its per-sequence decode metadata, and the
static staging buffers a captured chain reads its inputs from."""
