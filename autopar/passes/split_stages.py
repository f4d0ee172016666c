"""split_stages: one rank's program cut into pipeline stages, one GraphModule each.

The plan names the stage of every captured op (``PipelinePlan.stage_of``). The nodes the
passes inserted take a stage from their neighbours: a node computed from values of the
program (a checkpointed block's call, code the passes add after an op) joins the latest
stage among its inputs (or, for a checkpointed block's call, the stage of the ops its region
holds: the latest stage among its inputs would be the stage before when the block starts a
stage); a reshard between two ops joins its earliest reader's stage (not before its input's);
a node computed only from placeholders (a parameter's cast or gather, its prefetch, the
slicing of a user input) or from nothing joins the earliest stage reading it, so a
parameter's gathers run in the stage that holds the parameter.

What a later stage reads of an earlier one's is sent across the cuts between them, once,
placed as its producer placed it, as the plan prices the sends (``pipeline.crossing``), but
for what each later stage reading it computes again from what it has itself: a reshard
(shared by readers of several stages: ``insert_reshards``), so each stage reshards the value
that crossed; a function of placeholders alone (the one cast mixed precision reads a tied
weight through: each stage reads the copy of the state it holds); the plan's ops of constants
alone (``pipeline.crossing.constant_ops``: an ``arange``-based causal mask, rotary tables from
an ``inv_freq`` buffer), with the nodes the passes put between them. User inputs never
cross: every rank is handed the step's inputs, and each stage reads its micro-batch of them.

Each stage's module takes, in order, the values it receives (``inputs``: none for the first
stage; for a later one, every value an earlier stage computed that this stage or a later one
reads, carried stage to stage), the user inputs it reads (``user_inputs``), then the state
placeholders it reads (``state``: parameters, buffers, constants, bound by the runtime), and
returns what the next stage receives (the last stage: the program's outputs). Values
crossing a cut must be tensors: the runtime sends them point to point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from autopar.capture.aliasing import storage_root, written_args
from autopar.capture.subgraphs import is_higher_order
from autopar.errors import InputError
from autopar.passes.context import plan_name


@dataclass(frozen=True, kw_only=True)
class StageProgram:
    """One stage of a rank's program."""

    index: int
    gm: torch.fx.GraphModule
    """Placeholders: ``inputs``, ``user_inputs``, then ``state``; output: ``outputs`` (a tuple)."""
    inputs: list[str]
    """Names (in the whole program) of the values it receives from the stage before, in placeholder
    order (none for the first)."""
    user_inputs: list[str]
    """Names of the user inputs it reads (handed to every stage: its micro-batch of them), in order."""
    state: list[str]
    """Names of the program's state placeholders (parameters, buffers, constants) it reads."""
    outputs: list[str]
    """Names of the values it returns, in order."""


_RESHARDS = ("reshard", "regather")
"""Submodules the passes call to change a value's placement (``passes.insert_reshards``)."""


def split_stages(gm: torch.fx.GraphModule, stage_of: dict[str, int], stages: int, user_inputs: list[str],
                 constants: frozenset[str] = frozenset()) -> list[StageProgram]:
    """``gm`` (a rank's program) as ``stages`` stage programs; ``stage_of``: plan node name ->
    stage; ``user_inputs``: the placeholders the caller feeds (the others are state);
    ``constants``: the plan's ops of constants alone (``pipeline.crossing.constant_ops``)."""
    assigned = _assign(gm, stage_of, stages)
    _check_inputs_unwritten(assigned, set(user_inputs))
    _recompute_per_stage(gm, assigned, _recomputed(gm, assigned, constants))
    received = _received(gm, assigned, stages, constants)
    return [_stage_program(gm, s, assigned, received[s], received[s + 1] if s + 1 < stages else None,
                           set(user_inputs)) for s in range(stages)]


def _assign(gm: torch.fx.GraphModule, stage_of: dict[str, int], stages: int) -> dict[torch.fx.Node, int]:
    """Every non-placeholder node's stage (module docstring)."""
    assigned: dict[torch.fx.Node, int] = {}
    from_sources: list[torch.fx.Node] = []
    reshards: list[torch.fx.Node] = []  # placed once their readers are
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            assigned[node] = stages - 1
            continue
        name = plan_name(node)
        inner = _inner_stage(gm, node, stage_of)
        inputs = [assigned[a] for a in node.all_input_nodes if a in assigned]
        if name is not None and name in stage_of:
            assigned[node] = stage_of[name]
        elif inner is not None:
            assigned[node] = inner
        elif inputs and node.op == "call_module" and node.target in _RESHARDS:
            reshards.append(node)
            continue
        elif inputs:
            assigned[node] = max(inputs)
        else:
            from_sources.append(node)
            continue
        _check_order(node, assigned)
    for node in reversed(reshards):  # users first
        inputs = [assigned[a] for a in node.all_input_nodes if a in assigned]
        readers = [assigned[u] for u in node.users if u in assigned]
        assigned[node] = max(max(inputs), min(readers)) if readers else max(inputs)
    for node in reshards + [u for r in reshards for u in r.users if u in assigned]:
        _check_order(node, assigned)
    for node in reversed(from_sources):  # users first: a chain from placeholders follows its readers
        readers = [assigned[u] for u in node.users if u in assigned]
        assigned[node] = min(readers) if readers else 0
    return assigned


