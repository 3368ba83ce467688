"""EagerExecutor: run a planned graph on one uint8 arena.

Every intermediate is a view at its planned offset of one arena tensor; inputs,
weights and state are bound by name; each op writes into its output views.
The captured executor replays exactly these steps, on the same arena, inside a
CUDA graph: that is why eager and captured outputs are equal bit for bit.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from draftgraph.ops.overlap import SideStream
from draftgraph.runtime.device import concrete_device
from draftgraph.runtime.errors import ExecutionError, InputError, describe, first_problems
from draftgraph.runtime.execution.kernel_choice import (
    NOT_COMPILED,
    check_kernels,
    compiled_step,
    reads_block_scaled,
    select_impl,
)
from draftgraph.runtime.ir.graph import Graph, Node, ValueKind
from draftgraph.runtime.ir.op_registry import get_op
from draftgraph.runtime.ir.printer import format_node
from draftgraph.runtime.ir.schedule import flatten
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.ir.validate import validate
from draftgraph.runtime.model.quant import QuantWeight
from draftgraph.runtime.passes import DEFAULT_PASSES, Pass, run_passes
from draftgraph.runtime.planning.graph_plan import DEFAULT_ALIGNMENT, GraphPlan, plan_graph

POISON_BYTE = 0xFF  # NaN in every float format, -1 in every signed int


@dataclass
class Step:
    node: Node
    impl: Callable
    inputs: list[Any]  # tensors, or names of run-time inputs (str) resolved per run
    outputs: list[torch.Tensor]
    workspace: torch.Tensor | None
    poisonable: list[torch.Tensor]  # float outputs not aliasing an input: debug write check


def bind_tensors(graph, weights: Mapping, state: Mapping, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The graph's weight and state tensors by value name, each of its spec at ``batch`` and on
    ``device``; an InputError listing every problem otherwise (its first line names the first ones)."""
    problems, bound = [], {}
    for value in graph.values.values():
        if value.kind not in (ValueKind.WEIGHT, ValueKind.STATE):
            continue
        source = weights if value.kind == ValueKind.WEIGHT else state
        tensor = source.get(value.name)
        want = value.spec.concrete(batch)
        if tensor is None:
            problems.append(f"{value.ref}: missing (expected {value.spec})")
        elif tuple(tensor.shape) != want or tensor.dtype != value.spec.dtype or \
                TensorSpec.of(tensor).scale != value.spec.scale:  # a block-scaled weight's scales too
            problems.append(describe(value.ref, value.spec.short(), TensorSpec.of(tensor).short()))
        elif tensor.device != device:
            problems.append(describe(f"{value.ref} device", device, tensor.device))
        else:
            bound[value.name] = tensor
    if problems:
        raise InputError(f"cannot bind graph tensors: {len(problems)} problem(s): {first_problems(problems)}"
                         + "\n  " + "\n  ".join(problems))
    return bound


