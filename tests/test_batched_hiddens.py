"""``propose_batch`` with the hiddens as one [B, ...] tensor does what it does with a list of B.

The list is the oracle: same drafts, same probabilities, same cache bytes, same staged hidden
rows (padding rows zeros), whether the tensor is contiguous, has its rows apart (a slice with a
step) or strided inside (a transposed view). A bad tensor is refused with one typed error
naming expected and got, before anything changes.
"""

from __future__ import annotations

import random

import pytest
import torch
from draftgraph.runtime.cache.staging import ChainStaging
from draftgraph.runtime.errors import InputError
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.proposer.checks import check_hiddens
from proposer_fixtures import TINY, hidden, make_proposer
from staging_fixtures import stage_rows

SHAPES = {"streams": (TINY.hc_mult, TINY.hidden_size), "collapsed": (TINY.hidden_size,)}
CPU = torch.device("cpu")


def prefilled_pair(mode: str, batch: int, **kw):
    """Two proposers with the same weights and the same prefilled rows for ``batch`` sequences."""
    gen = torch.Generator().manual_seed(batch)
    props = [make_proposer(TINY, seed=1, mode=mode, **kw) for _ in range(2)]
    states = [[prop.alloc_state() for _ in range(batch)] for prop in props]
    for i in range(batch):
        prompt = torch.randint(TINY.vocab_size, (3 + 5 * i,), generator=gen).tolist()
        hs = hidden(TINY, gen, mode, len(prompt))
        for prop, st in zip(props, states):
            prop.prefill_drafter(prompt, hs, st[i])
    return props, states, gen


def strided(block: torch.Tensor, layout: str) -> torch.Tensor:
    """``block``'s values in another layout: its rows apart, or each row strided inside."""
    if layout == "step":  # rows apart, each contiguous: the addresses step over the gaps
        wide = torch.zeros(2 * block.shape[0], *block.shape[1:], dtype=block.dtype)
        wide[::2] = block
        return wide[::2]
    if layout == "transposed":  # [B, C, D] with stride 1 along C (or [B, D] with stride 1 along B)
        return block.transpose(0, -1).contiguous().transpose(0, -1)
    return block


def propose_both(props, states, tokens, rows, block, positions, k):
    """(drafts, out_conf) of the list form on props[0] and of the tensor form on props[1]."""
    confs = [[], []]
    listed = props[0].propose_batch(tokens, rows, positions, k, states[0], out_conf=confs[0])
    batched = props[1].propose_batch(tokens, block, positions, k, states[1], out_conf=confs[1])
    return (listed, confs[0]), (batched, confs[1])


def assert_same_proposers(props, states) -> None:
    a, b = props
    assert torch.equal(a.cache.kv, b.cache.kv)
    assert a.cache.num_free_blocks == b.cache.num_free_blocks
    assert [s.snapshot() for s in states[0]] == [s.snapshot() for s in states[1]]
    assert a._staging.keys() == b._staging.keys()
    for bucket, staging in a._staging.items():  # padding rows zeros in both, live rows the same hiddens
        assert torch.equal(staging.hidden_buf, b._staging[bucket].hidden_buf)
        assert torch.equal(staging.host_buf, b._staging[bucket].host_buf)


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
@pytest.mark.parametrize("layout", ["contiguous", "step", "transposed"])
def test_a_tensor_gives_the_drafts_probs_and_cache_of_the_list(mode, layout):
    """B = 4, then 3 and 2 in the same bucket of 4: the rows left behind are padding (zeros)."""
    props, states, gen = prefilled_pair(mode, 4, buckets=(1, 4))
    positions = [2 + 5 * i for i in range(4)]  # each prompt's last position (prompts of 3 + 5 i tokens)
    for round_index, batch in enumerate((4, 3, 2, 3)):
        tokens = torch.randint(TINY.vocab_size, (batch,), generator=gen).tolist()
        block = strided(hidden(TINY, gen, mode, batch), layout)
        rows = [block[i].clone() for i in range(batch)]  # the list form, rows of their own
        part = [st[:batch] for st in states]
        (listed, listed_conf), (batched, batched_conf) = propose_both(props, part, tokens, rows, block,
                                                                      positions[:batch], 2)
        assert batched == listed
        assert batched_conf == listed_conf and len(batched_conf) == batch
        assert_same_proposers(props, states)
        for prop, st in zip(props, part):
            for state in st:
                prop.after_verify(round_index % 3, state)
        positions[:batch] = [p + round_index % 3 for p in positions[:batch]]


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
def test_a_batch_of_three_in_a_bucket_of_four_with_default_buckets(mode):
    props, states, gen = prefilled_pair(mode, 3)
    block = hidden(TINY, gen, mode, 3)
    (listed, listed_conf), (batched, batched_conf) = propose_both(props, states, [5, 17, 42], list(block), block,
                                                                  [2, 7, 12], 3)
    assert batched == listed and batched_conf == listed_conf
    assert not props[1]._staging[4].hidden_buf[3].any()  # the bucket's padding row
    assert_same_proposers(props, states)