def _recompute_per_stage(gm: torch.fx.GraphModule, assigned: dict[torch.fx.Node, int],
                         recomputed: set[torch.fx.Node]) -> None:
    """Each ``recomputed`` node read by later stages is copied into each of them, before its first
    reader there; with it, its own inputs of that kind from earlier stages, recursively (a chain of
    reshards, one resharding another's result; the ops of a causal mask, back to its ``arange``),
    each stage's copy reading that stage's copies, so only what the chain starts from crosses."""
    copies = _Copies(recomputed)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node not in recomputed:
            continue
        later: dict[int, list[torch.fx.Node]] = {}
        for user in node.users:
            if assigned.get(user, -1) > assigned[node]:
                later.setdefault(assigned[user], []).append(user)
        for stage, users in later.items():
            if any(u not in order for u in users):  # a copy made for an earlier node reads this one
                order = {n: i for i, n in enumerate(gm.graph.nodes)}
            copy = _copy_chain(gm, node, stage, min(users, key=order.__getitem__), assigned, copies)
            for user in users:
                user.replace_input_with(node, copy)


@dataclass
class _Copies:
    """The copies ``_recompute_per_stage`` made, one per node and stage: a node read by a later
    stage may already read another's copy (made for its own stage), whose node is copied again."""

    recomputed: set[torch.fx.Node]
    made: dict[tuple[torch.fx.Node, int], torch.fx.Node] = field(default_factory=dict)
    origin: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    """Copy -> the node it copies."""

    def of(self, node: torch.fx.Node) -> torch.fx.Node:
        """The node ``node`` copies (itself if it is none's copy)."""
        return self.origin.get(node, node)


def _recomputed(gm: torch.fx.GraphModule, assigned: dict[torch.fx.Node, int], constants: frozenset[str]
                ) -> set[torch.fx.Node]:
    """The nodes each later stage reading them computes again rather than receives (module
    docstring): reshards; the plan's ``constants``; a node the passes added (no plan name), a
    function (no module: nothing kept between calls) writing into nothing, of placeholders and
    such nodes alone, or of nothing; a ``get_attr`` (a reference to the program's own)."""
    out: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node not in assigned or node.op == "output":
            continue
        pure = node.op == "call_function" and not written_args(node) and not is_higher_order(node)
        name = plan_name(node)
        added = all(a in out or a.op == "placeholder" for a in node.all_input_nodes) if name is None \
            else name in constants
        if _is_reshard(node, assigned) or node.op == "get_attr" or (pure and added):
            out.add(node)
    return out


def _is_reshard(node: torch.fx.Node, assigned: dict[torch.fx.Node, int]) -> bool:
    return node.op == "call_module" and node.target in _RESHARDS and node in assigned


def _copy_chain(gm: torch.fx.GraphModule, node: torch.fx.Node, stage: int, before: torch.fx.Node,
                assigned: dict[torch.fx.Node, int], copies: _Copies) -> torch.fx.Node:
    """``node`` (of an earlier stage) computed in ``stage`` before ``before``: its recomputed
    inputs of earlier stages too, recursively."""
    inputs = {a: _copy_chain(gm, a, stage, before, assigned, copies) for a in node.all_input_nodes
              if copies.of(a) in copies.recomputed and assigned[a] < stage}
    copy = copies.made.get((copies.of(node), stage))
    if copy is None:
        with gm.graph.inserting_before(before):
            copy = copies.made[(copies.of(node), stage)] = gm.graph.node_copy(node, lambda a: inputs.get(a, a))
        copies.origin[copy] = copies.of(node)
        assigned[copy] = stage
    elif _after(gm, copy, before):  # made for later readers: it must now come before this one's
        before.prepend(copy)
    return copy


def _after(gm: torch.fx.GraphModule, node: torch.fx.Node, other: torch.fx.Node) -> bool:
    for n in gm.graph.nodes:
        if n is other:
            return True
        if n is node:
            return False
    raise AssertionError(f"{other.name} is not in the graph")


