"""The compiled batch kernel (runtime/native/batch_kernel.c) equals its numpy twin on random batches.

Design note "flat kernel" (runtime/native/batch_kernel.py): the same arguments, the same answers,
the same bytes written. Each case draws a persistent batch (keys, lengths, budgets, block tables
with holes, a pool with few or many free blocks), a batch of rows (some stale, repeated, out of
range, over budget or short of blocks, so every status is reached), and runs place, write,
commit and verify on copies of the same buffers with both: the same blocks mapped from the pool in the same
order, the same blocks given back behind each window.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from draftgraph.runtime.native import batch_kernel as twin
from draftgraph.runtime.native import build

S, M, BS, WINDOW, VOCAB, P = 12, 20, 16, 40, 50, 400
MAX_SEQ = (M - 1) * BS  # every position has a table entry, and so does position + K - 1


@pytest.fixture(scope="module")
def native():
    module = build.load("batch_kernel")
    if module is None:
        pytest.skip(f"the C twin does not build here: {build.why_not('batch_kernel')}")
    return module


def persistent(rng: random.Random) -> dict[str, np.ndarray]:
    """Tables whose blocks are OWNED in the pool, the rest of the pool a shuffled free stack."""
    tables = np.full((S, M), -1, dtype=np.int32)
    blocks = iter(rng.sample(range(P), P))
    for row in tables:
        lo, hi = sorted(rng.sample(range(M + 1), 2))
        row[lo:hi] = [next(blocks) for _ in range(hi - lo)]
        for _ in range(rng.randrange(3)):
            row[rng.randrange(M)] = -1
    state = np.zeros(P, dtype=np.int8)
    state[tables[tables >= 0]] = 1
    free = [b for b in range(P) if not state[b]]
    rng.shuffle(free)
    top = len(free) if rng.random() < 0.8 else rng.randrange(0, 4)  # now and then a pool nearly dry
    stack = np.zeros(P, dtype=np.int32)
    stack[:top] = free[:top]
    state[free[top:]] = 2  # blocks neither owned nor free: carried elsewhere (LOOSE)
    rows = np.arange(S, dtype=np.int64)
    return {
        "key": np.array([rng.choice([0, *[rng.randrange(1, 1 << 40)] * 3]) for _ in range(S)], dtype=np.int64)
        << twin.ROW_BITS | rows,
        "seq_len": np.array([rng.randrange(0, MAX_SEQ) for _ in range(S)], dtype=np.int64),
        "kv_start": np.array([rng.randrange(0, 200) for _ in range(S)], dtype=np.int64),
        "max_positions": np.array([MAX_SEQ if rng.random() < 0.9 else rng.randrange(1, MAX_SEQ + 1) for _ in range(S)],
                                  dtype=np.int64),
        "tables": tables,
        "last_drafted": np.zeros(S, dtype=np.int64),
        "verify_due": np.zeros(S, dtype=bool),
        "num_trimmed": np.array([rng.randrange(0, 6) for _ in range(S)], dtype=np.int64),
        "block_state": state,
        "free_stack": stack,
        "free_top": np.array([top], dtype=np.int64),
    }


def batch(rng: random.Random, seqs, n: int, k: int):
    live = [r for r in range(S) if seqs["key"][r]]
    keys = [int(seqs["key"][r]) for r in (rng.sample(live, min(n, len(live))) if live else [])]
    for _ in range(rng.choice([0, 0, 0, 1])):  # now and then one bad item
        if not keys:
            break
        i = rng.randrange(len(keys))
        keys[i] = rng.choice([keys[i] + (1 << twin.ROW_BITS), 0, S + 3, keys[0]])
    m = len(keys)
    tokens = [rng.choice([-1, VOCAB]) if rng.random() < 0.02 else rng.randrange(VOCAB) for _ in range(m)]
    pos = [rng.choice([-1, MAX_SEQ]) if rng.random() < 0.02 else rng.randrange(MAX_SEQ - k) for _ in range(m)]
    return (np.array(x, dtype=np.int64) for x in (keys, tokens, pos))


POOL = ("tables", "num_trimmed", "block_state", "free_stack", "free_top")


def bind(kernel, arrays: dict[str, np.ndarray]):
    """The kernel's bound state over ``arrays`` (the rows' and the pool's, by name) and the test's sizes."""
    names = ("key", "seq_len", "kv_start", "max_positions", "last_drafted", "verify_due", "tables", "num_trimmed",
             "block_state", "free_stack", "free_top")
    return kernel.bind(*(arrays[name] for name in names), VOCAB, MAX_SEQ, BS, WINDOW)


def run_place(kernel, seqs, keys, tokens, pos, k, room: int | None = None):
    """place on copies of the pool's arrays: (answer, kv, mapped pairs, the arrays after).

    ``k``: an int (every row's span, as a propose passes it) or one span per row (a catch-up's)."""
    after = {name: seqs[name].copy() for name in POOL}
    spans = np.array([k] if np.ndim(k) == 0 else k, dtype=np.int64)
    kv = np.full(len(pos), -7, dtype=np.int64)
    mapped = np.full(4 * len(pos) if room is None else 2 * room, -7, dtype=np.int64)
    status, index, m = kernel.place(bind(kernel, {**seqs, **after}), keys, tokens, pos, spans, kv, mapped)
    return (status, index, m), kv, mapped[: 2 * m], after


@pytest.mark.parametrize("seed", range(40))
def test_place_write_and_commit_equal_the_twin(native, seed):
    rng = random.Random(seed)
    seqs = persistent(rng)
    statuses = set()
    for _ in range(30):
        k = rng.randrange(1, 9)
        keys, tokens, pos = batch(rng, seqs, rng.randrange(1, 9), k)
        # half the batches place a span per row (a catch-up's rows), within K: the commit below holds
        spans = k if rng.random() < 0.5 else [rng.randrange(1, k + 1) for _ in pos]
        got, want = run_place(native, seqs, keys, tokens, pos, spans), run_place(twin, seqs, keys, tokens, pos, spans)
        assert got[0] == want[0]
        statuses.add(got[0][0])
        for name in POOL:  # refused: nothing changed; placed: the same blocks mapped, in the same order
            assert np.array_equal(got[3][name], want[3][name]), name
        if got[0][0] != twin.OK:
            assert all(np.array_equal(got[3][name], seqs[name]) for name in POOL)
            continue
        assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])
        seqs.update(want[3])  # the batch's blocks are mapped from here on
        kv = want[1]
        # write: the same bytes, from a buffer holding an earlier batch's rows
        batch_rows, row_bytes, columns = 8, 384, 4
        meta = np.frombuffer(rng.randbytes(batch_rows * row_bytes), dtype=np.uint8).copy()
        token_buf = np.arange(batch_rows, dtype=np.int64)
        live = rng.randrange(len(pos), batch_rows + 1)
        outs = []
        for kernel in (native, twin):
            m, t = meta.copy(), token_buf.copy()
            n = kernel.write(m, row_bytes, M, columns, WINDOW, BS, seqs["tables"], keys, pos, kv, t, tokens, live)
            outs.append((n, m, t))
        assert outs[0][0] == outs[1][0] == len(pos)
        assert np.array_equal(outs[0][1], outs[1][1]) and np.array_equal(outs[0][2], outs[1][2])
        # commit: the same arrays written, the same kept counts, the same blocks given back
        drafts = np.array([[rng.choice([1, 2, 3]) for _ in range(k)] for _ in pos], dtype=np.int64)
        gated = rng.random() < 0.5
        if gated:
            for row in drafts:
                row[rng.randrange(1, k + 1):] = twin.CUT
        results = []
        for kernel in (native, twin):
            state = {name: seqs[name].copy() for name in ("seq_len", "kv_start", "last_drafted", "verify_due", *POOL)}
            kept = np.zeros(len(pos), dtype=np.int64)
            freed = kernel.commit(bind(kernel, {**seqs, **state}), keys, pos, kv, drafts, k, gated, kept)
            results.append((freed, kept, state))
        (f0, kept0, s0), (f1, kept1, s1) = results
        assert f0 == f1 and np.array_equal(kept0, kept1)
        assert all(np.array_equal(s0[name], s1[name]) for name in s0)
        seqs.update(s1)
        # verify (after_verify of the batch): counts now and then out of range, a key now and then
        # stale, repeated or of a row with no propose to verify
        vkeys = keys.copy()
        if rng.random() < 0.15:
            live = [int(x) for x in seqs["key"] if x and not seqs["verify_due"][int(x) & twin.ROW_MASK]]
            vkeys[rng.randrange(len(vkeys))] = rng.choice([0, vkeys[0], *live])
        accepted = np.array([rng.randrange(0, int(c) + 1) if rng.random() < 0.97 else rng.choice([-1, int(c) + 1])
                             for c in np.maximum(seqs["last_drafted"][vkeys & twin.ROW_MASK], 1)], dtype=np.int64)
        results = []
        for kernel in (native, twin):
            state = {name: seqs[name].copy() for name in ("seq_len", "verify_due", *POOL)}
            answer = kernel.verify(bind(kernel, {**seqs, **state}), vkeys, accepted)
            results.append((answer, state))
        (a0, s0), (a1, s1) = results
        assert a0 == a1
        assert all(np.array_equal(s0[name], s1[name]) for name in s0)
        VERIFY_STATUSES.add(a0[0])
        if a0[0] != twin.OK:
            assert all(np.array_equal(s1[name], seqs[name]) for name in s1)
        seqs.update(s1)
    STATUSES.update(statuses)


STATUSES: set[int] = set()
VERIFY_STATUSES: set[int] = set()


def test_the_random_batches_reach_every_answer(native):
    """Run after the cases above (file order): between them they met every status place has."""
    if not STATUSES:
        pytest.skip("run with the random cases")
    assert STATUSES == {twin.OK, twin.STALE, twin.TWICE, twin.TOKEN, twin.POSITION, twin.BUDGET, twin.POOL}
    assert VERIFY_STATUSES == {twin.OK, twin.STALE, twin.TWICE, twin.COUNT, twin.UNPROPOSED}


def test_every_refusal_names_its_first_bad_row():
    key = lambda serial, row: serial << twin.ROW_BITS | row  # noqa: E731
    seqs = {"key": np.array([key(5, 0), key(6, 1), 0], dtype=np.int64), "seq_len": np.zeros(3, dtype=np.int64),
            "kv_start": np.zeros(3, dtype=np.int64), "max_positions": np.full(3, 100, dtype=np.int64),
            "tables": np.full((3, M), -1, dtype=np.int32), "num_trimmed": np.zeros(3, dtype=np.int64),
            "last_drafted": np.zeros(3, dtype=np.int64), "verify_due": np.zeros(3, dtype=bool),
            "block_state": np.zeros(P, dtype=np.int8), "free_stack": np.arange(P, dtype=np.int32),
            "free_top": np.array([1], dtype=np.int64)}
    good = np.array([key(5, 0), key(6, 1)], dtype=np.int64)
    tok, pos = np.array([1, 2], dtype=np.int64), np.array([3, 4], dtype=np.int64)
    cases = [
        (np.array([key(5, 0), 2]), tok, pos, 1, (twin.STALE, 1)),
        (np.array([key(5, 0), key(9, 1)]), tok, pos, 1, (twin.STALE, 1)),
        (np.array([key(5, 0), key(5, 0)]), tok, pos, 1, (twin.TWICE, 1)),
        (good, np.array([1, VOCAB]), pos, 1, (twin.TOKEN, 1)),
        (good, tok, np.array([-1, 4]), 1, (twin.POSITION, 0)),
        (good, tok, np.array([3, 98]), 3, (twin.BUDGET, 1)),
        (good, tok, np.array([3, 15]), 2, (twin.POOL, 3)),  # 1 free block; rows need 1 and 2
    ]
    kernels = [twin] + ([build.load("batch_kernel")] if build.load("batch_kernel") is not None else [])
    for kernel in kernels:
        for keys, tokens, positions, k, want in cases:
            (status, index, m), _, _, after = run_place(kernel, seqs, np.asarray(keys, dtype=np.int64), tokens,
                                                        positions, k)
            assert (status, index) == want, (kernel, keys, status, index, want)
            assert m == 0 and all(np.array_equal(after[name], seqs[name]) for name in POOL)


def test_long_spans_map_every_block_and_need_room_for_them():
    """A catch-up row span crosses several blocks: every missing one is mapped, in row then entry order;
    a mapped_out without room for them all is a ValueError before any change, as is a spans array
    of neither 1 nor n entries."""
    key = lambda serial, row: serial << twin.ROW_BITS | row  # noqa: E731
    seqs = {"key": np.array([key(5, 0), key(6, 1)], dtype=np.int64), "seq_len": np.zeros(2, dtype=np.int64),
            "kv_start": np.zeros(2, dtype=np.int64), "max_positions": np.full(2, MAX_SEQ, dtype=np.int64),
            "tables": np.full((2, M), -1, dtype=np.int32), "num_trimmed": np.zeros(2, dtype=np.int64),
            "last_drafted": np.zeros(2, dtype=np.int64), "verify_due": np.zeros(2, dtype=bool),
            "block_state": np.zeros(P, dtype=np.int8), "free_stack": np.arange(P, dtype=np.int32),
            "free_top": np.array([P], dtype=np.int64)}
    seqs["tables"][1, 1] = P - 1  # row 1 holds its second block already
    seqs["block_state"][P - 1], seqs["free_top"][0] = 1, P - 1
    keys, tokens = seqs["key"].copy(), np.zeros(2, dtype=np.int64)
    pos, spans = np.array([5, 0], dtype=np.int64), [3 * BS, 2 * BS + 1]  # 4 blocks of row 0; 3 of row 1 (1 held)
    kernels = [twin] + ([build.load("batch_kernel")] if build.load("batch_kernel") is not None else [])
    for kernel in kernels:
        (status, _, m), kv, mapped, after = run_place(kernel, seqs, keys, tokens, pos, spans, room=6)
        assert (status, m) == (twin.OK, 6)
        assert mapped.reshape(-1, 2).tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 2]]
        assert (after["tables"][0, :4] >= 0).all() and (after["tables"][1, :3] >= 0).all()
        assert kv.tolist() == [5, 0]  # row 0 jumps ahead of its (empty) rows; row 1 continues them
        with pytest.raises(ValueError, match="room"):
            run_place(kernel, seqs, keys, tokens, pos, spans, room=5)
        with pytest.raises(ValueError, match="spans"):
            run_place(kernel, seqs, keys, tokens, pos, [1, 2, 3])


@pytest.mark.parametrize("seed", range(20))
def test_check_keys_loop_and_array_ops_agree(monkeypatch, seed):
    """check_keys answers the same by its small-batch loop and by its array ops (stale, repeated, fine)."""
    rng = random.Random(seed)
    seq_key = np.array([rng.choice([0, rng.randrange(1, 1 << 30)]) << twin.ROW_BITS | r for r in range(S)],
                       dtype=np.int64)
    live = [int(k) for k in seq_key if k]
    for _ in range(30):
        keys = [rng.choice(live) for _ in range(rng.randrange(1, 6))] if live else [0]
        if rng.random() < 0.3:
            keys[rng.randrange(len(keys))] = rng.choice([0, keys[0] + (1 << twin.ROW_BITS), S + 2])
        keys = np.array(keys, dtype=np.int64)
        rows = keys & twin.ROW_MASK
        answers = []
        for small in (twin.SMALL_BATCH, 0):
            monkeypatch.setattr(twin, "SMALL_BATCH", small)
            answers.append(twin.check_keys(keys, rows, seq_key))
        assert answers[0] == answers[1], (keys, answers)
