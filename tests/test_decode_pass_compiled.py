"""The compiled loop of the one pass decides as the Python loop does (design note "compiled pass").

Batches of a decoding proposer, each with a few rows spoiled at random (tokens, positions and
states of other types or out of range, freed or foreign states, tables shared, resized, of
other types or edited by hand, sequences that are not lists): both loops, from the same staging
buffer, give the same answer (the unheld rows, None, or the same exception), the same bytes and
the same per-row records. The compiled loop must also take the usual batch itself.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import draftgraph.runtime.proposer.front as decode_pass
import numpy as np
import pytest
import torch
from draftgraph.runtime.cache.metadata import BLOCK_TABLE_OFFSET, pack_metadata
from draftgraph.runtime.cache.paged_cache import OWNED, BlockTable
from draftgraph.runtime.native import build as native_build
from draftgraph.runtime.proposer.state import MtpProposerState
from native_fixtures import compiled, switch, use_compiled
from proposer_fixtures import TINY, hidden, make_proposer

BUCKET = 8


@pytest.fixture(scope="module")
def native():
    return compiled("decode_pass")


class TrackedBlocks(list):
    """A block list of another type."""


class TrackedTable(BlockTable):
    """A table of another type (an engine's subclass)."""


class LookalikeTable:
    """An object with a table's attributes, of no table type."""

    def __init__(self, blocks, block_size, cache_id, num_trimmed) -> None:
        self.blocks, self.block_size, self.cache_id, self.num_trimmed = blocks, block_size, cache_id, num_trimmed
        self.pass_mark = 0


class TrackedState(MtpProposerState):
    """A state of another type."""


def spoil(rng: random.Random, prop, states, tokens, positions, i: int) -> str:
    """Spoil row ``i`` one way; returns what was done (for the failure message)."""
    state = states[i]
    if not hasattr(state, "table"):  # spoiled already as a whole
        return "spoiled already"
    kind = rng.choice([
        "token_range", "token_bool", "token_float", "token_numpy", "position_range", "position_float",
        "position_numpy", "position_bool", "foreign_state", "freed_state", "twin", "kv_start_negative",
        "kv_start_ahead", "owner_float", "is_freed_int", "max_positions", "blocks_tuple", "blocks_subclass",
        "blocks_numpy", "block_size", "cache_id", "shared_table", "table_edited", "seq_len_behind",
        "not_a_state", "position_huge", "ensured_ahead", "ensured_ahead", "table_subclass", "table_lookalike",
        "table_lookalike", "state_subclass",
    ])
    if kind == "token_range":
        tokens[i] = rng.choice([-1, TINY.vocab_size, 2**70])
    elif kind == "token_bool":
        tokens[i] = True
    elif kind == "token_float":
        tokens[i] = float(tokens[i])
    elif kind == "token_numpy":
        tokens[i] = np.int64(tokens[i])
    elif kind == "position_range":
        positions[i] = rng.choice([-1, TINY.max_position_embeddings, TINY.max_position_embeddings - 1])
    elif kind == "position_float":
        positions[i] = float(positions[i])
    elif kind == "position_numpy":
        positions[i] = np.int64(positions[i])
    elif kind == "position_bool":
        positions[i] = False
    elif kind == "position_huge":
        positions[i] = 2**64
    elif kind == "foreign_state":
        states[i] = make_proposer(TINY).alloc_state()
    elif kind == "freed_state":
        if isinstance(state.table, BlockTable):
            prop.free_state(state)
        else:  # a lookalike table spoiled before: the cache cannot give its blocks back
            state.is_freed = True
    elif kind == "twin":
        states[i] = states[(i + 1) % len(states)]
    elif kind == "kv_start_negative":
        state.kv_start = -3
    elif kind == "kv_start_ahead":
        state.kv_start = positions[i] + 1
    elif kind == "owner_float":
        state.owner = float(state.owner)  # equal: the Python loop takes it
    elif kind == "is_freed_int":
        state.is_freed = 0  # falsy: the Python loop takes it
    elif kind == "max_positions":
        state.max_positions = positions[i]
    elif kind == "blocks_tuple":
        state.table.blocks = tuple(state.table.blocks)
    elif kind == "blocks_subclass":
        state.table.blocks = TrackedBlocks(state.table.blocks)
    elif kind == "blocks_numpy":
        state.table.blocks = [np.int32(b) for b in state.table.blocks]
    elif kind == "block_size":
        state.table.block_size = 8
    elif kind == "cache_id":
        state.table.cache_id = 10**6
    elif kind == "shared_table":
        states[(i + 1) % len(states)].table = state.table
    elif kind == "table_edited":
        blocks = state.table.blocks
        if blocks:
            blocks[rng.randrange(len(blocks))] = rng.choice([-1, 0, 10**6])
    elif kind == "ensured_ahead":  # an engine's own ensure: the table grows past the staged entries
        p = positions[i] if type(positions[i]) is int and 0 <= positions[i] < 400 else 0
        prop.cache.ensure(state.table, p, min(p + rng.randrange(1, 40), TINY.max_position_embeddings - 1))
    elif kind == "table_subclass":  # read by name, not by slot offset, in the compiled loop
        t = state.table
        state.table = TrackedTable(blocks=t.blocks, block_size=t.block_size, cache_id=t.cache_id,
                                   num_trimmed=t.num_trimmed)
    elif kind == "table_lookalike":  # not a BlockTable at all: read by name
        t = state.table
        state.table = LookalikeTable(t.blocks, t.block_size, t.cache_id, t.num_trimmed)
    elif kind == "state_subclass":
        states[i] = TrackedState(**{f.name: getattr(state, f.name) for f in dataclasses.fields(state)})
    elif kind == "seq_len_behind":
        state.seq_len = positions[i] - 1
    else:
        states[i] = object()
    return kind


def spoiled_batch(rng: random.Random, gen: torch.Generator) -> tuple:
    """(proposer, batch, tokens, positions, spoils): a fresh proposer's states after one propose,
    the first n of them at their next positions (or past them), with 0-2 rows spoiled."""
    prop = make_proposer(TINY, buckets=(BUCKET,))
    states = [prop.alloc_state() for _ in range(BUCKET)]
    positions = [rng.randrange(0, 80) for _ in states]
    prop.propose_batch(list(range(BUCKET)), [hidden(TINY, gen) for _ in states], positions, 2, states)
    for state in states:
        prop.after_verify(rng.randrange(0, 3), state)
    n = rng.randrange(1, BUCKET + 1)
    batch = states[:n]
    positions = [s.seq_len + rng.choice([0, 0, 1, 20]) for s in batch]
    tokens = [rng.randrange(TINY.vocab_size) for _ in batch]
    kinds = [spoil(rng, prop, batch, tokens, positions, rng.randrange(n)) for _ in range(rng.choice([0, 1, 1, 2]))]
    return prop, batch, tokens, positions, kinds


def run_pass(prop, staging, states, tokens, positions, k):
    """One pass; returns (answer, bytes, records): the unheld rows / None / the exception's type."""
    try:
        usual = decode_pass.stage_usual_batch(staging.writer, prop.cache, states, tokens, positions, k, prop.id,
                                              TINY.vocab_size)
        answer = None if usual is None else usual.unheld
    except Exception as exc:  # both loops must raise the same
        answer = type(exc)
    return answer, staging.host_buf.clone(), list(staging.writer.row_sink()[2])


def test_both_loops_decide_alike_on_spoiled_batches(native, monkeypatch):
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    seen = {"pass": 0, "none": 0, "raised": 0}
    for trial in range(150):
        prop, batch, tokens, positions, kinds = spoiled_batch(rng, gen)
        shape = rng.choice(["list", "list", "tuple", "iterator"])
        if shape == "tuple":
            batch, tokens = tuple(batch), tuple(tokens)
        k = rng.choice([1, 2, 3])
        staging = prop._staging_for(BUCKET)
        start = (staging.host_buf.clone(), list(staging.writer.row_sink()[2]))
        results = []
        for loop in (native, None):
            monkeypatch.setitem(native_build._loaded, "decode_pass", loop)  # the pass alone
            staging.host_buf.copy_(start[0])
            staging.writer.row_sink()[2][:] = start[1]
            tables = copy.deepcopy([getattr(s, "table", None) for s in batch])  # pass marks aside, unchanged
            given = iter(positions) if shape == "iterator" else positions  # a fresh one for each loop
            results.append(run_pass(prop, staging, batch, tokens, given, k))
            after = [getattr(s, "table", None) for s in batch]
            assert [(t.blocks, t.cache_id) if t is not None else None for t in tables] == [
                (t.blocks, t.cache_id) if t is not None else None for t in after]
        (native_answer, native_bytes, native_records), (py_answer, py_bytes, py_records) = results
        message = f"trial {trial}: spoiled {kinds}, {shape}, k={k}"
        assert native_answer == py_answer, message
        assert torch.equal(native_bytes, py_bytes), message
        assert native_records == py_records, message
        seen["raised" if isinstance(py_answer, type) else "none" if py_answer is None else "pass"] += 1
    assert seen["pass"] > 30 and seen["none"] > 30, seen


def test_the_compiled_loop_takes_the_usual_batch_itself(native):
    gen = torch.Generator().manual_seed(2)
    prop = make_proposer(TINY, buckets=(BUCKET,))
    states = [prop.alloc_state() for _ in range(BUCKET)]
    positions = [2 + 16 * i for i in range(BUCKET)]  # every row stays inside its block
    prop.propose_batch(list(range(BUCKET)), [hidden(TINY, gen) for _ in states], positions, 2, states)
    for state in states:
        prop.after_verify(2, state)
    positions = [s.seq_len for s in states]
    staging = prop._staging_for(BUCKET)
    staging.writer.save()
    answer = native.stage_rows(states, list(range(BUCKET)), positions, 2, prop.id, TINY.vocab_size, 10**9,
                               type(states[0]), staging.writer.row_sink()[0], staging.writer.row_sink()[1],
                               staging.writer.row_sink()[2], prop.cache.block_states, prop.cache.block_size,
                               prop.cache.cache_id, prop.cache.max_seq_len, staging.writer.window,
                               staging.writer.max_blocks, BLOCK_TABLE_OFFSET, OWNED, BlockTable)
    assert answer == [], answer  # every row held and staged by the compiled loop, none left to Python


def spoil_table(rng: random.Random, prop, state, holders: list) -> str:
    """Spoil a table the ensure reads (or leave it; ``holders`` take a drained pool's blocks); returns what was done."""
    table = state.table
    kind = rng.choice(["none"] * 2 + ["edited_held", "foreign_block", "cache_id", "subclass", "numpy_entry",
                                      "trimmed_high", "drained_pool"])
    held = [j for j, b in enumerate(table.blocks) if b >= 0]
    if kind == "edited_held" and held:
        table.blocks[rng.choice(held)] = rng.choice(table.blocks[:1] + [10**6])
    elif kind == "foreign_block" and table.blocks:
        loose = [b for b in range(prop.cache.num_blocks) if prop.cache.block_states[b] != 1]
        if loose:
            table.blocks[-1] = rng.choice(loose)
    elif kind == "cache_id" and held:
        table.cache_id = 10**6
    elif kind == "subclass":
        state.table = TrackedTable(blocks=table.blocks, block_size=table.block_size, cache_id=table.cache_id,
                                   num_trimmed=table.num_trimmed)
    elif kind == "numpy_entry" and held:
        table.blocks[held[-1]] = np.int64(table.blocks[held[-1]])
    elif kind == "trimmed_high":
        table.num_trimmed = len(table.blocks) + 3  # past the end: no entry to read
    elif kind == "drained_pool":
        keep = rng.randrange(0, 3)
        while prop.cache.num_free_blocks > keep:
            holders.append(BlockTable())
            prop.cache.ensure(holders[-1], 0, 0)
    return kind


def repair(prop, states) -> None:
    """Undo the tables' spoils: entries of blocks not owned, or claimed by an earlier table, dropped; ints; own id."""
    seen = set()
    for state in states:
        table, kept = state.table, []
        for b in table.blocks:
            b = int(b)
            is_own = 0 <= b < prop.cache.num_blocks and prop.cache.block_states[b] == 1 and b not in seen
            kept.append(b if is_own else -1)
            seen.add(b)
        cache_id = prop.cache.cache_id if any(b >= 0 for b in kept) else 0
        if type(table) is not BlockTable or kept != table.blocks or table.cache_id != cache_id:
            state.table = BlockTable(blocks=kept, block_size=table.block_size, cache_id=cache_id)


def world(prop, states, outcome) -> tuple:
    """Everything a propose may change: its answer, the pool, the tables, the states, the staged bytes."""
    cache = prop.cache
    own = {cache.cache_id: "own", 0: 0}  # the twins' caches have ids of their own
    tables = [(list(s.table.blocks), s.table.num_trimmed, own.get(s.table.cache_id, s.table.cache_id),
               type(s.table).__name__) for s in states]
    fields = [(s.seq_len, s.kv_start, s.last_num_drafted) for s in states]
    return (outcome, list(cache._free), list(cache.block_states), tables, fields,
            prop._staging_for(BUCKET).host_buf.clone())


def test_both_ensures_leave_the_same_pool_tables_and_rows(native, monkeypatch):
    """Two proposers alike, one with the compiled pass and ensure, one without: after every
    propose (rows crossing into new blocks, tables spoiled, the pool drained now and then)
    they hold the same pool, tables, states and staged bytes, or raised the same error."""
    rng, gen = random.Random(21), torch.Generator().manual_seed(21)
    recorders = use_compiled(monkeypatch, True)
    twins = [make_proposer(TINY, buckets=(BUCKET,), num_cache_blocks=48) for _ in range(2)]
    batches = [[p.alloc_state() for _ in range(BUCKET)] for p in twins]
    positions = [rng.randrange(0, 40) for _ in range(BUCKET)]
    seen, kinds = {"ok": 0, "raised": 0}, set()
    for step in range(150):
        n = rng.randrange(1, BUCKET + 1)
        k = rng.choice([1, 2, 3])
        tokens = [rng.randrange(TINY.vocab_size) for _ in range(n)]
        hiddens = [hidden(TINY, gen) for _ in range(n)]
        spoil_seed, worlds = rng.random(), []
        for prop, states, on in zip(twins, batches, (True, False)):
            switch(monkeypatch, recorders, on)
            local, holders = random.Random(spoil_seed), []  # the same spoils on both twins
            if local.random() < 0.35:  # most often the row likeliest to need a block (its ensure reads the table)
                row = max(range(n), key=lambda i: positions[i] % 16) if local.random() < 0.7 else local.randrange(n)
                kinds.add(spoil_table(local, prop, states[row], holders))
            try:
                prop.propose_batch(tokens, hiddens, positions[:n], k, states[:n])
                outcome = "ok"
            except Exception as exc:
                outcome = type(exc).__name__
            worlds.append(world(prop, states, outcome))
            for holder in holders:  # the pool drained for this step only
                prop.cache.free(holder)
        for a, b in zip(*worlds):
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f"step {step}: {a} != {b}"
        seen["ok" if worlds[0][0] == "ok" else "raised"] += 1
        for prop, states in zip(twins, batches):
            repair(prop, states)
        for i in range(BUCKET):  # the next step: every state alike on both twins
            ok = worlds[0][0] == "ok" and i < n
            if not ok or any(type(states[i].table) is not BlockTable for states in batches) or rng.random() < 0.1:
                for prop, states in zip(twins, batches):
                    prop.free_state(states[i])
                    states[i] = prop.alloc_state()
                positions[i] = rng.randrange(0, 40)
                continue
            accepted = rng.randrange(0, k + 1)
            for prop, states in zip(twins, batches):
                prop.after_verify(accepted, states[i])
            positions[i] += accepted + 1
            if positions[i] + 4 > 200:
                for prop, states in zip(twins, batches):
                    prop.free_state(states[i])
                    states[i] = prop.alloc_state()
                positions[i] = rng.randrange(0, 40)
    assert seen["ok"] > 60 and seen["raised"] > 3 and len(kinds) >= 7, (seen, kinds)
    ensured = recorders["cache_rows"].answers["ensure_tables"]
    deferred = sum(answer is NotImplemented for answer in ensured)
    assert deferred >= 5 and len(ensured) - deferred > 50, (deferred, len(ensured))


def run_front(prop, staging, states, tokens, positions, k):
    """One compiled front; returns (answer, bytes, records, pool): the unheld rows / None / the exception's type."""
    try:
        front = decode_pass.stage_front(staging, prop.cache, states, tokens, positions, k, prop.id, TINY.vocab_size)
        answer = None if front is None else front.unheld
    except Exception as exc:
        answer = type(exc)
    return answer, staging.host_buf.clone(), list(staging.writer.row_sink()[2]), list(prop.cache._free)


def test_the_compiled_front_answers_as_the_pass_and_a_refusal_changes_nothing(monkeypatch):
    """Spoiled batches through the compiled front (design note "compiled front") and through the
    Python pass: the same answer; where the front refuses the batch (None or an error) the
    staging buffer, its records and the pool are as they were, and where it takes a batch that
    needed blocks, it mapped them (or left the ensure to the proposer) and wrote every row,
    the padding and the tokens as a fresh stage does."""
    rng, gen = random.Random(31), torch.Generator().manual_seed(31)
    recorders = use_compiled(monkeypatch, True)
    seen = {"taken": 0, "refused": 0, "ensured": 0}
    for trial in range(150):
        prop, batch, tokens, positions, kinds = spoiled_batch(rng, gen)
        n = len(batch)
        k = rng.choice([1, 2, 3])
        staging = prop._staging_for(BUCKET)
        start = (staging.host_buf.clone(), list(staging.writer.row_sink()[2]), list(prop.cache._free))
        tables = copy.deepcopy([getattr(s, "table", None) for s in batch])
        switch(monkeypatch, recorders, False)  # the Python pass's answer, then the buffer as it was
        py_answer = run_pass(prop, staging, batch, tokens, positions, k)[0]
        staging.host_buf.copy_(start[0])
        staging.writer.row_sink()[2][:] = start[1]
        switch(monkeypatch, recorders, True)
        answer, after, records, free = run_front(prop, staging, batch, tokens, positions, k)
        message = f"trial {trial}: spoiled {kinds}, k={k}"
        assert answer == py_answer, message
        if answer is None or isinstance(answer, type):
            seen["refused"] += 1
            assert torch.equal(after, start[0]) and records == start[1] and free == start[2], message
            assert [(t.blocks, t.cache_id) if t is not None else None for t in tables] == [
                (s.table.blocks, s.table.cache_id) if hasattr(s, "table") else None for s in batch], message
            continue
        seen["taken"] += 1
        front = recorders["decode_pass"].answers["stage_batch"][-1]
        if front is NotImplemented or not front[2]:
            continue  # left to the proposer's general path, which the twin test compares
        seen["ensured"] += bool(answer)
        assert len(free) == len(start[2]) - sum(len(new) for _, _, new in front[1] or []), message
        rows = [(p, s.kv_start if s.kv_start <= p <= s.seq_len else p, s.table) for s, p in zip(batch, positions)]
        fresh = pack_metadata(rows + [None] * (BUCKET - n), prop.cache.max_blocks_per_seq,
                              window=TINY.sliding_window)
        assert torch.equal(staging.host["meta"].buf, fresh), message
        assert staging.host["token"].tolist() == list(tokens) + [0] * (BUCKET - n), message
    assert seen["refused"] > 30 and seen["taken"] > 30 and seen["ensured"] > 5, seen


def test_both_commits_write_the_same_states(native, monkeypatch):
    """commit_rows compiled and in Python: the same answer and states, from states, positions and
    draft rows of odd types too (which the compiled loop leaves to Python, changing nothing)."""
    rng = random.Random(41)
    seen = set()
    for trial in range(300):
        n, k = rng.randrange(1, 9), rng.randrange(1, 4)
        base = [MtpProposerState(seq_len=rng.randrange(0, 50), kv_start=rng.randrange(0, 50),
                                 last_num_drafted=rng.randrange(0, 4)) for _ in range(n)]
        positions = [rng.randrange(0, 60) for _ in range(n)]
        drafted = [[7] * rng.randrange(0, k + 1) for _ in range(n)]
        kind = rng.choice(["plain"] * 4 + ["numpy_position", "tuple_row", "subclass", "tuple_batch", "short"])
        i = rng.randrange(n)
        if kind == "numpy_position":
            positions[i] = np.int64(positions[i])
        elif kind == "tuple_row":
            drafted[i] = tuple(drafted[i])
        elif kind == "subclass":
            base[i] = TrackedState(seq_len=base[i].seq_len, kv_start=base[i].kv_start)
        elif kind == "tuple_batch":
            positions = tuple(positions)
        elif kind == "short":
            drafted = drafted[:-1]
        seen.add(kind)
        results = []
        for loop in (native, None):
            monkeypatch.setitem(native_build._loaded, "decode_pass", loop)
            states = copy.deepcopy(base)
            try:
                short, tables = decode_pass.commit_rows(states, positions, drafted, k)
                answer = (short, [t is s.table for t, s in zip(tables, states)])
            except Exception as exc:
                answer = type(exc)
            results.append((answer, [(s.seq_len, s.kv_start, s.last_num_drafted) for s in states]))
        assert results[0] == results[1], f"trial {trial}: {kind}"
    assert len(seen) == 6, seen
