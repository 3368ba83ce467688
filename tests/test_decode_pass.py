"""The one pass of a propose (runtime/proposer/front.py): the bytes it stages, and the buffer it leaves on refusal.

Design note "one pass": the usual batch is checked and its held rows staged in one loop; the
rest (unheld rows, unusual items) goes the general way. Here, over random decode steps (drafts
accepted or not, jumps, rows crossing blocks, fresh states, batches of every size in the
bucket), the staged rows are the bytes of a fresh ``pack_metadata``, and a propose refused at
any point after the pass leaves the staging buffer byte for byte as it was.
"""

from __future__ import annotations

import random

import draftgraph.runtime.proposer.proposer as proposer_module
import pytest
import torch
from draftgraph.runtime.cache.metadata import MetadataWriter, pack_metadata, row_bytes_for
from draftgraph.runtime.cache.paged_cache import BlockTable
from draftgraph.runtime.errors import CacheError, InputError
from native_fixtures import use_compiled
from proposer_fixtures import TINY, hidden, make_proposer

BUCKET = 8


@pytest.fixture(autouse=True, params=["compiled", "python"])
def loop(request, monkeypatch):
    """Every test here runs on both host paths (design note "compiled pass"); the recorders, or None."""
    if request.param == "python":
        use_compiled(monkeypatch, False)
        return None
    return use_compiled(monkeypatch, True)


def staged_meta(prop, bucket: int = BUCKET) -> torch.Tensor:
    return prop._staging_for(bucket).host["meta"].buf


def fresh_pack(prop, states, positions, bucket: int = BUCKET) -> torch.Tensor:
    """What a fresh pack of this batch writes (rows past it padding), from the states after the propose."""
    rows = [(p, s.kv_start, s.table) for p, s in zip(positions, states)] + [None] * (bucket - len(states))
    return pack_metadata(rows, prop.cache.max_blocks_per_seq, window=TINY.sliding_window)


def count_passes(monkeypatch) -> list:
    """Wrap the front: each call appends 'pass' (it staged the batch), 'unheld' (rows needed blocks) or 'general'."""
    seen, inner = [], proposer_module.stage_front

    def recorded(*args):
        front = inner(*args)
        seen.append("general" if front is None else ("unheld" if front.unheld else "pass"))
        return front

    monkeypatch.setattr(proposer_module, "stage_front", recorded)
    return seen


def test_random_decode_steps_stage_the_bytes_of_a_fresh_pack(monkeypatch, loop):
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    prop = make_proposer(TINY, buckets=(BUCKET,))
    seen = count_passes(monkeypatch)
    states = [prop.alloc_state() for _ in range(BUCKET)]
    positions = [rng.randrange(0, 60) for _ in states]
    for _ in range(120):
        n = rng.choice([BUCKET, BUCKET, rng.randrange(1, BUCKET + 1)])
        order = rng.sample(range(BUCKET), n)  # rows change places between steps, as batches do
        batch_states, batch_positions = [states[i] for i in order], [positions[i] for i in order]
        k = rng.choice([1, 1, 2, 3])
        tokens = [rng.randrange(TINY.vocab_size) for _ in order]
        hiddens = [hidden(TINY, gen) for _ in order]
        prop.propose_batch(tokens, hiddens, batch_positions, k, batch_states)
        assert torch.equal(staged_meta(prop), fresh_pack(prop, batch_states, batch_positions))
        for i in order:
            accepted = rng.randrange(0, k + 1)
            prop.after_verify(accepted, states[i])
            positions[i] += accepted + 1 if rng.random() < 0.9 else rng.randrange(1, 40)  # now and then a jump
            if positions[i] + 4 > TINY.max_position_embeddings or rng.random() < 0.02:
                prop.free_state(states[i])
                states[i], positions[i] = prop.alloc_state(), rng.randrange(0, 60)
    # Most steps are the one pass; some need blocks first; a step of a fresh state's first rows too.
    assert seen.count("pass") > 15 and seen.count("unheld") > 15, seen
    assert "general" not in seen
    if loop is not None:  # the compiled loops took every step themselves
        passes, rows = loop["decode_pass"].answers, loop["cache_rows"].answers
        fronts = passes["stage_batch"]  # (unheld, records, done): one call a step, all of it done there
        assert len(fronts) == len(seen) and all(type(front) is tuple and front[2] for front in fronts)
        assert not passes["stage_rows"] and not passes["restage_rows"]  # no pass or restage of their own
        assert len(rows["ensure_tables"]) == seen.count("unheld") and NotImplemented not in rows["ensure_tables"]
        assert len(rows["trim_tables"]) >= len(seen) and NotImplemented not in rows["trim_tables"]
        assert sum(bool(released) for released in rows["trim_tables"]) > 10  # windows that moved past a block


