"""10,000 random calls on one shared proposer, good and bad mixed, from four threads.

Good calls include device proposes with catch-up rows (propose_device then after_verify_device) and
hiddens that require grad. Every bad call (a token or position out of range, a bool count, a freed
or foreign state, the same state twice, an after_verify with no propose to verify, a NaN hidden, a
list of hiddens to prefill, a K out of range, a mask of the wrong length, an install into a table
that holds blocks, a double free) must raise a DraftGraphError and leave the calling thread's
states as they were; every good one must work. At the end, with every state freed, the pool is
exact: every block free, each once, and no block owned or carried.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import torch
from draftgraph.runtime.cache.hidden_rows import HiddenRows
from draftgraph.runtime.cache.paged_cache import FREE
from draftgraph.runtime.errors import DraftGraphError
from proposer_fixtures import TINY, hidden, make_proposer

THREADS, CALLS = 4, 2_500
V = TINY.vocab_size


class Bad(Exception):
    """A call the script meant as misuse went through."""


def fuzz(prop, foreign, seed: int, counts: dict) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    states = [prop.alloc_state() for _ in range(3)]
    freed = prop.alloc_state()
    prop.free_state(freed)
    carried: list = []

    def snapshot():
        return [s.snapshot() for s in states]

    def good(op, state):
        if op == "propose":
            h = hidden(TINY, gen)
            if rng.random() < 0.25:  # straight from a forward under autograd (the lock turns it off)
                h.requires_grad_()
            prop.propose(rng.randrange(V), h, state.seq_len, rng.randrange(1, 4), state)
        elif op == "batch":
            pick = rng.sample(states, rng.randrange(1, 4))
            prop.propose_batch([rng.randrange(V) for _ in pick], hidden(TINY, gen, n=len(pick)),
                               np.array([s.seq_len for s in pick]), rng.randrange(1, 4), pick)
        elif op == "verify":
            if state.awaiting_verify:
                prop.after_verify(np.int64(rng.randrange(0, state.last_num_drafted + 1)), state)
        elif op == "verify_batch":
            pick = [s for s in states if s.awaiting_verify]
            if pick:
                prop.after_verify_batch(np.array([rng.randrange(0, s.last_num_drafted + 1) for s in pick]), pick)
        elif op == "catchup":
            n = rng.randrange(1, 5)
            prop.catchup_drafter([rng.randrange(V) for _ in range(n)], hidden(TINY, gen, n=n), state.seq_len,
                                 state.seq_len, state)
        elif op == "device" and not state.awaiting_verify:
            # a device propose writing n catch-up rows in its first step, finished at once
            n, k, at = rng.randrange(0, 3), rng.randrange(1, 4), state.seq_len
            rows = hidden(TINY, gen, n=n)  # as a list of tensors, or as a decode loop passes them: rows by index
            rows = [rows] if rng.random() < 0.5 else HiddenRows(rows, np.arange(n, dtype=np.int64))
            handle = prop.propose_device([rng.randrange(V)], hidden(TINY, gen, n=1), [at + n], k, [state],
                                         catchup=([[rng.randrange(V) for _ in range(n)]], rows, [at]))
            prop.after_verify_device(handle, [rng.randrange(0, k + 1)], dropped=False)
        elif op == "take":
            taken = prop.take_drafter_kv(state)
            if taken is not None:
                carried.append(taken)
        elif op == "install" and carried:
            if not prop.install_drafter_kv(state, carried[-1], carried[-1][1], carried[-1][2]):
                prop.free_drafter_kv(carried[-1])
            carried.pop()
        elif op == "rows":
            assert prop.drafter_rows(state) == state.seq_len - state.kv_start
            assert prop.last_pair_key(state) in (None, state.seq_len - 1)
        elif op == "renew":
            i = states.index(state)
            prop.free_state(state)
            states[i] = prop.alloc_state_for(rng.choice([None, 2000, np.int64(500)]))

    def bad(op, state):
        h = hidden(TINY, gen)
        if op == "token":
            prop.propose(rng.choice([-1, V, True, 2.0, "3"]), h, state.seq_len, 2, state)
        elif op == "position":
            prop.propose(1, h, rng.choice([-1, TINY.max_position_embeddings, False, 1.5]), 2, state)
        elif op == "k":
            prop.propose(1, h, state.seq_len, rng.choice([0, 9, True, 2.0]), state)
        elif op == "count":
            prop.after_verify(rng.choice([True, -1, 1.0, 99]), state)
        elif op == "state":
            prop.propose(1, h, 0, 2, rng.choice([freed, foreign, object()]))
        elif op == "twice":
            prop.propose_batch([1, 2], hidden(TINY, gen, n=2), [state.seq_len] * 2, 2, [state, state])
        elif op == "nan":
            h[rng.randrange(TINY.hc_mult), rng.randrange(TINY.hidden_size)] = rng.choice([float("nan"), float("inf")])
            prop.propose(1, h, state.seq_len, 2, state)
        elif op == "listed":
            prop.prefill_drafter([1, 2], [h, h], state)
        elif op == "mask":
            prop.propose(1, h, state.seq_len, 2, state, grammar_bitmask=[0] * 3)
        elif op == "reverify":
            prop.after_verify(0, state)
            prop.after_verify(0, state)  # the second, at the latest, has no propose to verify
        elif op == "install":  # the seed's answer to an install that cannot be done is False
            if not state.table.is_empty and prop.install_drafter_kv(state, [0, 1], 20, 19) is not False:
                raise Bad("install into a table holding blocks answered True")
            return
        elif op == "device":  # a catch-up as a decode loop passes it, one thing wrong (design note "checks the
            n, at = 2, state.seq_len  # kernel makes": the kernel's refusals and the checks it leaves)
            rows = HiddenRows(hidden(TINY, gen, n=n), np.arange(n, dtype=np.int64))
            tokens, first, target = [[1, 2]], [at], rng.choice([freed, foreign, state, state, state])
            wrong = rng.choice(["first", "token", "index"]) if target is state else "state"
            if wrong == "first":
                first = [rng.choice([at - 1, -1, TINY.max_position_embeddings])]
            elif wrong == "token":
                tokens = [[1, rng.choice([-1, V])]]
            elif wrong == "index":
                rows = HiddenRows(rows.tensor, np.array([0, n], dtype=np.int64))
            prop.propose_device([1], hidden(TINY, gen, n=1), [at + n], 2, [target], catchup=(tokens, rows, first))
        elif op == "double":
            doomed = prop.alloc_state()
            prop.free_state(doomed)
            prop.free_state(doomed)
        raise Bad(f"bad call {op!r} went through")

    for _ in range(CALLS):
        state = rng.choice(states)
        if rng.random() < 0.45:
            op = rng.choice(["token", "position", "k", "count", "state", "twice", "nan", "listed", "mask",
                             "reverify", "install", "double", "device"])
            before = snapshot()
            try:
                bad(op, state)
            except DraftGraphError:
                pass
            assert snapshot() == before or op == "reverify", op  # a reverify's first call may be good
            counts["bad"] += 1
        else:
            op = rng.choice(["propose", "batch", "verify", "verify_batch", "catchup", "device", "take", "install",
                             "renew", "rows", "rows", "rows"])
            good(op, state)
            counts["good"] += 1
    for taken in carried:
        prop.free_drafter_kv(taken)
    for state in states:
        prop.free_state(state)


def test_ten_thousand_random_calls_from_four_threads_leave_the_pool_exact():
    prop, other = make_proposer(TINY), make_proposer(TINY)
    foreign = other.alloc_state()
    counts = {"good": 0, "bad": 0}
    errors: list[BaseException] = []

    def run(seed):
        try:
            fuzz(prop, foreign, seed, counts)
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(THREADS)]
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the calls take turns at the lock: torch's own pool only adds contention
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(torch_threads)
    assert not errors, errors
    assert counts["good"] + counts["bad"] == THREADS * CALLS and min(counts.values()) > 3_000
    cache = prop.cache
    assert cache.num_free_blocks == cache.num_blocks and prop.rows.num_live == 0
    assert sorted(cache._free) == list(range(cache.num_blocks))
    assert (cache.block_state == FREE).all() and (prop.rows.tables[prop.rows.key == 0] >= -1).all()
