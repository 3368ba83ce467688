"""A user runner loaded by 'module:callable' in the tests: the body halves the streams."""

class HalvingRunner:
    name = "halving"

    def bind(self, config, weights, device):
        self.bound = True

    def workspace_bytes(self, batch):
        return 1024

    def __call__(self, streams, positions, kv_cache, kv_start, block_table, workspace):
        assert workspace is not None and workspace.numel() >= 1024
        return streams * 0.5


def wrong_shape_runner(streams, positions, kv_cache, kv_start, block_table, workspace):
    return streams[:, :1]


def wrong_dtype_runner(streams, positions, kv_cache, kv_start, block_table, workspace):
    return streams.float()


def returns_none_runner(streams, positions, kv_cache, kv_start, block_table, workspace):
    return None


NOT_CALLABLE = 42