def refused_before(prop, states, positions, k, tokens, hiddens, error):
    """Propose, expect ``error``; returns the staging host buffer before and after."""
    staging = prop._staging_for(BUCKET)
    before = staging.host_buf.clone()
    with pytest.raises(error):
        prop.propose_batch(tokens, hiddens, positions, k, states)
    return before, staging.host_buf


@pytest.fixture()
def decoding():
    """A proposer whose staging holds a batch of 8, and the next step's inputs (row 5 crosses into a new block)."""
    gen = torch.Generator().manual_seed(5)
    prop = make_proposer(TINY, buckets=(BUCKET,))
    states = [prop.alloc_state() for _ in range(BUCKET)]
    positions = [17 + 5 * i for i in range(BUCKET)]
    hiddens = [hidden(TINY, gen) for _ in range(BUCKET)]
    prop.propose_batch(list(range(BUCKET)), hiddens, positions, 2, states)
    for state in states:
        prop.after_verify(2, state)
    positions = [p + 2 for p in positions]
    positions[5] = 47  # (47 + 1) // 16 = 3: a block this row does not hold yet
    return prop, states, positions, list(range(BUCKET)), hiddens


@pytest.mark.parametrize("at", [0, 3, 7])
@pytest.mark.parametrize("kind", ["token", "position", "state", "twin", "hidden"])
def test_a_refused_propose_leaves_the_staging_buffer_as_it_was(decoding, at, kind):
    prop, states, positions, tokens, hiddens = decoding
    if kind == "token":
        tokens[at] = TINY.vocab_size
    elif kind == "position":
        positions[at] = -1
    elif kind == "state":
        states[at] = make_proposer(TINY).alloc_state()
    elif kind == "twin":
        states[at] = states[(at + 1) % BUCKET]
    else:  # refused after the pass staged every row
        hiddens[at] = torch.zeros(3, TINY.hidden_size, dtype=torch.bfloat16)
    before, after = refused_before(prop, states, positions, 2, tokens, hiddens, InputError)
    assert torch.equal(after, before)


def test_a_pool_too_small_for_the_unheld_rows_leaves_the_staging_buffer_as_it_was(decoding):
    prop, states, positions, tokens, hiddens = decoding
    while prop.cache.num_free_blocks:
        prop.cache.ensure(BlockTable(), 0, 0)
    before, after = refused_before(prop, states, positions, 2, tokens, hiddens, CacheError)
    assert torch.equal(after, before)


def test_restore_puts_back_the_rows_and_records_save_found():
    rng = random.Random(8)
    max_blocks, window = 12, 32
    buf = torch.zeros(4, row_bytes_for(max_blocks), dtype=torch.uint8)
    writer = MetadataWriter(buf, max_blocks, window)

    def random_rows():
        rows = []
        for _ in range(rng.randrange(0, 5)):
            p = rng.randrange(0, 150)
            blocks = [rng.randrange(0, 50) for _ in range(p // 16 + 1 + rng.randrange(0, 2))]
            rows.append((p, rng.randrange(0, p + 1), blocks, 16))
        return rows

    for _ in range(200):
        writer.write(random_rows())
        kept, records = buf.clone(), list(writer._tables)
        writer.save()
        writer.write(random_rows())
        writer.restore()
        assert torch.equal(buf, kept)
        assert writer._tables == records


class TrackedBlocks(list):
    """A table's block list of another type (as an engine's own bookkeeping might hand in)."""


def test_an_unheld_row_whose_table_the_fast_checks_refuse_is_staged_by_the_general_path(decoding):
    prop, states, positions, tokens, hiddens = decoding
    table = states[5].table  # row 5 needs a new block this step
    table.blocks = TrackedBlocks(table.blocks)
    prop.propose_batch(tokens, hiddens, positions, 2, states)
    assert torch.equal(staged_meta(prop), fresh_pack(prop, states, positions))
