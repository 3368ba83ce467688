"""Runner swap: identity changes the drafts, torch_module matches builtin, swapping back is
bit-identical, a user runner loads from 'module:callable', a misbehaving runner gets its error."""

from __future__ import annotations

import re

import pytest
import torch
from draftgraph.runtime.errors import ExecutionError, RunnerError
from proposer_fixtures import SMALL, hidden, make_proposer


def run_once(prop, seed=0, k=3):
    gen = torch.Generator().manual_seed(seed)
    state = prop.alloc_state()
    prompt = torch.randint(SMALL.vocab_size, (6,), generator=gen).tolist()
    prop.prefill_drafter(prompt, hidden(SMALL, gen, n=6), state)
    drafts = prop.propose(9, hidden(SMALL, gen), 5, k, state)
    out_hidden = prop.last_hidden(1)
    kv = prop.cache.kv.clone()
    prop.free_state(state)
    return drafts, out_hidden, kv


@pytest.fixture(scope="module")
def prop():
    return make_proposer(SMALL, seed=4)


def test_identity_changes_drafts_and_swapping_back_is_bit_identical(prop):
    prop.set_circuit_draft(None)
    base = run_once(prop)
    prop.set_circuit_draft("identity")
    assert prop.circuit_draft().runner == "identity"
    ident = run_once(prop)
    assert ident[0] != base[0]
    prop.set_circuit_draft(None)
    back = run_once(prop)
    assert back[0] == base[0] and torch.equal(back[1], base[1])


def test_torch_module_matches_builtin_within_bf16_tolerance(prop):
    prop.set_circuit_draft(None)
    base = run_once(prop, k=1)
    prop.set_circuit_draft("torch_module")
    mod = run_once(prop, k=1)
    rel = float((mod[1].double() - base[1].double()).norm() / base[1].double().norm())
    assert rel < 2e-2, f"torch_module vs builtin hidden relative error {rel:.3g}"
    prop.set_circuit_draft(None)


def test_user_runner_from_module_callable(prop):
    prop.set_circuit_draft(None)
    base = run_once(prop)
    prop.set_circuit_draft("user_runners.scaled:HalvingRunner")
    binding = prop.circuit_draft()
    assert binding.runner == "halving" and binding.workspace_bytes == 1024
    halved = run_once(prop)
    assert halved[0] != base[0]
    prop.set_circuit_draft(None)


@pytest.mark.parametrize("spec,match", [
    ("user_runners.scaled:wrong_shape_runner", "output shape"),
    ("user_runners.scaled:wrong_dtype_runner", "output dtype"),
    ("user_runners.scaled:returns_none_runner", "torch.Tensor"),
])
def test_misbehaving_runner_gets_a_runner_error_naming_it(prop, spec, match):
    prop.set_circuit_draft(spec)
    gen = torch.Generator().manual_seed(0)
    state = prop.alloc_state()
    before = (state.snapshot(), prop.cache.num_free_blocks)
    with pytest.raises(ExecutionError) as info:
        prop.propose(1, hidden(SMALL, gen), 0, 1, state)
    assert isinstance(info.value.__cause__, RunnerError)
    assert match in str(info.value) and "runner" in str(info.value)
    assert (state.snapshot(), prop.cache.num_free_blocks) == before
    prop.free_state(state)
    prop.set_circuit_draft(None)


@pytest.mark.parametrize("spec", ["no_such_module:x", "user_runners.scaled:nope", "user_runners.scaled:NOT_CALLABLE",
                                  "bogus", 42])
def test_unloadable_runner_specs(prop, spec):
    with pytest.raises(RunnerError):
        prop.set_circuit_draft(spec)


def test_swap_drops_executors_so_a_stale_one_never_runs(prop):
    prop.set_circuit_draft(None)
    run_once(prop)
    old = dict(prop._executors)
    generation = prop.generation
    prop.set_circuit_draft("identity")
    assert prop.generation == generation + 1 and not prop._executors
    stale = next(iter(old.values()))
    key = ("chain", 1, 3, False, prop.use_captured, prop.options.draft_conf_tau)
    prop._executors[key] = stale  # smuggle the old executor back
    from draftgraph.runtime.errors import CaptureError

    gen = torch.Generator().manual_seed(0)
    state = prop.alloc_state()
    with pytest.raises(CaptureError, match="stale"):
        prop.propose(1, hidden(SMALL, gen), 0, 3, state)
    prop.free_state(state)
    prop.set_circuit_draft(None)


def test_a_launch_plan_from_before_a_swap_is_never_used(prop):
    prop.set_circuit_draft(None)
    gen = torch.Generator().manual_seed(0)
    state = prop.alloc_state()
    prop.propose(1, hidden(SMALL, gen), 0, 3, state)
    prop.after_verify(0, state)
    plan = prop._plans[(1, 3, False)]
    assert plan.executor is prop._executors[("chain", 1, 3, False, prop.use_captured, prop.options.draft_conf_tau)]
    prop.propose(1, hidden(SMALL, gen), 0, 3, state)  # the same shape again: the same plan, no new lookup
    assert prop._plans[(1, 3, False)] is plan
    prop.after_verify(0, state)
    prop.set_circuit_draft("identity")
    assert not prop._plans
    prop._plans[(1, 3, False)] = plan  # smuggle the old plan back: its generation is past
    prop.propose(1, hidden(SMALL, gen), 0, 3, state)
    assert prop._plans[(1, 3, False)].executor is not plan.executor
    assert prop._plans[(1, 3, False)].generation == prop.generation
    prop.free_state(state)
    prop.set_circuit_draft(None)


def test_a_bool_k_is_refused_even_once_k_1_has_a_plan(prop):
    gen = torch.Generator().manual_seed(0)
    state = prop.alloc_state()
    prop.propose(1, hidden(SMALL, gen), 0, 1, state)
    prop.after_verify(0, state)
    from draftgraph.runtime.errors import InputError

    with pytest.raises(InputError, match="num_drafts"):
        prop.propose(1, hidden(SMALL, gen), 0, True, state)
    prop.free_state(state)


def test_a_callable_that_cannot_take_the_body_is_refused_when_set(prop):
    """'os:getcwd' was accepted and failed in the first propose, an ExecutionError inside the run."""
    with pytest.raises(RunnerError, match=r"runner 'os:getcwd': expected a callable of the body's arguments .*"
                                          r"got getcwd\(\)"):
        prop.set_circuit_draft("os:getcwd")
    with pytest.raises(RunnerError, match=r"got <lambda>\(streams\)"):
        prop.set_circuit_draft(lambda streams: streams)
    assert prop.runner is None  # nothing was set
    prop.set_circuit_draft(lambda *args: args[0])  # any callable that takes six arguments is a body
    prop.set_circuit_draft(None)


def test_chain_graph_names_a_k_that_is_not_an_int(prop):
    """K past max_num_drafts too: 2**63 built a graph of that many steps before (a hang)."""
    from draftgraph.runtime.errors import InputError

    for bad in ("a", 1.5, True, 0, 9, 2**63):
        with pytest.raises(InputError, match=re.escape(f"num_drafts: expected an int in [1, 8], got {bad!r}")):
            prop.circuit_draft(bad)
        with pytest.raises(InputError, match=re.escape(f"num_drafts: expected an int in [1, 8], got {bad!r}")):
            prop.chain_graph(bad)
