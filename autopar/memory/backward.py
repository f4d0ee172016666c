"""The backward working set in the plan's peak: the largest transient one op's backward holds
(``cost.backward``), priced once here for the ILP's row (``solver.backward_rows``), the plan's
predicted peak (``result.build``) and each pipeline rank's (``pipeline.stage_memory``).

The plan's peak holds every saved activation and every parameter's gradient. Backward runs one op
at a time, so it adds the largest op's working set, not all. With one micro-batch outside a
pipeline, a parameter's ``.grad`` does not exist yet while an op's backward runs if every reader of
the parameter is that op or comes before it in forward order (an optimizer's ``zero_grad`` leaves
none from the last step): the op's row is its working set less those gradients, and the peak adds
the largest row, if positive. The op's own parameters are among them: the gradient its backward
writes for one (counted in its working set) becomes that ``.grad`` (DDP: the same tensor, so the row
nets it out), or is reduced or cast into it after (FSDP's gathered gradient, a bf16 copy's: the row
keeps what it holds beyond the ``.grad`` to come). The loss's row: its logits-sized transients less
every gradient (none is made before it). With micro-batches (or a pipeline's), the first
micro-batch's backward made every gradient: no discount, and a later micro-batch's parameter
gradient is a transient added into ``.grad``.

One row per distinct op: folded instances share their representative's strategy, and the first
instance (forward order) has the fewest gradients not yet made, so its row stands for all.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autopar.cost.backward import gradient_bytes, working_set_bytes
from autopar.cost.model import CostContext
from autopar.problem.folding import Folding
from autopar.problem.nodes import OP, PARAM, PlanGraph
from autopar.rules.strategy import Strategy


@dataclass(frozen=True)
class TransientRow:
    """One distinct op's backward transient: ``held[s]`` - sum over ``absent`` of ``count * grad[s']``."""

    node: str
    """The representative op (its strategy column indices are ``held``'s)."""
    held: tuple[float, ...]
    """Per strategy: bytes its backward holds beyond what is saved (``cost.backward``)."""
    absent: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Representative parameter -> per strategy, the bytes of its instances' ``.grad`` not yet made
    while this op's backward runs (the model state counts them)."""

    def at(self, choice: Mapping[str, int]) -> float:
        """This row's bytes under ``choice`` (representative -> strategy index)."""
        return self.held[choice[self.node]] - sum(g[choice[p]] for p, g in self.absent.items())


def gradient_flags(graph: PlanGraph, name: str, consumers: Mapping[str, list[tuple[str, int, int]]]
                   ) -> tuple[list[bool], list[bool]] | None:
    """(which outputs of op ``name`` receive a gradient, which inputs it sends one), or None when its
    backward does not run. ``consumers``: ``graph.consumers()``."""
    node = graph.nodes[name]
    if node.kind != OP or node.call is None or not (node.needs_grad and node.differentiable):
        return None
    receives = [name == graph.loss] * len(node.outputs)
    for consumer, _, idx in consumers[name]:
        if idx < len(receives) and graph.sends_gradient(name, consumer):
            receives[idx] = True
    return receives, [graph.sends_gradient(src, name) for src, _ in node.args]


def working_set(graph: PlanGraph, name: str, strategy: Strategy, ctx: CostContext,
                flags: tuple[list[bool], list[bool]] | None) -> float:
    """Bytes op ``name``'s backward holds under ``strategy`` beyond what the plan counts; ``flags``:
    its ``gradient_flags``."""
    call = graph.nodes[name].call
    if flags is None or call is None:
        return 0.0
    return working_set_bytes(call, strategy, ctx, output_grads=flags[0], input_grads=flags[1])


def _gradients_made_before(graph: PlanGraph, folding: Folding,
                           consumers: Mapping[str, list[tuple[str, int, int]]]) -> tuple[list[int], list[str]]:
    """Each trainable parameter instance's last reading position in forward order (its ``.grad``
    exists once that reader's backward is done), sorted, beside its representative."""
    position = {n: i for i, n in enumerate(graph.order)}
    last: list[tuple[int, str]] = []
    for name in graph.order:
        if graph.nodes[name].kind != PARAM:
            continue
        readers = [position[c] for c, _, _ in consumers[name] if graph.sends_gradient(name, c)]
        if readers:
            last.append((max(readers), folding.representative[name]))
    last.sort()
    return [p for p, _ in last], [r for _, r in last]


def _gradient_bytes(graph: PlanGraph, param: str, ctx: CostContext) -> tuple[float, ...]:
    """Per strategy of ``param``, its ``.grad``'s bytes on one rank."""
    meta = graph.nodes[param].outputs[0]
    return tuple(0.0 if meta is None or s.outputs[0] is None else gradient_bytes(meta, s.outputs[0], ctx)
                 for s in graph.nodes[param].strategies)


def transient_rows(graph: PlanGraph, folding: Folding, ctx: CostContext) -> list[TransientRow]:
    """The rows the backward peak is the largest of (module docstring); a row that cannot be the
    largest under any choice, or exceed 0, is left out."""
    if not ctx.train:
        return []
    first: dict[str, int] = {}
    for i, name in enumerate(graph.order):
        first.setdefault(folding.representative[name], i)
    consumers = graph.consumers()
    discount = ctx.micro_batches == 1 and not ctx.pipelined
    positions, params = _gradients_made_before(graph, folding, consumers) if discount else ([], [])
    grads = {p: _gradient_bytes(graph, p, ctx) for p in dict.fromkeys(params)}
    rows = []
    for rep, at in first.items():
        flags = gradient_flags(graph, rep, consumers)
        held = tuple(working_set(graph, rep, s, ctx, flags) for s in graph.nodes[rep].strategies)
        if not any(b > 0 for b in held):
            continue
        counts: dict[str, int] = {}
        for p in params[:bisect.bisect_right(positions, at)]:  # read only by this op's first instance or before
            counts[p] = counts.get(p, 0) + 1
        rows.append(TransientRow(rep, held, {p: tuple(n * g for g in grads[p]) for p, n in counts.items()}))
    return _binding(rows)


def _binding(rows: list[TransientRow]) -> list[TransientRow]:
    """``rows`` without those that no choice makes larger than 0 and than the largest least row."""
    if not rows:
        return rows
    least = [min(r.held) - sum(max(g) for g in r.absent.values()) for r in rows]
    most = [max(r.held) - sum(min(g) for g in r.absent.values()) for r in rows]
    floor = max(0.0, max(least))
    surest = max(range(len(rows)), key=least.__getitem__)  # the row the peak is never below
    return [r for k, r in enumerate(rows) if most[k] > floor or (k == surest and floor > 0)]


def backward_peak(rows: Sequence[TransientRow], choice: Mapping[str, int]) -> float:
    """What backward's largest working set adds to the peak under ``choice`` (representative ->
    strategy index): the largest row, or nothing."""
    return max([0.0, *(r.at(choice) for r in rows)])


def op_working_sets(graph: PlanGraph, chosen: Mapping[str, Strategy], ctx: CostContext) -> dict[str, float]:
    """Per op with a backward, its working set under ``chosen`` (no discount: every micro-batch after the
    first finds its gradients made): what a pipeline stage's largest is taken from."""
    consumers = graph.consumers()
    out: dict[str, float] = {}
    seen: dict[tuple[int, int, tuple[bool, ...], tuple[bool, ...]], float] = {}
    for name in graph.order:
        flags = gradient_flags(graph, name, consumers)
        if flags is None:
            continue
        # the layers of a stack share their ops' strategy lists (one per distinct call): by identity,
        # an op's list and chosen strategy say what its working set reads besides the flags
        key = (id(graph.nodes[name].strategies), id(chosen[name]), tuple(flags[0]), tuple(flags[1]))
        if key not in seen:
            seen[key] = working_set(graph, name, chosen[name], ctx, flags)
        out[name] = seen[key]
    return out