class EagerExecutor:
    """Run ``graph`` eagerly at one batch size.

    Parameters
    ----------
    graph : Graph
        The graph as declared; the executor runs it after ``passes`` (subgraphs inlined, the
        result validated).
    batch : int
        The concrete size of the symbolic batch dim ``B``.
    weights, state : mapping of name -> tensor
        Persistent tensors bound by name (state is mutated in place by ops).
    runners : mapping of name -> runner, optional
        Implementations of the nodes whose op leaves its implementation to the user (``OpDef.bound_by``:
        the ``body`` under ``attrs["runner"]``, a comm node under ``attrs["group"]``), as objects with
        ``run_<op>`` or ``run_node`` (proposer/runners, ops.collectives.RankGroup).
    passes : sequence of Pass
        The rewrites the graph runs after (``draftgraph.runtime.passes``; default all of them).
    alias : bool
        False gives every intermediate its own buffer (the unaliased oracle).
    debug : bool
        Poison float outputs before each op and fail any op that leaves them unwritten.
    overlap : bool
        On CUDA, give ops a side stream for work that can run beside other work (``draftgraph.ops.overlap``:
        the torch hc_pre's Sinkhorn, the torch MoE's shared expert); the result is the same, in
        less time. Off in debug runs, whose write check reads each output right after its step.
    kernels : str
        Which implementation each op runs (``draftgraph.runtime.execution.kernel_choice``): "auto" (the fused kernel
        where one is registered for the device, else the torch op), "torch" (the torch
        reference ops), "compiled" (the torch ops, each compiled by torch.compile).

    Example
    -------
    >>> ex = EagerExecutor(graph, batch=2, weights={"w": w})   # doctest: +SKIP
    >>> out = ex.run({"x": x})["proj"]                          # doctest: +SKIP
    """

    num_built = 0  # executors built in this process (graph passes, plan, bind): what a warm-up must do once

    def __init__(
        self,
        graph: Graph,
        batch: int,
        weights: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor] | None = None,
        *,
        device: torch.device | str | None = None,
        runners: Mapping[str, Any] | None = None,
        plan: GraphPlan | None = None,
        alias: bool = True,
        debug: bool = False,
        kernels: str = "auto",
        alignment: int = DEFAULT_ALIGNMENT,
        overlap: bool = True,
        passes: Sequence[Pass] = DEFAULT_PASSES,
    ) -> None:
        if not isinstance(graph, Graph):
            raise InputError(describe("graph", "a Graph (GraphBuilder(...).build())", type(graph).__name__))
        try:
            count = None if isinstance(batch, bool) else operator.index(batch)  # numpy ints too
        except TypeError:
            count = None
        if count is None or count < 1:  # the plan sizes every B-shaped buffer by it
            raise InputError(describe("batch", "an int >= 1", repr(batch)))
        batch = count
        for what, tensors in (("weights", weights), ("state", state or {})):
            check_tensor_map(what, tensors)
        EagerExecutor.num_built += 1
        self.graph = flatten(run_passes(graph, passes).graph)
        validate(self.graph)
        self.batch = batch
        self.device = concrete_device(device) if device is not None else _guess_device(weights)
        self.debug = debug
        self.alias = alias
        self.runners = dict(runners or {})
        self.plan = plan if plan is not None else plan_graph(self.graph, batch, alignment)
        self.tracer = None  # optional: object with begin(node) / end(node)
        self.bound: dict[str, torch.Tensor] = {}
        self._bind_persistent(dict(weights), dict(state or {}))
        self.arena = torch.empty(self.plan.arena_bytes if alias else 0, dtype=torch.uint8, device=self.device)
        self._bind_arena()
        self.kernels = check_kernels(kernels)
        self.steps = [self._make_step(node) for node in (self.graph.nodes[n] for n in self.plan.order)]
        self.segments = self._gate_segments()
        self.side = SideStream(self.device) if overlap and self.device.type == "cuda" and not debug else None
        self._pending: dict[str, torch.cuda.Event] = {}  # arena root -> the side-stream work still writing it
        self._read_values = {n for node in self.graph.nodes.values() for n in node.reads} | set(self.graph.outputs)
        # How a gated segment runs: eagerly, by reading its flag (one host sync per gate); a
        # CapturedExecutor swaps in a CUDA conditional node while it captures.
        self.run_gated: Callable[[torch.Tensor, Callable[[], None]], None] = run_if_flag_set

    # ---- binding -------------------------------------------------------------
    def _bind_persistent(self, weights: dict, state: dict) -> None:
        self.bound.update(bind_tensors(self.graph, weights, state, self.batch, self.device))

    def _bind_arena(self) -> None:
        plan, groups = self.plan, self.plan.groups
        for name in groups.root:
            spec = self.graph.values[name].spec
            shape = spec.concrete(self.batch)
            if groups.kind.get(name) == "view":
                continue  # made from its base below, in schedule order
            if self.alias:
                offset = plan.offsets[name]
                raw = self.arena[offset : offset + spec.nbytes(self.batch)]
                self.bound[name] = raw.view(spec.dtype).view(shape)
            else:
                self.bound[name] = torch.empty(shape, dtype=spec.dtype, device=self.device)
        for node in (self.graph.nodes[n] for n in plan.order):
            for oi, out in enumerate(node.outputs):
                if groups.kind.get(out) == "view":
                    base = self.bound[node.inputs[get_op(node.op).views[oi]]]
                    shape = self.graph.values[out].spec.concrete(self.batch)
                    self.bound[out] = get_op(node.op).view_fn(base, node.attrs, shape)

    def _make_step(self, node: Node) -> Step:
        opdef = get_op(node.op)
        specs = [self.graph.values[n].spec for n in node.inputs if n in self.graph.values]
        if opdef.bound_by is not None:  # the user's implementation (a body runner), given by key
            key = node.attrs.get(opdef.bound_by)
            if key not in self.runners:
                raise ExecutionError(describe(f"%{node.name} {opdef.bound_by}", f"one of {sorted(self.runners)}",
                                              repr(key), "pass the implementation in runners="))
            runner = self.runners[key]  # one object may implement several ops: run_<op> first
            impl = getattr(runner, f"run_{node.op}", None) or runner.run_node
        else:
            impl = select_impl(opdef, self.device, self.kernels, specs)
        inputs = [self.bound.get(n, n) for n in node.inputs]
        outputs = [self.bound.get(n, n) for n in node.outputs]
        if self.kernels == "compiled" and opdef.bound_by is None and node.op not in NOT_COMPILED \
                and not reads_block_scaled(specs):  # block-scaled weights: the torch op (kernel_choice)
            impl, inputs, outputs = compiled_step(get_op(node.op), inputs, outputs)
        ws = None
        if node.name in self.plan.workspace:
            offset, nbytes = self.plan.workspace[node.name]
            if self.alias:
                ws = self.arena[offset : offset + nbytes]
            else:
                ws = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        in_ptrs = {t.data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        poisonable = [
            t
            for t in outputs
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.data_ptr() not in in_ptrs
        ]
        return Step(node, impl, inputs, outputs, ws, poisonable)

    def _gate_segments(self) -> list[tuple[torch.Tensor | None, list[Step]]]:
        """The steps cut into runs of one guard each: (flag tensor or None, steps), in schedule order.

        A node's ``guard`` (an int32 [1] value) says it runs only where the flag is nonzero;
        ``validate`` has checked that each guard's nodes are one unbroken run of the schedule.
        """
        segments: list[tuple[str | None, list[Step]]] = []
        for step in self.steps:
            flag = step.node.guard
            if segments and segments[-1][0] == flag:
                segments[-1][1].append(step)
            else:
                segments.append((flag, [step]))
        return [(None if flag is None else self.bound[flag], steps) for flag, steps in segments]

    # ---- running ----------------------------------------------------------------
    def check_inputs(self, inputs: Mapping[str, torch.Tensor]) -> None:
        if not isinstance(inputs, Mapping):
            raise InputError(describe("graph inputs", f"a mapping of {self.graph.inputs} to tensors",
                                      type(inputs).__name__))
        missing = [n for n in self.graph.inputs if n not in inputs]
        if missing:
            raise InputError(describe("graph inputs", self.graph.inputs, sorted(inputs), f"missing {missing}"))
        for name in self.graph.inputs:
            spec, tensor = self.graph.values[name].spec, inputs[name]
            if not isinstance(tensor, torch.Tensor):
                raise InputError(describe(f"input %{name}", f"a tensor {spec.short()}", type(tensor).__name__))
            want = spec.concrete(self.batch)
            if tuple(tensor.shape) != want or tensor.dtype != spec.dtype:
                raise InputError(describe(f"input %{name}", f"{spec.short()} with B={self.batch}",
                                          f"{tuple(tensor.shape)} {tensor.dtype}"))
            if tensor.device != self.device:
                raise InputError(describe(f"input %{name} device", self.device, tensor.device))

    def poison(self, byte: int = POISON_BYTE) -> None:
        """Fill the arena (every intermediate) with ``byte``: NaN for floats by default."""
        if self.alias:
            self.arena.fill_(byte)
        else:
            for name in self.plan.groups.root:
                self.bound[name].view(torch.uint8).fill_(byte)  # unaliased buffers are contiguous

    def warm(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Run once on ``inputs`` (staged with every row dead), so that on CUDA each kernel the steps
        launch is compiled now and not in the first real run (the decode loop's warm-up)."""
        self.run(inputs, check=False)

    def run(self, inputs: Mapping[str, torch.Tensor], check: bool = True) -> dict[str, torch.Tensor]:
        """Run every step; returns the graph outputs (views into the arena: copy to keep)."""
        if check:
            self.check_inputs(inputs)
        for flag, steps in self.segments:
            if flag is None:
                self._run_steps(steps, inputs)
            else:  # no fork inside a gated region: its body may be a conditional node's own capture
                self.run_gated(flag, partial(self._run_steps, steps, inputs, False))
        return {name: self.bound.get(name) if name in self.bound else self._resolve(name, inputs)
                for name in self.graph.outputs}

    def _run_steps(self, steps: list[Step], inputs, overlap: bool = True) -> None:
        """Run ``steps`` in order; side-stream work is joined by the end (a capture must rejoin)."""
        side = self.side if overlap else None
        try:
            for step in steps:
                self._run_step(step, inputs, side)
        finally:
            for event in self._pending.values():
                self.side.wait(event)
            self._pending.clear()

    def _resolve(self, item, inputs):
        if isinstance(item, str):
            if item in inputs:
                return inputs[item]
            return self._external_view(item, inputs)
        return item

    def _external_view(self, name: str, inputs) -> torch.Tensor:
        base_name = self.plan.groups.external_view[name]
        node = self.graph.producer_of(name)
        base = inputs.get(base_name, self.bound.get(base_name))
        shape = self.graph.values[name].spec.concrete(self.batch)
        return get_op(node.op).view_fn(base, node.attrs, shape)

    def _run_step(self, step: Step, inputs, side: SideStream | None = None) -> None:
        if self._pending:  # join the side-stream work writing what this step reads
            for name in step.node.inputs:
                event = self._pending.pop(self.plan.groups.root.get(name, name), None)
                if event is not None:
                    self.side.wait(event)
        ins = [self._resolve(t, inputs) for t in step.inputs]
        outs = [self._resolve(t, inputs) for t in step.outputs]
        if self.debug:
            for t in step.poisonable:
                t.view(torch.uint8).fill_(POISON_BYTE) if t.is_contiguous() else t.fill_(float("nan"))
        if self.tracer is not None:
            self.tracer.begin(step.node)
        try:
            if side is None:
                result = step.impl(ins, outs, step.node.attrs, step.workspace)
            else:
                with side.serving():
                    try:
                        result = step.impl(ins, outs, step.node.attrs, step.workspace)
                    finally:
                        if side.forked:
                            self._defer(step, side.join_event())
        except ExecutionError:
            raise
        except Exception as exc:
            raise ExecutionError(f"while executing {format_node(self.graph, step.node)}: {exc}") from exc
        finally:
            if self.tracer is not None:
                self.tracer.end(step.node)
        if result is not None:
            raise ExecutionError(
                f"while executing {format_node(self.graph, step.node)}: the op returned a new tensor "
                "instead of writing its output view (hint: write into outputs[i], return None)"
            )
        if self.debug:
            for t in step.poisonable:
                if torch.isnan(t).any():
                    raise ExecutionError(
                        f"while executing {format_node(self.graph, step.node)}: an output view was left "
                        "unwritten (NaN poison remains; hint: write every element of each output)"
                    )

    def _defer(self, step: Step, event: torch.cuda.Event) -> None:
        """The side-stream work of ``step`` is joined before the first reader of its deferred outputs.

        An op that lists none is joined at once. Pending work is keyed by arena root, so a
        view or an in-place successor of a deferred output joins it too.
        """
        deferred = get_op(step.node.op).deferred
        read_later = [step.node.outputs[i] for i in deferred if step.node.outputs[i] in self._read_values]
        if len(read_later) < len(deferred):  # an unread output's bytes are free for the next step: join now
            self.side.wait(event)
            return
        for name in read_later:
            self._pending[self.plan.groups.root.get(name, name)] = event


def run_if_flag_set(flag: torch.Tensor, body: Callable[[], None]) -> None:
    """The eager gate: read the flag (a host sync) and run the body when it is nonzero."""
    if int(flag.item()):
        body()


def check_tensor_map(what: str, tensors: object, names: str = "value names", hint: str | None = None) -> None:
    """Weights or state: a mapping of ``names`` to tensors (block-scaled QuantWeights too); else an
    InputError naming the first values that are not."""
    if not isinstance(tensors, Mapping):
        raise InputError(describe(what, f"a mapping of {names} to tensors", type(tensors).__name__, hint))
    bad = [describe(repr(name), "a tensor", type(t).__name__) for name, t in tensors.items()
           if not isinstance(t, (torch.Tensor, QuantWeight))]
    if bad:
        raise InputError(f"{what}: {len(bad)} problem(s): {first_problems(bad)}")


def _guess_device(weights: Mapping[str, torch.Tensor]) -> torch.device:
    for tensor in weights.values():
        return tensor.device
    return torch.device("cpu")
