"""One proposer shared by threads that use separate states drafts what sequential calls draft.

Design note "threads" (runtime/proposer/proposer.py): every call holds the proposer's lock. Four
threads each run 200 mixed calls (prefill, propose, a batched propose, after_verify, catch-up,
carrying a sequence's KV out and back, freeing and allocating) on states of their own, the calls
decided by each thread's own seed and results; then the same four scripts run one after another
on a fresh proposer with the same weights. Every result must be the same, call for call, and
the pool must end exact.
"""

from __future__ import annotations

import random
import threading

import torch
from draftgraph.runtime.errors import DraftGraphError
from proposer_fixtures import TINY, hidden, make_proposer

THREADS, CALLS = 4, 200


def script(prop, seed: int, calls: int = CALLS) -> list:
    """A thread's calls on states of its own; its log: (call, result) pairs, errors included."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    log: list = []

    def fresh():
        state = prop.alloc_state()
        prompt = [rng.randrange(TINY.vocab_size) for _ in range(rng.randrange(2, 20))]
        log.append(("prefill", prop.prefill_drafter(prompt, hidden(TINY, gen, n=len(prompt)), state)))
        return state

    states = [fresh(), fresh()]
    while len(log) < calls:
        op = rng.choice(["propose", "propose", "batch", "batch", "verify", "catchup", "carry", "renew", "rows"])
        i = rng.randrange(2)
        state = states[i]
        try:
            if op == "propose":
                result = prop.propose(rng.randrange(TINY.vocab_size), hidden(TINY, gen), state.seq_len,
                                      rng.randrange(1, 5), state)
            elif op == "batch":
                result = prop.propose_batch([rng.randrange(TINY.vocab_size) for _ in states],
                                            hidden(TINY, gen, n=2), [s.seq_len for s in states], 2, states)
            elif op == "verify":
                result = prop.after_verify(rng.randrange(0, max(state.last_num_drafted, 1) + 1), state)
            elif op == "catchup":
                n = rng.randrange(1, 4)
                result = prop.catchup_drafter([rng.randrange(TINY.vocab_size) for _ in range(n)],
                                              hidden(TINY, gen, n=n), state.seq_len, state.seq_len, state)
            elif op == "carry":
                carried = prop.take_drafter_kv(state)
                result = ("taken", None if carried is None else (carried[1], carried[2]))
                if carried is not None:
                    result += (prop.install_drafter_kv(state, carried, carried[1], carried[2]),)
            elif op == "renew":
                prop.free_state(state)
                states[i] = fresh()
                result = "renewed"
            else:
                result = (prop.drafter_rows(state), prop.last_pair_key(state))
        except DraftGraphError as exc:
            result = ("error", type(exc).__name__, str(exc))
        log.append((op, result))
    for state in states:
        prop.free_state(state)
    return log


def test_threads_sharing_a_proposer_draft_what_sequential_calls_draft():
    shared = make_proposer(TINY)
    logs: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(seed):
        try:
            logs[seed] = script(shared, seed)
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    alone = make_proposer(TINY)
    for seed in range(THREADS):
        want = script(alone, seed)
        got = logs[seed]
        assert len(got) == len(want)
        for at, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"thread {seed}, call {at}: {g} != {w} (sequentially)"
        assert sum(op in ("propose", "batch") and not (isinstance(r, tuple) and r[0] == "error")
                   for op, r in got) > 40  # the scripts really propose
    for prop in (shared, alone):
        assert prop.cache.num_free_blocks == prop.cache.num_blocks
        assert prop.cache.block_states == [0] * prop.cache.num_blocks and prop.rows.num_live == 0