def bad_tensors(mode: str, n: int) -> dict[str, tuple[torch.Tensor, list, list]]:
    """Each bad tensor, with the expected and got that its error must name."""
    shape = SHAPES[mode]
    want = [n, *shape]
    return {
        "shape": (torch.zeros(n, 1, *shape, dtype=torch.bfloat16), want, [n, 1, *shape]),
        "row shape": (torch.zeros(n, shape[0] + 1, *shape[1:], dtype=torch.bfloat16), want,
                      [n, shape[0] + 1, *shape[1:]]),
        "fewer rows": (torch.zeros(n - 1, *shape, dtype=torch.bfloat16), want, [n - 1, *shape]),
        "more rows": (torch.zeros(n + 1, *shape, dtype=torch.bfloat16), want, [n + 1, *shape]),
        "no batch dim": (torch.zeros(*shape, dtype=torch.bfloat16), want, list(shape)),
        "dtype": (torch.zeros(n, *shape), torch.bfloat16, torch.float32),
        "device": (torch.zeros(n, *shape, dtype=torch.bfloat16, device="meta"), CPU, torch.device("meta")),
    }


@pytest.mark.parametrize("mode", ["streams", "collapsed"])
@pytest.mark.parametrize("case", ["shape", "row shape", "fewer rows", "more rows", "no batch dim", "dtype",
                                  "device"])
def test_a_bad_tensor_raises_expected_and_got_and_changes_nothing(mode, case):
    props, states, gen = prefilled_pair(mode, 3)
    prop, st = props[1], states[1]
    prop.propose_batch([1, 2, 3], hidden(TINY, gen, mode, 3), [2, 7, 12], 2, st)  # the staging exists, holds rows
    before = ([s.snapshot() for s in st], prop.cache.num_free_blocks, prop.cache.kv.clone(),
              prop._staging[4].host_buf.clone(), prop._staging[4].hidden_buf.clone())
    bad, want, got = bad_tensors(mode, 3)[case]
    with pytest.raises(InputError) as info:
        prop.propose_batch([4, 5, 6], bad, [4, 9, 14], 2, st)
    message = str(info.value)
    assert message.startswith("target_hiddens") and f"expected {want}, got {got}" in message
    after = ([s.snapshot() for s in st], prop.cache.num_free_blocks, prop.cache.kv,
             prop._staging[4].host_buf, prop._staging[4].hidden_buf)
    assert after[:2] == before[:2]
    assert all(torch.equal(x, y) for x, y in zip(after[2:], before[2:]))


def test_check_hiddens_takes_a_tensor_as_it_is_and_a_list_as_before():
    shape = SHAPES["streams"]
    block = torch.zeros(5, *shape, dtype=torch.bfloat16)
    assert check_hiddens(block, shape, CPU, 5) is block
    rows = check_hiddens([block[0], block[1].unsqueeze(0)], shape, CPU, 2)  # a list still takes [1, C, D] rows
    assert isinstance(rows, list) and [r.shape for r in rows] == [shape, shape]
    with pytest.raises(InputError, match=r"expected \[4, 4, 64\], got \[5, 4, 64\]"):
        check_hiddens(block, shape, CPU, 4)


def staging_pair(bucket: int, **kw) -> tuple[ChainStaging, ChainStaging]:
    spec = TensorSpec(("B", 2, 3), torch.bfloat16)
    return tuple(ChainStaging(bucket, spec, 4, 2, CPU, window=16, **kw) for _ in range(2))


