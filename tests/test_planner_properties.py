"""Property tests for the arena planner, against oracles that share no code with it.

The lower bound is re-derived here by brute force over every step; overlaps are judged by
``verify_plan`` (itself independent of the planner) and, for corrupted plans, by the test.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from draftgraph.runtime.errors import PlanError
from draftgraph.runtime.planning.arena_plan import (
    ArenaPlan,
    Buffer,
    aligned,
    format_bytes,
    format_bytes_short,
    lower_bound,
    plan_arena,
)
from draftgraph.runtime.planning.verify_plan import verify_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

QUICK = dict(time_limit_s=0.05)  # property examples need a plan, not the best plan


def brute_force_bound(buffers: list[Buffer], alignment: int) -> int:
    if not buffers:
        return 0
    steps = range(min(b.start for b in buffers), max(b.end for b in buffers))
    return max(
        sum(-(-b.size // alignment) * alignment for b in buffers if b.start <= t < b.end) for t in steps
    )


@st.composite
def interval_sets(draw, max_size: int = 24):
    rows = draw(
        st.lists(st.tuples(st.integers(0, 30), st.integers(1, 12), st.integers(1, 3000)), max_size=max_size)
    )
    return [Buffer(f"v{i}", start, start + length, size) for i, (start, length, size) in enumerate(rows)]


def live_together(a: Buffer, b: Buffer) -> bool:
    return a.start < b.end and b.start < a.end


def bytes_overlap(plan: ArenaPlan, a: Buffer, b: Buffer) -> bool:
    lo_a, lo_b = plan.offsets[a.name], plan.offsets[b.name]
    return lo_a < lo_b + b.size and lo_b < lo_a + a.size


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buffers=interval_sets(), alignment=st.sampled_from([1, 8, 256]))
def test_random_plans_are_valid_and_between_the_bounds(buffers, alignment):
    plan = plan_arena(buffers, alignment=alignment, **QUICK)
    verify_plan(plan, buffers)
    # A second, pairwise oracle on the real (unaligned) byte ranges.
    for i, a in enumerate(buffers):
        for b in buffers[i + 1 :]:
            assert not (live_together(a, b) and bytes_overlap(plan, a, b)), (a, b, plan.offsets)
    bound = brute_force_bound(buffers, alignment)
    naive = sum(aligned(b.size, alignment) for b in buffers)
    assert plan.lower_bound == bound == lower_bound(buffers, alignment)
    assert bound <= plan.arena_bytes <= naive == plan.naive_bytes
    assert plan.arena_bytes == max(
        (plan.offsets[b.name] + aligned(b.size, alignment) for b in buffers), default=0
    )
    assert all(o % alignment == 0 and o >= 0 for o in plan.offsets.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buffers=interval_sets(), data=st.data())
def test_a_buffer_moved_onto_a_live_neighbour_is_caught(buffers, data):
    pairs = [(a, b) for i, a in enumerate(buffers) for b in buffers[i + 1 :] if live_together(a, b)]
    if not pairs:
        return
    a, b = data.draw(st.sampled_from(pairs))
    plan = plan_arena(buffers, alignment=16, **QUICK)
    offsets = dict(plan.offsets, **{b.name: plan.offsets[a.name]})
    arena = max(offsets[x.name] + aligned(x.size, 16) for x in buffers)
    corrupt = dataclasses.replace(plan, offsets=offsets, arena_bytes=arena)
    with pytest.raises(PlanError) as err:
        verify_plan(corrupt)
    message = str(err.value)
    assert "share" in message or "overlapping" in message
    # The pair reported may be another one the move created, but it is a real overlap.
    verify_plan(corrupt, allowed_overlaps=[(x.name, y.name) for x, y in pairs])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buffers=interval_sets().filter(bool), data=st.data())
def test_misaligned_and_out_of_arena_offsets_are_caught(buffers, data):
    plan = plan_arena(buffers, alignment=64, **QUICK)
    victim = data.draw(st.sampled_from(buffers)).name
    misaligned = dataclasses.replace(plan, offsets=dict(plan.offsets, **{victim: plan.offsets[victim] + 8}))
    with pytest.raises(PlanError, match="multiple of 64"):
        verify_plan(misaligned)
    past_end = dataclasses.replace(plan, offsets=dict(plan.offsets, **{victim: plan.arena_bytes}))
    with pytest.raises(PlanError, match="arena_bytes"):
        verify_plan(past_end)
    negative = dataclasses.replace(plan, offsets=dict(plan.offsets, **{victim: -64}))
    with pytest.raises(PlanError, match=">= 0"):
        verify_plan(negative)
    missing = dataclasses.replace(plan, offsets={k: v for k, v in plan.offsets.items() if k != victim})
    with pytest.raises(PlanError, match=repr(victim)):
        verify_plan(missing)


def test_overlap_message_names_both_buffers_lifetimes_and_bytes():
    buffers = (Buffer("x", 0, 4, 300), Buffer("y", 2, 6, 100))
    plan = ArenaPlan({"x": 0, "y": 256}, buffers, 512, 768, 512, 256, "hand", 0.0)
    with pytest.raises(PlanError) as err:
        verify_plan(plan)
    message = str(err.value)
    for part in ("'x'", "'y'", "[0, 4)", "[2, 6)", "[0x0, 0x200)", "[0x100, 0x200)"):
        assert part in message, (part, message)
    verify_plan(plan, allowed_overlaps=[("y", "x")])
    # Half-open lifetimes: a buffer that ends at step 2 may share bytes with one starting at 2.
    touching = (Buffer("x", 0, 2, 256), Buffer("y", 2, 4, 256))
    verify_plan(ArenaPlan({"x": 0, "y": 0}, touching, 256, 512, 256, 256, "hand", 0.0))


def test_verify_plan_checks_the_buffers_it_is_given():
    plan = plan_arena([Buffer("a", 0, 2, 256), Buffer("b", 2, 4, 256)])
    assert plan.offsets["a"] == plan.offsets["b"] == 0
    with pytest.raises(PlanError, match="'a'.*'b'|'b'.*'a'"):
        verify_plan(plan, [Buffer("a", 0, 3, 256), Buffer("b", 2, 4, 256)])  # lifetimes re-derived longer
    with pytest.raises(PlanError, match="'c'"):
        verify_plan(plan, [Buffer("c", 0, 1, 8)])


def test_same_seed_same_plan():
    buffers = [
        Buffer(f"v{i}", (i * 7) % 23, (i * 7) % 23 + 1 + (i * 5) % 9, 256 * (1 + (i * 13) % 17))
        for i in range(60)
    ]
    runs = [plan_arena(buffers, time_limit_s=60.0, seed=3, max_attempts=15) for _ in range(2)]
    assert runs[0].offsets == runs[1].offsets and runs[0].strategy == runs[1].strategy


def test_empty_chain_and_errors():
    empty = plan_arena([])
    assert (empty.arena_bytes, empty.naive_bytes, empty.lower_bound, empty.offsets) == (0, 0, 0, {})
    verify_plan(empty)
    chain = [Buffer(f"t{i}", i, i + 2, 4096 + 256 * (i % 5)) for i in range(300)]
    began = time.perf_counter()
    plan = plan_arena(chain)
    assert time.perf_counter() - began < 0.5  # the bound is met by the greedy start: no search
    assert plan.arena_bytes == plan.lower_bound
    with pytest.raises(PlanError, match="size"):
        Buffer("z", 0, 1, 0)
    with pytest.raises(PlanError, match="end > start"):
        Buffer("z", 3, 3, 8)
    with pytest.raises(PlanError, match="unique"):
        plan_arena([Buffer("a", 0, 1, 8), Buffer("a", 1, 2, 8)])
    with pytest.raises(PlanError, match="alignment"):
        plan_arena([Buffer("a", 0, 1, 8)], alignment=0)


@pytest.mark.parametrize("make, fragment", [
    (lambda: Buffer(3, 0, 1, 8), "buffer name: expected a str, got 3"),
    (lambda: Buffer("a", -5, 1, 8), "buffer 'a' start: expected a schedule step >= 0, got -5"),
    (lambda: Buffer("a", 0, 1, 2**70), "buffer 'a' size: expected a magnitude below 2**62"),
    (lambda: plan_arena([Buffer("a", 0, 1, 2**61), Buffer("b", 0, 1, 2**61)]),
     "buffer sizes: expected an aligned total below 2**62 bytes"),
    (lambda: plan_arena([Buffer("a", 0, 1, 8)], time_limit_s=float("nan")), "time_limit_s: expected a finite"),
    (lambda: plan_arena([Buffer("a", 0, 1, 8)], time_limit_s=-1), "time_limit_s: expected a finite"),
    (lambda: plan_arena([Buffer("a", 0, 1, 8)], time_limit_s="1"), "time_limit_s: expected a finite"),
    (lambda: plan_arena([Buffer("a", 0, 1, 8)], seed="x"), "seed: expected an int >= 0, got 'x'"),
    (lambda: plan_arena([Buffer("a", 0, 1, 8)], max_attempts=-1), "max_attempts: expected an int >= 0, got -1"),
], ids=["name", "start", "size", "total", "nan_limit", "negative_limit", "str_limit", "seed", "attempts"])
def test_bad_planner_input_is_a_plan_error(make, fragment):
    """Each was accepted silently (a plan with a negative step, a search under a NaN deadline)."""
    with pytest.raises(PlanError) as e:
        make()
    assert fragment in str(e.value)


def test_an_iterator_of_buffers_is_planned_whole():
    """The checks spent a generator before the planner read it: an empty plan, silently."""
    buffers = [Buffer("x", 0, 2, 512), Buffer("y", 1, 3, 256)]
    assert plan_arena(iter(buffers)).offsets == plan_arena(buffers).offsets == {"x": 0, "y": 512}


def test_summary_json_and_byte_formats():
    plan = plan_arena([Buffer("a", 0, 2, 600_000), Buffer("b", 1, 3, 700_000), Buffer("c", 2, 4, 650_000)])
    assert plan.summary() == "arena 1.3 MB (naive 1.9 MB, lower bound 1.3 MB), 3 values"
    again = ArenaPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    with pytest.raises(PlanError, match="JSON"):
        ArenaPlan.from_json({"buffers": []})
    assert [format_bytes(n) for n in (512, 1536, 131072, 1258291, 3 << 30)] == [
        "512 B",
        "1.5 KB",
        "128.0 KB",
        "1.2 MB",
        "3.0 GB",
    ]
    assert [format_bytes_short(n) for n in (640, 1536, 131072, 2 << 20, 1258291)] == [
        "640",
        "1.5K",
        "128K",
        "2M",
        "1.2M",
    ]


@pytest.mark.parametrize("buffers", [None, 3, 1.5], ids=repr)
def test_plan_arena_of_no_sequence_is_a_plan_error(buffers):
    """Was a TypeError from tuple() (a random fuzz of the planner's arguments)."""
    with pytest.raises(PlanError, match=r"plan_arena input: expected a sequence of Buffer objects, got "):
        plan_arena(buffers)
