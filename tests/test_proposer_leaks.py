"""10,000 random operations (alloc, propose, after_verify, carry, free, errors) leak no block."""

from __future__ import annotations

import random

import torch
from draftgraph.runtime.errors import CacheError, ExecutionError, InputError
from proposer_fixtures import TINY, hidden, make_proposer


class FlakyIdentity:
    """The identity body, failing now and then: exercises the error path of a run.

    Block accounting does not depend on what the body computes, so skipping the real
    body keeps 10,000 operations fast on 2 cores (the real body is tested elsewhere).
    """

    name = "flaky_identity"

    def __init__(self, rng):
        self.rng = rng

    def bind(self, config, weights, device):
        pass

    def workspace_bytes(self, batch):
        return 0

    def __call__(self, streams, positions, kv_cache, kv_start, block_table, workspace):
        if self.rng.random() < 0.05:
            raise RuntimeError("injected runner failure")
        return streams


def test_random_operation_sequences_leave_the_pool_exact():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    prop = make_proposer(TINY, num_cache_blocks=9, buckets=(1, 2, 4))
    prop.set_circuit_draft(FlakyIdentity(random.Random(1)))
    total = prop.cache.num_blocks
    hs = hidden(TINY, gen, n=8)
    live, carried = [], []
    counts = dict.fromkeys(["alloc", "propose", "batch", "verify", "catchup", "take", "install", "drop", "free",
                            "error", "exhausted", "runner_error"], 0)

    def held():
        return sum(len(s.table.held()) for s in live) + sum(len([b for b in c[0] if b >= 0]) for c in carried)

    for _ in range(10_000):
        op = rng.choice(["alloc", "propose", "propose", "batch", "verify", "catchup", "take", "install", "drop",
                         "free", "error"])
        if op == "alloc" and len(live) < 6:
            live.append(prop.alloc_state_for(rng.choice([None, 300])))
            counts["alloc"] += 1
        elif op in ("propose", "batch", "verify", "catchup", "take", "free", "error") and live:
            state = rng.choice(live)
            k = rng.randint(1, 3)
            p = min(max(state.seq_len + rng.randint(-2, 3), 0), state.max_positions - k)
            try:
                if op == "propose":
                    prop.propose(rng.randrange(TINY.vocab_size), hs[rng.randrange(8)], p, k, state)
                elif op == "batch":
                    group = rng.sample(live, min(len(live), rng.randint(1, 3)))
                    pos = [min(s.seq_len, s.max_positions - k) for s in group]
                    prop.propose_batch([1] * len(group), [hs[0]] * len(group), pos, k, group)
                elif op == "verify":
                    prop.after_verify(rng.randint(0, max(state.last_num_drafted, 1)), state)
                elif op == "catchup":
                    n = rng.randint(1, 3)
                    if p + n <= state.max_positions:
                        prop.catchup_drafter([2] * n, hs[:n], p, p, state)
                elif op == "take":
                    c = prop.take_drafter_kv(state)
                    if c is not None:
                        carried.append(c)
                elif op == "free":
                    prop.free_state(state)
                    live.remove(state)
                else:
                    prop.propose(TINY.vocab_size + 5, hs[0], p, k, state)  # always an InputError
                counts[op] += 1
            except InputError:
                counts["error"] += 1
            except CacheError:
                counts["exhausted"] += 1
            except ExecutionError:
                counts["runner_error"] += 1
        elif op == "install" and carried:
            fresh = prop.alloc_state()
            c = carried.pop()
            assert prop.install_drafter_kv(fresh, c, c[1], c[2])
            live.append(fresh)
            counts["install"] += 1
        elif op == "drop" and carried:
            prop.free_drafter_kv(carried.pop())
            counts["drop"] += 1
        assert prop.cache.num_free_blocks + held() == total, f"leak after {op}: {counts}"

    for state in live:
        prop.free_state(state)
    for c in carried:
        prop.free_drafter_kv(c)
    assert prop.cache.num_free_blocks == total
    assert all(v > 20 for v in counts.values()), counts  # every kind of operation really ran