def _check_order(node: torch.fx.Node, assigned: dict[torch.fx.Node, int]) -> None:
    inputs = [assigned[a] for a in node.all_input_nodes if a in assigned]
    if inputs and max(inputs) > assigned[node]:
        raise RuntimeError(f"split_stages: {node.name} (stage {assigned[node]}) reads a value of stage "
                           f"{max(inputs)}: the cuts do not follow the program's order")


def _inner_stage(gm: torch.fx.GraphModule, node: torch.fx.Node, stage_of: dict[str, int]) -> int | None:
    """For a call running a submodule of planned ops (a checkpointed block: ``recompute`` called
    with the block's region as its first argument), the stage of those ops. A region is one
    block's, and cuts fall between blocks, so its ops share one stage."""
    if node.op != "call_module":
        return None
    # the called module itself is ``Recompute``; the ops are in the region it is handed (a get_attr)
    targets = [str(node.target)] + [str(a.target) for a in node.args
                                     if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    inner: set[int] = set()
    for target in targets:
        graph = getattr(gm.get_submodule(target), "graph", None)
        if isinstance(graph, torch.fx.Graph):
            inner |= {stage_of[n] for n in (plan_name(m) for m in graph.nodes) if n is not None and n in stage_of}
    if len(inner) > 1:
        raise RuntimeError(f"split_stages: {node.name} runs ops of stages {sorted(inner)}: a checkpointed region "
                           "spans a cut")
    return min(inner) if inner else None


def _received(gm: torch.fx.GraphModule, assigned: dict[torch.fx.Node, int], stages: int,
              constants: frozenset[str]) -> list[list[torch.fx.Node]]:
    """For each stage s > 0, the values it receives: computed before s and read at s or later,
    in program order (placeholders never: each stage binds the state and is handed the user
    inputs it reads)."""
    last_read: dict[torch.fx.Node, int] = {}
    for node, s in assigned.items():
        for a in node.all_input_nodes:
            last_read[a] = max(last_read.get(a, -1), s)
    received: list[list[torch.fx.Node]] = [[] for _ in range(stages + 1)]
    for value in gm.graph.nodes:
        if value.op == "placeholder" or last_read.get(value, -1) <= assigned[value]:
            continue
        if plan_name(value) in constants:
            raise RuntimeError(f"split_stages: {value.name} crosses a cut, but the plan computes it again in each "
                               "later stage reading it (pipeline.crossing)")
        for s in range(assigned[value] + 1, last_read[value] + 1):
            received[s].append(value)
    return received


def _check_inputs_unwritten(assigned: dict[torch.fx.Node, int], user_inputs: set[str]) -> None:
    """Each stage reads the user inputs from its own micro-batch of them: one a stage writes in place
    and another stage reads would be read unwritten there."""
    for node, s in assigned.items():
        for target in written_args(node):
            root = storage_root(target)
            if root.op != "placeholder" or root.name not in user_inputs:
                continue
            readers = {assigned[n] for n in assigned if any(storage_root(a) is root for a in n.all_input_nodes)}
            if readers - {s}:
                raise InputError(f"the model writes into its input {root.name} in place ({node.name}, pipeline stage "
                                 f"{s}) and stages {sorted(readers - {s})} read it: a pipeline stage reads the inputs "
                                 "from its own micro-batch of them, so write into a copy (x = x.clone()) first")


def _stage_program(gm: torch.fx.GraphModule, s: int, assigned: dict[torch.fx.Node, int],
                   inputs: list[torch.fx.Node], outputs: list[torch.fx.Node] | None, user_inputs: set[str]
                   ) -> StageProgram:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    mine = [n for n in gm.graph.nodes if assigned.get(n) == s and n.op != "output"]
    read = [p for p in gm.graph.nodes if p.op == "placeholder" and any(assigned.get(u) == s for u in p.users)]
    fed = [p for p in read if p.name in user_inputs]
    state = [p for p in read if p.name not in user_inputs]
    for value in (*inputs, *fed, *state):
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in mine:
        env[node] = graph.node_copy(node, lambda a: env[a])
    if outputs is None:
        result = next(n for n in gm.graph.nodes if n.op == "output")
        graph.output(torch.fx.map_arg(result.args[0], lambda a: env[a]))
        names = [a.name for a in result.all_input_nodes]
    else:
        graph.output(tuple(env[v] for v in outputs))
        names = [v.name for v in outputs]
    stage = torch.fx.GraphModule(gm, graph, class_name=f"Stage{s}")  # submodules and subgraphs: the program's own
    return StageProgram(index=s, gm=stage, inputs=[v.name for v in inputs], user_inputs=[p.name for p in fed],
                        state=[p.name for p in state], outputs=names)