def test_staging_a_tensor_writes_the_bytes_staging_its_rows_writes():
    rng = random.Random(3)
    by_rows, by_block = staging_pair(8)
    for _ in range(40):
        n = rng.randrange(0, 9)
        rows = [(rng.randrange(0, 48), 0, [rng.randrange(0, 50) for _ in range(3)]) for _ in range(n)]
        tokens = [rng.randrange(0, 100) for _ in range(n)]
        block = strided(torch.randn(n, 2, 3).bfloat16(), rng.choice(["contiguous", "step", "transposed"]))
        stage_rows(by_rows, rows, tokens, list(block), 50)
        stage_rows(by_block, rows, tokens, block, 50)
        for name in ("host_buf", "device_buf", "hidden_buf"):
            assert torch.equal(getattr(by_rows, name), getattr(by_block, name)), name
        assert torch.equal(by_block.hidden_buf[:n], block) and not by_block.hidden_buf[n:].any()


# ---- the address gather (ops/triton/rows.py), under Triton's interpreter as tests/test_hidden_gather.py runs it ----
def gather(st: ChainStaging) -> None:
    """What the captured prologue does: copy the host buffer and gather each row from its address."""
    from draftgraph.ops.triton.rows import stage_from_host

    stage_from_host(st.host_buf, st.device_buf, st._address_at, st.hidden_buf)
    st._is_copy_pending = False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no CUDA")
@pytest.mark.parametrize("layout", ["contiguous", "step", "transposed", "expanded"])
def test_a_tensor_gives_row_addresses_by_arithmetic_and_the_gather_reads_its_rows(layout):
    pytest.importorskip("triton")
    st, _ = staging_pair(4, gather_hiddens=True)
    st.hidden_buf.fill_(7.0)  # stale: the gather rewrites every row
    row_bytes = 2 * 3 * 2
    if layout == "expanded":  # one hidden for every row: stride 0, one address
        block = torch.randn(1, 2, 3).bfloat16().expand(3, 2, 3)
    else:
        block = strided(torch.randn(3, 2, 3).bfloat16(), layout)
    rows = [(p, 0, [i]) for i, p in enumerate((3, 5, 7))]
    stage_rows(st, rows, [1, 2, 3], block, 100, copy_in=False)
    addresses = st.addresses.tolist()
    if layout == "transposed":  # strided inside a row: one contiguous copy, kept until the next stage
        assert len(st._kept) == 1 and addresses[:3] == [st._kept[0].data_ptr() + i * row_bytes for i in range(3)]
    else:
        step = {"contiguous": row_bytes, "step": 2 * row_bytes, "expanded": 0}[layout]
        assert st._kept == [] and addresses[:3] == [block.data_ptr() + i * step for i in range(3)]
    assert addresses[3] == 0
    gather(st)
    assert torch.equal(st.hidden_buf[:3], block) and not st.hidden_buf[3].any()
    only = block[:1].clone(memory_format=torch.contiguous_format)  # alive until the gather: a caller keeps it
    stage_rows(st, rows[:1], [4], only, 100, copy_in=False)  # a smaller batch: the stale addresses cleared
    assert st._kept == [] and st.addresses.tolist()[1:] == [0, 0, 0]
    gather(st)
    assert torch.equal(st.hidden_buf[0], only[0]) and not st.hidden_buf[1:].any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no CUDA")
def test_the_same_tensor_again_keeps_its_addresses_and_anything_else_rewrites_them():
    # A serving loop stages its own hiddens buffer every step: its row addresses are written once.
    # Every other stage (a list, another tensor, fewer rows) must leave exactly its own addresses.
    pytest.importorskip("triton")
    st, _ = staging_pair(4, gather_hiddens=True)
    row_bytes = 2 * 3 * 2
    first, other = torch.randn(3, 2, 3).bfloat16(), torch.randn(3, 2, 3).bfloat16()
    listed = [torch.randn(2, 3).bfloat16() for _ in range(3)]
    rows = [(p, 0, [i]) for i, p in enumerate((3, 5, 7))]

    def staged(hiddens, n=3) -> list[int]:
        stage_rows(st, rows[:n], [1] * n, hiddens, 100, copy_in=False)
        st._is_copy_pending = False  # what the replay's read-back does (no replay here)
        return st.addresses.tolist()

    def block_addresses(block, n=3) -> list[int]:
        return [block.data_ptr() + i * row_bytes for i in range(n)] + [0] * (4 - n)

    assert staged(first) == block_addresses(first)
    first.normal_()  # new values in the same rows: the same addresses
    assert staged(first) == block_addresses(first)
    assert staged(listed) == [h.data_ptr() for h in listed] + [0]
    assert staged(first) == block_addresses(first)  # rewritten after the list
    assert staged(other) == block_addresses(other)
    assert staged(other[:2], n=2) == block_addresses(other, n=2)
    assert staged(other) == block_addresses(other)
